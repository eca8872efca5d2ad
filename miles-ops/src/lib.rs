//! # miles-ops
//!
//! The math of RL post-training for miles-rs, matching Miles' formulas, flag names and
//! defaults. Every item has one path: the RL math and the fused model ops at the crate root,
//! six namespaces for what only reads well qualified.
//!
//! **RL math** (at the root):
//!
//! - advantages: [`AdvantageConfig`] → [`AdvantageCalculator`] (reward normalisation and the
//!   estimators `grpo` — Dr.GRPO with `disable_grpo_std_normalization` — `gspo`,
//!   `reinforce_plus_plus`, `reinforce_plus_plus_baseline` and `ppo` (GAE), see
//!   [`AdvantageEstimator`]), plus `--normalize-advantages` ([`whiten_advantages`]);
//! - the policy loss: [`PolicyLossConfig`] → [`PolicyLoss`] (PPO clip, asymmetric
//!   `eps_clip_high`, dual clip `eps_clip_c`, GSPO sequence ratio, OPSM, KL loss, entropy
//!   bonus), [`value_loss`], [`sft_loss`], and the clipped policy-gradient loss as one fused
//!   op forward and backward ([`clipped_pg_loss`], twin [`clipped_pg_loss_reference`]);
//! - importance-sampling corrections: [`TisFunction`] (`vanilla_tis`, `icepop`) and Miles'
//!   MIS ([`MisConfig`]);
//! - KL: [`KlLossType`] (`k1`, `k2`, `k3`, `low_var_kl`), [`compute_approx_kl`],
//!   [`shaping_kl`];
//! - aggregation: [`Reducer`] (`sum_of_sample_mean` / per-token with loss masks) and
//!   [`LossMetrics`] under Miles' names.
//!
//! **Fused model ops** (at the root), each one backend op with a custom backward and a
//! plain-op `*_reference` twin — native row loops on flex, CubeCL kernels on CubeCL devices:
//! masked attention with grouped key/value heads ([`attention()`], with GPT-OSS's sinks and
//! sliding window [`attention_with_sinks`]), [`rms_norm`], [`rope`],
//! [`swiglu()`], one AdamW update per parameter in one pass ([`adamw_update`], clipping's
//! coefficient applied inside it; a gradient's [`squared_norm`] in one pass), the token
//! [`embedding()`] whose backward adds into a tied weight's gradient in place, the grouped
//! expert matmul ([`grouped_matmul`], over device offsets
//! [`grouped_matmul_offsets`], over weights packed once per version [`PackedExperts`] /
//! [`grouped_matmul_packed`]), the expert bucketing of a sparse MoE dispatch on the ids'
//! device ([`bucket_by_expert`]), the decode-step projections split over the cores
//! ([`linear()`], [`linear_t`]), the training `bf16` linear layer on Intel AMX tiles
//! ([`linear_bf16`], forward and both gradients), the training `f32` linear layer whose
//! gradients are each written once, `∂W` in `W`'s layout ([`linear_train`], with the 2-D
//! product of the backward passes, [`MatmulOps::dense_matmul`], and the gradient buffers a
//! trainer keeps for its next step: [`keep_result_buffers`], [`recycle`]) and the gated
//! delta rule of Qwen3.5's linear attention in the chunked form
//! ([`gated_delta_rule_chunked`]: native loops on flex; on CubeCL devices batched tensor ops
//! for the chunk-local products and one fused kernel for the scan over the chunks each way;
//! the explicit backward on both); forward only, its recurrent form for decode steps
//! ([`gated_delta_rule`]: a native loop or a CubeCL kernel).
//! [`runs_fused`] says whether a device takes the fused path;
//! [`fused_ops_enabled`] / [`set_fused_ops`] (also `MILES_FUSED_OPS=off`) is one
//! process-wide switch that sends every fused op to its plain-op twin, to measure the two
//! paths in one run.
//!
//! **Namespaces:**
//!
//! - [`fused`]: per-token log-probs and entropy from hidden states and `lm_head`, chunked over
//!   tokens and vocabulary with a custom backward that never materialises `[tokens, vocab]`
//!   ([`fused::FusedLogProbConfig`]), and the op's per-chunk steps and plain-op twins;
//! - [`logprobs`]: the plain (reference) log-probs and entropy from logits, and the samplers'
//!   vectorised host row passes (log-sum-exp, tempered weights, greedy pick);
//! - [`packed`]: forward-only decode matmuls on flex with AVX-512F over weights packed once per
//!   weight version into 32-column panels (projections, `lm_head`, MoE experts);
//! - [`rows`]: forward-only decode matmuls on flex with AVX-512F (and VL) or AVX2 over weights
//!   read in place in their HF layout (no copy; the engine's path where [`packed`] does not
//!   apply, or where it is asked to copy nothing, as `miles train`'s engine is);
//! - [`paged`]: decode attention over a paged KV pool;
//! - [`device`]: the one `--device` parser (`flex`, `wgpu[:N]`, `wgpu-cpu`, `cuda[:N]`);
//! - [`kernels`]: the CubeCL kernels (feature `wgpu`, or `cuda`) are registered as burn
//!   backend extensions for `CubeBackend`, so the ops above dispatch to them for `f32` tensors
//!   on a CubeCL device; the namespace holds the device their tests run on (wgpu over a
//!   software adapter) and the policy for machines without one (`MILES_REQUIRE_KERNEL_TESTS`).
//!
//! Feature `avx512` (default): `gemm`'s AVX-512 kernels (burn's `x86-v4`), chosen at run time
//! on CPUs with AVX-512F, so flex's matmuls and ours use them; other CPUs keep the AVX2 / SSE
//! kernels and other architectures are unaffected.
//!
//! Built-in choices are serde enums whose values are Miles' CLI values; configs carry
//! Miles' defaults and are validated once (`init`). Tensor code uses burn's
//! device-at-run-time API, so it runs on any device, with or without autodiff.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use miles_ops::{AdvantageConfig, AdvantageSample, Grouping, PolicyLossConfig, PolicyLossInput};
//!
//! // GRPO: one prompt, four samples.
//! let calc = AdvantageConfig::default().with_n_samples_per_prompt(4).init()?;
//! let rewards = calc.normalize_rewards(&[1.0, 0.0, 0.0, 1.0], Grouping::FanOut, None)?;
//! assert!((rewards[0] - 0.866_025).abs() < 1e-5); // (1 − 0.5) / (std=0.577… + 1e-6)
//!
//! let mask = [1.0f32, 1.0];
//! let adv = calc.compute(&[AdvantageSample::new(rewards[0], &mask)])?;
//! assert_eq!(adv[0].advantages.len(), 2);
//!
//! // PPO-clip loss on a [1, 2] batch, on the flex CPU device.
//! let device = Device::flex();
//! let lp = Tensor::<2>::from_floats([[-1.0, -2.0]], &device);
//! let a = Tensor::<2>::from_floats([[adv[0].advantages[0], adv[0].advantages[1]]], &device);
//! let m = Tensor::<2>::from_floats([[1.0, 1.0]], &device);
//! let out = PolicyLossConfig::default()
//!     .init()?
//!     .forward(PolicyLossInput::new(lp.clone(), lp, a, m))?;
//! // On-policy (ratio 1): pg_loss = −A.
//! let pg: f32 = out.metrics.get("pg_loss").unwrap().clone().into_scalar();
//! assert!((pg + rewards[0]).abs() < 1e-5);
//! # Ok::<(), miles_ops::OpsError>(())
//! ```

mod adamw;
mod advantages;
mod attention;
mod bucket;
mod clipped;
mod corrections;
pub mod device;
mod embedding;
mod error;
mod flex;
pub mod fused;
mod gated_delta;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gated_delta_tensor;
mod grouped;
pub mod kernels;
mod kl;
mod linear;
mod linear_bf16;
pub mod logprobs;
mod matmul;
mod norm;
pub mod packed;
pub mod paged;
mod policy;
mod reduce;
pub mod rows;
mod swiglu;
mod switch;

pub use error::{OpsError, Result};
pub use switch::{
    FUSED_OPS_ENV, env_value_turns_off, fused_ops_enabled, runs_fused, set_fused_ops,
};

// RL math.
pub use adamw::{
    AdamWHyper, AdamWOps, adamw_update, adamw_update_reference, adamw_zero_moment, squared_norm,
    squared_norm_reference,
};
pub use advantages::{
    AdvantageCalculator, AdvantageConfig, AdvantageEstimator, AdvantageOutput, AdvantageSample,
    GROUP_STD_EPS, Grouping, WHITEN_EPS, whiten_advantages,
};
pub use clipped::{ClippedPgLossOps, clipped_pg_loss, clipped_pg_loss_reference};
pub use corrections::{Correction, IS_LOG_RATIO_BOUND, IsLevel, IsMode, MisConfig, TisFunction};
pub use kl::{
    KlLossType, LOG_RATIO_CLAMP, LOW_VAR_KL_CLAMP, approx_kl_scalar, compute_approx_kl, shaping_kl,
};
pub use policy::{
    PolicyLoss, PolicyLossConfig, PolicyLossInput, PolicyLossOutput, compute_policy_loss, sft_loss,
    value_loss,
};
pub use reduce::{LossAggregation, LossMetrics, Reducer, read_scalars};

// Fused model ops.
pub use attention::{
    FusedAttentionOps, MASKED_SCORE, attention, attention_reference, attention_with_sinks,
    attention_with_sinks_reference,
};
pub use bucket::{ExpertBucketOps, ExpertBuckets, HostBuckets, bucket_by_expert};
pub use embedding::{EmbeddingOps, embedding, embedding_reference};
pub use gated_delta::{
    ChunkedDeltaOps, DELTA_CHUNK, GatedDeltaOps, gated_delta_rule, gated_delta_rule_chunked,
    gated_delta_rule_recurrent, gated_delta_rule_reference, unit_lower_inverse,
};
pub use grouped::{
    ExpertLayout, GroupedMatmulOps, GroupedOffsetsOps, GroupedPackedOps, PackedExperts,
    grouped_matmul, grouped_matmul_offsets, grouped_matmul_offsets_packed, grouped_matmul_packed,
    grouped_matmul_reference,
};
pub use linear::{DECODE_ROWS, LinearOps, linear, linear_reference, linear_t};
pub use linear_bf16::{Bf16LinearOps, linear_bf16, runs_amx};
pub use matmul::{
    MatmulOps, drop_result_buffers, keep_result_buffers, linear_train, recycle, result_buffer_limit,
};
pub use norm::{NormRopeOps, rms_norm, rms_norm_reference, rope, rope_reference};
pub use swiglu::{SwiGluOps, swiglu, swiglu_reference};
