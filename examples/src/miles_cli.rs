//! The `miles` command: RL post-training of an HF checkpoint on a prompt file with a reward,
//! from one command, with Miles' flag names (`train.py` / `train_async.py`).
//!
//! ```text
//! miles train        --hf-checkpoint DIR --prompt-data train.jsonl --rm-type math ...   # synchronous loop
//! miles train-async  --config run.toml --num-rollout 200                             # fully asynchronous
//! miles sft          --hf-checkpoint DIR --prompt-data conversations.jsonl --save-hf out/sft
//! miles eval         --hf-checkpoint DIR --eval-prompt-data aime aime.jsonl --rm-type math
//! ```
//!
//! Every flag maps onto a field of a library config type ([`miles_rollout::RolloutConfig`],
//! [`miles_rollout::LoopConfig`], [`miles_train::TrainConfig`], …), so a Rust user gets the same
//! run without the CLI. [`flag_set`] lists them; COMPATIBILITY.md has the table against Miles.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use miles_bridge::{CausalLm, Precision};
use miles_core::{
    InferenceEngine, JsonlMetricsSink, MetricsSink, PolicyTrainer, RewardFn, SamplingParams,
};
use miles_ops::device::DeviceSpec;
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use miles_reward::{BuiltinReward, RemoteReward, RmHubReward, RmType};
use miles_rollout::{
    AgentGenerator, ChatPromptEncoder, DataSource, DatasetKeys, DynamicFilter, EvalSet, LoopConfig,
    PromptRecord, RlLoop, RolloutConfig, RolloutManager, SharedTrainer,
};
use miles_rollout::{DatasetOptions, PromptDataPath, load_dataset};
use miles_session::agent::{AgentDriverConfig, AgentReward};
use miles_session::command_agent::{CommandAgent, CommandAgentConfig};
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};
use serde_json::{Map, Value, json};

use crate::flags::{FlagSet, FlagValues, Parsed};
use crate::wiring::{CurvesOnEval, ProgressSink, embedded_engine, save_hf_checkpoint};

/// Errors of a `miles` run (any crate's error, boxed).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The subcommands and what each does.
pub const SUBCOMMANDS: [(&str, &str); 4] = [
    (
        "train",
        "RL with the synchronous loop (rollout → train → weight update), as train.py",
    ),
    (
        "train-async",
        "RL with the fully asynchronous loop (generation overlaps training), as train_async.py",
    ),
    (
        "sft",
        "supervised fine-tuning on conversations (loss on assistant tokens)",
    ),
    (
        "eval",
        "evaluate a checkpoint on --eval-prompt-data sets, no training",
    ),
];

const ABOUT: &str = "miles: RL post-training of an HF checkpoint on your prompts with your \
reward, with Miles' flag names. Subcommands: train (synchronous loop), train-async (fully \
asynchronous), sft, eval. Flags may also come from --config FILE (TOML, keys = flag names).";

/// Every flag of `miles`, grouped as Miles' argument groups are.
pub fn flag_set() -> FlagSet {
    FlagSet::new("miles <train|train-async|sft|eval>", ABOUT)
        .group("Model and checkpoints")
        .value("--hf-checkpoint", "DIR", None, "the HF model directory to train (config.json, safetensors, tokenizer, chat template)")
        .value("--ref-load", "DIR", None, "the reference model for KL terms (default: the initial policy)")
        .value("--load", "DIR", None, "resume from the latest valid checkpoint in DIR (a previous run's --save)")
        .value("--save", "DIR", None, "checkpoint directory (default: OUTPUT/checkpoints)")
        .value("--save-interval", "N", None, "checkpoint every N rollouts (default: never, but the final weights are always written)")
        .value("--keep-checkpoints", "N", None, "keep only the newest N checkpoints")
        .value("--save-hf", "DIR", None, "where the final HF checkpoint goes (default: OUTPUT/final)")
        .value("--output-dir", "DIR", Some("runs/miles"), "metrics.jsonl, curves.svg, summary.json and the defaults above")
        .value("--device", "DEV", Some("flex"), "flex | wgpu[:N] | wgpu-cpu | cuda[:N] (trainer, and engine unless --rollout-device)")
        .value("--rollout-device", "DEV", None, "device of the embedded engine (default: --device)")
        .switch("--bf16", "mixed precision in bfloat16: the trainer's forward computes in bf16 on f32 master weights and AdamW state, the embedded engine holds its weights and KV cache in bf16, weights are exported in bf16 (Megatron's --bf16)")
        .switch("--fp16", "the same in float16 (Megatron's --fp16; no loss scaling; not with --bf16)")
        .value("--seed", "N", Some("1234"), "seed of initialisation and shuffling")
        .group("Data")
        .value("--prompt-data", "FILE", None, "training prompts: JSONL (.jsonl / .json) or Parquet (.parquet); FILE@[a:b] takes rows a..b")
        .value("--input-key", "KEY", Some("input"), "the prompt: a string or a list of chat messages")
        .value("--label-key", "KEY", None, "the reference answer")
        .value("--tool-key", "KEY", Some("tools"), "the tool list of a prompt")
        .value("--metadata-key", "KEY", Some("metadata"), "an object merged into the sample's metadata")
        .switch("--apply-chat-template", "render prompts with the checkpoint's chat template (else string prompts are tokenized as they are)")
        .value("--apply-chat-template-kwargs", "JSON", Some("{}"), "extra chat-template kwargs, e.g. {\"enable_thinking\": false}")
        .switch("--rollout-shuffle", "shuffle the prompts each epoch")
        .value("--num-epoch", "N", None, "passes over the prompts (sets --num-rollout when that is not given)")
        .switch("--skip-bad-rows", "skip (and count) prompt rows that cannot be used instead of failing on the first")
        .value("--max-row-bytes", "N", Some("16777216"), "largest prompt row in bytes")
        .group("Rollout")
        .value("--num-rollout", "N", None, "training steps (rollouts)")
        .value("--rollout-batch-size", "N", None, "prompts per rollout (required)")
        .value("--n-samples-per-prompt", "N", Some("1"), "samples per prompt (the GRPO group)")
        .value("--rollout-max-response-len", "N", Some("1024"), "response token limit")
        .value("--rollout-max-context-len", "N", None, "prompt + response token limit")
        .value("--rollout-temperature", "T", Some("1.0"), "sampling temperature")
        .value("--rollout-top-p", "P", Some("1.0"), "nucleus sampling")
        .value("--rollout-top-k", "K", Some("-1"), "top-k sampling (-1: off)")
        .nargs("--rollout-stop", "TEXT", "stop strings")
        .nargs("--rollout-stop-token-ids", "ID", "stop token ids (besides the model's EOS)")
        .value("--rollout-seed", "N", Some("42"), "sampling seed (sample i uses seed + i)")
        .value("--over-sampling-batch-size", "N", None, "prompts fetched at a time when dynamic sampling drops groups")
        .switch("--partial-rollout", "keep aborted partial generations and resume them")
        .value("--save-debug-rollout-data", "PATH", None, "write each rollout's training samples as a JSON array to PATH ({rollout_id} is replaced by the rollout id)")
        .switch("--generate-multi-samples", "with --agent-cmd: one training sample per turn instead of one merged sample per session; the rollout's reward goes to every turn, advantages are normalised per rollout, each rollout's loss is one token-weighted mean and --global-batch-size counts rollouts")
        .value("--dynamic-sampling-filter-path", "NAME", None, "check_reward_nonzero_std | check_no_aborted (Miles' filter_hub names; a dotted path's last part)")
        .value("--max-weight-staleness", "N", None, "regenerate samples older than N weight versions")
        .value("--update-weights-interval", "N", Some("1"), "push weights to the engines every N steps")
        .repeat("--engine-url", "URL", "roll out on this SGLang-compatible server (repeatable; a router spreads the load; weight updates go through --output-dir/weights, which the servers must see)")
        .value("--max-running-requests", "N", Some("64"), "embedded engine: sequences decoded together")
        .group("Training")
        .value("--global-batch-size", "N", None, "samples per optimizer step (default: the whole rollout)")
        .value("--micro-batch-size", "N", Some("1"), "samples per micro-batch")
        .value("--num-steps-per-rollout", "N", None, "optimizer steps per rollout (instead of --global-batch-size)")
        .value("--lr", "LR", Some("1e-6"), "peak learning rate (AdamW)")
        .value("--min-lr", "LR", Some("0.0"), "final learning rate of a decaying schedule")
        .value("--lr-warmup-iters", "N", Some("0"), "optimizer steps of linear warm-up")
        .value("--lr-decay-style", "NAME", Some("constant"), "constant | linear | cosine")
        .value("--lr-decay-iters", "N", None, "optimizer steps of the decay")
        .value("--clip-grad", "X", Some("1.0"), "global gradient-norm clip (0: off)")
        .value("--weight-decay", "X", None, "AdamW weight decay")
        .value("--advantage-estimator", "NAME", Some("grpo"), "grpo | gspo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo")
        .value("--eps-clip", "X", Some("0.2"), "PPO clip (low side)")
        .value("--eps-clip-high", "X", None, "PPO clip (high side; default: --eps-clip)")
        .switch("--use-kl-loss", "KL loss to the reference model")
        .value("--kl-loss-coef", "X", Some("0.0"), "KL loss weight")
        .value("--kl-loss-type", "NAME", Some("k1"), "k1 | k2 | k3 | low_var_kl")
        .value("--entropy-coef", "X", Some("0.0"), "entropy bonus weight")
        .switch("--use-tis", "truncated importance sampling on the rollout / trainer mismatch")
        .value("--tis-clip", "X", Some("2.0"), "TIS upper clip")
        .switch("--use-rollout-routing-replay", "record routed experts at rollout and replay them in training (R3; MoE models)")
        .value("--batch-layout", "NAME", Some("padded"), "padded | packed | per_sample micro-batches (equal up to float rounding)")
        .group("LoRA")
        .value("--lora-rank", "N", Some("0"), "LoRA rank (0: full fine-tuning)")
        .value("--lora-alpha", "X", Some("16"), "LoRA alpha")
        .value("--target-modules", "LIST", None, "comma-separated module names, or all-linear")
        .group("Evaluation")
        .nargs("--eval-prompt-data", "NAME PATH", "evaluation sets as name / file pairs")
        .value("--eval-interval", "N", None, "evaluate every N rollouts (and before training)")
        .value("--n-samples-per-eval-prompt", "N", Some("1"), "samples per evaluation prompt")
        .switch("--skip-eval-before-train", "do not evaluate before the first rollout")
        .value("--eval-temperature", "T", None, "evaluation temperature (default: the rollout's)")
        .value("--eval-top-p", "P", None, "evaluation nucleus sampling (default: the rollout's)")
        .value("--eval-top-k", "K", None, "evaluation top-k (default: the rollout's)")
        .value("--eval-input-key", "KEY", None, "the evaluation sets' prompt key (default: --input-key)")
        .value("--eval-label-key", "KEY", None, "the evaluation sets' label key (default: --label-key)")
        .value("--eval-tool-key", "KEY", None, "the evaluation sets' tool key (default: --tool-key)")
        .value("--eval-max-response-len", "N", None, "evaluation response limit (default: the rollout's)")
        .group("Reward")
        .value("--rm-type", "NAME", None, "Miles' rm_hub rule: math | dapo | deepscaler | gemma_math | f1 | gpqa | random | deterministic_random | remote_rm, each also as boxed_NAME; or exact_match | numeric_match. A sample's metadata rm_type overrides it")
        .value("--rm-url", "URL", None, "reward-model server for remote_rm")
        .group("Agents")
        .value("--agent-cmd", "CMD", None, "an agent in any language, run with sh -c once per sample against an in-process session server (OPENAI_BASE_URL, OPENAI_API_KEY; the sample as JSON on stdin; optional {\"reward\": …, \"metadata\": …} as the last stdout line)")
        .value("--agent-timeout-s", "S", Some("3600"), "an agent's wall-clock limit (0: none); past it the sample is ABORTED")
        .switch("--use-session-server", "implied by --agent-cmd (the session server records exact tokens, log-probs and routed experts)")
        .value("--reward-key", "KEY", None, "which entry of a dict reward to train on")
        .group("Chat template")
        .value("--tito", "FAMILY", Some("default"), "the TITO family of the session server (--agent-cmd) and of sft's tokenization: default | qwen3 | glm47 | …")
        .group("Logging and metrics")
        .switch("--use-tensorboard", "write TensorBoard event files (step = rollout id)")
        .value("--tensorboard-dir", "DIR", None, "TensorBoard directory (default: $TENSORBOARD_DIR, else OUTPUT/tensorboard)")
        .alias("--tb-project-name")
        .switch("--use-wandb", "not built in: use --use-tensorboard and `wandb sync --sync-tensorboard DIR`")
        .value("--metrics-port", "PORT", None, "serve Prometheus /metrics of the trainer on 127.0.0.1:PORT (0: any free port)")
        .switch("--use-prometheus", "serve /metrics on --prometheus-port (Miles' spelling of --metrics-port)")
        .value("--prometheus-port", "PORT", Some("9090"), "the port of --use-prometheus")
}

/// Runs `miles` on `argv` (without the program name). Returns the run's summary.
pub async fn run(argv: Vec<String>) -> Result<Value, BoxError> {
    let Some((command, rest)) = argv.split_first() else {
        println!("{}", usage());
        return Ok(Value::Null);
    };
    if command == "--help" || command == "-h" || command == "help" {
        println!("{}", usage());
        return Ok(Value::Null);
    }
    let Some(&(name, _)) = SUBCOMMANDS.iter().find(|(n, _)| n == command) else {
        let names: Vec<&str> = SUBCOMMANDS.iter().map(|(n, _)| *n).collect();
        return Err(format!("unknown subcommand {command:?}: expected one of {names:?}").into());
    };
    let args = match flag_set().parse(rest.iter().cloned())? {
        Parsed::Help(text) => {
            println!("{text}");
            return Ok(Value::Null);
        }
        Parsed::Args(a) => a,
    };
    if args.switch("--use-wandb") {
        return Err("--use-wandb: the wandb format is not written here; use --use-tensorboard and upload with `wandb sync --sync-tensorboard DIR`".into());
    }
    match name {
        "train" => train(&args, false).await,
        "train-async" => train(&args, true).await,
        "sft" => sft(&args),
        _ => eval(&args).await,
    }
}

fn usage() -> String {
    let mut out = format!(
        "{ABOUT}\n\nUsage: miles <SUBCOMMAND> [FLAGS]   (miles <SUBCOMMAND> --help lists the flags)\n\nSubcommands:\n"
    );
    for (name, what) in SUBCOMMANDS {
        out.push_str(&format!("  {name:12} {what}\n"));
    }
    out
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

fn common(a: &FlagValues) -> Result<Common, BoxError> {
    let hf = PathBuf::from(a.required("--hf-checkpoint")?);
    let out = PathBuf::from(a.required("--output-dir")?);
    std::fs::create_dir_all(&out)?;
    let spec: DeviceSpec = a.required("--device")?.parse()?;
    let device = spec.init()?;
    let precision = Precision::from_flags(a.switch("--bf16"), a.switch("--fp16"))?;
    let rollout_device = match a.get("--rollout-device") {
        Some(s) => s.parse::<DeviceSpec>()?.init()?,
        None => device.clone(),
    };
    let kwargs: Map<String, Value> =
        serde_json::from_str(a.required("--apply-chat-template-kwargs")?)
            .map_err(|e| format!("--apply-chat-template-kwargs: not a JSON object: {e}"))?;
    let encoder = Arc::new(
        ChatPromptEncoder::load(&hf)?
            .with_kwargs(kwargs)
            .with_raw_text(!a.switch("--apply-chat-template")),
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
        seed: a.parse_required("--seed")?,
        encoder,
    })
}

fn dataset_keys(a: &FlagValues) -> Result<DatasetKeys, BoxError> {
    Ok(DatasetKeys {
        input_key: a.required("--input-key")?.to_owned(),
        label_key: a.get("--label-key").map(str::to_owned),
        metadata_key: a.required("--metadata-key")?.to_owned(),
        tool_key: a.required("--tool-key")?.to_owned(),
    })
}

/// Reads a prompt file (JSONL or Parquet, with an optional `@[a:b]` row slice); with
/// `--skip-bad-rows` prints how many rows were skipped and why the first were.
fn load_prompts(
    a: &FlagValues,
    path: &str,
    keys: &DatasetKeys,
) -> Result<Vec<PromptRecord>, BoxError> {
    let source: PromptDataPath = path.parse()?;
    let options = DatasetOptions {
        keys: keys.clone(),
        skip_bad_rows: a.switch("--skip-bad-rows"),
        max_row_bytes: a.parse_required("--max-row-bytes")?,
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
fn reward(a: &FlagValues, seed: u64) -> Result<Arc<dyn RewardFn>, BoxError> {
    let rm_type = a.get("--rm-type");
    let remote = a
        .get("--rm-url")
        .map(|url| RemoteReward::new(url, std::time::Duration::from_secs(60)));
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
    Ok(match (a.get("--agent-cmd"), rule) {
        (Some(_), Some(rule)) => Arc::new(AgentReward::new().with_fallback(rule)),
        (Some(_), None) => Arc::new(AgentReward::new()),
        (None, Some(rule)) => rule,
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
    a: &FlagValues,
    c: &Common,
    engine: &Arc<dyn InferenceEngine>,
    use_r3: bool,
) -> Result<Option<Arc<AgentGenerator>>, BoxError> {
    let Some(cmd) = a.get("--agent-cmd") else {
        if a.switch("--generate-multi-samples") {
            return Err("--generate-multi-samples needs --agent-cmd (per-turn samples come from the session server)".into());
        }
        return Ok(None);
    };
    // Miles applies --apply-chat-template-kwargs to every render of the session server.
    let kwargs: Map<String, Value> =
        serde_json::from_str(a.required("--apply-chat-template-kwargs")?)
            .map_err(|e| format!("--apply-chat-template-kwargs: not a JSON object: {e}"))?;
    let url = crate::wiring::spawn_session_server(
        engine.clone(),
        &c.hf,
        a.required("--tito")?,
        use_r3,
        kwargs,
    )
    .await?;
    println!("session server on {url}; agent: {cmd}");
    let mut config = CommandAgentConfig::shell(cmd);
    config.timeout = match a.parse_required::<f64>("--agent-timeout-s")? {
        t if t > 0.0 && t.is_finite() => Some(std::time::Duration::from_secs_f64(t)),
        _ => None,
    };
    let agent = Arc::new(CommandAgent::new(config)?);
    Ok(Some(Arc::new(AgentGenerator::new(
        agent,
        AgentDriverConfig::new(url)
            .with_generate_multi_samples(a.switch("--generate-multi-samples")),
    ))))
}

fn sampling(a: &FlagValues, eos_ids: &[u32]) -> Result<SamplingParams, BoxError> {
    let mut stop_token_ids = eos_ids.to_vec();
    for id in a.all("--rollout-stop-token-ids") {
        stop_token_ids.push(
            id.parse()
                .map_err(|e| format!("--rollout-stop-token-ids {id:?}: {e}"))?,
        );
    }
    Ok(SamplingParams {
        temperature: a.parse_required("--rollout-temperature")?,
        top_p: a.parse_required("--rollout-top-p")?,
        top_k: a.parse_required("--rollout-top-k")?,
        stop: a.all("--rollout-stop").to_vec(),
        stop_token_ids,
        ..SamplingParams::default()
    })
}

/// The engines: the embedded one on `model`, or a router over `--engine-url` servers.
fn engines(
    a: &FlagValues,
    c: &Common,
    num_layers: Option<usize>,
) -> Result<Arc<dyn InferenceEngine>, BoxError> {
    let urls = a.all("--engine-url");
    if urls.is_empty() {
        let model = CausalLm::from_pretrained(&c.hf, &c.rollout_device)?;
        return Ok(embedded_engine(
            model,
            &c.hf,
            c.eos_ids.clone(),
            a.parse_required("--max-running-requests")?,
            c.seed,
            c.precision,
        )?);
    }
    Ok(crate::wiring::sglang_fleet(
        urls,
        &c.out.join("weights"),
        num_layers,
    )?)
}

fn rollout_config(a: &FlagValues, c: &Common, use_r3: bool) -> Result<RolloutConfig, BoxError> {
    let filters = match a.get("--dynamic-sampling-filter-path") {
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
        n_samples_per_prompt: a.parse_required("--n-samples-per-prompt")?,
        rollout_batch_size: a
            .parse("--rollout-batch-size")?
            .ok_or("--rollout-batch-size is required")?,
        over_sampling_batch_size: a.parse("--over-sampling-batch-size")?,
        sampling: sampling(a, &c.eos_ids)?,
        rollout_max_response_len: a.parse_required("--rollout-max-response-len")?,
        rollout_max_context_len: a.parse("--rollout-max-context-len")?,
        rollout_seed: Some(a.parse_required("--rollout-seed")?),
        dynamic_filters: filters,
        reward_key: a.get("--reward-key").map(str::to_owned),
        partial_rollout: a.switch("--partial-rollout"),
        return_routed_experts: use_r3,
        ..RolloutConfig::default()
    })
}

/// The `--eval-prompt-data` sets, each with its own manager (evaluation sampling).
fn eval_sets(
    a: &FlagValues,
    c: &Common,
    base: &RolloutConfig,
    engine: &Arc<dyn InferenceEngine>,
    reward: &Arc<dyn RewardFn>,
    generator: Option<&Arc<AgentGenerator>>,
) -> Result<Vec<EvalSet>, BoxError> {
    let pairs = a.all("--eval-prompt-data");
    if !pairs.len().is_multiple_of(2) {
        return Err("--eval-prompt-data takes NAME PATH pairs".into());
    }
    let mut keys = dataset_keys(a)?;
    if let Some(k) = a.get("--eval-input-key") {
        keys.input_key = k.to_owned();
    }
    if let Some(k) = a.get("--eval-label-key") {
        keys.label_key = Some(k.to_owned());
    }
    if let Some(k) = a.get("--eval-tool-key") {
        keys.tool_key = k.to_owned();
    }
    let mut sampling = base.sampling.clone();
    if let Some(t) = a.parse("--eval-temperature")? {
        sampling.temperature = t;
    }
    if let Some(p) = a.parse("--eval-top-p")? {
        sampling.top_p = p;
    }
    if let Some(k) = a.parse("--eval-top-k")? {
        sampling.top_k = k;
    }
    let mut manager = RolloutManager::new(
        RolloutConfig {
            n_samples_per_prompt: a.parse_required("--n-samples-per-eval-prompt")?,
            sampling,
            rollout_max_response_len: a
                .parse("--eval-max-response-len")?
                .unwrap_or(base.rollout_max_response_len),
            rollout_seed: Some(c.seed ^ 0xE7A1),
            return_routed_experts: false,
            dynamic_filters: Vec::new(),
            partial_rollout: false,
            ..base.clone()
        },
        engine.clone(),
        c.encoder.clone(),
        reward.clone(),
    )?;
    if let Some(generator) = generator {
        // Evaluation scores whole conversations: one merged sample per session.
        manager = manager.with_generator(Arc::new(generator.with_generate_multi_samples(false)));
    }
    let manager = Arc::new(manager);
    pairs
        .chunks(2)
        .map(|pair| {
            Ok(EvalSet {
                name: pair[0].clone(),
                prompts: load_prompts(a, &pair[1], &keys)?,
                manager: manager.clone(),
            })
        })
        .collect()
}

fn train_config(
    a: &FlagValues,
    n: usize,
    use_r3: bool,
    seed: u64,
) -> Result<TrainConfig, BoxError> {
    let estimator: AdvantageEstimator = a
        .required("--advantage-estimator")?
        .parse()
        .map_err(|e| format!("--advantage-estimator: {e}"))?;
    let mut lr_schedule = LrSchedule {
        lr: a.parse_required("--lr")?,
        min_lr: a.parse_required("--min-lr")?,
        lr_warmup_iters: a.parse_required("--lr-warmup-iters")?,
        lr_decay_iters: a.parse("--lr-decay-iters")?,
        ..LrSchedule::default()
    };
    let style = a.required("--lr-decay-style")?;
    lr_schedule.lr_decay_style = serde_json::from_value(json!(style))
        .map_err(|_| format!("--lr-decay-style {style:?}: expected constant, linear or cosine"))?;
    let mut config = TrainConfig {
        lr_schedule,
        clip_grad: a.parse_required("--clip-grad")?,
        global_batch_size: a.parse("--global-batch-size")?,
        num_steps_per_rollout: a.parse("--num-steps-per-rollout")?,
        micro_batch_size: a.parse_required("--micro-batch-size")?,
        layout: a.parse_required::<BatchLayout>("--batch-layout")?,
        advantage: AdvantageConfig {
            advantage_estimator: estimator,
            ..AdvantageConfig::default()
        }
        .with_n_samples_per_prompt(n),
        reward_key: a.get("--reward-key").map(str::to_owned),
        use_routing_replay: use_r3,
        lora_rank: a.parse_required("--lora-rank")?,
        lora_alpha: a.parse_required("--lora-alpha")?,
        target_modules: a.get("--target-modules").map(str::to_owned),
        seed,
        ..TrainConfig::default()
    };
    if let Some(wd) = a.parse("--weight-decay")? {
        config.optimizer.weight_decay = wd;
    }
    let p = &mut config.policy_loss;
    p.advantage_estimator = estimator;
    p.eps_clip = a.parse_required("--eps-clip")?;
    p.eps_clip_high = a.parse("--eps-clip-high")?;
    p.use_kl_loss = a.switch("--use-kl-loss");
    p.kl_loss_coef = a.parse_required("--kl-loss-coef")?;
    p.kl_loss_type = a
        .required("--kl-loss-type")?
        .parse()
        .map_err(|e| format!("--kl-loss-type: {e}"))?;
    p.entropy_coef = a.parse_required("--entropy-coef")?;
    p.use_tis = a.switch("--use-tis");
    p.tis_clip = a.parse_required("--tis-clip")?;
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
    a: &FlagValues,
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
    if a.switch("--use-tensorboard") {
        list.push(Arc::new(crate::wiring::tensorboard_sink(
            a.get("--tensorboard-dir"),
            out,
        )?));
    }
    let port: Option<u16> = match a.parse("--metrics-port")? {
        Some(p) => Some(p),
        None if a.switch("--use-prometheus") => Some(a.parse_required("--prometheus-port")?),
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

async fn train(a: &FlagValues, asynchronous: bool) -> Result<Value, BoxError> {
    let started = Instant::now();
    let c = common(a)?;
    let keys = dataset_keys(a)?;
    let prompts = load_prompts(a, a.required("--prompt-data")?, &keys)?;
    let use_r3 = a.switch("--use-rollout-routing-replay");
    let model = CausalLm::from_pretrained(&c.hf, &c.device.clone().autodiff())?;
    if use_r3 && !model.config.has_moe() {
        return Err("--use-rollout-routing-replay needs an MoE model".into());
    }
    let moe_layers = (0..model.config.num_hidden_layers)
        .filter(|&l| model.config.is_moe_layer(l))
        .count();
    let reward = reward(a, c.seed)?;
    let engine = engines(
        a,
        &c,
        Some(model.config.num_hidden_layers).filter(|_| moe_layers > 0),
    )?;
    let generator = agent_generator(a, &c, &engine, use_r3).await?;
    let rollout = rollout_config(a, &c, use_r3)?;
    let n = rollout.n_samples_per_prompt;
    let num_rollout: u64 = match (
        a.parse::<u64>("--num-rollout")?,
        a.parse::<u64>("--num-epoch")?,
    ) {
        (Some(n), _) => n,
        (None, Some(epochs)) => {
            (epochs * prompts.len() as u64 / rollout.rollout_batch_size as u64).max(1)
        }
        (None, None) => return Err("--num-rollout or --num-epoch is required".into()),
    };
    let evals = eval_sets(a, &c, &rollout, &engine, &reward, generator.as_ref())?;
    let eval_key = evals.first().map_or("eval/raw_reward".to_string(), |s| {
        format!("eval/{}/raw_reward", s.name)
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
    let manager = Arc::new(manager);
    let mut config = train_config(a, n, use_r3, c.seed)?;
    config.precision = c.precision;
    let mut actor = Actor::new(model, config)?;
    if let Some(dir) = a.get("--ref-load") {
        actor = actor.with_reference(CausalLm::from_pretrained(dir, &c.device)?)?;
    }
    let mut boxed: Box<dyn PolicyTrainer> = Box::new(actor);
    if let Some(template) = a.get("--save-debug-rollout-data") {
        boxed = Box::new(DebugRolloutDump {
            inner: boxed,
            template: template.to_owned(),
        });
    }
    let trainer: SharedTrainer = Arc::new(Mutex::new(boxed));

    let save = a
        .get("--save")
        .map(PathBuf::from)
        .unwrap_or_else(|| c.out.join("checkpoints"));
    let resume = match a.get("--load") {
        None => false,
        Some(load)
            if Path::new(load) == save
                || std::fs::canonicalize(load)
                    .is_ok_and(|l| std::fs::canonicalize(&save).is_ok_and(|s| s == l)) =>
        {
            true
        }
        Some(load) if a.get("--save").is_none() => {
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
        update_weights_interval: a.parse_required("--update-weights-interval")?,
        max_weight_staleness: a.parse("--max-weight-staleness")?,
        save_interval: a.parse("--save-interval")?,
        save: Some(save.clone()),
        keep_checkpoints: a.parse("--keep-checkpoints")?,
        ..defaults
    };
    let eval_interval: Option<u64> = a.parse("--eval-interval")?;
    let data = DataSource::new(prompts, n, a.switch("--rollout-shuffle"), c.seed)?;
    let mut rl = RlLoop::new(loop_config, manager, trainer.clone(), sink.clone(), data)?;
    if !evals.is_empty() {
        rl = rl.with_eval(evals, eval_interval.unwrap_or(num_rollout.max(1)));
    }
    let mut summary = json!({"command": if asynchronous { "train-async" } else { "train" }});
    if resume {
        let step = rl.resume().await?;
        for note in rl.resume_notes() {
            println!("resume: {note}");
        }
        println!("resumed at step {step} from {}", save.display());
        summary["resumed_at"] = json!(step);
    } else if eval_interval.is_some() && !a.switch("--skip-eval-before-train") {
        let before = rl.evaluate().await?;
        sink.log(0, &before)?;
        summary["eval_before"] = json!(before);
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
    let after = rl.evaluate().await?;
    if !after.is_empty() {
        sink.log(num_rollout, &after)?;
        summary["eval_after"] = json!(after);
    }
    let (weights, version) = {
        let guard = trainer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (guard.export_weights()?, guard.weight_version())
    };
    let final_dir = a
        .get("--save-hf")
        .map(PathBuf::from)
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
    std::fs::write(
        c.out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    if let Some(server) = metrics_server {
        server.stop()?;
    }
    println!(
        "done in {:.0} s: weight version {}; wrote {}/{{metrics.jsonl, curves.svg, summary.json}} and {}",
        started.elapsed().as_secs_f64(),
        version.0,
        c.out.display(),
        final_dir.display()
    );
    Ok(summary)
}

async fn eval(a: &FlagValues) -> Result<Value, BoxError> {
    let c = common(a)?;
    let reward = reward(a, c.seed)?;
    let engine = engines(a, &c, None)?;
    let generator = agent_generator(a, &c, &engine, false).await?;
    let base = RolloutConfig {
        rollout_batch_size: 1,
        ..rollout_config_for_eval(a, &c)?
    };
    let sets = eval_sets(a, &c, &base, &engine, &reward, generator.as_ref())?;
    if sets.is_empty() {
        return Err("eval needs --eval-prompt-data NAME PATH [NAME PATH ...]".into());
    }
    let mut rows = Map::new();
    for set in sets {
        let name = set.name.clone();
        let metrics = set.evaluate().await?;
        for (k, v) in &metrics {
            println!("{k}: {v:.4}");
        }
        rows.insert(name, json!(metrics));
    }
    let summary = json!({"command": "eval", "hf_checkpoint": c.hf, "eval": rows});
    std::fs::write(
        c.out.join("eval.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(summary)
}

/// The rollout settings evaluation inherits (no `--rollout-batch-size` needed).
fn rollout_config_for_eval(a: &FlagValues, c: &Common) -> Result<RolloutConfig, BoxError> {
    Ok(RolloutConfig {
        reward_key: a.get("--reward-key").map(str::to_owned),
        sampling: sampling(a, &c.eos_ids)?,
        rollout_max_response_len: a.parse_required("--rollout-max-response-len")?,
        rollout_max_context_len: a.parse("--rollout-max-context-len")?,
        rollout_seed: Some(a.parse_required("--rollout-seed")?),
        ..RolloutConfig::default()
    })
}

fn sft(a: &FlagValues) -> Result<Value, BoxError> {
    if Precision::from_flags(a.switch("--bf16"), a.switch("--fp16"))?.is_half() {
        return Err("sft trains in f32 only: drop --bf16 / --fp16".into());
    }
    let hf = PathBuf::from(a.required("--hf-checkpoint")?);
    let out = PathBuf::from(a.required("--output-dir")?);
    std::fs::create_dir_all(&out)?;
    let data = PathBuf::from(a.required("--prompt-data")?);
    let mut options = crate::sft::SftOptions::new(&hf, &data);
    options.family =
        miles_tito::TitoFamily::parse(a.required("--tito")?).map_err(|e| format!("--tito: {e}"))?;
    options.kwargs = serde_json::from_str(a.required("--apply-chat-template-kwargs")?)
        .map_err(|e| format!("--apply-chat-template-kwargs: {e}"))?;
    options.epochs = a.parse("--num-epoch")?.unwrap_or(1);
    options.global_batch_size = a.parse("--global-batch-size")?.unwrap_or(8);
    options.lr = a.parse_required("--lr")?;
    options.clip_grad = a.parse_required("--clip-grad")?;
    options.seed = a.parse_required("--seed")?;
    let save = a
        .get("--save-hf")
        .map(PathBuf::from)
        .unwrap_or_else(|| out.join("final"));
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

/// `--save-debug-rollout-data`: writes the samples of every rollout the trainer gets (as
/// JSON) before training on them.
struct DebugRolloutDump {
    inner: Box<dyn PolicyTrainer>,
    template: String,
}

impl PolicyTrainer for DebugRolloutDump {
    fn train(
        &mut self,
        rollout_id: u64,
        samples: &[miles_core::Sample],
    ) -> miles_core::Result<miles_core::Metrics> {
        let path = self
            .template
            .replace("{rollout_id}", &rollout_id.to_string());
        let write = || -> std::io::Result<()> {
            if let Some(dir) = Path::new(&path).parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&path, serde_json::to_vec(samples)?)
        };
        write().map_err(|e| miles_core::Error::io(&path, e))?;
        self.inner.train(rollout_id, samples)
    }

    fn export_weights(&self) -> miles_core::Result<miles_core::NamedTensors> {
        self.inner.export_weights()
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
