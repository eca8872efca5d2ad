//! Embedded-engine throughput (issue: 2 cores, f32, flex): decode tokens/s at 1, 8 and 32
//! concurrent sequences of 256 new tokens from 16-token prompts, and prefill tokens/s, on the
//! 88 M GLM-4-MoE and the 25 M Qwen3-style dense model of the training-step bench.
//!
//! Baseline: HF transformers `generate` (greedy, KV cache, PyTorch 2.15 CPU, 2 threads) at 32
//! sequences × 256 new tokens, measured on this machine: GLM-4-MoE 341 tokens/s, Qwen3-style
//! 883 tokens/s (the reference figures of the issue; no torch in the bench itself). Target:
//! ≥ 2× transformers, i.e. our time ≤ 0.5 × theirs for the same tokens.
//!
//! `cargo bench -p miles-rollout --bench engine_decode` (`MILES_BENCH_QUICK=1`: 64 new tokens).

mod common;

use std::sync::Arc;

use common::glm_moe_88m;
use std::time::Instant;

use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelConfig};
use miles_core::{GenerateRequest, InferenceEngine, SamplingParams};
use miles_rollout::{EmbeddedEngine, EngineConfig};

fn qwen3_25m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 384,
        "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "max_position_embeddings": 4096}"#,
    )
    .expect("Qwen3 config")
}

fn prompt(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| ((t * 131 + i * 977 + 7) % vocab) as u32)
        .collect()
}

async fn decode(engine: &Arc<EmbeddedEngine>, seqs: usize, new_tokens: usize, vocab: usize) -> f64 {
    let started = Instant::now();
    let handles: Vec<_> = (0..seqs)
        .map(|i| {
            let e = engine.clone();
            let mut req = GenerateRequest::new(
                prompt(i, 16, vocab),
                SamplingParams {
                    temperature: 0.0,
                    max_new_tokens: Some(new_tokens),
                    ..SamplingParams::default()
                },
            );
            req.return_logprob = true;
            tokio::spawn(async move { e.generate(req).await })
        })
        .collect();
    let mut generated = 0;
    for h in handles {
        generated += h.await.expect("task").expect("generate").output_ids.len();
    }
    assert_eq!(generated, seqs * new_tokens);
    started.elapsed().as_secs_f64()
}

async fn run(name: &str, config: ModelConfig, hf_tokens_per_s: f64, new_tokens: usize) {
    let vocab = config.vocab_size;
    let model = CausalLm::init(&config, &Device::flex()).expect("model");
    let params = model.num_params();
    let engine = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                recompute_logprobs_via_prefill: false,
                prefix_cache_tokens: 0,
                ..EngineConfig::default()
            },
        )
        .expect("engine"),
    );
    // Warm-up.
    decode(&engine, 2, 4, vocab).await;
    for seqs in [1usize, 8, 32] {
        let secs = decode(&engine, seqs, new_tokens, vocab).await;
        let tps = (seqs * new_tokens) as f64 / secs;
        println!(
            "# engine {name}: {seqs} sequences x {new_tokens} new tokens: {secs:.2} s, {tps:.0} tokens/s"
        );
        if seqs == 32 {
            let baseline = (seqs * new_tokens) as f64 / hf_tokens_per_s;
            println!(
                "xtask-result: engine_decode_{name}_32seq ours={secs:.3}s baseline={baseline:.3}s \
                 target=<=0.5 note=32x{new_tokens} greedy decode, {params} params, f32 flex; \
                 baseline: HF transformers generate at {hf_tokens_per_s} tokens/s (issue reference \
                 constant, not measured here)"
            );
        }
    }
    // Prefill: 4 prompts of 512 tokens, one new token each.
    let started = Instant::now();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let e = engine.clone();
            let req = GenerateRequest::new(
                prompt(100 + i, 512, vocab),
                SamplingParams {
                    temperature: 0.0,
                    max_new_tokens: Some(1),
                    ..SamplingParams::default()
                },
            );
            tokio::spawn(async move { e.generate(req).await })
        })
        .collect();
    for h in handles {
        h.await.expect("task").expect("generate");
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "# engine {name}: prefill {:.0} tokens/s (4 x 512 tokens in {secs:.2} s)",
        2048.0 / secs
    );
}

fn main() {
    let quick = std::env::var_os("MILES_BENCH_QUICK").is_some();
    let new_tokens = if quick { 64 } else { 256 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        run("glm_moe_88m", glm_moe_88m(), 341.0, new_tokens).await;
        run("qwen3_25m", qwen3_25m(), 883.0, new_tokens).await;
    });
}
