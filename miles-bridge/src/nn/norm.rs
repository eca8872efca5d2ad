//! [`RmsNorm`].

use burn::module::{Module, Param};
use burn::tensor::{DType, FloatDType, Tensor};

use crate::error::BridgeError;
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor};

/// RMSNorm over the last dimension: `w * x / sqrt(mean(x²) + eps)`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Scale, `[d]`.
    pub weight: Param<Tensor<1>>,
    /// Epsilon.
    pub eps: f64,
}

impl RmsNorm {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        d: usize,
        eps: f64,
    ) -> Result<Self, BridgeError> {
        Ok(Self {
            weight: b.param(&format!("{name}.weight"), [d], Init::Ones)?,
            eps,
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let dtype = x.dtype();
        if dtype != DType::F32 {
            // Half precision: the statistics in f32 and the normalised values rounded to the
            // compute dtype before the scale, as transformers' RMSNorm does.
            let xf = x.cast(FloatDType::F32);
            let inv_rms = (xf.clone().square().mean_dim(D - 1) + self.eps)
                .sqrt()
                .recip();
            return (xf * inv_rms).cast(dtype) * weight.cast(dtype).unsqueeze();
        }
        // One fused op on flex, tensor ops elsewhere (the weight is `[d]` by construction).
        miles_ops::rms_norm(x.clone(), weight.clone(), self.eps)
            .unwrap_or_else(|_| miles_ops::rms_norm_reference(x, weight, self.eps))
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(&format!("{name}.weight"), ParamRef::R1(&self.weight));
    }
}
