//! One AdamW update of a flattened parameter as one pass over its values.
//!
//! The update PyTorch's `torch.optim.AdamW` (and Megatron's) applies to each parameter:
//! `p ← p·(1 − lr·wd)`; `m ← β₁m + (1−β₁)g`; `v ← β₂v + (1−β₂)g²`;
//! `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`. As tensor ops ([`adamw_update_reference`])
//! that is ten element-wise passes, each writing a fresh buffer of the parameter's size; on
//! flex (`f32`) [`adamw_update`] is one backend op ([`AdamWOps`]) that reads the gradient once
//! and updates the parameter and both moments in place (when nothing else holds their
//! buffers; a shared buffer is copied first, so a tensor held elsewhere never changes), split
//! over the cores with rayon. Both round the same way: every product, sum, square root and
//! quotient in `f32`, in the order written above, with the scalars rounded from `f64` once.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};
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
}

impl AdamWHyper {
    /// The `f32` scalars both paths use: decay factor, β₁, 1−β₁, β₂, 1−β₂, √(1−β₂ᵗ), ε and
    /// the step size `lr/(1−β₁ᵗ)`, each rounded once from its `f64` value.
    fn scalars(&self) -> [f32; 8] {
        [
            (1.0 - self.lr * self.weight_decay) as f32,
            self.beta1 as f32,
            (1.0 - self.beta1) as f32,
            self.beta2 as f32,
            (1.0 - self.beta2) as f32,
            self.bias2.sqrt() as f32,
            self.eps as f32,
            (self.lr / self.bias1) as f32,
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

/// [`adamw_update`] with tensor ops (one pass and one fresh buffer per operation).
pub fn adamw_update_reference(
    p: Tensor<1>,
    g: Tensor<1>,
    m: Tensor<1>,
    v: Tensor<1>,
    hyper: &AdamWHyper,
) -> (Tensor<1>, Tensor<1>, Tensor<1>) {
    let [decay, b1, one_b1, b2, one_b2, sqrt_bias2, eps, step] = hyper.scalars();
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
        scalars: [f32; 8],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);
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
fn update(p: f32, m: &mut f32, v: &mut f32, g: f32, s: &[f32; 8]) -> f32 {
    let [decay, b1, one_b1, b2, one_b2, sqrt_bias2, eps, step] = *s;
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
        scalars: [f32; 8],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let g = as_f32(g);
        let g = f32_data(&g);
        let (p, mut m, mut v) = (dense(p), dense(m), dense(v));
        // The moments are the optimizer's own (copied first if anything else holds them).
        let (ms, vs) = (m.storage_mut::<f32>(), v.storage_mut::<f32>());
        let moments = ms
            .par_chunks_mut(CHUNK)
            .zip(vs.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK));
        let p = if p.is_unique() {
            let mut p = p;
            moments
                .zip(p.storage_mut::<f32>().par_chunks_mut(CHUNK))
                .for_each(|(((m, v), g), p)| {
                    for (((p, m), v), &g) in p.iter_mut().zip(m).zip(v).zip(g) {
                        *p = update(*p, m, v, g, &scalars);
                    }
                });
            p
        } else {
            // Held elsewhere too (the engine serving this version): the new values go to a
            // new buffer in the same pass instead of a copy first.
            let shape = dims(&p);
            let mut out = vec![0.0f32; g.len()];
            moments
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
        // the moments also held here (new buffers; the held ones must not change).
        for shared in [false, true] {
            let (p0, m0, v0) = (t(&p, &device), t(&m, &device), t(&v, &device));
            let held = shared.then(|| (p0.clone(), m0.clone(), v0.clone()));
            let (fp, fm, fv) = adamw_update(p0, t(&g, &device), m0, v0, &hyper).unwrap();
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
        };
        let a = t(&[1.0, 2.0], &device);
        let b = t(&[1.0], &device);
        assert!(adamw_update(a.clone(), b, a.clone(), a, &hyper).is_err());
    }
}
