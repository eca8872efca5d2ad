//! The models the rollout benches share.

use miles_bridge::ModelConfig;

/// The 88 M GLM-4-MoE of the training-step and decode benches (8 layers, 16 experts, top 4).
pub fn glm_moe_88m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "glm4_moe", "vocab_size": 32000, "hidden_size": 512,
        "intermediate_size": 1408, "moe_intermediate_size": 256, "num_hidden_layers": 8,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 1.0, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "attention_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
        "initializer_range": 0.02, "max_position_embeddings": 4096}"#,
    )
    .expect("GLM config")
}
