//! Fused SwiGLU gate: `silu(gate) ⊙ up`, forward and backward in one pass each.
//!
//! For the MLP of Llama / Qwen / GLM blocks, `down(silu(gate(x)) ⊙ up(x))`. On flex (`f32`)
//! [`swiglu`] is one backend op ([`SwiGluOps`]): a parallel (rayon) vectorisable pass forward,
//! and a custom backward that produces both gradients in one pass,
//! `∂gate = g ⊙ up ⊙ σ(gate)·(1 + gate·(1 − σ(gate)))`, `∂up = g ⊙ silu(gate)`, where
//! burn's generic form runs several single-threaded element-wise ops each way. On CubeCL
//! devices (feature `wgpu` / `cuda`, `f32`) the op runs one element-wise CubeCL kernel each
//! way. Elsewhere it is `silu(gate) * up` with tensor ops ([`swiglu_reference`]).

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
use burn::tensor::activation::silu;
use rayon::prelude::*;

use crate::flex::tensor::{as_f32, dims, f32_data, takes_fused, tensor};
use crate::{OpsError, Result};

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// `silu(gate) ⊙ up` for two tensors of the same shape.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Result<Tensor<D>> {
    if gate.dims() != up.dims() {
        return Err(OpsError::ShapeMismatch {
            what: "swiglu up",
            expected: gate.dims().to_vec(),
            got: up.dims().to_vec(),
        });
    }
    if !takes_fused(&[gate.dtype(), up.dtype()], &gate.device()) {
        return Ok(swiglu_reference(gate, up));
    }
    Ok(Tensor::from_dispatch(<Dispatch as SwiGluOps>::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    )))
}

/// `silu(gate) * up` with tensor ops.
pub fn swiglu_reference<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    silu(gate) * up
}

/// Backend op of [`swiglu`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait SwiGluOps: Backend {
    /// `silu(gate) ⊙ up`.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `(∂gate, ∂up)` for the upstream gradient `grad`.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// `σ(x)` from `exp(−|x|)`, branch-free so that loops vectorise.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = crate::flex::exp::exp_nonpositive(-x.abs());
    let r = 1.0 / (1.0 + e);
    if x >= 0.0 { r } else { e * r }
}

impl SwiGluOps for Flex {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let (gate, up) = (as_f32(gate), as_f32(up));
        let (g, u) = (f32_data(&gate), f32_data(&up));
        let mut out = vec![0.0f32; g.len()];
        out.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| {
                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                    *o = g * sigmoid(g) * u;
                }
            });
        tensor(out, &dims(&gate))
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (gate, up, grad) = (as_f32(gate), as_f32(up), as_f32(grad));
        let (g, u, dy) = (f32_data(&gate), f32_data(&up), f32_data(&grad));
        let mut d_gate = vec![0.0f32; g.len()];
        let mut d_up = vec![0.0f32; g.len()];
        d_gate
            .par_chunks_mut(CHUNK)
            .zip(d_up.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .zip(dy.par_chunks(CHUNK))
            .for_each(|(((dg, du), (g, u)), dy)| {
                for ((((dg, du), &g), &u), &dy) in dg.iter_mut().zip(du).zip(g).zip(u).zip(dy) {
                    let s = sigmoid(g);
                    *du = dy * g * s;
                    *dg = dy * u * s * (1.0 + g * (1.0 - s));
                }
            });
        (tensor(d_gate, &dims(&gate)), tensor(d_up, &dims(&gate)))
    }
}

#[derive(Debug)]
struct SwiGluBackward;

impl<B: SwiGluOps> Backward<B, 2> for SwiGluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_gate, node_up] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up) = ops.state;
        let (d_gate, d_up) = B::swiglu_backward(gate, up, grad);
        if let Some(node) = node_gate {
            grads.register::<B>(node.id, d_gate);
        }
        if let Some(node) = node_up {
            grads.register::<B>(node.id, d_up);
        }
    }
}

impl<B: Backend + SwiGluOps, C: CheckpointStrategy> SwiGluOps for Autodiff<B, C> {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let guards = [gate.node(), up.node()];
        let (gate, up) = (gate.into_primitive(), up.into_primitive());
        match SwiGluBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(gate.clone(), up.clone());
                prep.finish((gate, up), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate, up)),
        }
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own backward.
        let (d_gate, d_up) = B::swiglu_backward(
            gate.into_primitive(),
            up.into_primitive(),
            grad.into_primitive(),
        );
        (
            <Self as AutodiffBackend>::from_inner(d_gate),
            <Self as AutodiffBackend>::from_inner(d_up),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::sigmoid;

    #[test]
    fn sigmoid_matches_the_definition() {
        for i in -3200..=3200 {
            let x = i as f32 / 40.0;
            let reference = 1.0 / (1.0 + (-x).exp());
            assert!(
                (sigmoid(x) - reference).abs() <= 2.0 * f32::EPSILON * reference,
                "{x}"
            );
        }
    }
}
