//! The CubeCL kernels of the fused ops and the device their tests run on.
//!
//! With the `wgpu` (or `cuda`) feature, every fused op registers CubeCL kernels for burn's
//! `CubeBackend` as its backend-extension implementation, so the ops dispatch to them for
//! `f32` tensors on a CubeCL device (with or without autodiff); nothing here is called
//! directly:
//!
//! - `loss.rs`: the per-chunk forward and backward steps of the fused log-probs
//!   ([`crate::fused::FusedLogProbOps`]) and the clipped policy-gradient loss
//!   ([`crate::ClippedPgLossOps`]);
//! - `model.rs`: RMSNorm, RoPE, SwiGLU, the grouped expert matmul and the expert bucketing;
//! - `attention.rs`: flash-style masked attention forward (also the decode step) and backward,
//!   with attention sinks and the sliding window (through the mask);
//! - `delta.rs`: the gated delta rule's recurrent forward ([`crate::GatedDeltaOps`]);
//! - `chunked.rs`: the chunked gated delta rule's scans over the chunks, forward and
//!   backward ([`crate::ChunkedDeltaOps`]; the chunk-local products are batched tensor ops).
//!
//! No plane (warp) operations and a few KiB of shared memory per cube, so they run on every
//! WebGPU adapter. What this module exports is the device kernel tests run on
//! ([`kernel_test_device`]: wgpu over a software Vulkan adapter without a GPU) and the policy
//! for machines without one ([`REQUIRE_KERNEL_TESTS_ENV`]).

#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod attention;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod chunked;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod delta;
mod device;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod launch;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod loss;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod model;

#[cfg(feature = "wgpu")]
pub use device::kernel_device;
pub use device::{
    INSTALL_HINT, REQUIRE_KERNEL_TESTS_ENV, kernel_test_device, kernel_tests_required,
};
