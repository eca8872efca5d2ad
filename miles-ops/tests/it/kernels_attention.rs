//! The CubeCL attention kernels (flash-style forward, backward recomputed from the saved
//! log-sum-exp) on the kernel test device against the fused attention op on flex (itself
//! checked against the tensor-op definition in `attention.rs`): outputs and the gradients of
//! a weighted sum w.r.t. `q`, `k` and `v`.
//!
//! Cases, chosen to share shader shapes (head dims 64 and 128): a causal mask over a cache
//! (rows < keys) with several key tiles and grouped heads (ratio 2) on strided inputs; left
//! padding (fully masked rows) with packed sequences and grouped heads (ratio 4) at head dim
//! 128; the decode step over a KV cache (one query row, left-padded keys); a tiny causal case
//! (3 rows, one partial tile); and a packed
//! (block-diagonal causal) mask over several tiles. Tolerance 2e-5 of the largest magnitude
//! for outputs and 5e-5 for gradients (f32 sums in another order; flex's `exp` is a
//! polynomial within 2 ulp).
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::tensor::{Bool, Device, Tensor, TensorData};
use miles_ops::kernels::kernel_test_device;
use miles_ops::{attention, runs_fused};

use crate::common::{assert_rel_close, lcg, to_vec};

#[derive(Clone, Copy)]
enum MaskKind {
    /// Causal over a cache: query `i` sits at key position `past + i`.
    Causal,
    /// Causal, and the first `pad + batch index` keys are padding (left padding): the first
    /// rows see no key at all.
    LeftPadded(usize),
    /// Two packed segments per row, causal within each.
    Packed,
    /// Left padding and two packed segments.
    PaddedPacked(usize),
}

struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    rows: usize,
    keys: usize,
    head_dim: usize,
    mask: MaskKind,
    strided: bool,
}

fn mask_data(c: &Case) -> Vec<bool> {
    let past = c.keys - c.rows;
    let mut m = Vec::with_capacity(c.batch * c.rows * c.keys);
    for b in 0..c.batch {
        let cut = c.keys / 2 + b;
        for i in 0..c.rows {
            let pos = past + i;
            for j in 0..c.keys {
                let packed = (pos >= cut) != (j >= cut);
                let masked = match c.mask {
                    MaskKind::Causal => j > pos,
                    MaskKind::LeftPadded(pad) => j > pos || j < pad + b,
                    MaskKind::Packed => j > pos || packed,
                    MaskKind::PaddedPacked(pad) => j > pos || j < pad + b || packed,
                };
                m.push(masked);
            }
        }
    }
    m
}

/// (out, dq, dk, dv) of `Σ w ⊙ attention(q, k, v)` on `device` (with autodiff).
fn run(c: &Case, device: &Device) -> [Vec<f32>; 4] {
    let device = device.clone().autodiff();
    let make = |heads: usize, rows: usize, seed: u64| {
        let data = lcg(c.batch * heads * rows * c.head_dim, seed, 1.5);
        let flat = Tensor::<1>::from_floats(data.as_slice(), &device);
        if c.strided {
            flat.reshape([c.batch, rows, heads, c.head_dim])
                .require_grad()
        } else {
            flat.reshape([c.batch, heads, rows, c.head_dim])
                .require_grad()
        }
    };
    let q0 = make(c.heads, c.rows, 1);
    let k0 = make(c.kv_heads, c.keys, 2);
    let v0 = make(c.kv_heads, c.keys, 3);
    let view = |t: &Tensor<4>| {
        if c.strided {
            t.clone().swap_dims(1, 2)
        } else {
            t.clone()
        }
    };
    let mask = Tensor::<3, Bool>::from_data(
        TensorData::new(mask_data(c), [c.batch, c.rows, c.keys]),
        &device,
    );
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let out = attention(view(&q0), view(&k0), view(&v0), mask, scale).unwrap();
    let w = Tensor::<1>::from_floats(
        lcg(c.batch * c.heads * c.rows * c.head_dim, 9, 1.0).as_slice(),
        &device,
    )
    .reshape([c.batch, c.heads, c.rows, c.head_dim]);
    let grads = (out.clone() * w).sum().backward();
    [
        to_vec(out.detach()),
        to_vec(q0.grad(&grads).unwrap()),
        to_vec(k0.grad(&grads).unwrap()),
        to_vec(v0.grad(&grads).unwrap()),
    ]
}

fn compare(what: &str, c: &Case, device: &Device) {
    let (kernel, flex) = (run(c, device), run(c, &Device::flex()));
    for (i, part) in ["out", "dq", "dk", "dv"].iter().enumerate() {
        let tol = if i == 0 { 2e-5 } else { 5e-5 };
        assert_rel_close(&format!("{what} {part}"), &kernel[i], &flex[i], tol);
    }
}

#[test]
fn attention_kernels_match_flex() {
    let Some(dev) = kernel_test_device("attention_kernels_match_flex") else {
        return;
    };
    assert!(runs_fused(&dev) && runs_fused(&dev.clone().autodiff()));
    compare(
        "causal cache, 3 key tiles, GQA 2, strided",
        &Case {
            batch: 1,
            heads: 4,
            kv_heads: 2,
            rows: 150,
            keys: 300,
            head_dim: 64,
            mask: MaskKind::Causal,
            strided: true,
        },
        &dev,
    );
    compare(
        "left padded + packed, GQA 4, head dim 128",
        &Case {
            batch: 2,
            heads: 4,
            kv_heads: 1,
            rows: 37,
            keys: 37,
            head_dim: 128,
            mask: MaskKind::PaddedPacked(3),
            strided: false,
        },
        &dev,
    );
    compare(
        "decode over a left-padded KV cache",
        &Case {
            batch: 2,
            heads: 4,
            kv_heads: 2,
            rows: 1,
            keys: 133,
            head_dim: 64,
            mask: MaskKind::LeftPadded(5),
            strided: false,
        },
        &dev,
    );
    compare(
        "tiny: 3 rows, causal",
        &Case {
            batch: 1,
            heads: 2,
            kv_heads: 1,
            rows: 3,
            keys: 3,
            head_dim: 64,
            mask: MaskKind::Causal,
            strided: false,
        },
        &dev,
    );
    compare(
        "packed, several tiles",
        &Case {
            batch: 2,
            heads: 2,
            kv_heads: 2,
            rows: 140,
            keys: 140,
            head_dim: 64,
            mask: MaskKind::Packed,
            strided: false,
        },
        &dev,
    );
}

/// Sinks and the sliding window (GPT-OSS): the kernels (the window through the mask, the
/// key tiles before a row's first unmasked key skipped; the sink folded into the
/// log-sum-exp) against the flex op, values and the gradients w.r.t. q, k, v and the sinks.
#[test]
fn attention_kernels_with_sinks_and_window_match_flex() {
    let Some(dev) = kernel_test_device("attention_kernels_with_sinks_and_window_match_flex") else {
        return;
    };
    for (what, c) in crate::attention::sink_cases() {
        let kernel = crate::attention::run_sinks(&c, &dev, true);
        let flex = crate::attention::run_sinks(&c, &Device::flex(), true);
        for (i, part) in ["out", "dq", "dk", "dv", "dsinks"].iter().enumerate() {
            let tol = if i == 0 { 2e-5 } else { 5e-5 };
            assert_rel_close(&format!("{what} {part}"), &kernel[i], &flex[i], tol);
        }
    }
}
