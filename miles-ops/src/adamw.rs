//! One AdamW update of a flattened parameter as one pass over its values.
//!
//! The update PyTorch's `torch.optim.AdamW` (and Megatron's) applies to each parameter:
//! `p ← p·(1 − lr·wd)`; `m ← β₁m + (1−β₁)g`; `v ← β₂v + (1−β₂)g²`;
//! `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. As tensor ops ([`adamw_update_reference`])
//! that is ten element-wise passes, each writing a fresh buffer of the parameter's size; on
//! flex (`f32`) [`adamw_update`] is one backend op ([`AdamWOps`]) that reads the gradient once
//! and updates the parameter and both moments in place (when nothing else holds their
//! buffers; a shared buffer is copied first, so a tensor held elsewhere never changes), split
//! over the cores with rayon. The gradient's buffer then goes to [`crate::recycle`] (kept for
//! the next step's gradient within the limit a trainer set), or, when the parameter is held
//! elsewhere (an engine serving this version), it becomes the new parameter's buffer. Both
//! paths round the same way: every product, sum, square root and quotient in `f32`, in the
//! order written above, with the scalars rounded from `f64` once.

use burn::backend::ops::FloatTensorOps;
use burn::backend::{Backend, Dispatch, Flex, Shape, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Device, Tensor, TensorData};
use rayon::prelude::*;

use crate::flex::tensor::{as_f32, dims, f32_data, tensor};
use crate::{OpsError, Result};

/// Elements per parallel task.
const CHUNK: usize = 1 << 15;

/// The scalars of one AdamW update (step `t`), in `f64` as the optimizer holds them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// `1 − β₁ᵗ`.
    pub bias1: f64,
    /// `1 − β₂ᵗ`.
    pub bias2: f64,
    /// The factor the gradient is multiplied by first (rounded to `f32` once): global-norm
    /// clipping's coefficient, so the clipped gradient is never written out (`1` without
    /// clipping: then `g` is used as it is).
    pub grad_scale: f64,
}

impl AdamWHyper {
    /// The `f32` scalars both paths use: decay factor, β₁, 1−β₁, β₂, 1−β₂, √(1−β₂ᵗ), ε,
    /// the step size `lr/(1−β₁ᵗ)` and the gradient's scale, each rounded once from its `f64`
    /// value.
    fn scalars(&self) -> [f32; 9] {
        [
            (1.0 - self.lr * self.weight_decay) as f32,
            self.beta1 as f32,
            (1.0 - self.beta1) as f32,
            self.beta2 as f32,
            (1.0 - self.beta2) as f32,
            self.bias2.sqrt() as f32,
            self.eps as f32,
            (self.lr / self.bias1) as f32,
            self.grad_scale as f32,
        ]
    }
}

/// One AdamW update of the flattened parameter `p` with gradient `g` and moments `m`, `v`
/// (all `[n]`): returns the new `(p, m, v)`. One pass on flex for `f32` tensors (see the
/// module docs), [`adamw_update_reference`] elsewhere.
pub fn adamw_update(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    hyper: &AdamWHyper,
) -> Result<(Tensor<1>, Tensor<1>, Tensor<1>)> {
    let n = p.dims()[0];
    for (what, t) in [
        ("adamw grad", &g),
        ("adamw exp_avg", &m),
        ("adamw exp_avg_sq", &v),
    ] {
        if t.dims()[0] != n {
            return Err(OpsError::ShapeMismatch {
                what,
                expected: vec![n],
                got: t.dims().to_vec(),
            });
        }
    }
    let dtypes = [p.dtype(), g.dtype(), m.dtype(), v.dtype()];
    let device = p.device();
    if !(dtypes.iter().all(|d| *d == DType::F32)
        && crate::device::is_flex(&device)
        && crate::fused_ops_enabled()
        && ![&p, &g, &m, &v].iter().any(|t| t.is_autodiff()))
    {
        return Ok(adamw_update_reference(p, g, m, v, hyper));
    }
    let (p, m, v) = <Dispatch as AdamWOps>::adamw_update(
        p.into_dispatch(),
        g.into_dispatch(),
        m.into_dispatch(),
        v.into_dispatch(),
        hyper.scalars(),
    );
    Ok((
        Tensor::from_dispatch(p),
        Tensor::from_dispatch(m),
        Tensor::from_dispatch(v),
    ))
}

/// A zero moment `[n]` (`f32`) for a parameter's first update, on `device`. On flex a zeroed
/// `f32` buffer taken as it is: flex's own zeros allocate a second, aligned buffer and copy
/// the zeros into it on the calling thread (two weight-sized writes per moment), while fresh
/// pages from the allocator are zero without a write and [`adamw_update`] first touches them
/// on the cores it runs on. Elsewhere `Tensor::zeros`.
pub fn adamw_zero_moment(n: usize, device: &Device) -> Tensor<1> {
    if crate::device::is_flex(device) {
        Tensor::from_data(TensorData::new(vec![0.0f32; n], [n]), device)
    } else {
        Tensor::zeros([n], device)
    }
}

/// [`adamw_update`] with tensor ops (one pass and one fresh buffer per operation).
pub fn adamw_update_reference(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    hyper: &AdamWHyper,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let [decay, b1, one_b1, b2, one_b2, sqrt_bias2, eps, step, scale] = hyper.scalars();
    let g = if scale == 1.0 { g } else { g * scale };
    let m = m * b1 + g.clone() * one_b1;
    let v = v * b2 + g.powi_scalar(2) * one_b2;
    let p = p * decay;
    let denom = v.clone().sqrt() / sqrt_bias2 + eps;
    let p = p - m.clone() / denom * step;
    (p, m, v)
}

/// Backend op of [`adamw_update`] (flex only: the public function sends other devices to
/// the reference).
#[backend_extension(Flex)]
pub trait AdamWOps: Backend {
    /// `(p, m, v)` after one update; `scalars` as `AdamWHyper::scalars` orders them.
    fn adamw_update(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scalars: [f32; 9],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// `Σ tᵢ²` of a `[n]` tensor as a `[1]` tensor, in one pass (no squared copy).
    fn squared_norm(t: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// `t` as a contiguous `f32` tensor whose buffer holds exactly its values (copied when it is
/// a view), so its storage can be updated in place.
fn dense(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let t = as_f32(t);
    let n = t.layout().num_elements();
    if t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == n * 4 {
        t
    } else {
        FloatTensor::<Flex>::from_data(t.into_data())
    }
}

/// One element's update: the new parameter, `m` and `v` written in place.
#[inline(always)]
fn update(p: f32, m: &mut f32, v: &mut f32, g: f32, s: &[f32; 9]) -> f32 {
    let [decay, b1, one_b1, b2, one_b2, sqrt_bias2, eps, step, scale] = *s;
    let g = g * scale;
    let m1 = *m * b1 + g * one_b1;
    let v1 = *v * b2 + g * g * one_b2;
    *m = m1;
    *v = v1;
    let denom = v1.sqrt() / sqrt_bias2 + eps;
    p * decay - m1 / denom * step
}

impl AdamWOps for Flex {
    fn adamw_update(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scalars: [f32; 9],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let g = as_f32(g);
        let (p, mut m, mut v) = (dense(p), dense(m), dense(v));
        // The moments are the optimizer's own (copied first if anything else holds them).
        let (ms, vs) = (m.storage_mut::<f32>(), v.storage_mut::<f32>());
        let moments = ms.par_chunks_mut(CHUNK).zip(vs.par_chunks_mut(CHUNK));
        let n = p.layout().num_elements();
        let p = if p.is_unique() {
            let mut p = p;
            {
                let gs = f32_data(&g);
                moments
                    .zip(gs.par_chunks(CHUNK))
                    .zip(p.storage_mut::<f32>().par_chunks_mut(CHUNK))
                    .for_each(|(((m, v), g), p)| {
                        for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
                            *p = update(*p, m, v, g, &scalars);
                        }
                    });
            }
            // The gradient's buffer may serve the next step's gradient ([`crate::recycle`]).
            crate::matmul::recycle_flex(g);
            p
        } else if g.is_unique()
            && g.layout().contiguous_offsets() == Some((0, n))
            && g.bytes().len() == n * 4
        {
            // Held elsewhere too (the engine serving this version): the new values go into
            // the gradient's own buffer, read and written in the same pass, instead of a new
            // buffer of the parameter's size.
            let shape = dims(&p);
            let mut out = g;
            moments
                .zip(out.storage_mut::<f32>().par_chunks_mut(CHUNK))
                .zip(p.storage::<f32>().par_chunks(CHUNK))
                .for_each(|(((m, v), out), p)| {
                    for (((out, &p), m), v) in out.iter_mut().zip(p).zip(m).zip(v) {
                        *out = update(p, m, v, *out, &scalars);
                    }
                });
            <Flex as FloatTensorOps<Flex>>::float_reshape(out, Shape::from(shape))
        } else {
            // Held elsewhere, and so is the gradient: a new buffer, written in the same pass.
            let shape = dims(&p);
            let gs = f32_data(&g);
            let mut out = vec![0.0f32; gs.len()];
            moments
                .zip(gs.par_chunks(CHUNK))
                .zip(out.par_chunks_mut(CHUNK))
                .zip(p.storage::<f32>().par_chunks(CHUNK))
                .for_each(|((((m, v), g), out), p)| {
                    for ((((out, &p), m), v), &g) in out.iter_mut().zip(p).zip(m).zip(v).zip(g) {
                        *out = update(p, m, v, g, &scalars);
                    }
                });
            tensor(out, &shape)
        };
        (p, m, v)
    }

    fn squared_norm(t: FloatTensor<Self>) -> FloatTensor<Self> {
        let t = as_f32(t);
        let data = f32_data(&t);
        // Per-chunk sums in f64, added in chunk order: the same bits on any thread count.
        let sums: Vec<f64> = data
            .par_chunks(CHUNK)
            .map(|c| c.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
            .collect();
        tensor(vec![sums.iter().sum::<f64>() as f32], &[1])
    }
}

/// `Σ tᵢ²` of the flattened `t` (`[n]`) as a `[1]` tensor (a squared L2 norm, e.g. of a
/// gradient for global-norm clipping): on flex for `f32` one pass summing in `f64` without
/// a squared copy of `t`; elsewhere [`squared_norm_reference`].
pub fn squared_norm(t: Tensor<1>) -> Tensor<1> {
    if !(t.dtype() == DType::F32
        && crate::device::is_flex(&t.device())
        && crate::fused_ops_enabled()
        && !t.is_autodiff())
    {
        return squared_norm_reference(t);
    }
    Tensor::from_dispatch(<Dispatch as AdamWOps>::squared_norm(t.into_dispatch()))
}

/// [`squared_norm`] with tensor ops: `t.powi_scalar(2).sum()`.
pub fn squared_norm_reference(t: Tensor<1>) -> Tensor<1> {
    t.powi_scalar(2).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    fn t(values: &[f32], device: &Device) -> Tensor<1> {
        Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), device)
    }

    #[test]
    fn the_one_pass_equals_the_tensor_ops() {
        let device = Device::flex();
        let n = 3 * CHUNK + 17;
        let f = |k: f32| -> Vec<f32> {
            (0..n)
                .map(|i| (i as f32 * 0.37 + k).sin() * (1.0 + i as f32 / n as f32))
                .collect()
        };
        let (p, g, m) = (f(0.0), f(1.0), f(2.0));
        let v: Vec<f32> = f(3.0).iter().map(|x| x * x).collect();
        let hyper = AdamWHyper {
            lr: 3e-4,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.98,
            eps: 1e-8,
            bias1: 1.0 - 0.9f64.powi(3),
            bias2: 1.0 - 0.98f64.powi(3),
            grad_scale: 1.0,
        };
        let (rp, rm, rv) = adamw_update_reference(
            t(&p, &device),
            t(&g, &device),
            t(&m, &device),
            t(&v, &device),
            &hyper,
        );
        let reference: Vec<Vec<f32>> = [rp, rm, rv]
            .into_iter()
            .map(|x| x.into_data().try_to_vec::<f32>().unwrap())
            .collect();
        // Once with buffers nothing else holds (updated in place), once with the parameter and
        // the moments also held here (the new parameter written into the gradient's buffer,
        // new moments; the held ones must not change), once with the gradient held too (a new
        // buffer; the held gradient must not change either).
        for (shared, grad_held) in [(false, false), (true, false), (true, true)] {
            let (p0, m0, v0) = (t(&p, &device), t(&m, &device), t(&v, &device));
            let held = shared.then(|| (p0.clone(), m0.clone(), v0.clone()));
            let g0 = t(&g, &device);
            let g_held = grad_held.then(|| g0.clone());
            let (fp, fm, fv) = adamw_update(p0, g0, m0, v0, &hyper).unwrap();
            if let Some(g0) = g_held {
                assert_eq!(g0.into_data().try_to_vec::<f32>().unwrap(), g);
            }
            for (fused, reference) in [fp, fm, fv].into_iter().zip(&reference) {
                let fused = fused.into_data().try_to_vec::<f32>().unwrap();
                // The same operations in the same order: equal up to how the backend's
                // scalar ops round (one ulp).
                for (i, (a, b)) in fused.iter().zip(reference).enumerate() {
                    assert!(
                        (a - b).abs() <= f32::EPSILON * b.abs(),
                        "shared {shared}, element {i}: {a} vs {b}"
                    );
                }
            }
            if let Some((p0, m0, v0)) = held {
                assert_eq!(p0.into_data().try_to_vec::<f32>().unwrap(), p);
                assert_eq!(m0.into_data().try_to_vec::<f32>().unwrap(), m);
                assert_eq!(v0.into_data().try_to_vec::<f32>().unwrap(), v);
            }
        }
    }

    #[test]
    fn a_scaled_gradient_equals_the_gradient_scaled_first() {
        // Clipping's coefficient applied inside the update gives the bits of the update of
        // the gradient multiplied by it beforehand (`g · c` rounded to f32 either way).
        let device = Device::flex();
        let n = CHUNK + 5;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
        let p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.05).sin()).collect();
        let coef = 0.123_456_789f64;
        let scaled: Vec<f32> = g.iter().map(|&x| x * coef as f32).collect();
        let hyper = |grad_scale| AdamWHyper {
            lr: 1e-3,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            bias1: 0.1,
            bias2: 0.001,
            grad_scale,
        };
        let zeros = || t(&vec![0.0; n], &device);
        let run = |grad: &[f32], scale| {
            let (p, m, v) = adamw_update(
                t(&p, &device),
                t(grad, &device),
                zeros(),
                zeros(),
                &hyper(scale),
            )
            .unwrap();
            [p, m, v].map(|x| x.into_data().try_to_vec::<f32>().unwrap())
        };
        assert_eq!(run(&g, coef), run(&scaled, 1.0));
        let (rp, _, _) = adamw_update_reference(
            t(&p, &device),
            t(&g, &device),
            zeros(),
            zeros(),
            &hyper(coef),
        );
        let rp = rp.into_data().try_to_vec::<f32>().unwrap();
        for (a, b) in run(&g, coef)[0].iter().zip(&rp) {
            assert!((a - b).abs() <= f32::EPSILON * b.abs(), "{a} vs {b}");
        }
    }

    #[test]
    fn squared_norm_is_the_sum_of_squares() {
        let device = Device::flex();
        let values: Vec<f32> = (0..3 * CHUNK + 7)
            .map(|i| (i as f32 * 0.013).sin())
            .collect();
        let want: f64 = values.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let got: f32 = squared_norm(t(&values, &device)).into_scalar();
        assert!(
            (f64::from(got) - want).abs() < 1e-6 * want,
            "{got} vs {want}"
        );
        let reference: f32 = squared_norm_reference(t(&values, &device)).into_scalar();
        assert!((f64::from(reference) - want).abs() < 1e-4 * want);
        let empty: f32 = squared_norm(t(&[], &device)).into_scalar();
        assert_eq!(empty, 0.0);
    }

    #[test]
    fn sizes_must_agree() {
        let device = Device::flex();
        let hyper = AdamWHyper {
            lr: 1e-3,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            bias1: 0.1,
            bias2: 0.001,
            grad_scale: 1.0,
        };
        let a = t(&[1.0, 2.0], &device);
        let b = t(&[1.0], &device);
        assert!(adamw_update(a.clone(), b, a.clone(), a, &hyper).is_err());
    }
}
