//! CubeCL kernels of the fused model ops (feature `wgpu` or `cuda`; tested on wgpu over
//! lavapipe by `tests/it/kernels_model.rs` against the flex ops): RMSNorm and RoPE
//! ([`crate::NormRopeOps`]), SwiGLU ([`crate::SwiGluOps`]) and the grouped
//! expert matmul ([`crate::GroupedMatmulOps`]), registered for burn's `CubeBackend`.
//!
//! - `rms_norm_kernel` / `rms_norm_backward_kernel`: one cube per row (grid-stride over rows),
//!   the units stride over the row and a shared-memory tree reduction gives `Σ x²` (and
//!   `Σ ∂y·w·x` backward). The weight gradient `Σ_rows ∂y·x·r` is summed in two passes
//!   (`rms_norm_dw_partial_kernel` over chunks of [`DW_ROWS`] rows, then
//!   `rms_norm_dw_final_kernel` over the chunks), so a small `d` (a per-head q/k norm) still
//!   fills the device.
//! - `rope_kernel`, `swiglu_kernel`, `swiglu_backward_kernel`: element-wise, one unit per
//!   element.
//! - `grouped_matmul_kernel` (forward and `∂x`) and `grouped_matmul_dw_kernel`: one unit per
//!   output element, the group of a row found from the groups' row offsets (built from host
//!   sizes, [`GroupedMatmulOps`], or given as a device tensor, [`GroupedOffsetsOps`]).
//! - `expert_count_kernel`, `expert_scan_kernel`, `expert_place_kernel`: the expert bucketing
//!   of [`ExpertBucketOps`] (one unit per expert counting, one unit scanning the counts, one
//!   unit per expert writing its slots in pair order).
//!
//! No plane (warp) operations, so they also run on CPU-side adapters.

#![allow(clippy::assign_op_pattern, clippy::collapsible_if)]

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{DType, Shape, TensorMetadata};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::launch::MAX_CUBES_X;
use crate::bucket::ExpertBucketOps;
use crate::grouped::{GroupedMatmulOps, GroupedOffsetsOps};
use crate::norm::NormRopeOps;
use crate::swiglu::SwiGluOps;

/// Rows per partial sum of the RMSNorm weight gradient.
const DW_ROWS: usize = 256;

#[cube(launch)]
fn rms_norm_kernel<F: Float>(
    x: &Tensor<F>, // [rows, cols], contiguous
    w: &Tensor<F>, // [cols]
    output: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    block: u32,
    eps: f32,
    #[comptime] shared_len: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let n_rows = rows as usize;
    let n_cols = cols as usize;
    let mut shared = Shared::<[F]>::new_slice(shared_len);
    let mut row = CUBE_POS_X as usize;
    while row < n_rows {
        let base = row * n_cols;
        let mut ss = F::new(0.0);
        let mut j = tid;
        while j < n_cols {
            let v = x[base + j];
            ss = ss + v * v;
            j += width;
        }
        shared[tid] = ss;
        sync_cube();
        let mut half = width / 2;
        while half > 0 {
            if tid < half {
                shared[tid] = shared[tid] + shared[tid + half];
            }
            sync_cube();
            half = half / 2;
        }
        let r = F::new(1.0) / (shared[0] / F::cast_from(cols) + F::cast_from(eps)).sqrt();
        sync_cube();
        let mut k = tid;
        while k < n_cols {
            output[base + k] = x[base + k] * r * w[k];
            k += width;
        }
        row += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn rms_norm_backward_kernel<F: Float>(
    x: &Tensor<F>,    // [rows, cols], contiguous
    w: &Tensor<F>,    // [cols]
    grad: &Tensor<F>, // [rows, cols], contiguous
    dx: &mut Tensor<F>,
    inv_rms: &mut Tensor<F>, // [rows]
    rows: u32,
    cols: u32,
    block: u32,
    eps: f32,
    #[comptime] shared_len: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let n_rows = rows as usize;
    let n_cols = cols as usize;
    // [0, block): Σ x²; [block, 2·block): Σ ∂y·w·x.
    let mut shared = Shared::<[F]>::new_slice(shared_len);
    let mut row = CUBE_POS_X as usize;
    while row < n_rows {
        let base = row * n_cols;
        let mut ss = F::new(0.0);
        let mut gx = F::new(0.0);
        let mut j = tid;
        while j < n_cols {
            let v = x[base + j];
            ss = ss + v * v;
            gx = gx + grad[base + j] * w[j] * v;
            j += width;
        }
        shared[tid] = ss;
        shared[width + tid] = gx;
        sync_cube();
        let mut half = width / 2;
        while half > 0 {
            if tid < half {
                shared[tid] = shared[tid] + shared[tid + half];
                shared[width + tid] = shared[width + tid] + shared[width + tid + half];
            }
            sync_cube();
            half = half / 2;
        }
        let d = F::cast_from(cols);
        let r = F::new(1.0) / (shared[0] / d + F::cast_from(eps)).sqrt();
        let kf = r * r * r * shared[width] / d;
        sync_cube();
        if tid == 0 {
            inv_rms[row] = r;
        }
        let mut k = tid;
        while k < n_cols {
            dx[base + k] = r * grad[base + k] * w[k] - x[base + k] * kf;
            k += width;
        }
        row += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn rms_norm_dw_partial_kernel<F: Float>(
    x: &Tensor<F>,           // [rows, cols], contiguous
    grad: &Tensor<F>,        // [rows, cols], contiguous
    inv_rms: &Tensor<F>,     // [rows]
    partial: &mut Tensor<F>, // [parts, cols]
    rows: u32,
    cols: u32,
    chunk: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= partial.len() {
        terminate!();
    }
    let n_cols = cols as usize;
    let part = pos / n_cols;
    let col = pos % n_cols;
    let start = part * (chunk as usize);
    let mut end = start + chunk as usize;
    if end > rows as usize {
        end = rows as usize;
    }
    let mut acc = F::new(0.0);
    let mut r = start;
    while r < end {
        acc = acc + grad[r * n_cols + col] * x[r * n_cols + col] * inv_rms[r];
        r += 1;
    }
    partial[pos] = acc;
}

#[cube(launch)]
fn rms_norm_dw_final_kernel<F: Float>(
    partial: &Tensor<F>, // [parts, cols]
    dw: &mut Tensor<F>,  // [cols]
    parts: u32,
    #[define(F)] _dtype: ElemType,
) {
    let col = ABSOLUTE_POS;
    if col >= dw.len() {
        terminate!();
    }
    let n_cols = dw.len();
    let mut acc = F::new(0.0);
    let mut p = 0usize;
    while p < parts as usize {
        acc = acc + partial[p * n_cols + col];
        p += 1;
    }
    dw[col] = acc;
}

#[cube(launch)]
fn rope_kernel<F: Float>(
    x: &Tensor<F>,   // [b, h, s, d], contiguous
    cos: &Tensor<F>, // [b, s, rot], contiguous
    sin: &Tensor<F>,
    output: &mut Tensor<F>,
    heads: u32,
    seq: u32,
    head_dim: u32,
    rot: u32,
    transpose: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= output.len() {
        terminate!();
    }
    let d = head_dim as usize;
    let s = seq as usize;
    let n_rot = rot as usize;
    let half = n_rot / 2;
    let j = pos % d;
    let bhp = pos / d;
    let p = bhp % s;
    let bi = bhp / s / (heads as usize);
    let row = pos - j;
    let table = (bi * s + p) * n_rot;
    if j >= n_rot {
        output[pos] = x[pos];
    } else if j < half {
        let a = x[row + j];
        let b = x[row + j + half];
        if transpose == 1 {
            output[pos] = a * cos[table + j] + b * sin[table + j + half];
        } else {
            output[pos] = a * cos[table + j] - b * sin[table + j];
        }
    } else {
        let a = x[row + j - half];
        let b = x[row + j];
        if transpose == 1 {
            output[pos] = b * cos[table + j] - a * sin[table + j - half];
        } else {
            output[pos] = b * cos[table + j] + a * sin[table + j];
        }
    }
}

/// `σ(x)` from `exp(−|x|)` (no overflow for large `|x|`).
#[cube]
fn sigmoid<F: Float>(x: F) -> F {
    let e = (F::new(0.0) - x.abs()).exp();
    let r = F::new(1.0) / (F::new(1.0) + e);
    let mut s = r;
    if x < F::new(0.0) {
        s = e * r;
    }
    s
}

#[cube(launch)]
fn swiglu_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    output: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= output.len() {
        terminate!();
    }
    let g = gate[pos];
    output[pos] = g * sigmoid::<F>(g) * up[pos];
}

#[cube(launch)]
fn swiglu_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    grad: &Tensor<F>,
    d_gate: &mut Tensor<F>,
    d_up: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= d_gate.len() {
        terminate!();
    }
    let g = gate[pos];
    let dy = grad[pos];
    let s = sigmoid::<F>(g);
    d_up[pos] = dy * g * s;
    d_gate[pos] = dy * up[pos] * s * (F::new(1.0) + g * (F::new(1.0) - s));
}

/// The group of `row`: the last `e` with `offsets[e] ≤ row` (binary search over the
/// `experts + 1` ascending offsets).
#[cube]
fn group_of(offsets: &Tensor<u32>, experts: u32, row: u32) -> u32 {
    let mut lo = 0u32;
    let mut hi = experts;
    // Invariant: offsets[lo] ≤ row < offsets[hi].
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if offsets[mid as usize] <= row {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// `y[r, o] = Σ_k x[r, k] · w[e(r), o, k]` (forward, `w_t = 0`), or
/// `y[r, o] = Σ_k x[r, k] · w[e(r), k, o]` (`∂x = ∂y · w_e`, or a packed `[in, w_ld]`
/// expert, `w_t = 1`). Rows at or past `offsets[experts]` belong to no group and are zero
/// (the slots of invalid expert ids in a device bucketing).
#[cube(launch)]
fn grouped_matmul_kernel<F: Float>(
    x: &Tensor<F>,          // [rows, inner], contiguous
    w: &Tensor<F>,          // [experts, ·, ·], contiguous
    offsets: &Tensor<u32>,  // [experts + 1]
    output: &mut Tensor<F>, // [rows, cols]
    experts: u32,
    inner: u32,
    cols: u32,
    w_t: u32,
    w_ld: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= output.len() {
        terminate!();
    }
    let n_inner = inner as usize;
    let n_cols = cols as usize;
    let r = pos / n_cols;
    let o = pos % n_cols;
    let mut acc = F::new(0.0);
    if (r as u32) < offsets[experts as usize] {
        let e = group_of(offsets, experts, r as u32) as usize;
        let mut k = 0usize;
        if w_t == 0 {
            // w_e is [cols, inner].
            let wbase = e * n_inner * n_cols;
            while k < n_inner {
                acc = acc + x[r * n_inner + k] * w[wbase + o * n_inner + k];
                k += 1;
            }
        } else {
            // w_e is [inner, w_ld], the first `cols` columns used.
            let ld = w_ld as usize;
            let wbase = e * n_inner * ld;
            while k < n_inner {
                acc = acc + x[r * n_inner + k] * w[wbase + k * ld + o];
                k += 1;
            }
        }
    }
    output[pos] = acc;
}

/// `∂w[e, o, k] = Σ_{r ∈ group e} ∂y[r, o] · x[r, k]` (group rows clamped to `x`'s rows).
#[cube(launch)]
fn grouped_matmul_dw_kernel<F: Float>(
    x: &Tensor<F>,         // [rows, k], contiguous
    grad: &Tensor<F>,      // [rows, m], contiguous
    offsets: &Tensor<u32>, // [experts + 1]
    dw: &mut Tensor<F>,    // [experts, m, k]
    m: u32,
    k: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= dw.len() {
        terminate!();
    }
    let n_m = m as usize;
    let n_k = k as usize;
    let rows = x.len() / n_k;
    let kk = pos % n_k;
    let o = (pos / n_k) % n_m;
    let e = pos / (n_k * n_m);
    let mut acc = F::new(0.0);
    let mut r = offsets[e] as usize;
    let mut end = offsets[e + 1] as usize;
    if end > rows {
        end = rows;
    }
    while r < end {
        acc = acc + grad[r * n_m + o] * x[r * n_k + kk];
        r += 1;
    }
    dw[pos] = acc;
}

/// Whether `id` is an expert index in `0..experts`.
#[cube]
fn valid_expert<I: Int>(id: I, experts: u32) -> bool {
    let mut valid = false;
    if id >= I::from_int(0) {
        if id < I::cast_from(experts) {
            valid = true;
        }
    }
    valid
}

/// Expert bucketing, pass 1: unit `e < experts` counts the pairs routed to expert `e` into
/// `offsets[e + 1]`; unit `experts` counts the ids outside `0..experts` into `invalid[0]`.
#[cube(launch)]
fn expert_count_kernel<I: Int>(
    ids: &Tensor<I>,         // [pairs], contiguous
    offsets: &mut Tensor<I>, // [experts + 1]
    invalid: &mut Tensor<I>, // [1]
    experts: u32,
    #[define(I)] _dtype: ElemType,
) {
    let unit = ABSOLUTE_POS;
    let n_experts = experts as usize;
    if unit > n_experts {
        terminate!();
    }
    let pairs = ids.len();
    let mut n = 0u32;
    let mut p = 0usize;
    while p < pairs {
        let id = ids[p];
        let valid = valid_expert::<I>(id, experts);
        if unit == n_experts {
            if !valid {
                n += 1;
            }
        } else if valid {
            if id == I::cast_from(unit) {
                n += 1;
            }
        }
        p += 1;
    }
    if unit == n_experts {
        invalid[0] = I::cast_from(n);
    } else {
        offsets[unit + 1] = I::cast_from(n);
    }
}

/// Expert bucketing, pass 2 (one unit): `offsets[0] = 0` and the counts turned into their
/// running sums, so group `e` holds slots `offsets[e]..offsets[e + 1]`.
#[cube(launch)]
fn expert_scan_kernel<I: Int>(offsets: &mut Tensor<I>, #[define(I)] _dtype: ElemType) {
    if ABSOLUTE_POS > 0 {
        terminate!();
    }
    offsets[0] = I::from_int(0);
    let mut e = 1usize;
    while e < offsets.len() {
        offsets[e] = offsets[e] + offsets[e - 1];
        e += 1;
    }
}

/// Expert bucketing, pass 3: unit `e < experts` walks the pairs in order and gives those
/// routed to `e` the slots `offsets[e]..` (stable); unit `experts` gives the invalid pairs the
/// slots from `offsets[experts]` on. Each placed pair `p` (= `t · top_k + j`) writes
/// `pair_of_slot[s] = p`, `token_of_slot[s] = t` and `slot_of_pair[p] = s`.
#[cube(launch)]
fn expert_place_kernel<I: Int>(
    ids: &Tensor<I>,               // [pairs], contiguous
    offsets: &Tensor<I>,           // [experts + 1]
    pair_of_slot: &mut Tensor<I>,  // [pairs]
    token_of_slot: &mut Tensor<I>, // [pairs]
    slot_of_pair: &mut Tensor<I>,  // [pairs]
    experts: u32,
    top_k: u32,
    #[define(I)] _dtype: ElemType,
) {
    let unit = ABSOLUTE_POS;
    let n_experts = experts as usize;
    if unit > n_experts {
        terminate!();
    }
    let pairs = ids.len();
    let k = top_k as usize;
    let mut slot = usize::cast_from(offsets[unit]);
    let mut p = 0usize;
    while p < pairs {
        let id = ids[p];
        let valid = valid_expert::<I>(id, experts);
        let mut mine = false;
        if unit == n_experts {
            mine = !valid;
        } else if valid {
            mine = id == I::cast_from(unit);
        }
        if mine {
            if slot < pairs {
                pair_of_slot[slot] = I::cast_from(p);
                token_of_slot[slot] = I::cast_from(p / k);
                slot_of_pair[p] = I::cast_from(slot);
            }
            slot += 1;
        }
        p += 1;
    }
}

fn empty_like(t: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, t.dtype)
}

/// Largest power of two ≤ `min(256, max units per cube along x)`.
pub(crate) fn block_size(t: &CubeTensor) -> u32 {
    let max = t.client.properties().hardware.max_cube_dim.0.clamp(1, 256);
    1 << (31 - max.leading_zeros())
}

pub(crate) fn elementwise_launch(t: &CubeTensor, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, n);
    (calculate_cube_count_elemwise(&t.client, n, dim), dim)
}

/// `(rows, cols)` of a tensor viewed as rows of its last dimension.
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let n = shape.num_elements();
    let cols = shape
        .num_dims()
        .checked_sub(1)
        .map_or(1, |last| shape[last]);
    (n.checked_div(cols).unwrap_or(0), cols)
}

fn rope_launch(x: CubeTensor, cos: CubeTensor, sin: CubeTensor, transpose: bool) -> CubeTensor {
    let x = into_contiguous(x);
    let cos = into_contiguous(cos);
    let sin = into_contiguous(sin);
    let shape = x.shape();
    let n = shape.num_elements();
    let output = empty_like(&x, shape.clone());
    if n == 0 {
        return output;
    }
    let rot = cos.shape()[2];
    let (count, dim) = elementwise_launch(&x, n);
    let dtype = x.dtype;
    rope_kernel::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        output.clone().into_tensor_arg(),
        shape[1] as u32,
        shape[2] as u32,
        shape[3] as u32,
        rot as u32,
        u32::from(transpose),
        dtype_to_storage_type(dtype),
    );
    output
}

impl NormRopeOps for CubeBackend {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let x = into_contiguous(x);
        let weight = into_contiguous(weight);
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let output = empty_like(&x, shape);
        if rows == 0 {
            return output;
        }
        let block = block_size(&x);
        let dtype = x.dtype;
        rms_norm_kernel::launch(
            &x.client.clone(),
            CubeCount::Static(rows.min(MAX_CUBES_X) as u32, 1, 1),
            CubeDim::new_1d(block),
            x.into_tensor_arg(),
            weight.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            block,
            eps,
            block as usize,
            dtype_to_storage_type(dtype),
        );
        output
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = into_contiguous(x);
        let weight = into_contiguous(weight);
        let grad = into_contiguous(grad);
        let shape = x.shape();
        let (rows, cols) = rows_cols(&shape);
        let dx = empty_like(&x, shape);
        let dw = empty_like(&weight, Shape::from([cols]));
        if cols == 0 {
            return (dx, dw);
        }
        if rows == 0 {
            let zeros = burn_cubecl::ops::numeric::zeros_client(
                x.client.clone(),
                x.device.clone(),
                Shape::from([cols]),
                x.dtype,
            );
            return (dx, zeros);
        }
        let client = x.client.clone();
        let dtype = x.dtype;
        let inv_rms = empty_like(&x, Shape::from([rows]));
        let block = block_size(&x);
        rms_norm_backward_kernel::launch(
            &client,
            CubeCount::Static(rows.min(MAX_CUBES_X) as u32, 1, 1),
            CubeDim::new_1d(block),
            x.clone().into_tensor_arg(),
            weight.into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            inv_rms.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            block,
            eps,
            2 * block as usize,
            dtype_to_storage_type(dtype),
        );
        let parts = rows.div_ceil(DW_ROWS);
        let partial = empty_like(&x, Shape::from([parts, cols]));
        let (count, dim) = elementwise_launch(&x, parts * cols);
        rms_norm_dw_partial_kernel::launch(
            &client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            inv_rms.into_tensor_arg(),
            partial.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            DW_ROWS as u32,
            dtype_to_storage_type(dtype),
        );
        let (count, dim) = elementwise_launch(&x, cols);
        rms_norm_dw_final_kernel::launch(
            &client,
            count,
            dim,
            partial.into_tensor_arg(),
            dw.clone().into_tensor_arg(),
            parts as u32,
            dtype_to_storage_type(dtype),
        );
        (dx, dw)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope_launch(x, cos, sin, false)
    }

    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope_launch(grad, cos, sin, true)
    }
}

impl SwiGluOps for CubeBackend {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let gate = into_contiguous(gate);
        let up = into_contiguous(up);
        let shape = gate.shape();
        let n = shape.num_elements();
        let output = empty_like(&gate, shape);
        if n == 0 {
            return output;
        }
        let (count, dim) = elementwise_launch(&gate, n);
        let dtype = gate.dtype;
        swiglu_kernel::launch(
            &gate.client.clone(),
            count,
            dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            dtype_to_storage_type(dtype),
        );
        output
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let gate = into_contiguous(gate);
        let up = into_contiguous(up);
        let grad = into_contiguous(grad);
        let shape = gate.shape();
        let n = shape.num_elements();
        let d_gate = empty_like(&gate, shape.clone());
        let d_up = empty_like(&gate, shape);
        if n == 0 {
            return (d_gate, d_up);
        }
        let (count, dim) = elementwise_launch(&gate, n);
        let dtype = gate.dtype;
        swiglu_backward_kernel::launch(
            &gate.client.clone(),
            count,
            dim,
            gate.into_tensor_arg(),
            up.into_tensor_arg(),
            grad.into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            dtype_to_storage_type(dtype),
        );
        (d_gate, d_up)
    }
}

/// The groups' row offsets `[experts + 1]` as a `u32` tensor on `like`'s device.
fn offsets_tensor(like: &CubeTensor, sizes: &[usize]) -> CubeTensor {
    let mut offsets = Vec::with_capacity(sizes.len() + 1);
    let mut at = 0u32;
    offsets.push(at);
    for &n in sizes {
        at += n as u32;
        offsets.push(at);
    }
    let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_ne_bytes()).collect();
    let handle = like.client.create_from_slice(&bytes);
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::from([offsets.len()]),
        handle,
        DType::U32,
    )
}

/// `y_e = x_e · w_eᵀ` (`w_t = false`) or `x_e · w_e` (`w_t = true`) for the row groups.
fn grouped_launch(x: CubeTensor, w: CubeTensor, offsets: &CubeTensor, w_t: bool) -> CubeTensor {
    let cols = if w_t { w.shape()[2] } else { w.shape()[1] };
    grouped_launch_cols(x, w, offsets, w_t, cols)
}

/// [`grouped_launch`] with `cols` output columns (fewer than a packed `[in, stride]`
/// expert's `stride` when `w_t`).
fn grouped_launch_cols(
    x: CubeTensor,
    w: CubeTensor,
    offsets: &CubeTensor,
    w_t: bool,
    cols: usize,
) -> CubeTensor {
    let x = into_contiguous(x);
    let w = into_contiguous(w);
    let rows = x.shape()[0];
    let inner = x.shape()[1];
    let [experts, w_ld] = [w.shape()[0], w.shape()[2]];
    let output = empty_like(&x, Shape::from([rows, cols]));
    let n = rows * cols;
    if n == 0 {
        return output;
    }
    let (count, dim) = elementwise_launch(&x, n);
    let dtype = x.dtype;
    grouped_matmul_kernel::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_tensor_arg(),
        w.into_tensor_arg(),
        offsets.clone().into_tensor_arg(),
        output.clone().into_tensor_arg(),
        experts as u32,
        inner as u32,
        cols as u32,
        u32::from(w_t),
        w_ld as u32,
        dtype_to_storage_type(dtype),
    );
    output
}

impl GroupedMatmulOps for CubeBackend {
    fn grouped_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> FloatTensor<Self> {
        let offsets = offsets_tensor(&x, &sizes);
        grouped_launch(x, w, &offsets, false)
    }

    fn grouped_matmul_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let offsets = offsets_tensor(&x, &sizes);
        grouped_backward(x, w, grad, offsets)
    }
}

/// `(∂x, ∂w)` of the grouped matmul over `u32` row offsets.
fn grouped_backward(
    x: CubeTensor,
    w: CubeTensor,
    grad: CubeTensor,
    offsets: CubeTensor,
) -> (CubeTensor, CubeTensor) {
    let x = into_contiguous(x);
    let grad = into_contiguous(grad);
    let w_shape = w.shape();
    let dx = grouped_launch(grad.clone(), w, &offsets, true);
    let dw = empty_like(&x, w_shape.clone());
    let n = w_shape.num_elements();
    if n == 0 {
        return (dx, dw);
    }
    let (count, dim) = elementwise_launch(&x, n);
    let dtype = x.dtype;
    grouped_matmul_dw_kernel::launch(
        &x.client.clone(),
        count,
        dim,
        x.into_tensor_arg(),
        grad.into_tensor_arg(),
        offsets.into_tensor_arg(),
        dw.clone().into_tensor_arg(),
        w_shape[1] as u32,
        w_shape[2] as u32,
        dtype_to_storage_type(dtype),
    );
    (dx, dw)
}

/// Device offsets (any int dtype) as the `u32` the grouped kernels read.
fn offsets_u32(offsets: CubeTensor) -> CubeTensor {
    let offsets = into_contiguous(offsets);
    if offsets.dtype == DType::U32 {
        offsets
    } else {
        burn_cubecl::kernel::cast(offsets, DType::U32)
    }
}

impl GroupedOffsetsOps for CubeBackend {
    fn grouped_matmul_offsets(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        grouped_launch(x, w, &offsets_u32(offsets), false)
    }

    fn grouped_matmul_offsets_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        grouped_backward(x, w, grad, offsets_u32(offsets))
    }

    fn grouped_matmul_offsets_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
        out: usize,
    ) -> FloatTensor<Self> {
        grouped_launch_cols(x, w, &offsets_u32(offsets), true, out)
    }
}

impl ExpertBucketOps for CubeBackend {
    fn bucket_by_expert(
        ids: IntTensor<Self>,
        experts: usize,
        top_k: usize,
    ) -> (
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
    ) {
        let ids = into_contiguous(ids);
        let pairs = ids.shape().num_elements();
        let offsets = empty_like(&ids, Shape::from([experts + 1]));
        let invalid = empty_like(&ids, Shape::from([1]));
        let pair_of_slot = empty_like(&ids, Shape::from([pairs]));
        let token_of_slot = empty_like(&ids, Shape::from([pairs]));
        let slot_of_pair = empty_like(&ids, Shape::from([pairs]));
        let client = ids.client.clone();
        let dtype = dtype_to_storage_type(ids.dtype);
        let (count, dim) = elementwise_launch(&ids, experts + 1);
        expert_count_kernel::launch(
            &client,
            count.clone(),
            dim,
            ids.clone().into_tensor_arg(),
            offsets.clone().into_tensor_arg(),
            invalid.clone().into_tensor_arg(),
            experts as u32,
            dtype,
        );
        expert_scan_kernel::launch(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(1),
            offsets.clone().into_tensor_arg(),
            dtype,
        );
        if pairs > 0 {
            expert_place_kernel::launch(
                &client,
                count,
                dim,
                ids.into_tensor_arg(),
                offsets.clone().into_tensor_arg(),
                pair_of_slot.clone().into_tensor_arg(),
                token_of_slot.clone().into_tensor_arg(),
                slot_of_pair.clone().into_tensor_arg(),
                experts as u32,
                top_k as u32,
                dtype,
            );
        }
        (offsets, pair_of_slot, token_of_slot, slot_of_pair, invalid)
    }
}
