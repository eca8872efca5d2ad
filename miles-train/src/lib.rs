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
//!    ([`LrSchedule`]), which on flex updates the weights in place and, with full activation
//!    recomputation, keeps each gradient's buffer for the next step's backward to write into
//!    (up to the model's `f32` size: [`miles_ops::keep_result_buffers`]);
//! 5. metrics under Miles' names (`train/loss`, `train/pg_loss`, `train/grad_norm`, `train/lr`,
//!    …) are returned and traced.
//!
//! **Activation recomputation** ([`TrainConfig::recompute`], Megatron's
//! `--recompute-granularity`, `--recompute-method`, `--recompute-num-layers`): with `full`,
//! the training forward keeps only the input of each recomputed group of layers and re-runs
//! the group in the backward pass ([`miles_bridge::RecomputedForward`]); loss and gradients
//! equal the plain step's bit for bit with one forward pass per micro-batch.
//!
//! **Mixed precision** ([`TrainConfig::precision`], Miles' `--bf16` / `--fp16`): parameters and
//! AdamW state stay `f32` (master weights); every forward runs on the weights cast to the
//! compute dtype (a differentiable cast: gradients arrive in `f32`), the log-prob op, losses
//! and reductions stay `f32`, and exported weights are written in the compute dtype.
//!
//! Per-token log-probs are **batch-invariant** by construction in the default
//! [`BatchLayout::PerSample`] layout: every sample is forwarded on its own, so its log-probs do
//! not depend on which other samples, padding or packing share its micro-batch (tested bit for
//! bit). [`BatchLayout::Packed`], [`BatchLayout::Padded`] and [`BatchLayout::SharedPrefix`]
//! (one row per prompt: a group's prompt computed once for all its responses) batch the
//! forward instead, with log-probs equal to the per-sample ones up to float rounding.
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
mod error;
mod malloc;
mod opd;
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
pub use error::{Error, Result};
pub use malloc::retain_freed_memory;
pub use opd::{OpdConfig, OpdType, apply_opd_kl_to_advantages};
pub use optim::{AdamW, GradAccumulator, NamedParams};
pub use schedule::{LrDecayStyle, LrSchedule};
pub use scoring::{HookFn, ScoredBatch, score_batch};
