//! LoRA on the HF-layout layers: PEFT adapters (saved by PEFT 0.21.2 on the tiny fixtures,
//! see `fixtures/lora/SOURCES.md`; Qwen3.5 dense / MoE / text-only, GLM-4.7-Flash and GPT-OSS,
//! its fused experts through `target_parameters` included, among them) give PEFT's log-probs
//! and gradients and export under PEFT's names; a fresh adapter
//! (B = 0) leaves the forward bit-identical; the LoRA forward equals the forward of the merged
//! HF weights; PEFT export round-trips; only adapters receive gradients.

use std::path::PathBuf;

use burn::tensor::{Device, Tensor};
use miles_bridge::lora::{LoraConfig, LoraForward, PEFT_PREFIX};
use miles_bridge::{BridgeError, CausalLm, ModelInput, ids_tensor, token_logprobs};
use miles_core::{DType, NamedTensors, TensorBytes};
use miles_r3::Fallthrough;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// The model fixture a LoRA fixture was made on (`fixtures/lora/SOURCES.md`).
fn model_of(name: &str) -> &str {
    match name {
        "gptoss-experts" | "gptoss-gate-up" => "gptoss-tiny",
        other => other,
    }
}

fn base(name: &str, device: &Device) -> CausalLm {
    CausalLm::from_pretrained(root().join("models").join(model_of(name)), device).unwrap()
}

fn inputs(name: &str) -> Vec<Vec<u32>> {
    let path = root().join("lora").join(name).join("reference_inputs.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::from_value(v["input_ids"].clone()).unwrap()
}

fn reference(name: &str) -> NamedTensors {
    NamedTensors::from_safetensors_file(
        &root()
            .join("lora")
            .join(name)
            .join("reference_outputs.safetensors"),
    )
    .unwrap()
}

fn logits(model: &CausalLm, rows: &[Vec<u32>]) -> Vec<f32> {
    let device = model.lm_head_weight().device();
    let ids = ids_tensor(rows, &device).unwrap();
    let out = model.forward(&ModelInput::new(ids), &Fallthrough).unwrap();
    out.logits.into_data().try_to_vec::<f32>().unwrap()
}

fn logprobs(model: &CausalLm, rows: &[Vec<u32>]) -> Tensor<2> {
    let device = model.lm_head_weight().device();
    let ids = ids_tensor(rows, &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    token_logprobs(out.logits, ids)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `model`'s adapters with every `lora_B` replaced by deterministic non-zero values, as PEFT
/// tensors (so adapters actually change the output).
fn perturbed_adapters(model: &CausalLm) -> NamedTensors {
    let mut tensors = model.lora_to_peft_tensors(DType::F32).unwrap();
    for (i, (name, t)) in tensors.iter_mut().enumerate() {
        if name.contains("lora_B") {
            let n = t.numel();
            let values: Vec<f32> = (0..n)
                .map(|j| (((j * 7919 + i * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.2)
                .collect();
            *t = TensorBytes::from_f32(t.shape().to_vec(), &values).unwrap();
        }
    }
    tensors
}

/// `name`'s PEFT adapter (`fixtures/lora/<name>`), loaded in both forward formulations, gives
/// PEFT's log-probs (adapters active and merged) and adapter gradients; base weights get none.
fn check_against_peft(name: &str) {
    let device = Device::flex().autodiff();
    let rows = inputs(name);
    let want = reference(name);
    for mode in [LoraForward::Merged, LoraForward::Factored] {
        let model = base(name, &device)
            .load_lora_adapter(root().join("lora").join(name), mode)
            .unwrap();
        let config = model.lora_config().unwrap();
        assert_eq!(
            (config.r, config.lora_alpha, config.scaling()),
            (4, 8.0, 2.0)
        );
        let lp = logprobs(&model, &rows);
        let got = lp.clone().into_data().try_to_vec::<f32>().unwrap();
        let d = max_diff(&got, &want["token_logprobs"].to_f32().unwrap());
        assert!(
            d <= 1e-4,
            "{name} {mode:?}: log-probs differ from PEFT by {d}"
        );
        eprintln!("{name} {mode:?}: max |log-prob - PEFT| = {d:.2e}");
        // The adapters matter: PEFT's log-probs are far from the base model's.
        let plain = logprobs(&base(name, &device), &rows)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert!(max_diff(&plain, &want["token_logprobs"].to_f32().unwrap()) > 1e-2);

        let grads = lp.mean().neg().backward();
        let mut seen = 0;
        let mut worst = 0.0f32;
        model.visit_lora_params(&mut |pname, p| {
            let g = p.grad(&grads).expect("adapter without gradient");
            let g = g.convert::<f32>().try_to_vec::<f32>().unwrap();
            let w = reference_grad(&want, &model.peft_tensor_name(pname));
            let bound = 1e-4 * w.iter().fold(1.0f32, |m, v| m.max(v.abs()));
            let d = max_diff(&g, &w);
            assert!(
                d <= bound,
                "{name} {mode:?}: grad of {pname} differs by {d}"
            );
            worst = worst.max(d / bound);
            seen += 1;
        });
        let expected = want.keys().filter(|k| k.starts_with("grad.")).count();
        assert_eq!(
            seen, expected,
            "{name}: every PEFT adapter tensor has a gradient"
        );
        eprintln!("{name} {mode:?}: worst adapter-gradient diff / bound = {worst:.3}");
        // Base weights are frozen: no gradient.
        model.visit_params(&mut |pname, p| {
            assert!(
                p.grad(&grads).is_none(),
                "{name}: base {pname} got a gradient"
            );
        });

        // The merged export (engine weights) gives PEFT's merge_and_unload log-probs.
        let merged = CausalLm::from_hf_tensors(
            &model.config,
            model.to_hf_tensors_merged(DType::F32).unwrap(),
            &Device::flex(),
        )
        .unwrap();
        let got = logprobs(&merged, &rows)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let d = max_diff(&got, &want["merged_token_logprobs"].to_f32().unwrap());
        assert!(
            d <= 1e-4,
            "{name}: merged log-probs differ from PEFT by {d}"
        );
    }
}

/// The reference gradient of our adapter tensor whose PEFT key is `key`
/// (`CausalLm::peft_tensor_name`), where a vision-language checkpoint's text modules are
/// `model.language_model.*` when the fixture's adapter was saved on the checkpoint's own class
/// (`qwen35-tiny`).
fn reference_grad(want: &NamedTensors, key: &str) -> Vec<f32> {
    let name = key.strip_prefix(PEFT_PREFIX).unwrap();
    let plain = format!("grad.{key}");
    let wrapped = format!(
        "grad.{PEFT_PREFIX}{}",
        name.replacen("model.", "model.language_model.", 1)
    );
    let t = want
        .get(&plain)
        .or_else(|| want.get(&wrapped))
        .unwrap_or_else(|| panic!("no PEFT gradient for {name}"));
    t.to_f32().unwrap()
}

/// PEFT's adapters on Qwen3 / Qwen2 (all seven projections), GLM-4-MoE (attention) and
/// DeepSeek-V3 (the latent-attention projections, with and without `q_lora_rank`).
#[test]
fn peft_adapters_reproduce_peft_logprobs_and_gradients() {
    for name in [
        "qwen3-tiny",
        "glm4moe-tiny",
        "qwen2-tiny",
        "dsv3-tiny",
        "dsv3-noq",
    ] {
        check_against_peft(name);
    }
}

/// The fixtures of the models of issue 43: Qwen3.5 (Gated DeltaNet `in_proj_qkv` / `in_proj_z`
/// / `in_proj_b` / `in_proj_a` / `out_proj`, the gated full attention's q/k/v/o, the MLPs; the
/// release's vision-language layout, adapter saved on `Qwen3_5ForConditionalGeneration`),
/// Qwen3.5-MoE (the same plus the shared expert and its gate; adapter saved on the text-only
/// `Qwen3_5MoeForCausalLM`), Qwen3.5 text-only with `all-linear`, GLM-4.7-Flash (the
/// latent-attention projections) and GPT-OSS (attention with biases; its fused experts
/// through PEFT's `target_parameters`: `gate_up_proj` and `down_proj` with the attention,
/// nested wrappers, and `gate_up_proj` alone).
const NEW_MODELS: [&str; 7] = [
    "qwen35-tiny",
    "qwen35moe-tiny",
    "qwen35-text",
    "glm47flash-tiny",
    "gptoss-tiny",
    "gptoss-experts",
    "gptoss-gate-up",
];

/// PEFT's adapters on the projections of Qwen3.5 (dense and MoE), GLM-4.7-Flash and GPT-OSS
/// (attention and the fused experts).
#[test]
fn peft_adapters_on_qwen35_glm47_flash_and_gpt_oss_match_peft() {
    for name in NEW_MODELS {
        check_against_peft(name);
    }
}

/// Our PEFT export of those adapters carries exactly PEFT's tensors (names and values) and
/// targets: a vision-language checkpoint's text modules under
/// `base_model.model.model.language_model.*`, the names PEFT gives them on the checkpoint's
/// own class (an adapter PEFT saved on the text-only class, `qwen35moe-tiny`, loads too and is
/// written back under those names).
#[test]
fn peft_export_of_the_new_models_has_peft_names() {
    let device = Device::flex();
    for name in NEW_MODELS {
        let dir = root().join("lora").join(name);
        let file =
            NamedTensors::from_safetensors_file(&dir.join("adapter_model.safetensors")).unwrap();
        let model = base(name, &device)
            .load_lora_adapter(&dir, LoraForward::Merged)
            .unwrap();
        let multimodal = model.config.multimodal.is_some();
        let text = format!("{PEFT_PREFIX}model.");
        let wrapped = format!("{PEFT_PREFIX}model.language_model.");
        let expected: Vec<(String, Vec<f32>)> = file
            .iter()
            .map(|(k, t)| {
                let k = match k.strip_prefix(&text) {
                    Some(rest) if multimodal && !k.starts_with(&wrapped) => {
                        format!("{wrapped}{rest}")
                    }
                    _ => k.to_string(),
                };
                (k, t.to_f32().unwrap())
            })
            .collect();
        let ours = model.lora_to_peft_tensors(DType::F32).unwrap();
        let mut expected = expected;
        expected.sort_by(|a, b| a.0.cmp(&b.0));
        let got: Vec<(String, Vec<f32>)> = ours
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_f32().unwrap()))
            .collect();
        assert_eq!(
            got.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            expected.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            "{name}: adapter tensor names"
        );
        assert_eq!(
            got, expected,
            "{name}: adapter values round-trip bit for bit"
        );
        if multimodal {
            assert!(ours.keys().all(|k| k.starts_with(&wrapped)), "{name}");
        }
        // adapter_config.json: PEFT's target set.
        let peft: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let sorted = |v: &serde_json::Value| {
            let mut t: Vec<String> = serde_json::from_value(v.clone()).unwrap();
            t.sort();
            t
        };
        let json = model.peft_adapter_config().unwrap();
        assert_eq!(
            sorted(&json["target_modules"]),
            sorted(&peft["target_modules"]),
            "{name}"
        );
        let parameters = |v: &serde_json::Value| {
            if v.is_null() { Vec::new() } else { sorted(v) }
        };
        assert_eq!(
            parameters(&json["target_parameters"]),
            parameters(&peft["target_parameters"]),
            "{name}"
        );
        assert_eq!(json["r"].as_u64(), peft["r"].as_u64(), "{name}");
        assert_eq!(
            json["lora_alpha"].as_f64(),
            peft["lora_alpha"].as_f64(),
            "{name}"
        );
    }
}

/// GPT-OSS's fused experts as a Miles user reaches them: `--target-modules
/// gate_proj,up_proj,down_proj` (Miles' `run-gpt-oss-20B-megatron-moe-lora.sh`; Megatron's
/// `linear_fc1` / `linear_fc2`) adapts `gate_up_proj` and `down_proj` of every layer and no
/// attention, `gate_proj` alone the whole fused `gate_up_proj`, `all-linear` the attention
/// and the experts; a fresh adapter leaves the logits bit-identical; the PEFT export has
/// PEFT's own tensor names (those of the `gptoss-experts` fixture) and an
/// `adapter_config.json` PEFT reads the same way (`target_modules` empty,
/// `target_parameters`); a `target_parameters` entry that reaches nothing is a typed error.
#[test]
fn gpt_oss_experts_take_adapters_from_miles_target_modules() {
    let device = Device::flex();
    let rows = inputs("gptoss-experts");
    let want = logits(&base("gptoss-tiny", &device), &rows);
    let miles = base("gptoss-tiny", &device)
        .with_lora(&LoraConfig::new(
            4,
            8.0,
            &["gate_proj", "up_proj", "down_proj"],
        ))
        .unwrap();
    let experts: Vec<String> = (0..3)
        .flat_map(|l| {
            ["gate_up_proj", "down_proj"].map(|p| format!("model.layers.{l}.mlp.experts.{p}"))
        })
        .collect();
    assert_eq!(miles.lora_modules(), experts);
    assert_eq!(miles.lora_parameters(), experts);
    assert_eq!(logits(&miles, &rows), want, "B = 0 must not change logits");
    // PEFT's names and shapes: those of the fixture PEFT saved, less its attention adapters.
    let peft = NamedTensors::from_safetensors_file(
        &root()
            .join("lora/gptoss-experts")
            .join("adapter_model.safetensors"),
    )
    .unwrap();
    let expected: Vec<(String, Vec<usize>)> = peft
        .iter()
        .filter(|(k, _)| k.contains(".mlp.experts."))
        .map(|(k, t)| (k.to_string(), t.shape().to_vec()))
        .collect();
    let ours = miles.lora_to_peft_tensors(DType::F32).unwrap();
    let got: Vec<(String, Vec<usize>)> = ours
        .iter()
        .map(|(k, t)| (k.to_string(), t.shape().to_vec()))
        .collect();
    assert_eq!(got, expected);
    let json = miles.peft_adapter_config().unwrap();
    assert_eq!(json["target_modules"], serde_json::json!([]));
    assert_eq!(
        json["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    // Read back from that config: the same adapters.
    let config = LoraConfig::from_peft_json(&json).unwrap();
    let back = base("gptoss-tiny", &device)
        .with_lora_tensors(&config, perturbed_adapters(&miles))
        .unwrap();
    assert_eq!(back.lora_parameters(), experts);
    assert!(
        max_diff(&logits(&back, &rows), &want) > 1e-3,
        "adapters must matter"
    );

    let megatron = base("gptoss-tiny", &device)
        .with_lora(&LoraConfig::new(4, 8.0, &["linear_fc1"]))
        .unwrap();
    let gate_up: Vec<String> = (0..3)
        .map(|l| format!("model.layers.{l}.mlp.experts.gate_up_proj"))
        .collect();
    assert_eq!(megatron.lora_parameters(), gate_up);
    let gate = base("gptoss-tiny", &device)
        .with_lora(&LoraConfig::new(4, 8.0, &["gate_proj"]))
        .unwrap();
    assert_eq!(gate.lora_parameters(), gate_up);
    // One wrapper: PEFT's `…mlp.experts.lora_A.weight`, `[E·r, hidden]`.
    let one = gate.lora_to_peft_tensors(DType::F32).unwrap();
    assert_eq!(
        one[&format!("{PEFT_PREFIX}model.layers.1.mlp.experts.lora_A.weight")].shape(),
        &[16, 32]
    );

    let all = base("gptoss-tiny", &device)
        .with_lora(&LoraConfig::new(4, 8.0, &["all-linear"]))
        .unwrap();
    assert_eq!(all.lora_modules().len(), 3 * 4 + 3 * 2);
    assert_eq!(all.lora_parameters(), experts);
    let json = all.peft_adapter_config().unwrap();
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["k_proj", "o_proj", "q_proj", "v_proj"])
    );
    let excluded = base("gptoss-tiny", &device)
        .with_lora(&LoraConfig {
            exclude_modules: vec!["up_proj".into()],
            ..LoraConfig::new(4, 8.0, &["all-linear"])
        })
        .unwrap();
    assert_eq!(
        excluded.lora_parameters(),
        (0..3)
            .map(|l| format!("model.layers.{l}.mlp.experts.down_proj"))
            .collect::<Vec<_>>()
    );

    for (model, entry) in [
        ("gptoss-tiny", "mlp.experts.gate_up_proj_bias"),
        ("qwen3-tiny", "mlp.experts.gate_up_proj"),
    ] {
        let config = LoraConfig {
            target_parameters: vec![entry.into()],
            ..LoraConfig::new(4, 8.0, &["q_proj"])
        };
        assert!(
            matches!(
                base(model, &device).with_lora(&config),
                Err(BridgeError::Config { field, .. }) if field == "target_parameters"
            ),
            "{model} {entry}"
        );
    }
}

#[test]
fn fresh_adapters_leave_the_forward_bit_identical() {
    let device = Device::flex();
    let rows = inputs("glm4moe-tiny");
    let plain = base("glm4moe-tiny", &device);
    let want = logits(&plain, &rows);
    for mode in [LoraForward::Merged, LoraForward::Factored] {
        let config = LoraConfig {
            forward: mode,
            ..LoraConfig::new(4, 16.0, &["all-linear"])
        };
        let model = base("glm4moe-tiny", &device).with_lora(&config).unwrap();
        // Attention, dense MLP, shared experts and routed experts; not lm_head.
        let modules = model.lora_modules();
        assert_eq!(modules.len(), 3 * 4 + 3 + 2 * 3 + 2 * 3, "{modules:?}");
        assert!(modules.contains(&"model.layers.1.mlp.experts.gate_proj".to_string()));
        assert!(!modules.iter().any(|m| m == "lm_head"));
        assert_eq!(
            logits(&model, &rows),
            want,
            "{mode:?}: B = 0 must not change logits"
        );
        // A is PEFT's kaiming-uniform: |A| < 1/sqrt(in), B is zero.
        model.visit_lora_params(&mut |name, p| {
            let v = p.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            let d_in = *p.shape().last().unwrap() as f32;
            if name.contains("lora_A") {
                assert!(v.iter().all(|x| x.abs() <= 1.0 / d_in.sqrt()), "{name}");
                assert!(v.iter().any(|x| *x != 0.0), "{name}");
            } else {
                assert!(v.iter().all(|x| *x == 0.0), "{name}");
            }
        });
        // Seeded: the same config gives the same adapters.
        let again = base("glm4moe-tiny", &device).with_lora(&config).unwrap();
        assert_eq!(
            again.lora_to_peft_tensors(DType::F32).unwrap(),
            model.lora_to_peft_tensors(DType::F32).unwrap()
        );
    }
}

#[test]
fn lora_forward_equals_merged_weight_forward() {
    let device = Device::flex();
    let rows = inputs("glm4moe-tiny");
    for mode in [LoraForward::Merged, LoraForward::Factored] {
        let config = LoraConfig {
            forward: mode,
            ..LoraConfig::new(4, 16.0, &["all-linear", "lm_head"])
        };
        let fresh = base("glm4moe-tiny", &device).with_lora(&config).unwrap();
        assert!(fresh.lora_modules().iter().any(|m| m == "lm_head"));
        let model = base("glm4moe-tiny", &device)
            .with_lora_tensors(&config, perturbed_adapters(&fresh))
            .unwrap();
        let with_lora = logits(&model, &rows);
        let plain = logits(&base("glm4moe-tiny", &device), &rows);
        assert!(max_diff(&with_lora, &plain) > 1e-2, "adapters must matter");

        let exported = model.to_hf_tensors_merged(DType::F32).unwrap();
        assert_eq!(
            exported.keys().collect::<Vec<_>>(),
            base("glm4moe-tiny", &device)
                .to_hf_tensors(DType::F32)
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            "merged export has exactly the base model's HF names"
        );
        let engine = CausalLm::from_hf_tensors(&model.config, exported, &device).unwrap();
        let merged = logits(&engine, &rows);
        let folded = logits(&model.clone().merge_lora(), &rows);
        assert_eq!(merged, folded, "merge_lora = merged export");
        match mode {
            LoraForward::Merged => assert_eq!(with_lora, merged, "bit-identical"),
            LoraForward::Factored => {
                let d = max_diff(&with_lora, &merged);
                assert!(d <= 1e-5, "factored vs merged: {d}");
                eprintln!("factored vs merged logits: max diff {d:.2e}");
            }
        }
        // Merged weight = W + (alpha / r) · B · A, checked by hand on one layer.
        let w = base("glm4moe-tiny", &device)
            .to_hf_tensors(DType::F32)
            .unwrap();
        let peft = model.lora_to_peft_tensors(DType::F32).unwrap();
        let m = model.to_hf_tensors_merged(DType::F32).unwrap();
        let key = "model.layers.1.mlp.experts.5.down_proj";
        let (w0, a, b) = (
            w[&format!("{key}.weight")].to_f32().unwrap(),
            peft[&format!("{PEFT_PREFIX}{key}.lora_A.weight")]
                .to_f32()
                .unwrap(),
            peft[&format!("{PEFT_PREFIX}{key}.lora_B.weight")]
                .to_f32()
                .unwrap(),
        );
        let (d_out, d_in, r) = (64, 32, 4);
        let got = m[&format!("{key}.weight")].to_f32().unwrap();
        for o in 0..d_out {
            for i in 0..d_in {
                let ba: f64 = (0..r)
                    .map(|k| f64::from(b[o * r + k]) * f64::from(a[k * d_in + i]))
                    .sum();
                let want = f64::from(w0[o * d_in + i]) + 4.0 * ba;
                assert!((f64::from(got[o * d_in + i]) - want).abs() < 1e-6);
            }
        }
    }
}

#[test]
fn peft_export_round_trips_through_an_adapter_directory() {
    let device = Device::flex();
    let config = LoraConfig::new(2, 4.0, &["linear_qkv", "o_proj", "experts.up_proj"]);
    let fresh = base("glm4moe-tiny", &device).with_lora(&config).unwrap();
    let tensors = perturbed_adapters(&fresh);
    // Routed experts are split per expert under PEFT names.
    assert!(tensors.contains_key(&format!(
        "{PEFT_PREFIX}model.layers.2.mlp.experts.7.up_proj.lora_B.weight"
    )));
    assert_eq!(tensors.len(), 3 * 4 * 2 + 2 * 8 * 2);
    let model = base("glm4moe-tiny", &device)
        .with_lora_tensors(&config, tensors.clone())
        .unwrap();
    assert_eq!(model.lora_to_peft_tensors(DType::F32).unwrap(), tensors);
    let dir = std::env::temp_dir().join(format!("miles-lora-{}", std::process::id()));
    model.save_lora_adapter(&dir, DType::F32).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(json["r"], 2);
    assert_eq!(json["lora_alpha"], 4.0);
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(
        json["target_modules"],
        serde_json::json!(["experts.up_proj", "k_proj", "o_proj", "q_proj", "v_proj"])
    );
    let back = base("glm4moe-tiny", &device)
        .load_lora_adapter(&dir, LoraForward::Merged)
        .unwrap();
    assert_eq!(back.lora_to_peft_tensors(DType::F32).unwrap(), tensors);
    let rows = inputs("glm4moe-tiny");
    assert_eq!(logits(&back, &rows), logits(&model, &rows));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_targets_and_adapter_tensors_are_typed_errors() {
    let device = Device::flex();
    let none = base("qwen3-tiny", &device).with_lora(&LoraConfig::new(4, 8.0, &["c_attn"]));
    assert!(matches!(none, Err(BridgeError::Config { field, .. }) if field == "target_modules"));

    let config = LoraConfig::new(4, 8.0, &["q_proj"]);
    let fresh = base("qwen3-tiny", &device).with_lora(&config).unwrap();
    let mut tensors = fresh.lora_to_peft_tensors(DType::F32).unwrap();
    let key = format!("{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight");
    let removed = tensors.remove(&key).unwrap();
    let err = base("qwen3-tiny", &device).with_lora_tensors(&config, tensors.clone());
    assert!(matches!(err, Err(BridgeError::MissingTensor { name }) if name == key));
    tensors.insert(
        key.clone(),
        TensorBytes::from_f32(vec![4, 4], &[0.0; 16]).unwrap(),
    );
    let err = base("qwen3-tiny", &device).with_lora_tensors(&config, tensors.clone());
    assert!(matches!(err, Err(BridgeError::ShapeMismatch { name, .. }) if name == key));
    tensors.insert(key, removed);
    let extra = format!("{PEFT_PREFIX}model.layers.0.self_attn.k_proj.lora_A.weight");
    tensors.insert(
        extra.clone(),
        TensorBytes::from_f32(vec![1], &[0.0]).unwrap(),
    );
    let err = base("qwen3-tiny", &device).with_lora_tensors(&config, tensors);
    assert!(matches!(err, Err(BridgeError::UnexpectedTensor { name }) if name == extra));

    let twice = fresh.with_lora(&config);
    assert!(matches!(twice, Err(BridgeError::Config { field, .. }) if field == "lora"));
}
