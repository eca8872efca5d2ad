//! The integration tests of the examples package (the example binaries, cross-crate
//! checks; the `miles` command's tests are miles-cli's), one module per former test file, built as one test binary: one compile
//! of the dependencies' generic code and one link instead of one per file. The example binaries
//! they run sit next to this one (`cargo test` builds the examples first).

mod engine_vs_trainer;
mod glm_moe_grpo;
mod grpo_learns;
mod half_precision;
mod opd;
mod toolkit;
mod wgpu_step;
