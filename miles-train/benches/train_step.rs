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
    CausalLm, ModelConfig, ModelInput, MoeDispatch, RecomputeConfig, RecomputeGranularity,
    RecomputeMethod, ids_tensor,
};
use miles_core::{DType, PolicyTrainer, Reward, RoutedExperts, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};

const BATCH: usize = 8;
const SEQ: usize = 512;
const PROMPT: usize = 32;

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

fn batch(vocab: u32) -> Vec<Sample> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % u64::from(vocab)) as u32
    };
    (0..BATCH)
        .map(|i| Sample {
            tokens: (0..SEQ).map(|_| next()).collect(),
            response_length: SEQ - PROMPT,
            reward: Some(Reward::Scalar((i % 2) as f64)),
            group_index: Some((i / 2) as u64),
            ..Sample::default()
        })
        .collect()
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

/// Mean step time of `iters` training steps after one warm-up.
fn step_times(
    model: CausalLm,
    samples: &[Sample],
    replay: bool,
    iters: usize,
) -> (Vec<f64>, Actor) {
    step_times_with(model, samples, replay, iters, RecomputeConfig::default())
}

/// [`step_times`] with activation recomputation set to `recompute`.
fn step_times_with(
    model: CausalLm,
    samples: &[Sample],
    replay: bool,
    iters: usize,
    recompute: RecomputeConfig,
) -> (Vec<f64>, Actor) {
    let cfg = TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-5,
            ..LrSchedule::default()
        },
        micro_batch_size: BATCH,
        layout: BatchLayout::Padded,
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(2),
        use_routing_replay: replay,
        recompute,
        ..TrainConfig::default()
    };
    let mut actor = Actor::new(model, cfg).expect("actor");
    let mut steps = Vec::new();
    for i in 0..=iters {
        let m = actor.train(i as u64, samples).expect("train");
        if i > 0 {
            // Warm-up excluded; the step time excludes the old-log-prob scoring pass.
            steps.push(m["perf/step_time"]);
        }
    }
    (steps, actor)
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

/// PyTorch's tokens/s on `name`, measured now by `benches/torch_train_step.py` (the same
/// model and batch, transformers on 2 threads), or `None` without a Python with torch.
fn measure_torch(name: &str, iters: usize) -> Option<f64> {
    let python = torch_python()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/torch_train_step.py");
    let out = Command::new(&python)
        .arg(&script)
        .args(["--iters", &iters.to_string(), "--only", name])
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
    let value = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("tokens_per_s="))?;
    let tokens_per_s: f64 = value.parse().ok()?;
    println!("# {name}: PyTorch measured in this run: {line}");
    Some(tokens_per_s)
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
        measure_torch(name, iters),
        reference_tokens_per_s,
    ) {
        (Some(measured), _) => (
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
    let mut samples = batch(config.vocab_size as u32);
    let tokens = (BATCH * SEQ) as f64;
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
         note=fwd+bwd+AdamW, {BATCH}x{SEQ} tokens, {params} params, mean of {} steps; baseline: \
         {baseline_note}",
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
/// vocabulary 151,936, tied embeddings), for the recomputation rows only (at this bench's
/// 8 × 512 tokens PyTorch's step does not fit in 24 GiB: killed by the OOM killer).
fn qwen3_0_6b() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
        "attention_bias": false, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
        "initializer_range": 0.02}"#,
    )
    .expect("Qwen3-0.6B config")
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

/// The recomputation child: one model's steps with or without recomputation, in a process
/// of its own so its peak RSS is its own.
fn recompute_child(spec: &str, iters: usize) {
    let (name, mode) = spec.split_once(':').expect("MODEL:MODE");
    let config = match name {
        "glm_moe_88m" => glm_moe_88m(),
        "qwen3_25m" => qwen3_25m(),
        "deepseek_v3_82m" => deepseek_v3_82m(),
        "qwen35_moe_80m" => qwen35_moe_80m(),
        "qwen3_0_6b" => qwen3_0_6b(),
        other => panic!("unknown model {other}"),
    };
    let model = CausalLm::init(&config, &Device::flex().autodiff()).expect("init");
    let samples = batch(config.vocab_size as u32);
    let (steps, _) = step_times_with(
        model,
        &samples,
        false,
        iters,
        recompute_config(mode == "on"),
    );
    let mean = steps.iter().sum::<f64>() / steps.len() as f64;
    println!(
        "recompute-child: secs={mean:.4} peak_rss_mib={:.0}",
        peak_rss_mib()
    );
}

/// The recomputation rows of `name`: step time and peak RSS with full recomputation
/// (uniform, one layer per group) against without, each in a child process, same run.
fn recompute_rows(name: &str, iters: usize) {
    let child = |mode: &str| -> Option<(f64, f64)> {
        let out = Command::new(std::env::current_exe().ok()?)
            .env("MILES_BENCH_RECOMPUTE_CHILD", format!("{name}:{mode}"))
            .env("MILES_BENCH_ITERS", iters.to_string())
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find(|l| l.starts_with("recompute-child: "))?;
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(key))
                .and_then(|v| v.parse::<f64>().ok())
        };
        Some((field("secs=")?, field("peak_rss_mib=")?))
    };
    let (Some((plain_s, plain_rss)), Some((re_s, re_rss))) = (child("off"), child("on")) else {
        eprintln!("# {name}: a recomputation child failed");
        return;
    };
    println!(
        "xtask-result: train_step_recompute_{name} ours={re_s:.4}s baseline={plain_s:.4}s \
         note=fwd+bwd+AdamW {BATCH}x{SEQ} tokens with --recompute-granularity full \
         --recompute-method uniform --recompute-num-layers 1 vs every activation kept, same \
         run; peak RSS {re_rss:.0} MiB vs {plain_rss:.0} MiB"
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

fn main() {
    // As the reference binary (examples/glm_moe_grpo.rs) does.
    miles_train::retain_freed_memory();
    let iters = std::env::var("MILES_BENCH_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    if let Ok(spec) = std::env::var("MILES_BENCH_RECOMPUTE_CHILD") {
        recompute_child(&spec, iters);
        return;
    }
    let only = std::env::var("MILES_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
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
}
