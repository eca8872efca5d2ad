//! The loop a user runs, side by side with TRL: seconds per GRPO step, peak RSS and time to
//! reward of `miles train` (sync) and `miles train-async` against TRL's `GRPOTrainer` (CPU,
//! its HF `generate` rollouts), in the same run, on the same HF checkpoint directory, prompts,
//! reward, group size, batch sizes, response length, learning rate and steps.
//!
//! The shape is RL's: 32 prompts × 8 samples (4 × 8 at the 0.6B shape), ≤ 8 new tokens, one
//! optimizer step of all the samples per rollout in one micro-batch (TRL's
//! `per_device_train_batch_size` 256; miles `--micro-batch-size 256 --batch-layout
//! shared_prefix`: one row per prompt, its 8 responses after it; the training forward then
//! gives the old log-probs and the engine does not re-score), lr 1e-4, no KL, no reference
//! model; the
//! reference task's prompts (`data/train.jsonl` of `glm_moe_grpo`: two-digit additions,
//! chat template with
//! `enable_thinking: false`) and an exact-match reward (miles' `--rm-type exact_match`; the
//! Python twin in `trl_grpo_step.py`). Models:
//! * `reference`: the reference run's warm-started tiny GLM-4-MoE (`glm_moe_grpo --num-rollout
//!   0` writes it, with the prompts; its answers are short, so most responses stop early);
//! * `glm_moe_88m`: the GLM-4-MoE of the `train_step` / `engine_decode` benches (88 M
//!   parameters, vocabulary 32,000, random weights, the toy tokenizer and chat template): every
//!   response runs to the 8-token limit;
//! * `qwen3_0_6b`: a Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 heads, 8 KV heads,
//!   head dim 128, intermediate 3072, vocabulary 151,936, tied embeddings: 596 M parameters,
//!   random weights made by the bench, f32) with Qwen3's tokenizer and chat template
//!   (`fixtures/tokenizers/qwen3`), at **4 prompts × 8 samples** (the batch issue 46 measured
//!   TRL at: 27 s a step, 11.7 GB). Only with `MILES_BENCH_ONLY=qwen3_0_6b` (its
//!   weights take 2.4 GB on disk and a run minutes).
//!
//! TRL runs with its `GRPOConfig` defaults, which the bench keeps: `gradient_checkpointing`
//! on (each decoder layer's activations recomputed in the backward) and `bf16` on (on CPU,
//! accelerate's bf16 autocast: the training pass's matmuls in bf16, the weights and AdamW in
//! f32). miles trains in f32 (its `--bf16` falls back to flex's bf16 matmul on a CPU without
//! AMX, slower here). At the 0.6B shape, where memory binds, miles runs with the same
//! activation checkpointing, under Megatron's names (`--recompute-granularity full
//! --recompute-method uniform --recompute-num-layers 1`: every layer's activations recomputed
//! in the backward); at the two small shapes without it (their peak RSS is well under TRL's
//! either way).
//!
//! `miles` runs with its default KV pool, which `miles train` sizes to the rollout (the
//! sequences it runs at once × the longest prompt plus the response limit: 256 × 64 = 16,384
//! positions at 32 × 8 here) rather than SGLang's memory fraction: it releases its engine's
//! pool during each training step (`--offload-rollout`) and takes it back at the push.
//!
//! Each configuration runs as its own process (`/usr/bin/time` gives its peak RSS); a step's
//! time is the loop's `perf/step_time` (rollout + training + weight update) for miles and
//! `on_step_begin` → `on_step_end` (generation + scoring + training) for TRL, the first step
//! (warm-up) left out. The three run in turn, twice (`MILES_BENCH_ROUNDS`), and the rows give
//! the mean of the rounds with every round's figure in the note (the spread, never only the
//! best).
//!
//! **Time to reward** (`grpo_time_to_reward_reference_sync` / `_async`): on the reference
//! warm-start with the step rows' hyperparameters (32 × 8, ≤ 8 new tokens, lr 1e-4, no KL,
//! one optimizer step per rollout), the prompts are the 2,800 training problems the
//! warm-start did not demonstrate (`data/undemonstrated.jsonl`, written from `train.jsonl`:
//! the prompts `glm_moe_grpo`'s GRPO samples; on the first 1,000 of `train.jsonl`, the
//! demonstrated ones, the warm-start already scores about 0.7 and the batch-to-batch spread
//! hides the rise), in file order on both sides. Each round runs TRL, `miles train` and
//! `miles train-async` for up to 60 steps (`MILES_BENCH_REWARD_STEPS`) and records each
//! step's mean reward (miles' `rollout/raw_reward` in `metrics.jsonl`, TRL's logged `reward`:
//! both the mean exact-match reward of the step's rollout, before its update) and time. The
//! figure is the seconds from the first step's start until the mean reward of 5 consecutive
//! steps (`MILES_BENCH_REWARD_WINDOW`) first reaches 0.72 (`MILES_BENCH_REWARD_THRESHOLD`):
//! the sum of the step times (the clocks above, first step included) up to and including the
//! step that completes the window; process start-up and model loading are counted on neither
//! side. TRL stops there (`--stop-reward`); miles runs its budget and the crossing is read
//! from its metrics by the same rule. The warm-start scores about 0.6 on these prompts
//! (frozen, lr 0, its 5-step mean stays at or under 0.64 over the 60 steps); trained, TRL and
//! `miles train` pass 0.72 after 24–25 steps, `train-async` (its rollouts one weight version
//! behind) after 25–35 (the runs so far). Round `r` seeds TRL with `1 + r` and miles'
//! sampling (`--rollout-seed`) with `42 + 1,000,000 r`: the rounds differ in their samples,
//! and the note gives every round's steps, seconds and reward (first window → the window that
//! reached). A side that misses the threshold in a round has no figure: its row says so
//! (`baseline=-`, or `ours` missing) with what the run reached instead. The time-to-reward
//! rows run in the default run (after the step rows) and alone with
//! `MILES_BENCH_ONLY=reward`.
//!
//! Needs: the `miles` binary and the `glm_moe_grpo` example, built in the same target dir
//! (`cargo build --release --bin miles --example glm_moe_grpo`; or `MILES_BIN`,
//! `MILES_GRPO_EXAMPLE`), and a Python with torch, transformers and trl
//! (`MILES_TORCH_PYTHON`, or `.venv-ref/bin/python` at the workspace root). Without them the
//! rows are skipped with a note. `MILES_BENCH_ONLY=reference` (or `glm_moe_88m`,
//! `qwen3_0_6b`) runs one model's step rows, `MILES_BENCH_ONLY=reward` the time-to-reward rows
//! (without it: the first two models' step rows, then the time-to-reward rows);
//! `MILES_BENCH_STEPS` (default 3) sets the steps of each step-row run; `MILES_BENCH_ROUNDS`
//! (default 2) the rounds of both; `MILES_BENCH_QUICK=1`: 2 steps, one round. Work files go to
//! `target/grpo_step_vs_trl/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelConfig};
use miles_core::DType;
use miles_examples::toy::{ToyModelSpec, write_model_dir};

type BoxError = Box<dyn std::error::Error>;

/// Prompts per step at the reference and 88 M shapes.
const PROMPTS: usize = 32;
/// Prompts per step at the 0.6B shape (issue 46's TRL measurement).
const PROMPTS_0_6B: usize = 4;
const GROUP: usize = 8;
const MAX_NEW: usize = 8;
const LR: &str = "1e-4";
/// Time to reward: the step budget of each run (`MILES_BENCH_REWARD_STEPS`).
const REWARD_STEPS: usize = 60;
/// Time to reward: the steps the reward is averaged over (`MILES_BENCH_REWARD_WINDOW`).
const REWARD_WINDOW: usize = 5;
/// Time to reward: the threshold on that mean (`MILES_BENCH_REWARD_THRESHOLD`). The
/// warm-start scores about 0.6 on these prompts; frozen (lr 0), its 5-step mean stays at or
/// under 0.64 over the 60 steps; trained, both trainers pass 0.72 after about 25 steps.
const REWARD_THRESHOLD: f64 = 0.72;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// `target/release` of this bench (its executable lives in `target/release/deps`).
fn profile_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.parent()?.to_path_buf())
}

fn found(var: &str, default: Option<PathBuf>) -> Option<PathBuf> {
    std::env::var_os(var)
        .map(PathBuf::from)
        .or(default)
        .filter(|p| p.exists())
}

fn python() -> Option<PathBuf> {
    found(
        "MILES_TORCH_PYTHON",
        Some(workspace_root().join(".venv-ref/bin/python")),
    )
}

/// The 88 M GLM-4-MoE of the train_step / engine_decode benches, written with the toy
/// tokenizer and chat template (vocabulary padded to 32,000 ids, random weights).
fn write_88m(dir: &Path) -> Result<(), BoxError> {
    if dir.join("model.safetensors").exists() {
        return Ok(());
    }
    let spec = ToyModelSpec {
        hidden_size: 512,
        num_hidden_layers: 8,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        head_dim: 64,
        intermediate_size: 1408,
        moe_intermediate_size: 256,
        n_routed_experts: 16,
        num_experts_per_tok: 4,
        n_shared_experts: 1,
        max_position_embeddings: 2048,
        ..ToyModelSpec::default()
    };
    let device = Device::flex();
    // The toy directory (tokenizer, chat template, special ids), then the model again at the
    // benches' vocabulary.
    let info = write_model_dir(dir, &spec, 7, &device)?;
    let config = spec.config_json(32_000, info.eos_token_id, info.pad_token_id);
    let model_config = ModelConfig::from_hf_json(&config.to_string())?;
    device.seed(7);
    let model = CausalLm::init(&model_config, &device)?;
    model.save_pretrained(dir, DType::F32, None)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    println!(
        "wrote {}: GLM-4-MoE, {:.1} M parameters",
        dir.display(),
        model.num_params() as f64 / 1e6
    );
    Ok(())
}

/// The Qwen3-0.6B shape (596 M parameters, random weights, f32) with Qwen3's tokenizer and
/// chat template from `fixtures/tokenizers/qwen3` (151,669 ids; the vocabulary is padded to
/// 151,936 as the released checkpoint's is).
fn write_qwen3_0_6b(dir: &Path) -> Result<(), BoxError> {
    if dir.join("model.safetensors").exists() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151_936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40_960,
        "rope_theta": 1_000_000.0,
        "rope_scaling": null,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": 28,
        "tie_word_embeddings": true,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "bos_token_id": 151_643,
        "eos_token_id": 151_645,
        "torch_dtype": "float32",
        "use_cache": true
    });
    let model_config = ModelConfig::from_hf_json(&config.to_string())?;
    let device = Device::flex();
    device.seed(7);
    let model = CausalLm::init(&model_config, &device)?;
    model.save_pretrained(dir, DType::F32, None)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    // Qwen3's generation config: both end-of-turn ids stop.
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&serde_json::json!({
            "bos_token_id": 151_643,
            "eos_token_id": [151_645, 151_643],
            "pad_token_id": 151_643
        }))?,
    )?;
    let fixture = workspace_root().join("fixtures/tokenizers/qwen3");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(fixture.join(file), dir.join(file))?;
    }
    println!(
        "wrote {}: Qwen3-0.6B shape, {:.1} M parameters",
        dir.display(),
        model.num_params() as f64 / 1e6
    );
    Ok(())
}

/// The reference run's warm-start and prompts (`glm_moe_grpo --num-rollout 0`).
fn write_reference(example: &Path, out: &Path) -> Result<(), BoxError> {
    if out.join("warm_start/model.safetensors").exists() {
        return Ok(());
    }
    let status = Command::new(example)
        .args(["--num-rollout", "0", "--output-dir"])
        .arg(out)
        .status()?;
    if !status.success() {
        return Err(format!("{} --num-rollout 0 failed: {status}", example.display()).into());
    }
    Ok(())
}

/// The training problems the warm-start did not demonstrate, in `train.jsonl`'s order: the
/// prompts `glm_moe_grpo`'s GRPO samples (`--grpo-prompts undemonstrated`), where the reward
/// has room to rise (the first 1,000 of `train.jsonl` are the warm-start's demonstrations).
fn write_undemonstrated(reference: &Path) -> Result<PathBuf, BoxError> {
    let out = reference.join("data/undemonstrated.jsonl");
    if out.exists() {
        return Ok(out);
    }
    let input = |line: &str| -> Result<String, BoxError> {
        let row: serde_json::Value = serde_json::from_str(line)?;
        Ok(row["input"].to_string())
    };
    let shown = std::fs::read_to_string(reference.join("data/warm_start.jsonl"))?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(input)
        .collect::<Result<std::collections::HashSet<_>, _>>()?;
    let mut text = String::new();
    for line in std::fs::read_to_string(reference.join("data/train.jsonl"))?.lines() {
        if !line.trim().is_empty() && !shown.contains(&input(line)?) {
            text.push_str(line);
            text.push('\n');
        }
    }
    if text.is_empty() {
        return Err("every training problem of the reference run is demonstrated".into());
    }
    std::fs::write(&out, text)?;
    Ok(out)
}

/// Runs `cmd` under `/usr/bin/time`; returns its stdout and peak RSS (MiB).
fn run_measured(mut cmd: Command, rss_file: &Path) -> Result<(String, f64), BoxError> {
    let out = cmd.output()?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(20)
                .collect::<Vec<_>>()
                .join("\n")
        )
        .into());
    }
    let kib: f64 = std::fs::read_to_string(rss_file)?
        .lines()
        .rev()
        .find_map(|l| l.trim().parse().ok())
        .ok_or("no peak RSS from /usr/bin/time")?;
    Ok((
        String::from_utf8_lossy(&out.stdout).into_owned(),
        kib / 1024.0,
    ))
}

fn timed(program: &Path, rss_file: &Path) -> Command {
    let mut cmd = Command::new("/usr/bin/time");
    cmd.arg("-f").arg("%M").arg("-o").arg(rss_file).arg(program);
    cmd
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

/// Mean seconds per step, peak RSS (MiB) and the mean of each phase's `perf/…` figure.
type MilesRun = (f64, f64, Vec<(String, f64)>);

/// One `miles train` / `train-async` run: its per-step records of `metrics.jsonl` (those
/// with `perf/step_time`, in step order) and its peak RSS (MiB).
#[allow(clippy::too_many_arguments)]
fn miles_records(
    miles: &Path,
    subcommand: &str,
    model: &Path,
    data: &Path,
    work: &Path,
    steps: usize,
    prompts: usize,
    extra: &[&str],
) -> Result<(Vec<serde_json::Value>, f64), BoxError> {
    let out = work.join(subcommand);
    let _ = std::fs::remove_dir_all(&out);
    let rss = work.join(format!("{subcommand}.rss"));
    let mut cmd = timed(miles, &rss);
    cmd.arg(subcommand)
        .arg("--hf-checkpoint")
        .arg(model)
        .arg("--prompt-data")
        .arg(data)
        .args(["--apply-chat-template", "--apply-chat-template-kwargs"])
        .arg(r#"{"enable_thinking": false}"#)
        .args(["--input-key", "input", "--label-key", "label"])
        .args(["--rm-type", "exact_match"])
        .args(["--num-rollout", &steps.to_string()])
        .args(["--rollout-batch-size", &prompts.to_string()])
        .args(["--n-samples-per-prompt", &GROUP.to_string()])
        .args(["--global-batch-size", &(prompts * GROUP).to_string()])
        .args(["--rollout-max-response-len", &MAX_NEW.to_string()])
        .args(["--max-running-requests", &(prompts * GROUP).to_string()])
        // TRL's batch: the whole step in one micro-batch (per_device_train_batch_size), each
        // group's prompt computed once for its 8 responses (shared-prefix rows).
        .args(["--micro-batch-size", &(prompts * GROUP).to_string()])
        .args(["--batch-layout", "shared_prefix"])
        .args(["--lr", LR, "--lr-warmup-iters", "0", "--weight-decay", "0"])
        .args(["--clip-grad", "1.0", "--log-level", "warn"])
        .args(extra)
        .arg("--output-dir")
        .arg(&out);
    let (_, peak) = run_measured(cmd, &rss)?;
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let records: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("perf/step_time").is_some())
        .collect();
    Ok((records, peak))
}

/// One `miles train` / `train-async` run: mean seconds per step (first left out), peak RSS
/// and the mean of the phases' `perf/…` figures over the same steps.
#[allow(clippy::too_many_arguments)]
fn run_miles(
    miles: &Path,
    subcommand: &str,
    model: &Path,
    data: &Path,
    work: &Path,
    steps: usize,
    prompts: usize,
    extra: &[&str],
) -> Result<MilesRun, BoxError> {
    let (records, peak) =
        miles_records(miles, subcommand, model, data, work, steps, prompts, extra)?;
    let measured = &records[records.len().min(1)..];
    if measured.is_empty() {
        return Err(format!("{subcommand}: fewer than 2 steps in metrics.jsonl").into());
    }
    let get = |key: &str| -> f64 {
        mean(
            &measured
                .iter()
                .filter_map(|r| r.get(key).and_then(serde_json::Value::as_f64))
                .collect::<Vec<_>>(),
        )
    };
    let phases = [
        "perf/rollout_time",
        "perf/rollout_wait_time",
        "perf/log_probs_time",
        "perf/actor_forward_time",
        "perf/actor_backward_time",
        "perf/optimizer_time",
        "perf/update_weights_time",
    ]
    .iter()
    .filter(|k| measured.iter().any(|r| r.get(**k).is_some()))
    .map(|k| (k.trim_start_matches("perf/").to_string(), get(k)))
    .collect();
    Ok((get("perf/step_time"), peak, phases))
}

/// One run of `trl_grpo_step.py` (`extra`: its further flags): its result line and peak RSS
/// (MiB).
fn trl_result(
    python: &Path,
    model: &Path,
    data: &Path,
    work: &Path,
    steps: usize,
    prompts: usize,
    extra: &[String],
) -> Result<(serde_json::Value, f64), BoxError> {
    let rss = work.join("trl.rss");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/trl_grpo_step.py");
    let mut cmd = timed(python, &rss);
    cmd.arg(script)
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(data)
        .args(["--prompts", &prompts.to_string()])
        .args(["--group", &GROUP.to_string()])
        .args(["--max-new-tokens", &MAX_NEW.to_string()])
        .args(["--lr", LR, "--steps", &steps.to_string(), "--threads", "2"])
        .args(extra)
        .arg("--output-dir")
        .arg(work.join("trl"));
    let (stdout, peak) = run_measured(cmd, &rss)?;
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or("no result line from trl_grpo_step.py")?;
    Ok((serde_json::from_str(line)?, peak))
}

/// One TRL run: mean seconds per step (first left out) and peak RSS.
fn run_trl(
    python: &Path,
    model: &Path,
    data: &Path,
    work: &Path,
    steps: usize,
    prompts: usize,
) -> Result<(f64, f64), BoxError> {
    let (v, peak) = trl_result(python, model, data, work, steps, prompts, &[])?;
    let secs: Vec<f64> = v["step_seconds"]
        .as_array()
        .ok_or("no step_seconds")?
        .iter()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    let measured = &secs[secs.len().min(1)..];
    if measured.is_empty() {
        return Err("trl: fewer than 2 steps".into());
    }
    Ok((mean(measured), peak))
}

/// One time-to-reward run: each step's seconds (rollout + training + weight update) and mean
/// reward, in step order.
struct Curve {
    secs: Vec<f64>,
    rewards: Vec<f64>,
}

impl Curve {
    /// From `miles`' per-step records: `perf/step_time` and `rollout/raw_reward`.
    fn from_miles(records: &[serde_json::Value]) -> Result<Self, BoxError> {
        let series = |key: &str| -> Result<Vec<f64>, BoxError> {
            records
                .iter()
                .map(|r| {
                    r.get(key)
                        .and_then(serde_json::Value::as_f64)
                        .ok_or_else(|| format!("a step without {key} in metrics.jsonl").into())
                })
                .collect()
        };
        Ok(Self {
            secs: series("perf/step_time")?,
            rewards: series("rollout/raw_reward")?,
        })
    }

    /// From `trl_grpo_step.py`'s result line: `step_seconds` and `rewards`.
    fn from_trl(result: &serde_json::Value) -> Result<Self, BoxError> {
        let series = |key: &str| -> Result<Vec<f64>, BoxError> {
            result[key]
                .as_array()
                .ok_or_else(|| format!("no {key} from trl_grpo_step.py"))?
                .iter()
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| format!("{key}: {v} is not a number").into())
                })
                .collect()
        };
        let secs = series("step_seconds")?;
        let rewards = series("rewards")?;
        if secs.len() != rewards.len() {
            return Err(format!(
                "trl_grpo_step.py: {} step times but {} rewards",
                secs.len(),
                rewards.len()
            )
            .into());
        }
        Ok(Self { secs, rewards })
    }

    /// The mean reward of each `window` consecutive steps, the window ending at step `k`
    /// (1-based) at index `k - window`.
    fn rolling(&self, window: usize) -> Vec<f64> {
        self.rewards.windows(window).map(mean).collect()
    }

    /// The steps until the mean reward of the last `window` steps first reaches `threshold`,
    /// and the seconds of those steps from the first step's start; `None` when it does not
    /// in the run.
    fn reached(&self, window: usize, threshold: f64) -> Option<(usize, f64)> {
        let k = self.rolling(window).iter().position(|&r| r >= threshold)? + window;
        Some((k, self.secs[..k].iter().sum()))
    }

    /// `25 steps 2.41s (0.62->0.73)`: steps and seconds to the threshold, the mean reward of
    /// the first `window` steps and of the `window` that reached it; or what the run did
    /// instead.
    fn summary(&self, window: usize, threshold: f64) -> String {
        let rolling = self.rolling(window);
        let first = rolling.first().copied().unwrap_or(f64::NAN);
        match self.reached(window, threshold) {
            Some((k, secs)) => format!(
                "{k} steps {secs:.2}s ({first:.2}->{:.2})",
                rolling[k - window]
            ),
            None => format!(
                "not reached in {} steps {:.2}s ({first:.2}, best {:.2})",
                self.rewards.len(),
                self.secs.iter().sum::<f64>(),
                rolling.iter().copied().fold(f64::NAN, f64::max)
            ),
        }
    }
}

/// The time-to-reward rows (`grpo_time_to_reward_reference_{sync,async}`): TRL, `miles train`
/// and `miles train-async` on the reference warm-start and its undemonstrated prompts, each
/// round with its own seeds, up to `MILES_BENCH_REWARD_STEPS` steps; the seconds until the
/// mean reward of `MILES_BENCH_REWARD_WINDOW` consecutive steps first reaches
/// `MILES_BENCH_REWARD_THRESHOLD`.
fn time_to_reward(
    miles: &Path,
    python: &Path,
    reference: &Path,
    work: &Path,
    rounds: usize,
    cpu: &str,
) -> Result<(), BoxError> {
    let steps = env_usize("MILES_BENCH_REWARD_STEPS", REWARD_STEPS).max(1);
    let window = env_usize("MILES_BENCH_REWARD_WINDOW", REWARD_WINDOW).clamp(1, steps);
    let threshold = env_f64("MILES_BENCH_REWARD_THRESHOLD", REWARD_THRESHOLD);
    let data = write_undemonstrated(reference)?;
    let problems = std::fs::read_to_string(&data)?.lines().count();
    let model = reference.join("warm_start");
    let dir = work.join("runs_reward");
    std::fs::create_dir_all(&dir)?;
    let (mut trl, mut sync, mut asyn) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // TRL stops at the threshold; miles runs its whole budget (cheap) and the crossing is
        // read from its metrics, by the same rule.
        let stop: Vec<String> = [
            "--seed".to_string(),
            (1 + round).to_string(),
            "--stop-reward".to_string(),
            threshold.to_string(),
            "--stop-window".to_string(),
            window.to_string(),
        ]
        .into();
        let (result, _) = trl_result(python, &model, &data, &dir, steps, PROMPTS, &stop)?;
        let curve = Curve::from_trl(&result)?;
        println!(
            "time to reward round {round}: TRL {}",
            curve.summary(window, threshold)
        );
        trl.push(curve);
        let seed = (42 + 1_000_000 * round).to_string();
        let extra = ["--rollout-seed", &seed];
        for (sub, curves) in [("train", &mut sync), ("train-async", &mut asyn)] {
            let (records, _) =
                miles_records(miles, sub, &model, &data, &dir, steps, PROMPTS, &extra)?;
            let curve = Curve::from_miles(&records)?;
            println!(
                "time to reward round {round}: miles {sub} {}",
                curve.summary(window, threshold)
            );
            curves.push(curve);
        }
    }
    // The mean seconds over the rounds when every round reached the threshold.
    let seconds = |curves: &[Curve]| -> Option<f64> {
        let secs: Option<Vec<f64>> = curves
            .iter()
            .map(|c| c.reached(window, threshold).map(|(_, s)| s))
            .collect();
        secs.map(|s| mean(&s))
    };
    let runs = |curves: &[Curve]| -> String {
        curves
            .iter()
            .map(|c| c.summary(window, threshold))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let baseline = seconds(&trl).map_or_else(|| "-".to_string(), |s| format!("{s:.3}s"));
    for (label, curves) in [("sync", &sync), ("async", &asyn)] {
        let name = format!("grpo_time_to_reward_reference_{label}");
        // A side that misses the threshold in a round has no figure: its runs say so.
        let ours =
            seconds(curves).map_or_else(|| format!("@{name}/not_reached"), |s| format!("{s:.3}s"));
        println!(
            "xtask-result: {name} ours={ours} baseline={baseline} target=<=0.333 note=seconds \
             from the first step's start until the mean reward of {window} consecutive steps \
             first reaches {threshold} (the sum of the step times up to that step: rollout + \
             training + weight update; start-up and model loading not counted), mean of \
             {rounds} rounds of <= {steps} steps; miles {label} {} vs TRL GRPOTrainer {} (per \
             round: steps and seconds to the threshold, reward over the first {window} steps \
             -> over the {window} that reached it); the reference warm-start on its {problems} \
             undemonstrated addition prompts in order, exact match, {PROMPTS}x{GROUP} samples, \
             <= {MAX_NEW} new tokens, lr {LR}, no KL, one optimizer step per rollout; round r \
             seeds TRL with 1+r, miles' sampling with 42+1000000r; ratio < 1 is faster; {cpu}",
            runs(curves),
            runs(&trl),
        );
    }
    Ok(())
}

fn list(v: &[f64], unit: &str) -> String {
    v.iter()
        .map(|x| format!("{x:.3}{unit}"))
        .collect::<Vec<_>>()
        .join("/")
}

/// TRL's default `gradient_checkpointing=True` under Megatron's flags: every decoder layer
/// recomputed in the backward.
const RECOMPUTE: [&str; 6] = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
];

fn main() -> Result<(), BoxError> {
    let quick = std::env::var("MILES_BENCH_QUICK").is_ok_and(|v| v == "1");
    let steps = env_usize("MILES_BENCH_STEPS", if quick { 2 } else { 3 }).max(2);
    let rounds = env_usize("MILES_BENCH_ROUNDS", if quick { 1 } else { 2 }).max(1);
    let only = std::env::var("MILES_BENCH_ONLY").ok();
    let profile = profile_dir();
    let miles = found("MILES_BIN", profile.as_ref().map(|p| p.join("miles")));
    let example = found(
        "MILES_GRPO_EXAMPLE",
        profile.as_ref().map(|p| p.join("examples/glm_moe_grpo")),
    );
    let (Some(miles), Some(example), Some(python)) = (miles, example, python()) else {
        println!(
            "grpo_step_vs_trl: skipped: needs the miles binary and the glm_moe_grpo example \
             (cargo build --release --bin miles --example glm_moe_grpo) and MILES_TORCH_PYTHON \
             (torch, transformers, trl)"
        );
        return Ok(());
    };
    let work = profile
        .as_ref()
        .and_then(|p| p.parent())
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf)
        .join("grpo_step_vs_trl");
    std::fs::create_dir_all(&work)?;
    let reference = work.join("reference");
    let big = work.join("glm_moe_88m");
    let data = reference.join("data/train.jsonl");
    write_reference(&example, &reference)?;
    let qwen = work.join("qwen3_0_6b");
    // (name, model directory, prompts per step, extra `miles` flags, run without ONLY).
    let models: Vec<(&str, PathBuf, usize, Vec<&str>, bool)> = vec![
        (
            "reference",
            reference.join("warm_start"),
            PROMPTS,
            vec![],
            true,
        ),
        ("glm_moe_88m", big.clone(), PROMPTS, vec![], true),
        // TRL's activation checkpointing (its GRPOConfig default), where memory binds.
        (
            "qwen3_0_6b",
            qwen.clone(),
            PROMPTS_0_6B,
            RECOMPUTE.to_vec(),
            false,
        ),
    ];
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    for (name, model, prompts, extra, by_default) in models {
        match only.as_deref() {
            Some(o) if o != name => continue,
            None if !by_default => continue,
            _ => {}
        }
        if name == "glm_moe_88m" {
            write_88m(&big)?;
        }
        if name == "qwen3_0_6b" {
            write_qwen3_0_6b(&qwen)?;
        }
        let dir = work.join(format!("runs_{name}"));
        std::fs::create_dir_all(&dir)?;
        let (mut trl, mut sync, mut asyn) = (Vec::new(), Vec::new(), Vec::new());
        let (mut trl_rss, mut sync_rss, mut async_rss) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let (t, r) = run_trl(&python, &model, &data, &dir, steps, prompts)?;
            println!("{name} round {round}: TRL {t:.3} s/step, {r:.0} MiB");
            trl.push(t);
            trl_rss.push(r);
            for (sub, secs, rss) in [
                ("train", &mut sync, &mut sync_rss),
                ("train-async", &mut asyn, &mut async_rss),
            ] {
                let (s, r, phases) =
                    run_miles(&miles, sub, &model, &data, &dir, steps, prompts, &extra)?;
                let phases: Vec<String> =
                    phases.iter().map(|(k, v)| format!("{k} {v:.3}s")).collect();
                println!(
                    "{name} round {round}: miles {sub} {s:.3} s/step, {r:.0} MiB ({})",
                    phases.join(", ")
                );
                secs.push(s);
                rss.push(r);
            }
        }
        let base = mean(&trl);
        let flags = if extra.is_empty() {
            String::new()
        } else {
            format!(
                "; miles {} (TRL: gradient_checkpointing, its default)",
                extra.join(" ")
            )
        };
        for (label, secs, rss) in [("sync", &sync, &sync_rss), ("async", &asyn, &async_rss)] {
            let ours = mean(secs);
            println!(
                "xtask-result: grpo_step_vs_trl_{name}_{label} ours={ours:.3}s baseline={base:.3}s \
                 target=<=0.333 note=miles {} s/step vs TRL GRPOTrainer {} s/step over {rounds} \
                 rounds ({steps} steps each, first left out); {prompts}x{GROUP} samples, <= {MAX_NEW} \
                 new tokens, lr {LR}, one optimizer step per rollout in one shared-prefix micro-batch{flags}; ratio < 1 is faster; {cpu}",
                list(secs, ""),
                list(&trl, ""),
            );
            println!(
                "xtask-result: grpo_step_vs_trl_{name}_{label}_peak_rss ours={:.0}MiB \
                 baseline={:.0}MiB target=<=1 note=peak RSS of the process, miles {} vs TRL {}",
                mean(rss),
                mean(&trl_rss),
                list(rss, "MiB"),
                list(&trl_rss, "MiB"),
            );
        }
    }
    // The time-to-reward rows: in the default run and with `MILES_BENCH_ONLY=reward`.
    if matches!(only.as_deref(), None | Some("reward")) {
        time_to_reward(&miles, &python, &reference, &work, rounds, &cpu)?;
    }
    Ok(())
}
