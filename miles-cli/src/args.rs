//! The command line of `miles`: one clap parser for every subcommand, Miles' flag names in
//! Miles' help groups. Defaults are read from the library config types' `Default`
//! ([`TrainConfig`], [`RolloutConfig`], [`LoopConfig`], [`EngineConfig`], …), never written
//! here a second time; a flag without a library default is an `Option`.
//!
//! Adding a flag backed by a library config field is one field here (with its doc comment as
//! the help line) and one line where the config is built (`train.rs`, `serve.rs`, …).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use miles_engine::{DEFAULT_KV_MEMORY_FRACTION, EngineConfig};
use miles_ops::{AdvantageConfig, PolicyLossConfig};
use miles_rollout::{DatasetKeys, DatasetOptions, LoopConfig, RolloutConfig};
use miles_session::server::SessionServerConfig;
use miles_train::{LrSchedule, TrainConfig};

/// The version line: the crate version and, when built from a git checkout, the commit
/// (`build.rs` reads `git rev-parse`; without git, the version alone).
pub const VERSION: &str = env!("MILES_VERSION_LINE");

/// `miles`: RL post-training of HF checkpoints with Miles' flag names.
#[derive(Debug, Parser)]
#[command(
    name = "miles",
    version = VERSION,
    about = "RL post-training of an HF checkpoint on your prompts with your reward, with Miles' flag names",
    long_about = "RL post-training of an HF checkpoint on your prompts with your reward, with Miles' \
flag names: train (synchronous loop), train-async (fully asynchronous), sft, eval; the \
SGLang-compatible engine server (serve), the session server (session), checkpoint tools \
(bridge) and chat-template tools (tito). Flags of train / train-async / sft / eval may also \
come from --config FILE (TOML, keys = flag names; the command line wins).",
    propagate_version = true,
    disable_help_subcommand = true
)]
pub struct Cli {
    /// Logging options (every subcommand).
    #[command(flatten)]
    pub log: LogArgs,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Where log lines go and how they look.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Logging")]
pub struct LogArgs {
    /// Log filter: error | warn | info | debug | trace, or an env-filter directive such as
    /// `miles_session=debug,info` (default: $RUST_LOG, else warnings, and miles' own info lines)
    #[arg(long, global = true, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// Log line format on stderr
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// The format of log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line (for log collectors).
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)]
pub enum Command {
    /// RL with the synchronous loop (rollout → train → weight update), as Miles' train.py
    Train(TrainArgs),
    /// RL with the fully asynchronous loop (generation overlaps training), as train_async.py
    TrainAsync(TrainArgs),
    /// Supervised fine-tuning on conversations (loss on assistant tokens)
    Sft(TrainArgs),
    /// Evaluate a checkpoint on --eval-config / --eval-prompt-data sets, no training
    Eval(TrainArgs),
    /// Serve an HF checkpoint with the embedded engine over SGLang's HTTP protocol
    Serve(ServeArgs),
    /// The OpenAI-compatible session server in front of an SGLang-compatible engine
    Session(SessionArgs),
    /// SGLang's HTTP protocol in front of several SGLang-compatible servers (least
    /// outstanding requests, health checks, failover)
    Router(RouterArgs),
    /// Inspect, convert and score HF checkpoints
    Bridge {
        /// What to do.
        #[command(subcommand)]
        command: BridgeCommand,
    },
    /// Render chat templates, replay TITO sessions, verify templates
    Tito {
        /// What to do.
        #[command(subcommand)]
        command: TitoCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell)
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn serde_name<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn train_defaults() -> TrainConfig {
    TrainConfig::default()
}

fn policy_defaults() -> PolicyLossConfig {
    PolicyLossConfig::default()
}

fn rollout_defaults() -> RolloutConfig {
    RolloutConfig::default()
}

fn schedule_defaults() -> LrSchedule {
    LrSchedule::default()
}

/// The flags of `train`, `train-async`, `sft` and `eval` (Miles' names and groups).
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Read flags from a TOML file (keys = flag names, `-` or `_`; the command line wins)
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Model and checkpoints.
    #[command(flatten)]
    pub model: ModelArgs,
    /// Data.
    #[command(flatten)]
    pub data: DataArgs,
    /// Rollout.
    #[command(flatten)]
    pub rollout: RolloutArgs,
    /// Training.
    #[command(flatten)]
    pub train: TrainingArgs,
    /// LoRA.
    #[command(flatten)]
    pub lora: LoraArgs,
    /// Evaluation.
    #[command(flatten)]
    pub eval: EvalArgs,
    /// Reward.
    #[command(flatten)]
    pub reward: RewardArgs,
    /// Agents.
    #[command(flatten)]
    pub agent: AgentArgs,
    /// On-policy distillation.
    #[command(flatten)]
    pub opd: OpdArgs,
    /// Logging and metrics.
    #[command(flatten)]
    pub metrics: MetricsArgs,
}

/// Model and checkpoints.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Model and checkpoints")]
pub struct ModelArgs {
    /// The HF model directory to train (config.json, safetensors, tokenizer, chat template),
    /// or a hub id (`Qwen/Qwen3-0.6B`) found in the local Hugging Face cache
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: Option<String>,
    /// The reference model for KL terms (default: the initial policy): an HF checkpoint, or
    /// an earlier run's --save folder (its newest valid checkpoint, or --ref-ckpt-step)
    #[arg(long, value_name = "DIR")]
    pub ref_load: Option<String>,
    /// With --ref-load at a run's --save folder: the checkpoint of this step (iter_NNNNNNN)
    #[arg(long, value_name = "N")]
    pub ref_ckpt_step: Option<u64>,
    /// Resume from the latest valid checkpoint in DIR (a previous run's --save)
    #[arg(long, value_name = "DIR")]
    pub load: Option<String>,
    /// Checkpoint directory (default: OUTPUT/checkpoints)
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Checkpoint every N rollouts (default: never, but the final weights are always written)
    #[arg(long, value_name = "N")]
    pub save_interval: Option<u64>,
    /// Keep only the newest N checkpoints
    #[arg(long, value_name = "N")]
    pub keep_checkpoints: Option<usize>,
    /// Where the final HF checkpoint goes (default: OUTPUT/final)
    #[arg(long, value_name = "DIR")]
    pub save_hf: Option<PathBuf>,
    /// metrics.jsonl, curves.svg, summary.json and the defaults above
    #[arg(long, value_name = "DIR", default_value = "runs/miles")]
    pub output_dir: PathBuf,
    /// flex | wgpu[:N] | wgpu-cpu | cuda[:N] (trainer, and engine unless --rollout-device)
    #[arg(long, value_name = "DEV", default_value = "flex")]
    pub device: String,
    /// Device of the embedded engine (default: --device)
    #[arg(long, value_name = "DEV")]
    pub rollout_device: Option<String>,
    /// Mixed precision in bfloat16: the trainer's forward computes in bf16 on f32 master
    /// weights and AdamW state, the embedded engine holds its weights and KV cache in bf16,
    /// weights are exported in bf16 (Megatron's --bf16)
    #[arg(long)]
    pub bf16: bool,
    /// The same in float16 (Megatron's --fp16; no loss scaling; not with --bf16)
    #[arg(long)]
    pub fp16: bool,
    /// Seed of initialisation and shuffling
    #[arg(long, value_name = "N", default_value_t = train_defaults().seed)]
    pub seed: u64,
}

/// Data.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Data")]
pub struct DataArgs {
    /// Training prompts: JSONL (.jsonl / .json) or Parquet (.parquet); FILE@[a:b] takes rows a..b
    #[arg(long, value_name = "FILE")]
    pub prompt_data: Option<String>,
    /// The prompt: a string or a list of chat messages
    #[arg(long, value_name = "KEY", default_value_t = DatasetKeys::default().input_key)]
    pub input_key: String,
    /// The reference answer (Miles' default: none)
    #[arg(long, value_name = "KEY")]
    pub label_key: Option<String>,
    /// The tool list of a prompt
    #[arg(long, value_name = "KEY", default_value_t = DatasetKeys::default().tool_key)]
    pub tool_key: String,
    /// An object merged into the sample's metadata
    #[arg(long, value_name = "KEY", default_value_t = DatasetKeys::default().metadata_key)]
    pub metadata_key: String,
    /// Render prompts with the checkpoint's chat template (else string prompts are tokenized
    /// as they are)
    #[arg(long)]
    pub apply_chat_template: bool,
    /// Extra chat-template kwargs, e.g. {"enable_thinking": false}
    #[arg(long, value_name = "JSON", default_value = "{}")]
    pub apply_chat_template_kwargs: String,
    /// Shuffle the prompts each epoch
    #[arg(long)]
    pub rollout_shuffle: bool,
    /// Passes over the prompts (sets --num-rollout when that is not given)
    #[arg(long, value_name = "N")]
    pub num_epoch: Option<u64>,
    /// Skip (and count, with a warning) prompt rows that cannot be used instead of failing on
    /// the first
    #[arg(long)]
    pub skip_bad_rows: bool,
    /// Largest prompt row in bytes
    #[arg(long, value_name = "N", default_value_t = DatasetOptions::default().max_row_bytes)]
    pub max_row_bytes: usize,
}

/// Rollout.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Rollout")]
pub struct RolloutArgs {
    /// Training steps (rollouts)
    #[arg(long, value_name = "N")]
    pub num_rollout: Option<u64>,
    /// Prompts per rollout (required for train / train-async)
    #[arg(long, value_name = "N")]
    pub rollout_batch_size: Option<usize>,
    /// Samples per prompt (the GRPO group)
    #[arg(long, value_name = "N", default_value_t = rollout_defaults().n_samples_per_prompt)]
    pub n_samples_per_prompt: usize,
    /// Response token limit
    #[arg(long, value_name = "N", default_value_t = rollout_defaults().rollout_max_response_len)]
    pub rollout_max_response_len: usize,
    /// Prompt + response token limit
    #[arg(long, value_name = "N")]
    pub rollout_max_context_len: Option<usize>,
    /// Sampling temperature
    #[arg(long, value_name = "T", default_value_t = rollout_defaults().sampling.temperature)]
    pub rollout_temperature: f32,
    /// Nucleus sampling
    #[arg(long, value_name = "P", default_value_t = rollout_defaults().sampling.top_p)]
    pub rollout_top_p: f32,
    /// Top-k sampling (-1: off)
    #[arg(long, value_name = "K", allow_negative_numbers = true,
          default_value_t = rollout_defaults().sampling.top_k)]
    pub rollout_top_k: i32,
    /// Stop strings
    #[arg(long, value_name = "TEXT", num_args = 1..)]
    pub rollout_stop: Vec<String>,
    /// Stop token ids (besides the model's EOS)
    #[arg(long, value_name = "ID", num_args = 1..)]
    pub rollout_stop_token_ids: Vec<u32>,
    /// Sampling seed (sample i uses seed + i; Miles' default 42)
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub rollout_seed: u64,
    /// Prompts fetched at a time when dynamic sampling drops groups
    #[arg(long, value_name = "N")]
    pub over_sampling_batch_size: Option<usize>,
    /// Keep aborted partial generations and resume them
    #[arg(long)]
    pub partial_rollout: bool,
    /// Write each rollout's training samples as a JSON array to PATH ({rollout_id} is
    /// replaced by the rollout id)
    #[arg(long, value_name = "PATH")]
    pub save_debug_rollout_data: Option<String>,
    /// With --agent-cmd: the session server puts each session's conversation on its sample as
    /// metadata.messages, and each rollout's conversations are written to PATH as JSONL, one
    /// row per sample ({rollout_id} in PATH is replaced)
    #[arg(long, value_name = "PATH")]
    pub save_debug_trajectory_data: Option<String>,
    /// With --agent-cmd: one training sample per turn instead of one merged sample per
    /// session; the rollout's reward goes to every turn, advantages are normalised per
    /// rollout, each rollout's loss is one token-weighted mean and --global-batch-size counts
    /// rollouts
    #[arg(long)]
    pub generate_multi_samples: bool,
    /// check_reward_nonzero_std | check_no_aborted (Miles' filter_hub names; a dotted path's
    /// last part)
    #[arg(long, value_name = "NAME")]
    pub dynamic_sampling_filter_path: Option<String>,
    /// Regenerate samples older than N weight versions
    #[arg(long, value_name = "N")]
    pub max_weight_staleness: Option<u64>,
    /// Push weights to the engines every N steps
    #[arg(long, value_name = "N", default_value_t = LoopConfig::default().update_weights_interval)]
    pub update_weights_interval: u64,
    /// Roll out on this SGLang-compatible server (repeatable; a router spreads the load;
    /// weight updates go through --output-dir/weights, which the servers must see)
    #[arg(long, value_name = "URL")]
    pub engine_url: Vec<String>,
    /// Seconds between health checks of the --engine-url servers out of rotation (one that
    /// answers again is brought to the current weights and re-admitted)
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub rollout_health_check_interval: f64,
    /// Seconds generation and weight updates wait for an --engine-url server back in rotation
    /// when none is, before failing (0: fail at once)
    #[arg(long, value_name = "S", default_value_t = 60.0, value_parser = seconds_or_zero)]
    pub engine_wait_s: f64,
    /// Embedded engine: sequences decoded together
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_running_requests)]
    pub max_running_requests: usize,
    /// Embedded engine: the share of the memory available once the weights are loaded that
    /// its KV pool may take, on the CPU (SGLang's --mem-fraction-static, as Miles passes it;
    /// default 0.3)
    #[arg(long, value_name = "F")]
    pub sglang_mem_fraction_static: Option<f64>,
    /// Embedded engine: most tokens its KV pool holds (SGLang's --max-total-tokens, as Miles
    /// passes it), still bounded by --sglang-mem-fraction-static. Default for train /
    /// train-async without either flag: what the rollout can fill (its sequences running at
    /// once, at most --max-running-requests, × the longest prompt in tokens +
    /// --rollout-max-response-len); otherwise 65536
    #[arg(long, value_name = "TOKENS")]
    pub sglang_max_total_tokens: Option<usize>,
    /// Embedded engine, train: release its memory (--offload-rollout-level) while the trainer
    /// trains and take it back at the weight push (Miles' --offload-rollout; the default for
    /// train, as Miles' --colocate sets it; train-async generates while it trains: never)
    #[arg(long, overrides_with = "no_offload_rollout")]
    pub offload_rollout: bool,
    /// Keep the engine's weights and KV cache while the trainer trains
    #[arg(long, overrides_with = "offload_rollout")]
    pub no_offload_rollout: bool,
    /// What --offload-rollout releases: kv_cache, weight (Miles' names; default both)
    #[arg(long, value_name = "LEVEL", num_args = 1.., value_parser = ["kv_cache", "weight"])]
    pub offload_rollout_level: Vec<String>,
}

impl RolloutArgs {
    /// `--sglang-mem-fraction-static`, else the engine's default share.
    pub fn kv_memory_fraction(&self) -> f64 {
        self.sglang_mem_fraction_static
            .unwrap_or(DEFAULT_KV_MEMORY_FRACTION)
    }

    /// What the engine releases while the trainer trains (empty: nothing): Miles'
    /// `--offload-rollout-level` (default `kv_cache weight`) for the synchronous loop unless
    /// `--no-offload-rollout`; nothing for the fully async one, where an explicit
    /// `--offload-rollout` is an error (it generates while it trains).
    pub fn offload_rollout_tags(
        &self,
        asynchronous: bool,
    ) -> Result<Vec<miles_core::MemoryTag>, String> {
        if asynchronous {
            return if self.offload_rollout {
                Err(
                    "--offload-rollout needs the synchronous loop (train): train-async keeps \
                     generating while it trains, so its engine cannot release its memory"
                        .into(),
                )
            } else {
                Ok(Vec::new())
            };
        }
        if self.no_offload_rollout {
            return Ok(Vec::new());
        }
        let level: &[String] = &self.offload_rollout_level;
        let mut tags = Vec::new();
        for (name, tag) in [
            ("kv_cache", miles_core::MemoryTag::KvCache),
            ("weight", miles_core::MemoryTag::Weights),
        ] {
            if level.is_empty() || level.iter().any(|l| l == name) {
                tags.push(tag);
            }
        }
        Ok(tags)
    }
}

/// Training.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Training")]
pub struct TrainingArgs {
    /// Samples per optimizer step (default: the whole rollout)
    #[arg(long, value_name = "N")]
    pub global_batch_size: Option<usize>,
    /// Samples per micro-batch
    #[arg(long, value_name = "N", default_value_t = train_defaults().micro_batch_size)]
    pub micro_batch_size: usize,
    /// Optimizer steps per rollout (instead of --global-batch-size)
    #[arg(long, value_name = "N")]
    pub num_steps_per_rollout: Option<usize>,
    /// Peak learning rate (AdamW)
    #[arg(long, value_name = "LR", default_value_t = schedule_defaults().lr)]
    pub lr: f64,
    /// Final learning rate of a decaying schedule
    #[arg(long, value_name = "LR", default_value_t = schedule_defaults().min_lr)]
    pub min_lr: f64,
    /// Optimizer steps of linear warm-up
    #[arg(long, value_name = "N", default_value_t = schedule_defaults().lr_warmup_iters)]
    pub lr_warmup_iters: u64,
    /// constant | linear | cosine
    #[arg(long, value_name = "NAME", default_value_t = serde_name(&schedule_defaults().lr_decay_style))]
    pub lr_decay_style: String,
    /// Optimizer steps of the decay
    #[arg(long, value_name = "N")]
    pub lr_decay_iters: Option<u64>,
    /// The optimizer: adam (AdamW, decoupled weight decay; Megatron's and FSDP's name) is the
    /// one here
    #[arg(long, value_name = "NAME", default_value = "adam")]
    pub optimizer: String,
    /// AdamW beta1
    #[arg(long, value_name = "X", default_value_t = train_defaults().optimizer.adam_beta1)]
    pub adam_beta1: f64,
    /// AdamW beta2
    #[arg(long, value_name = "X", default_value_t = train_defaults().optimizer.adam_beta2)]
    pub adam_beta2: f64,
    /// AdamW epsilon
    #[arg(long, value_name = "X", default_value_t = train_defaults().optimizer.adam_eps)]
    pub adam_eps: f64,
    /// Micro-batches by a token budget (--max-tokens-per-gpu) instead of a sample count
    #[arg(long)]
    pub use_dynamic_batch_size: bool,
    /// The token budget of a micro-batch with --use-dynamic-batch-size
    #[arg(long, value_name = "N")]
    pub max_tokens_per_gpu: Option<usize>,
    /// Global gradient-norm clip (0: off)
    #[arg(long, value_name = "X", default_value_t = train_defaults().clip_grad)]
    pub clip_grad: f64,
    /// AdamW weight decay
    #[arg(long, value_name = "X", default_value_t = train_defaults().optimizer.weight_decay)]
    pub weight_decay: f64,
    /// grpo | gspo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo
    #[arg(long, value_name = "NAME",
          default_value_t = serde_name(&policy_defaults().advantage_estimator))]
    pub advantage_estimator: String,
    /// PPO clip (low side)
    #[arg(long, value_name = "X", default_value_t = policy_defaults().eps_clip)]
    pub eps_clip: f32,
    /// PPO clip (high side; default: --eps-clip)
    #[arg(long, value_name = "X")]
    pub eps_clip_high: Option<f32>,
    /// KL loss to the reference model
    #[arg(long)]
    pub use_kl_loss: bool,
    /// KL penalty in the reward (advantages), as Miles' --kl-coef
    #[arg(long, value_name = "X", default_value_t = AdvantageConfig::default().kl_coef)]
    pub kl_coef: f64,
    /// KL loss weight
    #[arg(long, value_name = "X", default_value_t = policy_defaults().kl_loss_coef)]
    pub kl_loss_coef: f32,
    /// k1 | k2 | k3 | low_var_kl
    #[arg(long, value_name = "NAME", default_value_t = serde_name(&policy_defaults().kl_loss_type))]
    pub kl_loss_type: String,
    /// Entropy bonus weight
    #[arg(long, value_name = "X", default_value_t = policy_defaults().entropy_coef)]
    pub entropy_coef: f32,
    /// Truncated importance sampling on the rollout / trainer mismatch
    #[arg(long)]
    pub use_tis: bool,
    /// TIS upper clip
    #[arg(long, value_name = "X", default_value_t = policy_defaults().tis_clip)]
    pub tis_clip: f32,
    /// The PPO ratio's old log-probs are the rollout's (the trainer runs no old-log-prob
    /// forward unless --get-mismatch-metrics asks for it)
    #[arg(long)]
    pub use_rollout_logprobs: bool,
    /// Log the rollout / trainer log-prob mismatch (train_rollout_logprob_abs_diff, …) even
    /// when the trainer's old log-probs would not need their own forward
    #[arg(long)]
    pub get_mismatch_metrics: bool,
    /// Accepted for Miles' scripts and changes nothing: the actor skips its old-log-prob
    /// forward by itself whenever that forward would only recompute the training forward's
    /// log-probs (one optimizer step per rollout, no --use-tis / --get-mismatch-metrics /
    /// --kl-coef)
    #[arg(long)]
    pub skip_actor_forward_only: bool,
    /// Record routed experts at rollout and replay them in training (R3; MoE models)
    #[arg(long)]
    pub use_rollout_routing_replay: bool,
    /// padded | packed | per_sample | shared_prefix micro-batches (equal up to float
    /// rounding). shared_prefix: one row per prompt, [prompt, response 1, response 2, ...],
    /// so a group's prompt is computed once (GRPO); not with Gated DeltaNet models
    /// (Qwen3.5) or --use-rollout-routing-replay
    #[arg(long, value_name = "NAME", default_value_t = serde_name(&train_defaults().layout))]
    pub batch_layout: String,
    /// Activation recomputation (Megatron's): full (whole decoder layers re-run in the
    /// backward pass from their kept input; with --recompute-method and
    /// --recompute-num-layers) or selective (the attention core: its probabilities are
    /// recomputed, not kept). Default: every activation kept
    #[arg(long, value_name = "NAME")]
    pub recompute_granularity: Option<String>,
    /// With --recompute-granularity full: uniform (the layers in groups of
    /// --recompute-num-layers, each group re-run from its input) or block (the first
    /// --recompute-num-layers layers re-run one by one, the others' activations kept)
    #[arg(long, value_name = "NAME")]
    pub recompute_method: Option<String>,
    /// Layers per recomputed group (uniform) or layers recomputed (block)
    #[arg(long, value_name = "N")]
    pub recompute_num_layers: Option<usize>,
}

/// LoRA.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "LoRA")]
pub struct LoraArgs {
    /// LoRA rank (0: full fine-tuning)
    #[arg(long, value_name = "N", default_value_t = train_defaults().lora_rank)]
    pub lora_rank: usize,
    /// LoRA alpha
    #[arg(long, value_name = "X", default_value_t = train_defaults().lora_alpha)]
    pub lora_alpha: f64,
    /// Comma-separated module names, or all-linear
    #[arg(long, value_name = "LIST")]
    pub target_modules: Option<String>,
}

/// Evaluation.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Evaluation")]
pub struct EvalArgs {
    /// Evaluation sets as name / file pairs (one bare path is named aime, as in Miles)
    #[arg(long, value_names = ["NAME", "PATH"], num_args = 1..)]
    pub eval_prompt_data: Vec<String>,
    /// Evaluation datasets in Miles' YAML / JSON schema (`eval.defaults`, `eval.datasets`:
    /// each with its own samples per prompt, sampling, lengths, rm_type, keys and metadata
    /// overrides), a file or an inline base64:PAYLOAD; overrides --eval-prompt-data
    #[arg(long, value_name = "FILE")]
    pub eval_config: Option<String>,
    /// Evaluate every N rollouts (and before training)
    #[arg(long, value_name = "N")]
    pub eval_interval: Option<u64>,
    /// Samples per evaluation prompt
    #[arg(long, value_name = "N", default_value_t = rollout_defaults().n_samples_per_prompt)]
    pub n_samples_per_eval_prompt: usize,
    /// Do not evaluate before the first rollout
    #[arg(long)]
    pub skip_eval_before_train: bool,
    /// Evaluation temperature (default: the rollout's)
    #[arg(long, value_name = "T")]
    pub eval_temperature: Option<f32>,
    /// Evaluation nucleus sampling (default: the rollout's)
    #[arg(long, value_name = "P")]
    pub eval_top_p: Option<f32>,
    /// Evaluation top-k (default: the rollout's)
    #[arg(long, value_name = "K", allow_negative_numbers = true)]
    pub eval_top_k: Option<i32>,
    /// The evaluation sets' prompt key (default: --input-key)
    #[arg(long, value_name = "KEY")]
    pub eval_input_key: Option<String>,
    /// The evaluation sets' label key (default: --label-key)
    #[arg(long, value_name = "KEY")]
    pub eval_label_key: Option<String>,
    /// The evaluation sets' tool key (default: --tool-key)
    #[arg(long, value_name = "KEY")]
    pub eval_tool_key: Option<String>,
    /// Evaluation response limit (default: the rollout's)
    #[arg(long, value_name = "N")]
    pub eval_max_response_len: Option<usize>,
    /// Leave out evaluation prompts longer than N tokens (chat template applied)
    #[arg(long, value_name = "N")]
    pub eval_max_prompt_len: Option<usize>,
    /// Tokens every evaluation response has before a stop may end it (a dataset's
    /// min_new_tokens wins)
    #[arg(long, value_name = "N")]
    pub eval_min_new_tokens: Option<usize>,
    /// Evaluation prompt + response token limit (default: --rollout-max-context-len)
    #[arg(long, value_name = "N")]
    pub eval_max_context_len: Option<usize>,
    /// Key of dict rewards in evaluation (default: --reward-key)
    #[arg(long, value_name = "KEY")]
    pub eval_reward_key: Option<String>,
}

/// Reward.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Reward")]
pub struct RewardArgs {
    /// Miles' rm_hub rule: math | dapo | deepscaler | gemma_math | f1 | gpqa | random |
    /// deterministic_random | remote_rm, each also as boxed_NAME; or exact_match |
    /// numeric_match. A sample's metadata rm_type overrides it
    #[arg(long, value_name = "NAME")]
    pub rm_type: Option<String>,
    /// Reward-model server for remote_rm (http:// or https://: the system's trust store,
    /// SSL_CERT_FILE / SSL_CERT_DIR honoured)
    #[arg(long, value_name = "URL")]
    pub rm_url: Option<String>,
    /// Per-call limit on the reward-model server; past it the call is retried (3 times, with
    /// backoff), then the sample fails (kind reward)
    #[arg(long, value_name = "S", default_value_t = 60.0, value_parser = positive_seconds)]
    pub rm_timeout_s: f64,
    /// Which entry of a dict reward to train on
    #[arg(long, value_name = "KEY")]
    pub reward_key: Option<String>,
}

/// On-policy distillation (Miles' `add_on_policy_distillation_arguments`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "On-policy distillation")]
pub struct OpdArgs {
    /// Enable on-policy distillation (OPD). Must specify --opd-type when enabled.
    #[arg(long)]
    pub use_opd: bool,
    /// Type of on-policy distillation. 'sglang': Teacher log-probs are obtained from external
    /// SGLang server during rollout. 'megatron': Teacher model is loaded via --opd-teacher-load
    /// and forwarded during training (here: an HF checkpoint scored by the trainer)
    #[arg(long, value_name = "TYPE", value_parser = ["sglang", "megatron"])]
    pub opd_type: Option<String>,
    /// On-policy distillation KL penalty coefficient. Default is 1.0.
    #[arg(
        long,
        value_name = "C",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub opd_kl_coef: f64,
    /// Number of top-k tokens to use for the re-think OPD token-level reward. Set to 0 to use
    /// sampled-token OPD.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub opd_log_prob_top_k: usize,
    /// Token set strategy for top-k OPD.
    #[arg(long, value_name = "S", default_value = "only-student",
          value_parser = ["only-student", "only-teacher", "intersection", "union", "xor"])]
    pub opd_top_k_strategy: String,
    /// Weighting scheme for top-k OPD token rewards.
    #[arg(long, value_name = "M", default_value = "student_p",
          value_parser = ["student_p", "teacher_p", "none"])]
    pub opd_reward_weight_mode: String,
    /// Multi-teacher routing map for --opd-type=sglang, e.g. --opd-teacher-urls
    /// math=http://h1:30001/generate code=http://h2:30002/generate. Each sample is routed to
    /// the teacher named by sample.metadata[--opd-teacher-key]; the reserved name 'default' is
    /// the fallback for samples with a missing or unknown name. When unset, all samples are
    /// scored by the single teacher at --rm-url (original behavior).
    #[arg(long, value_name = "NAME=URL", num_args = 1..)]
    pub opd_teacher_urls: Vec<String>,
    /// Sample metadata key holding the teacher name used for --opd-teacher-urls routing.
    /// Populated from the dataset's metadata column (see --metadata-key).
    #[arg(long, value_name = "KEY", default_value = "opd_teacher")]
    pub opd_teacher_key: String,
    /// The checkpoint for OPD teacher model. Required when --opd-type=megatron. The teacher
    /// model should have the same architecture as policy/ref model (here: an HF checkpoint
    /// directory or hub id with the policy's vocabulary, or an earlier run's --save folder:
    /// its newest valid checkpoint, or --opd-teacher-ckpt-step).
    #[arg(long, value_name = "DIR")]
    pub opd_teacher_load: Option<String>,
    /// The checkpoint step for OPD teacher model (here: iter_NNNNNNN of the --save folder that
    /// --opd-teacher-load names).
    #[arg(long, value_name = "N")]
    pub opd_teacher_ckpt_step: Option<u64>,
    /// Send per-position token ids to the teacher / student scoring server
    /// (token_ids_logprob_positions) instead of the global top-k union: the answer is
    /// O(response_len * k) instead of O(response_len * |union|). `miles serve` understands it;
    /// an unpatched SGLang server does not (leave it off there).
    #[arg(long)]
    pub opd_topk_per_position: bool,
}

/// Agents.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Agents")]
pub struct AgentArgs {
    /// An agent in any language, run with sh -c once per sample against an in-process session
    /// server (OPENAI_BASE_URL, OPENAI_API_KEY; the sample as JSON on stdin; optional
    /// {"reward": …, "metadata": …} as the last stdout line)
    #[arg(long, value_name = "CMD")]
    pub agent_cmd: Option<String>,
    /// An agent's wall-clock limit (0: none); past it the sample is FAILED (kind `timeout`)
    #[arg(long, value_name = "S", default_value_t = 3600.0)]
    pub agent_timeout_s: f64,
    /// Implied by --agent-cmd (the session server records exact tokens, log-probs and routed
    /// experts). Bare (or v1): the append-only linear server; v2: tree sessions (a request
    /// that diverges from the recorded history branches; every kept leaf is a sample)
    #[arg(long, value_name = "VERSION", num_args = 0..=1, default_missing_value = "v1",
          value_parser = session_version_name)]
    pub use_session_server: Option<String>,
    /// The TITO family of the session server (--agent-cmd) and of sft's tokenization:
    /// default | qwen3 | glm47 | …
    #[arg(
        long,
        value_name = "FAMILY",
        default_value = "default",
        alias = "tito-model"
    )]
    pub tito: String,
    /// How the session server compares a request's history with the recorded one (rollback
    /// detection, append-only check): strict | loose_tool_call (tool-call arguments that are
    /// the same JSON written differently match) | role_content_only (high risk: reasoning and
    /// tool calls are not compared)
    #[arg(long, value_name = "NAME", default_value = "strict", value_parser = message_matcher_name)]
    pub session_message_matcher: String,
    /// A group holding a failed sample (agent, reward or engine failure) is generated again at
    /// most N times, then dropped and counted
    #[arg(long, value_name = "N", default_value_t = failure_defaults().max_group_retries)]
    pub max_group_retries: u32,
    /// Stop the run after N failed samples in a row (0: never)
    #[arg(long, value_name = "N", default_value_t = failure_defaults().max_consecutive_failures)]
    pub max_consecutive_failures: usize,
    /// Stop the run when more than this share of the last --failure-window finished samples
    /// failed (1: never)
    #[arg(long, value_name = "F", default_value_t = failure_defaults().max_failure_ratio)]
    pub max_failure_ratio: f64,
    /// The window of --max-failure-ratio, in finished samples
    #[arg(long, value_name = "N", default_value_t = failure_defaults().failure_window)]
    pub failure_window: usize,
}

fn failure_defaults() -> miles_rollout::FailurePolicy {
    miles_rollout::FailurePolicy::default()
}

/// Checks a `--session-message-matcher` name (miles-tito's parser, Miles' names).
/// Miles' `--use-session-server` values (`v1`, `v2`; the bare flag is v1).
fn session_version_name(text: &str) -> Result<String, String> {
    text.parse::<miles_session::server::SessionVersion>()
        .map(|v| v.as_str().to_owned())
        .map_err(|e| e.to_string())
}

/// The session server version a `--use-session-server` value names (v1 when absent).
pub fn session_version(value: Option<&str>) -> miles_session::server::SessionVersion {
    value
        .and_then(|v| v.parse().ok())
        .unwrap_or(miles_session::server::SessionVersion::V1)
}

fn message_matcher_name(text: &str) -> Result<String, String> {
    miles_tito::MessageMatcher::parse(text)
        .map(|_| text.to_owned())
        .map_err(|e| e.to_string())
}

/// Logging and metrics.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Logging and metrics")]
pub struct MetricsArgs {
    /// Write TensorBoard event files (step = rollout id)
    #[arg(long)]
    pub use_tensorboard: bool,
    /// TensorBoard directory (default: $TENSORBOARD_DIR, else OUTPUT/tensorboard)
    #[arg(long, value_name = "DIR", alias = "tb-project-name")]
    pub tensorboard_dir: Option<String>,
    /// Not built in: use --use-tensorboard and `wandb sync --sync-tensorboard DIR`
    #[arg(long)]
    pub use_wandb: bool,
    /// Serve Prometheus /metrics of the trainer on 127.0.0.1:PORT (0: any free port)
    #[arg(long, value_name = "PORT")]
    pub metrics_port: Option<u16>,
    /// Serve /metrics on --prometheus-port (Miles' spelling of --metrics-port)
    #[arg(long)]
    pub use_prometheus: bool,
    /// The port of --use-prometheus
    #[arg(long, value_name = "PORT", default_value_t = 9090)]
    pub prometheus_port: u16,
    /// Log pass@k (k = 1, 2, 4, … up to the group size; unbiased estimator, a sample passes
    /// with reward exactly 1): `passrate/pass@k` per rollout, `eval/NAME-pass@k` per
    /// evaluation set
    #[arg(long)]
    pub log_passrate: bool,
}

/// `miles serve`: the embedded engine behind SGLang's HTTP protocol.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// HF checkpoint directory (config.json + *.safetensors), or a hub id in the local cache
    #[arg(long, value_name = "DIR", alias = "model-path")]
    pub model: String,
    /// Tokenizer directory for text prompts and chat (default: --model)
    #[arg(long, value_name = "DIR", alias = "tokenizer-path")]
    pub tokenizer: Option<PathBuf>,
    /// Chat family of miles-tito (default: from config.json model_type)
    #[arg(long, value_name = "FAMILY", alias = "tito-model")]
    pub tito: Option<String>,
    /// Address to bind
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0: any free port)
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Model name in OpenAI answers (default: the model path)
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Sequences decoded together
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_running_requests)]
    pub max_running_requests: usize,
    /// KV-cache budget in tokens
    #[arg(long, value_name = "TOKENS", default_value_t = EngineConfig::default().kv_token_budget)]
    pub kv_token_budget: usize,
    /// The share of the memory available once the weights are loaded that the KV pool may
    /// take, on the CPU (SGLang's --mem-fraction-static; the smaller of this and
    /// --kv-token-budget sizes the pool)
    #[arg(long, value_name = "F", default_value_t = DEFAULT_KV_MEMORY_FRACTION)]
    pub mem_fraction_static: f64,
    /// Seed for requests without sampling_seed
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().seed)]
    pub seed: u64,
    /// Return decode-time log-probs (no prefill recompute)
    #[arg(long)]
    pub no_recompute_logprobs: bool,
    /// Largest n (samples per prompt) a request may ask for (default 64)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_n: Option<u64>,
    /// Largest request body in bytes (default 67108864; larger → 413)
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_request_bytes: Option<u64>,
    /// The only directory update_weights_from_disk may read from (without it that route is
    /// disabled: 403)
    #[arg(long, value_name = "DIR")]
    pub weights_root: Option<PathBuf>,
    /// Every route but /health needs `Authorization: Bearer KEY` (default: $MILES_API_KEY;
    /// unset = no authentication)
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Connections served at once (default 1024)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: Option<u64>,
    /// Requests in progress at once, /health excluded (default 4096; 503)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_concurrent_requests: Option<u64>,
    /// Time to send a request head in seconds (default 10)
    #[arg(long, value_name = "S", value_parser = positive_seconds)]
    pub header_read_timeout_s: Option<f64>,
    /// Time a request may run in seconds (default: none; 504 after it)
    #[arg(long, value_name = "S", value_parser = positive_seconds)]
    pub request_timeout_s: Option<f64>,
    /// Serve Prometheus metrics at GET /metrics (SGLang's names)
    #[arg(long)]
    pub enable_metrics: bool,
    /// The engine's device: flex | cpu | wgpu[:N] | wgpu-cpu | cuda[:N]
    #[arg(long, value_name = "DEV", default_value = "flex")]
    pub device: String,
    /// Hold the weights and the KV cache and compute in bfloat16 (Miles' --bf16)
    #[arg(long, conflicts_with = "fp16")]
    pub bf16: bool,
    /// The same in float16 (Miles' --fp16)
    #[arg(long)]
    pub fp16: bool,
    /// Seconds in-flight requests get to finish after SIGINT / SIGTERM
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub shutdown_timeout_s: f64,
}

/// `miles router`: one SGLang-compatible address over several engines.
#[derive(Debug, Clone, Args)]
pub struct RouterArgs {
    /// An SGLang-compatible server's base URL (repeatable; `miles serve` or SGLang)
    #[arg(long, value_name = "URL", required = true, num_args = 1.., alias = "worker-urls")]
    pub engine_url: Vec<String>,
    /// HF checkpoint directory (or a hub id in the local cache) whose config and tokenizer
    /// the router reads, for text prompts, chat and /get_model_info (default: token ids only)
    #[arg(long, value_name = "DIR", alias = "model-path")]
    pub model: Option<String>,
    /// Tokenizer directory (default: --model)
    #[arg(long, value_name = "DIR", alias = "tokenizer-path")]
    pub tokenizer: Option<PathBuf>,
    /// Chat family of miles-tito (default: from config.json model_type)
    #[arg(long, value_name = "FAMILY", alias = "tito-model")]
    pub tito: Option<String>,
    /// Model name in OpenAI answers (default: the model path)
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Address to bind
    #[arg(long, default_value = "127.0.0.1", alias = "sglang-router-ip")]
    pub host: String,
    /// Port to bind (0: any free port)
    #[arg(long, default_value_t = 30000, alias = "sglang-router-port")]
    pub port: u16,
    /// Every route but /health needs `Authorization: Bearer KEY` (default: $MILES_API_KEY)
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// The engines' --api-key, sent with every call to them
    #[arg(long, value_name = "KEY")]
    pub engine_api_key: Option<String>,
    /// MoE layers of the model (needed to pass routed experts through)
    #[arg(long, value_name = "N")]
    pub num_layers: Option<usize>,
    /// The only directory /update_weights_from_disk may name (without it that route is
    /// disabled: 403); the engines must see the same path
    #[arg(long, value_name = "DIR")]
    pub weights_root: Option<PathBuf>,
    /// Seconds between health checks of the engines out of rotation
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub rollout_health_check_interval: f64,
    /// Seconds a /generate call to an engine may take
    #[arg(long, value_name = "S", default_value_t = 600.0, value_parser = positive_seconds)]
    pub miles_router_timeout: f64,
    /// Seconds in-flight requests get to finish after SIGINT / SIGTERM
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub shutdown_timeout_s: f64,
}

/// `miles session`: the session server.
#[derive(Debug, Clone, Args)]
pub struct SessionArgs {
    /// SGLang-compatible engine base URL; `toy` (in-process toy engine) or `instant`
    /// (pre-tokenized replies, for load tests)
    #[arg(long, value_name = "URL")]
    pub engine_url: String,
    /// Model directory (tokenizer + chat template); not needed with --tito byte_chatml
    #[arg(long, value_name = "DIR")]
    pub model: Option<String>,
    /// TITO family (qwen3, glm47, …, or byte_chatml)
    #[arg(long, value_name = "FAMILY", alias = "tito-model")]
    pub tito: String,
    /// Address to bind
    #[arg(long, default_value = "127.0.0.1", alias = "session-server-ip")]
    pub host: String,
    /// Port to bind (0: any free port)
    #[arg(long, default_value_t = 30010, alias = "session-server-port")]
    pub port: u16,
    /// Largest request body in bytes
    #[arg(long, value_name = "N", alias = "max-body-bytes",
          default_value_t = SessionServerConfig::default().max_body_bytes,
          value_parser = at_least_one)]
    pub max_request_bytes: usize,
    /// Ask the engine for routed experts
    #[arg(long)]
    pub routed_experts: bool,
    /// MoE layers (needed with --routed-experts over SGLang)
    #[arg(long, value_name = "N")]
    pub num_layers: Option<usize>,
    /// Context limit
    #[arg(long, value_name = "N")]
    pub max_context_len: Option<usize>,
    /// Default max_tokens
    #[arg(long, value_name = "N")]
    pub default_max_tokens: Option<usize>,
    /// Engine timeout in seconds
    #[arg(long, value_name = "S", value_parser = positive_seconds,
          default_value_t = SessionServerConfig::default().engine_timeout.as_secs_f64())]
    pub engine_timeout_s: f64,
    /// Instance id reported by /health
    #[arg(long, value_name = "ID")]
    pub instance_id: Option<String>,
    /// Tokio worker threads (default: one per core)
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub worker_threads: Option<usize>,
    /// Every route but /health needs `Authorization: Bearer KEY` (default: $MILES_API_KEY)
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Largest n
    #[arg(long, value_name = "N", value_parser = at_least_one,
          default_value_t = SessionServerConfig::default().limits.max_n)]
    pub max_n: usize,
    /// Most open sessions (0: no limit)
    #[arg(long, value_name = "N",
          default_value_t = SessionServerConfig::default().max_sessions.unwrap_or(0))]
    pub max_sessions: usize,
    /// Session idle timeout in seconds (0: none)
    #[arg(long, value_name = "S", alias = "session-idle-timeout-s", value_parser = seconds_or_zero,
          default_value_t = secs(SessionServerConfig::default().session_idle_timeout))]
    pub session_idle_timeout: f64,
    /// Most records per session (0: no limit)
    #[arg(long, value_name = "N",
          default_value_t = SessionServerConfig::default().max_records_per_session.unwrap_or(0))]
    pub max_records_per_session: usize,
    /// Most trajectory tokens per session (0: no limit)
    #[arg(long, value_name = "N",
          default_value_t = SessionServerConfig::default().max_tokens_per_session.unwrap_or(0))]
    pub max_tokens_per_session: usize,
    /// Time a request may run in seconds (0: none)
    #[arg(long, value_name = "S", value_parser = seconds_or_zero,
          default_value_t = secs(SessionServerConfig::default().guard.request_timeout))]
    pub request_timeout_s: f64,
    /// Time to receive a request head in seconds (0: none)
    #[arg(long, value_name = "S", value_parser = seconds_or_zero,
          default_value_t = secs(SessionServerConfig::default().guard.header_read_timeout))]
    pub header_read_timeout_s: f64,
    /// Most connections at once (0: no limit)
    #[arg(long, value_name = "N",
          default_value_t = SessionServerConfig::default().guard.max_connections.unwrap_or(0))]
    pub max_connections: usize,
    /// Most requests in progress at once (0: no limit)
    #[arg(long, value_name = "N",
          default_value_t = SessionServerConfig::default().guard.max_concurrent_requests.unwrap_or(0))]
    pub max_concurrent_requests: usize,
    /// How a request's history is compared with the recorded one: strict |
    /// loose_tool_call | role_content_only (Miles' --session-message-matcher)
    #[arg(long, value_name = "NAME", default_value = "strict", value_parser = message_matcher_name)]
    pub session_message_matcher: String,
    /// Which session server: v1 (the default, also the bare flag: append-only, one-step
    /// rollback) or v2 (tree sessions: a request that diverges from the recorded history
    /// branches; the samples route gives one sample per kept leaf, Miles' v2 wire)
    #[arg(long, value_name = "VERSION", num_args = 0..=1, default_missing_value = "v1",
          value_parser = session_version_name)]
    pub use_session_server: Option<String>,
    /// Put each session's conversation on its last sample as metadata.messages (Miles'
    /// --save-debug-trajectory-data; the session server alone writes no file: the PATH is
    /// for `miles train`)
    #[arg(long, value_name = "PATH")]
    pub save_debug_trajectory_data: Option<String>,
    /// Seconds in-flight requests get to finish after SIGINT / SIGTERM
    #[arg(long, value_name = "S", default_value_t = 30.0, value_parser = positive_seconds)]
    pub shutdown_timeout_s: f64,
}

fn secs(d: Option<std::time::Duration>) -> f64 {
    d.map_or(0.0, |d| d.as_secs_f64())
}

fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(s),
        _ => Err(format!(
            "expected a positive number of seconds, got {text:?}"
        )),
    }
}

fn seconds_or_zero(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if (0.0..1e9).contains(&s) => Ok(s),
        _ => Err(format!("expected seconds (0: none), got {text:?}")),
    }
}

fn at_least_one(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "expected a whole number of at least 1, got {text:?}"
        )),
    }
}

/// `miles bridge …`.
#[derive(Debug, Clone, Subcommand)]
pub enum BridgeCommand {
    /// Print a checkpoint's architecture, parameter count and tensors
    Inspect {
        /// The HF checkpoint directory.
        dir: PathBuf,
    },
    /// Score token sequences: per-token log-probs of a JSON file of id lists
    Logprobs {
        /// HF checkpoint directory
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// JSON file: a list of token-id lists
        #[arg(long, value_name = "FILE")]
        input: PathBuf,
        /// Write the log-probs here (default: stdout)
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// flex | wgpu[:N] | wgpu-cpu | cuda[:N]
        #[arg(long, value_name = "DEV", default_value = "flex")]
        device: String,
    },
    /// Rewrite a checkpoint (dtype cast, tensor / expert parallel shards)
    Convert {
        /// HF checkpoint directory
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Output directory
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// f32 | bf16 | f16 (default: as stored)
        #[arg(long, value_name = "DTYPE")]
        dtype: Option<String>,
        /// Tensor-parallel shards
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
        tp: usize,
        /// Expert-parallel shards
        #[arg(long, value_name = "N", default_value_t = 1, value_parser = at_least_one)]
        ep: usize,
    },
}

/// The model and template options the `tito` subcommands share.
#[derive(Debug, Clone, Args)]
pub struct TitoModel {
    /// Model directory (tokenizer + chat template)
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// A chat template file that replaces the model's
    #[arg(long, value_name = "FILE")]
    pub template: Option<PathBuf>,
    /// Chat-template kwargs as a JSON object
    #[arg(long, value_name = "JSON")]
    pub kwargs: Option<String>,
}

/// `miles tito …`.
#[derive(Debug, Clone, Subcommand)]
pub enum TitoCommand {
    /// Render a conversation with a chat template (text and ids as JSON)
    Render {
        /// Model and template.
        #[command(flatten)]
        model: TitoModel,
        /// The TITO family (its fixed template, kwargs and message normalisation)
        #[arg(long, value_name = "FAMILY", alias = "tito-model")]
        tito: Option<String>,
        /// JSON file: the messages
        #[arg(long, value_name = "FILE")]
        messages: PathBuf,
        /// JSON file: the tools
        #[arg(long, value_name = "FILE")]
        tools: Option<PathBuf>,
        /// Append the assistant generation prompt
        #[arg(long)]
        add_generation_prompt: bool,
    },
    /// Replay a conversation turn by turn with TITO (ids, loss mask, turns as JSON)
    Incremental {
        /// Model and template.
        #[command(flatten)]
        model: TitoModel,
        /// The TITO family
        #[arg(long, value_name = "FAMILY", alias = "tito-model")]
        tito: String,
        /// JSON file: the messages
        #[arg(long, value_name = "FILE")]
        messages: PathBuf,
        /// JSON file: the tools
        #[arg(long, value_name = "FILE")]
        tools: Option<PathBuf>,
    },
    /// Verify a chat template against Miles' trajectories (exit 1 when a case fails)
    Verify {
        /// Model and template.
        #[command(flatten)]
        model: TitoModel,
        /// Verify TITO tokenization of this family (default: the raw template)
        #[arg(long, value_name = "FAMILY", alias = "tito-model")]
        tito: Option<String>,
        /// on | off | both
        #[arg(long, value_name = "MODE", default_value = "on")]
        thinking: String,
        /// A trajectories JSON file (default: Miles' built-in cases)
        #[arg(long, value_name = "FILE")]
        trajectories: Option<PathBuf>,
    },
    /// Is a model directory TITO-safe? Tokenizer checks plus the verifier in raw and TITO mode
    Check {
        /// Model and template.
        #[command(flatten)]
        model: TitoModel,
        /// The TITO family (default: detected from config.json and the special tokens)
        #[arg(long, value_name = "FAMILY", alias = "tito-model")]
        tito: Option<String>,
        /// on | off | both
        #[arg(long, value_name = "MODE", default_value = "on")]
        thinking: String,
        /// A trajectories JSON file (default: Miles' built-in cases)
        #[arg(long, value_name = "FILE")]
        trajectories: Option<PathBuf>,
    },
}
