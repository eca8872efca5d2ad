//! The fused attention op on flex against its definition written with tensor ops
//! (`attention_reference`: repeated key/value heads, `q·kᵀ·scale`, masked fill, softmax, `·v`):
//! outputs and the gradients of a weighted sum of them w.r.t. `q`, `k` and `v`, under causal,
//! padded, packed, fully masked and cached (rows < keys) masks, grouped heads, strided inputs,
//! and shapes that do not fill a row block.

use burn::tensor::{Bool, Device, Tensor, TensorData};
use miles_ops::OpsError;
use miles_ops::{
    attention, attention_reference, attention_with_sinks, attention_with_sinks_reference,
};

use crate::common::{assert_rel_close, lcg, to_vec};

#[derive(Clone, Copy)]
enum MaskKind {
    /// Causal over a cache: query `i` sits at key position `past + i`.
    Causal,
    /// Causal, and the first `pad` keys of every sequence are padding (left padding): the
    /// first rows see no key at all.
    LeftPadded(usize),
    /// Two packed segments per row, causal within each.
    Packed,
    /// Nothing masked.
    None,
}

struct Case {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    rows: usize,
    keys: usize,
    head_dim: usize,
    mask: MaskKind,
}

fn mask_data(c: &Case) -> Vec<bool> {
    let past = c.keys - c.rows;
    let mut m = Vec::with_capacity(c.batch * c.rows * c.keys);
    for b in 0..c.batch {
        for i in 0..c.rows {
            let pos = past + i;
            for j in 0..c.keys {
                let masked = match c.mask {
                    MaskKind::Causal => j > pos,
                    MaskKind::LeftPadded(pad) => j > pos || j < pad + b,
                    MaskKind::Packed => {
                        let cut = c.keys / 2 + b;
                        j > pos || (pos >= cut) != (j >= cut)
                    }
                    MaskKind::None => false,
                };
                m.push(masked);
            }
        }
    }
    m
}

/// (out, dq, dk, dv) of `Σ w ⊙ attention(q, k, v)`; `transposed` builds q, k and v as
/// `[b, rows, heads, d]` tensors swapped to `[b, heads, rows, d]` (strided views, as a model
/// makes them).
fn run(c: &Case, fused: bool, transposed: bool) -> [Vec<f32>; 4] {
    let device = Device::flex().autodiff();
    let make = |heads: usize, rows: usize, seed: u64| {
        let data = lcg(c.batch * heads * rows * c.head_dim, seed, 1.5);
        let flat = Tensor::<1>::from_floats(data.as_slice(), &device);
        let shape = if transposed {
            [c.batch, rows, heads, c.head_dim]
        } else {
            [c.batch, heads, rows, c.head_dim]
        };
        flat.reshape(shape).require_grad()
    };
    let q0 = make(c.heads, c.rows, 1);
    let k0 = make(c.kv_heads, c.keys, 2);
    let v0 = make(c.kv_heads, c.keys, 3);
    let view = |t: &Tensor<4>| {
        if transposed {
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
    let out = if fused {
        attention(view(&q0), view(&k0), view(&v0), mask, scale).unwrap()
    } else {
        attention_reference(view(&q0), view(&k0), view(&v0), mask, scale)
    };
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

fn compare(c: &Case) {
    for transposed in [false, true] {
        let reference = run(c, false, transposed);
        let fused = run(c, true, transposed);
        for (i, what) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            assert_rel_close(what, &fused[i], &reference[i], 2e-5);
        }
    }
}

#[test]
fn causal_grouped_heads_over_several_blocks() {
    compare(&Case {
        batch: 2,
        heads: 6,
        kv_heads: 2,
        rows: 150,
        keys: 150,
        head_dim: 16,
        mask: MaskKind::Causal,
    });
}

#[test]
fn left_padding_leaves_rows_with_no_key() {
    compare(&Case {
        batch: 3,
        heads: 4,
        kv_heads: 4,
        rows: 70,
        keys: 70,
        head_dim: 8,
        mask: MaskKind::LeftPadded(5),
    });
}

#[test]
fn packed_segments_and_no_mask() {
    compare(&Case {
        batch: 2,
        heads: 3,
        kv_heads: 1,
        rows: 66,
        keys: 66,
        head_dim: 12,
        mask: MaskKind::Packed,
    });
    compare(&Case {
        batch: 1,
        heads: 2,
        kv_heads: 1,
        rows: 9,
        keys: 9,
        head_dim: 4,
        mask: MaskKind::None,
    });
}

#[test]
fn cached_keys_prefill_and_decode() {
    compare(&Case {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        rows: 20,
        keys: 85,
        head_dim: 8,
        mask: MaskKind::Causal,
    });
    compare(&Case {
        batch: 3,
        heads: 2,
        kv_heads: 1,
        rows: 1,
        keys: 40,
        head_dim: 8,
        mask: MaskKind::LeftPadded(3),
    });
}

/// One query row per head with a head size the decode loops take (a multiple of 16): the
/// direct decode path (grouped heads reading each key once), including a row whose keys are
/// all masked and a key range cut short by the mask.
#[test]
fn decode_rows_with_vector_head_sizes() {
    for head_dim in [16, 64, 128] {
        compare(&Case {
            batch: 3,
            heads: 8,
            kv_heads: 2,
            rows: 1,
            keys: 37,
            head_dim,
            mask: MaskKind::LeftPadded(3),
        });
    }
    compare(&Case {
        batch: 3,
        heads: 4,
        kv_heads: 4,
        rows: 1,
        keys: 3,
        head_dim: 32,
        mask: MaskKind::LeftPadded(1),
    });
    compare(&Case {
        batch: 2,
        heads: 6,
        kv_heads: 3,
        rows: 1,
        keys: 70,
        head_dim: 64,
        mask: MaskKind::Packed,
    });
}

#[test]
fn inference_forward_matches_without_autodiff() {
    let device = Device::flex();
    let (b, h, s, d) = (2, 4, 33, 8);
    let q = Tensor::<1>::from_floats(lcg(b * h * s * d, 4, 1.0).as_slice(), &device)
        .reshape([b, h, s, d]);
    let k = Tensor::<1>::from_floats(lcg(b * 2 * s * d, 5, 1.0).as_slice(), &device)
        .reshape([b, 2, s, d]);
    let v = Tensor::<1>::from_floats(lcg(b * 2 * s * d, 6, 1.0).as_slice(), &device)
        .reshape([b, 2, s, d]);
    let case = Case {
        batch: b,
        heads: h,
        kv_heads: 2,
        rows: s,
        keys: s,
        head_dim: d,
        mask: MaskKind::Causal,
    };
    let mask = Tensor::<3, Bool>::from_data(TensorData::new(mask_data(&case), [b, s, s]), &device);
    let fused = attention(q.clone(), k.clone(), v.clone(), mask.clone(), 0.3).unwrap();
    let reference = attention_reference(q, k, v, mask, 0.3);
    assert_rel_close("out", &to_vec(fused), &to_vec(reference), 2e-5);
}

#[test]
fn inconsistent_shapes_are_typed_errors() {
    let device = Device::flex();
    let q = Tensor::<4>::zeros([1, 3, 4, 8], &device);
    let k = Tensor::<4>::zeros([1, 2, 4, 8], &device);
    let mask = Tensor::<3, Bool>::from_data(TensorData::new(vec![false; 16], [1, 4, 4]), &device);
    let err = attention(q.clone(), k.clone(), k.clone(), mask.clone(), 1.0).unwrap_err();
    assert!(
        matches!(
            err,
            OpsError::ShapeMismatch {
                what: "attention keys",
                ..
            }
        ),
        "{err:?}"
    );
    let k = Tensor::<4>::zeros([1, 1, 4, 8], &device);
    let v = Tensor::<4>::zeros([1, 1, 5, 8], &device);
    let err = attention(q.clone(), k.clone(), v, mask.clone(), 1.0).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "attention values",
            ..
        }
    ));
    let bad_mask =
        Tensor::<3, Bool>::from_data(TensorData::new(vec![false; 12], [1, 4, 3]), &device);
    let err = attention(q, k.clone(), k, bad_mask, 1.0).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "attention mask",
            ..
        }
    ));
}

/// Keys and values that are the used part of a larger KV cache (`[b, kv_heads, capacity, d]`
/// narrowed on the key axis, as the inference cache hands them over): the fused op reads them
/// in place and must give what the reference gives on contiguous copies, fully masked rows
/// (mean of the used values only) included.
#[test]
fn keys_and_values_narrowed_from_a_larger_cache() {
    let device = Device::flex();
    // One decode row; five rows of which the first ones see no key (left padding past them).
    for (mask, rows) in [(MaskKind::Causal, 1), (MaskKind::LeftPadded(34), 5)] {
        let c = Case {
            batch: 3,
            heads: 4,
            kv_heads: 2,
            rows,
            keys: 37,
            head_dim: 8,
            mask,
        };
        let capacity = 64;
        let cache = |seed: u64| {
            let data = lcg(c.batch * c.kv_heads * capacity * c.head_dim, seed, 1.5);
            Tensor::<1>::from_floats(data.as_slice(), &device)
                .reshape([c.batch, c.kv_heads, capacity, c.head_dim])
                .narrow(2, 0, c.keys)
        };
        let (k, v) = (cache(2), cache(3));
        let q = Tensor::<1>::from_floats(
            lcg(c.batch * c.heads * c.rows * c.head_dim, 1, 1.5).as_slice(),
            &device,
        )
        .reshape([c.batch, c.heads, c.rows, c.head_dim]);
        let mask = Tensor::<3, Bool>::from_data(
            TensorData::new(mask_data(&c), [c.batch, c.rows, c.keys]),
            &device,
        );
        let scale = 0.3;
        let fused = attention(q.clone(), k.clone(), v.clone(), mask.clone(), scale).unwrap();
        // The reference on contiguous copies of the used keys and values.
        let copy = |t: Tensor<4>| {
            let dims = t.dims();
            Tensor::<4>::from_data(t.into_data(), &device).reshape(dims)
        };
        let reference = attention_reference(q, copy(k), copy(v), mask, scale);
        assert_rel_close("out", &to_vec(fused), &to_vec(reference), 2e-5);
    }
}

/// The paged decode kernel (`miles_ops::paged`) over a pool whose blocks are scattered and
/// shared by sequences of different lengths, against the fused op over the same keys copied
/// into a contiguous, masked batch (`gather_index`) — bit for bit, since both run the same
/// decode loops over the same keys in the same order — and against the tensor-op reference;
/// bad tables and shapes are typed errors.
#[test]
fn paged_decode_equals_contiguous_decode() {
    use miles_ops::paged::{PageTable, applies, gather_index, paged_decode};
    let device = Device::flex();
    let (heads, kv_heads, d, block) = (8, 2, 32, 16);
    let blocks_in_pool = 12;
    let slots = blocks_in_pool * block;
    let table = PageTable {
        block,
        // Blocks out of order and interleaved between sequences; one sequence ends exactly
        // on a block boundary, one has a single position.
        blocks: vec![vec![7, 2, 9], vec![0], vec![11, 3], vec![5, 1, 8, 10]],
        lens: vec![40, 1, 32, 50],
    };
    let batch = table.lens.len();
    let pool = |seed| {
        Tensor::<2>::from_data(
            TensorData::new(lcg(kv_heads * slots * d, seed, 1.0), [kv_heads * slots, d]),
            &device,
        )
    };
    let (keys, values) = (pool(3), pool(4));
    let q = Tensor::<4>::from_data(
        TensorData::new(lcg(batch * heads * d, 5, 1.0), [batch, heads, 1, d]),
        &device,
    );
    let scale = 0.17;
    let total = *table.lens.iter().max().unwrap();
    let index = gather_index(&table, kv_heads, slots, &device);
    let gather = |t: &Tensor<2>| {
        t.clone()
            .select(0, index.clone())
            .reshape([batch, kv_heads, total, d])
    };
    let mask: Vec<bool> = table
        .lens
        .iter()
        .flat_map(|&len| (0..total).map(move |p| p >= len))
        .collect();
    let mask = Tensor::<3, Bool>::from_data(TensorData::new(mask, [batch, 1, total]), &device);
    let (k, v) = (gather(&keys), gather(&values));
    let reference = attention_reference(q.clone(), k.clone(), v.clone(), mask.clone(), scale);
    if !applies(&device, burn::tensor::DType::F32, d) {
        // No AVX-512F here: the kernel must refuse rather than compute.
        assert!(paged_decode(q, keys, values, kv_heads, &table, scale).is_err());
        return;
    }
    let contiguous = attention(q.clone(), k, v, mask, scale).unwrap();
    let run = |table: PageTable| {
        paged_decode(
            q.clone(),
            keys.clone(),
            values.clone(),
            kv_heads,
            &table,
            scale,
        )
    };
    let got = to_vec(run(table.clone()).unwrap());
    assert_eq!(got, to_vec(contiguous), "paged vs contiguous decode");
    assert_rel_close("paged vs reference", &got, &to_vec(reference), 1e-5);

    let bad = run;
    let mut t = table.clone();
    t.lens[0] = 49; // more positions than its 3 blocks
    assert!(matches!(bad(t), Err(OpsError::LengthMismatch { .. })));
    let mut t = table.clone();
    t.blocks[1] = vec![12]; // past the pool
    assert!(matches!(bad(t), Err(OpsError::ShapeMismatch { .. })));
    let mut t = table.clone();
    t.lens.pop(); // a sequence too few for the queries
    assert!(bad(t).is_err());
    let mut t = table.clone();
    t.lens[1] = 0;
    assert!(bad(t).is_err());
    assert!(paged_decode(q, keys.clone(), values, 3, &table, scale).is_err());
}

/// A case of attention with sinks and a sliding window (GPT-OSS): causal over a cache, keys
/// older than `window` positions masked (`None`: no window), the first `pad + batch index`
/// keys padding (the first rows then see no key: every weight on the sink).
pub(crate) struct SinkCase {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub rows: usize,
    pub keys: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    pub pad: usize,
}

impl SinkCase {
    fn mask(&self) -> Vec<bool> {
        let past = self.keys - self.rows;
        let mut m = Vec::with_capacity(self.batch * self.rows * self.keys);
        for b in 0..self.batch {
            for i in 0..self.rows {
                let pos = past + i;
                for j in 0..self.keys {
                    let old = self.window.is_some_and(|w| pos >= j + w);
                    m.push(j > pos || old || j < self.pad + b);
                }
            }
        }
        m
    }
}

/// (out, dq, dk, dv, dsinks) of `Σ w ⊙ attention_with_sinks(q, k, v)` on `device`: the fused
/// op or its tensor-op reference.
pub(crate) fn run_sinks(c: &SinkCase, device: &Device, fused: bool) -> [Vec<f32>; 5] {
    let device = device.clone().autodiff();
    let make = |heads: usize, rows: usize, seed: u64| {
        let data = lcg(c.batch * heads * rows * c.head_dim, seed, 1.5);
        Tensor::<1>::from_floats(data.as_slice(), &device)
            .reshape([c.batch, heads, rows, c.head_dim])
            .require_grad()
    };
    let q = make(c.heads, c.rows, 1);
    let k = make(c.kv_heads, c.keys, 2);
    let v = make(c.kv_heads, c.keys, 3);
    let sinks = Tensor::<1>::from_floats(lcg(c.heads, 4, 2.0).as_slice(), &device).require_grad();
    let mask = Tensor::<3, Bool>::from_data(
        TensorData::new(c.mask(), [c.batch, c.rows, c.keys]),
        &device,
    );
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    let (a, b, d, s) = (q.clone(), k.clone(), v.clone(), sinks.clone());
    let out = if fused {
        attention_with_sinks(a, b, d, mask, scale, s).unwrap()
    } else {
        attention_with_sinks_reference(a, b, d, mask, scale, s)
    };
    let w = Tensor::<1>::from_floats(
        lcg(c.batch * c.heads * c.rows * c.head_dim, 9, 1.0).as_slice(),
        &device,
    )
    .reshape([c.batch, c.heads, c.rows, c.head_dim]);
    let grads = (out.clone() * w).sum().backward();
    [
        to_vec(out.detach()),
        to_vec(q.grad(&grads).unwrap()),
        to_vec(k.grad(&grads).unwrap()),
        to_vec(v.grad(&grads).unwrap()),
        to_vec(sinks.grad(&grads).unwrap()),
    ]
}

/// The sink / window cases both the flex op and the kernels are checked on: a window inside
/// a multi-block causal pass with grouped heads and padding; the window crossed by a cache
/// (rows < keys); a decode row over a windowed, left-padded cache (head dim 64: the
/// one-row path); no window (sinks only).
pub(crate) fn sink_cases() -> Vec<(&'static str, SinkCase)> {
    let case = |batch, heads, kv_heads, rows, keys, head_dim, window, pad| SinkCase {
        batch,
        heads,
        kv_heads,
        rows,
        keys,
        head_dim,
        window,
        pad,
    };
    vec![
        (
            "window 40, 150 rows, GQA 2, padded",
            case(2, 4, 2, 150, 150, 16, Some(40), 3),
        ),
        (
            "window 24 over a cache",
            case(1, 2, 1, 37, 90, 64, Some(24), 0),
        ),
        (
            "decode, windowed, padded",
            case(2, 4, 2, 1, 133, 64, Some(50), 5),
        ),
        ("sinks only, GQA 4", case(1, 4, 1, 70, 70, 32, None, 0)),
    ]
}

#[test]
fn sinks_and_sliding_window_match_their_tensor_op_form() {
    for (what, c) in sink_cases() {
        let fused = run_sinks(&c, &Device::flex(), true);
        let reference = run_sinks(&c, &Device::flex(), false);
        for (i, part) in ["out", "dq", "dk", "dv", "dsinks"].iter().enumerate() {
            assert_rel_close(&format!("{what} {part}"), &fused[i], &reference[i], 2e-5);
        }
    }
}

#[test]
fn sink_shape_is_checked() {
    let device = Device::flex();
    let q = Tensor::<4>::zeros([1, 2, 3, 4], &device);
    let kv = Tensor::<4>::zeros([1, 1, 3, 4], &device);
    let mask = Tensor::<3, Bool>::empty([1, 3, 3], &device);
    let sinks = Tensor::<1>::zeros([3], &device);
    let err = attention_with_sinks(q, kv.clone(), kv, mask, 1.0, sinks).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "attention sinks",
            ..
        }
    ));
}
