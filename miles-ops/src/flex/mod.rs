//! The native `Flex` side of the fused ops: row loops over contiguous `f32` data, in
//! parallel with rayon, behind the burn backend extensions whose `Flex` implementations live
//! with each op (`attention.rs`, `norm.rs`, `swiglu.rs`, `grouped.rs`, …).
//!
//! - `amx`: `bf16` matrix products on Intel AMX tiles (`f32` accumulation), with the
//!   `f32` `gemm` fallback on CPUs without AMX;
//! - `attention`: masked softmax attention forward and backward, and the decode step over a
//!   paged KV pool (with attention sinks and the sliding window's skipped keys);
//! - `delta`: the gated delta rule's forward (the recurrent form, tasks per value columns);
//! - `chunked`: the chunked gated delta rule, forward and backward (tasks per head, chunks
//!   of `gemm` products);
//! - `steps`: the fused log-prob op's per-chunk forward and backward steps;
//! - `exp`: the vectorisable polynomial `exp` the row loops share;
//! - `gemm`: one strided, bounds-checked `gemm` call on the calling thread;
//! - `tensor`: flex tensor helpers (`f32` data, casts, shapes) and which dtypes and devices
//!   the fused ops take.

pub(crate) mod amx;
pub(crate) mod attention;
pub(crate) mod chunked;
pub(crate) mod delta;
pub(crate) mod exp;
pub(crate) mod gemm;
pub(crate) mod steps;
pub(crate) mod tensor;
