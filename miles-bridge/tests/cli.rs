//! The `miles-bridge` binary on the glm4moe-tiny fixture: `logprobs` output against the
//! transformers reference, `inspect`, `convert` (dtype, TP/EP) and one-line errors with exit 2.

use std::path::PathBuf;
use std::process::Command;

use safetensors::SafeTensors;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_miles-bridge"))
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
fn bad_input_is_one_line_and_exit_2() {
    for args in [
        vec!["inspect", "/nonexistent/model"],
        vec![
            "logprobs",
            "--model",
            "/nonexistent/model",
            "--input",
            "/nonexistent/in.json",
        ],
        vec!["frobnicate"],
    ] {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}
