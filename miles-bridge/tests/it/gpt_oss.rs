//! `gpt_oss` (GPT-OSS: attention sinks, sliding-window attention on the layers `layer_types`
//! marks, q/k/v/o biases, experts with biases and a clamped SwiGLU behind a biased
//! top-k-then-softmax router, YaRN RoPE with `truncate: false`) against HF transformers 5.24
//! on the tiny random checkpoint made by `fixtures/models/gen_gpt_oss.py` (`gptoss-tiny`:
//! 3 layers sliding / full / sliding with a window of 6 over 20-token inputs and 25-token
//! generations, 4 experts top-2, sinks N(0, 1), a third of the SwiGLU inputs past the clamp).
//! Logits and log-probs within 1e-4, routed experts identical, gradients, contiguous-cache
//! decoding equal to the full forward, greedy decoding equal to HF `generate`, the export equal
//! to the checkpoint byte for byte, the config read back as written. (The paged KV cache's
//! decode of it: `paged.rs`.)

use crate::common::{
    assert_greedy_kv_cache_decode_equals_hf_generate, assert_matches_reference, fixture, reference,
    rows_of,
};

use burn::tensor::Device;
use miles_bridge::{
    Architecture, BridgeError, CausalLm, ModelConfig, ModelInput, ids_tensor, token_logprobs,
};
use miles_r3::Fallthrough;

#[test]
fn gpt_oss_matches_transformers() {
    let dir = fixture("gptoss-tiny");
    let worst = assert_matches_reference(&dir, &[0, 1, 2], 1e-4);
    println!("gptoss-tiny: worst log-prob difference {worst:.3e}");
}

#[test]
fn gpt_oss_greedy_decode_equals_hf_generate() {
    assert_greedy_kv_cache_decode_equals_hf_generate(&fixture("gptoss-tiny"));
}

#[test]
fn gpt_oss_gradients_match_transformers() {
    let dir = fixture("gptoss-tiny");
    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let ids = ids_tensor(&rows_of(&dir), &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let grads = token_logprobs(out.logits, ids).mean().neg().backward();
    let mut ours = std::collections::BTreeMap::new();
    model.visit_params(&mut |name, p| {
        if let Some(g) = p.grad(&grads) {
            ours.insert(
                name.to_string(),
                (g.shape().to_vec(), g.try_to_vec::<f32>().unwrap()),
            );
        }
    });
    let refs = reference(&dir, "reference_grads.safetensors");
    assert!(refs.len() >= 10);
    let mut worst = 0.0f64;
    for (name, (shape, want)) in &refs {
        let (got_shape, got) = &ours[name];
        assert_eq!(got_shape, shape, "{name}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).abs())
            .fold(0.0, f64::max);
        assert!(diff <= bound, "grad of {name}: {diff:.3e} > {bound:.3e}");
        worst = worst.max(diff / bound);
    }
    println!("gptoss-tiny: worst gradient diff / bound = {worst:.3}");
}

#[test]
fn gpt_oss_config_is_read_as_transformers_reads_it_and_written_back() {
    let dir = fixture("gptoss-tiny");
    let c = ModelConfig::from_file(dir.join("config.json")).unwrap();
    assert_eq!(c.architecture, Architecture::GptOss);
    assert_eq!(c.sliding_layers, [true, false, true]);
    assert_eq!(c.sliding_window, Some(6));
    assert_eq!((c.layer_window(0), c.layer_window(1)), (Some(6), None));
    assert_eq!((c.n_routed_experts, c.num_experts_per_tok), (4, 2));
    assert_eq!(c.moe_intermediate_size, 16);
    assert_eq!((c.swiglu_alpha, c.swiglu_limit), (1.702, 7.0));
    assert!(c.attention_bias && c.has_moe());
    let yarn = c.yarn.unwrap();
    assert!(!yarn.truncate);
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (4.0, 16.0)
    );
    assert_eq!(c.rope_theta, 150000.0);
    let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
    assert_eq!(back, c);
    // Absent `layer_types`: even layers slide, transformers' default window of 128.
    let minimal = ModelConfig::from_hf_json(
        r#"{"model_type":"gpt_oss","vocab_size":64,"hidden_size":32,"intermediate_size":16,
            "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,
            "head_dim":8,"num_local_experts":4,"num_experts_per_tok":2}"#,
    )
    .unwrap();
    assert_eq!(minimal.sliding_layers, [true, false, true, false]);
    assert_eq!(minimal.sliding_window, Some(128));
    // The released MXFP4 checkpoints declare their quantisation: a typed error.
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    json["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    match ModelConfig::from_hf_json(&json.to_string()) {
        Err(BridgeError::Config { field, .. }) => assert_eq!(field, "quantization_config"),
        other => panic!("{other:?}"),
    }
    let mut bad = json.clone();
    bad.as_object_mut().unwrap().remove("quantization_config");
    bad["layer_types"] = serde_json::json!(["sliding_attention", "linear_attention", "x"]);
    match ModelConfig::from_hf_json(&bad.to_string()) {
        Err(BridgeError::Config { field, .. }) => assert_eq!(field, "layer_types"),
        other => panic!("{other:?}"),
    }
}
