//! The samples wire codec against Miles' own Python codec (Miles' samples codec), byte for byte.
//!
//! Fixtures (`fixtures/session/codec/`, made by `gen_codec_fixture.py` with Miles'
//! `encode_samples` / `decode_samples_and_merge_input_sample` at radixark/miles @ 31f1ca961a94):
//! `miles/<case>.safetensors` is Miles' blob and `miles/<case>.json` what Miles' decoder makes
//! of it, both with the case's decode input (`decoded`) and with a default `Sample()`
//! (`wire`, the values on the wire). `rust/` holds the blobs our encoder writes for the
//! round-trip cases and what Miles' decoder made of them.
//!
//! What is compared:
//! - (a) Miles' blob → [`decode_samples`] → exactly the values Miles' decoder recorded (every
//!   field, log-probs bit for bit, tables shape + data, metadata as JSON values).
//! - (b) [`encode_samples`] of those values → the **whole blob byte-identical** to Miles'
//!   (safetensors header order and padding, tensor data, the compact `_samples_meta` JSON
//!   with Python's key order, escapes and float formatting). Miles' encoder is deterministic:
//!   the generator asserts two encodes give the same bytes.
//! - (c) our blobs → Miles' decoder: offline through the committed `rust/` fixture (our current
//!   output must equal the committed blob, and Miles' view of it must equal its view of its own
//!   blob); live when a Python with numpy + safetensors and a Miles source (`MILES_SRC`) are
//!   at hand, else a loud NOT RUN line.
//! - the `differs_*` cases pin each documented difference (COMPATIBILITY.md).
//!
//! `MILES_CODEC_BLESS=1` rewrites `rust/*.safetensors` from our encoder (then run the
//! generator's `decode` mode to refresh `rust/*.json`).

use std::path::{Path, PathBuf};
use std::process::Command;

use miles_core::{PrefixCacheInfo, Prompt, Reward, RoutedExperts, Sample, SampleStatus};
use miles_session::Error;
use miles_session::codec::{EmptyReason, SamplesPayload, decode_samples, encode_samples};
use serde_json::{Map, Value};

/// Cases our encoder writes and must reproduce byte for byte.
const ROUND_TRIP: &[&str] = &[
    "single_completed",
    "statuses_and_nulls",
    "awkward_floats",
    "unicode",
    "replay_tables",
    "metadata_order",
    "empty_no_records",
    "empty_all_truncated",
    "empty_null_reason",
    "float_repr_sweep",
];

/// Cases our encoder never writes (null tokens, the v2 `reward` key) but must decode as Miles.
const DECODE_ONLY: &[&str] = &["decode_only_tokens_null", "decode_only_v2_reward"];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/session/codec")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn view(case: &str) -> Value {
    read_json(&dir().join(format!("miles/{case}.json")))
}

fn blob(case: &str) -> Vec<u8> {
    let path = dir().join(format!("miles/{case}.safetensors"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn table(v: &Value) -> Option<RoutedExperts> {
    if v.is_null() {
        return None;
    }
    let shape: Vec<usize> = serde_json::from_value(v["shape"].clone()).unwrap();
    let data: Vec<i32> = serde_json::from_value(v["data"].clone()).unwrap();
    Some(RoutedExperts::new(shape[0], shape[1], shape[2], data).unwrap())
}

/// A `Sample` with the fields of a decode input or a sample view set (others default).
fn sample_from(v: &Value) -> Sample {
    let mut s = Sample::default();
    let obj = v.as_object().unwrap();
    for (key, value) in obj {
        match key.as_str() {
            "group_index" => s.group_index = serde_json::from_value(value.clone()).unwrap(),
            "index" => s.index = serde_json::from_value(value.clone()).unwrap(),
            "prompt" => s.prompt = serde_json::from_value::<Prompt>(value.clone()).unwrap(),
            "label" => s.label = serde_json::from_value(value.clone()).unwrap(),
            "reward" => s.reward = serde_json::from_value::<Option<Reward>>(value.clone()).unwrap(),
            "tokens" => s.tokens = serde_json::from_value(value.clone()).unwrap(),
            "response" => s.response = value.as_str().unwrap().to_owned(),
            "response_length" => s.response_length = value.as_u64().unwrap() as usize,
            "loss_mask" => s.loss_mask = serde_json::from_value(value.clone()).unwrap(),
            "rollout_log_probs_bits" => {
                s.rollout_log_probs = value.as_array().map(|bits| {
                    bits.iter()
                        .map(|b| {
                            f64::from_bits(u64::from_str_radix(b.as_str().unwrap(), 16).unwrap())
                        })
                        .collect()
                })
            }
            "rollout_routed_experts" => s.rollout_routed_experts = table(value),
            "rollout_indexer_topk" => s.rollout_indexer_topk = table(value),
            "status" => s.status = serde_json::from_value::<SampleStatus>(value.clone()).unwrap(),
            "weight_versions" => s.weight_versions = serde_json::from_value(value.clone()).unwrap(),
            "prefix_cache_info" => {
                s.prefix_cache_info =
                    serde_json::from_value::<PrefixCacheInfo>(value.clone()).unwrap()
            }
            "metadata" => s.metadata = value.as_object().unwrap().clone(),
            other => panic!("unknown sample field {other}"),
        }
    }
    s
}

fn payload_from(section: &Value) -> SamplesPayload {
    assert!(section.get("error").is_none(), "Miles failed: {section}");
    SamplesPayload {
        samples: section["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(sample_from)
            .collect(),
        session_metadata: section["session_metadata"].as_object().unwrap().clone(),
        empty_reason: serde_json::from_value::<Option<EmptyReason>>(
            section["empty_reason"].clone(),
        )
        .unwrap(),
    }
}

/// Payloads compared field by field, log-probs by bits (NaN ≠ NaN under `==`).
fn assert_payload_eq(case: &str, got: &SamplesPayload, want: &SamplesPayload) {
    assert_eq!(
        got.samples.len(),
        want.samples.len(),
        "{case}: sample count"
    );
    for (k, (g, w)) in got.samples.iter().zip(&want.samples).enumerate() {
        let bits = |s: &Sample| {
            s.rollout_log_probs
                .as_ref()
                .map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        assert_eq!(
            bits(g),
            bits(w),
            "{case}: sample {k} rollout_log_probs bits"
        );
        let strip = |s: &Sample| Sample {
            rollout_log_probs: None,
            ..s.clone()
        };
        assert_eq!(strip(g), strip(w), "{case}: sample {k}");
        // Key order matters on the wire: Python dicts keep insertion order.
        let keys = |m: &Map<String, Value>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            keys(&g.metadata),
            keys(&w.metadata),
            "{case}: sample {k} metadata order"
        );
    }
    assert_eq!(
        got.session_metadata, want.session_metadata,
        "{case}: session_metadata"
    );
    assert_eq!(got.empty_reason, want.empty_reason, "{case}: empty_reason");
}

/// The safetensors header of a blob, for readable failure messages.
fn header(bytes: &[u8]) -> String {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    String::from_utf8_lossy(&bytes[8..8 + n.min(bytes.len() - 8)]).into_owned()
}

fn meta_json(bytes: &[u8]) -> String {
    let tensors = miles_core::NamedTensors::from_safetensors_bytes(bytes).unwrap();
    String::from_utf8_lossy(tensors.get("_samples_meta").unwrap().data()).into_owned()
}

fn assert_same_bytes(case: &str, got: &[u8], want: &[u8]) {
    if got != want {
        assert_eq!(
            header(got),
            header(want),
            "{case}: safetensors header differs"
        );
        assert_eq!(
            meta_json(got),
            meta_json(want),
            "{case}: _samples_meta differs"
        );
        panic!(
            "{case}: blobs differ ({} vs {} bytes)",
            got.len(),
            want.len()
        );
    }
}

#[test]
fn miles_blobs_decode_to_what_miles_decoded() {
    for case in ROUND_TRIP.iter().chain(DECODE_ONLY) {
        let v = view(case);
        let bytes = blob(case);
        let input = sample_from(&v["decode_input"]);
        let got = decode_samples(&bytes, &input).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_payload_eq(case, &got, &payload_from(&v["decoded"]));
        let got = decode_samples(&bytes, &Sample::default()).unwrap();
        assert_payload_eq(case, &got, &payload_from(&v["wire"]));
    }
}

#[test]
fn our_encoder_writes_miles_bytes() {
    for case in ROUND_TRIP {
        let v = view(case);
        let ours = encode_samples(&payload_from(&v["wire"])).unwrap();
        assert_same_bytes(case, &ours, &blob(case));
    }
}

#[test]
fn metadata_overlay_keeps_input_key_positions() {
    // Independent of the fixture values: Python's dict.update keeps the positions of keys
    // the input sample already had and appends new ones.
    let v = view("metadata_order");
    let decoded =
        decode_samples(&blob("metadata_order"), &sample_from(&v["decode_input"])).unwrap();
    let keys: Vec<&str> = decoded.samples[0]
        .metadata
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "alpha", "keep", "zeta", "Mid", "i64_max", "i64_min", "u64_max", "zero", "neg"
        ]
    );
}

#[test]
fn committed_rust_blobs_are_what_we_write_and_miles_reads_them_alike() {
    let bless = std::env::var_os("MILES_CODEC_BLESS").is_some();
    for case in ROUND_TRIP {
        let v = view(case);
        let ours = encode_samples(&payload_from(&v["wire"])).unwrap();
        let path = dir().join(format!("rust/{case}.safetensors"));
        if bless {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &ours).unwrap();
            continue;
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_same_bytes(case, &ours, &committed);
        let rust_view = read_json(&dir().join(format!("rust/{case}.json")));
        assert_eq!(
            rust_view["decoded"], v["decoded"],
            "{case}: Miles decodes our blob differently"
        );
        assert_eq!(
            rust_view["wire"], v["wire"],
            "{case}: Miles decodes our blob differently"
        );
    }
}

fn codec_error(case: &str) -> String {
    let v = view(case);
    match decode_samples(&blob(case), &sample_from(&v["decode_input"])) {
        Err(e @ Error::Codec { .. }) => e.to_string(),
        other => panic!("{case}: expected a codec error, got {other:?}"),
    }
}

#[test]
fn documented_differences_hold() {
    // Miles decodes each of these (its view has no error)…
    for case in [
        "differs_nonfinite_metadata",
        "differs_token_beyond_u32",
        "differs_loss_mask_2",
        "differs_length_mismatch",
        "differs_replay_id_below_minus_one",
        "differs_huge_int_metadata",
    ] {
        assert!(view(case)["decoded"].get("error").is_none(), "{case}");
    }
    assert_eq!(
        view("differs_nonfinite_metadata")["decoded"]["samples"][0]["metadata"]["nan"],
        serde_json::json!({"$nonfinite": "nan"})
    );
    // …we reject the first four with a typed error.
    assert!(codec_error("differs_nonfinite_metadata").contains("_samples_meta"));
    assert!(codec_error("differs_token_beyond_u32").contains("4294967296"));
    assert!(codec_error("differs_loss_mask_2").contains("loss_mask"));
    assert!(codec_error("differs_length_mismatch").contains("loss_mask"));
    assert!(codec_error("differs_replay_id_below_minus_one").contains("-2147483648"));
    // Integers beyond i64/u64 become the nearest f64 (serde_json without arbitrary precision),
    // so they re-encode in float notation.
    let decoded = decode_samples(&blob("differs_huge_int_metadata"), &Sample::default()).unwrap();
    let big = &decoded.samples[0].metadata["big"];
    assert_eq!(big.as_f64(), Some(2f64.powi(70)));
    assert!(big.as_u64().is_none());
    let ours = encode_samples(&decoded).unwrap();
    assert!(meta_json(&ours).contains("\"big\":1.1805916207174113e+21"));
    assert_ne!(ours, blob("differs_huge_int_metadata"));
}

// ---------------------------------------------------------------- live: Miles' decoder

/// The first Python (`MILES_TORCH_PYTHON`, then `<workspace>/.venv-ref/bin/python`) that
/// imports numpy and safetensors.
fn python() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    std::env::var_os("MILES_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv])
        .find(|python| {
            Command::new(python)
                .args(["-c", "import numpy, safetensors.numpy"])
                .output()
                .is_ok_and(|out| out.status.success())
        })
}

#[test]
fn miles_decoder_reads_our_blobs_live() {
    const TEST: &str = "miles_decoder_reads_our_blobs_live";
    let miles = std::env::var_os("MILES_SRC").map(PathBuf::from);
    let python = python();
    let (Some(miles), Some(python)) = (miles.clone(), python) else {
        let msg = format!(
            "needs a Miles source (MILES_SRC={miles:?}: a radixark/miles checkout or git dir) and a \
             Python with numpy + safetensors (MILES_TORCH_PYTHON or .venv-ref); the committed \
             fixture check `committed_rust_blobs_are_what_we_write_and_miles_reads_them_alike` \
             covers the same ground offline"
        );
        if miles.is_some() {
            // Asked for explicitly: a missing Python is a failure, not a skip.
            panic!("{TEST}: {msg}");
        }
        eprintln!("\n######## NOT RUN: {TEST}: {msg} ########\n");
        return;
    };
    let tmp = std::env::temp_dir().join(format!("miles-codec-interop-{}", std::process::id()));
    let blobs = tmp.join("blobs");
    let out = tmp.join("views");
    std::fs::create_dir_all(&blobs).unwrap();
    for case in ROUND_TRIP {
        let ours = encode_samples(&payload_from(&view(case)["wire"])).unwrap();
        std::fs::write(blobs.join(format!("{case}.safetensors")), ours).unwrap();
    }
    let status = Command::new(&python)
        .arg(dir().join("gen_codec_fixture.py"))
        .arg("--miles")
        .arg(&miles)
        .arg("decode")
        .arg("--blobs")
        .arg(&blobs)
        .arg("--views")
        .arg(dir().join("miles"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "Miles' decoder failed: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    for case in ROUND_TRIP {
        let v = view(case);
        let live = read_json(&out.join(format!("{case}.json")));
        assert_eq!(
            live["decoded"], v["decoded"],
            "{case}: Miles decodes our blob differently"
        );
        assert_eq!(
            live["wire"], v["wire"],
            "{case}: Miles decodes our blob differently"
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
