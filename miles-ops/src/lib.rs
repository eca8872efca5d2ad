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
//! - CubeCL kernels (feature `wgpu`, or `cuda`): the per-chunk forward and backward steps of
//!   [`fused`] and the [`clipped`] loss, registered as burn backend extensions for
//!   `CubeBackend`, so the ops dispatch to them for tensors on a CubeCL device and to native
//!   loops on flex; each has a plain-op `*_reference` twin they are tested against on
//!   `Device::wgpu(DeviceKind::Cpu)` (`tests/it/kernels.rs`, lavapipe without a GPU).
//! - [`linear`] and [`grouped::grouped_matmul_packed`]: forward-only inference matmuls for a
//!   decode step on flex (small projections split over both cores; MoE experts over weights
//!   packed once per weight version).
//! - [`device`]: the one `--device` parser (`flex`, `wgpu[:N]`, `wgpu-cpu`, `cuda[:N]`)
//! - [`kernel_device`]: the device CubeCL kernel tests run on (wgpu over a software adapter)
//!   and the policy for machines without one (`MILES_REQUIRE_KERNEL_TESTS`).
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
pub mod kl;
pub mod linear;
pub mod logprobs;
pub mod norm;
pub mod policy;
pub mod reduce;
pub mod swiglu;

pub use error::{OpsError, Result};
