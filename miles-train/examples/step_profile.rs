//! One model's training step, repeated, for profilers (`perf record`): the Qwen3-style 25 M
//! model of `benches/train_step.rs` (or its GLM-4-MoE 88 M with `MILES_PROFILE_MODEL=glm`) at
//! batch 8 × 512 (`MILES_PROFILE_ITERS`, default 2); with `MILES_PROFILE_SHAPE=grpo`, the
//! `grpo_step_vs_trl` bench's training batch instead: 32 prompts of 30–60 tokens × 8
//! responses of 8 tokens, one micro-batch of 256 in `MILES_PROFILE_LAYOUT` (`padded` by
//! default, or `shared_prefix`, `packed`, `per_sample`).
//!
//! `cargo run -p miles-train --release --example step_profile`

use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelConfig};
use miles_core::{PolicyTrainer, Reward, Sample};
use miles_ops::AdvantageConfig;
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};

fn main() {
    miles_train::retain_freed_memory();
    let glm = std::env::var("MILES_PROFILE_MODEL").is_ok_and(|m| m == "glm");
    let config = ModelConfig::from_hf_json(if glm {
        r#"{"model_type": "glm4_moe", "vocab_size": 32000, "hidden_size": 512,
        "intermediate_size": 1408, "moe_intermediate_size": 256, "num_hidden_layers": 8,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 1.0, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "attention_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
        "initializer_range": 0.02}"#
    } else {
        r#"{"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 384,
        "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "rms_norm_eps": 1e-6, "initializer_range": 0.02}"#
    })
    .expect("config");
    let iters: usize = std::env::var("MILES_PROFILE_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let device = Device::flex().autodiff();
    let model = CausalLm::init(&config, &device).expect("init");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let grpo = std::env::var("MILES_PROFILE_SHAPE").is_ok_and(|s| s == "grpo");
    let (samples, group, layout): (Vec<Sample>, usize, BatchLayout) = if grpo {
        let layout = std::env::var("MILES_PROFILE_LAYOUT")
            .unwrap_or_else(|_| "padded".into())
            .parse()
            .expect("MILES_PROFILE_LAYOUT");
        let mut samples = Vec::new();
        for g in 0..32u64 {
            let prompt_len = 30 + (next() % 31) as usize;
            let prompt: Vec<u32> = (0..prompt_len).map(|_| (next() % 32000) as u32).collect();
            for i in 0..8 {
                let mut tokens = prompt.clone();
                tokens.extend((0..8).map(|_| (next() % 32000) as u32));
                samples.push(Sample {
                    tokens,
                    response_length: 8,
                    reward: Some(Reward::Scalar((i % 2) as f64)),
                    group_index: Some(g),
                    ..Sample::default()
                });
            }
        }
        (samples, 8, layout)
    } else {
        let samples = (0..8)
            .map(|i| Sample {
                tokens: (0..512).map(|_| (next() % 32000) as u32).collect(),
                response_length: 480,
                reward: Some(Reward::Scalar((i % 2) as f64)),
                group_index: Some((i / 2) as u64),
                ..Sample::default()
            })
            .collect();
        (samples, 2, BatchLayout::Padded)
    };
    let cfg = TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-5,
            ..LrSchedule::default()
        },
        micro_batch_size: samples.len(),
        layout,
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(group),
        ..TrainConfig::default()
    };
    let mut actor = Actor::new(model, cfg).expect("actor");
    for i in 0..iters {
        let m = actor.train(i as u64, &samples).expect("train");
        let keys = [
            "perf/step_time",
            "perf/log_probs_time",
            "perf/actor_forward_time",
            "perf/actor_backward_time",
            "perf/optimizer_time",
        ];
        for k in keys {
            if let Some(v) = m.get(k) {
                println!("step {i}: {k} = {v:.3} s");
            }
        }
    }
}
