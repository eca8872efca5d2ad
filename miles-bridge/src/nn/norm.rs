//! [`RmsNorm`].

use burn::module::{Module, Param};
use burn::tensor::{DType, FloatDType, Tensor};

use crate::error::BridgeError;
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor};

/// RMSNorm over the last dimension: `w * x / sqrt(mean(x²) + eps)`, or with zero-centred
/// weights (Qwen3.5) `(1 + w) * x / sqrt(mean(x²) + eps)`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Scale, `[d]` (the offset from 1 when `unit_offset`).
    pub weight: Param<Tensor<1>>,
    /// Epsilon.
    pub eps: f64,
    /// Whether the scale is `1 + weight` (zero-centred weights).
    pub unit_offset: bool,
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
            unit_offset: false,
        })
    }

    /// A norm whose scale is `1 + weight` (zero-centred, initialised to zeros) when
    /// `unit_offset`, else [`RmsNorm::build`].
    pub(crate) fn build_with(
        b: &mut Builder<'_>,
        name: &str,
        d: usize,
        eps: f64,
        unit_offset: bool,
    ) -> Result<Self, BridgeError> {
        if !unit_offset {
            return Self::build(b, name, d, eps);
        }
        Ok(Self {
            weight: b.param(&format!("{name}.weight"), [d], Init::Zeros)?,
            eps,
            unit_offset: true,
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let dtype = x.dtype();
        if self.unit_offset {
            // transformers' zero-centred norm: `(norm(x.float()) * (1 + w.float())).to(dtype)`.
            let scale = weight.cast(FloatDType::F32) + 1.0;
            if dtype == DType::F32 {
                return miles_ops::rms_norm(x.clone(), scale.clone(), self.eps)
                    .unwrap_or_else(|_| miles_ops::rms_norm_reference(x, scale, self.eps));
            }
            let xf = x.cast(FloatDType::F32);
            let inv_rms = (xf.clone().square().mean_dim(D - 1) + self.eps)
                .sqrt()
                .recip();
            return (xf * inv_rms * scale.unsqueeze()).cast(dtype);
        }
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
