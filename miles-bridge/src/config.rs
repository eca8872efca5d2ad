//! [`ModelConfig`]: the hyper-parameters of every supported architecture, read from HF
//! `config.json` and keyed by its `model_type` ([`Architecture`]).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::BridgeError;

/// The architectures this crate implements, keyed by HF `model_type`.
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
    /// `kimi_k2` is the same architecture ([`Architecture::ALIASES`]).
    DeepseekV3,
}

impl Architecture {
    /// Every architecture, in registry order.
    pub const ALL: [Architecture; 6] = [
        Self::Glm4Moe,
        Self::Qwen3,
        Self::Qwen3Moe,
        Self::Llama,
        Self::Qwen2,
        Self::DeepseekV3,
    ];

    /// Other `model_type`s that name one of these architectures: Kimi-K2's `config.json` says
    /// `kimi_k2` for a `DeepseekV3ForCausalLM` (its hub repo ships DeepSeek-V3's remote code;
    /// transformers 5.24 has no `kimi_k2` type). Exports write the architecture's own
    /// [`Architecture::model_type`].
    pub const ALIASES: [(&'static str, Architecture); 1] = [("kimi_k2", Self::DeepseekV3)];

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Glm4Moe => "glm4_moe",
            Self::Qwen3 => "qwen3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::DeepseekV3 => "deepseek_v3",
        }
    }

    /// The HF model class name.
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Glm4Moe => "Glm4MoeForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Qwen3Moe => "Qwen3MoeForCausalLM",
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    /// The supported HF `model_type`s, comma-separated (for error messages).
    pub fn supported_model_types() -> String {
        Self::ALL
            .map(Self::model_type)
            .into_iter()
            .chain(Self::ALIASES.map(|(alias, _)| alias))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Looks an architecture up by HF `model_type` (or one of [`Architecture::ALIASES`]); an
    /// unknown one is [`BridgeError::UnsupportedArchitecture`] naming the supported types.
    pub fn from_model_type(model_type: &str) -> Result<Self, BridgeError> {
        Self::ALL
            .into_iter()
            .find(|a| a.model_type() == model_type)
            .or_else(|| {
                Self::ALIASES
                    .into_iter()
                    .find_map(|(alias, a)| (alias == model_type).then_some(a))
            })
            .ok_or_else(|| BridgeError::UnsupportedArchitecture {
                model_type: model_type.to_string(),
                supported: Self::supported_model_types(),
            })
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

/// Llama-3 RoPE frequency scaling (`rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: f64,
}

/// YaRN RoPE scaling (`rope_type = "yarn"`), as DeepSeek-V3, Kimi-K2 and Moonlight use it.
///
/// transformers 5.24 (`_compute_yarn_parameters`): the inverse frequencies blend
/// interpolation (`1 / (factor · base^(2i/d))`) and extrapolation (`1 / base^(2i/d)`) with a
/// linear ramp between the correction dims of `beta_fast` / `beta_slow` rotations over
/// `original_max_position_embeddings` (floored / ceiled when `truncate`); cos / sin are
/// multiplied by [`YarnRopeScaling::attention_factor`]; DeepSeek-V3's attention additionally
/// multiplies its softmax scale by `mscale(factor, mscale_all_dim)²` when `mscale_all_dim` is
/// set ([`ModelConfig::softmax_scale`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnRopeScaling {
    /// `factor` (context extension ratio).
    pub factor: f64,
    /// `original_max_position_embeddings` (pre-extension context).
    pub original_max_position_embeddings: f64,
    /// `beta_fast` (default 32).
    pub beta_fast: f64,
    /// `beta_slow` (default 1).
    pub beta_slow: f64,
    /// `mscale`, if given.
    pub mscale: Option<f64>,
    /// `mscale_all_dim`, if given.
    pub mscale_all_dim: Option<f64>,
    /// An explicit `attention_factor`, if given (else derived from `factor` and the mscales).
    pub attention_factor: Option<f64>,
    /// `truncate` (default true): round the correction range outward to whole dims.
    pub truncate: bool,
}

/// `0.1 · mscale · ln(scale) + 1` for `scale > 1`, else 1 (YaRN's magnitude correction).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl YarnRopeScaling {
    /// The factor cos / sin are multiplied by: `attention_factor` when given, else
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are set (and
    /// non-zero), else `mscale(factor, 1)`.
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(self.factor, m) / yarn_mscale(self.factor, all)
            }
            _ => yarn_mscale(self.factor, 1.0),
        }
    }

    /// The inverse frequencies of a `dim`-channel rotary embedding with base `theta`, in f32
    /// as transformers computes them.
    pub fn inv_freq(&self, dim: usize, theta: f64) -> Vec<f32> {
        let correction_dim = |rotations: f64| {
            dim as f64
                * (self.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (
            correction_dim(self.beta_fast),
            correction_dim(self.beta_slow),
        );
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        // transformers: `(arange(d / 2) - low) / (high - low)` in f32, the bounds as Python
        // floats (the difference taken in f64).
        let (low_f32, span) = (low as f32, (high - low) as f32);
        let factor = self.factor as f32;
        (0..dim / 2)
            .map(|i| {
                let pos_freq = (theta as f32).powf((2 * i) as f32 / dim as f32);
                let extrapolation = 1.0 / pos_freq;
                let interpolation = 1.0 / (factor * pos_freq);
                let ramp = ((i as f32 - low_f32) / span).clamp(0.0, 1.0);
                let extrapolation_factor = 1.0 - ramp;
                interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
            })
            .collect()
    }
}

/// Multi-head latent attention shapes (DeepSeek-V3): queries through `q_proj`, or the
/// low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj` when `q_lora_rank` is set; keys and
/// values from one compressed latent (`kv_a_proj_with_mqa` → `kv_lora_rank` latent channels,
/// RMS-normalised by `kv_a_layernorm`, plus `qk_rope_head_dim` shared rotary key channels),
/// expanded per head by `kv_b_proj` into `qk_nope_head_dim` key and `v_head_dim` value
/// channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Rank of the query compression (`None`: a full `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Rank of the key / value latent.
    pub kv_lora_rank: usize,
    /// Per-head query / key channels without position encoding.
    pub qk_nope_head_dim: usize,
    /// Per-head query / key channels with RoPE (the rotary key is shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Per-head value channels.
    pub v_head_dim: usize,
    /// Whether the rotary channels are stored as interleaved pairs (DeepSeek's layout;
    /// `rope_interleave`, default true).
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// Query / key channels per head (`qk_nope_head_dim + qk_rope_head_dim`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// Hyper-parameters of a decoder-only model of any supported [`Architecture`].
///
/// Field names are the HF ones (`n_routed_experts` also holds Qwen3-MoE's `num_experts`).
/// Build it with [`ModelConfig::from_hf_json`], which dispatches on `model_type` (for
/// `glm4_moe` both the transformers-5 layout with `rope_parameters` and the older top-level
/// `rope_theta` / `partial_rotary_factor` layout are accepted), or by hand, then call
/// [`ModelConfig::validate`] (done by `init` / the loaders).
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
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    #[serde(default)]
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    rope_parameters: Option<Value>,
    rope_scaling: Option<Value>,
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    use_qk_norm: bool,
    n_routed_experts: Option<usize>,
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: usize,
    #[serde(default = "one")]
    n_group: usize,
    #[serde(default = "one")]
    topk_group: usize,
    norm_topk_prob: Option<bool>,
    #[serde(default = "unit")]
    routed_scaling_factor: f64,
    #[serde(default = "one")]
    first_k_dense_replace: usize,
    #[serde(default = "one")]
    decoder_sparse_step: usize,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default = "default_init")]
    initializer_range: f64,
    hidden_act: Option<String>,
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    #[serde(alias = "num_mtp_layers")]
    num_nextn_predict_layers: Option<usize>,
    original_max_position_embeddings: Option<f64>,
}

fn one() -> usize {
    1
}
fn unit() -> f64 {
    1.0
}
fn default_max_pos() -> usize {
    131_072
}
fn default_init() -> f64 {
    0.02
}

/// Reads `key` of a `rope_parameters` / `rope_scaling` object as f64.
fn rope_field(obj: Option<&Value>, key: &str) -> Option<f64> {
    obj.and_then(|v| v.get(key)).and_then(Value::as_f64)
}

/// The RoPE variant named by a `rope_parameters` / `rope_scaling` object.
fn rope_type(obj: Option<&Value>) -> &str {
    obj.and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default")
}

fn llama3_scaling(obj: &Value, field: &str) -> Result<Llama3RopeScaling, BridgeError> {
    let get = |key: &str| {
        rope_field(Some(obj), key)
            .ok_or_else(|| BridgeError::config(field, format!("llama3 scaling needs `{key}`")))
    };
    Ok(Llama3RopeScaling {
        factor: get("factor")?,
        low_freq_factor: get("low_freq_factor")?,
        high_freq_factor: get("high_freq_factor")?,
        original_max_position_embeddings: get("original_max_position_embeddings")?,
    })
}

/// Reads a `rope_type = "yarn"` object as transformers 5.24 does: `factor` is required,
/// `beta_fast` / `beta_slow` default to 32 / 1 (also when 0 or null), `truncate` to true, and
/// `original_max_position_embeddings` is the top-level field when the config has one, else
/// the object's, else `max_position_embeddings`.
fn yarn_scaling(
    obj: &Value,
    field: &str,
    top_level_original: Option<f64>,
    max_position_embeddings: usize,
) -> Result<YarnRopeScaling, BridgeError> {
    let number = |key: &str| -> Result<Option<f64>, BridgeError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                BridgeError::config(field, format!("yarn `{key}` must be a number"))
            }),
        }
    };
    let factor = number("factor")?
        .ok_or_else(|| BridgeError::config(field, "yarn scaling needs `factor`"))?;
    let nonzero_or = |v: Option<f64>, default: f64| v.filter(|&x| x != 0.0).unwrap_or(default);
    let truncate = match obj.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(BridgeError::config(
                field,
                "yarn `truncate` must be a boolean",
            ));
        }
    };
    Ok(YarnRopeScaling {
        factor,
        original_max_position_embeddings: top_level_original
            .or(number("original_max_position_embeddings")?)
            .unwrap_or(max_position_embeddings as f64),
        beta_fast: nonzero_or(number("beta_fast")?, 32.0),
        beta_slow: nonzero_or(number("beta_slow")?, 1.0),
        mscale: number("mscale")?,
        mscale_all_dim: number("mscale_all_dim")?,
        attention_factor: number("attention_factor")?,
        truncate,
    })
}

/// Fields of DeepSeek's original `config.json` that transformers 5.24 ignores but that would
/// change the model if they differed from DeepSeek-V3's values: `scoring_func` (sigmoid),
/// `topk_method` (`noaux_tc`) and `moe_layer_freq` (1). Other values are rejected naming the
/// field rather than silently computing a different model.
fn check_deepseek_v3_fields(json: &Value) -> Result<(), BridgeError> {
    let expect = |key: &str, ok: &dyn Fn(&Value) -> bool, what: &str| match json.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if ok(v) => Ok(()),
        Some(v) => Err(BridgeError::config(
            key,
            format!("{v} is not supported (only {what}, as in DeepSeek-V3)"),
        )),
    };
    expect("scoring_func", &|v| v == "sigmoid", "`sigmoid`")?;
    expect("topk_method", &|v| v == "noaux_tc", "`noaux_tc`")?;
    expect("moe_layer_freq", &|v| v.as_u64() == Some(1), "1")
}

/// Rejects sliding-window attention on any layer, reading the fields as transformers 5.24's
/// `Qwen2Config` / `Qwen3Config` do: the window is `sliding_window` (default 4096) only when
/// `use_sliding_window` is true; `layer_types`, when absent, marks layers
/// `>= max_window_layers` (default 28) as `sliding_attention` when a window is set. A layer of
/// type `sliding_attention` is an error naming the field that made it so (`layer_types` when
/// given explicitly, else `use_sliding_window`).
fn reject_sliding_window(json: &Value, layers: usize) -> Result<(), BridgeError> {
    let use_window = match json.get("use_sliding_window") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(BridgeError::config(
                "use_sliding_window",
                "must be a boolean",
            ));
        }
    };
    // Absent: transformers' default 4096; explicit null: no window.
    let window = use_window && !matches!(json.get("sliding_window"), Some(Value::Null));
    match json.get("layer_types").filter(|v| !v.is_null()) {
        Some(types) => {
            let types = types.as_array().ok_or_else(|| {
                BridgeError::config("layer_types", "must be a list of layer type names")
            })?;
            if types.len() != layers {
                return Err(BridgeError::config(
                    "layer_types",
                    format!(
                        "has {} entries for {layers} layers (num_hidden_layers)",
                        types.len()
                    ),
                ));
            }
            for (layer, kind) in types.iter().enumerate() {
                match kind.as_str() {
                    // `attention` is the legacy name transformers remaps to `full_attention`.
                    Some("full_attention" | "attention") => {}
                    Some("sliding_attention") => {
                        return Err(BridgeError::config(
                            "layer_types",
                            format!(
                                "layer {layer} is `sliding_attention`; sliding-window \
                                 attention is not supported"
                            ),
                        ));
                    }
                    _ => {
                        return Err(BridgeError::config(
                            "layer_types",
                            format!("layer {layer} has unsupported type {kind}"),
                        ));
                    }
                }
            }
        }
        None if window => {
            let first = match json.get("max_window_layers") {
                None | Some(Value::Null) => 28,
                Some(v) => v.as_u64().ok_or_else(|| {
                    BridgeError::config("max_window_layers", "must be a non-negative integer")
                })? as usize,
            };
            if first < layers {
                return Err(BridgeError::config(
                    "use_sliding_window",
                    format!(
                        "true with max_window_layers = {first} < num_hidden_layers = {layers} \
                         makes layers {first}.. sliding-window attention, which is not \
                         supported"
                    ),
                ));
            }
        }
        None => {}
    }
    Ok(())
}

impl ModelConfig {
    /// Parses an HF `config.json` text, choosing the architecture by `model_type`, and
    /// validates it. A missing `model_type` is [`BridgeError::MissingModelType`], an unknown one
    /// [`BridgeError::UnsupportedArchitecture`]; both name the supported types.
    pub fn from_hf_json(text: &str) -> Result<Self, BridgeError> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| BridgeError::config("config.json", e.to_string()))?;
        let raw: RawConfig = serde_json::from_value(json.clone())
            .map_err(|e| BridgeError::config("config.json", e.to_string()))?;
        let Some(model_type) = raw.model_type.as_deref() else {
            return Err(BridgeError::MissingModelType {
                supported: Architecture::supported_model_types(),
            });
        };
        let architecture = Architecture::from_model_type(model_type)?;
        if let Some(act) = raw.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(BridgeError::config(
                "hidden_act",
                format!("`{act}` is not supported (only `silu`)"),
            ));
        }
        if matches!(architecture, Architecture::Qwen2 | Architecture::Qwen3) {
            reject_sliding_window(&json, raw.num_hidden_layers)?;
        }
        if json
            .get("quantization_config")
            .is_some_and(|q| !q.is_null())
        {
            return Err(BridgeError::config(
                "quantization_config",
                "quantised checkpoints (e.g. DeepSeek-V3's fp8 block-quantised weights) are not \
                 supported; dequantise them to bf16 / f32 first",
            ));
        }
        let is_dsv3 = architecture == Architecture::DeepseekV3;
        if is_dsv3 {
            check_deepseek_v3_fields(&json)?;
        }
        // transformers 5 keeps RoPE settings in `rope_parameters`; older checkpoints (and real
        // GLM-4.5 files) keep `rope_theta` / `partial_rotary_factor` at the top level and the
        // scaling in `rope_scaling`.
        let params = raw.rope_parameters.as_ref().filter(|v| !v.is_null());
        let scaling = raw.rope_scaling.as_ref().filter(|v| !v.is_null());
        let mut rope_scaling = None;
        let mut yarn = None;
        for (field, obj) in [("rope_parameters", params), ("rope_scaling", scaling)] {
            match (rope_type(obj), architecture) {
                ("default", _) => {}
                ("llama3", Architecture::Llama) => {
                    rope_scaling = obj.map(|o| llama3_scaling(o, field)).transpose()?;
                }
                ("yarn", Architecture::DeepseekV3) => {
                    yarn = obj
                        .map(|o| {
                            yarn_scaling(
                                o,
                                field,
                                raw.original_max_position_embeddings,
                                raw.max_position_embeddings,
                            )
                        })
                        .transpose()?;
                }
                (kind, _) => {
                    return Err(BridgeError::config(
                        field,
                        format!(
                            "rope_type `{kind}` is not supported for {}",
                            architecture.model_type()
                        ),
                    ));
                }
            }
        }
        // transformers 5.24's `default_theta` is 10000 for every architecture here.
        let rope_theta = rope_field(params, "rope_theta")
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        // transformers 5.24's defaults: 1e-5 for GLM-4-MoE, 1e-6 for the others.
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(match architecture {
            Architecture::Glm4Moe => 1e-5,
            _ => 1e-6,
        });
        let default_partial = if architecture == Architecture::Glm4Moe {
            0.5
        } else {
            1.0
        };
        // Qwen2's rotary embedding rotates the whole head whatever `partial_rotary_factor` says.
        let partial_rotary_factor =
            if matches!(architecture, Architecture::Qwen2 | Architecture::DeepseekV3) {
                1.0
            } else {
                rope_field(params, "partial_rotary_factor")
                    .or(raw.partial_rotary_factor)
                    .unwrap_or(default_partial)
            };
        // DeepSeek-V3: transformers' defaults for absent fields (`q_lora_rank: null` is a full
        // `q_proj`); the rotary "head" is the shared rope key.
        let mla = is_dsv3.then(|| MlaConfig {
            q_lora_rank: match json.get("q_lora_rank") {
                None => Some(1536),
                Some(_) => raw.q_lora_rank,
            },
            kv_lora_rank: raw.kv_lora_rank.unwrap_or(512),
            qk_nope_head_dim: raw.qk_nope_head_dim.unwrap_or(128),
            qk_rope_head_dim: raw.qk_rope_head_dim.unwrap_or(64),
            v_head_dim: raw.v_head_dim.unwrap_or(128),
            rope_interleave: raw.rope_interleave.unwrap_or(true),
        });
        let head_dim = match mla {
            Some(m) => m.qk_rope_head_dim,
            None => raw
                .head_dim
                .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
        };
        let absent = |key: &str| json.get(key).is_none();
        let dsv3_default = |key: &str, value: usize, default: usize| {
            if is_dsv3 && absent(key) {
                default
            } else {
                value
            }
        };
        if raw.mlp_bias {
            return Err(BridgeError::config(
                "mlp_bias",
                "MLP biases are not supported",
            ));
        }
        let (router, n_routed_experts, n_shared_experts, norm_default) = match architecture {
            Architecture::Glm4Moe => (
                RouterKind::SigmoidGrouped,
                raw.n_routed_experts.unwrap_or(0),
                raw.n_shared_experts.unwrap_or(1),
                true,
            ),
            Architecture::DeepseekV3 => (
                RouterKind::SigmoidGrouped,
                raw.n_routed_experts.or(raw.num_experts).unwrap_or(256),
                raw.n_shared_experts.unwrap_or(1),
                true,
            ),
            Architecture::Qwen3Moe => (RouterKind::Softmax, raw.num_experts.unwrap_or(0), 0, false),
            Architecture::Qwen3 | Architecture::Llama | Architecture::Qwen2 => {
                (RouterKind::Softmax, 0, 0, false)
            }
        };
        let config = Self {
            architecture,
            router,
            rope_scaling,
            yarn,
            mla,
            num_nextn_predict_layers: if is_dsv3 {
                raw.num_nextn_predict_layers.unwrap_or(1)
            } else {
                0
            },
            decoder_sparse_step: raw.decoder_sparse_step,
            mlp_only_layers: raw.mlp_only_layers,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            moe_intermediate_size: raw.moe_intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            // MLA has no key / value heads of its own (every head reads the shared latent).
            num_key_value_heads: if is_dsv3 {
                raw.num_attention_heads
            } else {
                raw.num_key_value_heads.unwrap_or(raw.num_attention_heads)
            },
            head_dim,
            rms_norm_eps,
            rope_theta,
            partial_rotary_factor,
            // Qwen2 always has q/k/v biases (transformers ignores `attention_bias` there).
            attention_bias: architecture == Architecture::Qwen2
                || raw.attention_bias.unwrap_or(false),
            use_qk_norm: raw.use_qk_norm
                || architecture == Architecture::Qwen3
                || architecture == Architecture::Qwen3Moe,
            n_routed_experts,
            n_shared_experts,
            num_experts_per_tok: dsv3_default("num_experts_per_tok", raw.num_experts_per_tok, 8),
            n_group: dsv3_default("n_group", raw.n_group, 8),
            topk_group: dsv3_default("topk_group", raw.topk_group, 4),
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(norm_default),
            routed_scaling_factor: if is_dsv3 && absent("routed_scaling_factor") {
                2.5
            } else {
                raw.routed_scaling_factor
            },
            first_k_dense_replace: dsv3_default(
                "first_k_dense_replace",
                raw.first_k_dense_replace,
                3,
            ),
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings,
            initializer_range: raw.initializer_range,
        };
        config.validate()?;
        Ok(config)
    }

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

    /// Reads and parses `path` (a `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| BridgeError::io(path, e))?;
        Self::from_hf_json(&text)
    }

    /// Number of channels of each head that RoPE rotates.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Whether layer `layer` is an MoE layer (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match self.architecture {
            Architecture::Glm4Moe | Architecture::DeepseekV3 => layer >= self.first_k_dense_replace,
            Architecture::Qwen3Moe => {
                self.n_routed_experts > 0
                    && !self.mlp_only_layers.contains(&layer)
                    && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
            }
            Architecture::Qwen3 | Architecture::Llama | Architecture::Qwen2 => false,
        }
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
        if matches!(self.architecture, Architecture::Qwen2 | Architecture::Qwen3) {
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
        if self.architecture == Architecture::Qwen3Moe {
            json["num_experts"] = self.n_routed_experts.into();
            json["decoder_sparse_step"] = self.decoder_sparse_step.into();
            json["mlp_only_layers"] = serde_json::json!(self.mlp_only_layers);
        }
        json
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V5: &str = r#"{"model_type":"glm4_moe","vocab_size":512,"hidden_size":64,
        "intermediate_size":128,"moe_intermediate_size":32,"num_hidden_layers":3,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"n_routed_experts":8,
        "num_experts_per_tok":2,"rope_parameters":{"rope_type":"default","rope_theta":500.0,
        "partial_rotary_factor":0.25}}"#;

    #[test]
    fn rope_parameters_layout_is_read() {
        let c = ModelConfig::from_hf_json(V5).unwrap();
        assert_eq!(c.rope_theta, 500.0);
        assert_eq!(c.rotary_dim(), 4);
        assert!(c.is_moe_layer(1) && !c.is_moe_layer(0));
    }

    #[test]
    fn llama3_inv_freq_matches_hand_computation() {
        let json = r#"{"model_type":"llama","vocab_size":8,"hidden_size":8,"intermediate_size":8,
            "num_hidden_layers":1,"num_attention_heads":1,"head_dim":8,"rope_theta":10000.0,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":64}}"#;
        let c = ModelConfig::from_hf_json(json).unwrap();
        assert!(!c.has_moe() && c.rotary_dim() == 8);
        // base: 1, 0.1, 0.01, 0.001 -> wavelengths 6.28 (kept), 62.8 (smoothed), 628, 6283
        // (both > 64: divided by 8). smooth = (64 / 62.83 - 1) / 3.
        let f = c.inv_freq();
        let smooth = (64.0 / (2.0 * std::f64::consts::PI / 0.1) - 1.0) / 3.0;
        let want = [
            1.0,
            (1.0 - smooth) * 0.1 / 8.0 + smooth * 0.1,
            0.01 / 8.0,
            0.001 / 8.0,
        ];
        for (got, want) in f.iter().zip(want) {
            assert!((*got as f64 - want).abs() < 1e-6 * want.max(1e-3), "{f:?}");
        }
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        let yarn = V5.replace("\"default\"", "\"yarn\"");
        assert!(matches!(
            ModelConfig::from_hf_json(&yarn),
            Err(BridgeError::Config { field, .. }) if field == "rope_parameters"
        ));
        let mistral = V5.replace("glm4_moe", "mistral");
        assert!(matches!(
            ModelConfig::from_hf_json(&mistral),
            Err(BridgeError::UnsupportedArchitecture { .. })
        ));
        let heads = V5.replace("\"num_key_value_heads\":2", "\"num_key_value_heads\":3");
        assert!(ModelConfig::from_hf_json(&heads).is_err());
        assert!(ModelConfig::from_hf_json("{").is_err());
    }

    /// A real Qwen2.5-style `config.json` (sliding-window fields present, window off).
    const QWEN25: &str = r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2",
        "vocab_size":512,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,
        "num_attention_heads":4,"num_key_value_heads":2,"hidden_act":"silu",
        "rope_theta":1000000.0,"rope_scaling":null,"use_sliding_window":false,
        "sliding_window":32768,"max_window_layers":2,"tie_word_embeddings":true,
        "attention_dropout":0.0,"torch_dtype":"bfloat16"}"#;

    fn field_of(json: &str) -> String {
        match ModelConfig::from_hf_json(json) {
            Err(BridgeError::Config { field, .. }) => field,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn qwen2_is_read_as_transformers_reads_it() {
        let c = ModelConfig::from_hf_json(QWEN25).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.attention_bias && !c.use_qk_norm && !c.has_moe());
        assert!(c.tie_word_embeddings);
        assert_eq!((c.head_dim, c.rotary_dim()), (16, 16));
        assert_eq!((c.rope_theta, c.rms_norm_eps), (1e6, 1e-6));
        // transformers' defaults when the fields are absent; `attention_bias: false` and
        // `partial_rotary_factor` are ignored by Qwen2 in transformers too.
        let bare = r#"{"model_type":"qwen2","vocab_size":8,"hidden_size":8,
            "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,
            "attention_bias":false,"partial_rotary_factor":0.5}"#;
        let c = ModelConfig::from_hf_json(bare).unwrap();
        assert_eq!((c.rope_theta, c.rms_norm_eps), (10_000.0, 1e-6));
        assert_eq!(
            (c.num_key_value_heads, c.head_dim, c.rotary_dim()),
            (2, 4, 4)
        );
        assert!(c.attention_bias && !c.tie_word_embeddings);
        // The export reads back as the same config.
        let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn qwen2_sliding_window_is_rejected_naming_the_field() {
        // use_sliding_window with layers past max_window_layers (2 of 4 here).
        let on = QWEN25.replace(
            r#""use_sliding_window":false"#,
            r#""use_sliding_window":true"#,
        );
        assert_eq!(field_of(&on), "use_sliding_window");
        // The default window (field absent) is a window too.
        let default_window = on.replace(r#""sliding_window":32768,"#, "");
        assert_eq!(field_of(&default_window), "use_sliding_window");
        // ... but no layer slides when max_window_layers covers them all, or the window is null.
        let all_full = on.replace(r#""max_window_layers":2"#, r#""max_window_layers":4"#);
        assert!(ModelConfig::from_hf_json(&all_full).is_ok());
        let null = on.replace(r#""sliding_window":32768"#, r#""sliding_window":null"#);
        assert!(ModelConfig::from_hf_json(&null).is_ok());
        // max_window_layers absent: transformers' default 28 covers these 4 layers.
        let default_layers = on.replace(r#""max_window_layers":2,"#, "");
        assert!(ModelConfig::from_hf_json(&default_layers).is_ok());
        // Explicit layer_types win (transformers only derives them when absent).
        let typed = QWEN25.replace(
            r#""max_window_layers":2"#,
            r#""layer_types":["full_attention","attention","full_attention","sliding_attention"]"#,
        );
        assert_eq!(field_of(&typed), "layer_types");
        let full = typed.replace("sliding_attention", "full_attention");
        assert!(ModelConfig::from_hf_json(&full).is_ok());
        let short = QWEN25.replace(
            r#""max_window_layers":2"#,
            r#""layer_types":["full_attention"]"#,
        );
        assert_eq!(field_of(&short), "layer_types");
        let odd = full.replace("\"attention\"", "\"linear_attention\"");
        assert_eq!(field_of(&odd), "layer_types");
        let gelu = QWEN25.replace("\"silu\"", "\"gelu\"");
        assert_eq!(field_of(&gelu), "hidden_act");
        let yarn = QWEN25.replace(
            r#""rope_scaling":null"#,
            r#""rope_scaling":{"type":"yarn","factor":4.0}"#,
        );
        assert_eq!(field_of(&yarn), "rope_scaling");
    }

    #[test]
    fn missing_or_unknown_model_type_names_the_supported_types() {
        let supported = "glm4_moe, qwen3, qwen3_moe, llama, qwen2, deepseek_v3";
        let missing = V5.replace(r#""model_type":"glm4_moe","#, "");
        match ModelConfig::from_hf_json(&missing) {
            Err(e @ BridgeError::MissingModelType { .. }) => {
                assert!(e.to_string().contains(supported), "{e}")
            }
            other => panic!("a config without model_type loaded: {other:?}"),
        }
        let unknown = V5.replace("glm4_moe", "deepseek_v2");
        match ModelConfig::from_hf_json(&unknown) {
            Err(e @ BridgeError::UnsupportedArchitecture { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("`deepseek_v2`") && text.contains(supported),
                    "{text}"
                );
            }
            other => panic!("an unknown model_type loaded: {other:?}"),
        }
    }
}
