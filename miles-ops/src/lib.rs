//! # miles-ops
//!
//! The math of RL post-training for miles-rs, matching Miles' formulas and flag names
//! (MILES_SPEC §5):
//!
//! - [`advantages`]: reward normalisation and the estimators `grpo` (Dr.GRPO with
//!   `disable_grpo_std_normalization`), `gspo`, `reinforce_plus_plus`,
//!   `reinforce_plus_plus_baseline` and `ppo` (GAE), plus `--normalize-advantages`.
//! - [`policy`]: the policy loss (PPO clip, asymmetric `eps_clip_high`, dual clip
//!   `eps_clip_c`, GSPO sequence ratio, OPSM), KL loss, entropy bonus, value and SFT losses.
//! - [`corrections`]: TIS (`vanilla_tis`), ICEPOP and MIS importance-sampling corrections.
//! - [`kl`]: the k1 / k2 / k3 / `low_var_kl` estimators.
//! - [`reduce`]: `sum_of_sample_mean` / per-token aggregation with loss masks, and metrics
//!   under Miles' names.
//! - [`logprobs`] and [`fused`]: per-token log-probs and entropy from logits, and the fused,
//!   chunked version from hidden states and `lm_head` with a custom backward that never
//!   materialises `[tokens, vocab]`.
//! - [`clipped`]: the clipped policy-gradient loss as one fused op (forward and backward).
//! - [`attention`], [`norm`], [`swiglu`], [`grouped`]: the fused model ops (masked attention
//!   with grouped key/value heads, RMSNorm, RoPE, SwiGLU, the grouped expert matmul), each
//!   one backend op with a custom backward and a plain-op `*_reference` twin.
//! - [`bucket`]: the expert bucketing of a sparse MoE dispatch (stable counting sort of the
//!   chosen ids by expert) on the ids' device, whose offsets
//!   [`grouped::grouped_matmul_offsets`] takes as a device tensor.
//! - CubeCL kernels (feature `wgpu`, or `cuda`), registered as burn backend extensions for
//!   `CubeBackend`, so the ops dispatch to them for `f32` tensors on a CubeCL device (with or
//!   without autodiff) and to native loops on flex:
//!   - the per-chunk forward and backward steps of [`fused`] and the [`clipped`] loss
//!     (`tests/it/kernels.rs`, against their plain-op twins);
//!   - RMSNorm (row reductions in shared memory; the weight gradient in two passes), RoPE and
//!     SwiGLU (element-wise), forward and backward, and the grouped expert matmul (forward,
//!     input and weight gradients, host sizes or device offsets) and the expert bucketing
//!     (`tests/it/kernels_model.rs`, against the flex ops and the host counting sort);
//!   - attention: a flash-style online-softmax forward (one cube per query row, key tiles
//!     skipped outside the row's first / last unmasked key, log-sum-exp saved), which is
//!     also the decode step over the KV cache, and a backward recomputing the
//!     probabilities from it (`∂q` per query row, `∂k / ∂v` per key, no atomics)
//!     (`tests/it/kernels_attention.rs`, against the flex op).
//!
//!   No plane (warp) operations and a few KiB of shared memory per cube, so they run on
//!   every WebGPU adapter; tested on `Device::wgpu(DeviceKind::Cpu)` (lavapipe without a GPU).
//! - [`packed`], [`linear`] and [`grouped::grouped_matmul_packed`]: forward-only inference
//!   matmuls for a decode step on flex: on AVX-512F CPUs an AVX-512 micro-kernel over weights
//!   packed once per weight version into 32-column panels (projections, `lm_head` and MoE
//!   experts; a row's result independent of the other rows); elsewhere projections split over
//!   both cores over weights stored transposed ([`linear::linear_t`]). The flex attention
//!   op's one-row (decode) case reads each cached key and value once per key/value head. [`logprobs`] has
//!   the samplers' vectorised row passes (log-sum-exp, tempered weights, greedy pick).
//!
//! Feature `avx512` (default): `gemm`'s AVX-512 kernels (burn's `x86-v4`), chosen at run time
//! on CPUs with AVX-512F, so flex's matmuls and ours use them; other CPUs keep the AVX2 / SSE
//! kernels and other architectures are unaffected.
//! - [`device`]: the one `--device` parser (`flex`, `wgpu[:N]`, `wgpu-cpu`, `cuda[:N]`)
//! - [`kernel_device`]: the device CubeCL kernel tests run on (wgpu over a software adapter)
//!   and the policy for machines without one (`MILES_REQUIRE_KERNEL_TESTS`).
//! - [`fused_ops_enabled`] / [`set_fused_ops`]: one process-wide switch (also
//!   `MILES_FUSED_OPS=off`) that sends every fused op to its plain-op twin, to measure the two
//!   paths in one run.
//!
//! Built-in choices are serde enums whose values are Miles' CLI values; configs carry
//! Miles' defaults and are validated once (`init`). Tensor code uses burn's
//! device-at-run-time API, so it runs on any device, with or without autodiff.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use miles_ops::advantages::{AdvantageConfig, AdvantageSample, Grouping};
//! use miles_ops::policy::{PolicyLossConfig, PolicyLossInput};
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

pub mod advantages;
pub mod attention;
pub mod bucket;
pub mod clipped;
pub mod corrections;
pub mod device;
mod error;
mod flex_attention;
mod flex_steps;
mod flex_util;
pub mod fused;
pub mod grouped;
pub mod kernel_device;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels_attention;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod kernels_model;
pub mod kl;
pub mod linear;
pub mod logprobs;
pub mod norm;
pub mod packed;
pub mod paged;
pub mod policy;
pub mod reduce;
pub mod swiglu;
mod switch;

pub use error::{OpsError, Result};
pub use switch::{FUSED_OPS_ENV, env_value_turns_off, fused_ops_enabled, set_fused_ops};
