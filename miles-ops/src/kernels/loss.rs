//! CubeCL kernels for the fused ops (feature `wgpu` or `cuda`; tested on wgpu over lavapipe by
//! `tests/it/kernels.rs`): the per-chunk steps of the
//! fused log-prob + entropy op ([`crate::fused::FusedLogProbOps`]) and the clipped
//! policy-gradient loss ([`crate::ClippedPgLossOps`]), registered for burn's
//! `CubeBackend` (every CubeCL runtime).
//!
//! - `logit_chunk_stats_kernel`: one cube per logits row (grid-stride over rows); the units
//!   stride over the row's columns, then two shared-memory tree reductions (max, then the two
//!   sums `Σ exp(z − m)` and `Σ exp(z − m)·z`) and unit 0 folds them into the running state.
//!   No plane (warp) operations, so it also runs on CPU-side adapters.
//! - `logit_chunk_grad_kernel`, `clipped_pg_loss_kernel`, `clipped_pg_loss_backward_kernel`:
//!   elementwise, one unit per element.
//!
//! Finite sentinels only (WGSL has no `-inf` literal): the running max starts at
//! [`crate::fused::RUNNING_MAX_INIT`].

// Kernel bodies are written in the plain-assignment style CubeCL's `#[cube]` expansion is
// tested with; the compound-assignment / collapsed-if rewrites are not applied to them.
#![allow(clippy::assign_op_pattern, clippy::collapsible_if)]

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Shape, TensorMetadata};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{calculate_cube_count_elemwise, prelude::*};

use super::launch::MAX_CUBES_X;
use crate::clipped::ClippedPgLossOps;
use crate::fused::{FusedLogProbOps, forward_chunked};

#[cube(launch)]
fn logit_chunk_stats_kernel<F: Float>(
    logits: &Tensor<F>,  // [rows, cols], contiguous
    running: &Tensor<F>, // [rows, 3] (m, s, u), contiguous
    output: &mut Tensor<F>,
    rows: u32,
    cols: u32,
    block: u32,
    #[comptime] shared_len: usize,
    #[define(F)] _dtype: ElemType,
) {
    let tid = UNIT_POS_X as usize;
    let width = block as usize;
    let n_rows = rows as usize;
    let n_cols = cols as usize;
    // `shared_len` = 2·block: [0, block) max, then Σ exp(z − m); [block, 2·block) Σ exp(z − m)·z.
    let mut shared = Shared::<[F]>::new_slice(shared_len);
    let mut row = CUBE_POS_X as usize;
    while row < n_rows {
        let base = row * n_cols;
        let m_old = running[row * 3];
        // Row max, starting from the running max.
        let mut local = m_old;
        let mut j = tid;
        while j < n_cols {
            let z = logits[base + j];
            if z > local {
                local = z;
            }
            j += width;
        }
        shared[tid] = local;
        sync_cube();
        let mut stride = width / 2;
        while stride > 0 {
            if tid < stride {
                let other = shared[tid + stride];
                if other > shared[tid] {
                    shared[tid] = other;
                }
            }
            sync_cube();
            stride = stride / 2;
        }
        let m_new = shared[0];
        sync_cube();
        // Σ exp(z − m_new) and Σ exp(z − m_new)·z.
        let mut s = F::new(0.0);
        let mut u = F::new(0.0);
        let mut k = tid;
        while k < n_cols {
            let z = logits[base + k];
            let e = (z - m_new).exp();
            s = s + e;
            u = u + e * z;
            k += width;
        }
        shared[tid] = s;
        shared[width + tid] = u;
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
        if tid == 0 {
            let scale = (m_old - m_new).exp();
            output[row * 3] = m_new;
            output[row * 3 + 1] = running[row * 3 + 1] * scale + shared[0];
            output[row * 3 + 2] = running[row * 3 + 2] * scale + shared[width];
        }
        sync_cube();
        row += CUBE_COUNT_X as usize;
    }
}

#[cube(launch)]
fn logit_chunk_grad_kernel<F: Float>(
    logits: &Tensor<F>,    // [rows, cols], contiguous
    row_stats: &Tensor<F>, // [rows, 4] (lse, E, g_lp, g_H), contiguous
    output: &mut Tensor<F>,
    cols: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= output.len() {
        terminate!();
    }
    let row = pos / (cols as usize);
    let z = logits[pos];
    let lse = row_stats[row * 4];
    let expected = row_stats[row * 4 + 1];
    let g_lp = row_stats[row * 4 + 2];
    let g_h = row_stats[row * 4 + 3];
    let p = (z - lse).exp();
    output[pos] = F::new(0.0) - p * (g_lp + g_h * (z - expected));
}

#[cube(launch)]
fn clipped_pg_loss_kernel<F: Float>(
    ppo_kl: &Tensor<F>,
    advantages: &Tensor<F>,
    losses: &mut Tensor<F>,
    clipfrac: &mut Tensor<F>,
    low: f32,
    high: f32,
    dual_c: f32,
    dual: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= losses.len() {
        terminate!();
    }
    let a = advantages[pos];
    let ratio = (F::new(0.0) - ppo_kl[pos]).exp();
    let mut clamped = ratio;
    if clamped < F::cast_from(low) {
        clamped = F::cast_from(low);
    }
    if clamped > F::cast_from(high) {
        clamped = F::cast_from(high);
    }
    let l1 = F::new(0.0) - ratio * a;
    let l2 = F::new(0.0) - clamped * a;
    let mut loss = l1;
    let mut clip = F::new(0.0);
    if l1 < l2 {
        loss = l2;
        clip = F::new(1.0);
    }
    if dual == 1 {
        if a < F::new(0.0) {
            let l3 = F::new(0.0) - F::cast_from(dual_c) * a;
            if l3 < loss {
                loss = l3;
            }
        }
    }
    losses[pos] = loss;
    clipfrac[pos] = clip;
}

#[cube(launch)]
fn clipped_pg_loss_backward_kernel<F: Float>(
    ppo_kl: &Tensor<F>,
    advantages: &Tensor<F>,
    grad: &Tensor<F>,
    d_kl: &mut Tensor<F>,
    d_adv: &mut Tensor<F>,
    low: f32,
    high: f32,
    dual_c: f32,
    dual: u32,
    #[define(F)] _dtype: ElemType,
) {
    let pos = ABSOLUTE_POS;
    if pos >= d_kl.len() {
        terminate!();
    }
    let a = advantages[pos];
    let g = grad[pos];
    let ratio = (F::new(0.0) - ppo_kl[pos]).exp();
    let mut clamped = ratio;
    if clamped < F::cast_from(low) {
        clamped = F::cast_from(low);
    }
    if clamped > F::cast_from(high) {
        clamped = F::cast_from(high);
    }
    let l1 = F::new(0.0) - ratio * a;
    let l2 = F::new(0.0) - clamped * a;
    let mut loss = l1;
    let mut dk = a * ratio;
    let mut da = F::new(0.0) - ratio;
    if l1 < l2 {
        loss = l2;
        dk = F::new(0.0);
        da = F::new(0.0) - clamped;
    }
    if dual == 1 {
        if a < F::new(0.0) {
            let l3 = F::new(0.0) - F::cast_from(dual_c) * a;
            if l3 < loss {
                dk = F::new(0.0);
                da = F::new(0.0) - F::cast_from(dual_c);
            }
        }
    }
    d_kl[pos] = g * dk;
    d_adv[pos] = g * da;
}

fn empty_like(t: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(t.client.clone(), t.device.clone(), shape, t.dtype)
}

/// Largest power of two ≤ `min(256, max units per cube along x)`.
fn block_size(t: &CubeTensor) -> u32 {
    let max = t.client.properties().hardware.max_cube_dim.0.clamp(1, 256);
    1 << (31 - max.leading_zeros())
}

fn elementwise_launch(t: &CubeTensor, n: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, n);
    (calculate_cube_count_elemwise(&t.client, n, dim), dim)
}

impl FusedLogProbOps for CubeBackend {
    fn fused_log_prob_entropy(
        hidden: FloatTensor<Self>,
        lm_head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        token_chunk: usize,
        vocab_chunk: usize,
        _keep_logits: bool,
    ) -> FloatTensor<Self> {
        forward_chunked::<Self>(hidden, lm_head, targets, token_chunk, vocab_chunk).output
    }

    fn logit_chunk_stats(
        logits: FloatTensor<Self>,
        running: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let logits = into_contiguous(logits);
        let running = into_contiguous(running);
        let [rows, cols] = [logits.shape()[0], logits.shape()[1]];
        let output = empty_like(&running, Shape::from([rows, 3]));
        if rows == 0 {
            return output;
        }
        let block = block_size(&logits);
        let dtype = logits.dtype;
        logit_chunk_stats_kernel::launch(
            &logits.client.clone(),
            CubeCount::Static(rows.min(MAX_CUBES_X) as u32, 1, 1),
            CubeDim::new_1d(block),
            logits.into_tensor_arg(),
            running.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            rows as u32,
            cols as u32,
            block,
            2 * block as usize,
            dtype_to_storage_type(dtype),
        );
        output
    }

    fn logit_chunk_grad(
        logits: FloatTensor<Self>,
        row_stats: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let logits = into_contiguous(logits);
        let row_stats = into_contiguous(row_stats);
        let shape = logits.shape();
        let cols = shape[1];
        let n = shape.num_elements();
        let output = empty_like(&logits, shape);
        if n == 0 {
            return output;
        }
        let (count, dim) = elementwise_launch(&logits, n);
        let dtype = logits.dtype;
        logit_chunk_grad_kernel::launch(
            &logits.client.clone(),
            count,
            dim,
            logits.into_tensor_arg(),
            row_stats.into_tensor_arg(),
            output.clone().into_tensor_arg(),
            cols as u32,
            dtype_to_storage_type(dtype),
        );
        output
    }
}

impl ClippedPgLossOps for CubeBackend {
    fn clipped_pg_loss(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let ppo_kl = into_contiguous(ppo_kl);
        let advantages = into_contiguous(advantages);
        let shape = ppo_kl.shape();
        let n = shape.num_elements();
        let losses = empty_like(&ppo_kl, shape.clone());
        let clipfrac = empty_like(&ppo_kl, shape);
        if n == 0 {
            return (losses, clipfrac);
        }
        let (count, dim) = elementwise_launch(&ppo_kl, n);
        let dtype = ppo_kl.dtype;
        clipped_pg_loss_kernel::launch(
            &ppo_kl.client.clone(),
            count,
            dim,
            ppo_kl.into_tensor_arg(),
            advantages.into_tensor_arg(),
            losses.clone().into_tensor_arg(),
            clipfrac.clone().into_tensor_arg(),
            1.0 - eps_clip,
            1.0 + eps_clip_high,
            eps_clip_c.unwrap_or(0.0),
            u32::from(eps_clip_c.is_some()),
            dtype_to_storage_type(dtype),
        );
        (losses, clipfrac)
    }

    fn clipped_pg_loss_backward(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let ppo_kl = into_contiguous(ppo_kl);
        let advantages = into_contiguous(advantages);
        let grad = into_contiguous(grad);
        let shape = ppo_kl.shape();
        let n = shape.num_elements();
        let d_kl = empty_like(&ppo_kl, shape.clone());
        let d_adv = empty_like(&ppo_kl, shape);
        if n == 0 {
            return (d_kl, d_adv);
        }
        let (count, dim) = elementwise_launch(&ppo_kl, n);
        let dtype = ppo_kl.dtype;
        clipped_pg_loss_backward_kernel::launch(
            &ppo_kl.client.clone(),
            count,
            dim,
            ppo_kl.into_tensor_arg(),
            advantages.into_tensor_arg(),
            grad.into_tensor_arg(),
            d_kl.clone().into_tensor_arg(),
            d_adv.clone().into_tensor_arg(),
            1.0 - eps_clip,
            1.0 + eps_clip_high,
            eps_clip_c.unwrap_or(0.0),
            u32::from(eps_clip_c.is_some()),
            dtype_to_storage_type(dtype),
        );
        (d_kl, d_adv)
    }
}
