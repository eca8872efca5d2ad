//! Embedded-engine throughput (issue 22: 2 cores, f32, flex): greedy decode tokens/s at 1, 8
//! and 32 concurrent sequences of 256 new tokens from 16-token prompts, prefill tokens/s of a
//! batch of 32 × 512-token prompts, and peak RSS, on the 88 M GLM-4-MoE, the 25 M
//! Qwen3-style dense model, the 82 M DeepSeek-V3-style model (latent attention decoding
//! over the compressed-latent cache) and the 81 M Qwen3.5-MoE-style hybrid (Gated DeltaNet
//! layers decoding from their per-sequence conv and recurrent states beside the paged KV
//! cache of the full-attention layers) of the training-step bench.
//!
//! Baseline: HF transformers `generate` (greedy, KV cache, float32, 2 threads) on the **same
//! random weights** (the bench exports its model to an HF directory first), measured in the
//! same run just before ours by `miles-rollout/benches/hf_generate.py` when a Python with torch
//! is available
//! (`MILES_TORCH_PYTHON`, or `.venv-ref/bin/python` at the workspace root: a venv with torch
//! and transformers). Prefill is compared with one HF forward over the
//! same batch with `logits_to_keep=1`. Without such a Python the 32-sequence rows fall back to
//! the issue's constants (GLM-4-MoE 333 tokens/s, Qwen3-style 973 tokens/s) and the notes say
//! so (the DeepSeek-V3-style model has no constant: its 32-sequence row then has no baseline).
//! Targets (ratio = our tokens/s ÷ HF's): GLM-4-MoE ≥ 2×, Qwen3-style ≥ 1.3×,
//! DeepSeek-V3-style ≥ 1× and Qwen3.5-MoE-style ≥ 2× at 32 sequences, ≥ 1× at 1 sequence and
//! for prefill. For the Qwen3.5-MoE-style model HF runs its PyTorch-only paths (no
//! flash-linear-attention or causal-conv1d on a CPU): `torch_chunk_gated_delta_rule` in the
//! prefill, `torch_recurrent_gated_delta_rule` per decoded token.
//!
//! `cargo bench -p miles-engine --features miles-ops/wgpu --bench engine_decode`
//! (or `cargo xtask bench --only engine_decode`). `MILES_BENCH_QUICK=1`: 32 new tokens and
//! 8 prefill prompts, for quick A/B runs. `MILES_BENCH_ONLY=glm_moe_88m` (or `qwen3_25m`,
//! `deepseek_v3_82m`, `qwen35_moe_80m`)
//! runs one model; `MILES_BENCH_NO_HF=1` skips the HF measurement (ours only).
//! `MILES_BENCH_PRECISION=bf16` (or `fp16`) runs the engine in that precision (weights, fused
//! copies and KV cache; default `fp32`), and HF `generate` in the same dtype.
//! `MILES_BENCH_ONLY=qwen3_0_6b` runs the Qwen3-0.6B shape (issue 46: 28 layers, hidden 1024,
//! 16 heads, 8 KV heads, head dim 128, intermediate 3072, vocabulary 151,936, tied
//! embeddings; 596 M random parameters; targets ≥ 2× HF at 32 sequences, ≥ 1× at one); it
//! runs only when named (its weights take 2.4 GB in f32 and its rows minutes).
//! `MILES_PROFILE_OPS=1` prints, after each decode row, the wall time the row spent per op
//! class (attention, projections, experts, router, `lm_head`, sampling, KV cache, …; see
//! `miles_bridge::profile`).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use common::glm_moe_88m;
use miles_bridge::{CausalLm, ModelConfig, PagedKvCache};
use miles_core::{DType, GenerateRequest, InferenceEngine, SamplingParams};
use miles_engine::{EmbeddedEngine, EngineConfig};

const PROMPT_LEN: usize = 16;
const PREFILL_LEN: usize = 512;
const ROWS: [usize; 3] = [1, 8, 32];

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

/// The DeepSeek-V3-style model of the training-step bench (82 M parameters).
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

/// The Qwen3.5-MoE-style model of the training-step bench (81 M parameters: 8 layers, three
/// Gated DeltaNet layers to one gated full-attention layer, 16 experts top-4 and a shared
/// expert in every layer).
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

/// The Qwen3-0.6B shape (596 M parameters with the tied embeddings), random weights.
fn qwen3_0_6b() -> ModelConfig {
    ModelConfig::from_hf_json(
        r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
        "attention_bias": false, "tie_word_embeddings": true, "rms_norm_eps": 1e-6,
        "initializer_range": 0.02, "max_position_embeddings": 40960}"#,
    )
    .expect("Qwen3-0.6B config")
}

/// Token `t` of prompt `i` (the same formula as `hf_generate.py`).
fn prompt(i: usize, len: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|t| ((t * 131 + i * 977 + 7) % vocab) as u32)
        .collect()
}

/// Sizes of one run.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    new_tokens: usize,
    prefill_seqs: usize,
}

/// KV tokens the largest batch of a run reserves at once: the largest decode batch of
/// [`PROMPT_LEN`] + `new_tokens`, or the prefill batch of [`PREFILL_LEN`] + 1.
/// For a hybrid model (Qwen3.5's linear-attention layers) the budget also pays for one state
/// slot per sequence of the largest batch (the engine charges each slot as its bytes' worth of
/// positions and gives the slots at most half the budget): without them its rows would
/// measure a few sequences at a time.
fn kv_budget(sizes: Sizes, model: &CausalLm) -> usize {
    let rows = ROWS
        .iter()
        .max()
        .copied()
        .unwrap_or(1)
        .max(sizes.prefill_seqs);
    let decode = ROWS.iter().max().copied().unwrap_or(1) * (PROMPT_LEN + sizes.new_tokens);
    let positions = decode.max(sizes.prefill_seqs * (PREFILL_LEN + 1));
    let state = PagedKvCache::state_bytes_per_row(model);
    if state == 0 {
        return positions;
    }
    let slots = rows * state.div_ceil(PagedKvCache::bytes_per_token(model).max(1));
    (positions + slots).max(2 * slots)
}

/// What HF transformers measured on one model.
#[derive(Debug, Default)]
struct HfFigures {
    decode: Vec<(usize, f64)>,
    prefill: Option<f64>,
    peak_rss_mib: Option<f64>,
    /// Row 0 of the largest decode batch.
    tokens: Option<(usize, Vec<u32>)>,
}

/// The Python to measure transformers with: `MILES_TORCH_PYTHON`, else the workspace's
/// `.venv-ref/bin/python` when present.
fn torch_python() -> Option<PathBuf> {
    if std::env::var_os("MILES_BENCH_NO_HF").is_some() {
        return None;
    }
    if let Ok(p) = std::env::var("MILES_TORCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    if !venv.exists() {
        eprintln!(
            "# HF transformers not measured: no MILES_TORCH_PYTHON and no {}",
            venv.display()
        );
        return None;
    }
    Some(venv)
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key)?.strip_prefix('='))
}

/// Runs `hf_generate.py` on the exported model directory; `None` without a Python with torch.
fn measure_hf(name: &str, dir: &Path, sizes: Sizes) -> Option<HfFigures> {
    let python = torch_python()?;
    // The script lives beside the rollout benches (it predates the engine's own crate).
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../miles-rollout/benches/hf_generate.py");
    let seqs = ROWS.map(|r| r.to_string()).join(",");
    let out = Command::new(&python)
        .arg(&script)
        .arg("--model-dir")
        .arg(dir)
        .args(["--name", name, "--seqs", &seqs])
        .args(["--new-tokens", &sizes.new_tokens.to_string()])
        .args(["--prompt-len", &PROMPT_LEN.to_string()])
        .args(["--prefill-seqs", &sizes.prefill_seqs.to_string()])
        .args(["--prefill-len", &PREFILL_LEN.to_string()])
        .args(["--dtype", hf_dtype(bench_precision())])
        .output();
    let out = match out {
        Ok(out) if out.status.success() => out,
        Ok(out) => {
            eprintln!(
                "# HF transformers not measured ({}): {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            return None;
        }
        Err(e) => {
            eprintln!("# HF transformers not measured ({}): {e}", python.display());
            return None;
        }
    };
    let mut figures = HfFigures::default();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(rest) = line.strip_prefix(&format!("hf-result: {name} ")) {
            println!("# {name}: HF transformers measured in this run: {rest}");
            let tps = field(rest, "tokens_per_s").and_then(|v| v.parse::<f64>().ok());
            if rest.starts_with("decode ") {
                let seqs = field(rest, "seqs").and_then(|v| v.parse::<usize>().ok());
                if let (Some(seqs), Some(tps)) = (seqs, tps) {
                    figures.decode.push((seqs, tps));
                }
            } else if rest.starts_with("prefill ") {
                figures.prefill = tps;
            } else if let Some(m) = field(rest, "peak_rss_mib") {
                figures.peak_rss_mib = m.parse().ok();
            }
        } else if let Some(rest) = line.strip_prefix(&format!("hf-tokens: {name} ")) {
            let seqs = field(rest, "seqs").and_then(|v| v.parse::<usize>().ok());
            let ids = field(rest, "ids").map(|v| {
                v.split(',')
                    .filter_map(|t| t.parse::<u32>().ok())
                    .collect::<Vec<_>>()
            });
            if let (Some(seqs), Some(ids)) = (seqs, ids) {
                figures.tokens = Some((seqs, ids));
            }
        }
    }
    Some(figures)
}

/// `MILES_BENCH_PRECISION` (`fp32` default, `bf16`, `fp16`): the engine's precision.
fn bench_precision() -> miles_bridge::Precision {
    std::env::var("MILES_BENCH_PRECISION")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or_default()
}

/// torch's name of `precision`'s dtype (HF runs in the engine's precision).
fn hf_dtype(precision: miles_bridge::Precision) -> &'static str {
    match precision {
        miles_bridge::Precision::F32 => "float32",
        miles_bridge::Precision::Bf16 => "bfloat16",
        miles_bridge::Precision::F16 => "float16",
    }
}

/// Resets the process's peak-RSS mark (Linux `clear_refs` 5), so each model's peak is its own.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident set size of this process since the last reset, in MiB (0 where unknown).
fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Decodes `seqs` greedy requests of `new_tokens` concurrently; seconds and row 0's tokens.
async fn decode(
    engine: &Arc<EmbeddedEngine>,
    seqs: usize,
    new_tokens: usize,
    vocab: usize,
) -> (f64, Vec<u32>) {
    let started = Instant::now();
    let handles: Vec<_> = (0..seqs)
        .map(|i| {
            let e = engine.clone();
            let mut req = GenerateRequest::new(
                prompt(i, PROMPT_LEN, vocab),
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
    let mut first = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let out = h.await.expect("task").expect("generate");
        generated += out.output_ids.len();
        if i == 0 {
            first = out.output_ids;
        }
    }
    assert_eq!(generated, seqs * new_tokens);
    (started.elapsed().as_secs_f64(), first)
}

/// Prefills `seqs` prompts of [`PREFILL_LEN`] tokens (one new token each); seconds.
async fn prefill(engine: &Arc<EmbeddedEngine>, seqs: usize, vocab: usize) -> f64 {
    let started = Instant::now();
    let handles: Vec<_> = (0..seqs)
        .map(|i| {
            let e = engine.clone();
            let req = GenerateRequest::new(
                prompt(100 + i, PREFILL_LEN, vocab),
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
    started.elapsed().as_secs_f64()
}

fn result_line(row: &str, ours: f64, baseline: Option<f64>, target: Option<f64>, note: &str) {
    let baseline = baseline.map_or("-".to_string(), |b| format!("{b:.1}tok/s"));
    let target = target.map_or(String::new(), |t| format!(" target=>={t}"));
    println!("xtask-result: {row} ours={ours:.1}tok/s baseline={baseline}{target} note={note}");
}

/// One model's rows; `issue_hf_32` is the issue's HF tokens/s at 32 sequences, the baseline
/// when HF cannot be measured here (none: no baseline then).
async fn run(
    name: &str,
    config: ModelConfig,
    issue_hf_32: Option<f64>,
    target_32: f64,
    sizes: Sizes,
) {
    let vocab = config.vocab_size;
    let new_tokens = sizes.new_tokens;
    let model = CausalLm::init(&config, &Device::flex()).expect("model");
    let params = model.num_params();
    // The same random weights for both engines: export ours as an HF directory.
    let dir =
        std::env::temp_dir().join(format!("miles-engine-decode-{name}-{}", std::process::id()));
    model
        .save_pretrained(&dir, DType::F32, None)
        .expect("export the bench model");
    let hf = measure_hf(name, &dir, sizes);
    let _ = std::fs::remove_dir_all(&dir);
    let measured = hf.is_some();
    let hf = hf.unwrap_or_default();
    let source = if measured {
        format!(
            "HF transformers generate measured in this run on the same weights ({}, 2 threads)",
            hf_dtype(bench_precision())
        )
    } else if let Some(constant) = issue_hf_32 {
        format!(
            "HF transformers generate at {constant} tokens/s (issue constant, not measured \
             here: no Python with torch)"
        )
    } else {
        "none (HF not measured in this run, no issue constant)".to_string()
    };

    let budget = kv_budget(sizes, &model);
    reset_peak_rss();
    let engine = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                recompute_logprobs_via_prefill: false,
                prefix_cache_tokens: 0,
                precision: bench_precision(),
                // The KV pool is allocated once for this budget: what the largest batch of
                // the run needs at once (the decode rows, or the prefill batch).
                kv_token_budget: budget,
                ..EngineConfig::default()
            },
        )
        .expect("engine"),
    );
    decode(&engine, 2, 4, vocab).await; // warm-up
    for seqs in ROWS {
        miles_bridge::profile::reset();
        let (secs, first) = decode(&engine, seqs, new_tokens, vocab).await;
        print_profile(name, &format!("{seqs} sequences"));
        let tps = (seqs * new_tokens) as f64 / secs;
        let baseline = hf
            .decode
            .iter()
            .find(|(s, _)| *s == seqs)
            .map(|(_, t)| *t)
            .or(issue_hf_32.filter(|_| !measured && seqs == 32));
        let ratio = baseline.map_or(String::new(), |b| format!(", {:.2}x HF", tps / b));
        println!(
            "# engine {name}: {seqs} sequences x {new_tokens} new tokens: {secs:.2} s, \
             {tps:.0} tokens/s{ratio}, peak RSS so far {:.0} MiB",
            peak_rss_mib()
        );
        if let Some((hf_seqs, hf_ids)) = &hf.tokens
            && *hf_seqs == seqs
        {
            let agree = first.iter().zip(hf_ids).take_while(|(a, b)| a == b).count();
            println!(
                "# engine {name}: row 0 greedy tokens agree with HF for {agree} of {} tokens",
                first.len()
            );
        }
        let target = match seqs {
            32 => Some(target_32),
            1 => Some(1.0),
            _ => None,
        };
        let baseline_note = if measured || seqs == 32 {
            source.as_str()
        } else {
            "no baseline (HF not measured in this run)"
        };
        result_line(
            &format!("engine_decode_{name}_{seqs}seq"),
            tps,
            baseline,
            target,
            &format!(
                "{seqs}x{new_tokens} greedy decode from {PROMPT_LEN}-token prompts, {params} \
                 params, {} flex, 2 threads; baseline: {baseline_note}",
                bench_precision()
            ),
        );
    }
    let decode_peak = peak_rss_mib();
    miles_bridge::profile::reset();
    let secs = prefill(&engine, sizes.prefill_seqs, vocab).await;
    print_profile(name, "prefill");
    let tokens = (sizes.prefill_seqs * PREFILL_LEN) as f64;
    let tps = tokens / secs;
    println!(
        "# engine {name}: prefill {tps:.0} tokens/s ({} x {PREFILL_LEN} tokens in {secs:.2} s)",
        sizes.prefill_seqs
    );
    result_line(
        &format!("engine_prefill_{name}"),
        tps,
        hf.prefill,
        Some(1.0),
        &format!(
            "{} x {PREFILL_LEN}-token prompts, one new token each; baseline: {}",
            sizes.prefill_seqs,
            if measured {
                "one HF forward over the same batch (logits_to_keep=1), measured in this run"
            } else {
                "none (HF not measured in this run)"
            }
        ),
    );
    let hf_rss = hf
        .peak_rss_mib
        .map_or("-".to_string(), |m| format!("{m:.0}MiB"));
    println!(
        "xtask-result: engine_peak_rss_{name} ours={decode_peak:.0}MiB baseline={hf_rss} \
         note=peak RSS through the decode rows (up to 32x{new_tokens}), whole process; \
         baseline: the HF process's peak (decode and prefill)"
    );
    drop(engine);
}

fn main() {
    let quick = std::env::var_os("MILES_BENCH_QUICK").is_some();
    let sizes = if quick {
        Sizes {
            new_tokens: 32,
            prefill_seqs: 8,
        }
    } else {
        Sizes {
            new_tokens: 256,
            prefill_seqs: 32,
        }
    };
    let only = std::env::var("MILES_BENCH_ONLY").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        if wanted("glm_moe_88m") {
            run("glm_moe_88m", glm_moe_88m(), Some(333.0), 2.0, sizes).await;
        }
        if wanted("qwen3_25m") {
            run("qwen3_25m", qwen3_25m(), Some(973.0), 1.3, sizes).await;
        }
        if wanted("deepseek_v3_82m") {
            run("deepseek_v3_82m", deepseek_v3_82m(), None, 1.0, sizes).await;
        }
        // Only when named: HF's delta rule on CPU makes its baseline take many minutes.
        if only.as_deref() == Some("qwen35_moe_80m") {
            run("qwen35_moe_80m", qwen35_moe_80m(), None, 2.0, sizes).await;
        }
        // Only when named: minutes of decode and prefill at this size.
        if only.as_deref() == Some("qwen3_0_6b") {
            run("qwen3_0_6b", qwen3_0_6b(), None, 2.0, sizes).await;
        }
    });
}

/// With `MILES_PROFILE_OPS`, the time per op class since the last reset, for `what`.
fn print_profile(name: &str, what: &str) {
    if miles_bridge::profile::enabled() {
        println!(
            "# engine {name}: {what}, time per op class (MILES_PROFILE_OPS): {}",
            miles_bridge::profile::report()
        );
    }
}
