//! # miles-ops
//!
//! The math of RL post-training on burn, generic over devices: policy losses (PPO clip, dual
//! clip, GSPO), importance-sampling corrections (TIS, MIS, ICEPOP), KL estimators, entropy,
//! advantage estimators (GRPO, Dr.GRPO, REINFORCE++, REINFORCE++-baseline, GAE), aggregation,
//! fused memory-lean log-probs with a custom backward, and CubeCL kernels (crate features
//! `wgpu` / `cuda`) each with a plain-op `*_reference` twin.
//!
//! Kernel tests run on [`kernel_device`]'s software adapter; see that module for the policy on
//! machines without one.
//!
//! ```
//! use miles_ops::kernel_device::{REQUIRE_KERNEL_TESTS_ENV, kernel_tests_required};
//!
//! assert_eq!(REQUIRE_KERNEL_TESTS_ENV, "MILES_REQUIRE_KERNEL_TESTS");
//! // CI sets it so a missing adapter fails the kernel tests instead of skipping them.
//! let _required: bool = kernel_tests_required();
//! ```

pub mod kernel_device;
