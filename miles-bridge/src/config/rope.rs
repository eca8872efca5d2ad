//! RoPE frequency scaling: Llama-3's and YaRN's parameters, and how `config.json`'s
//! `rope_parameters` / `rope_scaling` objects are read into them.

use serde_json::Value;

use crate::error::BridgeError;

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
/// set (`ModelConfig::softmax_scale`).
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
pub(crate) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
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

/// Reads `key` of a `rope_parameters` / `rope_scaling` object as f64.
pub(crate) fn rope_field(obj: Option<&Value>, key: &str) -> Option<f64> {
    obj.and_then(|v| v.get(key)).and_then(Value::as_f64)
}

/// The RoPE variant named by a `rope_parameters` / `rope_scaling` object.
pub(crate) fn rope_type(obj: Option<&Value>) -> &str {
    obj.and_then(|o| o.get("rope_type").or_else(|| o.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default")
}

pub(crate) fn llama3_scaling(obj: &Value, field: &str) -> Result<Llama3RopeScaling, BridgeError> {
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
pub(crate) fn yarn_scaling(
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
