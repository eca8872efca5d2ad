//! The trainer's configuration: Miles / Megatron flag names and defaults.

use std::path::PathBuf;

use miles_bridge::lora::{ALL_LINEAR, LoraConfig, LoraForward};
use miles_bridge::{Precision, RecomputeConfig};
use miles_ops::PolicyLossConfig;
use miles_ops::fused::FusedLogProbConfig;
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use serde::{Deserialize, Serialize};

use crate::batch::{BatchLayout, TrainItem, plan_micro_batches, plan_steps};
use crate::opd::OpdConfig;
use crate::{Error, LrSchedule, Result};

/// AdamW hyper-parameters (Megatron's `--weight-decay`, `--adam-beta1`, `--adam-beta2`,
/// `--adam-eps`, with Megatron's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// `--weight-decay` (0.01), decoupled: `p ← p·(1 − lr·wd)` before the Adam update.
    pub weight_decay: f64,
    /// `--adam-beta1` (0.9).
    pub adam_beta1: f64,
    /// `--adam-beta2` (0.999).
    pub adam_beta2: f64,
    /// `--adam-eps` (1e-8).
    pub adam_eps: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            weight_decay: 0.01,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
        }
    }
}

/// `--loss-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    /// The RL policy loss (PPO / GRPO / GSPO clip, corrections, KL, entropy).
    #[default]
    PolicyLoss,
    /// Supervised fine-tuning: `−reduce(logp)` over the loss mask (warm starts).
    SftLoss,
}

/// Everything the actor needs, with Miles' defaults. Deserialises from JSON with the same
/// field names as Miles' flags (underscores instead of dashes); nested sections group the
/// learning-rate schedule, AdamW, the policy loss and the advantage estimator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// `--lr`, `--min-lr`, `--lr-warmup-iters`, `--lr-decay-iters`, `--lr-decay-style`, …
    pub lr_schedule: LrSchedule,
    /// AdamW.
    pub optimizer: AdamWConfig,
    /// `--clip-grad` (1.0): global gradient-norm clipping; 0 disables it.
    pub clip_grad: f64,
    /// `--global-batch-size`: samples per optimizer step (`None`: the whole rollout, or
    /// `rollout size / num_steps_per_rollout`).
    pub global_batch_size: Option<usize>,
    /// `--num-steps-per-rollout`: optimizer steps per `train` call (used when
    /// `global_batch_size` is not set).
    pub num_steps_per_rollout: Option<usize>,
    /// `--micro-batch-size` (1): samples per micro-batch without dynamic batching.
    pub micro_batch_size: usize,
    /// `--use-dynamic-batch-size` (false): fill micro-batches up to `max_tokens_per_gpu`.
    pub use_dynamic_batch_size: bool,
    /// `--max-tokens-per-gpu`: token budget of a micro-batch with dynamic batching.
    pub max_tokens_per_gpu: Option<usize>,
    /// How a micro-batch is laid out for the forward pass.
    pub layout: BatchLayout,
    /// `--loss-type` (`policy_loss`).
    pub loss_type: LossType,
    /// Policy-loss flags (`--eps-clip`, `--use-tis`, `--use-kl-loss`, …).
    pub policy_loss: PolicyLossConfig,
    /// Advantage flags (`--advantage-estimator`, `--kl-coef`, `--gamma`, …).
    pub advantage: AdvantageConfig,
    /// Chunk sizes of the fused log-prob computation.
    pub fused: FusedLogProbConfig,
    /// `--reward-key`: which entry of a dict reward to train on.
    pub reward_key: Option<String>,
    /// `--ref-update-interval`: copy the actor into the reference model every N rollouts
    /// (`None`: the reference stays the initial model).
    pub ref_update_interval: Option<u64>,
    /// `--value-clip` (0.2): clip range of the critic's value loss (`ppo`).
    pub value_clip: f32,
    /// `--critic-lr`: the critic's learning rate (`None`: the actor's schedule).
    pub critic_lr: Option<f64>,
    /// Parameters that are not trained: exact names or name prefixes ending in `.`
    /// (e.g. `model.embed_tokens.weight`, `model.layers.0.`).
    pub freeze_params: Vec<String>,
    /// `--use-routing-replay` (R3): MoE layers route every token to the experts recorded at
    /// rollout (`Sample::rollout_routed_experts`) instead of choosing their own.
    pub use_routing_replay: bool,
    /// `--lora-rank` (0): LoRA rank; 0 disables LoRA (every weight is trained). With a rank,
    /// [`crate::Actor::new`] attaches adapters and freezes the base weights.
    pub lora_rank: usize,
    /// `--lora-alpha` (16): the adapters' output is scaled by `lora_alpha / lora_rank`.
    pub lora_alpha: f64,
    /// `--lora-dropout` (0.0): only 0 is supported.
    pub lora_dropout: f64,
    /// `--target-modules`: comma-separated module names / suffixes (HF `q_proj,v_proj` or
    /// Megatron `linear_qkv,linear_proj`) or `all-linear` (`None`: `all-linear`). On GPT-OSS,
    /// `gate_proj` / `up_proj` / `down_proj` (or `linear_fc1` / `linear_fc2`, `all-linear`)
    /// reach the fused experts `mlp.experts.gate_up_proj` / `down_proj` (PEFT's
    /// `target_parameters`).
    pub target_modules: Option<String>,
    /// `--exclude-modules`: comma-separated module names / suffixes never adapted.
    pub exclude_modules: Option<String>,
    /// `--lora-adapter-path`: start from this PEFT adapter directory instead of fresh adapters
    /// (its rank must equal `lora_rank`; its alpha and target modules come from its
    /// `adapter_config.json`).
    pub lora_adapter_path: Option<PathBuf>,
    /// How adapted layers compute their forward (not a Miles flag): `merged` (default; the
    /// exported merged weights reproduce the trainer's log-probs bit for bit) or `factored`
    /// (PEFT's `x Wᵀ + s·(x Aᵀ) Bᵀ`, cheaper backward, equal up to rounding).
    pub lora_forward: LoraForward,
    /// `--seed` (1234): seed of the `lora_A` initialisation.
    pub seed: u64,
    /// `--bf16` / `--fp16` (Megatron's mixed precision; default `fp32`): the dtype the
    /// forward computes in. Parameters and AdamW state stay `f32` (master weights); every
    /// forward runs on the weights cast to this dtype (a differentiable cast, so gradients
    /// arrive in `f32` on the masters), log-probs, losses and reductions stay `f32`, and the
    /// weights exported for the engines ([`miles_core::PolicyTrainer::export_weights`]) are
    /// written in it. Serialised as `"fp32"`, `"bf16"` or `"fp16"`.
    pub precision: Precision,
    /// On-policy distillation (`--use-opd`, `--opd-type`, `--opd-kl-coef`,
    /// `--opd-teacher-load`): the nested section `opd`.
    pub opd: OpdConfig,
    /// Activation recomputation of the actor's training forward
    /// (`--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`; off by
    /// default): checked against the model by [`crate::Actor::new`]; see
    /// [`miles_bridge::RecomputedForward`].
    pub recompute: RecomputeConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            lr_schedule: LrSchedule::default(),
            optimizer: AdamWConfig::default(),
            clip_grad: 1.0,
            global_batch_size: None,
            num_steps_per_rollout: None,
            micro_batch_size: 1,
            use_dynamic_batch_size: false,
            max_tokens_per_gpu: None,
            layout: BatchLayout::PerSample,
            loss_type: LossType::PolicyLoss,
            policy_loss: PolicyLossConfig::default(),
            advantage: AdvantageConfig::default(),
            fused: FusedLogProbConfig::default(),
            reward_key: None,
            ref_update_interval: None,
            value_clip: 0.2,
            critic_lr: None,
            freeze_params: Vec::new(),
            use_routing_replay: false,
            precision: Precision::F32,
            lora_rank: 0,
            lora_alpha: 16.0,
            lora_dropout: 0.0,
            target_modules: None,
            exclude_modules: None,
            lora_adapter_path: None,
            lora_forward: LoraForward::Merged,
            seed: 1234,
            opd: OpdConfig::default(),
            recompute: RecomputeConfig::default(),
        }
    }
}

impl TrainConfig {
    /// The micro-batches of one step's `items` (fixed size or token budget).
    pub(crate) fn micro_batches(&self, items: &[TrainItem]) -> Vec<std::ops::Range<usize>> {
        let lengths: Vec<usize> = items.iter().map(TrainItem::len).collect();
        let budget = self
            .use_dynamic_batch_size
            .then_some(self.max_tokens_per_gpu)
            .flatten();
        plan_micro_batches(&lengths, self.micro_batch_size, budget)
    }

    /// Checks every value once (the loss and estimator configs included).
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::Config {
                field,
                value,
                reason,
            })
        };
        self.lr_schedule.validate()?;
        self.opd.validate()?;
        let o = &self.optimizer;
        if !(o.weight_decay.is_finite() && o.weight_decay >= 0.0) {
            return bad("weight_decay", o.weight_decay.to_string(), "must be >= 0");
        }
        for (field, beta) in [("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(field, beta.to_string(), "must be in [0, 1)");
            }
        }
        if !(o.adam_eps.is_finite() && o.adam_eps > 0.0) {
            return bad("adam_eps", o.adam_eps.to_string(), "must be > 0");
        }
        if !(self.clip_grad.is_finite() && self.clip_grad >= 0.0) {
            return bad("clip_grad", self.clip_grad.to_string(), "must be >= 0");
        }
        if self.global_batch_size == Some(0) {
            return bad("global_batch_size", "0".into(), "must be >= 1");
        }
        if self.num_steps_per_rollout == Some(0) {
            return bad("num_steps_per_rollout", "0".into(), "must be >= 1");
        }
        if self.micro_batch_size == 0 {
            return bad("micro_batch_size", "0".into(), "must be >= 1");
        }
        if self.layout == BatchLayout::SharedPrefix && self.use_routing_replay {
            return Err(shared_prefix_with_routing_replay());
        }
        if self.use_dynamic_batch_size && self.max_tokens_per_gpu.is_none_or(|t| t == 0) {
            return bad(
                "max_tokens_per_gpu",
                format!("{:?}", self.max_tokens_per_gpu),
                "dynamic batching needs a token budget >= 1",
            );
        }
        if self.fused.token_chunk == 0 || self.fused.vocab_chunk == 0 {
            return bad(
                "fused",
                format!("{:?}", self.fused),
                "chunk sizes must be >= 1",
            );
        }
        if !(self.value_clip.is_finite() && self.value_clip >= 0.0) {
            return bad("value_clip", self.value_clip.to_string(), "must be >= 0");
        }
        if let Some(lr) = self.critic_lr
            && !(lr.is_finite() && lr >= 0.0)
        {
            return bad("critic_lr", lr.to_string(), "must be finite and >= 0");
        }
        if self.policy_loss.advantage_estimator != self.advantage.advantage_estimator {
            return bad(
                "advantage_estimator",
                format!(
                    "{} (policy_loss) vs {} (advantage)",
                    self.policy_loss.advantage_estimator, self.advantage.advantage_estimator
                ),
                "the two sections must name the same estimator",
            );
        }
        self.policy_loss.clone().init()?;
        self.advantage.clone().init()?;
        if let Some(lora) = self.lora_config() {
            lora.validate().map_err(|e| Error::Config {
                field: "lora",
                value: e.to_string(),
                reason: "invalid LoRA settings",
            })?;
        }
        Ok(())
    }

    /// The LoRA adapters these flags ask for (`None` when `lora_rank` is 0).
    pub fn lora_config(&self) -> Option<LoraConfig> {
        (self.lora_rank > 0).then(|| LoraConfig {
            r: self.lora_rank,
            lora_alpha: self.lora_alpha,
            lora_dropout: self.lora_dropout,
            target_modules: self
                .target_modules
                .as_deref()
                .map_or_else(|| vec![ALL_LINEAR.to_string()], LoraConfig::parse_list),
            exclude_modules: self
                .exclude_modules
                .as_deref()
                .map(LoraConfig::parse_list)
                .unwrap_or_default(),
            target_parameters: Vec::new(),
            use_rslora: false,
            forward: self.lora_forward,
            seed: self.seed,
        })
    }

    /// Whether `name` is frozen by `freeze_params`.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.freeze_params
            .iter()
            .any(|f| name == f || (f.ends_with('.') && name.starts_with(f.as_str())))
    }

    /// Whether the estimator needs a critic (`ppo`).
    pub fn needs_critic(&self) -> bool {
        self.advantage.advantage_estimator == AdvantageEstimator::Ppo
    }

    /// Whether reference-model log-probs are needed (KL loss or KL reward shaping).
    pub fn needs_ref(&self) -> bool {
        self.policy_loss.use_kl_loss || self.advantage.kl_coef != 0.0
    }

    /// Whether training on rollouts of `samples_per_rollout` samples compares the rollout's
    /// log-probs with a per-sample scoring of the trainer's (the function the embedded engine
    /// re-scores with), so that re-scored rollout log-probs make them equal bit for bit: with
    /// the per-sample layout, with TIS / mismatch metrics / `use_rollout_logprobs`, or
    /// whenever the actor runs its own old-log-prob forward (`kl_coef`, several optimizer
    /// steps per rollout; see [`crate::Actor`]). Otherwise (any other layout's training
    /// forward gives the old log-probs) the rollout's log-probs only feed
    /// `train_rollout_logprob_abs_diff`, which shows the layouts' float rounding either way, and
    /// an engine's per-sequence re-scoring (`recompute_logprobs_via_prefill`) buys nothing.
    pub fn needs_exact_rollout_log_probs(&self, samples_per_rollout: usize) -> bool {
        let p = &self.policy_loss;
        self.loss_type == LossType::PolicyLoss
            && (self.layout == BatchLayout::PerSample
                || p.use_tis
                || p.get_mismatch_metrics
                || p.use_rollout_logprobs
                || self.advantage.kl_coef != 0.0
                || plan_steps(
                    samples_per_rollout,
                    self.global_batch_size,
                    self.num_steps_per_rollout,
                )
                .len()
                    > 1)
    }
}

/// Why rollout routing replay and [`BatchLayout::SharedPrefix`] do not combine (refused by
/// [`TrainConfig::validate`]).
pub(crate) fn shared_prefix_with_routing_replay() -> Error {
    Error::Config {
        field: "batch_layout",
        value: "shared_prefix".into(),
        reason: "rollout routing replay (use_routing_replay) replays each sample's own routes of \
                 its prompt tokens, which a shared prompt computes once: use padded or packed",
    }
}
