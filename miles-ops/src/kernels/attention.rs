//! CubeCL kernels of the fused masked attention ([`crate::FusedAttentionOps`];
//! feature `wgpu` or `cuda`; tested on wgpu over lavapipe by `tests/it/kernels_attention.rs`
//! against the flex op), registered for burn's `CubeBackend`. Semantics are those of the flex
//! op: `softmax(mask_fill(q·kᵀ·scale, mask, −1e30))·v` with grouped key/value heads, a fully
//! masked row attending uniformly to every key. With sinks (GPT-OSS), the forward adds
//! `exp(sinks[h])` to each row's denominator after its last key tile (a fully masked row puts
//! every weight on the sink: zero output, `lse = sinks[h]`); the backward kernels run on the
//! sinked log-sum-exp unchanged (a fully masked row then reaches no key: its uniform weight is
//! 0) and `∂sinks[h] = −Σ exp(sinks[h] − lse)·δ` is reduced from the saved `δ`. A sliding
//! window comes through the mask: the key tiles before a row's first unmasked key are skipped.
//!
//! - `mask_bounds_kernel`: per (batch, query row), the first unmasked key and one past the
//!   last (`0, 0` for a fully masked row), so the passes below skip the key tiles outside
//!   them: a causal mask halves the work, a packed (block-diagonal) mask leaves only the
//!   row's own sequence.
//! - `attention_forward_kernel`: flash-style, one cube per (batch, head, query row)
//!   (grid-stride); the units take one key each per tile (score = `q·k` over the head dim),
//!   two shared-memory tree reductions give the tile's max and `Σ exp`, the running max / sum
//!   are rescaled (online softmax) and each unit accumulates its own output channels. Saves
//!   the row's log-sum-exp for backward. The same kernel is the decode step over the KV
//!   cache (one query row per sequence, all cached keys).
//! - `attention_backward_dq_kernel`: per query row, `δ = Σ ∂O ⊙ O` (saved for the next
//!   kernel), then over the key tiles `P = exp(s − lse)`, `∂S = P ⊙ (∂O·vᵀ − δ)`,
//!   `∂q = scale·∂S·k`.
//! - `attention_backward_dkv_kernel`: one cube per (batch, key/value head, key); over the
//!   query rows of every query head of the group that see the key (a causal mask: rows at
//!   or after it), `∂v += P·∂O`, `∂k += scale·∂S·q` — no atomics, each cube owns its key.
//!
//! Shared memory per cube: `2·head_dim + 2·block` floats forward, `3·head_dim + 2·block`
//! for `∂q`, `4·head_dim + 2·block` floats and `2·block` `u32` for `∂k / ∂v`: at most 4 KiB
//! for head dim 128 and a block of 128 (the block is capped at 128 units), well within
//! WebGPU's 16 KiB. No plane (warp) operations.

#![allow(
    clippy::assign_op_pattern,
    clippy::collapsible_if,
    clippy::collapsible_else_if
)]

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::{BoolTensorOps, FloatTensorOps};
use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{DType, IntDType, Shape, TensorMetadata};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::launch::cubes_x;
use super::model::{block_size, elementwise_launch};
use crate::attention::FusedAttentionOps;

/// Most units per cube (keys per tile).
const MAX_BLOCK: u32 = 128;

/// Below every score the passes see (finite: WGSL has no `-inf` literal).
const LOWEST: f32 = -3.0e38;

/// The masked score, as [`crate::MASKED_SCORE`].
const MASKED: f32 = -1.0e30;

#[cube(launch)]
fn mask_bounds_kernel(
    mask: &Tensor<u32>,       // [b, s, t], contiguous (non-zero = masked)
    bounds: &mut Tensor<u32>, // [b·s, 2]: first unmasked key, one past the last
    keys: u32,
) {
    let row = ABSOLUTE_POS;
    if row * 2 >= bounds.len() {
        terminate!();
    }
    let t = keys as usize;
    let base = row * t;
    let mut first = 0u32;
    let mut limit = 0u32;
    let mut found = 0u32;
    let mut j = 0usize;
    while j < t {
        if mask[base + j] == 0 {
            if found == 0 {
                first = j as u32;
                found = 1;
            }
            limit = j as u32 + 1;
        }
        j += 1;
    }
    bounds[row * 2] = first;
    bounds[row * 2 + 1] = limit;
}

#[cube(launch)]
fn attention_forward_kernel<F: Float>(
    q: &Tensor<F>,        // [b, h, s, d], contiguous
    k: &Tensor<F>,        // [b, hk, t, d], contiguous
    v: &Tensor<F>,        // [b, hk, t, d], contiguous
    mask: &Tensor<u32>,   // [b, s, t], contiguous
    bounds: &Tensor<u32>, // [b·s, 2]
    sinks: &Tensor<F>,    // [h] (read only with `has_sinks`)
    out: &mut Tensor<F>,  // [b, h, s, d]
    lse: &mut Tensor<F>,  // [b, h, s]
    heads: u32,
    kv_heads: u32,
    rows: u32,
    keys: u32,
    scale: f32,
    block: u32,
    #[comptime] head_dim: usize,
    #[comptime] block_len: usize,
    #[comptime] has_sinks: bool,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let d = head_dim;
    let s = rows as usize;
    let t = keys as usize;
    let n_heads = heads as usize;
    let group = n_heads / (kv_heads as usize);
    let total = lse.len();
    let mut q_sh = Shared::<[F]>::new_slice(head_dim);
    let mut acc = Shared::<[F]>::new_slice(head_dim);
    let mut p_sh = Shared::<[F]>::new_slice(block_len);
    let mut red = Shared::<[F]>::new_slice(block_len);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let r = id % s;
        let bh = id / s;
        let h = bh % n_heads;
        let bi = bh / n_heads;
        let kv = bi * (kv_heads as usize) + h / group;
        let qbase = id * d;
        let mut c = tid;
        while c < d {
            q_sh[c] = q[qbase + c] * F::cast_from(scale);
            acc[c] = F::new(0.0);
            c += width;
        }
        let brow = bi * s + r;
        let mut first = bounds[brow * 2] as usize;
        let mut limit = bounds[brow * 2 + 1] as usize;
        if limit == 0 {
            if !has_sinks {
                // Every key masked: all scores are the masked score, uniform weights.
                first = 0usize;
                limit = t;
            }
        }
        sync_cube();
        let mut m = F::new(LOWEST);
        let mut l = F::new(0.0);
        let mut j0 = first;
        while j0 < limit {
            let j = j0 + tid;
            let mut sc = F::new(LOWEST);
            if j < limit {
                let kb = (kv * t + j) * d;
                let mut dot = F::new(0.0);
                let mut cc = 0usize;
                while cc < d {
                    dot = dot + q_sh[cc] * k[kb + cc];
                    cc += 1;
                }
                sc = dot;
                if mask[brow * t + j] != 0 {
                    sc = F::new(MASKED);
                }
            }
            red[tid] = sc;
            sync_cube();
            let mut half = width / 2;
            while half > 0 {
                if tid < half {
                    let other = red[tid + half];
                    if other > red[tid] {
                        red[tid] = other;
                    }
                }
                sync_cube();
                half = half / 2;
            }
            let mut m_new = m;
            if red[0] > m_new {
                m_new = red[0];
            }
            sync_cube();
            let mut p = F::new(0.0);
            if j < limit {
                p = (sc - m_new).exp();
            }
            p_sh[tid] = p;
            red[tid] = p;
            sync_cube();
            let mut half2 = width / 2;
            while half2 > 0 {
                if tid < half2 {
                    red[tid] = red[tid] + red[tid + half2];
                }
                sync_cube();
                half2 = half2 / 2;
            }
            let corr = (m - m_new).exp();
            l = l * corr + red[0];
            let mut n = limit - j0;
            if n > width {
                n = width;
            }
            let mut c2 = tid;
            while c2 < d {
                let mut a = acc[c2] * corr;
                let mut jj = 0usize;
                while jj < n {
                    a = a + p_sh[jj] * v[(kv * t + j0 + jj) * d + c2];
                    jj += 1;
                }
                acc[c2] = a;
                c2 += width;
            }
            m = m_new;
            sync_cube();
            j0 += width;
        }
        // The sink joins the denominator only (a fully masked row: every weight its own).
        let mut corr_sink = F::new(1.0);
        if has_sinks {
            let sink = sinks[h];
            let mut m_new = m;
            if sink > m_new {
                m_new = sink;
            }
            corr_sink = (m - m_new).exp();
            l = l * corr_sink + (sink - m_new).exp();
            m = m_new;
        }
        let mut c3 = tid;
        while c3 < d {
            out[qbase + c3] = acc[c3] * corr_sink / l;
            c3 += width;
        }
        if tid == 0 {
            lse[id] = m + l.ln();
        }
        sync_cube();
        id += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn attention_backward_dq_kernel<F: Float>(
    q: &Tensor<F>,         // [b, h, s, d], contiguous
    k: &Tensor<F>,         // [b, hk, t, d], contiguous
    v: &Tensor<F>,         // [b, hk, t, d], contiguous
    mask: &Tensor<u32>,    // [b, s, t], contiguous
    bounds: &Tensor<u32>,  // [b·s, 2]
    out: &Tensor<F>,       // [b, h, s, d]
    lse: &Tensor<F>,       // [b, h, s]
    grad: &Tensor<F>,      // [b, h, s, d]
    dq: &mut Tensor<F>,    // [b, h, s, d]
    delta: &mut Tensor<F>, // [b, h, s]
    heads: u32,
    kv_heads: u32,
    rows: u32,
    keys: u32,
    scale: f32,
    block: u32,
    #[comptime] head_dim: usize,
    #[comptime] block_len: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let d = head_dim;
    let s = rows as usize;
    let t = keys as usize;
    let n_heads = heads as usize;
    let group = n_heads / (kv_heads as usize);
    let total = lse.len();
    let mut q_sh = Shared::<[F]>::new_slice(head_dim);
    let mut do_sh = Shared::<[F]>::new_slice(head_dim);
    let mut acc = Shared::<[F]>::new_slice(head_dim);
    let mut ds_sh = Shared::<[F]>::new_slice(block_len);
    let mut red = Shared::<[F]>::new_slice(block_len);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let r = id % s;
        let bh = id / s;
        let h = bh % n_heads;
        let bi = bh / n_heads;
        let kv = bi * (kv_heads as usize) + h / group;
        let qbase = id * d;
        let mut part = F::new(0.0);
        let mut c = tid;
        while c < d {
            let g = grad[qbase + c];
            q_sh[c] = q[qbase + c] * F::cast_from(scale);
            do_sh[c] = g;
            acc[c] = F::new(0.0);
            part = part + g * out[qbase + c];
            c += width;
        }
        red[tid] = part;
        sync_cube();
        let mut half2 = width / 2;
        while half2 > 0 {
            if tid < half2 {
                red[tid] = red[tid] + red[tid + half2];
            }
            sync_cube();
            half2 = half2 / 2;
        }
        let dl = red[0];
        let row_lse = lse[id];
        if tid == 0 {
            delta[id] = dl;
        }
        let brow = bi * s + r;
        let first = bounds[brow * 2] as usize;
        // A fully masked row (limit 0) reaches v only: no key tile.
        let limit = bounds[brow * 2 + 1] as usize;
        sync_cube();
        let mut j0 = first;
        while j0 < limit {
            let j = j0 + tid;
            let mut ds = F::new(0.0);
            if j < limit {
                if mask[brow * t + j] == 0 {
                    let kb = (kv * t + j) * d;
                    let mut dot = F::new(0.0);
                    let mut dp = F::new(0.0);
                    let mut cc = 0usize;
                    while cc < d {
                        dot = dot + q_sh[cc] * k[kb + cc];
                        dp = dp + do_sh[cc] * v[kb + cc];
                        cc += 1;
                    }
                    let p = (dot - row_lse).exp();
                    ds = p * (dp - dl);
                }
            }
            ds_sh[tid] = ds;
            sync_cube();
            let mut n = limit - j0;
            if n > width {
                n = width;
            }
            let mut c2 = tid;
            while c2 < d {
                let mut a = acc[c2];
                let mut jj = 0usize;
                while jj < n {
                    a = a + ds_sh[jj] * k[(kv * t + j0 + jj) * d + c2];
                    jj += 1;
                }
                acc[c2] = a;
                c2 += width;
            }
            sync_cube();
            j0 += width;
        }
        let mut c3 = tid;
        while c3 < d {
            dq[qbase + c3] = acc[c3] * F::cast_from(scale);
            c3 += width;
        }
        sync_cube();
        id += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn attention_backward_dkv_kernel<F: Float>(
    q: &Tensor<F>,        // [b, h, s, d], contiguous
    k: &Tensor<F>,        // [b, hk, t, d], contiguous
    v: &Tensor<F>,        // [b, hk, t, d], contiguous
    mask: &Tensor<u32>,   // [b, s, t], contiguous
    bounds: &Tensor<u32>, // [b·s, 2]
    lse: &Tensor<F>,      // [b, h, s]
    delta: &Tensor<F>,    // [b, h, s]
    grad: &Tensor<F>,     // [b, h, s, d]
    dk: &mut Tensor<F>,   // [b, hk, t, d]
    dv: &mut Tensor<F>,   // [b, hk, t, d]
    heads: u32,
    kv_heads: u32,
    rows: u32,
    keys: u32,
    scale: f32,
    block: u32,
    uniform_weight: f32,
    #[comptime] head_dim: usize,
    #[comptime] block_len: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let d = head_dim;
    let s = rows as usize;
    let t = keys as usize;
    let n_heads = heads as usize;
    let n_kv = kv_heads as usize;
    let group = n_heads / n_kv;
    let total = dk.len() / d;
    let mut k_sh = Shared::<[F]>::new_slice(head_dim);
    let mut v_sh = Shared::<[F]>::new_slice(head_dim);
    let mut dk_acc = Shared::<[F]>::new_slice(head_dim);
    let mut dv_acc = Shared::<[F]>::new_slice(head_dim);
    let mut p_sh = Shared::<[F]>::new_slice(block_len);
    let mut ds_sh = Shared::<[F]>::new_slice(block_len);
    let mut lo_sh = Shared::<[u32]>::new_slice(block_len);
    let mut hi_sh = Shared::<[u32]>::new_slice(block_len);
    // A fully masked row's weight on every key (0 with sinks: all on the sink).
    let uniform = F::cast_from(uniform_weight);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let j = id % t;
        let kvh = id / t; // bi · hk + head
        let bi = kvh / n_kv;
        let kbase = id * d;
        let mut c = tid;
        while c < d {
            k_sh[c] = k[kbase + c];
            v_sh[c] = v[kbase + c];
            dk_acc[c] = F::new(0.0);
            dv_acc[c] = F::new(0.0);
            c += width;
        }
        // The rows that reach this key: it is unmasked for them, or they are fully masked.
        let mut lo = rows;
        let mut hi = 0u32;
        let mut rr = tid;
        while rr < s {
            let brow = bi * s + rr;
            let mut sees = mask[brow * t + j] == 0;
            if bounds[brow * 2 + 1] == 0 {
                sees = true;
            }
            if sees {
                if (rr as u32) < lo {
                    lo = rr as u32;
                }
                hi = rr as u32 + 1;
            }
            rr += width;
        }
        lo_sh[tid] = lo;
        hi_sh[tid] = hi;
        sync_cube();
        let mut half = width / 2;
        while half > 0 {
            if tid < half {
                if lo_sh[tid + half] < lo_sh[tid] {
                    lo_sh[tid] = lo_sh[tid + half];
                }
                if hi_sh[tid + half] > hi_sh[tid] {
                    hi_sh[tid] = hi_sh[tid + half];
                }
            }
            sync_cube();
            half = half / 2;
        }
        let r_lo = lo_sh[0] as usize;
        let r_hi = hi_sh[0] as usize;
        sync_cube();
        let mut g = 0usize;
        while g < group {
            let bh = bi * n_heads + (kvh % n_kv) * group + g;
            let mut r0 = r_lo;
            while r0 < r_hi {
                let r = r0 + tid;
                let mut p = F::new(0.0);
                let mut ds = F::new(0.0);
                if r < r_hi {
                    let brow = bi * s + r;
                    let row = bh * s + r;
                    if bounds[brow * 2 + 1] == 0 {
                        p = uniform;
                    } else if mask[brow * t + j] == 0 {
                        let qb = row * d;
                        let mut dot = F::new(0.0);
                        let mut dp = F::new(0.0);
                        let mut cc = 0usize;
                        while cc < d {
                            dot = dot + q[qb + cc] * F::cast_from(scale) * k_sh[cc];
                            dp = dp + grad[qb + cc] * v_sh[cc];
                            cc += 1;
                        }
                        p = (dot - lse[row]).exp();
                        ds = p * (dp - delta[row]);
                    }
                }
                p_sh[tid] = p;
                ds_sh[tid] = ds;
                sync_cube();
                let mut n = r_hi - r0;
                if n > width {
                    n = width;
                }
                let mut c2 = tid;
                while c2 < d {
                    let mut a_k = dk_acc[c2];
                    let mut a_v = dv_acc[c2];
                    let mut i = 0usize;
                    while i < n {
                        let qb = (bh * s + r0 + i) * d + c2;
                        a_k = a_k + ds_sh[i] * q[qb];
                        a_v = a_v + p_sh[i] * grad[qb];
                        i += 1;
                    }
                    dk_acc[c2] = a_k;
                    dv_acc[c2] = a_v;
                    c2 += width;
                }
                sync_cube();
                r0 += width;
            }
            g += 1;
        }
        let mut c3 = tid;
        while c3 < d {
            dk[kbase + c3] = dk_acc[c3] * F::cast_from(scale);
            dv[kbase + c3] = dv_acc[c3];
            c3 += width;
        }
        sync_cube();
        id += CUBE_COUNT_X as usize;
    }
}

fn empty(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// Sizes of one call: `(b, h, hk, s, t, d)`.
fn sizes(q: &CubeTensor, k: &CubeTensor) -> [usize; 6] {
    let (qs, ks) = (q.shape(), k.shape());
    [qs[0], qs[1], ks[1], qs[2], ks[2], qs[3]]
}

/// The mask as contiguous `u32` and its per-row `(first, limit)` bounds.
fn mask_and_bounds(mask: BoolTensor<CubeBackend>, keys: usize) -> (CubeTensor, CubeTensor) {
    let mask = into_contiguous(<CubeBackend as BoolTensorOps<CubeBackend>>::bool_into_int(
        mask,
        IntDType::U32,
    ));
    let rows = mask.shape().num_elements() / keys.max(1);
    let bounds = empty(&mask, Shape::from([rows, 2]), DType::U32);
    if rows > 0 {
        let (count, dim) = elementwise_launch(&mask, rows);
        mask_bounds_kernel::launch(
            &mask.client.clone(),
            count,
            dim,
            mask.clone().into_tensor_arg(),
            bounds.clone().into_tensor_arg(),
            keys as u32,
        );
    }
    (mask, bounds)
}

fn attention_block(t: &CubeTensor) -> u32 {
    block_size(t).min(MAX_BLOCK)
}

/// `∂sinks[h] = −Σ_{batch, rows} exp(sinks[h] − lse)·δ` (`lse`, `δ`: `[b, h, s]`).
fn sink_grad(sinks: CubeTensor, lse: CubeTensor, delta: CubeTensor) -> CubeTensor {
    type B = CubeBackend;
    let shape = lse.shape();
    let heads = shape[1];
    let sinks = B::float_expand(B::float_reshape(sinks, Shape::from([1, heads, 1])), shape);
    let weighted = B::float_mul(B::float_exp(B::float_sub(sinks, lse)), delta);
    let per_head = B::float_sum_dim(B::float_sum_dim(weighted, 2), 0);
    B::float_neg(B::float_reshape(per_head, Shape::from([heads])))
}

impl FusedAttentionOps for CubeBackend {
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        Self::fused_attention_forward(q, k, v, mask, sinks, scale).0
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let [b, h, hk, s, t, d] = sizes(&q, &k);
        let dtype = q.dtype;
        let rows = b * h * s;
        // `[0]`: no sinks.
        let sinks = (sinks.shape().num_elements() > 0).then_some(sinks);
        if rows == 0 || d == 0 || t == 0 {
            // Nothing to attend to: zeros, and the log-sum-exp of an empty sum (the sink's
            // own with sinks).
            let out = zeros_client(q.client.clone(), q.device.clone(), q.shape(), dtype);
            let lse = match sinks {
                Some(sinks) if rows > 0 => Self::float_expand(
                    Self::float_reshape(sinks, Shape::from([1, h, 1])),
                    Shape::from([b, h, s]),
                ),
                _ => zeros_client(
                    q.client.clone(),
                    q.device.clone(),
                    Shape::from([b, h, s]),
                    dtype,
                ),
            };
            return (out, lse);
        }
        let (mask, bounds) = mask_and_bounds(mask, t);
        let out = empty(&q, q.shape(), dtype);
        let lse = empty(&q, Shape::from([b, h, s]), dtype);
        let block = attention_block(&q);
        let has_sinks = sinks.is_some();
        // Without sinks the kernel never reads the argument: any float tensor does.
        let sinks = sinks.map_or_else(|| q.clone(), into_contiguous);
        attention_forward_kernel::launch(
            &q.client.clone(),
            cubes_x(rows),
            CubeDim::new_1d(block),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            mask.into_tensor_arg(),
            bounds.into_tensor_arg(),
            sinks.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            h as u32,
            hk as u32,
            s as u32,
            t as u32,
            scale,
            block,
            d,
            block as usize,
            has_sinks,
            dtype_to_storage_type(dtype),
        );
        (out, lse)
    }

    fn fused_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let (out, lse, grad) = (
            into_contiguous(out),
            into_contiguous(lse),
            into_contiguous(grad),
        );
        let [b, h, hk, s, t, d] = sizes(&q, &k);
        let dtype = q.dtype;
        let client = q.client.clone();
        let no_sinks = sinks.shape().num_elements() == 0;
        let zeros = |shape: Shape| zeros_client(client.clone(), q.device.clone(), shape, dtype);
        if b * h * s == 0 || t == 0 || d == 0 {
            // No key reaches the output: every gradient is zero (the sinks' too, as the
            // output is zero whatever they are).
            let ds = if no_sinks {
                sinks
            } else {
                zeros(Shape::from([h]))
            };
            return (zeros(q.shape()), zeros(k.shape()), zeros(v.shape()), ds);
        }
        let (mask, bounds) = mask_and_bounds(mask, t);
        let dq = empty(&q, q.shape(), dtype);
        let delta = empty(&q, Shape::from([b, h, s]), dtype);
        let dk = empty(&q, k.shape(), dtype);
        let dv = empty(&q, v.shape(), dtype);
        let block = attention_block(&q);
        let uniform = if no_sinks { 1.0 / t as f32 } else { 0.0 };
        attention_backward_dq_kernel::launch(
            &client,
            cubes_x(b * h * s),
            CubeDim::new_1d(block),
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            mask.clone().into_tensor_arg(),
            bounds.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            dq.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            h as u32,
            hk as u32,
            s as u32,
            t as u32,
            scale,
            block,
            d,
            block as usize,
            dtype_to_storage_type(dtype),
        );
        attention_backward_dkv_kernel::launch(
            &client,
            cubes_x(b * hk * t),
            CubeDim::new_1d(block),
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            mask.into_tensor_arg(),
            bounds.into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            delta.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            dk.clone().into_tensor_arg(),
            dv.clone().into_tensor_arg(),
            h as u32,
            hk as u32,
            s as u32,
            t as u32,
            scale,
            block,
            uniform,
            d,
            block as usize,
            dtype_to_storage_type(dtype),
        );
        let ds = if no_sinks {
            sinks
        } else {
            sink_grad(into_contiguous(sinks), lse, delta)
        };
        (dq, dk, dv, ds)
    }
}
