//! CubeCL kernel of the gated delta rule's forward ([`crate::GatedDeltaOps`]; feature `wgpu`
//! or `cuda`; tested on wgpu over lavapipe by `tests/it/delta.rs` against the flex
//! op), registered for burn's `CubeBackend`.
//!
//! The chunked op ([`crate::ChunkedDeltaOps`], training and prefill) has its own kernels
//! (`src/kernels/chunked.rs`).
//!
//! `gated_delta_kernel`: one cube per (batch, head, block of value columns) (grid-stride),
//! one unit per column of the state: the column's `key_dim` entries live in the unit's
//! registers (a local array), and every column evolves on its own, so the units never
//! exchange values. Per token the cube loads the token's query and key into shared memory
//! (`2·key_dim` floats), then each unit decays its column, computes `u = kᵀS`,
//! `δ = β (v − u)`, `S += k δ` and its output `qᵀS`. Tokens are walked in order: the
//! parallelism is batch × heads × value columns.

#![allow(clippy::assign_op_pattern)]

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Shape, TensorMetadata};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use cubecl::prelude::*;

use super::launch::column_geometry;
use crate::gated_delta::GatedDeltaOps;

#[cube(launch)]
fn gated_delta_kernel<F: Float>(
    q: &Tensor<F>,         // [b, h, t, dk], contiguous
    k: &Tensor<F>,         // [b, h, t, dk], contiguous
    v: &Tensor<F>,         // [b, h, t, dv], contiguous
    decay: &Tensor<F>,     // [b, h, t]
    beta: &Tensor<F>,      // [b, h, t]
    initial: &Tensor<F>,   // [b, h, dk, dv]
    out: &mut Tensor<F>,   // [b, h, t, dv]
    state: &mut Tensor<F>, // [b, h, dk, dv]
    tokens: u32,
    value_dim: u32,
    blocks: u32,
    #[comptime] key_dim: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = CUBE_DIM_X as usize;
    let t = tokens as usize;
    let dv = value_dim as usize;
    let nb = blocks as usize;
    let total = (state.len() / (key_dim * dv)) * nb;
    let mut q_sh = Shared::<[F]>::new_slice(key_dim);
    let mut k_sh = Shared::<[F]>::new_slice(key_dim);
    let mut s = Array::<F>::new(key_dim);
    let mut id = CUBE_POS_X as usize;
    while id < total {
        let bh = id / nb;
        let j = (id % nb) * width + tid;
        let active = j < dv;
        let sbase = bh * key_dim * dv;
        let mut a = 0usize;
        while a < key_dim {
            let mut x = F::new(0.0);
            if active {
                x = initial[sbase + a * dv + j];
            }
            s[a] = x;
            a += 1;
        }
        let mut i = 0usize;
        while i < t {
            let at = bh * t + i;
            let mut c = tid;
            while c < key_dim {
                q_sh[c] = q[at * key_dim + c];
                k_sh[c] = k[at * key_dim + c];
                c += width;
            }
            sync_cube();
            if active {
                let g = decay[at].exp();
                let mut u = F::new(0.0);
                let mut a2 = 0usize;
                while a2 < key_dim {
                    let x = s[a2] * g;
                    s[a2] = x;
                    u = u + k_sh[a2] * x;
                    a2 += 1;
                }
                let dl = beta[at] * (v[at * dv + j] - u);
                let mut o = F::new(0.0);
                let mut a3 = 0usize;
                while a3 < key_dim {
                    let x = s[a3] + k_sh[a3] * dl;
                    s[a3] = x;
                    o = o + q_sh[a3] * x;
                    a3 += 1;
                }
                out[at * dv + j] = o;
            }
            sync_cube();
            i += 1;
        }
        if active {
            let mut a4 = 0usize;
            while a4 < key_dim {
                state[sbase + a4 * dv + j] = s[a4];
                a4 += 1;
            }
        }
        id += CUBE_COUNT_X as usize;
    }
}

impl GatedDeltaOps for CubeBackend {
    fn gated_delta_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (into_contiguous(q), into_contiguous(k), into_contiguous(v));
        let (decay, beta) = (into_contiguous(decay), into_contiguous(beta));
        let (qs, vs) = (q.shape(), v.shape());
        let (b, h, t, dk, dv) = (qs[0], qs[1], qs[2], qs[3], vs[3]);
        let dtype = q.dtype;
        let (client, device) = (q.client.clone(), q.device.clone());
        let out_shape = Shape::from([b, h, t, dv]);
        let state_shape = Shape::from([b, h, dk, dv]);
        if b * h * dv == 0 || dk == 0 {
            // No state column, or a state with no rows (outputs 0): nothing to run.
            let out = zeros_client(client.clone(), device.clone(), out_shape, dtype);
            return (out, initial);
        }
        let out = empty_device_contiguous_dtype(client.clone(), device.clone(), out_shape, dtype);
        let state = empty_device_contiguous_dtype(client.clone(), device, state_shape, dtype);
        let initial = into_contiguous(initial);
        let (cubes, dim, blocks) = column_geometry(b * h, dv);
        gated_delta_kernel::launch(
            &client,
            cubes,
            dim,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            decay.into_tensor_arg(),
            beta.into_tensor_arg(),
            initial.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            state.clone().into_tensor_arg(),
            t as u32,
            dv as u32,
            blocks as u32,
            dk,
            dtype_to_storage_type(dtype),
        );
        (out, state)
    }
}
