//! Reading an HF `config.json` into a [`ModelConfig`]: the fields every architecture shares,
//! then what the architecture's row of the table says (defaults, ignored and pinned fields,
//! RoPE scaling, attention kind, MoE layout).

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::config::architecture::{
    Architecture, ArchitectureSpec, AttentionKind, ExpertCountField, ExpertKind, MoeLayers,
    RopeScalingKind,
};
use crate::config::linear::LinearAttentionConfig;
use crate::config::mla::MlaConfig;
use crate::config::model_config::{LayerType, MlpLayerType, ModelConfig};
use crate::config::rope::{llama3_scaling, rope_field, rope_type, yarn_scaling};
use crate::error::BridgeError;

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    /// The dense MLP's width (GPT-OSS: the experts'). Absent from configs without a dense
    /// layer (transformers' `Qwen3_5MoeTextConfig` has no such field): 0, refused by
    /// [`ModelConfig::validate`] where a layer needs it.
    #[serde(default)]
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
    mlp_layer_types: Option<Vec<String>>,
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
    linear_conv_kernel_dim: Option<usize>,
    linear_key_head_dim: Option<usize>,
    linear_value_head_dim: Option<usize>,
    linear_num_key_heads: Option<usize>,
    linear_num_value_heads: Option<usize>,
    full_attention_interval: Option<usize>,
    #[serde(default)]
    shared_expert_intermediate_size: usize,
    sliding_window: Option<Value>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
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

/// Rejects a pinned field of `spec` (see `PinnedField`) holding another value, naming the
/// field rather than silently computing a different model.
fn check_pinned_fields(json: &Value, spec: &ArchitectureSpec) -> Result<(), BridgeError> {
    for pinned in spec.pinned_fields {
        match json.get(pinned.key) {
            None | Some(Value::Null) => {}
            Some(v) if pinned.value.matches(v) => {}
            Some(v) => {
                return Err(BridgeError::config(
                    pinned.key,
                    format!(
                        "{v} is not supported (only {}, as in {})",
                        pinned.value.shown(),
                        spec.name
                    ),
                ));
            }
        }
    }
    Ok(())
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

/// Splits a vision-language `config.json` (a row's `MultimodalLayout` `model_type`, e.g.
/// Qwen3.5's `qwen3_5`) into its text config — `text_config`, with the row's text
/// `model_type` and the wrapper's `tie_word_embeddings` (transformers ties by the top-level
/// config, default false) — and the whole file, kept for export (its `text_config` cut down
/// to the fields this crate does not read once the config is built). Other configs pass
/// unchanged.
fn split_multimodal(json: Value) -> Result<(Value, Option<Value>), BridgeError> {
    let arch = json
        .get("model_type")
        .and_then(Value::as_str)
        .and_then(Architecture::from_multimodal_model_type);
    let Some(arch) = arch else {
        return Ok((json, None));
    };
    let mut wrapper = json;
    let text = wrapper.get("text_config").cloned().filter(Value::is_object);
    let Some(mut text) = text else {
        return Err(BridgeError::config(
            "text_config",
            format!(
                "missing: a `{}` config holds its text model's config there",
                arch.spec().multimodal.map_or("", |m| m.model_type)
            ),
        ));
    };
    text["model_type"] = arch.model_type().into();
    // The stored dtype describes the file, and `save_pretrained` writes its own.
    if let Some(t) = wrapper
        .get_mut("text_config")
        .and_then(Value::as_object_mut)
    {
        t.remove("dtype");
        t.remove("torch_dtype");
    }
    if let Some(map) = wrapper.as_object_mut() {
        map.remove("dtype");
        map.remove("torch_dtype");
    }
    text["tie_word_embeddings"] = match wrapper.get("tie_word_embeddings") {
        Some(Value::Bool(b)) => Value::Bool(*b),
        _ => Value::Bool(false),
    };
    Ok((text, Some(wrapper)))
}

/// `layer_types` as the row reads it: the explicit list (one `linear_attention` /
/// `full_attention` per layer), else every `full_attention_interval`-th layer (default 4)
/// full attention.
fn linear_layer_types(
    json: &Value,
    layers: usize,
    interval: Option<usize>,
) -> Result<Vec<LayerType>, BridgeError> {
    let Some(types) = json.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(LayerType::interval_layout(layers, interval.unwrap_or(4)));
    };
    let types = types
        .as_array()
        .ok_or_else(|| BridgeError::config("layer_types", "must be a list of layer type names"))?;
    types
        .iter()
        .enumerate()
        .map(|(layer, kind)| {
            kind.as_str().and_then(LayerType::parse).ok_or_else(|| {
                BridgeError::config(
                    "layer_types",
                    format!(
                        "layer {layer} has unsupported type {kind} (`linear_attention` or \
                         `full_attention`)"
                    ),
                )
            })
        })
        .collect()
}

/// GPT-OSS's `layer_types` as transformers 5.24 reads them: one `sliding_attention` /
/// `full_attention` per layer (true: the layer slides), absent or null: even layers slide.
fn sliding_layer_types(json: &Value, layers: usize) -> Result<Vec<bool>, BridgeError> {
    let Some(types) = json.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok((0..layers).map(|l| l.is_multiple_of(2)).collect());
    };
    let types = types
        .as_array()
        .ok_or_else(|| BridgeError::config("layer_types", "must be a list of layer type names"))?;
    types
        .iter()
        .enumerate()
        .map(|(layer, kind)| match kind.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(BridgeError::config(
                "layer_types",
                format!(
                    "layer {layer} has unsupported type {kind} (`sliding_attention` or \
                     `full_attention`)"
                ),
            )),
        })
        .collect()
}

impl ModelConfig {
    /// Parses an HF `config.json` text, choosing the architecture by `model_type` in the
    /// architecture table and reading the fields as its row says, and validates it. A missing
    /// `model_type` is [`BridgeError::MissingModelType`], an unknown one
    /// [`BridgeError::UnsupportedArchitecture`]; both name the supported types. A
    /// vision-language config (Qwen3.5's `qwen3_5` / `qwen3_5_moe`) is read through its
    /// `text_config`; the rest is kept in [`ModelConfig::multimodal`].
    pub fn from_hf_json(text: &str) -> Result<Self, BridgeError> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| BridgeError::config("config.json", e.to_string()))?;
        let (json, multimodal) = split_multimodal(json)?;
        let raw: RawConfig = serde_json::from_value(json.clone())
            .map_err(|e| BridgeError::config("config.json", e.to_string()))?;
        let Some(model_type) = raw.model_type.as_deref() else {
            return Err(BridgeError::MissingModelType {
                supported: Architecture::supported_model_types(),
            });
        };
        let architecture = Architecture::from_model_type(model_type)?;
        let spec = architecture.spec();
        if let Some(act) = raw.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(BridgeError::config(
                "hidden_act",
                format!("`{act}` is not supported (only `silu`)"),
            ));
        }
        if spec.sliding_window {
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
        check_pinned_fields(&json, spec)?;
        // transformers 5 keeps RoPE settings in `rope_parameters`; older checkpoints (and real
        // GLM-4.5 files) keep `rope_theta` / `partial_rotary_factor` at the top level and the
        // scaling in `rope_scaling`.
        let params = raw.rope_parameters.as_ref().filter(|v| !v.is_null());
        let scaling = raw.rope_scaling.as_ref().filter(|v| !v.is_null());
        let mut rope_scaling = None;
        let mut yarn = None;
        for (field, obj) in [("rope_parameters", params), ("rope_scaling", scaling)] {
            let kind = rope_type(obj);
            if kind == "default" {
                continue;
            }
            match spec.rope_scaling.filter(|s| s.rope_type() == kind) {
                Some(RopeScalingKind::Llama3) => {
                    rope_scaling = obj.map(|o| llama3_scaling(o, field)).transpose()?;
                }
                Some(RopeScalingKind::Yarn) => {
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
                None => {
                    return Err(BridgeError::config(
                        field,
                        format!(
                            "rope_type `{kind}` is not supported for {}",
                            spec.model_type
                        ),
                    ));
                }
            }
        }
        // transformers 5.24's `default_theta` is 10000 for every architecture here.
        let rope_theta = rope_field(params, "rope_theta")
            .or(raw.rope_theta)
            .unwrap_or(10_000.0);
        let rms_norm_eps = spec.rms_norm_eps.resolve(raw.rms_norm_eps);
        let partial_rotary_factor = spec
            .partial_rotary_factor
            .resolve(rope_field(params, "partial_rotary_factor").or(raw.partial_rotary_factor));
        // Latent attention: the row's defaults for absent fields (`q_lora_rank: null` is a
        // full `q_proj`); the rotary "head" is the shared rope key.
        let mla = match spec.attention {
            AttentionKind::Grouped => None,
            AttentionKind::Latent(default) => Some(MlaConfig {
                q_lora_rank: match json.get("q_lora_rank") {
                    None => default.q_lora_rank,
                    Some(_) => raw.q_lora_rank,
                },
                kv_lora_rank: raw.kv_lora_rank.unwrap_or(default.kv_lora_rank),
                qk_nope_head_dim: raw.qk_nope_head_dim.unwrap_or(default.qk_nope_head_dim),
                qk_rope_head_dim: raw.qk_rope_head_dim.unwrap_or(default.qk_rope_head_dim),
                v_head_dim: raw.v_head_dim.unwrap_or(default.v_head_dim),
                rope_interleave: raw.rope_interleave.unwrap_or(default.rope_interleave),
            }),
        };
        let head_dim = match mla {
            Some(m) => m.qk_rope_head_dim,
            None => raw
                .head_dim
                .unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
        };
        // MoE fields absent from the file take the row's defaults.
        let moe = &spec.moe;
        let absent = |key: &str| json.get(key).is_none();
        let moe_field = |key: &str, value: usize, default: usize| {
            if absent(key) { default } else { value }
        };
        if raw.mlp_bias {
            return Err(BridgeError::config(
                "mlp_bias",
                "MLP biases are not supported",
            ));
        }
        let n_routed_experts = moe
            .expert_count_fields
            .iter()
            .find_map(|field| match field {
                ExpertCountField::NRoutedExperts => raw.n_routed_experts,
                ExpertCountField::NumExperts => raw.num_experts,
            })
            .unwrap_or(moe.n_routed_experts);
        // `mlp_layer_types` only where the architecture reads it (absent: transformers'
        // default); the other architectures' configs ignore the field, as transformers does.
        let mlp_layer_types = match (moe.layers, raw.mlp_layer_types.as_ref()) {
            (MoeLayers::FromLayerTypes, Some(types)) => types
                .iter()
                .map(|t| {
                    MlpLayerType::parse(t).ok_or_else(|| {
                        BridgeError::config(
                            "mlp_layer_types",
                            format!("`{t}` is not a layer type (`dense` or `sparse`)"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            (MoeLayers::FromLayerTypes, None) => {
                MlpLayerType::default_layout(raw.num_hidden_layers)
            }
            _ => Vec::new(),
        };
        let (layer_types, linear_attention) = match spec.linear_attention {
            None => (Vec::new(), None),
            Some(d) => (
                linear_layer_types(&json, raw.num_hidden_layers, raw.full_attention_interval)?,
                Some(LinearAttentionConfig {
                    conv_kernel_dim: raw.linear_conv_kernel_dim.unwrap_or(d.conv_kernel_dim),
                    key_head_dim: raw.linear_key_head_dim.unwrap_or(d.key_head_dim),
                    value_head_dim: raw.linear_value_head_dim.unwrap_or(d.value_head_dim),
                    num_key_heads: raw.linear_num_key_heads.unwrap_or(d.num_key_heads),
                    num_value_heads: raw.linear_num_value_heads.unwrap_or(d.num_value_heads),
                }),
            ),
        };
        // GPT-OSS: the sliding layers and window (transformers' default window 128; null: none),
        // its experts' width is `intermediate_size` and its SwiGLU clamp.
        let (sliding_layers, sliding_window) = if spec.sliding_layer_types {
            let window = match raw.sliding_window {
                None if json.get("sliding_window").is_none() => Some(128),
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().map(|w| w as usize).ok_or_else(|| {
                    BridgeError::config("sliding_window", "must be a non-negative integer")
                })?),
            };
            (sliding_layer_types(&json, raw.num_hidden_layers)?, window)
        } else {
            (Vec::new(), None)
        };
        let moe_intermediate_size = match moe.experts {
            ExpertKind::ClampedSwiGluBiased => raw.intermediate_size,
            ExpertKind::SwiGlu => raw.moe_intermediate_size,
        };
        let config = Self {
            architecture,
            router: moe.router,
            rope_scaling,
            yarn,
            mla,
            num_nextn_predict_layers: spec
                .num_nextn_predict_layers
                .resolve(raw.num_nextn_predict_layers),
            decoder_sparse_step: raw.decoder_sparse_step,
            mlp_only_layers: raw.mlp_only_layers,
            mlp_layer_types,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            moe_intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            // Latent attention has no key / value heads of its own (every head reads the
            // shared latent).
            num_key_value_heads: match spec.attention {
                AttentionKind::Latent(_) => raw.num_attention_heads,
                AttentionKind::Grouped => {
                    raw.num_key_value_heads.unwrap_or(raw.num_attention_heads)
                }
            },
            head_dim,
            rms_norm_eps,
            rope_theta,
            partial_rotary_factor,
            attention_bias: spec.attention_bias.resolve(raw.attention_bias),
            use_qk_norm: spec.use_qk_norm.resolve(Some(raw.use_qk_norm)),
            n_routed_experts,
            n_shared_experts: moe.n_shared_experts.resolve(raw.n_shared_experts),
            num_experts_per_tok: moe_field(
                "num_experts_per_tok",
                raw.num_experts_per_tok,
                moe.num_experts_per_tok,
            ),
            n_group: moe_field("n_group", raw.n_group, moe.n_group),
            topk_group: moe_field("topk_group", raw.topk_group, moe.topk_group),
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(moe.norm_topk_prob),
            routed_scaling_factor: if absent("routed_scaling_factor") {
                moe.routed_scaling_factor
            } else {
                raw.routed_scaling_factor
            },
            first_k_dense_replace: moe_field(
                "first_k_dense_replace",
                raw.first_k_dense_replace,
                moe.first_k_dense_replace,
            ),
            tie_word_embeddings: raw.tie_word_embeddings,
            max_position_embeddings: raw.max_position_embeddings,
            initializer_range: raw.initializer_range,
            layer_types,
            linear_attention,
            shared_expert_intermediate_size: raw.shared_expert_intermediate_size,
            multimodal,
            sliding_window,
            sliding_layers,
            swiglu_alpha: raw.swiglu_alpha.unwrap_or(1.702),
            swiglu_limit: raw.swiglu_limit.unwrap_or(7.0),
        };
        config.validate()?;
        Ok(config.keeping_unread_text_fields())
    }

    /// A vision-language config keeps, of its source `text_config`, only the fields
    /// [`ModelConfig::to_hf_json`] does not write (and of `rope_parameters` the keys it does
    /// not write, e.g. Qwen3.5's `mrope_section`), so an export writes them back unchanged
    /// and reads back as the same config.
    fn keeping_unread_text_fields(mut self) -> Self {
        let Some(wrapper) = self.multimodal.take() else {
            return self;
        };
        let written = Self {
            multimodal: None,
            ..self.clone()
        }
        .to_hf_json();
        let mut wrapper = wrapper;
        if let (Some(text), Some(written)) = (
            wrapper
                .get_mut("text_config")
                .and_then(Value::as_object_mut),
            written.as_object(),
        ) {
            for (key, value) in written {
                let rest = match (text.remove(key), value) {
                    (Some(Value::Object(mut kept)), Value::Object(ours)) => {
                        kept.retain(|k, _| !ours.contains_key(k));
                        (!kept.is_empty()).then_some(Value::Object(kept))
                    }
                    _ => None,
                };
                if let Some(rest) = rest {
                    text.insert(key.clone(), rest);
                }
            }
            text.remove("model_type");
        }
        self.multimodal = Some(wrapper);
        self
    }

    /// Reads and parses `path` (a `config.json`).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, BridgeError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| BridgeError::io(path, e))?;
        Self::from_hf_json(&text)
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
    #[test]
    fn intermediate_size_is_needed_only_by_dense_layers() {
        // transformers' Qwen3_5MoeTextConfig has no `intermediate_size`: every layer is sparse.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/models/qwen35moe-tiny/config.json"
        );
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let removed = match json.get_mut("text_config") {
            Some(text) => text.as_object_mut().unwrap().remove("intermediate_size"),
            None => json.as_object_mut().unwrap().remove("intermediate_size"),
        };
        assert!(removed.is_some());
        let c = ModelConfig::from_hf_json(&json.to_string()).unwrap();
        assert!((0..c.num_hidden_layers).all(|l| c.is_moe_layer(l)));
        // A dense model without it is refused, naming the field.
        let dense = V5.replace(r#""intermediate_size":128,"#, "");
        let err = ModelConfig::from_hf_json(&dense).unwrap_err().to_string();
        assert!(err.contains("intermediate_size"), "{err}");
    }
}
