//! `glm4_moe_lite` (GLM-4.7-Flash: DeepSeek-V3's latent attention, GLM-4-MoE's sigmoid router,
//! MoE layers chosen by `mlp_layer_types`) against HF transformers 5.24 on the tiny random
//! checkpoints made by `fixtures/models/gen_glm4_moe_lite.py`: `glm47flash-tiny` (explicit
//! `mlp_layer_types` dense / sparse / dense / sparse, 8 experts top-4, every expert reached)
//! and `glm47flash-legacy` (the `config.json` layout the released model ships: top-level
//! `rope_theta`, `first_k_dense_replace` 2 that transformers ignores, `topk_method`, one MTP
//! layer declared; two expert groups, attention biases, rope not interleaved). Logits and
//! log-probs within 1e-4, routed expert sets identical, gradients, the compressed-latent KV
//! cache equal to the full forward, greedy decoding equal to HF `generate`, the export equal
//! to the checkpoint byte for byte and its `config.json` read back as the same config.

use crate::common::fixture;
use crate::deepseek_v3::check;

use burn::tensor::Device;
use miles_bridge::{Architecture, BridgeError, CausalLm, MlpLayerType, ModelConfig};
use miles_core::{DType, NamedTensors};

#[test]
fn glm4_moe_lite_matches_transformers() {
    check("glm47flash-tiny", Architecture::Glm4MoeLite, &[1, 3]);
}

/// Without `mlp_layer_types`, layer 0 is dense and every later one sparse, whatever
/// `first_k_dense_replace` says (transformers reads the released config.json that way).
#[test]
fn glm4_moe_lite_released_layout_matches_transformers() {
    check("glm47flash-legacy", Architecture::Glm4MoeLite, &[1, 2]);
}

#[test]
fn glm4_moe_lite_config_is_read_as_transformers_reads_it() {
    let tiny = ModelConfig::from_file(fixture("glm47flash-tiny").join("config.json")).unwrap();
    let mla = tiny.mla.unwrap();
    assert_eq!(
        (
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim
        ),
        (Some(40), 32, 24, 8, 28)
    );
    assert!(mla.rope_interleave);
    use MlpLayerType::{Dense, Sparse};
    assert_eq!(tiny.mlp_layer_types, [Dense, Sparse, Dense, Sparse]);
    assert_eq!(
        (tiny.n_group, tiny.topk_group, tiny.num_experts_per_tok),
        (1, 1, 4)
    );
    assert_eq!(tiny.routed_scaling_factor, 1.8);
    assert_eq!(tiny.rope_theta, 1e6);
    assert_eq!(tiny.num_nextn_predict_layers, 0);
    assert_eq!(tiny.softmax_scale(), 32f64.powf(-0.5));
    let legacy = ModelConfig::from_file(fixture("glm47flash-legacy").join("config.json")).unwrap();
    assert_eq!(legacy.mlp_layer_types, [Dense, Sparse, Sparse]);
    assert_eq!(legacy.num_nextn_predict_layers, 1);
    assert_eq!(legacy.rope_theta, 5e5);
    assert!(legacy.attention_bias && !legacy.norm_topk_prob);
    assert!(!legacy.mla.unwrap().rope_interleave);
    // Absent fields take GLM-4.7-Flash's defaults (transformers 5.24's `Glm4MoeLiteConfig`).
    let minimal = ModelConfig::from_hf_json(
        r#"{"model_type":"glm4_moe_lite","vocab_size":64,"hidden_size":32,
            "intermediate_size":48,"moe_intermediate_size":8,"num_hidden_layers":3,
            "num_attention_heads":2}"#,
    )
    .unwrap();
    let mla = minimal.mla.unwrap();
    assert_eq!(
        (
            mla.q_lora_rank,
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim
        ),
        (Some(768), 512, 192, 64, 256)
    );
    assert_eq!(
        (
            minimal.n_routed_experts,
            minimal.num_experts_per_tok,
            minimal.n_shared_experts
        ),
        (64, 4, 1)
    );
    assert_eq!(minimal.routed_scaling_factor, 1.8);
    assert_eq!(minimal.rms_norm_eps, 1e-5);
    assert_eq!(minimal.mlp_layer_types, [Dense, Sparse, Sparse]);
    // The exported config reads back as the same config.
    for c in [tiny, legacy, minimal] {
        let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }
}

/// Bad `mlp_layer_types` and settings transformers could not run are typed errors naming the
/// field.
#[test]
fn glm4_moe_lite_bad_configs_are_typed_errors() {
    let text = std::fs::read_to_string(fixture("glm47flash-tiny").join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let field_of = |patch: serde_json::Value| {
        let mut json = base.clone();
        for (k, v) in patch.as_object().unwrap() {
            json[k] = v.clone();
        }
        match ModelConfig::from_hf_json(&json.to_string()) {
            Err(BridgeError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    };
    assert_eq!(
        field_of(serde_json::json!({"mlp_layer_types": ["dense", "sparse"]})),
        "mlp_layer_types"
    );
    assert_eq!(
        field_of(serde_json::json!({"mlp_layer_types": ["dense", "moe", "dense", "sparse"]})),
        "mlp_layer_types"
    );
    assert_eq!(
        field_of(serde_json::json!({"rope_parameters":
            {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}})),
        "partial_rotary_factor"
    );
    assert_eq!(
        field_of(serde_json::json!({"topk_method": "greedy"})),
        "topk_method"
    );
}

#[test]
fn glm4_moe_lite_greedy_kv_cache_decode_equals_hf_generate() {
    for name in ["glm47flash-tiny", "glm47flash-legacy"] {
        crate::common::assert_greedy_kv_cache_decode_equals_hf_generate(&fixture(name));
    }
}

/// HF names in and out: the f32 export equals the checkpoint byte for byte and the saved
/// `config.json` loads back as the same model.
#[test]
fn glm4_moe_lite_export_round_trip_is_bit_identical() {
    for name in ["glm47flash-tiny", "glm47flash-legacy"] {
        let dir = fixture(name);
        let device = Device::flex();
        let model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let original = NamedTensors::read_hf_checkpoint(&dir).unwrap();
        let exported = model.to_hf_tensors(DType::F32).unwrap();
        assert_eq!(exported, original, "{name}");
        let out = std::env::temp_dir().join(format!("miles-bridge-{name}-{}", std::process::id()));
        model.save_pretrained(&out, DType::F32, None).unwrap();
        let back = CausalLm::from_pretrained(&out, &device).unwrap();
        assert_eq!(back.config, model.config);
        assert_eq!(back.to_hf_tensors(DType::F32).unwrap(), original);
        std::fs::remove_dir_all(&out).ok();
    }
}
