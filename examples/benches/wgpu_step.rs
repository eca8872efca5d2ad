//! One training step and one decode step on `wgpu-cpu` (burn's wgpu runtime on the CPU
//! adapter: Mesa lavapipe without a GPU) with the fused ops against the plain-op path,
//! measured in the same run on the same weights. The plain path is the fused ops switched off
//! process-wide (`miles_ops::set_fused_ops(false)`, what `MILES_FUSED_OPS=off` does); the two
//! modes alternate, `MILES_BENCH_ITERS` rounds (default 3), and the rows give the medians.
//!
//! The model is a small GLM-4-MoE built from a config (random weights): vocabulary 8,000
//! (`MILES_BENCH_WGPU_VOCAB`), hidden 128 (`MILES_BENCH_WGPU_HIDDEN`), 4 layers (the first
//! dense), 8 routed experts of which 2 per token, one shared expert.
//!
//! - Training step (`wgpu_step_train`): [`Actor::train`] on 4 greedy samples of the
//!   embedded engine (32 prompt + 16 response tokens each, routed experts recorded), GRPO
//!   with TIS and rollout routing replay, one padded micro-batch: the old-log-prob pass,
//!   forward, backward and AdamW. A fresh actor from the same weights each time.
//! - Decode step (`wgpu_step_decode`): the embedded engine decoding the same 4 sequences
//!   (log-prob recompute off), `(t(17 new tokens) − t(1 new token)) / 16`: the prefill cancels.
//!
//! - MoE layer (`wgpu_moe_layer_8tok`, `wgpu_moe_layer_512tok`): one MoE block of a larger
//!   GLM-4-MoE config (hidden 512, 16 experts × 256, top-4, one shared expert), forward +
//!   backward at a decode size (8 tokens) and a training size (512 tokens), the device-side
//!   grouping (`MoeDispatch::Sparse`: bucketing kernels and the grouped matmul) against every
//!   expert on every token (`Dense`) on the same device, alternated.
//!
//! The first round of each mode is an untimed warm-up (shader compilation, autotune). With the
//! fused ops on, every fused op runs as a CubeCL kernel on wgpu (log-probs, clipped loss,
//! attention forward / backward and the decode step over the KV cache, RMSNorm, RoPE, SwiGLU,
//! the grouped expert matmul, and MoE dispatch is sparse on the device: bucketing kernels);
//! switched off, their plain-op twins run and MoE dispatch is dense.
//!
//! `cargo bench -p miles-examples --features miles-ops/wgpu --bench wgpu_step`
//! (or `cargo xtask bench --only wgpu_step -- --features miles-ops/wgpu`; the workspace
//! `cargo bench --workspace --features miles-ops/wgpu` runs it too). Without the feature or
//! an adapter it prints a `!!! KERNEL TEST … NOT RUN` line and no rows.

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Tensor};
use miles_bridge::nn::{FeedForward, MoeBlock};
use miles_bridge::{CausalLm, ModelConfig, MoeDispatch};
use miles_core::{PolicyTrainer, Sample};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_examples::grpo_step::{StepPlan, generate_all, samples_of};
use miles_train::Actor;

const BATCH: usize = 4;
const PROMPT: usize = 32;
const RESPONSE: usize = 16;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(vocab: usize, hidden: usize) -> ModelConfig {
    ModelConfig::from_hf_json(&format!(
        r#"{{"model_type": "glm4_moe", "vocab_size": {vocab}, "hidden_size": {hidden},
        "intermediate_size": {inter}, "moe_intermediate_size": {moe}, "num_hidden_layers": 4,
        "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 1.0, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": {head}, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "attention_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
        "initializer_range": 0.02, "max_position_embeddings": 1024}}"#,
        inter = hidden * 3,
        moe = hidden / 2,
        head = (hidden / 4).max(8),
    ))
    .expect("GLM-4-MoE config")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// An engine over `model` without log-prob recompute (decode work only).
fn decode_engine(model: &CausalLm) -> Arc<EmbeddedEngine> {
    let engine = EmbeddedEngine::builder(model.clone())
        .config(EngineConfig {
            max_running_requests: BATCH,
            recompute_logprobs_via_prefill: false,
            prefix_cache_tokens: 0,
            ..EngineConfig::default()
        })
        .build()
        .expect("engine");
    Arc::new(engine)
}

/// Seconds of one greedy generation of every prompt of `plan` with `new_tokens` each.
async fn generation_secs(engine: &Arc<EmbeddedEngine>, plan: &StepPlan, new_tokens: usize) -> f64 {
    let plan = StepPlan {
        max_new_tokens: new_tokens,
        ..plan.clone()
    };
    let started = Instant::now();
    let outputs = generate_all(engine, &plan, false).await.expect("generate");
    let secs = started.elapsed().as_secs_f64();
    assert!(outputs.iter().all(|o| o.output_ids.len() == new_tokens));
    secs
}

/// Seconds of one decode step: the difference of two generations over the extra tokens.
async fn decode_step_secs(model: &CausalLm, plan: &StepPlan) -> f64 {
    let engine = decode_engine(model);
    let short = generation_secs(&engine, plan, 1).await;
    let long = generation_secs(&engine, plan, RESPONSE + 1).await;
    engine.shutdown();
    (long - short) / RESPONSE as f64
}

/// Seconds of one training step on `samples` from a fresh actor over `model`.
fn train_step_secs(model: &CausalLm, plan: &StepPlan, samples: &[Sample]) -> (f64, f64) {
    let mut actor = Actor::new(model.clone(), plan.train.clone()).expect("actor");
    let started = Instant::now();
    let metrics = actor.train(0, samples).expect("train");
    let secs = started.elapsed().as_secs_f64();
    (secs, metrics["train/grad_norm"])
}

/// Seconds of one forward + backward of `block` over `x` with `dispatch`.
fn moe_layer_secs(block: &MoeBlock, x: &Tensor<2>, dispatch: MoeDispatch) -> f64 {
    let mut block = block.clone();
    block.dispatch = dispatch;
    let start = Instant::now();
    let xg = x.clone().require_grad();
    let (out, _) = block
        .forward(xg.clone(), &miles_r3::Fallthrough)
        .expect("moe forward");
    let grads = out.sum().backward();
    let dx: f32 = xg.grad(&grads).expect("dx").sum().into_scalar();
    let secs = start.elapsed().as_secs_f64();
    assert!(dx.is_finite());
    secs
}

/// The MoE-layer rows (module docs): sparse vs dense medians at 8 and 512 tokens.
fn moe_layer_rows(device: &Device, iters: usize) {
    let config = ModelConfig::from_hf_json(
        r#"{"model_type": "glm4_moe", "vocab_size": 1000, "hidden_size": 512,
        "intermediate_size": 1408, "moe_intermediate_size": 256, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 1.0, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "attention_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
        "initializer_range": 0.02}"#,
    )
    .expect("config");
    let device = device.clone().autodiff();
    let model = CausalLm::init(&config, &device).expect("model");
    let FeedForward::Moe(block) = &model.model.layers[1].mlp else {
        panic!("layer 1 is an MoE layer");
    };
    for tokens in [8usize, 512] {
        let x: Vec<f32> = (0..tokens * 512).map(|i| (i as f32 * 0.37).sin()).collect();
        let x = Tensor::<1>::from_floats(x.as_slice(), &device).reshape([tokens, 512]);
        let mut times = [Vec::new(), Vec::new()];
        for round in 0..=iters {
            for (mode, dispatch) in [(0, MoeDispatch::Sparse), (1, MoeDispatch::Dense)] {
                let t = moe_layer_secs(block, &x, dispatch);
                // Round 0 compiles the kernels.
                if round > 0 {
                    times[mode].push(t);
                }
            }
        }
        let [sparse, dense] = times.map(median);
        println!(
            "xtask-result: wgpu_moe_layer_{tokens}tok ours={:.2}ms baseline={:.2}ms note=one MoE block (hidden 512, 16 experts x 256, top-4, 1 shared) forward + backward of {tokens} tokens on wgpu-cpu: device-side grouping (Sparse) vs every expert on every token (Dense) in the same run (median of {iters})",
            sparse * 1e3,
            dense * 1e3,
        );
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a name filter selects nothing else here.
    let Some(device) = miles_ops::kernels::kernel_test_device("wgpu_step") else {
        return;
    };
    let vocab = env("MILES_BENCH_WGPU_VOCAB", 8_000);
    let hidden = env("MILES_BENCH_WGPU_HIDDEN", 128);
    let iters = env("MILES_BENCH_ITERS", 3).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let model = CausalLm::init(&config(vocab, hidden), &device.clone().autodiff()).expect("model");
    let inference = model.valid();
    let plan = StepPlan::new(vocab, BATCH, PROMPT, RESPONSE);
    // The training samples: one greedy rollout with routed experts and the trainer's
    // log-probs (fused ops on), used by both modes.
    miles_ops::set_fused_ops(true);
    let samples = runtime.block_on(async {
        let engine =
            miles_examples::grpo_step::step_engine(inference.clone(), BATCH).expect("engine");
        let outputs = generate_all(&engine, &plan, true).await.expect("rollout");
        engine.shutdown();
        samples_of(&plan, &outputs)
    });

    let mut train = [Vec::new(), Vec::new()];
    let mut decode = [Vec::new(), Vec::new()];
    let mut grad_norms = [0.0, 0.0];
    for round in 0..=iters {
        for (mode, fused) in [(0, true), (1, false)] {
            let mode = if round % 2 == 0 { mode } else { 1 - mode };
            let fused = if round % 2 == 0 { fused } else { !fused };
            miles_ops::set_fused_ops(fused);
            assert_eq!(miles_ops::runs_fused(&device), fused);
            let (t, norm) = train_step_secs(&model, &plan, &samples);
            let d = runtime.block_on(decode_step_secs(&inference, &plan));
            grad_norms[mode] = norm;
            if round > 0 {
                train[mode].push(t);
                decode[mode].push(d);
            }
            eprintln!(
                "wgpu_step round {round} {}: train {:.1} ms, decode step {:.2} ms",
                if fused { "fused" } else { "plain" },
                t * 1e3,
                d * 1e3
            );
        }
    }
    miles_ops::set_fused_ops(true);
    let rel = (grad_norms[0] - grad_norms[1]).abs() / grad_norms[1].abs().max(1e-12);
    assert!(
        rel < 1e-3,
        "fused and plain grad norms differ: {grad_norms:?}"
    );
    let [train_fused, train_plain] = train.map(median);
    let [decode_fused, decode_plain] = decode.map(median);
    let sizes = format!(
        "GLM-4-MoE 4 layers, hidden {hidden}, vocab {vocab}, 8 experts top-2, f32; {BATCH} sequences"
    );
    println!(
        "xtask-result: wgpu_step_train ours={:.1}ms baseline={:.1}ms note=one GRPO training step on wgpu-cpu (old log-probs, forward, backward, AdamW; TIS, R3, {BATCH} x {} tokens, one padded micro-batch), fused ops vs the plain-op path in the same run (median of {iters}); {sizes}",
        train_fused * 1e3,
        train_plain * 1e3,
        PROMPT + RESPONSE,
    );
    println!(
        "xtask-result: wgpu_step_decode ours={:.2}ms baseline={:.2}ms note=one embedded-engine decode step of {BATCH} sequences on wgpu-cpu, fused ops vs the plain-op path in the same run (median of {iters}; (t(17 tokens) - t(1 token)) / 16); {sizes}",
        decode_fused * 1e3,
        decode_plain * 1e3,
    );
    moe_layer_rows(&device, iters);
}
