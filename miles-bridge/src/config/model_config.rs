//! [`ModelConfig`]: the hyper-parameters of a decoder-only model of any supported
//! architecture, and what is derived from them (RoPE frequencies, softmax scale, which layers
//! are MoE, the HF `config.json` written on export).

use serde_json::Value;

use crate::config::architecture::{
    Architecture, ExpertCountField, MoeLayers, RouterKind, SharedExpertKind,
};
use crate::config::linear::LinearAttentionConfig;
use crate::config::mla::MlaConfig;
use crate::config::rope::{Llama3RopeScaling, YarnRopeScaling, yarn_mscale};
use crate::error::BridgeError;

/// Hyper-parameters of a decoder-only model of any supported [`Architecture`].
///
/// Field names are the HF ones (`n_routed_experts` also holds Qwen3-MoE's `num_experts`).
/// Build it with [`ModelConfig::from_hf_json`], which looks `model_type` up in the
/// architecture table and reads the fields as that row says (both the transformers-5 layout
/// with `rope_parameters` and the older top-level `rope_theta` / `partial_rotary_factor` /
/// `rope_scaling` layout are accepted), or by hand, then call [`ModelConfig::validate`] (done
/// by `init` / the loaders).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which architecture (HF `model_type`).
    pub architecture: Architecture,
    /// How MoE layers route (ignored by dense models).
    pub router: RouterKind,
    /// Llama-3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// YaRN RoPE scaling, if any (DeepSeek-V3).
    pub yarn: Option<YarnRopeScaling>,
    /// Multi-head latent attention (DeepSeek-V3); `None` for the other architectures.
    pub mla: Option<MlaConfig>,
    /// DeepSeek-V3 multi-token-prediction layers in the checkpoint (`num_nextn_predict_layers`,
    /// stored as layers `num_hidden_layers..`): skipped on import, never trained or exported.
    pub num_nextn_predict_layers: usize,
    /// Qwen3-MoE: every `decoder_sparse_step`-th layer is MoE.
    pub decoder_sparse_step: usize,
    /// Qwen3-MoE: layers that stay dense.
    pub mlp_only_layers: Vec<usize>,
    /// GLM-4.7-Flash: each layer's MLP kind (`mlp_layer_types`, one entry per layer); empty
    /// for the architectures that place MoE layers otherwise.
    pub mlp_layer_types: Vec<MlpLayerType>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP layers (`first_k_dense_replace` first layers).
    pub intermediate_size: usize,
    /// Intermediate size of one routed (and one shared) expert.
    pub moe_intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key / value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Fraction of each head's channels that is rotated (GLM: 0.5).
    pub partial_rotary_factor: f64,
    /// Whether q/k/v projections have a bias.
    pub attention_bias: bool,
    /// Whether q and k are RMS-normalised per head before RoPE.
    pub use_qk_norm: bool,
    /// Number of routed experts.
    pub n_routed_experts: usize,
    /// Number of shared experts (their widths are concatenated into one MLP).
    pub n_shared_experts: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Number of expert groups for group-limited routing.
    pub n_group: usize,
    /// Number of groups kept per token.
    pub topk_group: usize,
    /// Whether the chosen gate weights are renormalised to sum to one.
    pub norm_topk_prob: bool,
    /// Factor applied to the routed experts' gate weights.
    pub routed_scaling_factor: f64,
    /// The first `first_k_dense_replace` layers use a dense MLP instead of the MoE.
    pub first_k_dense_replace: usize,
    /// Whether `lm_head` shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest position the model was trained for (informational).
    pub max_position_embeddings: usize,
    /// Standard deviation of the random initialisation used by `init`.
    pub initializer_range: f64,
    /// Qwen3.5: each layer's token mixer (`layer_types`); empty for the architectures whose
    /// layers are all full attention.
    pub layer_types: Vec<LayerType>,
    /// Qwen3.5: the Gated DeltaNet shapes (`linear_*` fields); `None` without linear layers.
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Qwen3.5-MoE: width of the gated shared expert (`shared_expert_intermediate_size`).
    pub shared_expert_intermediate_size: usize,
    /// A vision-language checkpoint (Qwen3.5's `Qwen3_5ForConditionalGeneration`): its
    /// `config.json` (vision config, special token ids, ...; of `text_config` only the fields
    /// this crate does not read, such as `rope_parameters.mrope_section`), written back around
    /// the text config on export. `None`: a text-only checkpoint.
    pub multimodal: Option<Value>,
    /// GPT-OSS: `sliding_window`, the keys a sliding layer's query sees (itself and the
    /// `sliding_window - 1` before it); `None` without sliding layers.
    pub sliding_window: Option<usize>,
    /// GPT-OSS: which layers slide (`layer_types`: `sliding_attention` true,
    /// `full_attention` false), one entry per layer; empty for the other architectures.
    pub sliding_layers: Vec<bool>,
    /// GPT-OSS: `swiglu_alpha`, the sigmoid gain of the experts' clamped SwiGLU.
    pub swiglu_alpha: f64,
    /// GPT-OSS: `swiglu_limit`, the clamp of the experts' gate (above) and up (both sides).
    pub swiglu_limit: f64,
}

/// One entry of `layer_types`: a layer's token mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// `full_attention`: (gated) softmax attention with a KV cache.
    FullAttention,
    /// `linear_attention`: a Gated DeltaNet layer with a conv and a recurrent state.
    LinearAttention,
}

impl LayerType {
    /// Parses the `config.json` name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "full_attention" => Some(Self::FullAttention),
            "linear_attention" => Some(Self::LinearAttention),
            _ => None,
        }
    }

    /// The `config.json` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::LinearAttention => "linear_attention",
        }
    }

    /// transformers' layout when `layer_types` is absent: every `interval`-th layer full
    /// attention, the others linear.
    pub fn interval_layout(layers: usize, interval: usize) -> Vec<Self> {
        (0..layers)
            .map(|l| {
                if (l + 1).is_multiple_of(interval.max(1)) {
                    Self::FullAttention
                } else {
                    Self::LinearAttention
                }
            })
            .collect()
    }
}

/// One entry of `mlp_layer_types`: whether a layer's MLP is dense or a mixture of experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpLayerType {
    /// `dense`: one MLP of `intermediate_size`.
    Dense,
    /// `sparse`: routed experts (plus the shared ones).
    Sparse,
}

impl MlpLayerType {
    /// Parses the `config.json` name (`dense` / `sparse`).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "dense" => Some(Self::Dense),
            "sparse" => Some(Self::Sparse),
            _ => None,
        }
    }

    /// The `config.json` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Sparse => "sparse",
        }
    }

    /// transformers' default when `mlp_layer_types` is absent: layer 0 dense, the rest sparse.
    pub fn default_layout(layers: usize) -> Vec<Self> {
        (0..layers)
            .map(|l| if l == 0 { Self::Dense } else { Self::Sparse })
            .collect()
    }
}

impl ModelConfig {
    /// RoPE inverse frequencies (`rotary_dim / 2` of them), in f32 as transformers computes
    /// them, with Llama-3 or YaRN scaling applied when configured.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim();
        if let Some(yarn) = self.yarn {
            return yarn.inv_freq(dim, self.rope_theta);
        }
        let base: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / (self.rope_theta as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let Some(s) = self.rope_scaling else {
            return base;
        };
        let (factor, low, high) = (
            s.factor as f32,
            s.low_freq_factor as f32,
            s.high_freq_factor as f32,
        );
        let old = s.original_max_position_embeddings as f32;
        let (low_wavelen, high_wavelen) = (old / low, old / high);
        base.into_iter()
            .map(|f| {
                let wavelen = 2.0 * std::f32::consts::PI / f;
                if wavelen < high_wavelen {
                    f
                } else if wavelen > low_wavelen {
                    f / factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * f / factor + smooth * f
                }
            })
            .collect()
    }

    /// The factor RoPE's cos / sin tables are multiplied by (YaRN's attention factor; 1
    /// otherwise).
    pub fn rope_attention_factor(&self) -> f64 {
        self.yarn.map_or(1.0, |y| y.attention_factor())
    }

    /// The softmax scale of attention: `1 / sqrt(head_dim)`, for MLA `1 / sqrt(qk_nope +
    /// qk_rope)` times `mscale(factor, mscale_all_dim)²` under YaRN with `mscale_all_dim`
    /// set (transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f64 {
        let Some(mla) = self.mla else {
            return 1.0 / (self.head_dim as f64).sqrt();
        };
        let base = (mla.qk_head_dim() as f64).powf(-0.5);
        match self.yarn {
            Some(YarnRopeScaling {
                factor,
                mscale_all_dim: Some(all),
                ..
            }) if all != 0.0 => {
                let m = yarn_mscale(factor, all);
                base * m * m
            }
            _ => base,
        }
    }

    /// Number of channels of each head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Whether layer `layer` is an MoE layer (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match self.architecture.spec().moe.layers {
            MoeLayers::FromFirstKDense => layer >= self.first_k_dense_replace,
            MoeLayers::EverySparseStep => {
                self.n_routed_experts > 0
                    && !self.mlp_only_layers.contains(&layer)
                    && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
            }
            MoeLayers::FromLayerTypes => {
                self.mlp_layer_types.get(layer) == Some(&MlpLayerType::Sparse)
            }
            MoeLayers::All => self.n_routed_experts > 0,
            MoeLayers::None => false,
        }
    }

    /// Whether layer `layer` is a Gated DeltaNet linear-attention layer.
    pub fn is_linear_layer(&self, layer: usize) -> bool {
        self.layer_types.get(layer) == Some(&LayerType::LinearAttention)
    }

    /// The sliding window of layer `layer` (`None`: full attention).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|_| self.sliding_layers.get(layer) == Some(&true))
    }

    /// Whether any layer is an MoE layer.
    pub fn has_moe(&self) -> bool {
        (0..self.num_hidden_layers).any(|l| self.is_moe_layer(l))
    }

    /// The routing shape miles-r3 maps rollout routing onto (which layers are MoE, experts,
    /// top-k), or `None` for a dense model.
    pub fn moe_model(&self) -> Result<Option<miles_r3::MoeModel>, BridgeError> {
        let layers: Vec<usize> = (0..self.num_hidden_layers)
            .filter(|&l| self.is_moe_layer(l))
            .collect();
        if layers.is_empty() {
            return Ok(None);
        }
        Ok(Some(miles_r3::MoeModel::new(
            self.num_hidden_layers,
            layers,
            self.n_routed_experts,
            self.num_experts_per_tok,
        )?))
    }

    /// Checks internal consistency.
    pub fn validate(&self) -> Result<(), BridgeError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ];
        let moe = [
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_routed_experts", self.n_routed_experts),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ];
        let has_moe = self.has_moe();
        for (field, value) in positive
            .into_iter()
            .chain(moe.into_iter().filter(|_| has_moe))
        {
            if value == 0 {
                return Err(BridgeError::config(field, "must be positive"));
            }
        }
        if self.intermediate_size == 0
            && (0..self.num_hidden_layers).any(|layer| !self.is_moe_layer(layer))
        {
            return Err(BridgeError::config(
                "intermediate_size",
                "must be positive: the model has dense MLP layers",
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(BridgeError::config(
                "num_key_value_heads",
                "must divide num_attention_heads",
            ));
        }
        let rotary = self.rotary_dim();
        if !(0.0..=1.0).contains(&self.partial_rotary_factor) || !rotary.is_multiple_of(2) {
            return Err(BridgeError::config(
                "partial_rotary_factor",
                format!("head_dim * factor = {rotary} must be an even channel count"),
            ));
        }
        if self.architecture.spec().moe.layers == MoeLayers::FromLayerTypes
            && self.mlp_layer_types.len() != self.num_hidden_layers
        {
            return Err(BridgeError::config(
                "mlp_layer_types",
                format!(
                    "has {} entries for {} layers (num_hidden_layers)",
                    self.mlp_layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if let Some(lin) = self.linear_attention {
            if self.layer_types.len() != self.num_hidden_layers {
                return Err(BridgeError::config(
                    "layer_types",
                    format!(
                        "has {} entries for {} layers (num_hidden_layers)",
                        self.layer_types.len(),
                        self.num_hidden_layers
                    ),
                ));
            }
            for (field, value) in [
                ("linear_conv_kernel_dim", lin.conv_kernel_dim),
                ("linear_key_head_dim", lin.key_head_dim),
                ("linear_value_head_dim", lin.value_head_dim),
                ("linear_num_key_heads", lin.num_key_heads),
                ("linear_num_value_heads", lin.num_value_heads),
            ] {
                if value == 0 {
                    return Err(BridgeError::config(field, "must be positive"));
                }
            }
            if !lin.num_value_heads.is_multiple_of(lin.num_key_heads) {
                return Err(BridgeError::config(
                    "linear_num_value_heads",
                    "must be a multiple of linear_num_key_heads",
                ));
            }
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return Err(BridgeError::config("rms_norm_eps", "must be positive"));
        }
        if let Some(mla) = self.mla {
            for (field, value) in [
                ("kv_lora_rank", mla.kv_lora_rank),
                ("qk_nope_head_dim", mla.qk_nope_head_dim),
                ("qk_rope_head_dim", mla.qk_rope_head_dim),
                ("v_head_dim", mla.v_head_dim),
                ("q_lora_rank", mla.q_lora_rank.unwrap_or(1)),
            ] {
                if value == 0 {
                    return Err(BridgeError::config(field, "must be positive"));
                }
            }
            if self.partial_rotary_factor != 1.0 {
                return Err(BridgeError::config(
                    "partial_rotary_factor",
                    "latent attention rotates the whole rope key (only 1.0)",
                ));
            }
            if self.head_dim != mla.qk_rope_head_dim {
                return Err(BridgeError::config(
                    "qk_rope_head_dim",
                    "the rotary head must be the rope key (head_dim = qk_rope_head_dim)",
                ));
            }
        }
        if let Some(y) = self.yarn {
            let finite = [
                y.factor,
                y.original_max_position_embeddings,
                y.beta_fast,
                y.beta_slow,
            ]
            .iter()
            .all(|v| v.is_finite() && *v > 0.0);
            if !finite {
                return Err(BridgeError::config(
                    "rope_parameters",
                    "yarn factor, original_max_position_embeddings, beta_fast and beta_slow \
                     must be positive",
                ));
            }
        }
        if self.architecture.spec().sliding_layer_types {
            if self.sliding_layers.len() != self.num_hidden_layers {
                return Err(BridgeError::config(
                    "layer_types",
                    format!(
                        "has {} entries for {} layers (num_hidden_layers)",
                        self.sliding_layers.len(),
                        self.num_hidden_layers
                    ),
                ));
            }
            if self.sliding_window == Some(0) {
                return Err(BridgeError::config("sliding_window", "must be positive"));
            }
            if !(self.swiglu_limit > 0.0 && self.swiglu_alpha.is_finite()) {
                return Err(BridgeError::config(
                    "swiglu_limit",
                    "swiglu_limit must be positive and swiglu_alpha finite",
                ));
            }
        }
        if !has_moe {
            return Ok(());
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(BridgeError::config(
                "n_group",
                "must divide n_routed_experts",
            ));
        }
        if self.topk_group > self.n_group {
            return Err(BridgeError::config("topk_group", "must be at most n_group"));
        }
        if self.n_group > 1 && self.n_routed_experts / self.n_group < 2 {
            return Err(BridgeError::config(
                "n_group",
                "groups need at least two experts",
            ));
        }
        let kept = self.topk_group * self.n_routed_experts / self.n_group;
        if self.num_experts_per_tok > kept {
            return Err(BridgeError::config(
                "num_experts_per_tok",
                format!("must be at most the {kept} experts of the kept groups"),
            ));
        }
        Ok(())
    }

    /// The config as HF `config.json` (transformers-5 layout), for export.
    pub fn to_hf_json(&self) -> Value {
        let mut rope = serde_json::json!({
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        });
        if let Some(s) = self.rope_scaling {
            rope["rope_type"] = "llama3".into();
            rope["factor"] = s.factor.into();
            rope["low_freq_factor"] = s.low_freq_factor.into();
            rope["high_freq_factor"] = s.high_freq_factor.into();
            rope["original_max_position_embeddings"] = s.original_max_position_embeddings.into();
        }
        let mut json = serde_json::json!({
            "architectures": [self.architecture.hf_class()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "attention_bias": self.attention_bias,
            "use_qk_norm": self.use_qk_norm,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "hidden_act": "silu",
        });
        let spec = self.architecture.spec();
        if spec.sliding_window {
            json["use_sliding_window"] = false.into();
        }
        if let Some(y) = self.yarn {
            let rope = &mut json["rope_parameters"];
            rope["rope_type"] = "yarn".into();
            rope["factor"] = y.factor.into();
            rope["original_max_position_embeddings"] = y.original_max_position_embeddings.into();
            rope["beta_fast"] = y.beta_fast.into();
            rope["beta_slow"] = y.beta_slow.into();
            rope["truncate"] = y.truncate.into();
            for (key, value) in [
                ("mscale", y.mscale),
                ("mscale_all_dim", y.mscale_all_dim),
                ("attention_factor", y.attention_factor),
            ] {
                if let Some(v) = value {
                    rope[key] = v.into();
                }
            }
        }
        if let Some(m) = self.mla {
            json["q_lora_rank"] = serde_json::json!(m.q_lora_rank);
            json["kv_lora_rank"] = m.kv_lora_rank.into();
            json["qk_nope_head_dim"] = m.qk_nope_head_dim.into();
            json["qk_rope_head_dim"] = m.qk_rope_head_dim.into();
            json["v_head_dim"] = m.v_head_dim.into();
            json["rope_interleave"] = m.rope_interleave.into();
            json["num_nextn_predict_layers"] = self.num_nextn_predict_layers.into();
        }
        // The expert count also under the field the architecture reads it from first, and the
        // sparse-step layout's fields.
        if spec.moe.expert_count_fields.first() == Some(&ExpertCountField::NumExperts) {
            json["num_experts"] = self.n_routed_experts.into();
        }
        match spec.moe.layers {
            MoeLayers::EverySparseStep => {
                json["decoder_sparse_step"] = self.decoder_sparse_step.into();
                json["mlp_only_layers"] = serde_json::json!(self.mlp_only_layers);
            }
            MoeLayers::FromLayerTypes => {
                let types: Vec<&str> = self.mlp_layer_types.iter().map(|t| t.name()).collect();
                json["mlp_layer_types"] = serde_json::json!(types);
            }
            MoeLayers::FromFirstKDense | MoeLayers::All | MoeLayers::None => {}
        }
        if let Some(lin) = self.linear_attention {
            let types: Vec<&str> = self.layer_types.iter().map(|t| t.name()).collect();
            json["layer_types"] = serde_json::json!(types);
            json["linear_conv_kernel_dim"] = lin.conv_kernel_dim.into();
            json["linear_key_head_dim"] = lin.key_head_dim.into();
            json["linear_value_head_dim"] = lin.value_head_dim.into();
            json["linear_num_key_heads"] = lin.num_key_heads.into();
            json["linear_num_value_heads"] = lin.num_value_heads.into();
        }
        if spec.sliding_layer_types {
            let types: Vec<&str> = self
                .sliding_layers
                .iter()
                .map(|&s| {
                    if s {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            json["layer_types"] = serde_json::json!(types);
            json["sliding_window"] = serde_json::json!(self.sliding_window);
            // transformers' own name for the expert count (`num_experts` is its alias).
            if let Some(obj) = json.as_object_mut() {
                obj.remove("num_experts");
            }
            json["num_local_experts"] = self.n_routed_experts.into();
            json["swiglu_alpha"] = self.swiglu_alpha.into();
            json["swiglu_limit"] = self.swiglu_limit.into();
        }
        if spec.moe.shared_expert == SharedExpertKind::Gated {
            json["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size.into();
        }
        match (&self.multimodal, spec.multimodal) {
            (Some(wrapper), Some(layout)) => {
                // The fields of the source `text_config` this crate does not read (M-RoPE
                // sections, MTP settings, ...) come back around the ones it writes.
                let mut text = wrapper
                    .get("text_config")
                    .filter(|t| t.is_object())
                    .cloned()
                    .unwrap_or_else(|| serde_json::json!({}));
                if let (Some(text), Some(ours)) = (text.as_object_mut(), json.as_object()) {
                    for (key, value) in ours {
                        match (text.get_mut(key), value) {
                            (Some(Value::Object(kept)), Value::Object(new)) => {
                                kept.extend(new.clone());
                            }
                            _ => {
                                text.insert(key.clone(), value.clone());
                            }
                        }
                    }
                    text.remove("architectures");
                }
                text["model_type"] = spec.model_type.into();
                let mut outer = wrapper.clone();
                outer["architectures"] = serde_json::json!([layout.hf_class]);
                outer["model_type"] = layout.model_type.into();
                outer["tie_word_embeddings"] = self.tie_word_embeddings.into();
                outer["text_config"] = text;
                outer
            }
            _ => json,
        }
    }
}
