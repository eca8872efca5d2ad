//! The SwiGLU MLP ([`Mlp`]) and its activation.

use burn::module::Module;
use burn::tensor::Tensor;

use crate::error::BridgeError;
use crate::nn::linear::{DecodeWeights, FusedLinear, Linear};
use crate::nn::param::{Builder, ParamVisitor};

/// `silu(gate) * up`: one fused op on flex, tensor ops elsewhere (equal shapes by
/// construction; the fallback only re-raises burn's own shape panic).
pub(crate) fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    miles_ops::swiglu(gate.clone(), up.clone())
        .unwrap_or_else(|_| miles_ops::swiglu_reference(gate, up))
}

/// SwiGLU MLP `down(silu(gate(x)) * up(x))` (no biases).
#[derive(Module, Debug)]
pub struct Mlp {
    /// `gate_proj`.
    pub gate_proj: Linear,
    /// `up_proj`.
    pub up_proj: Linear,
    /// `down_proj`.
    pub down_proj: Linear,
    /// Inference only: `gate_proj` and `up_proj` fused ([`FusedLinear`]); `None` runs them
    /// separately.
    #[module(skip)]
    pub fused_gate_up: Option<FusedLinear>,
    /// Inference only: `down_proj` through [`FusedLinear`] (split over both cores on flex).
    #[module(skip)]
    pub packed_down: Option<FusedLinear>,
}

impl Mlp {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, BridgeError> {
        Ok(Self {
            gate_proj: Linear::build(b, &format!("{name}.gate_proj"), hidden, intermediate, false)?,
            up_proj: Linear::build(b, &format!("{name}.up_proj"), hidden, intermediate, false)?,
            down_proj: Linear::build(b, &format!("{name}.down_proj"), intermediate, hidden, false)?,
            fused_gate_up: None,
            packed_down: None,
        })
    }

    /// Applies the MLP to `[tokens, hidden]` rows.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = match &self.fused_gate_up {
            Some(fused) if fused.is_glu() => fused.forward_all(x),
            Some(fused) => {
                let mut parts = fused.forward(x).into_iter();
                match (parts.next(), parts.next()) {
                    (Some(gate), Some(up)) => swiglu(gate, up),
                    // Built from exactly two layers (`fuse`), so this never runs.
                    _ => unreachable!("fused gate / up of two layers"),
                }
            }
            None => swiglu(self.gate_proj.forward(x.clone()), self.up_proj.forward(x)),
        };
        match &self.packed_down {
            Some(down) => down.forward_all(h),
            None => self.down_proj.forward(h),
        }
    }

    /// Fuses `gate_proj` and `up_proj` for inference (see [`FusedLinear::glu`]).
    pub fn fuse(&mut self, decode: DecodeWeights) {
        self.fused_gate_up = Some(FusedLinear::glu(&self.gate_proj, &self.up_proj, decode));
        self.packed_down = Some(FusedLinear::new(&[&self.down_proj], decode));
    }

    /// Drops the inference-only fused copies ([`Mlp::fuse`]).
    pub(crate) fn unfuse(&mut self) {
        self.fused_gate_up = None;
        self.packed_down = None;
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        self.gate_proj.visit(&format!("{name}.gate_proj"), f);
        self.up_proj.visit(&format!("{name}.up_proj"), f);
        self.down_proj.visit(&format!("{name}.down_proj"), f);
    }
}
