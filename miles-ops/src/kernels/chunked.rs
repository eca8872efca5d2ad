//! CubeCL kernels of the chunked gated delta rule ([`crate::ChunkedDeltaOps`]; feature `wgpu`
//! or `cuda`; tested on wgpu over lavapipe by `tests/it/delta.rs` against the flex op and
//! transformers' fixture), registered for burn's `CubeBackend`.
//!
//! The chunk-local products (`src/gated_delta_tensor.rs`: `Γ`, `T = (I + L)⁻¹`, `U`, `W`,
//! `A`, `e^γ ⊙ q`, `e^{γ_last − γ} ⊙ k`) are batched tensor ops over every (batch, head,
//! chunk) at once (burn's CubeCL matmuls), and so are the backward's products that read a
//! chunk's state and its gradient once both are known. What is sequential over the chunks
//! is one kernel launch each way instead of a set of launches per chunk:
//!
//! - `chunk_scan_forward_kernel`: one cube per (batch, head, block of value columns)
//!   (grid-stride), one unit per column `j` of the state. Every column of `S` evolves on its
//!   own through the chunks (`V = U − W S`, `O = (e^γ ⊙ q) S + A V`,
//!   `S ← e^{γ_last} S + (e^{γ_last − γ} ⊙ k)ᵀ V` read only column `j` of `S`, `U`, `V`
//!   and `O`), so the unit keeps its column (`key_dim` floats) and the chunk's column of `V`
//!   (`chunk` floats) in registers (local arrays), walks the chunks in order, writes the
//!   outputs, the final state and (for a backward) the state entering every chunk; the
//!   shared chunk matrices are read from global memory by every unit of the cube alike.
//!   The units never exchange values: no shared memory, no barrier.
//! - `chunk_scan_backward_kernel`: the same layout, last chunk first: with `dS` the
//!   gradient of the state leaving the chunk (the final state's gradient for the last),
//!   `dV = Aᵀ dO + (e^{γ_last − γ} ⊙ k) dS` (written out), then the gradient of the state
//!   entering it, `e^{γ_last} dS + (e^γ ⊙ q)ᵀ dO − Wᵀ dV` — column by column again; it
//!   writes every chunk's `dS` and the initial state's gradient. The gradients of `q`, `k`,
//!   `v`, the decays and `β` follow from `dV`, `dS` and the kept states in batched tensor
//!   ops.

#![allow(clippy::assign_op_pattern)]

use burn::backend::Shape;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::tensor::Tensor as BurnTensor;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::launch::column_geometry;
use crate::gated_delta::ChunkedDeltaOps;
use crate::gated_delta_tensor::{self as tensor_ops, Local};

#[cube(launch)]
fn chunk_scan_forward_kernel<F: Float>(
    u: &Tensor<F>,          // [bh, n, c, dv], contiguous
    w: &Tensor<F>,          // [bh, n, c, dk]
    qe: &Tensor<F>,         // [bh, n, c, dk]
    a: &Tensor<F>,          // [bh, n, c, c]
    kd: &Tensor<F>,         // [bh, n, c, dk]
    el: &Tensor<F>,         // [bh, n]
    initial: &Tensor<F>,    // [bh, dk, dv]
    out: &mut Tensor<F>,    // [bh, n, c, dv]
    last: &mut Tensor<F>,   // [bh, dk, dv]
    states: &mut Tensor<F>, // [bh, n, dk, dv] (written with `keep` only)
    chunks: u32,
    value_dim: u32,
    blocks: u32,
    #[comptime] key_dim: usize,
    #[comptime] chunk: usize,
    #[comptime] keep: bool,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = CUBE_DIM_X as usize;
    let n = chunks as usize;
    let dv = value_dim as usize;
    let nb = blocks as usize;
    let total = (last.len() / (key_dim * dv)) * nb;
    let mut s = Array::<F>::new(key_dim);
    let mut x = Array::<F>::new(chunk);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let bh = id / nb;
        let j = (id % nb) * width + tid;
        if j < dv {
            let sbase = bh * key_dim * dv + j;
            let mut p = 0usize;
            while p < key_dim {
                s[p] = initial[sbase + p * dv];
                p += 1;
            }
            let mut i = 0usize;
            while i < n {
                let ci = bh * n + i;
                if keep {
                    let kbase = ci * key_dim * dv + j;
                    let mut p1 = 0usize;
                    while p1 < key_dim {
                        states[kbase + p1 * dv] = s[p1];
                        p1 += 1;
                    }
                }
                let rows = ci * chunk;
                // V = U − W S (column j).
                let mut r = 0usize;
                while r < chunk {
                    let wb = (rows + r) * key_dim;
                    let mut acc = u[(rows + r) * dv + j];
                    let mut p2 = 0usize;
                    while p2 < key_dim {
                        acc = acc - w[wb + p2] * s[p2];
                        p2 += 1;
                    }
                    x[r] = acc;
                    r += 1;
                }
                // O = (e^γ ⊙ q) S + A V, A lower triangular.
                let mut r2 = 0usize;
                while r2 < chunk {
                    let qb = (rows + r2) * key_dim;
                    let mut o = F::new(0.0);
                    let mut p3 = 0usize;
                    while p3 < key_dim {
                        o = o + qe[qb + p3] * s[p3];
                        p3 += 1;
                    }
                    let ab = (rows + r2) * chunk;
                    let mut m = 0usize;
                    while m <= r2 {
                        o = o + a[ab + m] * x[m];
                        m += 1;
                    }
                    out[(rows + r2) * dv + j] = o;
                    r2 += 1;
                }
                // S ← e^{γ_last} S + (e^{γ_last − γ} ⊙ k)ᵀ V.
                let e = el[ci];
                let mut p4 = 0usize;
                while p4 < key_dim {
                    let mut acc = s[p4] * e;
                    let mut r3 = 0usize;
                    while r3 < chunk {
                        acc = acc + kd[(rows + r3) * key_dim + p4] * x[r3];
                        r3 += 1;
                    }
                    s[p4] = acc;
                    p4 += 1;
                }
                i += 1;
            }
            let mut p5 = 0usize;
            while p5 < key_dim {
                last[sbase + p5 * dv] = s[p5];
                p5 += 1;
            }
        }
        id += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn chunk_scan_backward_kernel<F: Float>(
    a: &Tensor<F>,             // [bh, n, c, c], contiguous
    w: &Tensor<F>,             // [bh, n, c, dk]
    qe: &Tensor<F>,            // [bh, n, c, dk]
    kd: &Tensor<F>,            // [bh, n, c, dk]
    el: &Tensor<F>,            // [bh, n]
    d_out: &Tensor<F>,         // [bh, n, c, dv]
    d_last: &Tensor<F>,        // [bh, dk, dv]
    dvn: &mut Tensor<F>,       // [bh, n, c, dv]
    d_states: &mut Tensor<F>,  // [bh, n, dk, dv]: dS of the state leaving each chunk
    d_initial: &mut Tensor<F>, // [bh, dk, dv]
    chunks: u32,
    value_dim: u32,
    blocks: u32,
    #[comptime] key_dim: usize,
    #[comptime] chunk: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = CUBE_DIM_X as usize;
    let n = chunks as usize;
    let dv = value_dim as usize;
    let nb = blocks as usize;
    let total = (d_initial.len() / (key_dim * dv)) * nb;
    let mut ds = Array::<F>::new(key_dim);
    let mut x = Array::<F>::new(chunk);
    let mut y = Array::<F>::new(chunk);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let bh = id / nb;
        let j = (id % nb) * width + tid;
        if j < dv {
            let sbase = bh * key_dim * dv + j;
            let mut p = 0usize;
            while p < key_dim {
                ds[p] = d_last[sbase + p * dv];
                p += 1;
            }
            let mut i = n;
            while i > 0 {
                i -= 1;
                let ci = bh * n + i;
                let kbase = ci * key_dim * dv + j;
                let mut p1 = 0usize;
                while p1 < key_dim {
                    d_states[kbase + p1 * dv] = ds[p1];
                    p1 += 1;
                }
                let rows = ci * chunk;
                let mut r0 = 0usize;
                while r0 < chunk {
                    y[r0] = d_out[(rows + r0) * dv + j];
                    r0 += 1;
                }
                // dV = Aᵀ dO + (e^{γ_last − γ} ⊙ k) dS, A lower triangular.
                let mut r = 0usize;
                while r < chunk {
                    let kb = (rows + r) * key_dim;
                    let mut acc = F::new(0.0);
                    let mut p2 = 0usize;
                    while p2 < key_dim {
                        acc = acc + kd[kb + p2] * ds[p2];
                        p2 += 1;
                    }
                    let mut m = r;
                    while m < chunk {
                        acc = acc + a[(rows + m) * chunk + r] * y[m];
                        m += 1;
                    }
                    x[r] = acc;
                    dvn[(rows + r) * dv + j] = acc;
                    r += 1;
                }
                // dS entering = e^{γ_last} dS + (e^γ ⊙ q)ᵀ dO − Wᵀ dV.
                let e = el[ci];
                let mut p3 = 0usize;
                while p3 < key_dim {
                    let mut acc = ds[p3] * e;
                    let mut r2 = 0usize;
                    while r2 < chunk {
                        let at = (rows + r2) * key_dim + p3;
                        acc = acc + qe[at] * y[r2] - w[at] * x[r2];
                        r2 += 1;
                    }
                    ds[p3] = acc;
                    p3 += 1;
                }
            }
            let mut p4 = 0usize;
            while p4 < key_dim {
                d_initial[sbase + p4 * dv] = ds[p4];
                p4 += 1;
            }
        }
        id += CUBE_COUNT_X as usize;
    }
}

/// The contiguous CubeCL primitive of a tensor made from CubeCL primitives.
fn prim<const D: usize>(x: BurnTensor<D>) -> CubeTensor {
    into_contiguous(
        x.try_into_primitive::<CubeBackend>()
            .unwrap_or_else(|e| unreachable!("a CubeCL op result off its backend: {e:?}")),
    )
}

/// A CubeCL primitive as a tensor.
fn wrap<const D: usize>(x: FloatTensor<CubeBackend>) -> BurnTensor<D> {
    BurnTensor::from_primitive::<CubeBackend>(x)
}

/// The forward scan (`tensor_ops::forward`'s sequential part): the padded outputs
/// `[b, h, n, c, dv]`, the final state and, with `keep`, the state entering every chunk
/// `[b, h, n, dk, dv]` (else an empty tensor).
fn scan_forward(
    lo: &Local,
    initial: BurnTensor<4>,
    keep: bool,
) -> (BurnTensor<5>, BurnTensor<4>, BurnTensor<5>) {
    let [b, h, n, c, dk] = lo.w.dims();
    let dv = lo.u.dims()[4];
    let device = lo.u.device();
    if n == 0 || b * h * dv == 0 || dk == 0 {
        // Nothing to scan (no chunk, no state column, or a state with no rows: outputs 0).
        let out = BurnTensor::zeros([b, h, n, c, dv], &device);
        let states = if keep {
            BurnTensor::zeros([b, h, n, dk, dv], &device)
        } else {
            BurnTensor::zeros([0, 0, 0, 0, 0], &device)
        };
        return (out, initial, states);
    }
    let u = prim(lo.u.clone());
    let dtype = u.dtype;
    let (client, cube_device) = (u.client.clone(), u.device.clone());
    let empty = |shape: Shape| {
        empty_device_contiguous_dtype(client.clone(), cube_device.clone(), shape, dtype)
    };
    let out = empty(Shape::from([b, h, n, c, dv]));
    let last = empty(Shape::from([b, h, dk, dv]));
    let states = empty(Shape::from(if keep {
        [b, h, n, dk, dv]
    } else {
        [1, 1, 1, 1, 1]
    }));
    let (count, dim, blocks) = column_geometry(b * h, dv);
    chunk_scan_forward_kernel::launch(
        &client,
        count,
        dim,
        u.into_tensor_arg(),
        prim(lo.w.clone()).into_tensor_arg(),
        prim(lo.qe.clone()).into_tensor_arg(),
        prim(lo.a.clone()).into_tensor_arg(),
        prim(lo.kd.clone()).into_tensor_arg(),
        prim(lo.el.clone()).into_tensor_arg(),
        prim(initial).into_tensor_arg(),
        out.clone().into_tensor_arg(),
        last.clone().into_tensor_arg(),
        states.clone().into_tensor_arg(),
        n as u32,
        dv as u32,
        blocks as u32,
        dk,
        c,
        keep,
        dtype_to_storage_type(dtype),
    );
    let states = if keep {
        wrap(states)
    } else {
        BurnTensor::zeros([0, 0, 0, 0, 0], &device)
    };
    (wrap(out), wrap(last), states)
}

/// The backward scan (`tensor_ops::backward`'s sequential part): from the padded output
/// gradient `[b, h, n, c, dv]` and the final state's gradient `[b, h, dk, dv]`, the
/// gradient of every chunk's `V` `[b, h, n, c, dv]`, of the state leaving every chunk
/// `[b, h, n, dk, dv]`, and of the initial state.
fn scan_backward(
    lo: &Local,
    d_out: BurnTensor<5>,
    d_last: BurnTensor<4>,
) -> (BurnTensor<5>, BurnTensor<5>, BurnTensor<4>) {
    let [b, h, n, c, dk] = lo.w.dims();
    let dv = lo.u.dims()[4];
    let device = lo.u.device();
    if n == 0 || b * h * dv == 0 || dk == 0 {
        return (
            BurnTensor::zeros([b, h, n, c, dv], &device),
            BurnTensor::zeros([b, h, n, dk, dv], &device),
            d_last,
        );
    }
    let d_out = prim(d_out);
    let dtype = d_out.dtype;
    let (client, cube_device) = (d_out.client.clone(), d_out.device.clone());
    let empty = |shape: Shape| {
        empty_device_contiguous_dtype(client.clone(), cube_device.clone(), shape, dtype)
    };
    let dvn = empty(Shape::from([b, h, n, c, dv]));
    let d_states = empty(Shape::from([b, h, n, dk, dv]));
    let d_initial = empty(Shape::from([b, h, dk, dv]));
    let (count, dim, blocks) = column_geometry(b * h, dv);
    chunk_scan_backward_kernel::launch(
        &client,
        count,
        dim,
        prim(lo.a.clone()).into_tensor_arg(),
        prim(lo.w.clone()).into_tensor_arg(),
        prim(lo.qe.clone()).into_tensor_arg(),
        prim(lo.kd.clone()).into_tensor_arg(),
        prim(lo.el.clone()).into_tensor_arg(),
        d_out.into_tensor_arg(),
        prim(d_last).into_tensor_arg(),
        dvn.clone().into_tensor_arg(),
        d_states.clone().into_tensor_arg(),
        d_initial.clone().into_tensor_arg(),
        n as u32,
        dv as u32,
        blocks as u32,
        dk,
        c,
        dtype_to_storage_type(dtype),
    );
    (wrap(dvn), wrap(d_states), wrap(d_initial))
}

/// The primitive of a tensor made from CubeCL primitives (no copy).
fn unwrap<const D: usize>(x: BurnTensor<D>) -> FloatTensor<CubeBackend> {
    x.try_into_primitive::<CubeBackend>()
        .unwrap_or_else(|e| unreachable!("a CubeCL op result off its backend: {e:?}"))
}

impl ChunkedDeltaOps for CubeBackend {
    fn gated_delta_chunked(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (both, _) = tensor_ops::forward(
            wrap(q),
            wrap(k),
            wrap(v),
            wrap(decay),
            wrap(beta),
            wrap(initial),
            false,
            scan_forward,
        );
        unwrap(both)
    }

    fn gated_delta_chunked_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (both, states) = tensor_ops::forward(
            wrap(q),
            wrap(k),
            wrap(v),
            wrap(decay),
            wrap(beta),
            wrap(initial),
            true,
            scan_forward,
        );
        (unwrap(both), unwrap(states))
    }

    fn gated_delta_chunked_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        states: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    ) {
        let (dq, dk, dv, dd, db, di) = tensor_ops::backward(
            wrap(q),
            wrap(k),
            wrap(v),
            wrap(decay),
            wrap(beta),
            wrap(states),
            wrap(grad),
            scan_backward,
        );
        (
            unwrap(dq),
            unwrap(dk),
            unwrap(dv),
            unwrap(dd),
            unwrap(db),
            unwrap(di),
        )
    }
}
