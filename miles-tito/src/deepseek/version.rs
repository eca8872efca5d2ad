//! Which DeepSeek encoder: [`DeepSeekVersion`].

use serde_json::Value as Json;

use super::tokens::ASSISTANT_TOKEN;

/// Which DeepSeek encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeepSeekVersion {
    /// DeepSeek V3.2 (Miles' vendored `encoding_dsv32`).
    V32,
    /// DeepSeek V4 (sglang's `encoding_dsv4`).
    V4,
}

impl DeepSeekVersion {
    /// The checkpoint's `config.json` `model_type` (`deepseek_v32`, `deepseek_v4`).
    pub fn model_type(self) -> &'static str {
        match self {
            Self::V32 => "deepseek_v32",
            Self::V4 => "deepseek_v4",
        }
    }

    /// The version a `config.json` `model_type` routes to, if any.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "deepseek_v32" => Some(Self::V32),
            "deepseek_v4" => Some(Self::V4),
            _ => None,
        }
    }

    /// The generation suffix Miles strips when `add_generation_prompt=False`, for a
    /// conversation ending with `tail_role`.
    pub(super) fn generation_suffix(self, tail_role: &Json, think: &str) -> Option<String> {
        let role = tail_role.as_str()?;
        match (self, role) {
            (_, "user" | "developer") | (Self::V4, "tool") => {
                Some(format!("{ASSISTANT_TOKEN}{think}"))
            }
            (Self::V32, "tool") => Some(format!("\n\n{think}")),
            _ => None,
        }
    }
}

impl std::fmt::Display for DeepSeekVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}
