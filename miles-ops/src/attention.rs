//! Fused masked softmax attention with grouped key/value heads, forward and backward.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Flex, TensorMetadata, backend_extension,
    tensor::{BoolTensor, FloatTensor},
};
use burn::tensor::activation::softmax;
use burn::tensor::{Bool, Tensor};

use crate::flex;
use crate::flex::tensor::{as_f32, takes_fused};
use crate::{OpsError, Result};

/// The score a masked key gets before the softmax.
pub const MASKED_SCORE: f32 = -1.0e30;

fn check(q: &[usize; 4], k: &[usize; 4], v: &[usize; 4], mask: &[usize; 3]) -> Result<()> {
    let [b, h, s, d] = *q;
    let [bk, hk, t, dk] = *k;
    let expected_kv = [b, hk, t, d];
    if bk != b || dk != d || hk == 0 || h % hk != 0 {
        return Err(OpsError::ShapeMismatch {
            what: "attention keys",
            expected: expected_kv.to_vec(),
            got: k.to_vec(),
        });
    }
    if *v != expected_kv {
        return Err(OpsError::ShapeMismatch {
            what: "attention values",
            expected: expected_kv.to_vec(),
            got: v.to_vec(),
        });
    }
    if *mask != [b, s, t] {
        return Err(OpsError::ShapeMismatch {
            what: "attention mask",
            expected: vec![b, s, t],
            got: mask.to_vec(),
        });
    }
    Ok(())
}

/// Masked softmax attention. Errors on inconsistent shapes (heads not a multiple of
/// key/value heads, mismatched batch, keys, head size or mask).
///
/// [`attention`] computes `softmax(mask_fill(q·kᵀ·scale, mask, −1e30))·v` for queries
/// `[batch, heads, rows, head_dim]`, keys and values `[batch, kv_heads, keys, head_dim]`
/// (query head `h` reads key/value head `h / (heads / kv_heads)`, as HF's `repeat_kv`) and a
/// boolean mask `[batch, rows, keys]` (`true` = masked). A row whose keys are all masked
/// attends uniformly to every key, as the masked-fill form does.
///
/// On flex (`f32`) it runs as one backend op ([`FusedAttentionOps`]): rayon tasks per head,
/// row blocks that skip the keys past their last unmasked one (half the work under a causal
/// mask), the scale, masking and softmax fused over each block, and a custom backward that
/// recomputes the probabilities from the forward's log-sum-exp, so neither the
/// `[batch, heads, rows, keys]` scores nor their gradients are materialised between ops.
/// On CubeCL devices (feature `wgpu` / `cuda`, `f32`) the same op runs flash-style CubeCL
/// kernels (`src/kernels/attention.rs`: online softmax over key tiles, the log-sum-exp saved
/// for the backward; also the engine's decode step, one query row over the KV cache).
/// Elsewhere (other devices or dtypes) it is the same computation written with tensor ops
/// ([`attention_reference`]), which is also what the flex op is tested against.
pub fn attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
) -> Result<Tensor<4>> {
    check(&q.dims(), &k.dims(), &v.dims(), &mask.dims())?;
    if !takes_fused(&[q.dtype(), k.dtype(), v.dtype()], &q.device()) {
        return Ok(attention_reference(q, k, v, mask, scale));
    }
    let no_sinks = Tensor::<1>::zeros([0], &q.device());
    Ok(Tensor::from_dispatch(
        <Dispatch as FusedAttentionOps>::fused_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            mask.into_dispatch(),
            no_sinks.into_dispatch(),
            scale,
        ),
    ))
}

/// [`attention`] with attention sinks (GPT-OSS): per query head `h`, one more logit
/// `sinks[h]` joins every query's softmax denominator and its probability is dropped, so the
/// weights over the keys sum to less than one; `sinks` (`[heads]`) is differentiable. A row
/// whose keys are all masked attends to nothing (zero output, every weight on the sink). A
/// sliding window is expressed through `mask` (keys older than the window masked): the
/// kernels skip the keys before a row's first unmasked one as they skip those after its last.
///
/// Runs the same fused op as [`attention`] (flex loops, CubeCL kernels; the sink is folded
/// into each row's log-sum-exp, so the backward is the plain one plus
/// `∂sinks[h] = −Σ_rows exp(sinks[h] − lse)·Σ(∂O ⊙ O)`); elsewhere
/// [`attention_with_sinks_reference`]. Errors as [`attention`], and when `sinks` is not
/// `[heads]`.
pub fn attention_with_sinks(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
    sinks: Tensor<1>,
) -> Result<Tensor<4>> {
    check(&q.dims(), &k.dims(), &v.dims(), &mask.dims())?;
    let heads = q.dims()[1];
    if sinks.dims() != [heads] {
        return Err(OpsError::ShapeMismatch {
            what: "attention sinks",
            expected: vec![heads],
            got: sinks.dims().to_vec(),
        });
    }
    let dtypes = [q.dtype(), k.dtype(), v.dtype(), sinks.dtype()];
    if !takes_fused(&dtypes, &q.device()) {
        return Ok(attention_with_sinks_reference(q, k, v, mask, scale, sinks));
    }
    Ok(Tensor::from_dispatch(
        <Dispatch as FusedAttentionOps>::fused_attention(
            q.into_dispatch(),
            k.into_dispatch(),
            v.into_dispatch(),
            mask.into_dispatch(),
            sinks.into_dispatch(),
            scale,
        ),
    ))
}

/// The computation with tensor ops: key/value heads repeated, scores, masked fill, softmax.
pub fn attention_reference(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
) -> Tensor<4> {
    let (scores, v) = masked_scores(q, k, v, mask, scale);
    softmax(scores, 3).matmul(v)
}

/// The tensor-op forms' common part: `q·kᵀ·scale` with masked keys at [`MASKED_SCORE`]
/// (`[batch, heads, queries, keys]`), and the values repeated over each key/value head's group
/// of query heads.
fn masked_scores(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
) -> (Tensor<4>, Tensor<4>) {
    let [b, h, s, d] = q.dims();
    let [_, hk, t, _] = k.dims();
    let group = h / hk.max(1);
    let repeat = |x: Tensor<4>| -> Tensor<4> {
        if group == 1 {
            return x;
        }
        x.unsqueeze_dim::<5>(2)
            .expand([b, hk, group, t, d])
            .reshape([b, h, t, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let mask = mask.unsqueeze_dim::<4>(1).expand([b, h, s, t]);
    (scores.mask_fill(mask, MASKED_SCORE), v)
}

/// [`attention_with_sinks`] with tensor ops (transformers' eager GPT-OSS attention): the
/// masked scores with a column of `sinks[h]` appended, softmax over it, the sink column
/// dropped, `·v`.
pub fn attention_with_sinks_reference(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
    sinks: Tensor<1>,
) -> Tensor<4> {
    let [b, h, s, _] = q.dims();
    let t = k.dims()[2];
    let (scores, v) = masked_scores(q, k, v, mask, scale);
    let sink = sinks.reshape([1, h, 1, 1]).expand([b, h, s, 1]);
    let scores = Tensor::cat(vec![scores, sink], 3);
    softmax(scores, 3).narrow(3, 0, t).matmul(v)
}

/// Backend op of [`attention`] and [`attention_with_sinks`]: native kernels on flex,
/// CubeCL kernels on CubeCL devices, the custom backward on `Autodiff`. `sinks` (`[heads]`, or
/// `[0]` for none) join each row's softmax denominator; the saved log-sum-exp includes them.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait FusedAttentionOps: Backend {
    /// `softmax(mask_fill(q·kᵀ·scale, mask))·v`, `[batch, heads, rows, head_dim]` (with
    /// `sinks`, the softmax denominators include `exp(sinks[h])`).
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self>;

    /// The output and the per-row log-sum-exp of the scores (and the sink) `[batch, heads,
    /// rows]`.
    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// Gradients `(dq, dk, dv, dsinks)` for the upstream gradient `grad` of the output `out`
    /// (`dsinks` shaped as `sinks`).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
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
    );
}

/// The host values of the sinks, `None` for none (`[0]`) (flex).
fn sink_values(sinks: FloatTensor<Flex>) -> Option<Vec<f32>> {
    let values = flex::tensor::f32_data(&as_f32(sinks)).into_owned();
    (!values.is_empty()).then_some(values)
}

impl FusedAttentionOps for Flex {
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
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        debug_assert!(flex::attention::supported(&q, &k, &v));
        let dims = flex::attention::dims_of(&q.shape(), &k.shape());
        let sinks = sink_values(sinks);
        flex::attention::forward(&q, &k, &v, &mask, sinks.as_deref(), scale, dims)
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
        let (q, k, v) = (as_f32(q), as_f32(k), as_f32(v));
        let (out, grad) = (as_f32(out), as_f32(grad));
        let dims = flex::attention::dims_of(&q.shape(), &k.shape());
        let values = sink_values(sinks.clone());
        let (dq, dk, dv, ds) = flex::attention::backward(
            &q,
            &k,
            &v,
            &mask,
            values.as_deref(),
            &out,
            &lse,
            &grad,
            scale,
            dims,
        );
        (dq, dk, dv, ds.unwrap_or(sinks))
    }
}

/// The backward of one attention call (parents q, k, v and the sinks).
#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedAttentionOps> Backward<B, 4> for AttentionBackward {
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        BoolTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        f32,
    );

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v, node_s] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, mask, sinks, out, lse, scale) = ops.state;
        let (dq, dk, dv, ds) =
            B::fused_attention_backward(q, k, v, mask, sinks, out, lse, grad, scale);
        for (node, g) in [(node_q, dq), (node_k, dk), (node_v, dv), (node_s, ds)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

impl<B: Backend + FusedAttentionOps, C: CheckpointStrategy> FusedAttentionOps for Autodiff<B, C> {
    fn fused_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> FloatTensor<Self> {
        let guards = [q.node(), k.node(), v.node(), sinks.node()];
        let (q, k, v) = (q.into_primitive(), k.into_primitive(), v.into_primitive());
        let sinks = sinks.into_primitive();
        match AttentionBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (out, lse) = B::fused_attention_forward(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    mask.clone(),
                    sinks.clone(),
                    scale,
                );
                prep.finish((q, k, v, mask, sinks, out.clone(), lse, scale), out)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::fused_attention(q, k, v, mask, sinks, scale))
            }
        }
    }

    fn fused_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        sinks: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own passes.
        let (out, lse) = B::fused_attention_forward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            mask,
            sinks.into_primitive(),
            scale,
        );
        (
            <Self as AutodiffBackend>::from_inner(out),
            <Self as AutodiffBackend>::from_inner(lse),
        )
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
        let (dq, dk, dv, ds) = B::fused_attention_backward(
            q.into_primitive(),
            k.into_primitive(),
            v.into_primitive(),
            mask,
            sinks.into_primitive(),
            out.into_primitive(),
            lse.into_primitive(),
            grad.into_primitive(),
            scale,
        );
        (
            <Self as AutodiffBackend>::from_inner(dq),
            <Self as AutodiffBackend>::from_inner(dk),
            <Self as AutodiffBackend>::from_inner(dv),
            <Self as AutodiffBackend>::from_inner(ds),
        )
    }
}
