//! The architecture table: one row ([`ArchitectureSpec`]) per supported architecture, keyed by
//! HF `model_type`, holding everything that differs between architectures — their names, the
//! defaults transformers 5.24 gives absent `config.json` fields, the fields an architecture
//! ignores or pins, its RoPE scaling, attention kind and MoE layout. Reading a `config.json`
//! (`ModelConfig::from_hf_json`), writing one back (`ModelConfig::to_hf_json`) and deciding
//! which layers are MoE (`ModelConfig::is_moe_layer`) all read the row; no code elsewhere asks
//! which architecture it is looking at.
//!
//! Adding an architecture: a variant of [`Architecture`] (the row's key, in the table's order)
//! and its row in [`ARCHITECTURES`], plus model code for whatever the existing building blocks
//! do not cover yet.

use crate::config::linear::LinearAttentionConfig;
use crate::config::mla::MlaConfig;
use crate::error::BridgeError;

/// The architectures this crate implements, keyed by HF `model_type`; each one's row in
/// [`ARCHITECTURES`] ([`Architecture::spec`]) says what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `glm4_moe`: GLM-4.5 / 4.6 / 4.7 MoE (sigmoid, group-limited routing, shared experts).
    Glm4Moe,
    /// `qwen3`: dense Qwen3 (qk-norm).
    Qwen3,
    /// `qwen3_moe`: Qwen3 MoE (softmax routing).
    Qwen3Moe,
    /// `llama`: Llama 2 / 3 (Llama-3 RoPE scaling).
    Llama,
    /// `qwen2`: Qwen2 / Qwen2.5 dense (q/k/v bias, no qk-norm; sliding-window attention is
    /// rejected).
    Qwen2,
    /// `deepseek_v3`: DeepSeek-V3 / Moonlight / Kimi-K2 (multi-head latent attention, sigmoid
    /// group-limited routing, shared experts, dense first layers, YaRN RoPE); Kimi-K2's
    /// `kimi_k2` is the same architecture (an alias in its row).
    DeepseekV3,
    /// `glm4_moe_lite`: GLM-4.7-Flash (DeepSeek-V3's latent attention with GLM-4-MoE's router
    /// and experts; which layers are MoE is the per-layer `mlp_layer_types`).
    Glm4MoeLite,
    /// `qwen3_5`: Qwen3.5 / 3.6 dense (Gated DeltaNet linear-attention layers between gated
    /// full-attention layers, zero-centred RMSNorm); `Qwen3_5ForConditionalGeneration`
    /// checkpoints (`model_type: qwen3_5`, vision tower carried through) and text-only
    /// `Qwen3_5ForCausalLM` ones (`qwen3_5_text`).
    Qwen3_5,
    /// `qwen3_5_moe`: Qwen3.5 / 3.6 MoE (the same hybrid layers, every MLP routed experts plus
    /// a shared expert behind a sigmoid gate).
    Qwen3_5Moe,
    /// `gpt_oss`: GPT-OSS (attention sinks, sliding-window attention on the layers
    /// `layer_types` marks, biased q/k/v/o projections, experts with biases and a clamped
    /// SwiGLU behind a biased top-k-then-softmax router, YaRN RoPE).
    GptOss,
}

/// How a `config.json` field becomes a config value for one architecture.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldRule<T> {
    /// Read from `config.json`; this value when the field is absent (transformers' default).
    Read(T),
    /// Always this value, whatever `config.json` says (transformers ignores the field for
    /// this architecture).
    Fixed(T),
}

impl<T: Copy> FieldRule<T> {
    /// The value for a field read as `read` (`None`: absent).
    pub fn resolve(self, read: Option<T>) -> T {
        match self {
            Self::Read(default) => read.unwrap_or(default),
            Self::Fixed(value) => value,
        }
    }
}

/// How an MoE layer scores its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterKind {
    /// GLM-4-MoE / DeepSeek-V3: sigmoid scores, `e_score_correction_bias` for selection only,
    /// group-limited top-k.
    SigmoidGrouped,
    /// Qwen3-MoE / Mixtral: softmax probabilities, plain top-k.
    Softmax,
}

/// The RoPE scaling an architecture accepts besides plain RoPE (`rope_type = "default"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeScalingKind {
    /// `rope_type = "llama3"` (Llama-3 frequency scaling).
    Llama3,
    /// `rope_type = "yarn"` (DeepSeek-V3's YaRN, with `mscale` / `mscale_all_dim`).
    Yarn,
}

impl RopeScalingKind {
    /// The `rope_type` name.
    pub fn rope_type(self) -> &'static str {
        match self {
            Self::Llama3 => "llama3",
            Self::Yarn => "yarn",
        }
    }
}

/// The attention an architecture uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Grouped-query attention over `num_key_value_heads` heads of `head_dim` channels.
    Grouped,
    /// Multi-head latent attention; the shapes absent from `config.json` take these defaults
    /// (`q_lora_rank` present but null is a full `q_proj`). Every head reads the shared latent
    /// (`num_key_value_heads` = `num_attention_heads`) and the rotary "head" is the shared rope
    /// key (`head_dim` = `qk_rope_head_dim`).
    Latent(MlaConfig),
}

/// Which layers of a model are MoE layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeLayers {
    /// None: a dense model.
    None,
    /// Every layer from `first_k_dense_replace` on (GLM-4-MoE, DeepSeek-V3).
    FromFirstKDense,
    /// Every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`, when there are
    /// routed experts (Qwen3-MoE).
    EverySparseStep,
    /// The layers `mlp_layer_types` marks `sparse` (one `dense` / `sparse` entry per layer);
    /// absent, layer 0 is dense and every later layer sparse (GLM-4.7-Flash; transformers
    /// ignores `first_k_dense_replace` here).
    FromLayerTypes,
    /// Every layer (Qwen3.5-MoE).
    All,
}

/// How an MoE layer's shared experts join the routed ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedExpertKind {
    /// `mlp.shared_experts`: `n_shared_experts` experts of `moe_intermediate_size` as one MLP,
    /// added to the routed output (GLM, DeepSeek).
    Summed,
    /// `mlp.shared_expert` of `shared_expert_intermediate_size`, scaled by
    /// `sigmoid(mlp.shared_expert_gate(x))` before it is added (Qwen3.5-MoE).
    Gated,
}

/// The checkpoint layout of a vision-language release whose text model is this
/// architecture: `model_type` and class of the wrapper, the text config under `text_config`,
/// the text model's weights under `model.language_model.*` and the rest (`model.visual.*`)
/// carried through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MultimodalLayout {
    /// The wrapper's `model_type` (`qwen3_5`).
    pub model_type: &'static str,
    /// The wrapper's class (`Qwen3_5ForConditionalGeneration`).
    pub hf_class: &'static str,
}

/// A `config.json` field that holds the number of routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertCountField {
    /// `n_routed_experts`.
    NRoutedExperts,
    /// `num_experts` (or its alias `num_local_experts`).
    NumExperts,
}

/// What an MoE layer's routed experts are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertKind {
    /// SwiGLU experts without biases, stored per expert (`mlp.experts.{e}.gate_proj.weight`,
    /// ...) and stacked per projection in memory (GLM, DeepSeek, Qwen).
    SwiGlu,
    /// GPT-OSS: `mlp.experts.gate_up_proj` `[E, hidden, 2 I]` (gate / up columns
    /// interleaved), `down_proj` `[E, I, hidden]`, both with biases, the clamped SwiGLU
    /// `(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)` with `g = min(gate, limit)`
    /// (`swiglu_alpha`, `swiglu_limit`), behind `mlp.router` (weight and bias: top-k of the
    /// logits, softmax over the chosen ones); see [`crate::nn::BiasedMoeBlock`].
    ClampedSwiGluBiased,
}

/// An architecture's mixture of experts: its layout, router and the defaults of its fields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Which layers are MoE.
    pub layers: MoeLayers,
    /// How MoE layers route.
    pub router: RouterKind,
    /// The fields the routed-expert count is read from, first present wins (none: 0).
    pub expert_count_fields: &'static [ExpertCountField],
    /// The routed-expert count when none of those fields is present.
    pub n_routed_experts: usize,
    /// `n_shared_experts`.
    pub n_shared_experts: FieldRule<usize>,
    /// `norm_topk_prob` when absent.
    pub norm_topk_prob: bool,
    /// `num_experts_per_tok` when absent.
    pub num_experts_per_tok: usize,
    /// `n_group` when absent.
    pub n_group: usize,
    /// `topk_group` when absent.
    pub topk_group: usize,
    /// `routed_scaling_factor` when absent.
    pub routed_scaling_factor: f64,
    /// `first_k_dense_replace` when absent.
    pub first_k_dense_replace: usize,
    /// How the shared experts are added.
    pub shared_expert: SharedExpertKind,
    /// What the routed experts are.
    pub experts: ExpertKind,
}

impl MoeSpec {
    /// A dense model: no MoE layer, no experts; the MoE fields keep the generic defaults.
    pub const DENSE: MoeSpec = MoeSpec {
        layers: MoeLayers::None,
        router: RouterKind::Softmax,
        expert_count_fields: &[],
        n_routed_experts: 0,
        n_shared_experts: FieldRule::Fixed(0),
        norm_topk_prob: false,
        num_experts_per_tok: 0,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
        first_k_dense_replace: 1,
        shared_expert: SharedExpertKind::Summed,
        experts: ExpertKind::SwiGlu,
    };
}

/// A value a pinned field must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedValue {
    /// A string.
    Str(&'static str),
    /// An unsigned integer.
    Int(u64),
}

impl PinnedValue {
    /// Whether `value` is this one.
    pub fn matches(self, value: &serde_json::Value) -> bool {
        match self {
            Self::Str(s) => value.as_str() == Some(s),
            Self::Int(n) => value.as_u64() == Some(n),
        }
    }

    /// How error messages show it.
    pub fn shown(self) -> String {
        match self {
            Self::Str(s) => format!("`{s}`"),
            Self::Int(n) => n.to_string(),
        }
    }
}

/// A field of the architecture's original `config.json` that transformers 5.24 ignores but
/// that would change the model if it held another value: absent or null is fine, the pinned
/// value is fine, anything else is rejected naming the field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedField {
    /// The field.
    pub key: &'static str,
    /// The only value accepted.
    pub value: PinnedValue,
}

/// One row of the architecture table: everything that differs between architectures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ArchitectureSpec {
    /// The row's key.
    pub architecture: Architecture,
    /// The HF `model_type` (what exports write).
    pub model_type: &'static str,
    /// Other `model_type`s read as this architecture.
    pub aliases: &'static [&'static str],
    /// The HF model class (`architectures` in `config.json`).
    pub hf_class: &'static str,
    /// The name messages use.
    pub name: &'static str,
    /// `rms_norm_eps`.
    pub rms_norm_eps: FieldRule<f64>,
    /// `partial_rotary_factor` (in `rope_parameters` or at the top level).
    pub partial_rotary_factor: FieldRule<f64>,
    /// The RoPE scaling accepted besides plain RoPE; any other `rope_type` is rejected.
    pub rope_scaling: Option<RopeScalingKind>,
    /// Grouped-query or latent attention.
    pub attention: AttentionKind,
    /// `attention_bias` (q/k/v biases).
    pub attention_bias: FieldRule<bool>,
    /// `use_qk_norm` (per-head RMSNorm of queries and keys).
    pub use_qk_norm: FieldRule<bool>,
    /// Whether the config has transformers' sliding-window fields (`use_sliding_window`,
    /// `sliding_window`, `max_window_layers`, `layer_types`): read and rejected when they make
    /// any layer slide; exports write `use_sliding_window: false`.
    pub sliding_window: bool,
    /// The mixture of experts ([`MoeSpec::DENSE`] for a dense model).
    pub moe: MoeSpec,
    /// `num_nextn_predict_layers` (multi-token-prediction layers stored after the decoder
    /// layers, skipped on import).
    pub num_nextn_predict_layers: FieldRule<usize>,
    /// Fields that must hold the reference value.
    pub pinned_fields: &'static [PinnedField],
    /// Hybrid linear attention: `layer_types` (`linear_attention` / `full_attention`, absent:
    /// every `full_attention_interval`-th layer full, default 4) and the Gated DeltaNet shapes
    /// absent fields take (`None`: every layer is full attention).
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Whether full attention is gated: `q_proj` gives each head's queries and as many gate
    /// channels, the attention output is multiplied by their sigmoid before `o_proj`.
    pub attention_output_gate: bool,
    /// Whether every RMSNorm of the decoder (not the linear layers' gated norm) scales by
    /// `1 + weight` (zero-centred weights, Qwen3.5) instead of `weight`.
    pub norm_unit_offset: bool,
    /// The vision-language release layout, when the architecture has one.
    pub multimodal: Option<MultimodalLayout>,
    /// Attention sinks: `self_attn.sinks` (`[num_attention_heads]`), a learned logit per head
    /// that joins each query's softmax denominator and is then dropped (GPT-OSS).
    pub attention_sinks: bool,
    /// Whether `o_proj` has a bias when `attention_bias` is set (GPT-OSS; the other
    /// architectures' `o_proj` never has one).
    pub o_proj_bias: bool,
    /// Sliding-window attention read from `layer_types` (`sliding_attention` /
    /// `full_attention`; absent: even layers slide) and `sliding_window`: a sliding layer's
    /// query at cache index `i` sees keys at `i - sliding_window < j <= i` (GPT-OSS).
    pub sliding_layer_types: bool,
}

/// The architecture table, one row per [`Architecture`] variant, in the variants' order.
pub const ARCHITECTURES: &[ArchitectureSpec] = &[
    ArchitectureSpec {
        architecture: Architecture::Glm4Moe,
        model_type: "glm4_moe",
        aliases: &[],
        hf_class: "Glm4MoeForCausalLM",
        name: "GLM-4-MoE",
        rms_norm_eps: FieldRule::Read(1e-5),
        partial_rotary_factor: FieldRule::Read(0.5),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Read(false),
        sliding_window: false,
        moe: MoeSpec {
            layers: MoeLayers::FromFirstKDense,
            router: RouterKind::SigmoidGrouped,
            expert_count_fields: &[ExpertCountField::NRoutedExperts],
            n_shared_experts: FieldRule::Read(1),
            norm_topk_prob: true,
            ..MoeSpec::DENSE
        },
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Qwen3,
        model_type: "qwen3",
        aliases: &[],
        hf_class: "Qwen3ForCausalLM",
        name: "Qwen3",
        rms_norm_eps: FieldRule::Read(1e-6),
        partial_rotary_factor: FieldRule::Read(1.0),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Fixed(true),
        sliding_window: true,
        moe: MoeSpec::DENSE,
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Qwen3Moe,
        model_type: "qwen3_moe",
        aliases: &[],
        hf_class: "Qwen3MoeForCausalLM",
        name: "Qwen3-MoE",
        rms_norm_eps: FieldRule::Read(1e-6),
        partial_rotary_factor: FieldRule::Read(1.0),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Fixed(true),
        sliding_window: false,
        moe: MoeSpec {
            layers: MoeLayers::EverySparseStep,
            router: RouterKind::Softmax,
            expert_count_fields: &[ExpertCountField::NumExperts],
            ..MoeSpec::DENSE
        },
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Llama,
        model_type: "llama",
        aliases: &[],
        hf_class: "LlamaForCausalLM",
        name: "Llama",
        rms_norm_eps: FieldRule::Read(1e-6),
        partial_rotary_factor: FieldRule::Read(1.0),
        rope_scaling: Some(RopeScalingKind::Llama3),
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Read(false),
        sliding_window: false,
        moe: MoeSpec::DENSE,
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Qwen2,
        model_type: "qwen2",
        aliases: &[],
        hf_class: "Qwen2ForCausalLM",
        name: "Qwen2",
        rms_norm_eps: FieldRule::Read(1e-6),
        // Qwen2's rotary embedding rotates the whole head whatever `partial_rotary_factor`
        // says, and its q/k/v always have biases (transformers ignores `attention_bias`).
        partial_rotary_factor: FieldRule::Fixed(1.0),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Fixed(true),
        use_qk_norm: FieldRule::Read(false),
        sliding_window: true,
        moe: MoeSpec::DENSE,
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::DeepseekV3,
        model_type: "deepseek_v3",
        // Kimi-K2's `config.json` says `kimi_k2` for a `DeepseekV3ForCausalLM` (its hub repo
        // ships DeepSeek-V3's remote code; transformers 5.24 has no `kimi_k2` type).
        aliases: &["kimi_k2"],
        hf_class: "DeepseekV3ForCausalLM",
        name: "DeepSeek-V3",
        rms_norm_eps: FieldRule::Read(1e-6),
        // The rotary "head" is the shared rope key, rotated whole.
        partial_rotary_factor: FieldRule::Fixed(1.0),
        rope_scaling: Some(RopeScalingKind::Yarn),
        attention: AttentionKind::Latent(MlaConfig {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: true,
        }),
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Read(false),
        sliding_window: false,
        moe: MoeSpec {
            layers: MoeLayers::FromFirstKDense,
            router: RouterKind::SigmoidGrouped,
            expert_count_fields: &[
                ExpertCountField::NRoutedExperts,
                ExpertCountField::NumExperts,
            ],
            n_routed_experts: 256,
            n_shared_experts: FieldRule::Read(1),
            norm_topk_prob: true,
            num_experts_per_tok: 8,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            first_k_dense_replace: 3,
            shared_expert: SharedExpertKind::Summed,
            experts: ExpertKind::SwiGlu,
        },
        num_nextn_predict_layers: FieldRule::Read(1),
        // DeepSeek's original `config.json` fields: sigmoid scoring, `noaux_tc` top-k, every
        // layer past the dense ones MoE.
        pinned_fields: &[
            PinnedField {
                key: "scoring_func",
                value: PinnedValue::Str("sigmoid"),
            },
            PinnedField {
                key: "topk_method",
                value: PinnedValue::Str("noaux_tc"),
            },
            PinnedField {
                key: "moe_layer_freq",
                value: PinnedValue::Int(1),
            },
        ],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Glm4MoeLite,
        model_type: "glm4_moe_lite",
        aliases: &[],
        hf_class: "Glm4MoeLiteForCausalLM",
        name: "GLM-4.7-Flash",
        rms_norm_eps: FieldRule::Read(1e-5),
        // Read, not fixed: transformers rotates `head_dim * factor` channels of the rope key
        // (the rotary "head"), so only 1.0 is a model it can run; `validate` rejects others.
        partial_rotary_factor: FieldRule::Read(1.0),
        rope_scaling: Some(RopeScalingKind::Yarn),
        attention: AttentionKind::Latent(MlaConfig {
            q_lora_rank: Some(768),
            kv_lora_rank: 512,
            qk_nope_head_dim: 192,
            qk_rope_head_dim: 64,
            v_head_dim: 256,
            rope_interleave: true,
        }),
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Read(false),
        sliding_window: false,
        moe: MoeSpec {
            layers: MoeLayers::FromLayerTypes,
            router: RouterKind::SigmoidGrouped,
            expert_count_fields: &[ExpertCountField::NRoutedExperts],
            n_routed_experts: 64,
            n_shared_experts: FieldRule::Read(1),
            norm_topk_prob: true,
            num_experts_per_tok: 4,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.8,
            first_k_dense_replace: 1,
            shared_expert: SharedExpertKind::Summed,
            experts: ExpertKind::SwiGlu,
        },
        // The released checkpoint stores one multi-token-prediction layer after the decoder
        // layers (`num_nextn_predict_layers: 1`); transformers' config has no such field.
        num_nextn_predict_layers: FieldRule::Read(0),
        pinned_fields: &[
            PinnedField {
                key: "scoring_func",
                value: PinnedValue::Str("sigmoid"),
            },
            PinnedField {
                key: "topk_method",
                value: PinnedValue::Str("noaux_tc"),
            },
        ],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Qwen3_5,
        model_type: "qwen3_5_text",
        aliases: &[],
        hf_class: "Qwen3_5ForCausalLM",
        name: "Qwen3.5",
        rms_norm_eps: FieldRule::Read(1e-6),
        partial_rotary_factor: FieldRule::Read(0.25),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Fixed(true),
        sliding_window: false,
        moe: MoeSpec::DENSE,
        // Released checkpoints store MTP layers under `mtp.*` (carried through untouched).
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: Some(QWEN3_5_LINEAR),
        attention_output_gate: true,
        norm_unit_offset: true,
        multimodal: Some(MultimodalLayout {
            model_type: "qwen3_5",
            hf_class: "Qwen3_5ForConditionalGeneration",
        }),
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::Qwen3_5Moe,
        model_type: "qwen3_5_moe_text",
        aliases: &[],
        hf_class: "Qwen3_5MoeForCausalLM",
        name: "Qwen3.5-MoE",
        rms_norm_eps: FieldRule::Read(1e-6),
        partial_rotary_factor: FieldRule::Read(0.25),
        rope_scaling: None,
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(false),
        use_qk_norm: FieldRule::Fixed(true),
        sliding_window: false,
        moe: MoeSpec {
            layers: MoeLayers::All,
            router: RouterKind::Softmax,
            expert_count_fields: &[ExpertCountField::NumExperts],
            n_routed_experts: 256,
            n_shared_experts: FieldRule::Fixed(1),
            norm_topk_prob: true,
            num_experts_per_tok: 8,
            shared_expert: SharedExpertKind::Gated,
            ..MoeSpec::DENSE
        },
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: Some(QWEN3_5_LINEAR),
        attention_output_gate: true,
        norm_unit_offset: true,
        multimodal: Some(MultimodalLayout {
            model_type: "qwen3_5_moe",
            hf_class: "Qwen3_5MoeForConditionalGeneration",
        }),
        attention_sinks: false,
        o_proj_bias: false,
        sliding_layer_types: false,
    },
    ArchitectureSpec {
        architecture: Architecture::GptOss,
        model_type: "gpt_oss",
        aliases: &[],
        hf_class: "GptOssForCausalLM",
        name: "GPT-OSS",
        rms_norm_eps: FieldRule::Read(1e-5),
        partial_rotary_factor: FieldRule::Fixed(1.0),
        rope_scaling: Some(RopeScalingKind::Yarn),
        attention: AttentionKind::Grouped,
        attention_bias: FieldRule::Read(true),
        use_qk_norm: FieldRule::Fixed(false),
        sliding_window: false,
        // transformers 5.24's `GptOssTopKRouter`: softmax over the top-k logits, which is
        // the softmax router renormalised over the chosen experts.
        moe: MoeSpec {
            layers: MoeLayers::All,
            router: RouterKind::Softmax,
            expert_count_fields: &[ExpertCountField::NumExperts],
            n_routed_experts: 128,
            n_shared_experts: FieldRule::Fixed(0),
            norm_topk_prob: true,
            num_experts_per_tok: 4,
            experts: ExpertKind::ClampedSwiGluBiased,
            ..MoeSpec::DENSE
        },
        num_nextn_predict_layers: FieldRule::Fixed(0),
        pinned_fields: &[],
        linear_attention: None,
        attention_output_gate: false,
        norm_unit_offset: false,
        multimodal: None,
        attention_sinks: true,
        o_proj_bias: true,
        sliding_layer_types: true,
    },
];

/// transformers 5.24's Gated DeltaNet defaults (`Qwen3_5TextConfig`).
const QWEN3_5_LINEAR: LinearAttentionConfig = LinearAttentionConfig {
    conv_kernel_dim: 4,
    key_head_dim: 128,
    value_head_dim: 128,
    num_key_heads: 16,
    num_value_heads: 32,
};

// Row `i` is the row of the variant with discriminant `i`, so `spec` is an index.
const _: () = {
    let mut i = 0;
    while i < ARCHITECTURES.len() {
        assert!(
            ARCHITECTURES[i].architecture as usize == i,
            "ARCHITECTURES rows follow the order of the Architecture variants"
        );
        i += 1;
    }
};

impl Architecture {
    /// The architecture's row of [`ARCHITECTURES`].
    pub fn spec(self) -> &'static ArchitectureSpec {
        &ARCHITECTURES[self as usize]
    }

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        self.spec().model_type
    }

    /// The HF model class name.
    pub fn hf_class(self) -> &'static str {
        self.spec().hf_class
    }

    /// The supported HF `model_type`s, comma-separated (for error messages): every row's,
    /// then the aliases.
    pub fn supported_model_types() -> String {
        ARCHITECTURES
            .iter()
            .map(|row| row.model_type)
            .chain(
                ARCHITECTURES
                    .iter()
                    .flat_map(|row| row.aliases.iter().copied()),
            )
            .chain(
                ARCHITECTURES
                    .iter()
                    .filter_map(|row| row.multimodal.map(|m| m.model_type)),
            )
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The row whose vision-language layout has `model_type` (`qwen3_5`), if any.
    pub fn from_multimodal_model_type(model_type: &str) -> Option<Self> {
        ARCHITECTURES
            .iter()
            .find(|row| row.multimodal.is_some_and(|m| m.model_type == model_type))
            .map(|row| row.architecture)
    }

    /// Looks an architecture up by HF `model_type` (or one of a row's aliases); an unknown one
    /// is [`BridgeError::UnsupportedArchitecture`] naming the supported types.
    pub fn from_model_type(model_type: &str) -> Result<Self, BridgeError> {
        ARCHITECTURES
            .iter()
            .find(|row| row.model_type == model_type)
            .or_else(|| {
                ARCHITECTURES
                    .iter()
                    .find(|row| row.aliases.contains(&model_type))
            })
            .map(|row| row.architecture)
            .or_else(|| Self::from_multimodal_model_type(model_type))
            .ok_or_else(|| BridgeError::UnsupportedArchitecture {
                model_type: model_type.to_string(),
                supported: Self::supported_model_types(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_is_found_by_its_names() {
        for row in ARCHITECTURES {
            assert_eq!(row.architecture.spec(), row);
            assert_eq!(
                Architecture::from_model_type(row.model_type).unwrap(),
                row.architecture
            );
            for alias in row.aliases {
                assert_eq!(
                    Architecture::from_model_type(alias).unwrap(),
                    row.architecture
                );
            }
        }
    }
}
