//! The burn modules a `CausalLm` is made of, with HF's parameter names and layouts: linear
//! layers ([`Linear`], and [`FusedLinear`] for inference), [`RmsNorm`], the SwiGLU [`Mlp`],
//! [`Rope`], grouped-query [`Attention`] and DeepSeek-V3's [`LatentAttention`], the
//! mixture-of-experts [`MoeBlock`] and GPT-OSS's [`BiasedMoeBlock`], and the decoder built from them ([`DecoderLayer`],
//! [`DecoderModel`]); plus the parameter visitors ([`ParamRef`], [`ParamVisitor`]) that
//! export, optimizers and gradient checks walk the parameters with.

pub(crate) mod attention;
pub(crate) mod biased_moe;
pub(crate) mod gated_delta;
pub(crate) mod layer;
pub(crate) mod linear;
pub(crate) mod mla;
pub(crate) mod mlp;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod param;
pub(crate) mod rope;

pub use attention::{
    Attention, attention_mask, sliding_window_mask, sliding_window_mask_by_position,
};
pub use biased_moe::BiasedMoeBlock;
pub use gated_delta::{DELTA_CHUNK, GatedDeltaNet, LinearState};
pub use layer::{DecoderLayer, DecoderModel, FeedForward, SelfAttention};
pub use linear::{DecodeWeights, FusedLinear, FusedWeight, Linear};
pub use mla::LatentAttention;
pub use mlp::Mlp;
pub use moe::{Experts, MoeBlock, PackedMoe, TopkRouter};
pub use norm::RmsNorm;
pub use param::{ParamRef, ParamVisitor};
pub use rope::Rope;
