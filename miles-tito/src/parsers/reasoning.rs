//! Reasoning parsers (SGLang `--reasoning-parser`): how the `<think>…</think>` block (GPT-OSS:
//! the analysis channel) is split off the answer, per family.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// How reasoning is separated from the answer.
///
/// The `force_reasoning` variants start inside the reasoning block: the family's template
/// opened `<think>` in the generation prompt, so text before `</think>` is reasoning even
/// without `<think>` (SGLang forces reasoning per request: by default for `qwen3`, `glm45`,
/// `nemotron_3` and `kimi_k2`, when `thinking` is on for `deepseek-v3` / `deepseek-v4`; see
/// [`ReasoningParser::for_kwargs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReasoningParser {
    /// `<think>…</think>` (Qwen3, Qwen3.5, Qwen-Next; SGLang `qwen3`, `qwen3-thinking`,
    /// `minimax`). A `<tool_call>` before any `</think>` ends the reasoning.
    Qwen3 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// GLM-4.5 / 4.7: `<think>…</think>`; a `<tool_call>` before `</think>` ends it.
    Glm45,
    /// Kimi K2 / K2.5 / K2.6: `<think>…</think>`; `<|tool_calls_section_begin|>` before
    /// `</think>` ends it.
    KimiK2 {
        /// The output starts inside the reasoning block (K2.5's template opens `<think>`).
        force_reasoning: bool,
    },
    /// SGLang `deepseek-r1`: always starts inside reasoning, `(<think>)?…</think>`.
    DeepSeekR1,
    /// SGLang `deepseek-v3` (DeepSeek V3.1 / V3.2): `<think>…</think>`, forced when the request
    /// thinks (the encoder ends the generation prompt with `<think>`).
    DeepSeekV3 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// SGLang `deepseek-v4`: `<think>…</think>`, forced when the request thinks.
    DeepSeekV4 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// SGLang `nemotron_3`: `<think>…</think>`; a `<tool_call>` before `</think>` ends it.
    Nemotron3 {
        /// The output starts inside the reasoning block (the template opens `<think>`).
        force_reasoning: bool,
    },
    /// SGLang `minimax-append-think` (MiniMax M2 / M2.5 / M2.7): nothing is split off; the
    /// `<think>` the generation prompt opened is put back in front of the text, so the
    /// reasoning stays in `content` (the template recovers it from there next turn).
    MinimaxAppendThink,
    /// SGLang `gpt-oss` (GPT-OSS's harmony format): the `analysis` channel is the reasoning,
    /// the `final` channel and `commentary` preambles the answer; tool-call blocks stay in the
    /// answer, raw, for the tool-call parser.
    GptOss,
}

/// `<think>`.
const THINK_START: &str = "<think>";
/// `</think>`.
const THINK_END: &str = "</think>";

/// Whether the DeepSeek thinking mode is on in `kwargs`, when any of its aliases is set
/// (`thinking_mode`, `enable_thinking`, `thinking`; resolved as Miles' DeepSeek bridge does).
fn deepseek_thinking(kwargs: &Map<String, Value>) -> Option<bool> {
    ["thinking_mode", "enable_thinking", "thinking"]
        .iter()
        .any(|k| kwargs.contains_key(*k))
        .then(|| crate::deepseek::thinking_enabled(kwargs))
}

impl ReasoningParser {
    /// The parser for an SGLang `--reasoning-parser` name (with the detector's own default for
    /// `force_reasoning`; `qwen3-thinking`, `minimax` and `deepseek-r1` always force).
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "qwen3" => Self::Qwen3 {
                force_reasoning: false,
            },
            "qwen3-thinking" | "minimax" => Self::Qwen3 {
                force_reasoning: true,
            },
            "glm45" => Self::Glm45,
            "kimi_k2" => Self::KimiK2 {
                force_reasoning: false,
            },
            "deepseek-r1" => Self::DeepSeekR1,
            "deepseek-v3" => Self::DeepSeekV3 {
                force_reasoning: false,
            },
            "deepseek-v4" => Self::DeepSeekV4 {
                force_reasoning: false,
            },
            "nemotron_3" => Self::Nemotron3 {
                force_reasoning: false,
            },
            "minimax-append-think" => Self::MinimaxAppendThink,
            "gpt-oss" => Self::GptOss,
            other => {
                return Err(Error::UnknownParser {
                    kind: "reasoning",
                    name: other.to_owned(),
                });
            }
        })
    }

    /// The parser for a request with chat-template `kwargs`, as SGLang decides per request
    /// whether the output starts inside reasoning: `enable_thinking: false` (Qwen3, Nemotron 3)
    /// or `thinking: false` (Kimi) turns forcing off; for DeepSeek the resolved thinking mode
    /// (`thinking_mode` / `enable_thinking` / `thinking`) sets it. Without such a kwarg the
    /// family's default stays.
    pub fn for_kwargs(self, kwargs: &Map<String, Value>) -> Self {
        let off = |key: &str| kwargs.get(key).and_then(Value::as_bool) == Some(false);
        match self {
            Self::Qwen3 { .. } if off("enable_thinking") => Self::Qwen3 {
                force_reasoning: false,
            },
            Self::Nemotron3 { .. } if off("enable_thinking") => Self::Nemotron3 {
                force_reasoning: false,
            },
            Self::KimiK2 { .. } if off("thinking") => Self::KimiK2 {
                force_reasoning: false,
            },
            Self::DeepSeekV3 { force_reasoning } => Self::DeepSeekV3 {
                force_reasoning: deepseek_thinking(kwargs).unwrap_or(force_reasoning),
            },
            Self::DeepSeekV4 { force_reasoning } => Self::DeepSeekV4 {
                force_reasoning: deepseek_thinking(kwargs).unwrap_or(force_reasoning),
            },
            other => other,
        }
    }

    /// `(forced, tool-call start that also ends reasoning)`.
    fn mode(self) -> (bool, Option<&'static str>) {
        match self {
            Self::Qwen3 { force_reasoning }
            | Self::DeepSeekV3 { force_reasoning }
            | Self::Nemotron3 { force_reasoning } => (force_reasoning, Some("<tool_call>")),
            Self::Glm45 => (false, Some("<tool_call>")),
            Self::KimiK2 { force_reasoning } => {
                (force_reasoning, Some("<|tool_calls_section_begin|>"))
            }
            Self::DeepSeekR1 => (true, None),
            Self::DeepSeekV4 { force_reasoning } => (force_reasoning, None),
            Self::MinimaxAppendThink | Self::GptOss => (false, None),
        }
    }

    /// Splits `text` into `(reasoning, normal text)` as SGLang's detectors do: the start tag is
    /// removed and the text stripped; everything before the end tag is reasoning, the rest
    /// (stripped) is the answer. No end tag: all reasoning (generation cut short), unless the
    /// family's tool-call start comes first, which then ends the reasoning and stays in the
    /// answer.
    ///
    /// [`ReasoningParser::GptOss`] reads channels instead (see its variant).
    pub fn parse(self, text: &str) -> (Option<String>, String) {
        if self == Self::GptOss {
            return super::harmony::split_reasoning(text);
        }
        if self == Self::MinimaxAppendThink {
            return (None, format!("{THINK_START}{text}"));
        }
        let (forced, tool_start) = self.mode();
        if !forced && !text.contains(THINK_START) {
            return (None, text.to_owned());
        }
        let processed = text.replacen(THINK_START, "", 1);
        let processed = processed.trim();
        if let Some((reasoning, rest)) = processed.split_once(THINK_END) {
            return (Some(reasoning.to_owned()), rest.trim().to_owned());
        }
        if let Some(at) = tool_start.and_then(|t| processed.find(t)) {
            return (Some(processed[..at].to_owned()), processed[at..].to_owned());
        }
        (Some(processed.to_owned()), String::new())
    }
}
