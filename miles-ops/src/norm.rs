//! Fused RMSNorm and rotary position embedding (RoPE), forward and backward.
//!
//! - [`rms_norm`]: `w ⊙ x / sqrt(mean(x²) + eps)` over the last dimension. Backward, per row
//!   with `r = 1/sqrt(mean(x²) + eps)` and `g = ∂y ⊙ w`:
//!   `∂x = r·g − x·r³·(g·x)/d`, `∂w = Σ_rows ∂y ⊙ x·r`.
//! - [`rope`]: `x·cos + rotate_half(x)·sin` on the first `rotary_dim` channels of
//!   `[batch, heads, seq, head_dim]` (non-interleaved halves, `rotate_half(x) = [−x₂, x₁]`),
//!   the other channels passed through; `cos` / `sin` are `[batch, seq, rotary_dim]` tables
//!   (constants). Backward is the transposed rotation: `∂x = ∂y·cos + rotate_halfᵀ(∂y·sin)`,
//!   `rotate_halfᵀ(y) = [y₂, −y₁]`.
//!
//! On flex (`f32`) each is one backend op ([`NormRopeOps`]) with row-parallel (rayon) passes,
//! where burn's generic forms run five to eight single-threaded element-wise ops each way; on
//! CubeCL devices (feature `wgpu` / `cuda`, `f32`) the same op runs CubeCL kernels
//! (`src/kernels/model.rs`); elsewhere the same math with tensor ops ([`rms_norm_reference`],
//! [`rope_reference`]).

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor,
};
use burn::tensor::Tensor;
use rayon::prelude::*;

use crate::flex::tensor::{as_f32, dims, f32_data, takes_fused, tensor};
use crate::{OpsError, Result};

/// Rows per parallel task.
const ROWS: usize = 64;

/// RMSNorm of the last dimension of `x` with scale `weight` `[d]`.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Result<Tensor<D>> {
    let d = x.dims()[D - 1];
    if weight.dims() != [d] {
        return Err(OpsError::ShapeMismatch {
            what: "rms_norm weight",
            expected: vec![d],
            got: weight.dims().to_vec(),
        });
    }
    if !takes_fused(&[x.dtype(), weight.dtype()], &x.device()) {
        return Ok(rms_norm_reference(x, weight, eps));
    }
    Ok(Tensor::from_dispatch(<Dispatch as NormRopeOps>::rms_norm(
        x.into_dispatch(),
        weight.into_dispatch(),
        eps as f32,
    )))
}

/// RMSNorm with tensor ops.
pub fn rms_norm_reference<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Tensor<D> {
    let inv_rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt().recip();
    x * inv_rms * weight.unsqueeze()
}

/// RoPE on the first `cos.dims()[2]` channels of `x` `[batch, heads, seq, head_dim]`, with
/// `cos` / `sin` `[batch, seq, rotary_dim]`.
pub fn rope(x: Tensor<4>, cos: Tensor<3>, sin: Tensor<3>) -> Result<Tensor<4>> {
    let [b, _, s, d] = x.dims();
    let [cb, cs, rot] = cos.dims();
    if cb != b || cs != s || rot > d || rot % 2 != 0 || sin.dims() != cos.dims() {
        return Err(OpsError::ShapeMismatch {
            what: "rope tables",
            expected: vec![b, s, rot.min(d) / 2 * 2],
            got: sin.dims().to_vec(),
        });
    }
    if rot == 0 {
        return Ok(x);
    }
    if !takes_fused(&[x.dtype(), cos.dtype(), sin.dtype()], &x.device()) {
        return Ok(rope_reference(x, cos, sin));
    }
    Ok(Tensor::from_dispatch(<Dispatch as NormRopeOps>::rope(
        x.into_dispatch(),
        cos.into_dispatch(),
        sin.into_dispatch(),
    )))
}

/// RoPE with tensor ops.
pub fn rope_reference(x: Tensor<4>, cos: Tensor<3>, sin: Tensor<3>) -> Tensor<4> {
    let [_, _, _, head_dim] = x.dims();
    let rot = cos.dims()[2];
    if rot == 0 {
        return x;
    }
    let half = rot / 2;
    let part = x.clone().narrow(3, 0, rot);
    let x1 = part.clone().narrow(3, 0, half);
    let x2 = part.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    let out = part * cos.unsqueeze_dim::<4>(1) + rotated * sin.unsqueeze_dim::<4>(1);
    if rot == head_dim {
        out
    } else {
        Tensor::cat(vec![out, x.narrow(3, rot, head_dim - rot)], 3)
    }
}

/// Backend ops of [`rms_norm`] and [`rope`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait NormRopeOps: Backend {
    /// RMSNorm of the last dimension.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self>;

    /// `(∂x, ∂weight)` of RMSNorm for the upstream gradient `grad`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// RoPE on the first `rotary_dim` channels (`cos` / `sin` `[batch, seq, rotary_dim]`).
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The backward of [`NormRopeOps::rope`]: the transposed rotation of `grad`.
    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

/// `1/sqrt(mean(row²) + eps)`.
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|x| x * x).sum();
    1.0 / (ss / row.len() as f32 + eps).sqrt()
}

/// RoPE over contiguous `[b, h, s, d]` data, `cos` / `sin` `[b, s, rot]`; `transpose` applies
/// the adjoint rotation.
fn rope_pass(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    shape: &[usize],
    rot: usize,
    transpose: bool,
) -> Vec<f32> {
    let (heads, s, d) = (shape[1], shape[2], shape[3]);
    let half = rot / 2;
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut((s * d).max(1))
        .zip(x.par_chunks((s * d).max(1)))
        .enumerate()
        .for_each(|(bh, (out, x))| {
            let bi = bh / heads.max(1);
            for p in 0..s {
                let c = &cos[(bi * s + p) * rot..(bi * s + p + 1) * rot];
                let sn = &sin[(bi * s + p) * rot..(bi * s + p + 1) * rot];
                let xr = &x[p * d..(p + 1) * d];
                let o = &mut out[p * d..(p + 1) * d];
                for j in 0..half {
                    let (a, b) = (xr[j], xr[j + half]);
                    if transpose {
                        o[j] = a * c[j] + b * sn[j + half];
                        o[j + half] = b * c[j + half] - a * sn[j];
                    } else {
                        o[j] = a * c[j] - b * sn[j];
                        o[j + half] = b * c[j + half] + a * sn[j + half];
                    }
                }
                o[rot..].copy_from_slice(&xr[rot..]);
            }
        });
    out
}

/// [`rope_pass`] on flex tensors.
fn rope_flex(
    x: FloatTensor<Flex>,
    cos: FloatTensor<Flex>,
    sin: FloatTensor<Flex>,
    transpose: bool,
) -> FloatTensor<Flex> {
    let (x, cos, sin) = (as_f32(x), as_f32(cos), as_f32(sin));
    let shape = dims(&x);
    let rot = dims(&cos)[2];
    let out = rope_pass(
        &f32_data(&x),
        &f32_data(&cos),
        &f32_data(&sin),
        &shape,
        rot,
        transpose,
    );
    tensor(out, &shape)
}

impl NormRopeOps for Flex {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let (x, weight) = (as_f32(x), as_f32(weight));
        let shape = dims(&x);
        let (xs, w) = (f32_data(&x), f32_data(&weight));
        let d = w.len().max(1);
        let mut out = vec![0.0f32; xs.len()];
        out.par_chunks_mut(ROWS * d)
            .zip(xs.par_chunks(ROWS * d))
            .for_each(|(o, x)| {
                for (o, x) in o.chunks_mut(d).zip(x.chunks(d)) {
                    let r = inv_rms(x, eps);
                    for ((o, &x), &w) in o.iter_mut().zip(x).zip(w.iter()) {
                        *o = x * r * w;
                    }
                }
            });
        tensor(out, &shape)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, weight, grad) = (as_f32(x), as_f32(weight), as_f32(grad));
        let shape = dims(&x);
        let (xs, w, dy) = (f32_data(&x), f32_data(&weight), f32_data(&grad));
        let d = w.len().max(1);
        let mut dx = vec![0.0f32; xs.len()];
        let dw = dx
            .par_chunks_mut(ROWS * d)
            .zip(xs.par_chunks(ROWS * d).zip(dy.par_chunks(ROWS * d)))
            .map(|(dx, (x, dy))| {
                let mut dw = vec![0.0f32; d];
                for ((dx, x), dy) in dx.chunks_mut(d).zip(x.chunks(d)).zip(dy.chunks(d)) {
                    let r = inv_rms(x, eps);
                    let gx: f32 = dy
                        .iter()
                        .zip(w.iter())
                        .zip(x)
                        .map(|((g, w), x)| g * w * x)
                        .sum();
                    let k = r * r * r * gx / d as f32;
                    for (j, dxj) in dx.iter_mut().enumerate() {
                        *dxj = r * dy[j] * w[j] - x[j] * k;
                        dw[j] += dy[j] * x[j] * r;
                    }
                }
                dw
            })
            .reduce(
                || vec![0.0f32; d],
                |mut a, b| {
                    a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        (tensor(dx, &shape), tensor(dw, &[w.len()]))
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope_flex(x, cos, sin, false)
    }

    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rope_flex(grad, cos, sin, true)
    }
}

#[derive(Debug)]
struct RmsNormBackward;

impl<B: NormRopeOps> Backward<B, 2> for RmsNormBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f32);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, weight, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, weight, grad, eps);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw);
        }
    }
}

#[derive(Debug)]
struct RopeBackward;

impl<B: NormRopeOps> Backward<B, 1> for RopeBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (cos, sin) = ops.state;
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::rope_backward(grad, cos, sin));
        }
    }
}

impl<B: Backend + NormRopeOps, C: CheckpointStrategy> NormRopeOps for Autodiff<B, C> {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f32) -> FloatTensor<Self> {
        let guards = [x.node(), weight.node()];
        let (x, weight) = (x.into_primitive(), weight.into_primitive());
        match RmsNormBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::rms_norm(x.clone(), weight.clone(), eps);
                prep.finish((x, weight, eps), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x, weight, eps)),
        }
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own backward.
        let (dx, dw) = B::rms_norm_backward(
            x.into_primitive(),
            weight.into_primitive(),
            grad.into_primitive(),
            eps,
        );
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let guards = [x.node()];
        let x = x.into_primitive();
        // The tables are constants.
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match RopeBackward.prepare::<C>(guards).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::rope(x, cos.clone(), sin.clone());
                prep.finish((cos, sin), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::rope(x, cos, sin)),
        }
    }

    fn rope_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::rope_backward(
            grad.into_primitive(),
            cos.into_primitive(),
            sin.into_primitive(),
        ))
    }
}
