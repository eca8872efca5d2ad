//! `miles bridge` on the glm4moe-tiny fixture (and the other architectures'): `logprobs`
//! output against the transformers reference, `inspect`, `convert` (dtype, TP/EP), one-line
//! errors with exit 1 and usage mistakes with exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;

fn bin() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_miles"));
    command.arg("bridge");
    command
}

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny")
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("miles-bridge-cli-{name}-{}", std::process::id()))
}

#[test]
fn logprobs_match_reference() {
    let out_file = temp("lp.json");
    let out = bin()
        .args(["logprobs", "--model"])
        .arg(fixture())
        .arg("--input")
        .arg(fixture().join("reference_inputs.json"))
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference_summary.json")).unwrap(),
    )
    .unwrap();
    let got_lp: Vec<Vec<f64>> = serde_json::from_value(got["token_logprobs"].clone()).unwrap();
    let want_lp: Vec<Vec<f64>> = serde_json::from_value(want["token_logprobs"].clone()).unwrap();
    assert_eq!(got_lp.len(), 2);
    for (g, w) in got_lp.iter().zip(&want_lp) {
        assert_eq!(g.len(), 11);
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-4, "{a} vs {b}");
        }
    }
    for layer in ["layer1", "layer2"] {
        let got_r: Vec<Vec<i64>> =
            serde_json::from_value(got["routed_experts"][layer].clone()).unwrap();
        let want_r: Vec<Vec<Vec<i64>>> =
            serde_json::from_value(want["routed_experts_sorted"][layer].clone()).unwrap();
        let want_flat: Vec<Vec<i64>> = want_r.into_iter().flatten().collect();
        assert_eq!(got_r, want_flat, "{layer}");
    }
    assert!(got["routed_experts"].get("layer0").is_none());
    std::fs::remove_file(out_file).ok();
}

#[test]
fn inspect_and_convert() {
    let out = bin().arg("inspect").arg(fixture()).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let params: usize = st
        .iter()
        .map(|(_, v)| v.shape().iter().product::<usize>())
        .sum();
    assert!(
        text.contains("architecture: glm4_moe (Glm4MoeForCausalLM)"),
        "{text}"
    );
    assert!(text.contains(&format!("parameters: {params}")), "{text}");
    assert!(text.contains(&format!("tensors: {}", st.len())), "{text}");
    assert!(text.contains("dtype: f32"), "{text}");

    let dir = temp("convert");
    let out = bin()
        .args(["convert", "--model"])
        .arg(fixture())
        .arg("--out")
        .arg(&dir)
        .args(["--dtype", "bf16", "--tp", "2", "--ep", "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shard = std::fs::read(dir.join("tp01_ep01/model.safetensors")).unwrap();
    let shard = SafeTensors::deserialize(&shard).unwrap();
    let q = shard
        .tensor("model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.shape(), [32, 64]);
    assert_eq!(q.dtype(), safetensors::Dtype::BF16);
    assert!(
        shard
            .tensor("model.layers.1.mlp.experts.7.up_proj.weight")
            .is_ok()
    );
    assert!(
        shard
            .tensor("model.layers.1.mlp.experts.0.up_proj.weight")
            .is_err()
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_input_is_one_line_and_exit_1_usage_mistakes_exit_2() {
    for args in [
        vec!["inspect", "/nonexistent/model"],
        vec![
            "logprobs",
            "--model",
            "/nonexistent/model",
            "--input",
            "/nonexistent/in.json",
        ],
    ] {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("/nonexistent/"), "names the path: {err}");
    }
    let out = bin().arg("inspekt").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("'inspect'"), "did you mean: {err}");
}

/// A checkpoint folder of `fixtures/models`.
fn model(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

/// Runs `miles bridge logprobs` on `dir`'s `reference_inputs.json`; the JSON it wrote.
fn run_logprobs(dir: &Path, tag: &str) -> serde_json::Value {
    let out_file = temp(&format!("{tag}-lp.json"));
    let out = bin()
        .args(["logprobs", "--model"])
        .arg(dir)
        .arg("--input")
        .arg(dir.join("reference_inputs.json"))
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{tag}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    std::fs::remove_file(out_file).ok();
    got
}

/// The largest difference between the CLI's token log-probs and transformers' in `dir`'s
/// `reference_outputs.safetensors` (same count asserted).
fn max_logprob_diff(dir: &Path, got: &serde_json::Value, tag: &str) -> f32 {
    let got: Vec<Vec<f32>> = serde_json::from_value(got["token_logprobs"].clone()).unwrap();
    let got: Vec<f32> = got.into_iter().flatten().collect();
    let bytes = std::fs::read(dir.join("reference_outputs.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let want: Vec<f32> = st
        .tensor("token_logprobs")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(got.len(), want.len(), "{tag}");
    got.iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

/// `logprobs`, `inspect` and `convert` on the Qwen2 fixtures (tied + GQA, untied + MHA):
/// log-probs within 1e-4 of transformers', the q/k/v biases shown and split with their
/// projections under `--tp`.
#[test]
fn qwen2_logprobs_inspect_and_convert() {
    for (name, kv_heads) in [("qwen2-tiny", 2usize), ("qwen2-untied", 5)] {
        let dir = model(name);
        let diff = max_logprob_diff(&dir, &run_logprobs(&dir, name), name);
        assert!(diff <= 1e-4, "{name}: CLI log-probs differ by {diff}");

        let out = bin().arg("inspect").arg(&dir).output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("architecture: qwen2 (Qwen2ForCausalLM)"),
            "{text}"
        );
        assert!(text.contains("self_attn.q_proj.bias f32"), "{text}");
        assert_eq!(text.contains("lm_head.weight"), name == "qwen2-untied");

        // qwen2-tiny: 2 KV heads and intermediate 160 split over TP 2; qwen2-untied (5 heads,
        // intermediate 112) is converted whole to bf16.
        let target = temp(&format!("{name}-convert"));
        let tp = if name == "qwen2-tiny" { 2 } else { 1 };
        let out = bin()
            .args(["convert", "--model"])
            .arg(&dir)
            .arg("--out")
            .arg(&target)
            .args(["--tp", &tp.to_string(), "--dtype", "bf16"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let file = if tp == 1 {
            target.join("model.safetensors")
        } else {
            target.join("tp01_ep00/model.safetensors")
        };
        let shard = std::fs::read(file).unwrap();
        let shard = SafeTensors::deserialize(&shard).unwrap();
        let k_bias = shard
            .tensor("model.layers.0.self_attn.k_proj.bias")
            .unwrap();
        assert_eq!(k_bias.shape(), [kv_heads / tp * 16]);
        assert_eq!(k_bias.dtype(), safetensors::Dtype::BF16);
        // The bf16 values are the f32 bias of this rank's heads, rounded.
        let full = std::fs::read(dir.join("model.safetensors")).unwrap();
        let full = SafeTensors::deserialize(&full).unwrap();
        let full_bias: Vec<f32> = full
            .tensor("model.layers.0.self_attn.k_proj.bias")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let per = kv_heads / tp * 16;
        let rank = tp - 1;
        for (i, c) in k_bias.data().chunks_exact(2).enumerate() {
            let v = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            let want = full_bias[rank * per + i];
            assert!((v - want).abs() <= want.abs() / 128.0, "{name}: bias {i}");
        }
        assert_eq!(
            shard.tensor("lm_head.weight").is_ok(),
            name == "qwen2-untied"
        );
        std::fs::remove_dir_all(target).ok();
    }
}

/// A `config.json` without `model_type` (or with an unknown one) is refused, naming the
/// supported types, instead of loading as some default architecture.
#[test]
fn missing_or_unknown_model_type_is_refused() {
    let src = model("qwen2-tiny");
    let text = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (case, model_type) in [("none", None), ("unknown", Some("mistral"))] {
        let dir = temp(&format!("model-type-{case}"));
        std::fs::create_dir_all(&dir).unwrap();
        match model_type {
            None => config.as_object_mut().unwrap().remove("model_type"),
            Some(t) => config
                .as_object_mut()
                .unwrap()
                .insert("model_type".into(), t.into()),
        };
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let out = bin().arg("inspect").arg(&dir).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{case}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains("glm4_moe, qwen3, qwen3_moe, llama, qwen2"),
            "{case}: {err}"
        );
        std::fs::remove_dir_all(dir).ok();
    }
}

/// `logprobs --device wgpu-cpu` (burn's wgpu runtime on the CPU adapter) matches the same
/// transformers reference; an unknown device is a one-line error with exit 2. Needs a Vulkan
/// adapter (lavapipe in CI, where `MILES_REQUIRE_KERNEL_TESTS=1` makes its absence a failure).
#[test]
fn logprobs_on_wgpu_cpu_match_reference() {
    let out_file = temp("lp-wgpu.json");
    let out = bin()
        .args(["logprobs", "--device", "wgpu-cpu", "--model"])
        .arg(fixture())
        .arg("--input")
        .arg(fixture().join("reference_inputs.json"))
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("not available") {
        let required = std::env::var("MILES_REQUIRE_KERNEL_TESTS")
            .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes"));
        assert!(!required, "no wgpu adapter: {stderr}");
        eprintln!("!!! KERNEL TEST logprobs_on_wgpu_cpu NOT RUN: {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    let got: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("reference_summary.json")).unwrap(),
    )
    .unwrap();
    let got_lp: Vec<Vec<f64>> = serde_json::from_value(got["token_logprobs"].clone()).unwrap();
    let want_lp: Vec<Vec<f64>> = serde_json::from_value(want["token_logprobs"].clone()).unwrap();
    assert_eq!(got_lp.len(), want_lp.len());
    for (g, w) in got_lp.iter().zip(&want_lp) {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() <= 1e-4, "{a} vs {b}");
        }
    }
    let bad = bin()
        .args(["logprobs", "--device", "tpu", "--model"])
        .arg(fixture())
        .arg("--input")
        .arg(fixture().join("reference_inputs.json"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown device"));
}

/// `logprobs`, `inspect` and `convert` on the DeepSeek-V3 fixtures (MLA with and without
/// `q_lora_rank`): log-probs within 1e-4 of transformers' and routed experts equal to its
/// choices, the latent-attention shapes shown, and `kv_b_proj` split by heads under `--tp`
/// while `kv_a_proj_with_mqa` is replicated.
#[test]
fn deepseek_v3_logprobs_inspect_and_convert() {
    for (name, heads, nope_v) in [("dsv3-tiny", 4usize, 16 + 12), ("dsv3-noq", 3, 12 + 24)] {
        let dir = model(name);
        let got = run_logprobs(&dir, name);
        let diff = max_logprob_diff(&dir, &got, name);
        let bytes = std::fs::read(dir.join("reference_outputs.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert!(diff <= 1e-4, "{name}: CLI log-probs differ by {diff}");
        let routed: Vec<Vec<i64>> =
            serde_json::from_value(got["routed_experts"]["layer1"].clone()).unwrap();
        let want_routed: Vec<i64> = st
            .tensor("layer1.topk_indices_sorted")
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(routed.concat(), want_routed, "{name}");

        let out = bin().arg("inspect").arg(&dir).output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.contains("architecture: deepseek_v3 (DeepseekV3ForCausalLM)"),
            "{text}"
        );
        assert!(text.contains("latent attention: q_lora_rank"), "{text}");
        assert_eq!(
            text.contains("q_a_layernorm"),
            name == "dsv3-tiny",
            "{text}"
        );

        let target = temp(&format!("{name}-convert"));
        let out = bin()
            .args(["convert", "--model"])
            .arg(&dir)
            .arg("--out")
            .arg(&target)
            .args(["--tp", "1", "--ep", "2"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::remove_dir_all(&target).ok();
        if heads % 2 != 0 {
            continue;
        }
        let out = bin()
            .args(["convert", "--model"])
            .arg(&dir)
            .arg("--out")
            .arg(&target)
            .args(["--tp", "2"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let shard = std::fs::read(target.join("tp01_ep00/model.safetensors")).unwrap();
        let shard = SafeTensors::deserialize(&shard).unwrap();
        let kv_b = shard
            .tensor("model.layers.0.self_attn.kv_b_proj.weight")
            .unwrap();
        assert_eq!(kv_b.shape()[0], heads / 2 * nope_v);
        let kv_a = shard
            .tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
            .unwrap();
        assert_eq!(kv_a.shape(), [32 + 8, 64]);
        std::fs::remove_dir_all(target).ok();
    }
}

/// `logprobs` on the checkpoints of `fixtures/models/variants` (DeepSeek-V3 settings the
/// other fixtures lack, Kimi-K2's `model_type: "kimi_k2"`, Qwen2 with an unused sliding
/// window): log-probs within 1e-4 of transformers'.
#[test]
fn logprobs_on_unseen_shapes_match_reference() {
    for name in [
        "dsv3-moonlight",
        "dsv3-k0-noshared",
        "dsv3-legacy-yarn",
        "kimi-k2",
        "qwen2-window-off",
    ] {
        let dir = model(&format!("variants/{name}"));
        let diff = max_logprob_diff(&dir, &run_logprobs(&dir, name), name);
        assert!(diff <= 1e-4, "{name}: CLI log-probs differ by {diff}");
    }
}
