//! # miles-train
//!
//! The training side of RL post-training: [`Actor`] implements [`miles_core::PolicyTrainer`]
//! on top of a miles-bridge [`CausalLm`](miles_bridge::CausalLm) and miles-ops losses. Flags
//! and defaults follow Miles / Megatron ([`TrainConfig`]), so a Miles config carries over.
//!
//! What one [`PolicyTrainer::train`](miles_core::PolicyTrainer::train) call does, as Miles'
//! actor does it:
//!
//! 1. samples → [`TrainItem`]s (validated: response length, loss mask, rollout log-probs);
//! 2. rewards normalised per group and advantages computed with the configured estimator
//!    (`grpo`, `gspo`, `reinforce_plus_plus(_baseline)`, or `ppo` with GAE over the values of
//!    a [`Critic`] — a value head on a copy of the transformer, trained first in every step
//!    with the clipped value loss);
//! 3. old log-probs scored once with the current weights (and reference log-probs from a
//!    frozen copy when `use_kl_loss` / `kl_coef` need them) through miles-bridge's **sequence
//!    scorer** ([`miles_bridge::score_response`]) — the same code the embedded engine uses to
//!    score what it generated;
//! 4. the rollout is split into `num_steps_per_rollout` optimizer steps of `global_batch_size`
//!    samples, each step into micro-batches ([`plan_micro_batches`], fixed size or a token
//!    budget), gradients accumulated over micro-batches, **global** gradient-norm clipping
//!    (`clip_grad`), then decoupled-weight-decay AdamW ([`AdamW`]) at the scheduled LR
//!    ([`LrSchedule`]);
//! 5. metrics under Miles' names (`train/loss`, `train/pg_loss`, `train/grad_norm`, `train/lr`,
//!    …) are returned and traced.
//!
//! **Mixed precision** ([`TrainConfig::precision`], Miles' `--bf16` / `--fp16`): parameters and
//! AdamW state stay `f32` (master weights); every forward runs on the weights cast to the
//! compute dtype (a differentiable cast: gradients arrive in `f32`), the log-prob op, losses
//! and reductions stay `f32`, and exported weights are written in the compute dtype.
//!
//! Per-token log-probs are **batch-invariant** by construction in the default
//! [`BatchLayout::PerSample`] layout: every sample is forwarded on its own, so its log-probs do
//! not depend on which other samples, padding or packing share its micro-batch (tested bit for
//! bit). [`BatchLayout::Packed`] and [`BatchLayout::Padded`] batch the forward instead, with
//! log-probs equal to the per-sample ones up to float rounding.
//!
//! **LoRA** (`lora_rank > 0`): the actor attaches miles-bridge LoRA adapters
//! ([`miles_bridge::lora`]) and freezes the base, so only the adapters are trained and have
//! optimizer state; [`PolicyTrainer::export_weights`](miles_core::PolicyTrainer::export_weights)
//! returns the merged HF weights (bit-identical log-probs in the default `merged` forward), the
//! reference model is the adapter-free base, and checkpoints store the adapters as a PEFT
//! adapter directory.
//!
//! Checkpoints ([`Actor::save_checkpoint`](miles_core::PolicyTrainer::save_checkpoint)) hold
//! the HF-named model, the AdamW moments, the step and the weight version, written to a
//! temporary directory and renamed into place, so a crash mid-save leaves the previous
//! checkpoint usable; resuming continues bit-identically.
//!
//! ```
//! use miles_train::{LrDecayStyle, LrSchedule};
//!
//! let schedule = LrSchedule {
//!     lr: 1e-6,
//!     min_lr: 1e-7,
//!     lr_warmup_iters: 10,
//!     lr_decay_iters: Some(110),
//!     lr_decay_style: LrDecayStyle::Cosine,
//!     ..LrSchedule::default()
//! }
//! .validate()?;
//! assert_eq!(schedule.lr_at(5), 0.5e-6); // half-way through linear warm-up
//! assert_eq!(schedule.lr_at(10), 1e-6); // peak
//! assert!((schedule.lr_at(60) - 0.55e-6).abs() < 1e-15); // cosine mid-point
//! assert_eq!(schedule.lr_at(500), 1e-7); // past decay: min_lr
//! # Ok::<(), miles_train::Error>(())
//! ```

mod actor;
mod batch;
mod checkpoint;
mod config;
mod critic;
mod malloc;
mod optim;
mod schedule;
mod scoring;

pub use actor::{Actor, StepReport};
pub use batch::{
    BatchLayout, TrainItem, has_siblings, plan_micro_batches, plan_rollout_steps, plan_steps,
    rollout_mask_sums, rollouts_of,
};
pub use config::{AdamWConfig, LossType, TrainConfig};
pub use critic::{Critic, ValueModel};
pub use malloc::retain_freed_memory;
pub use optim::{AdamW, GradAccumulator, NamedParams};
pub use schedule::{LrDecayStyle, LrSchedule};
pub use scoring::{HookFn, ScoredBatch, score_batch};

use std::path::PathBuf;

/// Errors of miles-train.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of its valid range.
    #[error("invalid config: {field} = {value}: {reason}")]
    Config {
        /// The flag (Miles / Megatron name, with underscores).
        field: &'static str,
        /// The offending value.
        value: String,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// A training sample cannot be used.
    #[error("sample {index}: {reason}")]
    Sample {
        /// Position of the sample in the batch handed to `train`.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint is missing, corrupt or does not match the model.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file-system operation failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A loss, advantage or log-prob computation rejected its input.
    #[error(transparent)]
    Ops(#[from] miles_ops::OpsError),
    /// The model rejected its input or weights.
    #[error(transparent)]
    Bridge(#[from] miles_bridge::BridgeError),
    /// The routing-replay layer rejected its input.
    #[error(transparent)]
    R3(#[from] miles_r3::R3Error),
    /// A miles-core operation (metrics sink, sample) failed.
    #[error(transparent)]
    Core(#[from] miles_core::Error),
    /// A non-finite loss or gradient norm: the step was not applied.
    #[error("non-finite {what} at step {step}: the update was skipped")]
    NonFinite {
        /// `loss` or `grad_norm`.
        what: &'static str,
        /// The optimizer step.
        step: u64,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl From<Error> for miles_core::Error {
    fn from(e: Error) -> Self {
        miles_core::Error::Trainer(e.to_string())
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
