//! The gated delta rule (Qwen3.5's Gated DeltaNet linear attention) over whole sequences:
//! [`gated_delta_rule`] (the op), [`gated_delta_rule_reference`] (the chunked form in tensor
//! ops, differentiable) and [`gated_delta_rule_recurrent`] (token by token in tensor ops).
//!
//! Per (batch, head) the state `S` (`[key_dim, value_dim]`) follows, for each token `t` with
//! query `q_t`, key `k_t` (`[key_dim]`), value `v_t` (`[value_dim]`), log-space decay `g_t`
//! and write strength `β_t`: `S ← e^{g_t} S;  S ← S + k_t (β_t (v_t − k_tᵀS))ᵀ`, and the
//! output is `o_t = q_tᵀS`. Every column of `S` evolves on its own (the update of column `j`
//! reads only column `j`), which the native loop and the kernel parallelise over.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{Bool, Tensor, TensorData};

use crate::flex;
use crate::flex::tensor::{as_f32, takes_fused};
use crate::{OpsError, Result};

/// The longest chunk of the chunked form (transformers' `chunk_size`); shorter sequences use
/// the next power of two at or above their length.
pub const DELTA_CHUNK: usize = flex::chunked::DELTA_CHUNK;

fn mismatch(what: &'static str, expected: Vec<usize>, got: [usize; 4]) -> OpsError {
    OpsError::ShapeMismatch {
        what,
        expected,
        got: got.to_vec(),
    }
}

fn check(
    q: [usize; 4],
    k: [usize; 4],
    v: [usize; 4],
    decay: [usize; 3],
    beta: [usize; 3],
    initial: Option<[usize; 4]>,
) -> Result<()> {
    let [b, hk, t, dk] = q;
    let [_, h, _, dv] = v;
    if k != q {
        return Err(mismatch("delta rule keys", q.to_vec(), k));
    }
    if v[0] != b || v[2] != t || hk == 0 || h % hk != 0 {
        return Err(mismatch("delta rule values", vec![b, hk, t, dv], v));
    }
    for (what, x) in [("delta rule decay", decay), ("delta rule beta", beta)] {
        if x != [b, h, t] {
            return Err(OpsError::ShapeMismatch {
                what,
                expected: vec![b, h, t],
                got: x.to_vec(),
            });
        }
    }
    if let Some(s) = initial
        && s != [b, h, dk, dv]
    {
        return Err(mismatch("delta rule state", vec![b, h, dk, dv], s));
    }
    Ok(())
}

/// Queries or keys `[b, key_heads, t, d]` repeated to `heads` (each key head serving
/// `heads / key_heads` consecutive heads), as the model's `repeat_interleave`.
fn spread(x: Tensor<4>, heads: usize) -> Tensor<4> {
    let [b, hk, t, d] = x.dims();
    if hk == heads {
        return x;
    }
    x.unsqueeze_dim::<5>(2)
        .expand([b, hk, heads / hk, t, d])
        .reshape([b, heads, t, d])
}

/// The gated delta rule over whole sequences, token by token (the recurrent form: decode
/// steps): `q`, `k` `[batch, key_heads, tokens, key_dim]`, `v` `[batch, heads, tokens,
/// value_dim]`, `decay` (log space, `g ≤ 0`) and `beta` `[batch, heads, tokens]`, from
/// `initial` (`[batch, heads, key_dim, value_dim]`, zeros when `None`); `heads` a multiple
/// of `key_heads`, each key head serving `heads / key_heads` consecutive heads (Qwen3.5's
/// `linear_num_key_heads` / `linear_num_value_heads`). Returns the outputs `[batch, heads,
/// tokens, value_dim]` and the state after the last token. Errors on inconsistent shapes.
///
/// When no input takes part in an autodiff graph (decode) and the inputs are `f32` on flex
/// or a CubeCL device, it runs forward-only as one backend op ([`GatedDeltaOps`]): on flex a
/// native loop, one rayon task per (batch, head, block of value columns), each column of the
/// state kept in a local buffer and updated token by token (the recurrent form,
/// 4·key_dim multiply-adds per column and token); on CubeCL devices one kernel
/// (`src/kernels/delta.rs`: one unit per state column, its `key_dim` entries in registers,
/// the token's query and key shared by the cube). Under autodiff with a tracked input
/// (training) it is [`gated_delta_rule_chunked`], the chunked form with its backward.
pub fn gated_delta_rule(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
) -> Result<(Tensor<4>, Tensor<4>)> {
    check(
        q.dims(),
        k.dims(),
        v.dims(),
        decay.dims(),
        beta.dims(),
        initial.as_ref().map(Tensor::dims),
    )?;
    let tracked = [&q, &k, &v].iter().any(|t| t.is_tracked())
        || decay.is_tracked()
        || beta.is_tracked()
        || initial.as_ref().is_some_and(Tensor::is_tracked);
    if tracked {
        return gated_delta_rule_chunked(q, k, v, decay, beta, initial);
    }
    let mut dtypes = vec![q.dtype(), k.dtype(), v.dtype(), decay.dtype(), beta.dtype()];
    dtypes.extend(initial.as_ref().map(Tensor::dtype));
    let heads = v.dims()[1];
    let (q, k) = (spread(q, heads), spread(k, heads));
    if !takes_fused(&dtypes, &q.device()) {
        return Ok(gated_delta_rule_reference(q, k, v, decay, beta, initial));
    }
    let [b, h, _, dk] = q.dims();
    let initial = initial.unwrap_or_else(|| Tensor::zeros([b, h, dk, v.dims()[3]], &q.device()));
    let (out, state) = <Dispatch as GatedDeltaOps>::gated_delta_forward(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        decay.into_dispatch(),
        beta.into_dispatch(),
        initial.into_dispatch(),
    );
    Ok((Tensor::from_dispatch(out), Tensor::from_dispatch(state)))
}

/// The gated delta rule in the chunked form (training, scoring, prefill), forward and
/// backward: same arguments, shapes and results as [`gated_delta_rule`] (key heads may serve
/// groups of heads). The sequence is cut into chunks of [`DELTA_CHUNK`] tokens (the last one
/// ragged); within a chunk the delta-rule updates are one unit-lower-triangular system,
/// solved once, and the chunks are scanned in order (transformers'
/// `torch_chunk_gated_delta_rule`, see `src/flex/chunked.rs` for the products).
///
/// On flex (`f32`) it is one backend op ([`ChunkedDeltaOps`]): a native loop per
/// (batch, head) in parallel, every product a `gemm` call; under autodiff a custom
/// backward (keeping only the state entering each chunk, the chunk-local products
/// recomputed) gives the gradients of `q`, `k`, `v`, `decay`, `beta` and `initial`. The
/// outputs do not depend on whether a gradient is tracked, nor on the other rows of the
/// batch, so training, scoring, prefill and a recomputed layer compute the same bits.
/// On CubeCL devices (`f32`) the same op and backward: the chunk-local products as batched
/// tensor ops, the scan over the chunks one fused kernel each way (`src/kernels/chunked.rs`).
/// Elsewhere (other devices or dtypes) it is [`gated_delta_rule_reference`] (the same
/// computation in differentiable tensor ops, chunks padded to a power of two). Errors on
/// inconsistent shapes.
pub fn gated_delta_rule_chunked(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
) -> Result<(Tensor<4>, Tensor<4>)> {
    check(
        q.dims(),
        k.dims(),
        v.dims(),
        decay.dims(),
        beta.dims(),
        initial.as_ref().map(Tensor::dims),
    )?;
    let mut dtypes = vec![q.dtype(), k.dtype(), v.dtype(), decay.dtype(), beta.dtype()];
    dtypes.extend(initial.as_ref().map(Tensor::dtype));
    let device = q.device();
    if !takes_fused(&dtypes, &device) {
        return Ok(gated_delta_rule_reference(q, k, v, decay, beta, initial));
    }
    let [b, _, t, dk] = q.dims();
    let [_, h, _, dv] = v.dims();
    let initial = initial.unwrap_or_else(|| Tensor::zeros([b, h, dk, dv], &device));
    if t == 0 {
        return Ok((Tensor::zeros([b, h, 0, dv], &device), initial));
    }
    let both: Tensor<4> =
        Tensor::from_dispatch(<Dispatch as ChunkedDeltaOps>::gated_delta_chunked(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            decay.into_dispatch(),
            beta.into_dispatch(),
            initial.into_dispatch(),
        ));
    Ok((both.clone().narrow(2, 0, t), both.narrow(2, t, dk)))
}

/// Backend op of [`gated_delta_rule_chunked`] (flex and CubeCL, with the custom backward on
/// `Autodiff`). The outputs and the final state travel as one tensor `[b, h, t + dk, dv]`
/// (per head its `t` output rows, then the state's `dk` rows), so one autodiff node carries
/// the gradients of both.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait ChunkedDeltaOps: Backend {
    /// The outputs and final state `[b, h, t + dk, dv]` from `q`, `k` `[b, hk, t, dk]`, `v`
    /// `[b, h, t, dv]`, `decay`, `beta` `[b, h, t]` and `initial` `[b, h, dk, dv]`.
    fn gated_delta_chunked(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// [`Self::gated_delta_chunked`] and the state entering every chunk
    /// `[b, h, chunks, dk, dv]` (what the backward reads).
    fn gated_delta_chunked_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(dq, dk, dv, d_decay, d_beta, d_initial)` for the gradient `grad` (`[b, h, t + dk,
    /// dv]`) of the op's result, from the chunk states `states` of its forward.
    #[allow(clippy::type_complexity)]
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
    );
}

impl ChunkedDeltaOps for Flex {
    fn gated_delta_chunked(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        let (decay, beta, initial) = (as_f32(decay), as_f32(beta), as_f32(initial));
        flex::chunked::forward(&q, &k, &v, &decay, &beta, &initial, false).0
    }

    fn gated_delta_chunked_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        let (decay, beta, initial) = (as_f32(decay), as_f32(beta), as_f32(initial));
        flex::chunked::forward(&q, &k, &v, &decay, &beta, &initial, true)
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
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        let (decay, beta, grad) = (as_f32(decay), as_f32(beta), as_f32(grad));
        flex::chunked::backward(&q, &k, &v, &decay, &beta, &states, &grad)
    }
}

/// The backward of one chunked call (parents q, k, v, decay, β and the initial state).
#[derive(Debug)]
struct ChunkedBackward;

impl<B: ChunkedDeltaOps> Backward<B, 6> for ChunkedBackward {
    type State = [FloatTensor<B>; 6];

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [q, k, v, decay, beta, states] = ops.state;
        let (dq, dk, dv, dd, db, di) =
            B::gated_delta_chunked_backward(q, k, v, decay, beta, states, grad);
        for (node, g) in ops.parents.into_iter().zip([dq, dk, dv, dd, db, di]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

impl<B: Backend + ChunkedDeltaOps, C: CheckpointStrategy> ChunkedDeltaOps for Autodiff<B, C> {
    fn gated_delta_chunked(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let guards = [
            q.node(),
            k.node(),
            v.node(),
            decay.node(),
            beta.node(),
            initial.node(),
        ];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let (decay, beta) = (decay.into_primitive(), beta.into_primitive());
        let initial = initial.into_primitive();
        match ChunkedBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (both, states) = B::gated_delta_chunked_forward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    decay.clone(),
                    beta.clone(),
                    initial,
                );
                prep.finish([q, k, v, decay, beta, states], both)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::gated_delta_chunked(q, k, v, decay, beta, initial))
            }
        }
    }

    fn gated_delta_chunked_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own passes.
        let (both, states) = B::gated_delta_chunked_forward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            decay.into_primitive(),
            beta.into_primitive(),
            initial.into_primitive(),
        );
        (
            <Self as AutodiffBackend>::from_inner(both),
            <Self as AutodiffBackend>::from_inner(states),
        )
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
        let (dq, dk, dv, dd, db, di) = B::gated_delta_chunked_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            decay.into_primitive(),
            beta.into_primitive(),
            states.into_primitive(),
            grad.into_primitive(),
        );
        let inner = <Self as AutodiffBackend>::from_inner;
        (
            inner(dq),
            inner(dk),
            inner(dv),
            inner(dd),
            inner(db),
            inner(di),
        )
    }
}

/// Backend op of [`gated_delta_rule`] (forward only).
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait GatedDeltaOps: Backend {
    /// `(outputs [b, h, t, dv], final state [b, h, dk, dv])` of the gated delta rule from the
    /// state `initial` `[b, h, dk, dv]`.
    fn gated_delta_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

impl GatedDeltaOps for Flex {
    fn gated_delta_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        let (decay, beta) = (as_f32(decay), as_f32(beta));
        flex::delta::forward(&q, &k, &v, &decay, &beta, &as_f32(initial))
    }
}

impl<B: Backend + GatedDeltaOps, C: CheckpointStrategy> GatedDeltaOps for Autodiff<B, C> {
    fn gated_delta_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        decay: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        initial: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Forward only: [`gated_delta_rule`] sends tracked inputs down the tensor-op path, so
        // these are constants.
        let (out, state) = B::gated_delta_forward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            decay.into_primitive(),
            beta.into_primitive(),
            initial.into_primitive(),
        );
        (
            <Self as AutodiffBackend>::from_inner(out),
            <Self as AutodiffBackend>::from_inner(state),
        )
    }
}

/// A `[n, n]` bool mask, true where `keep(row, column)`, on `device`.
fn mask2(
    n: usize,
    device: &burn::tensor::Device,
    keep: impl Fn(usize, usize) -> bool,
) -> Tensor<2, Bool> {
    let values: Vec<bool> = (0..n * n).map(|i| keep(i / n, i % n)).collect();
    Tensor::from_data(TensorData::new(values, [n, n]), device)
}

/// `(I + L)⁻¹` for strictly lower-triangular `l` (`[g, c, c]`, `c` a power of two), by
/// doubling blocks: the inverse of `[[A, 0], [B, D]]` is `[[A⁻¹, 0], [−D⁻¹ B A⁻¹, D⁻¹]]`,
/// all blocks of one size at once (`log2 c` rounds of two batched matmuls) — forward
/// substitution regrouped, differentiable tensor ops.
pub fn unit_lower_inverse(l: Tensor<3>) -> Tensor<3> {
    let [g, c, _] = l.dims();
    let device = l.device();
    // Inverses of the 1×1 diagonal blocks.
    let mut inv = Tensor::<4>::ones([g, c, 1, 1], &device);
    let mut s = 1;
    while s < c {
        let n = c / (2 * s);
        // The 2s×2s diagonal blocks of `l`, `[g, n, 2s, 2s]`.
        let eye = mask2(n, &device, |i, j| i == j)
            .float()
            .reshape([1, n, 1, n, 1]);
        let diag: Tensor<4> = (l.clone().reshape([g, n, 2 * s, n, 2 * s]) * eye)
            .sum_dim(3)
            .reshape([g, n, 2 * s, 2 * s]);
        let lower = diag.narrow(2, s, s).narrow(3, 0, s);
        let pairs = inv.reshape([g, n, 2, s * s]);
        let a_inv = pairs.clone().narrow(2, 0, 1).reshape([g, n, s, s]);
        let d_inv = pairs.narrow(2, 1, 1).reshape([g, n, s, s]);
        let corner = d_inv.clone().matmul(lower).matmul(a_inv.clone()).neg();
        let top = Tensor::cat(vec![a_inv, Tensor::zeros([g, n, s, s], &device)], 3);
        let bottom = Tensor::cat(vec![corner, d_inv], 3);
        inv = Tensor::cat(vec![top, bottom], 2);
        s *= 2;
    }
    inv.reshape([g, c, c])
}

/// The chunk length for a sequence of `seq` tokens.
fn chunk_len(seq: usize) -> usize {
    seq.next_power_of_two().min(DELTA_CHUNK)
}

/// [`gated_delta_rule`] in the chunked form with tensor ops (transformers'
/// `torch_chunk_gated_delta_rule`): the sequence cut into chunks of at most
/// [`DELTA_CHUNK`] tokens; within a chunk the delta-rule updates become one
/// unit-lower-triangular system, inverted by blocks with batched matmuls
/// ([`unit_lower_inverse`]), so the whole pass is differentiable; the chunks are scanned in
/// order. All inputs `f32`; shapes as [`gated_delta_rule`] (unchecked).
pub fn gated_delta_rule_reference(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
) -> (Tensor<4>, Tensor<4>) {
    let heads = v.dims()[1];
    let (q, k) = (spread(q, heads), spread(k, heads));
    let [b, h, t, dk] = q.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let c = chunk_len(t);
    let pad = (c - t % c) % c;
    let n = (t + pad) / c;
    let padded4 = |x: Tensor<4>| -> Tensor<4> {
        if pad == 0 {
            return x;
        }
        let [b, h, _, d] = x.dims();
        Tensor::cat(vec![x, Tensor::zeros([b, h, pad, d], &device)], 2)
    };
    let padded3 = |x: Tensor<3>| -> Tensor<3> {
        if pad == 0 {
            return x;
        }
        Tensor::cat(vec![x, Tensor::zeros([b, h, pad], &device)], 2)
    };
    let chunks = |x: Tensor<4>, d: usize| padded4(x).reshape([b, h, n, c, d]);
    let beta = padded3(beta).reshape([b, h, n, c, 1]);
    let (q, k, v) = (chunks(q, dk), chunks(k, dk), chunks(v, dv));
    let cum = padded3(decay).reshape([b, h, n, c]).cumsum(3);
    let k_beta = k.clone() * beta.clone();
    let v_beta = v * beta;
    // decay_ij = exp(cum_i − cum_j) for j ≤ i, 0 above the diagonal.
    let above = mask2(c, &device, |i, j| j > i)
        .reshape([1, 1, 1, c, c])
        .expand([b, h, n, c, c]);
    let pairwise = (cum.clone().unsqueeze_dim::<5>(4) - cum.clone().unsqueeze_dim::<5>(3))
        .mask_fill(above, f32::NEG_INFINITY)
        .exp();
    let on_or_above = mask2(c, &device, |i, j| j >= i)
        .reshape([1, 1, 1, c, c])
        .expand([b, h, n, c, c]);
    let system = (k_beta.clone().matmul(k.clone().swap_dims(3, 4)) * pairwise.clone())
        .mask_fill(on_or_above, 0.0);
    let solve = unit_lower_inverse(system.reshape([b * h * n, c, c])).reshape([b, h, n, c, c]);
    let cum_exp = cum.clone().exp().unsqueeze_dim::<5>(4);
    let new_values = solve.clone().matmul(v_beta);
    let k_cumdecay = solve.matmul(k_beta * cum_exp.clone());
    let intra = q.clone().matmul(k.clone().swap_dims(3, 4)) * pairwise;
    let last = cum.clone().narrow(3, c - 1, 1);
    let q_decayed = q * cum_exp;
    let k_decayed = k * (last.clone() - cum).exp().unsqueeze_dim::<5>(4);
    let chunk_decay = last.exp().reshape([b, h, n, 1, 1]);
    let mut state = initial.unwrap_or_else(|| Tensor::zeros([b, h, dk, dv], &device));
    let mut outs = Vec::with_capacity(n);
    let at = |x: &Tensor<5>, i: usize, d: usize| x.clone().narrow(2, i, 1).reshape([b, h, c, d]);
    for i in 0..n {
        let v_new = at(&new_values, i, dv) - at(&k_cumdecay, i, dk).matmul(state.clone());
        outs.push(
            at(&q_decayed, i, dk).matmul(state.clone()) + at(&intra, i, c).matmul(v_new.clone()),
        );
        state = state * chunk_decay.clone().narrow(2, i, 1).reshape([b, h, 1, 1])
            + at(&k_decayed, i, dk).swap_dims(2, 3).matmul(v_new);
    }
    let out = Tensor::cat(outs, 2);
    let out = if pad == 0 { out } else { out.narrow(2, 0, t) };
    (out, state)
}

/// [`gated_delta_rule`] token by token with tensor ops (the recurrent form; same arguments
/// and results as [`gated_delta_rule_reference`], unchecked).
pub fn gated_delta_rule_recurrent(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    decay: Tensor<3>,
    beta: Tensor<3>,
    initial: Option<Tensor<4>>,
) -> (Tensor<4>, Tensor<4>) {
    let heads = v.dims()[1];
    let (q, k) = (spread(q, heads), spread(k, heads));
    let [b, h, t, dk] = q.dims();
    let dv = v.dims()[3];
    let mut state = initial.unwrap_or_else(|| Tensor::zeros([b, h, dk, dv], &q.device()));
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q_t = q.clone().narrow(2, i, 1);
        let k_t = k.clone().narrow(2, i, 1);
        let v_t = v.clone().narrow(2, i, 1);
        let g_t = decay.clone().narrow(2, i, 1).exp().reshape([b, h, 1, 1]);
        let beta_t = beta.clone().narrow(2, i, 1).reshape([b, h, 1, 1]);
        state = state * g_t;
        let delta = (v_t - k_t.clone().matmul(state.clone())) * beta_t;
        state = state + k_t.swap_dims(2, 3).matmul(delta);
        outs.push(q_t.matmul(state.clone()));
    }
    (Tensor::cat(outs, 2), state)
}
