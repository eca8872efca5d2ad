//! GPT-OSS's mixture-of-experts layer ([`BiasedMoeBlock`], transformers 5.24's `GptOssMLP`):
//! a router with a bias and experts with biases and a clamped SwiGLU, kept in HF's fused
//! layout (no remap: the parameters are the checkpoint's tensors).
//!
//! Router (`mlp.router`): logits `x W^T + b` (f32), the [`RouterHook`] picks the top-k of
//! the logits, the gate weights are the softmax over the chosen logits. Experts
//! (`mlp.experts`): `gate_up = x · gate_up_proj[e] + gate_up_proj_bias[e]` (`[2 I]`, gate in
//! the even columns, up in the odd ones), `g = min(gate, limit)`, `u = clamp(up, -limit,
//! limit)`, `act = (u + 1) · g · sigmoid(alpha · g)`, `out = act · down_proj[e] +
//! down_proj_bias[e]`, and the layer's output is `sum_k w_k out_{e_k}`. Every expert runs on
//! every token and unchosen experts are weighted by zero (the dense dispatch of
//! [`crate::nn::MoeBlock`]: static shapes, nothing read back to the host). With LoRA
//! attached to the fused expert parameters ([`ParamLora`], PEFT's `target_parameters`) the
//! experts use `gate_up_proj + Δ` / `down_proj + Δ` (the merged form).
use burn::module::{Module, Param};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::{FloatDType, IndexingUpdateOp, Tensor};
use miles_r3::{MoeLayerInfo, RouterHook};

use crate::error::BridgeError;
use crate::lora::ParamLora;
use crate::nn::moe::MoeRouting;
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor};
use crate::profile::{self, OpClass};

/// The MoE MLP of one GPT-OSS layer (`mlp`).
#[derive(Module, Debug)]
pub struct BiasedMoeBlock {
    /// `mlp.router.weight`, `[E, hidden]`.
    pub router_weight: Param<Tensor<2>>,
    /// `mlp.router.bias`, `[E]`.
    pub router_bias: Param<Tensor<1>>,
    /// `mlp.experts.gate_up_proj`, `[E, hidden, 2 I]` (gate / up columns interleaved).
    pub gate_up_proj: Param<Tensor<3>>,
    /// `mlp.experts.gate_up_proj_bias`, `[E, 2 I]`.
    pub gate_up_proj_bias: Param<Tensor<2>>,
    /// `mlp.experts.down_proj`, `[E, I, hidden]`.
    pub down_proj: Param<Tensor<3>>,
    /// `mlp.experts.down_proj_bias`, `[E, hidden]`.
    pub down_proj_bias: Param<Tensor<2>>,
    /// LoRA on `gate_up_proj`, if attached.
    pub gate_up_proj_lora: Option<ParamLora>,
    /// LoRA on `down_proj`, if attached.
    pub down_proj_lora: Option<ParamLora>,
    /// `swiglu_alpha`.
    pub alpha: f64,
    /// `swiglu_limit`.
    pub limit: f64,
    /// Model layer index (for the router hook).
    pub layer_index: usize,
    /// Index among MoE layers.
    pub moe_index: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// Shape of a [`BiasedMoeBlock`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct BiasedMoeShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub alpha: f64,
    pub limit: f64,
    pub layer_index: usize,
    pub moe_index: usize,
}

impl BiasedMoeBlock {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        s: BiasedMoeShape,
    ) -> Result<Self, BridgeError> {
        let (e, h, i) = (s.experts, s.hidden, s.intermediate);
        Ok(Self {
            router_weight: b.param(&format!("{name}.router.weight"), [e, h], Init::Normal)?,
            router_bias: b.param(&format!("{name}.router.bias"), [e], Init::Zeros)?,
            gate_up_proj: b.param(
                &format!("{name}.experts.gate_up_proj"),
                [e, h, 2 * i],
                Init::Normal,
            )?,
            gate_up_proj_bias: b.param(
                &format!("{name}.experts.gate_up_proj_bias"),
                [e, 2 * i],
                Init::Zeros,
            )?,
            down_proj: b.param(
                &format!("{name}.experts.down_proj"),
                [e, i, h],
                Init::Normal,
            )?,
            down_proj_bias: b.param(
                &format!("{name}.experts.down_proj_bias"),
                [e, h],
                Init::Zeros,
            )?,
            gate_up_proj_lora: None,
            down_proj_lora: None,
            alpha: s.alpha,
            limit: s.limit,
            layer_index: s.layer_index,
            moe_index: s.moe_index,
            top_k: s.top_k,
        })
    }

    fn effective(weight: &Param<Tensor<3>>, lora: &Option<ParamLora>) -> Tensor<3> {
        match lora {
            Some(lora) => weight.val() + lora.delta(),
            None => weight.val(),
        }
    }

    /// `gate_up_proj` with its adapter merged in, `[E, hidden, 2 I]`.
    pub fn effective_gate_up_proj(&self) -> Tensor<3> {
        Self::effective(&self.gate_up_proj, &self.gate_up_proj_lora)
    }

    /// `down_proj` with its adapter merged in, `[E, I, hidden]`.
    pub fn effective_down_proj(&self) -> Tensor<3> {
        Self::effective(&self.down_proj, &self.down_proj_lora)
    }

    /// Routes and applies the experts to `[tokens, hidden]` rows.
    pub fn forward(
        &self,
        x: Tensor<2>,
        hook: &dyn RouterHook,
    ) -> Result<(Tensor<2>, MoeRouting), BridgeError> {
        let [tokens, hidden] = x.dims();
        let [experts, _, two_inter] = self.gate_up_proj.val().dims();
        let inter = two_inter / 2;
        let dtype = x.dtype();
        let info = MoeLayerInfo {
            layer_index: self.layer_index,
            moe_index: self.moe_index,
            num_experts: experts,
            top_k: self.top_k,
        };
        let (chosen, weights) = profile::time(OpClass::Router, || -> Result<_, BridgeError> {
            let f32 = FloatDType::F32;
            let logits = x
                .clone()
                .cast(f32)
                .matmul(self.router_weight.val().cast(f32).transpose())
                + self.router_bias.val().cast(f32).unsqueeze_dim(0);
            let chosen = hook.select_experts(&info, logits.clone().detach())?;
            if chosen.dims() != [tokens, self.top_k] {
                return Err(BridgeError::input(format!(
                    "router hook returned shape {:?} for layer {}, expected [{tokens}, {}]",
                    chosen.dims(),
                    self.layer_index,
                    self.top_k
                )));
            }
            let weights = softmax(logits.gather(1, chosen.clone()), 1);
            Ok((chosen, weights.cast(dtype)))
        })?;
        let out = profile::time(OpClass::MoeExperts, || {
            let device = x.device();
            let combine = Tensor::<2>::zeros([tokens, experts], (&device, weights.dtype()))
                .scatter(1, chosen.clone(), weights.clone(), IndexingUpdateOp::Add);
            let gate_up = self
                .effective_gate_up_proj()
                .swap_dims(0, 1)
                .reshape([hidden, experts * two_inter]);
            let gate_up = x.matmul(gate_up)
                + self
                    .gate_up_proj_bias
                    .val()
                    .reshape([1, experts * two_inter]);
            let pairs = gate_up.reshape([tokens, experts, inter, 2]);
            let gate = pairs
                .clone()
                .narrow(3, 0, 1)
                .reshape([tokens, experts, inter])
                .clamp_max(self.limit);
            let up = pairs
                .narrow(3, 1, 1)
                .reshape([tokens, experts, inter])
                .clamp(-self.limit, self.limit);
            let glu = gate.clone() * sigmoid(gate * self.alpha);
            let act = (up + 1.0) * glu * combine.clone().unsqueeze_dim(2);
            act.reshape([tokens, experts * inter]).matmul(
                self.effective_down_proj()
                    .reshape([experts * inter, hidden]),
            ) + combine.matmul(self.down_proj_bias.val())
        });
        Ok((
            out,
            MoeRouting {
                layer_index: self.layer_index,
                experts: chosen,
                weights,
            },
        ))
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(
            &format!("{name}.router.weight"),
            ParamRef::R2(&self.router_weight),
        );
        f(
            &format!("{name}.router.bias"),
            ParamRef::R1(&self.router_bias),
        );
        f(
            &format!("{name}.experts.gate_up_proj"),
            ParamRef::R3(&self.gate_up_proj),
        );
        f(
            &format!("{name}.experts.gate_up_proj_bias"),
            ParamRef::R2(&self.gate_up_proj_bias),
        );
        f(
            &format!("{name}.experts.down_proj"),
            ParamRef::R3(&self.down_proj),
        );
        f(
            &format!("{name}.experts.down_proj_bias"),
            ParamRef::R2(&self.down_proj_bias),
        );
    }
}
