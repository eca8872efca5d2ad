//! The integration tests of miles-ops, one module per former test file, built as one test
//! binary: one compile of burn's generic code and one link instead of one per file. The kernel
//! modules (`kernel_device`, `kernels`) are compiled only with a cubecl feature (`wgpu` / `cuda`).

mod common;

mod attention;
mod delta;
mod fused;
mod gradients;
mod grouped;
mod kernel_device;
mod kernels;
mod kernels_attention;
mod kernels_model;
mod linear;
mod norm;
mod properties;
mod swiglu;
