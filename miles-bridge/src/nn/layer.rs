//! A decoder layer and the decoder: [`SelfAttention`] (grouped-query or latent),
//! [`FeedForward`] (dense or MoE), [`DecoderLayer`] and [`DecoderModel`].

use burn::module::{Module, Param};
use burn::tensor::{Bool, Tensor};

use crate::kv_cache::LayerCache;
use crate::nn::attention::{Attention, KvTarget};
use crate::nn::biased_moe::BiasedMoeBlock;
use crate::nn::gated_delta::GatedDeltaNet;
use crate::nn::linear::Linear;
use crate::nn::mla::LatentAttention;
use crate::nn::mlp::Mlp;
use crate::nn::moe::MoeBlock;
use crate::nn::norm::RmsNorm;
use crate::nn::param::ParamVisitor;
use crate::nn::rope::Rope;

/// The MLP of a decoder layer.
// Layers are few and long-lived; boxing the MoE variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum FeedForward {
    /// Dense SwiGLU (`first_k_dense_replace` first layers).
    Dense(Mlp),
    /// Routed + shared experts.
    Moe(MoeBlock),
    /// GPT-OSS: routed experts with biases and a clamped SwiGLU behind a biased router.
    BiasedMoe(BiasedMoeBlock),
}

/// The attention of a decoder layer.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum SelfAttention {
    /// Grouped-query attention (every architecture but DeepSeek-V3).
    Grouped(Attention),
    /// Multi-head latent attention (DeepSeek-V3).
    Latent(LatentAttention),
    /// Qwen3.5's Gated DeltaNet linear attention (`linear_attn`): no KV cache, a conv and a
    /// recurrent state instead ([`crate::KvCache`] keeps them beside the full layers' keys).
    Linear(GatedDeltaNet),
}

impl SelfAttention {
    /// Attends `x` (`[batch, seq, hidden]`); see [`Attention::forward`] and
    /// [`LatentAttention::forward`].
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: Tensor<4, Bool>,
        cache: Option<&mut Option<LayerCache>>,
    ) -> Tensor<3> {
        self.forward_kv(x, rope, KvTarget::new(mask, cache))
    }

    pub(crate) fn forward_kv(&self, x: Tensor<3>, rope: &Rope, target: KvTarget<'_>) -> Tensor<3> {
        match (self, target) {
            (Self::Grouped(a), target) => a.forward_kv(x, rope, target),
            (Self::Latent(a), target) => a.forward_kv(x, rope, target),
            (Self::Linear(a), KvTarget::Plain(_)) => a.forward(x, None, None),
            // `CausalLm::forward_cached` and `CausalLm::forward_paged` hand linear layers
            // their state before any layer runs.
            (Self::Linear(_), _) => unreachable!("a linear-attention layer given a KV target"),
        }
    }

    /// The module's HF name in its decoder layer: `self_attn`, or `linear_attn` for a
    /// Gated DeltaNet layer.
    pub fn hf_name(&self) -> &'static str {
        match self {
            Self::Linear(_) => "linear_attn",
            _ => "self_attn",
        }
    }

    /// Key / value heads and width of a cached position (see the paged KV cache), and whether
    /// values are stored.
    pub(crate) fn cache_shape(&self) -> (usize, usize, bool) {
        match self {
            Self::Grouped(a) => (a.num_kv_heads, a.head_dim, true),
            Self::Latent(a) => (1, a.cache_width(), false),
            // No keys: the paged pool keeps state slots for linear layers instead.
            Self::Linear(_) => (0, 0, false),
        }
    }

    /// Every linear layer with its name relative to `self_attn`, in a fixed order.
    pub(crate) fn linears(&self) -> Vec<(&'static str, &Linear)> {
        match self {
            Self::Grouped(a) => vec![
                ("q_proj", &a.q_proj),
                ("k_proj", &a.k_proj),
                ("v_proj", &a.v_proj),
                ("o_proj", &a.o_proj),
            ],
            Self::Latent(a) => a.linears(),
            Self::Linear(a) => a.linears(),
        }
    }

    /// Mutable twin of [`Self::linears`] (same order).
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        match self {
            Self::Grouped(a) => vec![
                ("q_proj", &mut a.q_proj),
                ("k_proj", &mut a.k_proj),
                ("v_proj", &mut a.v_proj),
                ("o_proj", &mut a.o_proj),
            ],
            Self::Latent(a) => a.linears_mut(),
            Self::Linear(a) => a.linears_mut(),
        }
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        match self {
            Self::Grouped(a) => a.visit(name, f),
            Self::Latent(a) => a.visit(name, f),
            Self::Linear(a) => a.visit(name, f),
        }
    }
}

/// One decoder layer: pre-norm attention and pre-norm MLP with residuals.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// `input_layernorm`.
    pub input_layernorm: RmsNorm,
    /// `self_attn` (`linear_attn` for a [`SelfAttention::Linear`] layer).
    pub self_attn: SelfAttention,
    /// `post_attention_layernorm`.
    pub post_attention_layernorm: RmsNorm,
    /// `mlp`.
    pub mlp: FeedForward,
}

/// `model.*`: embeddings, decoder layers, final norm.
#[derive(Module, Debug)]
pub struct DecoderModel {
    /// `embed_tokens.weight`, `[vocab, hidden]`.
    pub embed_tokens: Param<Tensor<2>>,
    /// `layers.{i}`.
    pub layers: Vec<DecoderLayer>,
    /// `norm`.
    pub norm: RmsNorm,
}
