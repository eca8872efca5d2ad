//! Training-step throughput on flex (2 cores, f32): forward + backward + AdamW at batch
//! 8 × 512 tokens, for the models of the miles-bridge / miles-train issues:
//! (a) GLM-4-MoE, 88 M parameters; (b) Qwen3-style dense, 25 M, tied embeddings;
//! (c) DeepSeek-V3-style, 82 M (multi-head latent attention with `q_lora_rank`, sigmoid
//! group-limited routing over 16 experts in 4 groups, a shared expert, a dense first layer,
//! YaRN RoPE); (d) Qwen3.5-MoE-style, 81 M (`qwen3_5_moe_text`: 8 layers, three Gated
//! DeltaNet linear-attention layers to one gated full-attention layer, 16 routed experts top-4
//! plus the shared expert with its sigmoid gate in every layer).
//! For the MoE model, also the same step with routing replay (R3) on, against replay off
//! measured in the same run (target ≤ 5 % overhead). Also the cost of a weight export (HF-named host tensors, f32 and bf16).
//!
//! The baseline of each group is PyTorch CPU (transformers, 2 threads, same configs and batch,
//! causal-LM loss): measured in the same run, just before ours, by `torch_train_step.py` when a
//! Python with torch is available (`MILES_TORCH_PYTHON`, or `.venv-ref/bin/python` at the
//! workspace root: a venv with torch and transformers); otherwise the issue's
//! constants measured on our machine with PyTorch 2.15, 420 tokens/s for (a) and 755 tokens/s
//! for (b) ((c) and (d) have no constant: without PyTorch their rows are skipped). Either way
//! printed as the equivalent step time, and the note says which. For (d) transformers runs its
//! PyTorch-only paths (no flash-linear-attention, no causal-conv1d on the CPU):
//! `torch_chunk_gated_delta_rule` (chunks of 64) for the delta rule and `F.conv1d` for the
//! short convolution.
//! Target: ours ≥ 0.8× PyTorch throughput, i.e. step time ≤ 1.25× the baseline; (d) ≥ 1×
//! (step time ≤ the baseline).
//!
//! The process keeps freed memory for reuse (`miles_train::retain_freed_memory`), as the
//! reference binary `examples/glm_moe_grpo.rs` does.
//!
//! Run: `cargo bench -p miles-train --bench train_step` (or `cargo xtask bench`).
//! `MILES_BENCH_ITERS` (default 2) sets the measured steps; `MILES_BENCH_ONLY=glm_moe_88m`
//! (or `qwen3_25m`, `deepseek_v3_82m`) runs one model; (d) runs only when named
//! (`qwen35_moe_80m`: HF's delta rule on the CPU takes minutes a step).
//!
//! `MILES_BENCH_RECOMPUTE=1` runs only the activation-recomputation rows instead: each model's
//! step with `--recompute-granularity full --recompute-method uniform --recompute-num-layers
//! 1` against every activation kept, each in a child process of its own, with its step time
//! and peak RSS (`MILES_BENCH_ONLY=qwen3_0_6b` adds a Qwen3-0.6B-shaped model: 28 layers,
//! hidden 1024, vocabulary 151,936, tied embeddings).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{
    CausalLm, ModelConfig, ModelInput, MoeDispatch, Precision, RecomputeConfig,
    RecomputeGranularity, RecomputeMethod, ids_tensor,
};
use miles_core::{DType, PolicyTrainer, Reward, RoutedExperts, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};

fn glm_moe_88m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "glm4_moe", "vocab_size": 32000, "hidden_size": 512,
        "intermediate_size": 1408, "moe_intermediate_size": 256, "num_hidden_layers": 8,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 1.0, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
        "attention_bias": false, "tie_word_embeddings": false, "rms_norm_eps": 1e-5,
        "initializer_range": 0.02}"#,
    )
    .expect("GLM config")
}

fn qwen3_25m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "qwen3", "vocab_size": 32000, "hidden_size": 384,
        "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "rms_norm_eps": 1e-6, "initializer_range": 0.02}"#,
    )
    .expect("Qwen3 config")
}

fn deepseek_v3_82m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "deepseek_v3", "vocab_size": 32000, "hidden_size": 512,
        "intermediate_size": 1408, "moe_intermediate_size": 224, "num_hidden_layers": 8,
        "first_k_dense_replace": 1, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "norm_topk_prob": true,
        "routed_scaling_factor": 2.5, "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "rope_interleave": true,
        "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "tie_word_embeddings": false, "rms_norm_eps": 1e-6, "initializer_range": 0.02}"#,
    )
    .expect("DeepSeek-V3 config")
}

/// The Qwen3.5-MoE-style model (81 M parameters): hidden 512, 8 layers (linear, linear,
/// linear, full) × 2; full attention 8 heads / 2 KV heads of 64 with the output gate and
/// partial rotary 0.25; Gated DeltaNet 4 key heads / 8 value heads of 64, conv kernel 4; 16
/// experts top-4 of 192 and a shared expert of 192 in every layer; untied, vocabulary 32,000
/// (`intermediate_size` is unused: every layer is MoE; our config reader asks for it).
fn qwen35_moe_80m() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "qwen3_5_moe_text", "vocab_size": 32000, "hidden_size": 512,
        "intermediate_size": 1024, "num_hidden_layers": 8,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
            "full_attention", "linear_attention", "linear_attention", "linear_attention",
            "full_attention"], "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4,
        "linear_key_head_dim": 64, "linear_num_value_heads": 8, "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 192, "shared_expert_intermediate_size": 192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25},
        "max_position_embeddings": 4096, "attention_bias": false,
        "tie_word_embeddings": false, "rms_norm_eps": 1e-6, "initializer_range": 0.02}"#,
    )
    .expect("Qwen3.5-MoE config")
}

/// A batch shape: `batch` sequences of `seq` tokens, the first `prompt` of each the prompt.
#[derive(Debug, Clone, Copy)]
struct Shape {
    batch: usize,
    seq: usize,
    prompt: usize,
}

/// The shape of every model but the 0.6B one: 8 × 512 tokens.
const SHAPE: Shape = Shape {
    batch: 8,
    seq: 512,
    prompt: 32,
};

/// The Qwen3-0.6B shape's batch: 4 × 256 tokens (at 8 × 512 PyTorch's step does not fit in
/// 24 GiB: killed by the OOM killer).
const SHAPE_0_6B: Shape = Shape {
    batch: 4,
    seq: 256,
    prompt: 32,
};

fn batch(vocab: u32, shape: Shape) -> Vec<Sample> {
    let mut next = token_source(vocab);
    (0..shape.batch)
        .map(|i| Sample {
            tokens: (0..shape.seq).map(|_| next()).collect(),
            response_length: shape.seq - shape.prompt,
            reward: Some(Reward::Scalar((i % 2) as f64)),
            group_index: Some((i / 2) as u64),
            ..Sample::default()
        })
        .collect()
}

/// Deterministic pseudo-random token ids below `vocab` (xorshift).
fn token_source(vocab: u32) -> impl FnMut() -> u32 {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % u64::from(vocab)) as u32
    }
}

/// GRPO's shape (`MILES_BENCH_SHAPE=grpo`): [`GRPO_PROMPTS`] prompts of [`GRPO_PROMPT_LEN`]
/// tokens, [`GRPO_GROUP`] responses of [`GRPO_RESPONSE`] tokens each, as `miles train` trains
/// one rollout of the `grpo_step_vs_trl` bench (4 prompts × 8 samples, ≤ 8 new tokens).
const GRPO_PROMPTS: usize = 4;
/// Responses per prompt of the GRPO shape.
const GRPO_GROUP: usize = 8;
/// Prompt tokens of the GRPO shape (a chat-templated two-digit addition is about 30).
const GRPO_PROMPT_LEN: usize = 30;
/// Response tokens of the GRPO shape.
const GRPO_RESPONSE: usize = 8;

fn grpo_batch(vocab: u32) -> Vec<Sample> {
    let mut next = token_source(vocab);
    let mut out = Vec::new();
    for g in 0..GRPO_PROMPTS {
        let prompt: Vec<u32> = (0..GRPO_PROMPT_LEN).map(|_| next()).collect();
        for k in 0..GRPO_GROUP {
            let mut tokens = prompt.clone();
            tokens.extend((0..GRPO_RESPONSE).map(|_| next()));
            out.push(Sample {
                tokens,
                response_length: GRPO_RESPONSE,
                reward: Some(Reward::Scalar((k % 2) as f64)),
                group_index: Some(g as u64),
                ..Sample::default()
            });
        }
    }
    out
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The model's own routing of every sample, as SGLang returns it (`[tokens − 1, layers,
/// top_k]`, dense layers zero), so replay follows exactly what a rollout would record.
fn attach_routing(model: &CausalLm, samples: &mut [Sample]) {
    let layers = model.config.num_hidden_layers;
    let top_k = model.config.num_experts_per_tok;
    let inference = model.valid();
    for s in samples {
        let n = s.tokens.len();
        let ids = ids_tensor(std::slice::from_ref(&s.tokens), &Device::flex()).expect("ids");
        let out = inference
            .forward(&ModelInput::new(ids), &Fallthrough)
            .expect("forward");
        let mut data = vec![0i32; (n - 1) * layers * top_k];
        for r in &out.routing {
            let ex: Vec<i64> = r
                .experts
                .clone()
                .into_data()
                .convert::<i64>()
                .try_to_vec()
                .expect("ids");
            for row in 0..n - 1 {
                for k in 0..top_k {
                    data[(row * layers + r.layer_index) * top_k + k] = ex[row * top_k + k] as i32;
                }
            }
        }
        s.rollout_routed_experts =
            Some(RoutedExperts::new(n - 1, layers, top_k, data).expect("routing"));
    }
}

/// How the measured steps train: layout, micro-batch and group size, routing replay,
/// recomputation and the compute precision.
#[derive(Debug, Clone)]
struct Setup {
    layout: BatchLayout,
    micro_batch: usize,
    group: usize,
    replay: bool,
    recompute: RecomputeConfig,
    precision: Precision,
}

impl Setup {
    /// The rows' setup: one padded micro-batch of `batch` sequences in groups of 2, f32.
    fn padded(batch: usize) -> Self {
        Self {
            layout: BatchLayout::Padded,
            micro_batch: batch,
            group: 2,
            replay: false,
            recompute: RecomputeConfig::default(),
            precision: Precision::F32,
        }
    }

    /// GRPO's setup (`MILES_BENCH_SHAPE=grpo`): the whole rollout in one shared-prefix
    /// micro-batch, as `miles train --batch-layout shared_prefix` trains it.
    fn grpo() -> Self {
        Self {
            layout: BatchLayout::SharedPrefix,
            micro_batch: GRPO_PROMPTS * GRPO_GROUP,
            group: GRPO_GROUP,
            ..Self::padded(GRPO_PROMPTS * GRPO_GROUP)
        }
    }
}

/// The measured steps' times: step, forward, backward and optimizer seconds of each.
#[derive(Debug, Default)]
struct Times {
    step: Vec<f64>,
    forward: Vec<f64>,
    backward: Vec<f64>,
    optimizer: Vec<f64>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

impl Times {
    fn mean_step(&self) -> f64 {
        mean(&self.step)
    }

    /// `forward a s, backward b s, optimizer c s` (means).
    fn phases(&self) -> String {
        format!(
            "forward {:.3} s, backward {:.3} s, optimizer {:.3} s",
            mean(&self.forward),
            mean(&self.backward),
            mean(&self.optimizer)
        )
    }
}

/// Step times of `iters` training steps after one warm-up, in the rows' setup.
fn step_times(
    model: CausalLm,
    samples: &[Sample],
    replay: bool,
    iters: usize,
) -> (Vec<f64>, Actor) {
    let setup = Setup {
        replay,
        ..Setup::padded(samples.len())
    };
    let (times, actor) = step_times_with(model, samples, &setup, iters);
    (times.step, actor)
}

/// Times of `iters` training steps after one warm-up, in `setup`.
fn step_times_with(
    model: CausalLm,
    samples: &[Sample],
    setup: &Setup,
    iters: usize,
) -> (Times, Actor) {
    let cfg = TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-5,
            ..LrSchedule::default()
        },
        micro_batch_size: setup.micro_batch,
        layout: setup.layout,
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(setup.group),
        use_routing_replay: setup.replay,
        recompute: setup.recompute,
        precision: setup.precision,
        ..TrainConfig::default()
    };
    let mut actor = Actor::new(model, cfg).expect("actor");
    let mut times = Times::default();
    for i in 0..=iters {
        let m = actor.train(i as u64, samples).expect("train");
        if i > 0 {
            // Warm-up excluded; the step time excludes the old-log-prob scoring pass.
            times.step.push(m["perf/step_time"]);
            times.forward.push(m["perf/actor_forward_time"]);
            times.backward.push(m["perf/actor_backward_time"]);
            times.optimizer.push(m["perf/optimizer_time"]);
        }
    }
    (times, actor)
}

/// The Python to measure PyTorch with: `MILES_TORCH_PYTHON`, else the workspace's
/// `.venv-ref/bin/python` when present.
fn torch_python() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("MILES_TORCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    venv.exists().then_some(venv)
}

/// PyTorch's tokens/s and peak RSS (MiB) on `name`, measured now by
/// `benches/torch_train_step.py` (the same model and batch `shape`, transformers on 2
/// threads, `dtype` `f32` or `bf16`: autocast over f32 masters), or `None` without a Python
/// with torch.
fn measure_torch(name: &str, iters: usize, shape: Shape, dtype: &str) -> Option<(f64, f64)> {
    let python = torch_python()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_train_step.py");
    let out = Command::new(&python)
        .arg(&script)
        .args(["--iters", &iters.to_string(), "--only", name])
        .args(["--batch", &shape.batch.to_string()])
        .args(["--seq", &shape.seq.to_string(), "--dtype", dtype])
        .output();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) => {
            eprintln!(
                "# PyTorch reference not measured ({}): {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            return None;
        }
        Err(e) => {
            eprintln!(
                "# PyTorch reference not measured ({}): {e}",
                python.display()
            );
            return None;
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("torch-result: {name} ")))?;
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    let tokens_per_s = field("tokens_per_s=")?;
    println!("# {name}: PyTorch measured in this run: {line}");
    Some((tokens_per_s, field("peak_rss_mib=").unwrap_or(f64::NAN)))
}

/// One model's rows; `reference_tokens_per_s` is the issue's PyTorch constant, used when
/// PyTorch cannot be measured here (a model without one is then skipped); `target` the
/// largest step-time ratio (ours ÷ PyTorch's) that meets the model's issue.
fn run(
    name: &str,
    config: ModelConfig,
    reference_tokens_per_s: Option<f64>,
    target: f64,
    iters: usize,
) {
    // PyTorch in the same run when it is available (just before ours), else the constant.
    let constant = reference_tokens_per_s.map_or("none".to_string(), |c| c.to_string());
    let (torch_tokens_per_s, baseline_note) = match (
        measure_torch(name, iters, SHAPE, "f32"),
        reference_tokens_per_s,
    ) {
        (Some((measured, _)), _) => (
            measured,
            format!(
                "PyTorch CPU (transformers, 2 threads) measured in this run at {measured:.0} tokens/s (issue constant {constant})"
            ),
        ),
        (None, Some(reference)) => (
            reference,
            format!("PyTorch CPU at {reference} tokens/s (issue constant, not measured here)"),
        ),
        (None, None) => {
            eprintln!("# {name}: skipped (PyTorch not measured and no issue constant)");
            return;
        }
    };
    let device = Device::flex().autodiff();
    let model = CausalLm::init(&config, &device).expect("init");
    let params = model.num_params();
    let mut samples = batch(config.vocab_size as u32, SHAPE);
    let tokens = (SHAPE.batch * SHAPE.seq) as f64;
    let moe = config.has_moe();
    if moe {
        attach_routing(&model, &mut samples);
    }
    let dense_model = moe.then(|| {
        let mut dense = model.clone();
        dense.set_moe_dispatch(MoeDispatch::Dense);
        dense
    });
    let (steps, actor) = step_times(model.clone(), &samples, false, iters);
    let baseline = tokens / torch_tokens_per_s;
    let mean = steps.iter().sum::<f64>() / steps.len() as f64;
    println!(
        "xtask-result: train_step_{name} ours={mean:.4}s baseline={baseline:.4}s target=<={target} \
         note=fwd+bwd+AdamW, {}x{} tokens, {params} params, mean of {} steps; baseline: \
         {baseline_note}",
        SHAPE.batch,
        SHAPE.seq,
        steps.len()
    );
    println!(
        "# {name}: {params} parameters, {:.0} tokens/s (PyTorch reference {torch_tokens_per_s} \
         tokens/s: {:.2}x), peak RSS so far {:.0} MiB",
        tokens / mean,
        tokens / mean / torch_tokens_per_s,
        peak_rss_mib()
    );
    if moe {
        // R3: the same step with every MoE layer replaying the recorded routing.
        let (replayed, _) = step_times(model, &samples, true, iters);
        let mean_fall = steps.iter().sum::<f64>() / steps.len() as f64;
        let mean_replay = replayed.iter().sum::<f64>() / replayed.len() as f64;
        println!(
            "xtask-result: train_step_r3_{name} ours={mean_replay:.4}s baseline={mean_fall:.4}s \
             target=<=1.05 note=train step with routing replay on vs off, same run"
        );
        println!(
            "# {name}: replay on {:.0} tokens/s, off {:.0} tokens/s (overhead {:+.1} %)",
            tokens / mean_replay,
            tokens / mean_fall,
            100.0 * (mean_replay / mean_fall - 1.0)
        );
    }
    if let Some(dense) = dense_model {
        // Expert dispatch: sparse (the default) against dense, same run.
        let (dense_steps, _) = step_times(dense, &samples, false, iters);
        let mean_sparse = steps.iter().sum::<f64>() / steps.len() as f64;
        let mean_dense = dense_steps.iter().sum::<f64>() / dense_steps.len() as f64;
        println!(
            "xtask-result: train_step_moe_dispatch_{name} ours={mean_sparse:.4}s \
             baseline={mean_dense:.4}s note=train step with sparse expert dispatch (the default) \
             vs dense (MoeDispatch::Dense: every expert on every token), same run"
        );
        println!(
            "# {name}: sparse dispatch {:.0} tokens/s, dense {:.0} tokens/s ({:.2}x PyTorch)",
            tokens / mean_sparse,
            tokens / mean_dense,
            tokens / mean_dense / torch_tokens_per_s
        );
    }
    let mut export = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        let t = Instant::now();
        let w = actor.export(dtype).expect("export");
        export.push((dtype, t.elapsed().as_secs_f64(), w.len()));
    }
    for (dtype, secs, n) in export {
        println!("# {name}: export {dtype} of {n} tensors in {secs:.3} s");
        println!(
            "xtask-result: export_{name}_{dtype} ours={secs:.4}s note=HF weight export of {n} \
             tensors, no baseline"
        );
    }
}

/// A Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 heads, 8 KV heads, head dim 128,
/// vocabulary 151,936, tied embeddings; 596 M parameters), trained at [`SHAPE_0_6B`].
/// `MILES_BENCH_LAYERS=N` keeps N layers only (for profiling the vocabulary-sized parts in
/// less memory; no row is recorded that way).
fn qwen3_0_6b() -> ModelConfig {
    let layers = std::env::var("MILES_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(28);
    ModelConfig::from_hf_json(&format!(
        r#"{{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": {layers}, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
        "attention_bias": false, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
        "initializer_range": 0.02}}"#
    ))
    .expect("Qwen3-0.6B config")
}

fn config_of(name: &str) -> ModelConfig {
    match name {
        "glm_moe_88m" => glm_moe_88m(),
        "qwen3_25m" => qwen3_25m(),
        "deepseek_v3_82m" => deepseek_v3_82m(),
        "qwen35_moe_80m" => qwen35_moe_80m(),
        "qwen3_0_6b" => qwen3_0_6b(),
        other => panic!("unknown model {other}"),
    }
}

/// The batch shape `name` is measured at in a child ([`SHAPE_0_6B`] for the 0.6B model).
fn shape_of(name: &str) -> Shape {
    if name == "qwen3_0_6b" {
        SHAPE_0_6B
    } else {
        SHAPE
    }
}

/// `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`
/// (Miles' model scripts' setting) for `recompute`, every activation kept otherwise.
fn recompute_config(recompute: bool) -> RecomputeConfig {
    if !recompute {
        return RecomputeConfig::default();
    }
    RecomputeConfig {
        granularity: Some(RecomputeGranularity::Full),
        method: Some(RecomputeMethod::Uniform),
        num_layers: Some(1),
    }
}

/// A child process: one model's steps in one mode, in a process of its own so its peak RSS
/// is its own. `spec` is `MODEL:MODE`, the mode `off` / `on` (recomputation, f32), `f32`,
/// `bf16` (`--bf16`: mixed precision over f32 masters) or `grpo` (GRPO's shape and layout,
/// f32; see [`grpo_batch`]).
fn child(spec: &str, iters: usize) {
    let (name, mode) = spec.split_once(':').expect("MODEL:MODE");
    let config = config_of(name);
    let model = CausalLm::init(&config, &Device::flex().autodiff()).expect("init");
    let vocab = config.vocab_size as u32;
    let (samples, setup) = match mode {
        "grpo" => (grpo_batch(vocab), Setup::grpo()),
        _ => {
            let samples = batch(vocab, shape_of(name));
            let setup = Setup {
                recompute: recompute_config(mode == "on"),
                precision: if mode == "bf16" {
                    Precision::Bf16
                } else {
                    Precision::F32
                },
                ..Setup::padded(samples.len())
            };
            (samples, setup)
        }
    };
    let (times, _) = step_times_with(model, &samples, &setup, iters);
    println!("# {name} ({mode}): {}", times.phases());
    println!(
        "bench-child: secs={:.4} peak_rss_mib={:.0}",
        times.mean_step(),
        peak_rss_mib()
    );
}

/// Runs [`child`] for `name` in `mode` in a child process: `(mean step seconds, peak RSS
/// MiB)`, or `None` when it failed (its error printed).
fn run_child(name: &str, mode: &str, iters: usize) -> Option<(f64, f64)> {
    let out = Command::new(std::env::current_exe().ok()?)
        .env("MILES_BENCH_CHILD", format!("{name}:{mode}"))
        .env("MILES_BENCH_ITERS", iters.to_string())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines().filter(|l| l.starts_with("# ")) {
        println!("{line}");
    }
    let Some(line) = text.lines().find(|l| l.starts_with("bench-child: ")) else {
        eprintln!(
            "# {name} ({mode}): the child failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    };
    let field = |key: &str| {
        line.split_whitespace()
            .find_map(|f| f.strip_prefix(key))
            .and_then(|v| v.parse::<f64>().ok())
    };
    Some((field("secs=")?, field("peak_rss_mib=")?))
}

/// The recomputation rows of `name`: step time and peak RSS with full recomputation
/// (uniform, one layer per group) against without, each in a child process, same run.
fn recompute_rows(name: &str, iters: usize) {
    let shape = shape_of(name);
    let (Some((plain_s, plain_rss)), Some((re_s, re_rss))) =
        (run_child(name, "off", iters), run_child(name, "on", iters))
    else {
        eprintln!("# {name}: a recomputation child failed");
        return;
    };
    println!(
        "xtask-result: train_step_recompute_{name} ours={re_s:.4}s baseline={plain_s:.4}s \
         note=fwd+bwd+AdamW {}x{} tokens with --recompute-granularity full \
         --recompute-method uniform --recompute-num-layers 1 vs every activation kept, same \
         run; peak RSS {re_rss:.0} MiB vs {plain_rss:.0} MiB",
        shape.batch, shape.seq
    );
    println!(
        "xtask-result: train_step_recompute_{name}_peak_rss ours={re_rss:.0}MiB \
         baseline={plain_rss:.0}MiB target=<=1 note=peak RSS of the process with full \
         recomputation (uniform, one layer per group) vs every activation kept"
    );
    println!(
        "# {name}: recompute {re_s:.2} s/step at {re_rss:.0} MiB peak RSS, plain {plain_s:.2} \
         s/step at {plain_rss:.0} MiB ({:+.1} % time, {:+.0} MiB)",
        100.0 * (re_s / plain_s - 1.0),
        re_rss - plain_rss
    );
}

/// The Qwen3-0.6B rows (issue 46): f32 and bf16 steps at [`SHAPE_0_6B`] against PyTorch in
/// the same run (each side in a process of its own, one at a time, so each peak RSS is its
/// own), target ≥ 1.5× PyTorch's tokens/s; then, with `MILES_BENCH_SHAPE=grpo`, our step
/// at GRPO's shape (no PyTorch row).
fn qwen3_0_6b_rows(iters: usize) {
    let name = "qwen3_0_6b";
    let shape = SHAPE_0_6B;
    let tokens = (shape.batch * shape.seq) as f64;
    for dtype in ["f32", "bf16"] {
        let Some((torch_tps, torch_rss)) = measure_torch(name, iters, shape, dtype) else {
            eprintln!("# {name} {dtype}: skipped (PyTorch not measured, no issue constant)");
            continue;
        };
        let Some((secs, rss)) = run_child(name, dtype, iters) else {
            continue;
        };
        let baseline = tokens / torch_tps;
        let row = if dtype == "f32" {
            format!("train_step_{name}")
        } else {
            format!("train_step_{name}_{dtype}")
        };
        println!(
            "xtask-result: {row} ours={secs:.4}s baseline={baseline:.4}s target=<=0.6667 \
             note=fwd+bwd+AdamW, {}x{} tokens, {dtype} (bf16: --bf16 over f32 masters; \
             PyTorch autocast), mean of {iters} steps; baseline: PyTorch CPU (transformers, 2 \
             threads) measured in this run at {torch_tps:.0} tokens/s; peak RSS {rss:.0} MiB vs \
             {torch_rss:.0} MiB",
            shape.batch, shape.seq
        );
        println!(
            "xtask-result: {row}_peak_rss ours={rss:.0}MiB baseline={torch_rss:.0}MiB \
             note=peak RSS of the training process, each side in a process of its own"
        );
        println!(
            "# {name} {dtype}: {:.0} tokens/s vs PyTorch {torch_tps:.0} ({:.2}x), peak RSS \
             {rss:.0} MiB vs {torch_rss:.0} MiB",
            tokens / secs,
            tokens / secs / torch_tps
        );
    }
}

fn main() {
    // As the reference binary (examples/glm_moe_grpo.rs) does.
    miles_train::retain_freed_memory();
    let iters = std::env::var("MILES_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    if let Ok(spec) = std::env::var("MILES_BENCH_CHILD") {
        child(&spec, iters);
        return;
    }
    let only = std::env::var("MILES_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if std::env::var("MILES_BENCH_SHAPE").is_ok_and(|s| s == "grpo") {
        // Ours only, GRPO's shape: the phases of one rollout's training step.
        let name = only.as_deref().unwrap_or("qwen3_0_6b");
        if let Some((secs, rss)) = run_child(name, "grpo", iters) {
            println!(
                "# {name} at GRPO's shape ({GRPO_PROMPTS} prompts x {GRPO_GROUP} samples, \
                 {GRPO_PROMPT_LEN} + {GRPO_RESPONSE} tokens, shared prefix): {secs:.3} s/step, \
                 peak RSS {rss:.0} MiB"
            );
        }
        return;
    }
    if std::env::var("MILES_BENCH_RECOMPUTE").is_ok() {
        // Only the recomputation rows; the 0.6B shape only when named.
        for name in ["glm_moe_88m", "qwen3_25m", "deepseek_v3_82m"] {
            if wanted(name) {
                recompute_rows(name, iters);
            }
        }
        if only.as_deref() == Some("qwen3_0_6b") {
            recompute_rows("qwen3_0_6b", iters);
        }
        return;
    }
    if wanted("glm_moe_88m") {
        run("glm_moe_88m", glm_moe_88m(), Some(420.0), 1.25, iters);
    }
    if wanted("qwen3_25m") {
        run("qwen3_25m", qwen3_25m(), Some(755.0), 1.25, iters);
    }
    if wanted("deepseek_v3_82m") {
        run("deepseek_v3_82m", deepseek_v3_82m(), None, 1.25, iters);
    }
    // Only when named: HF's delta rule on the CPU makes its baseline take minutes a step.
    if only.as_deref() == Some("qwen35_moe_80m") {
        run("qwen35_moe_80m", qwen35_moe_80m(), None, 1.0, iters);
    }
    // Only when named: about 15 GiB a side, minutes a step.
    if only.as_deref() == Some("qwen3_0_6b") {
        qwen3_0_6b_rows(iters);
    }
}
