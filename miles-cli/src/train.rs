//! `miles train`, `train-async`, `sft` and `eval`: RL post-training of an HF checkpoint on a prompt file with a reward,
//! from one command, with Miles' flag names (`train.py` / `train_async.py`).
//!
//! ```text
//! miles train        --hf-checkpoint DIR --prompt-data train.jsonl --rm-type math ...   # synchronous loop
//! miles train-async  --config run.toml --num-rollout 200                             # fully asynchronous
//! miles sft          --hf-checkpoint DIR --prompt-data conversations.jsonl --save-hf out/sft
//! miles eval         --hf-checkpoint DIR --eval-prompt-data aime aime.jsonl --rm-type math
//! miles eval         --hf-checkpoint DIR --eval-config eval.yaml --log-passrate       # Miles' schema, several datasets
//! ```
//!
//! Every flag maps onto a field of a library config type ([`miles_rollout::RolloutConfig`],
//! [`miles_rollout::LoopConfig`], [`miles_train::TrainConfig`], …), so a Rust user gets the same
//! run without the CLI. [`crate::args::TrainArgs`] lists them; COMPATIBILITY.md has the table
//! against Miles.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::module::Module;
use miles_bridge::{CausalLm, DecodeWeights, Precision, RecomputeConfig};
use miles_core::{
    InferenceEngine, JsonlMetricsSink, MemoryTag, MetricsSink, PolicyTrainer, RewardFn,
    SamplingParams,
};
use miles_ops::device::DeviceSpec;
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use miles_reward::{BuiltinReward, RemoteReward, RmHubReward, RmType};
use miles_rollout::{
    AgentGenerator, ChatPromptEncoder, DataSource, DatasetKeys, DynamicFilter, EvalDatasetConfig,
    EvalFlags, EvalSet, LoopConfig, PromptEncoder, PromptRecord, RlLoop, RolloutConfig,
    RolloutManager, SharedTrainer, filter_long_prompts,
};
use miles_rollout::{DatasetOptions, PromptDataPath, load_dataset};
use miles_session::agent::{AgentDriverConfig, AgentReward};
use miles_session::command_agent::{CommandAgent, CommandAgentConfig};
use miles_session::server::SessionServerConfig;
use miles_tito::MessageMatcher;
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};
use serde_json::{Map, Value, json};

use crate::args::TrainArgs;
use crate::wiring::{CurvesOnEval, ProgressSink, save_hf_checkpoint};

/// Errors of a `miles` run (any crate's error, boxed).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a run ended with.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The run's summary (also written to `OUTPUT/summary.json`; `miles eval` also to `eval.json`).
    pub summary: Value,
    /// The exit status a signal asked for (130 SIGINT, 143 SIGTERM) when the run was stopped
    /// early (after writing its checkpoint), `None` when it ran to the end.
    pub stopped_by: Option<u8>,
}

impl Outcome {
    fn finished(summary: Value) -> Self {
        Self {
            summary,
            stopped_by: None,
        }
    }
}

/// Runs `train`, `train-async`, `sft` or `eval` with `args`.
pub async fn run(command: TrainCommand, args: &TrainArgs) -> Result<Outcome, BoxError> {
    if args.metrics.use_wandb {
        return Err("--use-wandb: the wandb format is not written here; use --use-tensorboard and upload with `wandb sync --sync-tensorboard DIR`".into());
    }
    match command {
        TrainCommand::Train => train(args, false).await,
        TrainCommand::TrainAsync => train(args, true).await,
        TrainCommand::Sft => sft(args).map(Outcome::finished),
        TrainCommand::Eval => eval(args).await.map(Outcome::finished),
    }
}

/// A stop signal for the loop that turns `true` on the first SIGINT / SIGTERM, and the exit
/// status that signal asks for (0 until then). A second signal ends the process at once.
fn stop_on_signal() -> (
    tokio::sync::watch::Receiver<bool>,
    Arc<std::sync::atomic::AtomicU8>,
) {
    let (tx, rx) = tokio::sync::watch::channel(false);
    let code = Arc::new(std::sync::atomic::AtomicU8::new(0));
    let seen = code.clone();
    let mut signals = crate::shutdown::Signals::install();
    tokio::spawn(async move {
        let first = signals.recv().await;
        seen.store(first, std::sync::atomic::Ordering::SeqCst);
        tracing::warn!(
            "stopping: finishing the step in training, then writing a checkpoint (signal again to quit at once)"
        );
        let _ = tx.send(true);
        let second = signals.recv().await;
        std::process::exit(i32::from(second));
    });
    (rx, code)
}

/// The subcommands that take [`TrainArgs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainCommand {
    /// The synchronous loop.
    Train,
    /// The fully asynchronous loop.
    TrainAsync,
    /// Supervised fine-tuning.
    Sft,
    /// Evaluation only.
    Eval,
}

/// What every subcommand loads first.
struct Common {
    hf: PathBuf,
    out: PathBuf,
    device: burn::tensor::Device,
    rollout_device: burn::tensor::Device,
    precision: Precision,
    seed: u64,
    encoder: Arc<ChatPromptEncoder>,
    eos_ids: Vec<u32>,
}

fn common(a: &TrainArgs) -> Result<Common, BoxError> {
    let hf = hf_checkpoint(a)?;
    let out = a.model.output_dir.clone();
    std::fs::create_dir_all(&out).map_err(|e| format!("--output-dir {}: {e}", out.display()))?;
    let device = device(&a.model.device, "--device")?;
    let precision = Precision::from_flags(a.model.bf16, a.model.fp16)?;
    let rollout_device = match a.model.rollout_device.as_deref() {
        Some(s) => device_of(s, "--rollout-device")?,
        None => device.clone(),
    };
    let kwargs: Map<String, Value> =
        serde_json::from_str(a.data.apply_chat_template_kwargs.as_str())
            .map_err(|e| format!("--apply-chat-template-kwargs: not a JSON object: {e}"))?;
    let encoder = Arc::new(
        ChatPromptEncoder::load(&hf)?
            .with_kwargs(kwargs)
            .with_raw_text(!a.data.apply_chat_template),
    );
    let mut eos_ids = miles_engine::read_eos_ids(&hf);
    if eos_ids.is_empty() {
        // A config without `eos_token_id`: the tokenizer config's end-of-turn token.
        eos_ids.extend(miles_engine::eos_from_tokenizer_config(&hf));
    }
    Ok(Common {
        eos_ids,
        hf,
        out,
        device,
        rollout_device,
        precision,
        seed: a.model.seed,
        encoder,
    })
}

/// `--hf-checkpoint`: a directory, or a hub id found in the local Hugging Face cache.
fn hf_checkpoint(a: &TrainArgs) -> Result<PathBuf, BoxError> {
    let spec = a
        .model
        .hf_checkpoint
        .as_deref()
        .ok_or("--hf-checkpoint is required")?;
    Ok(crate::hub::resolve(spec, "--hf-checkpoint")?)
}

fn device_of(spec: &str, flag: &str) -> Result<burn::tensor::Device, BoxError> {
    let spec: DeviceSpec = spec.parse().map_err(|e| format!("{flag} {spec}: {e}"))?;
    Ok(spec.init().map_err(|e| format!("{flag}: {e}"))?)
}

fn device(spec: &str, flag: &str) -> Result<burn::tensor::Device, BoxError> {
    device_of(spec, flag)
}

fn dataset_keys(a: &TrainArgs) -> DatasetKeys {
    DatasetKeys {
        input_key: a.data.input_key.clone(),
        label_key: a.data.label_key.clone(),
        metadata_key: a.data.metadata_key.clone(),
        tool_key: a.data.tool_key.clone(),
    }
}

/// Reads a prompt file (JSONL or Parquet, with an optional `@[a:b]` row slice); with
/// `--skip-bad-rows` prints how many rows were skipped and why the first were.
fn load_prompts(
    a: &TrainArgs,
    path: &str,
    keys: &DatasetKeys,
) -> Result<Vec<PromptRecord>, BoxError> {
    let source: PromptDataPath = path.parse()?;
    let options = DatasetOptions {
        keys: keys.clone(),
        skip_bad_rows: a.data.skip_bad_rows,
        max_row_bytes: a.data.max_row_bytes,
    };
    let loaded = load_dataset(&source, &options)?;
    if loaded.skipped.count > 0 {
        println!("{path}: {}", loaded.skipped);
    }
    if loaded.records.is_empty() {
        return Err(format!("{path}: no prompts").into());
    }
    Ok(loaded.records)
}

/// The reward of `--rm-type` / `--rm-url` (Miles' rm_hub, per-sample `metadata["rm_type"]`
/// first), and with `--agent-cmd` the agent's own reward first.
fn reward(a: &TrainArgs, seed: u64) -> Result<Arc<dyn RewardFn>, BoxError> {
    reward_for(a, seed, a.reward.rm_type.as_deref())
}

/// [`reward`] with `rm_type` in place of `--rm-type` (an evaluation dataset's own).
fn reward_for(
    a: &TrainArgs,
    seed: u64,
    rm_type: Option<&str>,
) -> Result<Arc<dyn RewardFn>, BoxError> {
    // With OPD on a teacher server, --rm-url is the teacher (Miles' OPD reward function).
    let opd_sglang = a.opd.use_opd && a.opd.opd_type.as_deref() == Some("sglang");
    // Otherwise `--rm-url` alone means a remote reward model (Miles asks for `--rm-type
    // remote_rm` too, and fails every sample with "Rule-based RM type is not specified").
    let rm_type = rm_type.or(a
        .reward
        .rm_url
        .as_ref()
        .filter(|_| !opd_sglang)
        .map(|_| "remote_rm"));
    let remote = a
        .reward
        .rm_url
        .as_deref()
        .filter(|_| !opd_sglang)
        .map(|url| RemoteReward::new(url, Duration::from_secs_f64(a.reward.rm_timeout_s)));
    let rule: Option<Arc<dyn RewardFn>> = match rm_type {
        Some("exact_match") => Some(Arc::new(BuiltinReward::ExactMatch)),
        Some("numeric_match") => Some(Arc::new(BuiltinReward::NumericMatch { tolerance: 1e-6 })),
        None if remote.is_none() => None,
        _ => {
            let global = rm_type
                .map(RmType::from_rm_type)
                .transpose()
                .map_err(|e| format!("--rm-type: {e}"))?;
            let mut hub = RmHubReward::new(global).with_seed(seed);
            if let Some(remote) = remote {
                hub = hub.with_remote(Arc::new(remote));
            }
            Some(Arc::new(hub))
        }
    };
    Ok(match (a.agent.agent_cmd.as_deref(), rule) {
        (Some(_), Some(rule)) => Arc::new(AgentReward::new().with_fallback(rule)),
        (Some(_), None) => Arc::new(AgentReward::new()),
        (None, Some(rule)) => rule,
        // Distillation alone: task reward 0, the teacher's reverse KL is the signal.
        (None, None) if a.opd.use_opd => Arc::new(miles_rollout::opd::DistillationOnlyReward),
        (None, None) => {
            return Err(
                "--rm-type (or --rm-url, or an --agent-cmd that prints rewards) is required".into(),
            );
        }
    })
}

/// With `--agent-cmd`: a session server over `engine` on loopback (TITO family `--tito`) and
/// the agent as the rollout's sample generator.
async fn agent_generator(
    a: &TrainArgs,
    c: &Common,
    engine: &Arc<dyn InferenceEngine>,
    use_r3: bool,
) -> Result<Option<Arc<AgentGenerator>>, BoxError> {
    let Some(cmd) = a.agent.agent_cmd.as_deref() else {
        if a.rollout.generate_multi_samples {
            return Err("--generate-multi-samples needs --agent-cmd (per-turn samples come from the session server)".into());
        }
        return Ok(None);
    };
    // Miles applies --apply-chat-template-kwargs to every render of the session server.
    let kwargs: Map<String, Value> =
        serde_json::from_str(a.data.apply_chat_template_kwargs.as_str())
            .map_err(|e| format!("--apply-chat-template-kwargs: not a JSON object: {e}"))?;
    let message_matcher = MessageMatcher::parse(&a.agent.session_message_matcher)
        .map_err(|e| format!("--session-message-matcher: {e}"))?;
    let session_version = crate::args::session_version(a.agent.use_session_server.as_deref());
    if session_version == miles_session::server::SessionVersion::V2 {
        // Miles: "v2 returns list[Sample]" (no group reward, no partial rollout); here a v2
        // session's samples are its kept leaves already.
        for (on, flag) in [
            (a.rollout.generate_multi_samples, "--generate-multi-samples"),
            (a.rollout.partial_rollout, "--partial-rollout"),
        ] {
            if on {
                return Err(format!("--use-session-server v2 does not support {flag}; v2 returns one sample per kept leaf of the session's tree").into());
            }
        }
    }
    let url = crate::wiring::spawn_session_server(
        engine.clone(),
        &c.hf,
        a.agent.tito.as_str(),
        SessionServerConfig {
            return_routed_experts: use_r3,
            chat_template_kwargs: kwargs,
            message_matcher,
            save_debug_trajectory_data: a.rollout.save_debug_trajectory_data.is_some(),
            session_version,
            ..SessionServerConfig::default()
        },
    )
    .await?;
    println!("session server ({session_version}) on {url}; agent: {cmd}");
    let mut config = CommandAgentConfig::shell(cmd);
    config.timeout = match a.agent.agent_timeout_s {
        t if t > 0.0 && t.is_finite() => Some(Duration::from_secs_f64(t)),
        _ => None,
    };
    let agent = Arc::new(CommandAgent::new(config)?);
    Ok(Some(Arc::new(AgentGenerator::new(
        agent,
        AgentDriverConfig::new(url)
            .with_generate_multi_samples(a.rollout.generate_multi_samples)
            .with_session_version(session_version),
    ))))
}

fn sampling(a: &TrainArgs, eos_ids: &[u32]) -> SamplingParams {
    let mut stop_token_ids = eos_ids.to_vec();
    stop_token_ids.extend(&a.rollout.rollout_stop_token_ids);
    SamplingParams {
        temperature: a.rollout.rollout_temperature,
        top_p: a.rollout.rollout_top_p,
        top_k: a.rollout.rollout_top_k,
        stop: a.rollout.rollout_stop.clone(),
        stop_token_ids,
        ..SamplingParams::default()
    }
}

/// The engines: the embedded one on `model`, or a router over `--engine-url` servers (health
/// checked every `--rollout-health-check-interval`, waited for `--engine-wait-s` when all are
/// out of rotation). The
/// embedded engine re-scores finished sequences (`recompute_logprobs_via_prefill`) only when
/// `recompute` (the trainer compares rollout log-probs with its per-sample scoring:
/// `TrainConfig::needs_exact_rollout_log_probs`).
/// `reserved`: bytes the embedded engine's KV pool leaves to the trainer
/// (`EngineConfig::kv_reserved_bytes`, from the memory plan); `kv_tokens`: its token budget
/// ([`kv_pool_tokens`]); `initial`: the embedded engine's first weights when the caller has
/// them on the rollout device (else they are loaded from `--hf-checkpoint`).
#[allow(clippy::too_many_arguments)]
fn engines(
    a: &TrainArgs,
    c: &Common,
    num_layers: Option<usize>,
    recompute: bool,
    reserved: u64,
    kv_tokens: usize,
    initial: Option<CausalLm>,
) -> Result<Arc<dyn InferenceEngine>, BoxError> {
    let urls = &a.rollout.engine_url;
    if urls.is_empty() {
        let model = match initial {
            Some(model) => model,
            None => CausalLm::from_pretrained(&c.hf, &c.rollout_device)?,
        };
        let config = miles_engine::EngineConfig {
            max_running_requests: a.rollout.max_running_requests,
            kv_memory_fraction: Some(a.rollout.kv_memory_fraction()),
            kv_token_budget: kv_tokens,
            kv_reserved_bytes: reserved,
            eos_token_ids: c.eos_ids.clone(),
            seed: c.seed,
            precision: c.precision,
            recompute_logprobs_via_prefill: recompute,
            // The engine serves the trainer's own buffers: its decode matmuls read them in
            // place (no copy held beside the trainer's weights, nothing rebuilt at a push).
            decode_weights: DecodeWeights::InPlace,
            ..miles_engine::EngineConfig::default()
        };
        return Ok(crate::wiring::embedded_engine_with(model, &c.hf, config)?);
    }
    let router = crate::wiring::sglang_fleet(urls, &c.out.join("weights"), num_layers)?
        .with_unavailable_wait(Duration::from_secs_f64(a.rollout.engine_wait_s));
    let router = Arc::new(router);
    // Detached: it ends with the router (it holds a weak reference).
    drop(router.spawn_health_checker(Duration::from_secs_f64(
        a.rollout.rollout_health_check_interval,
    )));
    Ok(router)
}

/// The longest of `prompts` in tokens, as the rollout encodes them (chat template, tools).
fn longest_prompt_tokens(
    encoder: &dyn PromptEncoder,
    prompts: &[PromptRecord],
) -> Result<usize, BoxError> {
    let mut longest = 0;
    for record in prompts {
        longest = longest.max(encoder.encode(&record.to_sample())?.len());
    }
    Ok(longest)
}

/// The embedded engine's KV token budget for `train` / `train-async`, and why:
/// `--sglang-max-total-tokens` when given; the engine's default (65,536) when only
/// `--sglang-mem-fraction-static` is (SGLang sizes its pool from the fraction alone) or when a
/// multi-turn agent runs without `--rollout-max-context-len` (its conversations have no known
/// bound); otherwise what the rollout can fill ([`miles_engine::RolloutKvNeed`]): the
/// sequences it runs at once (`--over-sampling-batch-size`, else `--rollout-batch-size`, ×
/// `--n-samples-per-prompt`, at most `--max-running-requests`) × its longest sequence (the
/// longest prompt in tokens + `--rollout-max-response-len`, at most
/// `--rollout-max-context-len`; the evaluation sets' longest when longer). The memory fraction
/// bounds every choice when the engine starts.
fn kv_pool_tokens(
    a: &TrainArgs,
    c: &Common,
    model: &CausalLm,
    prompts: &[PromptRecord],
) -> Result<(usize, String), BoxError> {
    let r = &a.rollout;
    let default = miles_engine::EngineConfig::default().kv_token_budget;
    if let Some(tokens) = r.sglang_max_total_tokens {
        return Ok((tokens, "--sglang-max-total-tokens".into()));
    }
    if r.sglang_mem_fraction_static.is_some() {
        return Ok((
            default,
            "the default budget, within the memory fraction given".into(),
        ));
    }
    if a.agent.agent_cmd.is_some() && r.rollout_max_context_len.is_none() {
        return Ok((
            default,
            "the default budget: a multi-turn agent's conversations have no bound without \
             --rollout-max-context-len"
                .into(),
        ));
    }
    let within_context = |tokens: usize, context: Option<usize>| match context {
        Some(context) => tokens.min(context),
        None => tokens,
    };
    let prompt = longest_prompt_tokens(c.encoder.as_ref(), prompts)?;
    let mut sequence = within_context(
        prompt + r.rollout_max_response_len,
        r.rollout_max_context_len,
    );
    let mut why_sequence = format!(
        "longest prompt {prompt} + --rollout-max-response-len {}",
        r.rollout_max_response_len
    );
    if sequence < prompt + r.rollout_max_response_len {
        why_sequence.push_str(", within --rollout-max-context-len");
    }
    for d in eval_flags(a).resolve()? {
        let records = load_prompts(a, &d.path, &eval_keys(&d))?;
        let (records, _) =
            filter_long_prompts(records, c.encoder.as_ref(), a.eval.eval_max_prompt_len)?;
        let eval_prompt = longest_prompt_tokens(c.encoder.as_ref(), &records)?;
        let response = d.max_response_len.unwrap_or(r.rollout_max_response_len);
        let eval_sequence = within_context(
            eval_prompt + response,
            a.eval.eval_max_context_len.or(r.rollout_max_context_len),
        );
        if eval_sequence > sequence {
            sequence = eval_sequence;
            why_sequence = format!(
                "eval {}: longest prompt {eval_prompt} + max response {response}",
                d.name
            );
        }
    }
    let per_token = miles_bridge::PagedKvCache::bytes_per_token(model);
    let state_bytes = miles_bridge::PagedKvCache::state_bytes_per_row(model);
    let need = miles_engine::RolloutKvNeed {
        requests: r
            .over_sampling_batch_size
            .unwrap_or(0)
            .max(r.rollout_batch_size.unwrap_or(1))
            .saturating_mul(r.n_samples_per_prompt),
        max_running_requests: r.max_running_requests,
        sequence_tokens: sequence,
        state_tokens_per_slot: if state_bytes == 0 {
            0
        } else {
            state_bytes.div_ceil(per_token.max(1))
        },
    };
    let tokens = need.tokens();
    Ok((
        tokens,
        format!(
            "sized to the rollout: {} sequences at once ({} requests, --max-running-requests \
             {}) × {sequence} tokens ({why_sequence}), in 16-token blocks{}; \
             --sglang-max-total-tokens sets it",
            need.concurrent(),
            need.requests,
            r.max_running_requests,
            if need.state_tokens_per_slot > 0 {
                format!(
                    " + a linear-attention state slot each ({} tokens)",
                    need.state_tokens_per_slot
                )
            } else {
                String::new()
            }
        ),
    ))
}

/// The run's [`crate::memory::MemoryPlan`]: the policy's shape, the engine's precision and
/// KV pool (`kv_tokens`, the pool's bytes per position), and one padded
/// micro-batch of `--micro-batch-size` sequences of `--rollout-max-context-len` tokens (else
/// the longest prompt's JSON bytes, an upper bound of its tokens, plus 64 for the chat
/// template, plus `--rollout-max-response-len`).
fn memory_plan(
    a: &TrainArgs,
    model: &CausalLm,
    prompts: &[PromptRecord],
    precision: miles_bridge::Precision,
    engine_on_trainer_device: bool,
    offload: &[miles_core::MemoryTag],
    kv_tokens: usize,
) -> crate::memory::MemoryPlan {
    let m = &model.config;
    let engine_bytes = precision.checkpoint_dtype().size() as u64;
    let kv_f32 = miles_bridge::PagedKvCache::bytes_per_token(model) as u64;
    let longest_prompt = prompts
        .iter()
        .map(|p| serde_json::to_string(&p.prompt).map_or(0, |s| s.len()))
        .max()
        .unwrap_or(0);
    let seq_len = a
        .rollout
        .rollout_max_context_len
        .unwrap_or(longest_prompt + 64 + a.rollout.rollout_max_response_len);
    let mut inputs = crate::memory::MemoryInputs {
        params: model.num_params() as u64,
        layers: m.num_hidden_layers as u64,
        hidden: m.hidden_size as u64,
        intermediate: m.intermediate_size as u64,
        heads: m.num_attention_heads as u64,
        q_width: (m.num_attention_heads * m.head_dim) as u64,
        kv_width: (m.num_key_value_heads * m.head_dim) as u64,
        engine_dtype_bytes: engine_bytes,
        // The trainer's model is f32 on the trainer's device; an engine in another precision
        // or on another device is counted as copying everything.
        engine_decode_copy_params: if engine_bytes == 4 && engine_on_trainer_device {
            model.decode_copy_params(DecodeWeights::InPlace) as u64
        } else {
            model.num_params() as u64
        },
        offload_weights: offload.contains(&miles_core::MemoryTag::Weights),
        offload_kv_cache: offload.contains(&miles_core::MemoryTag::KvCache),
        kv_tokens: kv_tokens as u64,
        kv_bytes_per_token: kv_f32 / 4 * engine_bytes,
        micro_batch_seqs: a.train.micro_batch_size as u64,
        seq_len: seq_len as u64,
    };
    // The pool the engine will size: the flag's tokens, bounded by the memory fraction of
    // what is available once its own weights are loaded, less what the trainer will still
    // allocate (as the engine resolves it).
    let plan = crate::memory::MemoryPlan::new(&inputs);
    let config = miles_engine::EngineConfig {
        kv_token_budget: kv_tokens,
        kv_memory_fraction: Some(a.rollout.kv_memory_fraction()),
        kv_reserved_bytes: plan.trainer_growth(),
        ..miles_engine::EngineConfig::default()
    };
    let engine_weights = inputs.params * engine_bytes;
    let available = miles_engine::available_memory().map(|b| b.saturating_sub(engine_weights));
    if let Ok(budget) =
        miles_engine::KvBudget::resolve(&config, inputs.kv_bytes_per_token as usize, available)
    {
        inputs.kv_tokens = budget.tokens as u64;
    }
    crate::memory::MemoryPlan::new(&inputs)
}

fn rollout_config(a: &TrainArgs, c: &Common, use_r3: bool) -> Result<RolloutConfig, BoxError> {
    let filters = match a.rollout.dynamic_sampling_filter_path.as_deref() {
        None => Vec::new(),
        Some(path) => {
            let name = path.rsplit(['.', ':']).next().unwrap_or(path);
            let filter: DynamicFilter = serde_json::from_value(json!(name)).map_err(|_| {
                format!("--dynamic-sampling-filter-path {path:?}: expected check_reward_nonzero_std or check_no_aborted")
            })?;
            vec![filter]
        }
    };
    Ok(RolloutConfig {
        n_samples_per_prompt: a.rollout.n_samples_per_prompt,
        rollout_batch_size: a
            .rollout
            .rollout_batch_size
            .ok_or("--rollout-batch-size is required")?,
        over_sampling_batch_size: a.rollout.over_sampling_batch_size,
        sampling: sampling(a, &c.eos_ids),
        rollout_max_response_len: a.rollout.rollout_max_response_len,
        rollout_max_context_len: a.rollout.rollout_max_context_len,
        rollout_seed: Some(a.rollout.rollout_seed),
        dynamic_filters: filters,
        reward_key: a.reward.reward_key.as_deref().map(str::to_owned),
        partial_rollout: a.rollout.partial_rollout,
        return_routed_experts: use_r3,
        failure: failure_policy(a)?,
        log_passrate: a.metrics.log_passrate,
        ..RolloutConfig::default()
    })
}

/// `--max-group-retries`, `--max-consecutive-failures`, `--max-failure-ratio`,
/// `--failure-window`, checked by the library.
fn failure_policy(a: &TrainArgs) -> Result<miles_rollout::FailurePolicy, BoxError> {
    let policy = miles_rollout::FailurePolicy {
        max_group_retries: a.agent.max_group_retries,
        max_consecutive_failures: a.agent.max_consecutive_failures,
        max_failure_ratio: a.agent.max_failure_ratio,
        failure_window: a.agent.failure_window,
        ..miles_rollout::FailurePolicy::default()
    };
    policy.validate().map_err(|e| {
        format!("--max-failure-ratio / --failure-window / --max-consecutive-failures: {e}")
    })?;
    Ok(policy)
}

/// The command-line values Miles' evaluation-dataset resolution reads.
fn eval_flags(a: &TrainArgs) -> EvalFlags {
    EvalFlags {
        eval_config: a.eval.eval_config.clone(),
        eval_prompt_data: Some(a.eval.eval_prompt_data.clone()).filter(|v| !v.is_empty()),
        n_samples_per_eval_prompt: Some(a.eval.n_samples_per_eval_prompt),
        n_samples_per_prompt: Some(a.rollout.n_samples_per_prompt),
        eval_temperature: a.eval.eval_temperature.map(f64::from),
        rollout_temperature: Some(f64::from(a.rollout.rollout_temperature)),
        eval_top_p: a.eval.eval_top_p.map(f64::from),
        rollout_top_p: Some(f64::from(a.rollout.rollout_top_p)),
        eval_top_k: a.eval.eval_top_k.map(i64::from),
        rollout_top_k: Some(i64::from(a.rollout.rollout_top_k)),
        eval_max_response_len: a.eval.eval_max_response_len,
        rollout_max_response_len: Some(a.rollout.rollout_max_response_len),
        eval_input_key: a.eval.eval_input_key.clone(),
        input_key: Some(a.data.input_key.clone()),
        eval_label_key: a.eval.eval_label_key.clone(),
        label_key: a.data.label_key.clone(),
        eval_tool_key: a.eval.eval_tool_key.clone(),
        tool_key: Some(a.data.tool_key.clone()),
        metadata_key: Some(a.data.metadata_key.clone()),
    }
}

/// The evaluation sets of `--eval-config` (or `--eval-prompt-data`), each with its own
/// manager: its samples per prompt, sampling, lengths, reward (its `rm_type`, else
/// `reward`), `--eval-reward-key` and prompt keys; its `rm_type` and `metadata_overrides` put
/// into every prompt's metadata, prompts above `--eval-max-prompt-len` left out.
fn eval_sets(
    a: &TrainArgs,
    c: &Common,
    base: &RolloutConfig,
    engine: &Arc<dyn InferenceEngine>,
    reward: &Result<Arc<dyn RewardFn>, String>,
    generator: Option<&Arc<AgentGenerator>>,
) -> Result<Vec<EvalSet>, BoxError> {
    let datasets = eval_flags(a).resolve()?;
    // Evaluation scores whole conversations: one merged sample per session.
    let generator = generator.map(|g| Arc::new(g.with_generate_multi_samples(false)));
    datasets
        .iter()
        .map(|d| {
            let reward = match d.rm_type.as_deref() {
                Some(rm_type) => reward_for(a, c.seed, Some(rm_type))
                    .map_err(|e| format!("eval dataset {}: {e}", d.name))?,
                None => reward.clone()?,
            };
            eval_set(a, c, base, engine, reward, generator.clone(), d)
                .map_err(|e| format!("eval dataset {}: {e}", d.name).into())
        })
        .collect()
}

/// An evaluation set's prompt keys (the dataset's, else the defaults).
fn eval_keys(d: &EvalDatasetConfig) -> DatasetKeys {
    let defaults = DatasetKeys::default();
    DatasetKeys {
        input_key: d.input_key.clone().unwrap_or(defaults.input_key),
        label_key: d.label_key.clone(),
        metadata_key: d.metadata_key.clone().unwrap_or(defaults.metadata_key),
        tool_key: d.tool_key.clone().unwrap_or(defaults.tool_key),
    }
}

fn eval_set(
    a: &TrainArgs,
    c: &Common,
    base: &RolloutConfig,
    engine: &Arc<dyn InferenceEngine>,
    reward: Arc<dyn RewardFn>,
    generator: Option<Arc<AgentGenerator>>,
    d: &EvalDatasetConfig,
) -> Result<EvalSet, BoxError> {
    if let Some(path) = &d.custom_generate_function_path {
        return Err(format!(
            "custom_generate_function_path {path:?} is a Python import path: use --agent-cmd"
        )
        .into());
    }
    let keys = eval_keys(d);
    // A null in the file leaves the engine's own default, as SGLang does for Miles.
    let engine_defaults = SamplingParams::default();
    let mut sampling = base.sampling.clone();
    sampling.temperature = d
        .temperature
        .map_or(engine_defaults.temperature, |t| t as f32);
    sampling.top_p = d.top_p.map_or(engine_defaults.top_p, |p| p as f32);
    sampling.top_k = match d.top_k {
        None => engine_defaults.top_k,
        Some(k) => i32::try_from(k).map_err(|_| format!("top_k {k} is out of range"))?,
    };
    if let Some(stop) = &d.stop {
        sampling.stop = stop.clone();
    }
    if let Some(ids) = &d.stop_token_ids {
        sampling.stop_token_ids = c.eos_ids.iter().chain(ids).copied().collect();
    }
    if let Some(min) = d.min_new_tokens.or(a.eval.eval_min_new_tokens) {
        sampling.min_new_tokens = min;
    }
    let n = d
        .n_samples_per_eval_prompt
        .ok_or("n_samples_per_eval_prompt is null")?;
    let mut manager = RolloutManager::new(
        RolloutConfig {
            n_samples_per_prompt: n,
            sampling,
            rollout_max_response_len: d.max_response_len.unwrap_or(base.rollout_max_response_len),
            rollout_max_context_len: a.eval.eval_max_context_len.or(base.rollout_max_context_len),
            reward_key: a
                .eval
                .eval_reward_key
                .clone()
                .or_else(|| base.reward_key.clone()),
            rollout_seed: Some(c.seed ^ 0xE7A1),
            return_routed_experts: false,
            dynamic_filters: Vec::new(),
            partial_rollout: false,
            ..base.clone()
        },
        engine.clone(),
        c.encoder.clone(),
        reward,
    )?;
    if let Some(generator) = generator {
        manager = manager.with_generator(generator);
    }
    let mut prompts = load_prompts(a, &d.path, &keys)?;
    for prompt in &mut prompts {
        d.inject_metadata(&mut prompt.metadata);
    }
    let (prompts, dropped) =
        filter_long_prompts(prompts, c.encoder.as_ref(), a.eval.eval_max_prompt_len)?;
    if dropped > 0 {
        println!(
            "eval {}: {dropped} prompts longer than --eval-max-prompt-len left out",
            d.name
        );
    }
    if prompts.is_empty() {
        return Err(format!("{}: no prompts left", d.path).into());
    }
    Ok(EvalSet {
        name: d.name.clone(),
        prompts,
        manager: Arc::new(manager),
    })
}

fn train_config(a: &TrainArgs, n: usize, use_r3: bool, seed: u64) -> Result<TrainConfig, BoxError> {
    let estimator: AdvantageEstimator = a
        .train
        .advantage_estimator
        .parse()
        .map_err(|e| format!("--advantage-estimator: {e}"))?;
    let mut lr_schedule = LrSchedule {
        lr: a.train.lr,
        min_lr: a.train.min_lr,
        lr_warmup_iters: a.train.lr_warmup_iters,
        lr_decay_iters: a.train.lr_decay_iters,
        ..LrSchedule::default()
    };
    let style = a.train.lr_decay_style.as_str();
    lr_schedule.lr_decay_style = serde_json::from_value(json!(style))
        .map_err(|_| format!("--lr-decay-style {style:?}: expected constant, linear or cosine"))?;
    let mut config = TrainConfig {
        lr_schedule,
        clip_grad: a.train.clip_grad,
        global_batch_size: a.train.global_batch_size,
        num_steps_per_rollout: a.train.num_steps_per_rollout,
        micro_batch_size: a.train.micro_batch_size,
        layout: a
            .train
            .batch_layout
            .parse::<BatchLayout>()
            .map_err(|e| format!("--batch-layout: {e}"))?,
        advantage: AdvantageConfig {
            advantage_estimator: estimator,
            kl_coef: a.train.kl_coef,
            ..AdvantageConfig::default()
        }
        .with_n_samples_per_prompt(n),
        reward_key: a.reward.reward_key.as_deref().map(str::to_owned),
        use_routing_replay: use_r3,
        lora_rank: a.lora.lora_rank,
        lora_alpha: a.lora.lora_alpha,
        target_modules: a.lora.target_modules.as_deref().map(str::to_owned),
        seed,
        ..TrainConfig::default()
    };
    if a.train.optimizer != "adam" {
        return Err(format!(
            "--optimizer {}: only adam (AdamW) is built in",
            a.train.optimizer
        )
        .into());
    }
    config.optimizer.weight_decay = a.train.weight_decay;
    config.optimizer.adam_beta1 = a.train.adam_beta1;
    config.optimizer.adam_beta2 = a.train.adam_beta2;
    config.optimizer.adam_eps = a.train.adam_eps;
    config.use_dynamic_batch_size = a.train.use_dynamic_batch_size;
    config.max_tokens_per_gpu = a.train.max_tokens_per_gpu;
    let p = &mut config.policy_loss;
    p.advantage_estimator = estimator;
    p.eps_clip = a.train.eps_clip;
    p.eps_clip_high = a.train.eps_clip_high;
    p.use_kl_loss = a.train.use_kl_loss;
    p.kl_loss_coef = a.train.kl_loss_coef;
    p.kl_loss_type = a
        .train
        .kl_loss_type
        .parse()
        .map_err(|e| format!("--kl-loss-type: {e}"))?;
    p.entropy_coef = a.train.entropy_coef;
    p.use_tis = a.train.use_tis;
    p.tis_clip = a.train.tis_clip;
    p.use_rollout_logprobs = a.train.use_rollout_logprobs;
    p.get_mismatch_metrics = a.train.get_mismatch_metrics;
    config.recompute = RecomputeConfig {
        granularity: a
            .train
            .recompute_granularity
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| format!("--recompute-granularity: {e}"))?,
        method: a
            .train
            .recompute_method
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| format!("--recompute-method: {e}"))?,
        num_layers: a.train.recompute_num_layers,
    };
    config.validate()?;
    Ok(config)
}

/// What [`sinks`] returns: the fan-out sink, the progress bar, the metrics server.
type Sinks = (
    Arc<dyn MetricsSink>,
    Arc<ProgressSink>,
    Option<miles_session::metrics_server::MetricsServer>,
);

/// The metrics sinks of a training run: JSONL, curves after each evaluation, progress,
/// TensorBoard and Prometheus when asked. Returns the sink, the progress bar and the metrics
/// server (kept alive by the caller).
fn sinks(
    a: &TrainArgs,
    out: &Path,
    resume: bool,
    num_rollout: u64,
    eval_key: &str,
    buffer_capacity_groups: Option<f64>,
) -> Result<Sinks, BoxError> {
    let path = out.join("metrics.jsonl");
    let jsonl = if resume {
        JsonlMetricsSink::append(&path)?
    } else {
        JsonlMetricsSink::create(&path)?
    };
    let progress = Arc::new(ProgressSink::new(num_rollout, eval_key));
    let mut list: Vec<Arc<dyn MetricsSink>> = vec![
        Arc::new(jsonl),
        Arc::new(CurvesOnEval::new(out, eval_key)),
        progress.clone(),
    ];
    if a.metrics.use_tensorboard {
        list.push(Arc::new(crate::wiring::tensorboard_sink(
            a.metrics.tensorboard_dir.as_deref(),
            out,
        )?));
    }
    let port: Option<u16> = match a.metrics.metrics_port {
        Some(p) => Some(p),
        None if a.metrics.use_prometheus => Some(a.metrics.prometheus_port),
        None => None,
    };
    let server = match port {
        None => None,
        Some(port) => {
            let registry = Arc::new(miles_core::prometheus::Registry::new());
            let trainer = miles_core::prometheus::TrainerMetrics::register(&registry)?;
            if let Some(capacity) = buffer_capacity_groups {
                trainer.buffer_capacity_groups.set(capacity);
            }
            list.push(Arc::new(miles_core::prometheus::TrainerMetricsSink::new(
                trainer,
            )));
            list.push(Arc::new(
                miles_core::prometheus::PrometheusMetricsSink::new(registry.clone()),
            ));
            let server = miles_session::metrics_server::MetricsServer::start(
                std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                registry,
            )?;
            println!("metrics: http://{}/metrics", server.local_addr());
            std::fs::write(out.join("metrics_addr"), server.local_addr().to_string())?;
            Some(server)
        }
    };
    Ok((
        Arc::new(miles_core::FanoutMetricsSink::new(list)),
        progress,
        server,
    ))
}

/// The end of a run, finished or stopped by a signal: `summary.json` written into `out`, the
/// metrics server (if any) stopped.
fn close_run(
    out: &Path,
    summary: &Value,
    metrics_server: Option<miles_session::metrics_server::MetricsServer>,
) -> Result<(), BoxError> {
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(summary)?,
    )?;
    if let Some(server) = metrics_server {
        server.stop()?;
    }
    Ok(())
}

async fn train(a: &TrainArgs, asynchronous: bool) -> Result<Outcome, BoxError> {
    let started = Instant::now();
    let c = common(a)?;
    let keys = dataset_keys(a);
    let prompts = load_prompts(
        a,
        a.data
            .prompt_data
            .as_deref()
            .ok_or("--prompt-data is required")?,
        &keys,
    )?;
    let use_r3 = a.train.use_rollout_routing_replay;
    let model = CausalLm::from_pretrained(&c.hf, &c.device.clone().autodiff())?;
    if use_r3 && !model.config.has_moe() {
        return Err("--use-rollout-routing-replay needs an MoE model".into());
    }
    let moe_layers = (0..model.config.num_hidden_layers)
        .filter(|&l| model.config.is_moe_layer(l))
        .count();
    let reward = reward(a, c.seed)?;
    let rollout = rollout_config(a, &c, use_r3)?;
    let n = rollout.n_samples_per_prompt;
    let recompute = train_config(a, n, use_r3, c.seed)?
        .needs_exact_rollout_log_probs(rollout.rollout_batch_size * n);
    let offload = a.rollout.offload_rollout_tags(asynchronous)?;
    let kv_tokens = if a.rollout.engine_url.is_empty() {
        let (tokens, why) = kv_pool_tokens(a, &c, &model, &prompts)?;
        tracing::info!("KV pool budget: {tokens} tokens ({why})");
        tokens
    } else {
        // Remote engines size their own pools.
        a.rollout
            .sglang_max_total_tokens
            .unwrap_or(miles_engine::EngineConfig::default().kv_token_budget)
    };
    let plan = memory_plan(
        a,
        &model,
        &prompts,
        c.precision,
        c.rollout_device == c.device,
        &offload,
        kv_tokens,
    );
    tracing::info!("{}", plan.line(miles_engine::available_memory()));
    let engine = engines(
        a,
        &c,
        Some(model.config.num_hidden_layers).filter(|_| moe_layers > 0),
        recompute,
        if a.rollout.engine_url.is_empty() {
            plan.trainer_growth()
        } else {
            0
        },
        kv_tokens,
        // The engine starts on the trainer's own buffers when both use one device, as a weight
        // push hands them over: the same weights, not a second copy loaded from disk (which
        // `train-async`, never releasing, held through its whole first step).
        (c.rollout_device == c.device).then(|| model.valid()),
    )?;
    let generator = agent_generator(a, &c, &engine, use_r3).await?;
    let num_rollout: u64 = match (a.rollout.num_rollout, a.data.num_epoch) {
        (Some(n), _) => n,
        (None, Some(epochs)) => {
            (epochs * prompts.len() as u64 / rollout.rollout_batch_size as u64).max(1)
        }
        (None, None) => return Err("--num-rollout or --num-epoch is required".into()),
    };
    let evals = eval_sets(
        a,
        &c,
        &rollout,
        &engine,
        &Ok(reward.clone()),
        generator.as_ref(),
    )?;
    let eval_key = evals.first().map_or("eval/raw_reward".to_string(), |s| {
        format!("eval/{}", s.name)
    });
    let mut manager = RolloutManager::new(
        rollout.clone(),
        engine.clone(),
        c.encoder.clone(),
        reward.clone(),
    )?;
    if let Some(generator) = &generator {
        manager = manager.with_generator(generator.clone());
    }
    if let Some(teacher) = crate::wiring::opd_teacher(a)? {
        manager = manager.with_opd_teacher(teacher);
    }
    let manager = Arc::new(manager);
    let mut config = train_config(a, n, use_r3, c.seed)?;
    config.precision = c.precision;
    config.opd = crate::wiring::opd_config(&a.opd)?;
    let local_teacher = config.opd.local_teacher();
    let mut actor = Actor::new(model, config)?;
    if let Some(dir) = a.opd.opd_teacher_load.as_deref().filter(|_| local_teacher) {
        let dir = crate::hub::resolve(dir, "--opd-teacher-load")?;
        let dir = miles_rollout::checkpoint::model_dir(&dir, a.opd.opd_teacher_ckpt_step)
            .map_err(|e| format!("--opd-teacher-load: {e}"))?;
        tracing::info!("OPD teacher: {}", dir.display());
        actor = actor.with_teacher(CausalLm::from_pretrained(&dir, &c.device)?)?;
    }
    if let Some(dir) = a.model.ref_load.as_deref() {
        let dir = crate::hub::resolve(dir, "--ref-load")?;
        let dir = miles_rollout::checkpoint::model_dir(&dir, a.model.ref_ckpt_step)
            .map_err(|e| format!("--ref-load: {e}"))?;
        tracing::info!("reference model: {}", dir.display());
        actor = actor.with_reference(CausalLm::from_pretrained(&dir, &c.device)?)?;
    }
    let mut boxed: Box<dyn PolicyTrainer> = Box::new(actor);
    if a.rollout.save_debug_rollout_data.is_some() || a.rollout.save_debug_trajectory_data.is_some()
    {
        boxed = Box::new(DebugRolloutDump {
            inner: boxed,
            samples: a.rollout.save_debug_rollout_data.clone(),
            trajectories: a.rollout.save_debug_trajectory_data.clone(),
        });
    }
    let trainer: SharedTrainer = Arc::new(Mutex::new(boxed));

    let save = a
        .model
        .save
        .clone()
        .unwrap_or_else(|| c.out.join("checkpoints"));
    let resume = match a.model.load.as_deref() {
        None => false,
        Some(load)
            if Path::new(load) == save
                || std::fs::canonicalize(load)
                    .is_ok_and(|l| std::fs::canonicalize(&save).is_ok_and(|s| s == l)) =>
        {
            true
        }
        Some(load) if a.model.save.as_deref().is_none() => {
            return Err(format!(
                "--load {load}: give --save {load} too (checkpoints continue where they are read)"
            )
            .into());
        }
        Some(load) => {
            return Err(format!(
                "--load {load} differs from --save {}: resuming writes to the directory it reads",
                save.display()
            )
            .into());
        }
    };
    let defaults = LoopConfig::default();
    // The fully async loop's buffer holds this many groups (Miles' formula).
    let capacity = asynchronous.then(|| {
        (defaults.async_data_buffer_capacity_factor * rollout.rollout_batch_size as f64).floor()
    });
    let (sink, progress, metrics_server) =
        sinks(a, &c.out, resume, num_rollout, &eval_key, capacity)?;
    let loop_config = LoopConfig {
        num_rollout,
        update_weights_interval: a.rollout.update_weights_interval,
        max_weight_staleness: a.rollout.max_weight_staleness,
        save_interval: a.model.save_interval,
        save: Some(save.clone()),
        keep_checkpoints: a.model.keep_checkpoints,
        offload_rollout: !offload.is_empty(),
        offload_rollout_level: offload,
        ..defaults
    };
    let eval_interval: Option<u64> = a.eval.eval_interval;
    let data = DataSource::new(prompts, n, a.data.rollout_shuffle, c.seed)?;
    let (stop, signal) = stop_on_signal();
    let mut rl =
        RlLoop::new(loop_config, manager, trainer.clone(), sink.clone(), data)?.with_stop(stop);
    if !evals.is_empty() {
        // Without --eval-interval: once, after the last step.
        rl = rl
            .with_eval(evals, eval_interval.unwrap_or(num_rollout.max(1)))
            .skip_eval_before_train(a.eval.skip_eval_before_train || eval_interval.is_none());
    }
    let mut summary = json!({"command": if asynchronous { "train-async" } else { "train" }});
    if resume {
        let step = rl.resume().await?;
        for note in rl.resume_notes() {
            println!("resume: {note}");
        }
        println!("resumed at step {step} from {}", save.display());
        summary["resumed_at"] = json!(step);
    }
    println!(
        "{}: {num_rollout} rollouts × {} prompts × {n} samples",
        if asynchronous { "train-async" } else { "train" },
        rollout.rollout_batch_size
    );
    let t = Instant::now();
    if asynchronous {
        rl.run_async().await?;
    } else {
        rl.run_sync().await?;
    }
    progress.finish();
    sink.flush()?;
    summary["train_seconds"] = json!(t.elapsed().as_secs_f64());
    if rl.stopped() {
        // A user's SIGINT / SIGTERM: the loop wrote its checkpoint; no final evaluation or
        // export, so the stop stays prompt.
        let code = signal.load(std::sync::atomic::Ordering::SeqCst);
        summary["stopped_at"] = json!(rl.next_rollout_id());
        summary["stopped_by_signal"] = json!(code);
        summary["total_seconds"] = json!(started.elapsed().as_secs_f64());
        close_run(&c.out, &summary, metrics_server)?;
        tracing::info!(
            step = rl.next_rollout_id(),
            checkpoints = %save.display(),
            "stopped by a signal; resume with --load {} --save {}",
            save.display(),
            save.display()
        );
        return Ok(Outcome {
            summary,
            stopped_by: Some(code),
        });
    }
    // The loop evaluated before training and after its last step (logged with those steps).
    let evaluations = rl.evaluations();
    if let Some((_, before)) = evaluations.iter().find(|(step, _)| step.is_none()) {
        summary["eval_before"] = json!(before);
    }
    if let Some((_, after)) = evaluations
        .iter()
        .rfind(|(step, _)| step.is_some_and(|s| s + 1 == num_rollout))
    {
        summary["eval_after"] = json!(after);
    }
    // The engine is done: its decode copies and pool go back before the final checkpoint is
    // exported (the export's host copy of the weights would otherwise come on top of them),
    // and so do the gradient buffers the trainer kept for its next step.
    engine
        .release_memory_occupation(&[MemoryTag::KvCache, MemoryTag::Weights])
        .await?;
    miles_ops::drop_result_buffers();
    let (weights, version) = {
        let guard = trainer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (guard.export_weights()?, guard.weight_version())
    };
    let final_dir = a
        .model
        .save_hf
        .clone()
        .unwrap_or_else(|| c.out.join("final"));
    save_hf_checkpoint(&weights, &c.hf, &final_dir)?;
    let mut plot = crate::plot::PlotSpec::reward_kl_entropy();
    plot.panels[0].metrics.push(eval_key.clone());
    crate::plot::plot_metrics_file(
        &c.out.join("metrics.jsonl"),
        &c.out.join("curves.svg"),
        &plot,
    )?;
    summary["weight_version"] = json!(version.0);
    summary["final_checkpoint"] = json!(final_dir);
    summary["total_seconds"] = json!(started.elapsed().as_secs_f64());
    close_run(&c.out, &summary, metrics_server)?;
    println!(
        "done in {:.0} s: weight version {}; wrote {}/{{metrics.jsonl, curves.svg, summary.json}} and {}",
        started.elapsed().as_secs_f64(),
        version.0,
        c.out.display(),
        final_dir.display()
    );
    Ok(Outcome::finished(summary))
}

async fn eval(a: &TrainArgs) -> Result<Value, BoxError> {
    let c = common(a)?;
    // Needed only by datasets without their own rm_type.
    let reward = reward(a, c.seed).map_err(|e| e.to_string());
    let kv_tokens = a
        .rollout
        .sglang_max_total_tokens
        .unwrap_or(miles_engine::EngineConfig::default().kv_token_budget);
    let engine = engines(a, &c, None, true, 0, kv_tokens, None)?;
    let generator = agent_generator(a, &c, &engine, false).await?;
    let base = RolloutConfig {
        rollout_batch_size: 1,
        ..rollout_config_for_eval(a, &c)?
    };
    let sets = eval_sets(a, &c, &base, &engine, &reward, generator.as_ref())?;
    if sets.is_empty() {
        return Err(
            "eval needs --eval-config FILE or --eval-prompt-data NAME PATH [NAME PATH ...]".into(),
        );
    }
    let mut rows = Map::new();
    let mut all = miles_core::Metrics::new();
    for set in &sets {
        let metrics = set.evaluate().await?;
        for (k, v) in &metrics {
            println!("{k}: {v:.4}");
        }
        all.extend(metrics.clone());
        rows.insert(set.name.clone(), json!(metrics));
    }
    all.insert("eval/step".into(), 0.0);
    // metrics.jsonl (and TensorBoard) hold one row at step 0, as a training run's evaluations.
    let mut list: Vec<Arc<dyn MetricsSink>> = vec![Arc::new(JsonlMetricsSink::create(
        c.out.join("metrics.jsonl"),
    )?)];
    if a.metrics.use_tensorboard {
        list.push(Arc::new(crate::wiring::tensorboard_sink(
            a.metrics.tensorboard_dir.as_deref(),
            &c.out,
        )?));
    }
    let sink = miles_core::FanoutMetricsSink::new(list);
    sink.log(0, &all)?;
    sink.flush()?;
    let summary = json!({"command": "eval", "hf_checkpoint": c.hf, "eval": rows});
    let text = serde_json::to_string_pretty(&summary)?;
    std::fs::write(c.out.join("summary.json"), &text)?;
    std::fs::write(c.out.join("eval.json"), &text)?;
    Ok(summary)
}

/// The rollout settings evaluation inherits (no `--rollout-batch-size` needed).
fn rollout_config_for_eval(a: &TrainArgs, c: &Common) -> Result<RolloutConfig, BoxError> {
    Ok(RolloutConfig {
        reward_key: a.reward.reward_key.as_deref().map(str::to_owned),
        sampling: sampling(a, &c.eos_ids),
        rollout_max_response_len: a.rollout.rollout_max_response_len,
        rollout_max_context_len: a.rollout.rollout_max_context_len,
        rollout_seed: Some(a.rollout.rollout_seed),
        log_passrate: a.metrics.log_passrate,
        ..RolloutConfig::default()
    })
}

fn sft(a: &TrainArgs) -> Result<Value, BoxError> {
    if Precision::from_flags(a.model.bf16, a.model.fp16)?.is_half() {
        return Err("sft trains in f32 only: drop --bf16 / --fp16".into());
    }
    let hf = hf_checkpoint(a)?;
    let out = a.model.output_dir.clone();
    std::fs::create_dir_all(&out).map_err(|e| format!("--output-dir {}: {e}", out.display()))?;
    let data = PathBuf::from(
        a.data
            .prompt_data
            .as_deref()
            .ok_or("--prompt-data is required")?,
    );
    let mut options = crate::sft::SftOptions::new(&hf, &data);
    options.family =
        miles_tito::TitoFamily::parse(a.agent.tito.as_str()).map_err(|e| format!("--tito: {e}"))?;
    options.kwargs = serde_json::from_str(a.data.apply_chat_template_kwargs.as_str())
        .map_err(|e| format!("--apply-chat-template-kwargs: {e}"))?;
    options.epochs = a
        .data
        .num_epoch
        .map_or(Ok(1), usize::try_from)
        .map_err(|_| "--num-epoch is too large")?;
    options.global_batch_size = a.train.global_batch_size.unwrap_or(8);
    options.lr = a.train.lr;
    options.clip_grad = a.train.clip_grad;
    options.seed = a.model.seed;
    let save = a.model.save_hf.clone().unwrap_or_else(|| out.join("final"));
    options.save = Some(save.clone());
    options.metrics = Some(out.join("metrics.jsonl"));
    let report = crate::sft::run_sft(&options, |step, metrics| {
        if let Some(loss) = metrics.get("train/loss") {
            println!("sft step {step}: loss {loss:.4}");
        }
    })?;
    println!(
        "sft: {} conversations, {} steps; NLL per trained token {:.4} → {:.4}; wrote {}",
        report.conversations,
        report.steps,
        report.nll_before,
        report.nll_after,
        save.display()
    );
    let summary = json!({
        "command": "sft",
        "conversations": report.conversations,
        "trained_tokens": report.trained_tokens,
        "steps": report.steps,
        "nll_before": report.nll_before,
        "nll_after": report.nll_after,
        "final_checkpoint": save,
    });
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(summary)
}

/// `--save-debug-rollout-data` / `--save-debug-trajectory-data`: writes the samples of every
/// rollout the trainer gets (as JSON), and the conversations the session server recorded on
/// them (`metadata.messages`: one JSONL row per such sample, Miles' trajectory rows; no file
/// when there is none), before training on them. `{rollout_id}` in a path is the rollout.
struct DebugRolloutDump {
    inner: Box<dyn PolicyTrainer>,
    samples: Option<String>,
    trajectories: Option<String>,
}

impl DebugRolloutDump {
    fn write(template: &str, rollout_id: u64, bytes: &[u8]) -> miles_core::Result<()> {
        let path = template.replace("{rollout_id}", &rollout_id.to_string());
        let write = || -> std::io::Result<()> {
            if let Some(dir) = Path::new(&path).parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&path, bytes)
        };
        write().map_err(|e| miles_core::Error::io(&path, e))
    }
}

/// Miles' trajectory rows (`debug_data.trajectory_rows`): the samples that carry
/// `metadata.messages`, as `{sample_index, group_index, status, reward, prompt, messages}`
/// (a reward that is not a number is `null`), one compact JSON line each.
fn trajectory_rows(samples: &[miles_core::Sample]) -> String {
    samples
        .iter()
        .filter_map(|s| {
            let messages = s.metadata.get("messages")?;
            let reward = match &s.reward {
                Some(miles_core::Reward::Scalar(v)) => json!(v),
                _ => Value::Null,
            };
            let row = json!({
                "sample_index": s.index,
                "group_index": s.group_index,
                "status": s.status,
                "reward": reward,
                "prompt": s.prompt,
                "messages": messages,
            });
            Some(row.to_string() + "\n")
        })
        .collect()
}

impl PolicyTrainer for DebugRolloutDump {
    fn train(
        &mut self,
        rollout_id: u64,
        samples: &[miles_core::Sample],
    ) -> miles_core::Result<miles_core::Metrics> {
        if let Some(template) = &self.trajectories {
            let rows = trajectory_rows(samples);
            if !rows.is_empty() {
                Self::write(template, rollout_id, rows.as_bytes())?;
            }
        }
        if let Some(template) = &self.samples {
            let bytes = serde_json::to_vec(samples)
                .map_err(|e| miles_core::Error::io(template, std::io::Error::other(e)))?;
            Self::write(template, rollout_id, &bytes)?;
        }
        self.inner.train(rollout_id, samples)
    }

    fn export_weights(&self) -> miles_core::Result<miles_core::NamedTensors> {
        self.inner.export_weights()
    }

    fn export_in_process(&self) -> miles_core::Result<Option<miles_core::InProcessWeights>> {
        self.inner.export_in_process()
    }

    fn weight_version(&self) -> miles_core::WeightVersion {
        self.inner.weight_version()
    }

    fn save_checkpoint(&self, dir: &Path) -> miles_core::Result<()> {
        self.inner.save_checkpoint(dir)
    }

    fn load_checkpoint(&mut self, dir: &Path) -> miles_core::Result<()> {
        self.inner.load_checkpoint(dir)
    }
}
