//! The chat-family table: everything that differs between Miles' TITO families, one row per
//! family.
//!
//! A row ([`FamilySpec`]) holds the family's template (the model's own, a fixed template the
//! crate ships, or a DeepSeek encoder), the template kwargs it forces, the roles a session may
//! append, how the stored prefix meets the incremental tokens (boundary rule, trailing ids,
//! trim), which ids the comparator cuts segments at, the text that opens an assistant turn,
//! the end-of-turn tokens, the reasoning and tool-call parsers of its output, and how a model
//! directory is recognised as the family ([`TitoFamily::detect`]).
//!
//! [`TitoFamily`] is the row's key, named as Miles' `--tito-model` values; the
//! `family_table!` invocation below declares both, so adding a family is adding one row there
//! (and one parser file under `parsers/` when its output format is new).

use miles_core::Role;
use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use crate::deepseek::{self, DeepSeekVersion};
use crate::error::{Error, Result};
use crate::parsers::{OutputParser, ReasoningParser, ToolCallParser};

/// All four appendable roles (`VALID_APPEND_ROLES`).
pub const ALL_ROLES: [Role; 4] = [Role::Tool, Role::User, Role::System, Role::Assistant];
/// Every role but `system`: templates that cannot render a mid-session system message.
const NO_SYSTEM: [Role; 3] = [Role::Tool, Role::User, Role::Assistant];

/// What renders a family's conversations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FamilyTemplate {
    /// The model directory's own chat template.
    Native,
    /// A fixed template shipped in `templates/` (Miles' `FIXED_TEMPLATE`).
    Fixed {
        /// The template's file name.
        file: &'static str,
        /// Its Jinja source.
        source: &'static str,
    },
    /// A DeepSeek prompt encoder (no Jinja template exists for these models).
    DeepSeek(DeepSeekVersion),
}

/// How the stored prefix is joined to the incremental tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BoundaryRule {
    /// Plain concatenation (default, Kimi, DeepSeek).
    Concat,
    /// The template writes `END\n` after every message but the model stops at `END`: when
    /// the prefix ends with `END`, append the `\n` token (Qwen, Nemotron: `<|im_end|>`;
    /// MiniMax: `[e~[`).
    NewlineAfter(&'static str),
    /// The model's stop tokens double as the next message's opener: drop one trailing token
    /// of this list (GLM-4.7: `<|observation|>`, `<|user|>`; `max_trim_tokens = 1`).
    TrimStopOpeners(&'static [&'static str]),
}

/// Which ids the token-sequence comparator treats as segment boundaries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpecialIds {
    /// The tokenizer's added tokens flagged special, less these texts (Kimi: `<|im_middle|>`).
    Added {
        /// Texts removed from the set when the vocabulary has them.
        except: &'static [&'static str],
    },
    /// Exactly these tokens, each of which must be in the vocabulary (DeepSeek: `<｜User｜>`,
    /// `<｜Assistant｜>`).
    Exactly(&'static [&'static str]),
}

/// How the tokens of appended messages are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Incremental {
    /// Render the appended messages (plus the generation prompt) after the two-message
    /// synthetic context and take the rendered suffix (Miles' default).
    SyntheticContext,
    /// Render the real histories, the stored one without and the new one with the generation
    /// prompt, and take the difference (DeepSeek V4: its encoder folds adjacent tool results
    /// and user turns, so the synthetic context renders them differently).
    RealHistories,
    /// As [`Incremental::SyntheticContext`], but when `old` does not end with tool calls the
    /// context ends with a dummy user turn instead of the dummy assistant (GPT-OSS: its
    /// template renders an assistant answer differently once it is no longer the last
    /// message — `<|end|>` for `<|return|>`, the analysis dropped — so a context ending with
    /// one is not a prefix of itself followed by more messages).
    SyntheticUserContext,
}

/// How a model directory is recognised as a family ([`TitoFamily::detect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Detection {
    /// `config.json` `model_type` values whose checkpoints ship this family's chat format.
    pub model_types: &'static [&'static str],
    /// A special token the family's template writes: a vocabulary without it is not this
    /// family, whatever its `model_type` says.
    pub marker: Option<&'static str>,
    /// Whether a vocabulary holding `marker` is taken for this family when no `model_type`
    /// decides (at most one row per marker).
    pub fallback: bool,
}

/// One row of the family table: what Miles' `TITOTokenizer` subclass of the family fixes,
/// plus the output parsers and end-of-turn tokens SGLang serves it with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FamilySpec {
    /// Miles' name (`qwen3`, `glm47`, …).
    pub name: &'static str,
    /// What renders the family's conversations.
    pub template: FamilyTemplate,
    /// The template kwargs the family forces (`extra_kwargs`); a caller value that differs
    /// is [`Error::KwargConflict`].
    pub forced_kwargs: &'static [(&'static str, bool)],
    /// Kwargs that are aliases of one setting (DeepSeek: `thinking_mode`, `enable_thinking`,
    /// `thinking`): a request setting any of them replaces all of them.
    pub kwarg_aliases: &'static [&'static str],
    /// Roles that may be appended to a session.
    pub append_roles: &'static [Role],
    /// How the stored prefix meets the incremental tokens.
    pub boundary: BoundaryRule,
    /// How the incremental tokens are computed.
    pub incremental: Incremental,
    /// How many trailing stored tokens the next prompt may drop.
    pub max_trim_tokens: usize,
    /// Texts whose ids form `trailing_token_ids` (where the model may stop; stripped by the
    /// verifier and the comparator). `"\n"` must encode to one token; the others are
    /// vocabulary tokens, required except for the DeepSeek encoders (Miles looks them up
    /// with `convert_tokens_to_ids`: a vocabulary without `<think>` just has no such id).
    pub trailing_tokens: &'static [&'static str],
    /// The comparator's segment boundaries.
    pub special_ids: SpecialIds,
    /// The text that opens an assistant turn (comparator classification), if known.
    pub assistant_start: Option<&'static str>,
    /// The texts an assistant turn ends with: sent to the engine as stop ids and stripped
    /// from the parsed output (the tokenizer's `eos_token` is added to them).
    pub end_of_turn: &'static [&'static str],
    /// How reasoning is split off the output (SGLang `--reasoning-parser`).
    pub reasoning_parser: Option<ReasoningParser>,
    /// How tool calls are read from the output (SGLang `--tool-call-parser`).
    pub tool_call_parser: Option<ToolCallParser>,
    /// How a model directory is recognised as this family.
    pub detection: Detection,
}

/// Declares [`TitoFamily`] (one variant per row, in row order) and the table itself.
macro_rules! family_table {
    ($($(#[$doc:meta])* $variant:ident => $row:expr,)+) => {
        /// A TITO tokenizer family, named as Miles' `--tito-model` values: the key of one row
        /// of the family table ([`TitoFamily::spec`]).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum TitoFamily {
            $($(#[$doc])* $variant,)+
        }

        /// Number of rows.
        const FAMILY_COUNT: usize = [$(stringify!($variant),)+].len();

        impl TitoFamily {
            /// Every supported family, in table order.
            pub const ALL: [TitoFamily; FAMILY_COUNT] = [$(TitoFamily::$variant,)+];
        }

        /// The family table, one row per [`TitoFamily`] variant, in declaration order.
        static FAMILIES: [FamilySpec; FAMILY_COUNT] = [$($row,)+];
    };
}

/// Detection of a family no model directory selects by itself.
const UNDETECTED: Detection = Detection {
    model_types: &[],
    marker: None,
    fallback: false,
};

/// Qwen's stop token.
const IM_END: &str = "<|im_end|>";

family_table! {
    /// The model's own template, plain concatenation, no forced kwargs.
    Default => FamilySpec {
        name: "default",
        template: FamilyTemplate::Native,
        forced_kwargs: &[],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &[],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: None,
        end_of_turn: &[],
        reasoning_parser: None,
        tool_call_parser: None,
        detection: UNDETECTED,
    },
    /// Qwen3 with `qwen3_fixed.jinja`.
    Qwen3 => FamilySpec {
        name: "qwen3",
        template: FamilyTemplate::Fixed {
            file: "qwen3_fixed.jinja",
            source: include_str!("../templates/qwen3_fixed.jinja"),
        },
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::NewlineAfter(IM_END),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|im_start|>assistant"),
        end_of_turn: &[IM_END],
        reasoning_parser: Some(ReasoningParser::Qwen3 { force_reasoning: false }),
        tool_call_parser: Some(ToolCallParser::Qwen25),
        detection: Detection {
            model_types: &["qwen3", "qwen3_moe"],
            marker: Some("<|im_start|>"),
            fallback: true,
        },
    },
    /// Qwen3.5 with `qwen3.5_fixed.jinja` (no mid-session system messages).
    Qwen35 => FamilySpec {
        name: "qwen35",
        template: FamilyTemplate::Fixed {
            file: "qwen3.5_fixed.jinja",
            source: include_str!("../templates/qwen3.5_fixed.jinja"),
        },
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &NO_SYSTEM,
        boundary: BoundaryRule::NewlineAfter(IM_END),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|im_start|>assistant"),
        end_of_turn: &[IM_END],
        reasoning_parser: Some(ReasoningParser::Qwen3 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::Qwen3Coder),
        detection: Detection {
            model_types: &[],
            marker: Some("<|im_start|>"),
            fallback: false,
        },
    },
    /// Qwen3 thinking-2507 / Qwen3-Next with `qwen3_thinking_2507_and_next_fixed.jinja`.
    QwenNext => FamilySpec {
        name: "qwennext",
        template: FamilyTemplate::Fixed {
            file: "qwen3_thinking_2507_and_next_fixed.jinja",
            source: include_str!("../templates/qwen3_thinking_2507_and_next_fixed.jinja"),
        },
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::NewlineAfter(IM_END),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|im_start|>assistant"),
        end_of_turn: &[IM_END],
        reasoning_parser: Some(ReasoningParser::Qwen3 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::Qwen25),
        detection: Detection {
            model_types: &["qwen3_next"],
            marker: Some("<|im_start|>"),
            fallback: false,
        },
    },
    /// GLM-4.7: native template, `<|observation|>`/`<|user|>` trim.
    Glm47 => FamilySpec {
        name: "glm47",
        template: FamilyTemplate::Native,
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::TrimStopOpeners(&["<|observation|>", "<|user|>"]),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 1,
        trailing_tokens: &["<|observation|>", "<|user|>"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|assistant|>"),
        end_of_turn: &["<|user|>", "<|observation|>", "<|endoftext|>"],
        reasoning_parser: Some(ReasoningParser::Glm45),
        tool_call_parser: Some(ToolCallParser::Glm47),
        detection: Detection {
            model_types: &["glm4_moe", "glm4_moe_lite"],
            marker: Some("<|observation|>"),
            fallback: true,
        },
    },
    /// Nemotron 3: native template, `truncate_history_thinking=False`.
    Nemotron3 => FamilySpec {
        name: "nemotron3",
        template: FamilyTemplate::Native,
        forced_kwargs: &[("truncate_history_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::NewlineAfter(IM_END),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|im_start|>assistant\n"),
        end_of_turn: &[IM_END],
        reasoning_parser: Some(ReasoningParser::Nemotron3 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::Qwen3Coder),
        detection: Detection {
            model_types: &[],
            marker: Some("<|im_start|>"),
            fallback: false,
        },
    },
    /// Kimi K2.5 with `kimi_k25_fixed.jinja`.
    Kimi25 => FamilySpec {
        name: "kimi25",
        template: FamilyTemplate::Fixed {
            file: "kimi_k25_fixed.jinja",
            source: include_str!("../templates/kimi_k25_fixed.jinja"),
        },
        forced_kwargs: &[("preserve_thinking", true)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &[],
        special_ids: SpecialIds::Added { except: &["<|im_middle|>"] },
        assistant_start: Some("<|im_assistant|>"),
        end_of_turn: &[IM_END],
        // Miles binds no parsers; SGLang's Kimi parsers read K2.5's format.
        reasoning_parser: Some(ReasoningParser::KimiK2 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::KimiK2),
        detection: Detection {
            model_types: &[],
            marker: Some("<|im_middle|>"),
            fallback: true,
        },
    },
    /// Kimi K2.6: native template, `preserve_thinking=True`.
    Kimi26 => FamilySpec {
        name: "kimi26",
        template: FamilyTemplate::Native,
        forced_kwargs: &[("preserve_thinking", true)],
        kwarg_aliases: &[],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &[],
        special_ids: SpecialIds::Added { except: &["<|im_middle|>"] },
        assistant_start: Some("<|im_assistant|>"),
        end_of_turn: &[IM_END],
        reasoning_parser: Some(ReasoningParser::KimiK2 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::KimiK2),
        detection: Detection {
            model_types: &[],
            marker: Some("<|im_middle|>"),
            fallback: false,
        },
    },
    /// MiniMax M2.5 with `minimax_m25_fixed.jinja`.
    MinimaxM25 => FamilySpec {
        name: "minimax_m25",
        template: FamilyTemplate::Fixed {
            file: "minimax_m25_fixed.jinja",
            source: include_str!("../templates/minimax_m25_fixed.jinja"),
        },
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &NO_SYSTEM,
        boundary: BoundaryRule::NewlineAfter("[e~["),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("]~b]ai"),
        end_of_turn: &["[e~["],
        reasoning_parser: Some(ReasoningParser::MinimaxAppendThink),
        tool_call_parser: Some(ToolCallParser::MinimaxM2),
        detection: Detection {
            model_types: &[],
            marker: Some("]~b]"),
            fallback: true,
        },
    },
    /// MiniMax M2.7 with `minimax_m27_fixed.jinja`.
    MinimaxM27 => FamilySpec {
        name: "minimax_m27",
        template: FamilyTemplate::Fixed {
            file: "minimax_m27_fixed.jinja",
            source: include_str!("../templates/minimax_m27_fixed.jinja"),
        },
        forced_kwargs: &[("clear_thinking", false)],
        kwarg_aliases: &[],
        append_roles: &NO_SYSTEM,
        boundary: BoundaryRule::NewlineAfter("[e~["),
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &["\n"],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("]~b]ai"),
        end_of_turn: &["[e~["],
        reasoning_parser: Some(ReasoningParser::MinimaxAppendThink),
        tool_call_parser: Some(ToolCallParser::MinimaxM2),
        detection: Detection {
            model_types: &[],
            marker: Some("]~b]"),
            fallback: false,
        },
    },
    /// DeepSeek V3.2: Miles' vendored `encoding_dsv32` encoder, `drop_thinking=False`.
    DeepseekV32 => FamilySpec {
        name: "deepseekv32",
        template: FamilyTemplate::DeepSeek(DeepSeekVersion::V32),
        forced_kwargs: &[("drop_thinking", false)],
        kwarg_aliases: &["thinking_mode", "enable_thinking", "thinking"],
        append_roles: &ALL_ROLES,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::SyntheticContext,
        max_trim_tokens: 0,
        trailing_tokens: &[],
        special_ids: SpecialIds::Exactly(&[deepseek::USER_TOKEN, deepseek::ASSISTANT_TOKEN]),
        assistant_start: Some(deepseek::ASSISTANT_TOKEN),
        end_of_turn: &[deepseek::EOS],
        reasoning_parser: Some(ReasoningParser::DeepSeekV3 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::DeepSeekV32),
        detection: Detection {
            model_types: &["deepseek_v32"],
            marker: Some(deepseek::ASSISTANT_TOKEN),
            fallback: false,
        },
    },
    /// DeepSeek V4: sglang's `encoding_dsv4` encoder, `drop_thinking=False`, incremental
    /// tokens from the real histories' renders (no mid-session system messages).
    DeepseekV4 => FamilySpec {
        name: "deepseekv4",
        template: FamilyTemplate::DeepSeek(DeepSeekVersion::V4),
        forced_kwargs: &[("drop_thinking", false)],
        kwarg_aliases: &["thinking_mode", "enable_thinking", "thinking"],
        append_roles: &NO_SYSTEM,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::RealHistories,
        max_trim_tokens: 0,
        trailing_tokens: &[
            deepseek::ASSISTANT_TOKEN,
            deepseek::THINK_START,
            deepseek::THINK_END,
        ],
        special_ids: SpecialIds::Exactly(&[deepseek::USER_TOKEN, deepseek::ASSISTANT_TOKEN]),
        assistant_start: Some(deepseek::ASSISTANT_TOKEN),
        end_of_turn: &[deepseek::EOS],
        reasoning_parser: Some(ReasoningParser::DeepSeekV4 { force_reasoning: true }),
        tool_call_parser: Some(ToolCallParser::DeepSeekV4),
        detection: Detection {
            model_types: &["deepseek_v4"],
            marker: Some(deepseek::ASSISTANT_TOKEN),
            fallback: false,
        },
    },
    /// GPT-OSS (harmony format): native template, no forced kwargs (the template has no
    /// switch that keeps earlier analysis), appended messages rendered after a dummy user
    /// context (no mid-session system messages). Ours: Miles has no GPT-OSS TITO
    /// family.
    GptOss => FamilySpec {
        name: "gpt_oss",
        template: FamilyTemplate::Native,
        forced_kwargs: &[],
        kwarg_aliases: &[],
        // The template renders a system message only first (as the developer message).
        append_roles: &NO_SYSTEM,
        boundary: BoundaryRule::Concat,
        incremental: Incremental::SyntheticUserContext,
        max_trim_tokens: 0,
        trailing_tokens: &[],
        special_ids: SpecialIds::Added { except: &[] },
        assistant_start: Some("<|start|>assistant"),
        // generation_config.json's `eos_token_id`.
        end_of_turn: &["<|return|>", "<|call|>", "<|endoftext|>"],
        reasoning_parser: Some(ReasoningParser::GptOss),
        tool_call_parser: Some(ToolCallParser::GptOss),
        detection: Detection {
            model_types: &["gpt_oss"],
            marker: Some("<|channel|>"),
            fallback: true,
        },
    },
}

impl TitoFamily {
    /// The family's row of the table.
    pub fn spec(self) -> &'static FamilySpec {
        &FAMILIES[self as usize]
    }

    /// Miles' name (`qwen3`, `glm47`, …).
    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// Parses a Miles family name.
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| Error::UnknownFamily {
                name: name.to_owned(),
                known: Self::ALL.map(Self::name).join(", "),
            })
    }

    /// The family of a model directory, from its `config.json` `model_type` and its
    /// vocabulary (either may be unknown). This is the one detection rule of the workspace:
    ///
    /// 1. a row listing `model_type` wins, unless the vocabulary lacks the row's marker token
    ///    (a checkpoint of one architecture may ship another family's chat format);
    /// 2. otherwise the vocabulary decides: the first row, in table order, that is its
    ///    marker's fallback and whose marker the vocabulary holds (`<|im_start|>` → `qwen3`,
    ///    `<|observation|>` → `glm47`, `<|im_middle|>` → `kimi25`, `]~b]` → `minimax_m25`,
    ///    `<|channel|>` → `gpt_oss`);
    /// 3. otherwise `default` (the model's own template, no boundary rule, no parsers).
    pub fn detect(model_type: Option<&str>, vocabulary: Option<&Tokenizer>) -> Self {
        let has_marker = |family: &Self| match (family.spec().detection.marker, vocabulary) {
            (Some(marker), Some(tokenizer)) => tokenizer.token_to_id(marker).is_some(),
            _ => true,
        };
        if let Some(model_type) = model_type
            && let Some(family) = Self::ALL
                .into_iter()
                .find(|f| f.spec().detection.model_types.contains(&model_type) && has_marker(f))
        {
            return family;
        }
        if vocabulary.is_some()
            && let Some(family) = Self::ALL.into_iter().find(|f| {
                let detection = f.spec().detection;
                detection.fallback && detection.marker.is_some() && has_marker(f)
            })
        {
            return family;
        }
        Self::Default
    }

    /// The fixed template's file name and Jinja source, or `None` for the model's own.
    pub fn fixed_template(self) -> Option<(&'static str, &'static str)> {
        match self.spec().template {
            FamilyTemplate::Fixed { file, source } => Some((file, source)),
            FamilyTemplate::Native | FamilyTemplate::DeepSeek(_) => None,
        }
    }

    /// The DeepSeek encoder the family renders with, for the DeepSeek families.
    pub fn deepseek_encoder(self) -> Option<DeepSeekVersion> {
        match self.spec().template {
            FamilyTemplate::DeepSeek(version) => Some(version),
            FamilyTemplate::Native | FamilyTemplate::Fixed { .. } => None,
        }
    }

    /// The kwargs the family forces (`extra_kwargs`).
    pub fn forced_kwargs(self) -> Map<String, Json> {
        self.spec()
            .forced_kwargs
            .iter()
            .map(|(key, value)| ((*key).to_owned(), Json::Bool(*value)))
            .collect()
    }

    /// Roles that may be appended to a session.
    pub fn allowed_append_roles(self) -> &'static [Role] {
        self.spec().append_roles
    }

    /// The text that opens an assistant turn (comparator classification), if known.
    pub fn assistant_start_str(self) -> Option<&'static str> {
        self.spec().assistant_start
    }

    /// How many trailing stored tokens the next prompt may drop.
    pub fn max_trim_tokens(self) -> usize {
        self.spec().max_trim_tokens
    }

    /// The family's boundary rule.
    pub fn boundary_rule(self) -> BoundaryRule {
        self.spec().boundary
    }

    /// Kwargs that are aliases of one setting: when a request sets any of them,
    /// [`crate::TitoTokenizer::clone_with_chat_template_kwargs`] drops all of them from the
    /// base kwargs first (DeepSeek: `thinking_mode`, `enable_thinking`, `thinking`).
    pub fn kwarg_aliases(self) -> &'static [&'static str] {
        self.spec().kwarg_aliases
    }

    /// The texts an assistant turn of this family ends with.
    pub fn end_of_turn(self) -> &'static [&'static str] {
        self.spec().end_of_turn
    }

    /// The output parser of the family: its reasoning and tool-call parsers, with its
    /// end-of-turn texts stripped first.
    ///
    /// Where the family's template opens `<think>` in the generation prompt (Qwen3.5,
    /// Qwen-Next, Nemotron 3, Kimi K2.5 / K2.6, DeepSeek in thinking mode), the output starts
    /// inside the reasoning block: the parser forces reasoning, as SGLang does for these
    /// parsers by default; a request that turns thinking off un-forces it
    /// ([`OutputParser::for_kwargs`]).
    pub fn output_parser(self) -> OutputParser {
        let spec = self.spec();
        OutputParser {
            reasoning: spec.reasoning_parser,
            tool_calls: spec.tool_call_parser,
            end_of_turn: spec.end_of_turn.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// The kwargs a tokenizer of this family renders with: `kwargs` with the family's forced
    /// kwargs merged in (a caller value that differs from a forced one is
    /// [`Error::KwargConflict`]); the DeepSeek families also set `thinking` to whether the
    /// kwargs resolve to thinking mode.
    pub fn merge_kwargs(self, kwargs: Map<String, Json>) -> Result<Map<String, Json>> {
        let mut kwargs = merge_forced(self, kwargs)?;
        if self.deepseek_encoder().is_some() {
            let thinking = deepseek::thinking_enabled(&kwargs);
            kwargs.insert("thinking".into(), Json::Bool(thinking));
        }
        Ok(kwargs)
    }
}

impl std::fmt::Display for TitoFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

fn merge_forced(family: TitoFamily, mut kwargs: Map<String, Json>) -> Result<Map<String, Json>> {
    for (key, value) in family.forced_kwargs() {
        match kwargs.get(&key) {
            Some(given) if *given != value => {
                return Err(Error::KwargConflict {
                    key,
                    value: given.to_string(),
                    family: family.name().into(),
                });
            }
            _ => {
                kwargs.insert(key, value);
            }
        }
    }
    Ok(kwargs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_names_round_trip_and_unknown_is_typed() {
        for family in TitoFamily::ALL {
            assert_eq!(TitoFamily::parse(family.name()).unwrap(), family);
        }
        assert!(matches!(
            TitoFamily::parse("gpt"),
            Err(Error::UnknownFamily { .. })
        ));
    }

    #[test]
    fn forced_kwargs_conflict() {
        let mut kwargs = Map::new();
        kwargs.insert("clear_thinking".into(), Json::Bool(true));
        let err = merge_forced(TitoFamily::Qwen3, kwargs).unwrap_err();
        assert_eq!(
            err.to_string(),
            "chat template kwarg clear_thinking=true conflicts with the value registered for qwen3"
        );
        let mut kwargs = Map::new();
        kwargs.insert("clear_thinking".into(), Json::Bool(false));
        kwargs.insert("enable_thinking".into(), Json::Bool(true));
        let merged = merge_forced(TitoFamily::Qwen3, kwargs).unwrap();
        assert_eq!(merged.len(), 2);
        assert!(
            merge_forced(TitoFamily::Default, Map::new())
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn the_table_is_consistent() {
        let mut fallback_markers = Vec::new();
        for family in TitoFamily::ALL {
            let spec = family.spec();
            // A family with a boundary token stops on it.
            if let BoundaryRule::NewlineAfter(end) = spec.boundary {
                assert!(spec.end_of_turn.contains(&end), "{family}");
            }
            // Only a trim rule drops stored tokens.
            assert_eq!(
                spec.max_trim_tokens > 0,
                matches!(spec.boundary, BoundaryRule::TrimStopOpeners(_)),
                "{family}"
            );
            // Real-history diffs exist for the encoders only.
            if spec.incremental == Incremental::RealHistories {
                assert!(family.deepseek_encoder().is_some(), "{family}");
            }
            if spec.detection.fallback {
                let marker = spec.detection.marker.expect("a fallback row has a marker");
                assert!(!fallback_markers.contains(&marker), "{marker} twice");
                fallback_markers.push(marker);
            }
            // Every append-role list is a subset of Miles' four roles.
            assert!(spec.append_roles.iter().all(|r| ALL_ROLES.contains(r)));
        }
    }

    #[test]
    fn model_types_alone_pick_the_family() {
        // What `miles serve` chose from config.json before the table existed.
        let cases = [
            (Some("qwen3"), TitoFamily::Qwen3),
            (Some("qwen3_moe"), TitoFamily::Qwen3),
            (Some("qwen3_next"), TitoFamily::QwenNext),
            (Some("glm4_moe"), TitoFamily::Glm47),
            (Some("glm4_moe_lite"), TitoFamily::Glm47),
            (Some("deepseek_v32"), TitoFamily::DeepseekV32),
            (Some("deepseek_v4"), TitoFamily::DeepseekV4),
            (Some("gpt_oss"), TitoFamily::GptOss),
            (Some("llama"), TitoFamily::Default),
            (Some("deepseek_v3"), TitoFamily::Default),
            (None, TitoFamily::Default),
        ];
        for (model_type, family) in cases {
            assert_eq!(
                TitoFamily::detect(model_type, None),
                family,
                "{model_type:?}"
            );
        }
    }
}
