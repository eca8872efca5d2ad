//! `deepseek_v3` (multi-head latent attention, sigmoid group-limited routing, shared experts,
//! YaRN RoPE) against HF transformers 5.24 on the tiny random checkpoints made by
//! `fixtures/models/gen_deepseek_v3.py`: `dsv3-tiny` (`q_lora_rank` set, YaRN with `mscale` /
//! `mscale_all_dim`, interleaved rope) and `dsv3-noq` (`q_lora_rank: null`, no rope scaling,
//! `v_head_dim` wider than the query / key head, attention biases). Logits and token log-probs
//! within 1e-4, routed expert sets identical, gradients of `-mean(token_logprobs)` within
//! 1e-4 · max(1, max|ref|) per tensor (plain and fused log-prob paths), KV-cache decoding
//! (compressed-latent cache, absorbed decode steps) equal to the full forward, greedy decoding
//! equal to HF `generate`, bit-identical export, MTP layers skipped, LoRA on the MLA
//! projections.

use crate::common::{fixture, reference, rows_of};

use std::path::Path;

use burn::tensor::{Device, Tensor};
use miles_bridge::lora::{LoraConfig, LoraForward};
use miles_bridge::{
    Architecture, BridgeError, CausalLm, KvCache, ModelConfig, ModelInput, ids_tensor,
    mtp_tensor_names, names::internal_to_hf, token_logprobs,
};
use miles_core::{DType, NamedTensors, TensorBytes};
use miles_r3::Fallthrough;

const FIXTURES: [&str; 2] = ["dsv3-tiny", "dsv3-noq"];

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

fn check_grads(name: &str, model: &CausalLm, grads: &burn::tensor::Gradients, dir: &Path) {
    let mut ours = NamedTensors::new();
    model.visit_params(&mut |pname, p| {
        if let Some(g) = p.grad(grads) {
            let values = g.try_to_vec::<f32>().unwrap();
            ours.insert(
                pname.to_string(),
                TensorBytes::from_f32(g.shape().to_vec(), &values).unwrap(),
            );
        }
    });
    let ours = internal_to_hf(ours);
    let ref_grads = reference(dir, "reference_grads.safetensors");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        ref_grads.keys().collect::<Vec<_>>(),
        "{name}: parameters with gradients"
    );
    let mut worst = 0.0f64;
    for (pname, (shape, want)) in &ref_grads {
        let got = &ours[pname];
        assert_eq!(got.shape(), &shape[..], "{pname}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&got.to_f32().unwrap(), want);
        assert!(
            diff <= bound,
            "{name}: grad of {pname}: {diff:.3e} > {bound:.3e}"
        );
        worst = worst.max(diff / bound);
    }
    println!("{name}: worst gradient diff / bound = {worst:.3}");
}

/// Logits, log-probs, routed experts and gradients against transformers; then the KV cache:
/// a 5-token prefill (expanded evaluation) and one-token decode steps (absorbed evaluation
/// over the cached latent) give the full forward's log-probs.
/// Logits, log-probs, routes and gradients against transformers', then the compressed-latent
/// KV cache against the full forward, for a latent-attention checkpoint of `architecture`.
pub(crate) fn check(name: &str, architecture: Architecture, moe_layers: &[usize]) {
    let dir = fixture(name);
    let rows = rows_of(&dir);
    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    assert_eq!(model.architecture(), architecture);
    let ids = ids_tensor(&rows, &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let refs = reference(&dir, "reference_outputs.safetensors");
    let logits = out.logits.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_logits = max_abs_diff(&logits, &refs["logits"].1);
    let lp = token_logprobs(out.logits, ids);
    let lp_host = host(lp.clone());
    let d_lp = max_abs_diff(&lp_host, &refs["token_logprobs"].1);
    println!("{name}: max |logits - ref| = {d_logits:.3e}, max |logprobs - ref| = {d_lp:.3e}");
    assert!(
        d_logits <= 1e-4 && d_lp <= 1e-4,
        "{name}: {d_logits} / {d_lp}"
    );

    let layers: Vec<usize> = out.routing.iter().map(|r| r.layer_index).collect();
    assert_eq!(layers, moe_layers);
    for routing in &out.routing {
        let k = routing.experts.dims()[1];
        let ids = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        let mut got: Vec<i64> = Vec::new();
        for row in ids.chunks(k) {
            let mut row = row.to_vec();
            row.sort_unstable();
            got.extend(row);
        }
        let want: Vec<i64> = refs[&format!("layer{}.topk_indices_sorted", routing.layer_index)]
            .1
            .iter()
            .map(|v| *v as i64)
            .collect();
        assert_eq!(
            got, want,
            "{name}: routed experts of layer {}",
            routing.layer_index
        );
    }
    let grads = lp.mean().neg().backward();
    check_grads(name, &model, &grads, &dir);

    let device = Device::flex();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let mla = model.config.mla.unwrap();
    let mut cache = KvCache::new();
    let prefill: Vec<Vec<u32>> = rows.iter().map(|r| r[..5].to_vec()).collect();
    let first = model
        .forward_cached(
            &ModelInput::new(ids_tensor(&prefill, &device).unwrap()),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    let mut parts = vec![first.logits];
    for t in 5..rows[0].len() {
        let step: Vec<Vec<u32>> = rows.iter().map(|r| vec![r[t]]).collect();
        let out = model
            .forward_cached(
                &ModelInput::new(ids_tensor(&step, &device).unwrap()),
                &mut cache,
                &Fallthrough,
            )
            .unwrap();
        parts.push(out.logits);
    }
    // The cache holds the compressed latent and the rope key only.
    for l in 0..model.config.num_hidden_layers {
        let layer = cache.layer(l).unwrap();
        assert_eq!(
            layer.keys.dims(),
            [
                rows.len(),
                1,
                rows[0].len(),
                mla.kv_lora_rank + mla.qk_rope_head_dim
            ]
        );
        assert!(layer.values.is_none());
    }
    let cached = Tensor::cat(parts, 1);
    let ids = ids_tensor(&rows, &device).unwrap();
    let cached_lp = host(token_logprobs(cached, ids));
    let diff = cached_lp
        .iter()
        .zip(&lp_host)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!("{name}: max |cached - full| log-prob = {diff:.3e}");
    assert!(diff <= 1e-5, "{name}: cached decoding differs by {diff}");
}

#[test]
fn deepseek_v3_q_lora_yarn_matches_transformers() {
    check("dsv3-tiny", Architecture::DeepseekV3, &[1, 2]);
}

#[test]
fn deepseek_v3_no_q_lora_matches_transformers() {
    check("dsv3-noq", Architecture::DeepseekV3, &[1, 2, 3]);
}

#[test]
fn deepseek_v3_config_is_read_as_transformers_reads_it() {
    let tiny = ModelConfig::from_file(fixture("dsv3-tiny").join("config.json")).unwrap();
    let mla = tiny.mla.unwrap();
    assert_eq!(mla.q_lora_rank, Some(48));
    assert_eq!(
        (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim),
        (32, 16, 8)
    );
    assert_eq!(mla.v_head_dim, 12);
    assert!(mla.rope_interleave);
    assert_eq!(
        (tiny.n_group, tiny.topk_group, tiny.first_k_dense_replace),
        (4, 2, 1)
    );
    assert_eq!(tiny.num_nextn_predict_layers, 1);
    let yarn = tiny.yarn.unwrap();
    // transformers: attention_factor = mscale(4, 0.9) / mscale(4, 0.7); softmax scale
    // 24^-0.5 · mscale(4, 0.7)².
    let m = |s: f64| 0.1 * s * 4f64.ln() + 1.0;
    assert!((yarn.attention_factor() - m(0.9) / m(0.7)).abs() < 1e-12);
    assert!((tiny.softmax_scale() - 24f64.powf(-0.5) * m(0.7) * m(0.7)).abs() < 1e-12);
    let noq = ModelConfig::from_file(fixture("dsv3-noq").join("config.json")).unwrap();
    assert_eq!(noq.mla.unwrap().q_lora_rank, None);
    assert!(noq.yarn.is_none() && !noq.mla.unwrap().rope_interleave);
    assert!(noq.attention_bias && !noq.norm_topk_prob);
    assert_eq!(noq.softmax_scale(), 20f64.powf(-0.5));
    // The exported config reads back as the same config.
    for c in [tiny, noq] {
        let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }
}

/// The training path that never materialises the logits: `forward_hidden` + miles-ops' fused
/// chunked log-prob op, gradients against transformers'.
#[test]
fn deepseek_v3_fused_log_prob_path_matches_transformers() {
    let name = "dsv3-tiny";
    let dir = fixture(name);
    let rows = rows_of(&dir);
    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let lp = crate::common::fused_token_logprobs(&model, &rows, &device);
    let refs = reference(&dir, "reference_outputs.safetensors");
    let d_lp = max_abs_diff(
        &lp.clone().into_data().try_to_vec::<f32>().unwrap(),
        &refs["token_logprobs"].1,
    );
    assert!(d_lp <= 1e-4, "{name}: fused log-probs differ by {d_lp}");
    let grads = lp.mean().neg().backward();
    check_grads(name, &model, &grads, &dir);
}

/// Greedy decoding with the KV cache (prefill, then one token per step, both prompts in one
/// batch) gives exactly the tokens transformers' `generate(do_sample=False)` gave.
#[test]
fn deepseek_v3_greedy_kv_cache_decode_equals_hf_generate() {
    for name in FIXTURES {
        crate::common::assert_greedy_kv_cache_decode_equals_hf_generate(&fixture(name));
    }
}

/// HF names in and out: the f32 export equals the checkpoint byte for byte, a bf16 save
/// reloads to the same bf16 tensors, sharded saves load back, and the saved `config.json`
/// reads back as the same config.
#[test]
fn deepseek_v3_export_round_trip_is_bit_identical() {
    for name in FIXTURES {
        let dir = fixture(name);
        let device = Device::flex();
        let model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let original = NamedTensors::read_hf_checkpoint(&dir).unwrap();
        let exported = model.to_hf_tensors(DType::F32).unwrap();
        assert!(exported.contains_key("model.layers.1.self_attn.kv_b_proj.weight"));
        assert!(exported.contains_key("model.layers.2.mlp.gate.e_score_correction_bias"));
        assert_eq!(exported, original, "{name}");
        let out = std::env::temp_dir().join(format!("miles-bridge-{name}-{}", std::process::id()));
        // Small shards: the import reads the sharded index.
        model
            .save_pretrained(&out, DType::BF16, Some(64 << 10))
            .unwrap();
        assert!(out.join("model.safetensors.index.json").exists());
        let back = CausalLm::from_pretrained(&out, &device).unwrap();
        assert_eq!(back.config, model.config);
        let saved = NamedTensors::read_hf_checkpoint(&out).unwrap();
        assert_eq!(back.to_hf_tensors(DType::BF16).unwrap(), saved);
        std::fs::remove_dir_all(&out).ok();
    }
}

/// Multi-token-prediction layers (`model.layers.{num_hidden_layers}.*` with
/// `num_nextn_predict_layers = 1`) are skipped on import; a layer beyond them is an error.
#[test]
fn deepseek_v3_mtp_layers_are_skipped() {
    let dir = fixture("dsv3-tiny");
    let device = Device::flex();
    let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
    let tensors = NamedTensors::read_hf_checkpoint(&dir).unwrap();
    let mut with_mtp = tensors.clone();
    for (name, t) in &tensors {
        if let Some(rest) = name.strip_prefix("model.layers.2.") {
            with_mtp.insert(format!("model.layers.3.{rest}"), t.clone());
        }
    }
    with_mtp.insert(
        "model.layers.3.eh_proj.weight",
        TensorBytes::from_f32(vec![64, 128], &vec![0.0; 64 * 128]).unwrap(),
    );
    let skipped = mtp_tensor_names(&config, &with_mtp);
    assert_eq!(skipped.len(), with_mtp.len() - tensors.len());
    let plain = CausalLm::from_hf_tensors(&config, tensors.clone(), &device).unwrap();
    let mtp = CausalLm::from_hf_tensors(&config, with_mtp, &device).unwrap();
    assert_eq!(
        mtp.to_hf_tensors(DType::F32).unwrap(),
        plain.to_hf_tensors(DType::F32).unwrap()
    );
    let mut beyond = tensors;
    beyond.insert(
        "model.layers.4.eh_proj.weight",
        TensorBytes::from_f32(vec![2], &[0.0, 0.0]).unwrap(),
    );
    assert!(matches!(
        CausalLm::from_hf_tensors(&config, beyond, &device),
        Err(BridgeError::UnexpectedTensor { name }) if name == "model.layers.4.eh_proj.weight"
    ));
}

/// Unsupported settings are typed errors naming the field.
#[test]
fn deepseek_v3_unsupported_settings_are_typed_errors() {
    let text = std::fs::read_to_string(fixture("dsv3-tiny").join("config.json")).unwrap();
    let field_of = |json: serde_json::Value| match ModelConfig::from_hf_json(&json.to_string()) {
        Err(BridgeError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let with = |key: &str, value: serde_json::Value| {
        let mut j = base.clone();
        j[key] = value;
        j
    };
    let fp8 = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
        "weight_block_size": [128, 128]});
    assert_eq!(
        field_of(with("quantization_config", fp8)),
        "quantization_config"
    );
    assert_eq!(
        field_of(with("scoring_func", "softmax".into())),
        "scoring_func"
    );
    assert_eq!(
        field_of(with("topk_method", "greedy".into())),
        "topk_method"
    );
    assert_eq!(field_of(with("moe_layer_freq", 2.into())), "moe_layer_freq");
    assert_eq!(field_of(with("kv_lora_rank", 0.into())), "kv_lora_rank");
    assert_eq!(field_of(with("hidden_act", "gelu".into())), "hidden_act");
    let mut no_factor = base.clone();
    no_factor["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("factor");
    assert_eq!(field_of(no_factor), "rope_parameters");
    let mut longrope = base.clone();
    longrope["rope_parameters"]["rope_type"] = "longrope".into();
    assert_eq!(field_of(longrope), "rope_parameters");
    // DeepSeek's own fields with DeepSeek-V3's values are accepted.
    let mut real = base.clone();
    real["scoring_func"] = "sigmoid".into();
    real["topk_method"] = "noaux_tc".into();
    real["moe_layer_freq"] = 1.into();
    real["quantization_config"] = serde_json::Value::Null;
    assert!(ModelConfig::from_hf_json(&real.to_string()).is_ok());
}

/// DeepSeek-V3's own `config.json` layout (top-level `rope_theta`, legacy `rope_scaling`
/// with `type: yarn`) reads as transformers 5.24 reads it. Expected inverse frequencies and
/// factors: transformers 5.24's `_compute_yarn_parameters` / `yarn_apply_mscale` on this
/// config (qk_rope_head_dim 64, rope_theta 10000, factor 40, original 4096, beta 32 / 1,
/// mscale = mscale_all_dim = 1), printed with `inv_freq.tolist()`.
#[test]
fn deepseek_v3_legacy_rope_scaling_layout_matches_transformers() {
    let json = r#"{"model_type":"deepseek_v3","vocab_size":64,"hidden_size":32,
        "intermediate_size":64,"moe_intermediate_size":16,"num_hidden_layers":2,
        "num_attention_heads":2,"num_key_value_heads":2,"n_routed_experts":8,
        "num_experts_per_tok":2,"n_group":4,"topk_group":2,"first_k_dense_replace":1,
        "q_lora_rank":16,"kv_lora_rank":16,"qk_nope_head_dim":8,"qk_rope_head_dim":64,
        "v_head_dim":8,"rope_theta":10000,"max_position_embeddings":163840,
        "rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,
        "mscale_all_dim":1.0,"original_max_position_embeddings":4096,"type":"yarn"},
        "scoring_func":"sigmoid","topk_method":"noaux_tc","moe_layer_freq":1,
        "num_nextn_predict_layers":1}"#;
    let c = ModelConfig::from_hf_json(json).unwrap();
    let yarn = c.yarn.unwrap();
    assert_eq!(yarn.attention_factor(), 1.0);
    let m = 0.1 * 40f64.ln() + 1.0;
    assert!((c.softmax_scale() - 72f64.powf(-0.5) * m * m).abs() < 1e-12);
    let got = c.inv_freq();
    let want = include!("../../../fixtures/models/dsv3_yarn_inv_freq.txt");
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-6 * w.abs(),
            "inv_freq[{i}]: {g} vs {w}"
        );
    }
}

/// LoRA attaches to every MLA projection (`all-linear` and Megatron's MLA names); fresh
/// adapters leave the forward bit-identical, perturbed ones change it, and the merged export
/// reproduces the adapted forward bit for bit.
#[test]
fn deepseek_v3_lora_on_latent_attention_projections() {
    let device = Device::flex();
    let dir = fixture("dsv3-tiny");
    let rows = rows_of(&dir);
    let base = || CausalLm::from_pretrained(&dir, &device).unwrap();
    let logits = |m: &CausalLm| {
        m.forward(
            &ModelInput::new(ids_tensor(&rows, &device).unwrap()),
            &Fallthrough,
        )
        .unwrap()
        .logits
        .into_data()
        .try_to_vec::<f32>()
        .unwrap()
    };
    let plain = logits(&base());
    let config = LoraConfig::new(4, 16.0, &["all-linear"]);
    let fresh = base().with_lora(&config).unwrap();
    let modules = fresh.lora_modules();
    for m in [
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    ] {
        assert!(
            modules.contains(&format!("model.layers.1.self_attn.{m}")),
            "{m}: {modules:?}"
        );
    }
    assert_eq!(logits(&fresh), plain);
    let megatron = LoraConfig::new(
        4,
        16.0,
        &[
            "linear_q_down_proj",
            "linear_q_up_proj",
            "linear_kv_down_proj",
            "linear_kv_up_proj",
        ],
    );
    let m = base().with_lora(&megatron).unwrap();
    assert_eq!(m.lora_modules().len(), 3 * 4);
    // Perturbed adapters (B != 0).
    let mut tensors = fresh.lora_to_peft_tensors(DType::F32).unwrap();
    for (name, t) in tensors.iter_mut() {
        if name.contains("lora_B") {
            let values: Vec<f32> = (0..t.numel())
                .map(|i| 0.05 * ((i * 7 % 13) as f32 - 6.0) / 6.0)
                .collect();
            *t = TensorBytes::from_f32(t.shape().to_vec(), &values).unwrap();
        }
    }
    let adapted = base()
        .with_lora_tensors(
            &LoraConfig {
                forward: LoraForward::Merged,
                ..config
            },
            tensors,
        )
        .unwrap();
    let with_lora = logits(&adapted);
    let d = with_lora
        .iter()
        .zip(&plain)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(d > 1e-2, "adapters must matter: {d}");
    let merged = adapted.to_hf_tensors_merged(DType::F32).unwrap();
    let engine = CausalLm::from_hf_tensors(&adapted.config, merged, &device).unwrap();
    assert_eq!(
        logits(&engine),
        with_lora,
        "merged export = adapted forward"
    );
}

/// Checkpoints in settings the two main fixtures do not use (`fixtures/models/variants`, made by
/// `gen_variants.py`; the reference is transformers 5.24 reloading the files as written):
///
/// - `dsv3-moonlight`: `q_lora_rank: null`, one expert group, `v_head_dim` = nope, rope dim 6,
///   tied embeddings, two dense layers, 2 shared experts, no renormalisation, legacy layout
///   (top-level `rope_theta`, `rope_scaling: null`, DeepSeek's extra fields);
/// - `dsv3-k0-noshared`: every layer MoE (`first_k_dense_replace` 0), `n_shared_experts` 0
///   (zero-sized shared-expert tensors), YaRN with `mscale` but no `mscale_all_dim`, rope dim
///   16 wider than nope, not interleaved, attention biases, `routed_scaling_factor` 0.75;
/// - `dsv3-legacy-yarn`: legacy `rope_scaling` with `type: yarn`, `mscale_all_dim` 0 (no
///   softmax-scale correction), custom `beta_fast` / `beta_slow`, `v_head_dim` narrower than
///   nope, 2 groups picking 1;
/// - `kimi-k2`: Kimi-K2's layout (`model_type: "kimi_k2"`, `auto_map`, no `rope_interleave`,
///   YaRN with `beta_fast` = `beta_slow` = 1, `routed_scaling_factor` 2.827, no MTP layers).
///
/// Logits / log-probs within 1e-4, routing, cached decoding, export, and greedy decoding equal
/// to HF `generate`.
#[test]
fn deepseek_v3_variants_match_transformers() {
    let cases: [(&str, &[usize]); 4] = [
        ("variants/dsv3-moonlight", &[2, 3]),
        ("variants/dsv3-k0-noshared", &[0, 1]),
        ("variants/dsv3-legacy-yarn", &[1, 2]),
        ("variants/kimi-k2", &[1, 2]),
    ];
    for (name, moe_layers) in cases {
        let dir = fixture(name);
        let config = ModelConfig::from_file(dir.join("config.json")).unwrap();
        assert_eq!(config.architecture, Architecture::DeepseekV3, "{name}");
        crate::common::assert_matches_reference(&dir, moe_layers, 1e-4);
        crate::common::assert_greedy_kv_cache_decode_equals_hf_generate(&dir);
    }
}
