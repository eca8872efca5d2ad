//! The samples wire codec (Miles' samples codec): what `POST /sessions/{id}/samples` returns.
//!
//! One safetensors blob. For sample `k`, tensor fields are stored as `"<field>.<k>"` with pinned
//! dtypes (`tokens` I64, `loss_mask` U8, `rollout_log_probs` F64, `rollout_routed_experts` and
//! `rollout_indexer_topk` I32 `[rows, layers, top_k]`); everything else travels in `_samples_meta`,
//! a U8 rank-1 tensor holding compact UTF-8 JSON
//! `{"samples": [{response, response_length, status, weight_versions, prefix_cache_info,
//! metadata, nulls}], "session_metadata": {…}, "empty_reason": null | "no_records" | "all_truncated"}`.

use std::collections::BTreeSet;

use miles_core::python::{self, JsonDumpOptions};
use miles_core::{
    DType, NamedTensors, PrefixCacheInfo, RoutedExperts, Sample, SampleStatus, TensorBytes,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The key of the JSON metadata tensor.
pub const META_KEY: &str = "_samples_meta";

/// Why a session produced no sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmptyReason {
    /// The session has no committed turn.
    NoRecords,
    /// Truncation to `max_seq_len` dropped every turn.
    AllTruncated,
}

/// What the samples route carries: samples, the session's metadata, and why it is empty.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SamplesPayload {
    /// The assembled samples (one, merged, for a linear session).
    pub samples: Vec<Sample>,
    /// `accumulated_token_ids`, `max_trim_tokens`, `tito_session_mismatch`, …
    pub session_metadata: Map<String, Value>,
    /// Set when `samples` is empty.
    pub empty_reason: Option<EmptyReason>,
}

/// The tensor fields of the wire, in Miles' `SAMPLES_VALUE_SPEC` order (the order of `nulls`).
const TENSOR_FIELDS: [&str; 5] = [
    "tokens",
    "loss_mask",
    "rollout_log_probs",
    "rollout_routed_experts",
    "rollout_indexer_topk",
];

/// Miles' `PrefixCacheInfo.to_dict()`; `from_dict` reads missing keys as 0.
#[derive(Serialize, Deserialize, Default)]
#[serde(default)]
struct PrefixCacheWire {
    cached_tokens: u64,
    total_prompt_tokens: u64,
}

impl From<PrefixCacheInfo> for PrefixCacheWire {
    fn from(p: PrefixCacheInfo) -> Self {
        Self {
            cached_tokens: p.cached_tokens,
            total_prompt_tokens: p.total_prompt_tokens,
        }
    }
}

/// One sample's JSON entry, fields in Miles' order. `reward` is on the wire only in the v2
/// format ([`SamplesWire::V2`]); the v1 decoder ignores it, as Miles' does.
#[derive(Serialize, Deserialize)]
struct SampleMeta {
    response: String,
    response_length: usize,
    status: SampleStatus,
    weight_versions: Vec<String>,
    prefix_cache_info: PrefixCacheWire,
    metadata: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reward: Option<Value>,
    nulls: Vec<String>,
}

/// Which field allowlist crosses the samples wire (Miles' `COMPUTED_FIELDS` /
/// `COMPUTED_FIELDS_V2`): the tree server (v2) adds `Sample.reward` after `metadata`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SamplesWire {
    /// The linear server's fields (default).
    #[default]
    V1,
    /// The tree server's fields: V1's plus `reward` (a null reward keeps the input's on decode).
    V2,
}

#[derive(Serialize, Deserialize)]
struct PayloadMeta {
    samples: Vec<SampleMeta>,
    session_metadata: Map<String, Value>,
    empty_reason: Option<EmptyReason>,
}

fn codec_err(field: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Codec {
        field: field.into(),
        reason: reason.into(),
    }
}

fn tensor(dtype: DType, shape: Vec<usize>, data: Vec<u8>, name: &str) -> Result<TensorBytes> {
    TensorBytes::new(dtype, shape, data).map_err(|e| codec_err(name, e.to_string()))
}

fn table_tensor(table: &RoutedExperts, name: &str) -> Result<TensorBytes> {
    let data = table
        .as_slice()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    tensor(DType::I32, table.shape().to_vec(), data, name)
}

/// Encodes a payload as Miles does (Miles' samples codec), byte for byte: the safetensors layout
/// of `safetensors.numpy.save` ([`NamedTensors::to_safetensors_bytes`]) and the
/// `_samples_meta` JSON of Python's `json.dumps(meta, ensure_ascii=False,
/// separators=(",", ":"))` (key order kept; floats as Python's `repr`).
/// `fixtures/session/codec/` holds blobs written by Miles' own encoder that this function
/// reproduces exactly.
pub fn encode_samples(payload: &SamplesPayload) -> Result<Vec<u8>> {
    encode_samples_as(payload, SamplesWire::V1)
}

/// [`encode_samples`] with the field allowlist of `wire` (Miles' `encode_samples(…,
/// fields=COMPUTED_FIELDS_V2)` for [`SamplesWire::V2`], byte for byte:
/// `fixtures/session/tree_v2/`).
pub fn encode_samples_as(payload: &SamplesPayload, wire: SamplesWire) -> Result<Vec<u8>> {
    let mut tensors = NamedTensors::new();
    let mut metas = Vec::with_capacity(payload.samples.len());
    for (k, s) in payload.samples.iter().enumerate() {
        let mut nulls = Vec::new();
        let name = format!("tokens.{k}");
        let data = s
            .tokens
            .iter()
            .flat_map(|t| i64::from(*t).to_le_bytes())
            .collect();
        tensors.insert(
            name.clone(),
            tensor(DType::I64, vec![s.tokens.len()], data, &name)?,
        );
        match &s.loss_mask {
            Some(mask) => {
                let name = format!("loss_mask.{k}");
                tensors.insert(
                    name.clone(),
                    tensor(DType::U8, vec![mask.len()], mask.clone(), &name)?,
                );
            }
            None => nulls.push("loss_mask".to_owned()),
        }
        match &s.rollout_log_probs {
            Some(lp) => {
                let name = format!("rollout_log_probs.{k}");
                let data = lp.iter().flat_map(|v| v.to_le_bytes()).collect();
                tensors.insert(
                    name.clone(),
                    tensor(DType::F64, vec![lp.len()], data, &name)?,
                );
            }
            None => nulls.push("rollout_log_probs".to_owned()),
        }
        for (field, table) in [
            ("rollout_routed_experts", &s.rollout_routed_experts),
            ("rollout_indexer_topk", &s.rollout_indexer_topk),
        ] {
            match table {
                Some(t) => {
                    let name = format!("{field}.{k}");
                    tensors.insert(name.clone(), table_tensor(t, &name)?);
                }
                None => nulls.push(field.to_owned()),
            }
        }
        metas.push(SampleMeta {
            response: s.response.clone(),
            response_length: s.response_length,
            status: s.status,
            weight_versions: s.weight_versions.clone(),
            prefix_cache_info: s.prefix_cache_info.into(),
            metadata: s.metadata.clone(),
            reward: match wire {
                SamplesWire::V1 => None,
                SamplesWire::V2 => Some(
                    serde_json::to_value(&s.reward)
                        .map_err(|e| codec_err("reward", e.to_string()))?,
                ),
            },
            nulls,
        });
    }
    let meta = PayloadMeta {
        samples: metas,
        session_metadata: payload.session_metadata.clone(),
        empty_reason: payload.empty_reason,
    };
    // Python's compact `json.dumps(…, ensure_ascii=False, separators=(",", ":"))`: floats
    // as `float.__repr__` (`1e-05`), where serde_json writes `1e-5`.
    let json = python::json_dumps_to_vec(&meta, &JsonDumpOptions::compact())
        .map_err(|e| codec_err(META_KEY, e.to_string()))?;
    tensors.insert(
        META_KEY,
        tensor(DType::U8, vec![json.len()], json, META_KEY)?,
    );
    Ok(tensors.to_safetensors_bytes())
}

fn take(
    tensors: &NamedTensors,
    name: &str,
    dtype: DType,
    used: &mut BTreeSet<String>,
) -> Result<Option<TensorBytes>> {
    match tensors.get(name) {
        None => Ok(None),
        Some(t) if t.dtype() != dtype => Err(codec_err(
            name,
            format!("dtype {:?}, expected {dtype:?}", t.dtype()),
        )),
        Some(t) => {
            used.insert(name.to_owned());
            Ok(Some(t.clone()))
        }
    }
}

/// A tensor-list field (`tokens`, `loss_mask`, `rollout_log_probs`) must be rank 1.
fn rank_one(t: &TensorBytes, name: &str) -> Result<()> {
    if t.shape().len() == 1 {
        Ok(())
    } else {
        Err(codec_err(
            name,
            format!("shape {:?}, expected rank 1", t.shape()),
        ))
    }
}

fn table_from(t: &TensorBytes, name: &str) -> Result<RoutedExperts> {
    let [rows, layers, top_k] = t.shape() else {
        return Err(codec_err(
            name,
            format!("rank {}, expected 3", t.shape().len()),
        ));
    };
    let data = t
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    RoutedExperts::new(*rows, *layers, *top_k, data).map_err(|e| codec_err(name, e.to_string()))
}

/// The key Miles forbids in the input sample's metadata (`merge_samples` gives it per-token
/// semantics that only hold for per-turn values).
const OPD_STUDENT_TOP_LOGPROBS_KEY: &str = "opd_student_top_logprobs";

/// Miles' `assert_input_sample_defaults`.
fn check_input_defaults(input: &Sample) -> Result<()> {
    if !input.weight_versions.is_empty()
        || input.prefix_cache_info != PrefixCacheInfo::default()
        || input.spec_info != Default::default()
        || input.teacher_log_probs.is_some()
        || input.opd_reverse_kl.is_some()
        || input.metadata.contains_key(OPD_STUDENT_TOP_LOGPROBS_KEY)
    {
        return Err(codec_err(
            "input",
            "input sample must have default weight_versions, prefix_cache_info, spec_info, \
             no teacher log-probs / opd_reverse_kl and no metadata.opd_student_top_logprobs",
        ));
    }
    Ok(())
}

/// Decodes a payload as Miles' `decode_samples_and_merge_input_sample` does, overlaying each
/// encoded sample onto a copy of `input`: wire fields replace the input's, `metadata` is
/// merged key by key (keys the input had keep their position), a null-marked `tokens` becomes
/// empty. When there is at least one sample, `input` must have Miles' defaults (no
/// weight_versions, prefix-cache or speculative counters, teacher log-probs, `opd_reverse_kl` or
/// `metadata.opd_student_top_logprobs`).
///
/// Rejected with [`Error::Codec`], as by Miles: an invalid container; a missing
/// `_samples_meta`, or one that is not rank-1 U8 JSON; a tensor of the wrong dtype; a missing
/// promised tensor; null markers naming non-tensor fields; unreferenced tensors (a null-marked
/// field's tensor included). Rejected here but accepted by Miles (COMPATIBILITY.md): values
/// that do not fit [`Sample`] (token ids beyond u32, replay ids below −1), tensor-list fields
/// of rank ≠ 1, non-finite or out-of-range numbers in the JSON, and samples that break
/// [`Sample::validate`] (lengths, loss-mask values other than 0/1).
pub fn decode_samples(bytes: &[u8], input: &Sample) -> Result<SamplesPayload> {
    decode_samples_as(bytes, input, SamplesWire::V1)
}

/// [`decode_samples`] with the field allowlist of `wire`: with [`SamplesWire::V2`] a
/// non-null `reward` (a number or an object, else a codec error) replaces the input's, a null
/// or missing one keeps it (Miles' v2 decoder).
pub fn decode_samples_as(
    bytes: &[u8],
    input: &Sample,
    wire: SamplesWire,
) -> Result<SamplesPayload> {
    let tensors = NamedTensors::from_safetensors_bytes(bytes)
        .map_err(|e| codec_err("blob", e.to_string()))?;
    let mut used = BTreeSet::new();
    let meta_tensor = take(&tensors, META_KEY, DType::U8, &mut used)?
        .ok_or_else(|| codec_err(META_KEY, "missing"))?;
    rank_one(&meta_tensor, META_KEY)?;
    let meta: PayloadMeta = serde_json::from_slice(meta_tensor.data())
        .map_err(|e| codec_err(META_KEY, e.to_string()))?;
    if !meta.samples.is_empty() {
        check_input_defaults(input)?;
    }
    let mut samples = Vec::with_capacity(meta.samples.len());
    for (k, m) in meta.samples.into_iter().enumerate() {
        if let Some(bad) = m
            .nulls
            .iter()
            .find(|n| !TENSOR_FIELDS.contains(&n.as_str()))
        {
            return Err(codec_err(
                format!("sample {k}"),
                format!("null marker names non-tensor field {bad:?}"),
            ));
        }
        let is_null = |f: &str| m.nulls.iter().any(|n| n == f);
        // A null-marked field is null whatever the blob holds (a tensor for it is then
        // unreferenced, hence an error); otherwise its tensor must be there.
        let fetch = |field: &str, dtype: DType, used: &mut BTreeSet<String>| {
            if is_null(field) {
                return Ok(None);
            }
            let name = format!("{field}.{k}");
            take(&tensors, &name, dtype, used)?
                .map(|t| (name.clone(), t))
                .ok_or_else(|| codec_err(name, "missing"))
                .map(Some)
        };
        let mut s = input.clone();
        s.tokens = match fetch("tokens", DType::I64, &mut used)? {
            Some((name, t)) => {
                rank_one(&t, &name)?;
                t.data()
                    .chunks_exact(8)
                    .map(|b| {
                        let v = i64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                        u32::try_from(v)
                            .map_err(|_| codec_err(&name, format!("token id {v} out of range")))
                    })
                    .collect::<Result<_>>()?
            }
            None => Vec::new(),
        };
        s.loss_mask = match fetch("loss_mask", DType::U8, &mut used)? {
            Some((name, t)) => {
                rank_one(&t, &name)?;
                Some(t.data().to_vec())
            }
            None => None,
        };
        s.rollout_log_probs = match fetch("rollout_log_probs", DType::F64, &mut used)? {
            Some((name, t)) => {
                rank_one(&t, &name)?;
                Some(
                    t.data()
                        .chunks_exact(8)
                        .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                        .collect(),
                )
            }
            None => None,
        };
        s.rollout_routed_experts = fetch("rollout_routed_experts", DType::I32, &mut used)?
            .map(|(name, t)| table_from(&t, &name))
            .transpose()?;
        s.rollout_indexer_topk = fetch("rollout_indexer_topk", DType::I32, &mut used)?
            .map(|(name, t)| table_from(&t, &name))
            .transpose()?;
        s.response = m.response;
        s.response_length = m.response_length;
        s.status = m.status;
        s.weight_versions = m.weight_versions;
        s.prefix_cache_info = PrefixCacheInfo {
            cached_tokens: m.prefix_cache_info.cached_tokens,
            total_prompt_tokens: m.prefix_cache_info.total_prompt_tokens,
        };
        for (key, value) in m.metadata {
            s.metadata.insert(key, value);
        }
        if wire == SamplesWire::V2
            && let Some(reward) = m.reward.filter(|r| !r.is_null())
        {
            s.reward = Some(serde_json::from_value(reward).map_err(|e| {
                codec_err(
                    format!("sample {k}"),
                    format!("reward must be a number or an object: {e}"),
                )
            })?);
        }
        s.validate()
            .map_err(|e| codec_err(format!("sample {k}"), e.to_string()))?;
        samples.push(s);
    }
    let unreferenced: Vec<&str> = tensors
        .iter()
        .map(|(n, _)| n)
        .filter(|n| !used.contains(*n))
        .collect();
    if !unreferenced.is_empty() {
        return Err(codec_err(
            "blob",
            format!("unreferenced tensors {unreferenced:?}"),
        ));
    }
    Ok(SamplesPayload {
        samples,
        session_metadata: meta.session_metadata,
        empty_reason: meta.empty_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Sample {
        let mut s = Sample::builder(Default::default())
            .tokens(vec![1, 2, 3, 70000], 2)
            .loss_mask(vec![1, 0])
            .rollout_log_probs(vec![-0.5, -1.25])
            .routed_experts(RoutedExperts::new(3, 2, 2, (0..12).collect()).unwrap())
            .status(SampleStatus::Truncated)
            .weight_version(4)
            .metadata("k", json!([1, "x"]))
            .build()
            .unwrap();
        s.response = "ab".into();
        s.prefix_cache_info.cached_tokens = 2;
        s.prefix_cache_info.total_prompt_tokens = 3;
        s
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn valid_bytes() -> Vec<u8> {
            let payload = SamplesPayload {
                samples: vec![sample(), sample()],
                session_metadata: Map::new(),
                empty_reason: None,
            };
            encode_samples(&payload).unwrap()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Arbitrary bytes: an error or a payload, never a panic or a huge allocation.
            #[test]
            fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                let _ = decode_samples(&bytes, &Sample::default());
            }

            /// A valid payload with bytes overwritten, cut short or extended: every decode
            /// either fails with a codec error or yields samples that pass validation.
            #[test]
            fn mutated_payloads_are_errors_or_valid_samples(
                edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
                cut in any::<prop::sample::Index>(),
                mode in 0u8..3,
            ) {
                let mut bytes = valid_bytes();
                for (at, value) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = value;
                }
                match mode {
                    0 => bytes.truncate(cut.index(bytes.len())),
                    1 => bytes.extend(std::iter::repeat_n(0xffu8, cut.index(64))),
                    _ => {}
                }
                if let Ok(payload) = decode_samples(&bytes, &Sample::default()) {
                    for sample in &payload.samples {
                        prop_assert!(sample.validate().is_ok());
                    }
                }
            }

            /// A header length field rewritten to any value is an error, not an allocation.
            #[test]
            fn hostile_header_lengths_are_errors(length in any::<u64>()) {
                let mut bytes = valid_bytes();
                let real = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                prop_assume!(length != real);
                bytes[..8].copy_from_slice(&length.to_le_bytes());
                prop_assert!(decode_samples(&bytes, &Sample::default()).is_err());
            }
        }
    }

    #[test]
    fn round_trip_and_layout() {
        let mut meta = Map::new();
        meta.insert("max_trim_tokens".into(), json!(0));
        let payload = SamplesPayload {
            samples: vec![sample()],
            session_metadata: meta,
            empty_reason: None,
        };
        let bytes = encode_samples(&payload).unwrap();
        let tensors = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            vec![
                "_samples_meta",
                "loss_mask.0",
                "rollout_log_probs.0",
                "rollout_routed_experts.0",
                "tokens.0"
            ]
        );
        let tokens = tensors.get("tokens.0").unwrap();
        assert_eq!(tokens.dtype(), DType::I64);
        assert_eq!(&tokens.data()[24..32], &70000i64.to_le_bytes());
        assert_eq!(
            tensors.get("rollout_routed_experts.0").unwrap().shape(),
            &[3, 2, 2]
        );
        let meta: Value = serde_json::from_slice(tensors.get(META_KEY).unwrap().data()).unwrap();
        assert_eq!(meta["samples"][0]["status"], json!("truncated"));
        assert_eq!(meta["samples"][0]["nulls"], json!(["rollout_indexer_topk"]));
        assert_eq!(meta["empty_reason"], Value::Null);
        let back = decode_samples(&bytes, &Sample::default()).unwrap();
        assert_eq!(back, payload);
    }

    #[test]
    fn floats_are_formatted_as_python_repr() {
        // Expected strings: Python 3.11 `repr(x)` of each value.
        for (value, python) in [
            (1e-05, "1e-05"),
            (1e16, "1e+16"),
            (9999999999999998.0, "9999999999999998.0"),
            (0.0001, "0.0001"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (100.0, "100.0"),
            (123456789.0, "123456789.0"),
            (1.2345e-07, "1.2345e-07"),
            (0.1 + 0.2, "0.30000000000000004"),
            (-2.5e-10, "-2.5e-10"),
            (1e22, "1e+22"),
            (2f64.powi(63), "9.223372036854776e+18"),
        ] {
            assert_eq!(python::float_repr(value), python, "{value:e}");
        }
        let json = python::json_dumps_to_vec(
            &json!({"b": [1e-05, 1, -2, "é\u{1}"], "a": null}),
            &JsonDumpOptions::compact(),
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(json).unwrap(),
            r#"{"b":[1e-05,1,-2,"é\u0001"],"a":null}"#
        );
    }

    #[test]
    fn json_floats_parse_correctly_rounded() {
        // serde_json's default fast parser is off by one ulp on these (Python's values,
        // bits from `struct.pack('<d', x)`); the workspace enables `float_roundtrip`.
        for (text, bits) in [
            ("-3.81871992853141e+108", 0xd67a0413f8ea3bd0_u64),
            ("1.9164746950873022e+136", 0x5c3a5e04df081e4f),
        ] {
            let v: Value = serde_json::from_str(text).unwrap();
            assert_eq!(v.as_f64().unwrap().to_bits(), bits, "{text}");
        }
    }

    #[test]
    fn decoder_follows_miles_null_markers_and_meta_rank() {
        let mut s = sample();
        s.loss_mask = None;
        let payload = SamplesPayload {
            samples: vec![s],
            ..Default::default()
        };
        let bytes = encode_samples(&payload).unwrap();
        let tensors = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        let meta: Value = serde_json::from_slice(tensors.get(META_KEY).unwrap().data()).unwrap();
        let repack = |meta: &Value, extra: Option<(&str, TensorBytes)>| {
            let mut t = tensors.clone();
            let json = serde_json::to_vec(meta).unwrap();
            t.insert(
                META_KEY,
                TensorBytes::new(DType::U8, vec![json.len()], json).unwrap(),
            );
            if let Some((name, tensor)) = extra {
                t.insert(name, tensor);
            }
            t.to_safetensors_bytes()
        };
        // A null marker naming a JSON field is malformed.
        let mut bad = meta.clone();
        bad["samples"][0]["nulls"] = json!(["loss_mask", "rollout_indexer_topk", "response"]);
        let err = decode_samples(&repack(&bad, None), &Sample::default()).unwrap_err();
        assert!(err.to_string().contains("non-tensor"), "{err}");
        // A null-marked field whose tensor is present: the tensor is unreferenced.
        let extra = TensorBytes::new(DType::U8, vec![2], vec![1, 0]).unwrap();
        let err = decode_samples(
            &repack(&meta, Some(("loss_mask.0", extra))),
            &Sample::default(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("unreferenced"), "{err}");
        // Null tokens decode to an empty list (a 1-token sample without replay tables).
        let mut null_tokens = meta.clone();
        null_tokens["samples"][0]["nulls"] = json!([
            "tokens",
            "loss_mask",
            "rollout_log_probs",
            "rollout_routed_experts",
            "rollout_indexer_topk"
        ]);
        null_tokens["samples"][0]["response_length"] = json!(0);
        let mut t = NamedTensors::new();
        let json = serde_json::to_vec(&null_tokens).unwrap();
        t.insert(
            META_KEY,
            TensorBytes::new(DType::U8, vec![json.len()], json).unwrap(),
        );
        let decoded = decode_samples(&t.to_safetensors_bytes(), &Sample::default()).unwrap();
        assert!(decoded.samples[0].tokens.is_empty());
        // `_samples_meta` must be rank 1.
        let mut t = tensors.clone();
        let data = t.get(META_KEY).unwrap().data().to_vec();
        t.insert(
            META_KEY,
            TensorBytes::new(DType::U8, vec![1, data.len()], data).unwrap(),
        );
        let err = decode_samples(&t.to_safetensors_bytes(), &Sample::default()).unwrap_err();
        assert!(err.to_string().contains("rank 1"), "{err}");
    }

    #[test]
    fn decoder_rejects_extra_tensors_and_bad_input() {
        let payload = SamplesPayload {
            samples: vec![],
            session_metadata: Map::new(),
            empty_reason: Some(EmptyReason::NoRecords),
        };
        let bytes = encode_samples(&payload).unwrap();
        assert_eq!(decode_samples(&bytes, &Sample::default()).unwrap(), payload);
        let mut tensors = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        tensors.insert(
            "tokens.7",
            TensorBytes::new(DType::I64, vec![0], vec![]).unwrap(),
        );
        let err = decode_samples(&tensors.to_safetensors_bytes(), &Sample::default()).unwrap_err();
        assert!(err.to_string().contains("unreferenced"), "{err}");
        // As in Miles, the input-defaults guard only applies when there are samples.
        let mut used = Sample::default();
        used.weight_versions.push("1".into());
        assert_eq!(decode_samples(&bytes, &used).unwrap(), payload);
        let one = SamplesPayload {
            samples: vec![sample()],
            ..payload.clone()
        };
        let err = decode_samples(&encode_samples(&one).unwrap(), &used).unwrap_err();
        assert!(err.to_string().contains("input sample"), "{err}");
        assert!(decode_samples(b"garbage", &Sample::default()).is_err());
    }
}
