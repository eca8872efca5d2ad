//! The fused clipped policy-gradient loss as a backend extension.
//!
//! Per element, with `ratio = exp(−ppo_kl)`: `L1 = −ratio·A`,
//! `L2 = −clamp(ratio, 1 − eps_clip, 1 + eps_clip_high)·A`, `L = max(L1, L2)`,
//! `clipfrac = [L2 > L1]`; with the dual clip `eps_clip_c`, `L = min(L, −eps_clip_c·A)` where
//! `A < 0` (Miles' `compute_policy_loss`). One pass forward and one pass backward instead of
//! about a dozen tensor ops each way.
//!
//! [`clipped_pg_loss`] runs the extension ([`ClippedPgLossOps`]): a native loop on `Flex`,
//! CubeCL kernels on CubeCL devices (feature `wgpu` / `cuda`), with a custom backward on autodiff
//! devices. [`clipped_pg_loss_reference`] is its plain-op twin (and what other backends run).
//! Gradients follow burn's tie rules for the reference: `max(L1, L2)` takes `L1` on ties,
//! `min(L, L3)` takes `L` on ties.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, DType, Dispatch, Flex, FloatDType, Shape, TensorMetadata,
    backend_extension, ops::FloatTensorOps, tensor::FloatTensor,
};
use burn::tensor::{Tensor, TensorData};

/// Backend extension for the clipped policy-gradient loss.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait ClippedPgLossOps: Backend {
    /// `(losses, clipfrac)`, both shaped like `ppo_kl` (same shape as `advantages`).
    fn clipped_pg_loss(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `(∂ppo_kl, ∂advantages)` for the upstream gradient `grad` of the losses.
    fn clipped_pg_loss_backward(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// Loss, clip indicator and the two partial derivatives of one element (the formula every
/// implementation shares; the CubeCL kernels spell out the same steps).
#[inline]
pub(crate) fn element(
    kl: f32,
    a: f32,
    lo: f32,
    hi: f32,
    dual: Option<f32>,
) -> (f32, f32, f32, f32) {
    let ratio = (-kl).exp();
    let clamped = ratio.max(lo).min(hi);
    let l1 = -ratio * a;
    let l2 = -clamped * a;
    let (mut loss, mut d_kl, mut d_a, mut clip) = (l1, a * ratio, -ratio, 0.0);
    if l1 < l2 {
        (loss, d_kl, d_a, clip) = (l2, 0.0, -clamped, 1.0);
    }
    if let Some(c) = dual
        && a < 0.0
    {
        let l3 = -c * a;
        if l3 < loss {
            (loss, d_kl, d_a) = (l3, 0.0, -c);
        }
    }
    (loss, clip, d_kl, d_a)
}

/// Contiguous `f32` values of a flex tensor (other float dtypes are cast) and its dtype.
fn flex_f32(t: FloatTensor<Flex>) -> (Vec<f32>, DType) {
    let dtype = t.dtype();
    let t = if dtype == DType::F32 {
        t
    } else {
        Flex::float_cast(t, FloatDType::F32)
    };
    let values = match t.as_slice::<f32>() {
        Some(s) => s.to_vec(),
        None => t
            .to_contiguous()
            .as_slice::<f32>()
            .map(<[f32]>::to_vec)
            .unwrap_or_default(),
    };
    (values, dtype)
}

fn flex_from(data: Vec<f32>, shape: Shape, dtype: DType) -> FloatTensor<Flex> {
    let t = FloatTensor::<Flex>::from_data(TensorData::new(data, shape));
    match dtype {
        DType::F32 => t,
        other => Flex::float_cast(t, FloatDType::from(other)),
    }
}

impl ClippedPgLossOps for Flex {
    fn clipped_pg_loss(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = ppo_kl.shape();
        let (kl, dtype) = flex_f32(ppo_kl);
        let (adv, _) = flex_f32(advantages);
        let (lo, hi) = (1.0 - eps_clip, 1.0 + eps_clip_high);
        let (loss, clip): (Vec<f32>, Vec<f32>) = kl
            .iter()
            .zip(&adv)
            .map(|(&k, &a)| {
                let (l, c, _, _) = element(k, a, lo, hi, eps_clip_c);
                (l, c)
            })
            .unzip();
        (
            flex_from(loss, shape.clone(), dtype),
            flex_from(clip, shape, dtype),
        )
    }

    fn clipped_pg_loss_backward(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = ppo_kl.shape();
        let (kl, dtype) = flex_f32(ppo_kl);
        let (adv, _) = flex_f32(advantages);
        let (g, _) = flex_f32(grad);
        let (lo, hi) = (1.0 - eps_clip, 1.0 + eps_clip_high);
        let (d_kl, d_a): (Vec<f32>, Vec<f32>) = kl
            .iter()
            .zip(&adv)
            .zip(&g)
            .map(|((&k, &a), &g)| {
                let (_, _, dk, da) = element(k, a, lo, hi, eps_clip_c);
                (g * dk, g * da)
            })
            .unzip();
        (
            flex_from(d_kl, shape.clone(), dtype),
            flex_from(d_a, shape, dtype),
        )
    }
}

#[derive(Debug)]
struct ClippedBackward;

impl<B: ClippedPgLossOps> Backward<B, 2> for ClippedBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f32, f32, Option<f32>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_kl, node_adv] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (kl, adv, lo, hi, c) = ops.state;
        let (d_kl, d_adv) = B::clipped_pg_loss_backward(kl, adv, grad, lo, hi, c);
        if let Some(node) = node_kl {
            grads.register::<B>(node.id, d_kl);
        }
        if let Some(node) = node_adv {
            grads.register::<B>(node.id, d_adv);
        }
    }
}

impl<B: ClippedPgLossOps, C: CheckpointStrategy> ClippedPgLossOps for Autodiff<B, C> {
    fn clipped_pg_loss(
        ppo_kl: FloatTensor<Self>,
        advantages: FloatTensor<Self>,
        eps_clip: f32,
        eps_clip_high: f32,
        eps_clip_c: Option<f32>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let guards = [ppo_kl.node(), advantages.node()];
        let kl = ppo_kl.into_primitive();
        let adv = advantages.into_primitive();
        let (losses, clipfrac) =
            B::clipped_pg_loss(kl.clone(), adv.clone(), eps_clip, eps_clip_high, eps_clip_c);
        let clipfrac = <Self as AutodiffBackend>::from_inner(clipfrac);
        let losses = match ClippedBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                prep.finish((kl, adv, eps_clip, eps_clip_high, eps_clip_c), losses)
            }
            OpsKind::UnTracked(prep) => prep.finish(losses),
        };
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
        // A constant: only called inside the op's own backward.
        let (d_kl, d_adv) = B::clipped_pg_loss_backward(
            ppo_kl.into_primitive(),
            advantages.into_primitive(),
            grad.into_primitive(),
            eps_clip,
            eps_clip_high,
            eps_clip_c,
        );
        (
            <Self as AutodiffBackend>::from_inner(d_kl),
            <Self as AutodiffBackend>::from_inner(d_adv),
        )
    }
}

/// The clipped policy-gradient loss: `(losses, clipfrac)` shaped like `ppo_kl`.
///
/// Differentiable with respect to `ppo_kl` and `advantages`; `clipfrac` is a constant.
pub fn clipped_pg_loss<const D: usize>(
    ppo_kl: Tensor<D>,
    advantages: Tensor<D>,
    eps_clip: f32,
    eps_clip_high: f32,
    eps_clip_c: Option<f32>,
) -> (Tensor<D>, Tensor<D>) {
    if !crate::runs_fused(&ppo_kl.device()) {
        return clipped_pg_loss_reference(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c);
    }
    let (losses, clipfrac) = <Dispatch as ClippedPgLossOps>::clipped_pg_loss(
        ppo_kl.into_dispatch(),
        advantages.into_dispatch(),
        eps_clip,
        eps_clip_high,
        eps_clip_c,
    );
    (
        Tensor::from_dispatch(losses),
        Tensor::from_dispatch(clipfrac),
    )
}

/// Plain-op twin of [`clipped_pg_loss`] (differentiated by burn's autodiff).
pub fn clipped_pg_loss_reference<const D: usize>(
    ppo_kl: Tensor<D>,
    advantages: Tensor<D>,
    eps_clip: f32,
    eps_clip_high: f32,
    eps_clip_c: Option<f32>,
) -> (Tensor<D>, Tensor<D>) {
    let ratio = ppo_kl.neg().exp();
    let l1 = ratio.clone().neg() * advantages.clone();
    let l2 = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high).neg() * advantages.clone();
    let clipfrac = l2.clone().greater(l1.clone()).float();
    let clipped = l1.max_pair(l2);
    let losses = match eps_clip_c {
        Some(c) => {
            let l3 = advantages.clone().mul_scalar(-c);
            let dual = clipped.clone().min_pair(l3);
            clipped.mask_where(advantages.lower_elem(0.0), dual)
        }
        None => clipped,
    };
    (losses, clipfrac.detach())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn data(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32;
                (x * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn run(fused: bool, c: Option<f32>) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = Device::flex().autodiff();
        let kl = Tensor::<1>::from_floats(data(64, 1, 0.6).as_slice(), &d)
            .reshape([8, 8])
            .require_grad();
        let a = Tensor::<1>::from_floats(data(64, 7, 2.0).as_slice(), &d)
            .reshape([8, 8])
            .require_grad();
        let g = Tensor::<1>::from_floats(data(64, 13, 1.0).as_slice(), &d).reshape([8, 8]);
        let f = if fused {
            clipped_pg_loss::<2>
        } else {
            clipped_pg_loss_reference::<2>
        };
        let (l, cf) = f(kl.clone(), a.clone(), 0.2, 0.28, c);
        let grads = (l.clone() * g).sum().backward();
        let v = |t: Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
        (
            v(l.detach()),
            v(cf),
            v(kl.grad(&grads).unwrap()),
            v(a.grad(&grads).unwrap()),
        )
    }

    #[test]
    fn flex_extension_matches_reference_with_gradients() {
        for c in [None, Some(3.0)] {
            let (l, cf, dk, da) = run(true, c);
            let (rl, rcf, rdk, rda) = run(false, c);
            for (what, x, y) in [
                ("loss", &l, &rl),
                ("clipfrac", &cf, &rcf),
                ("d_kl", &dk, &rdk),
                ("d_adv", &da, &rda),
            ] {
                for (i, (p, q)) in x.iter().zip(y.iter()).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-6 * (1.0 + q.abs()),
                        "{what}[{i}]: {p} vs {q}"
                    );
                }
            }
        }
    }

    #[test]
    fn element_hand_computed() {
        // ratio = e^0.5 ≈ 1.6487 > 1.28, A = 1: L1 = −1.6487, L2 = −1.28 → clipped, no grad.
        let (l, c, dk, da) = element(-0.5, 1.0, 0.8, 1.28, None);
        assert!((l + 1.28).abs() < 1e-6 && c == 1.0 && dk == 0.0 && (da + 1.28).abs() < 1e-6);
        // A = −2, ratio ≈ 1.6487: L = 3.2974; dual clip c = 1.5 → L3 = 3.0 wins.
        let (l, _, dk, da) = element(-0.5, -2.0, 0.8, 1.28, Some(1.5));
        assert!((l - 3.0).abs() < 1e-6 && dk == 0.0 && (da + 1.5).abs() < 1e-6);
        // Inside the band: L = −ratio·A, ∂L/∂kl = A·ratio.
        let r = (-0.1f32).exp();
        let (l, c, dk, _) = element(0.1, 2.0, 0.8, 1.28, None);
        assert!((l + 2.0 * r).abs() < 1e-6 && c == 0.0 && (dk - 2.0 * r).abs() < 1e-6);
    }
}
