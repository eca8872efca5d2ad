//! # miles-tito
//!
//! HF-exact chat templates and token-in-token-out (TITO) incremental tokenization for
//! multi-turn RL: the tokens the trainer sees are exactly the tokens the model produced, and
//! each new turn costs only its own tokens.
//!
//! ```
//! use miles_tito::{ChatTemplate, RenderArgs};
//! use serde_json::{json, Map};
//!
//! // Rendering follows HF transformers' sandbox: null-valued keys are dropped, values print
//! // as Python prints them, `tojson` is `json.dumps(..., ensure_ascii=False)`.
//! let template = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ m.meta|tojson }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}{{ flag }}",
//! )?;
//! let messages = vec![json!({"role": "user", "content": "héllo", "name": null, "meta": {"k": [1, 2.5]}})];
//! let mut kwargs = Map::new();
//! kwargs.insert("flag".into(), json!(true));
//! let text = template.render(RenderArgs {
//!     messages: &messages,
//!     tools: None,
//!     add_generation_prompt: true,
//!     kwargs: &kwargs,
//! })?;
//! assert_eq!(text, "<|user|>héllo{\"k\": [1, 2.5]}\n<|assistant|>True");
//! # Ok::<(), miles_tito::Error>(())
//! ```
//!
//! What the crate holds (every item at the crate root, one path each):
//!
//! * **HF-exact rendering** — [`HfChat`] / [`ChatTemplate`] ([`RenderArgs`],
//!   [`RenderLimits`], [`Rendered`]): loading a model directory like transformers
//!   (`tokenizer.json`, `tokenizer_config.json` special tokens and `chat_template` string or
//!   named list, `chat_template.jinja`) and rendering with minijinja configured like HF's
//!   immutable Jinja2 sandbox. Text and ids equal transformers 5.24 exactly on 3762 renders
//!   over 33 real templates (`tests/it/hf_exact.rs`). Where HF raises (`raise_exception`,
//!   `list.append`, undefined values), rendering returns a typed [`Error`]. A template
//!   byte-identical to one the crate ships in compiled form (so far `qwen3_fixed.jinja` and
//!   its Qwen3-Next variant) renders through that Rust form when the input has the shapes it
//!   handles, with the template's exact text ([`ChatTemplate::is_compiled`],
//!   [`ChatTemplate::interpreted`]). [`encode`] / [`decode`] are HF's
//!   `encode(text, add_special_tokens=False)` / `decode(ids)`; [`tools_to_json`],
//!   [`normalise_messages`], [`miles_normalise`] and [`canonical_tools`] shape template input
//!   as transformers and Miles do.
//! * **Fast paths** — [`FastEncoder`]: id-exact `encode` for byte-level BPE tokenizers with
//!   the GPT-4-style split regex (Qwen2/Qwen3, Llama 3, GLM-4.x); [`FastDecoder`]: text-exact
//!   table-driven `decode` for `ByteLevel` decoders. [`HfChat`] and [`TitoTokenizer`] use them
//!   when the tokenizer qualifies; anything else goes through HF tokenizers unchanged.
//! * **The family table** — [`TitoFamily`] / [`FamilySpec`]: one row per Miles family
//!   (`default`, `qwen3`, `qwen35`, `qwennext`, `glm47`, `nemotron3`, `kimi25`, `kimi26`,
//!   `minimax_m25`, `minimax_m27`, `deepseekv32`, `deepseekv4`, and our `gpt_oss`) with its template
//!   ([`FamilyTemplate`]: native, an embedded fixed template or a DeepSeek encoder), forced
//!   kwargs, append roles, boundary rule ([`BoundaryRule`], [`Incremental`]), trailing and
//!   special ids ([`SpecialIds`]), assistant opener, end-of-turn tokens, reasoning and
//!   tool-call parsers, and detection from `config.json`'s `model_type` and the vocabulary's
//!   special tokens ([`Detection`], [`TitoFamily::detect`]: the one detection rule of the
//!   workspace).
//! * **Incremental tokenization** — [`TitoTokenizer`]: a family bound to a model directory;
//!   `tokenize_additional_messages` against the synthetic context with the rendered-suffix
//!   check (DeepSeek V4: against the real histories), `merge_tokens`,
//!   `clone_with_chat_template_kwargs` (with DeepSeek's thinking-alias group), and a session
//!   replay.
//! * **DeepSeek encoders** — [`DeepSeekVersion`]: the V3.2 and V4 prompt encoders (no Jinja
//!   template exists for them), byte-exact with the Python encoders Miles renders with
//!   ([`DeepSeekVersion::encode_messages`], [`DeepSeekEncodeOptions`]), and Miles' bridge to
//!   them ([`DeepSeekVersion::apply_chat_template`]); [`HfChat`] routes a directory whose
//!   `config.json` `model_type` is `deepseek_v32` / `deepseek_v4` there.
//! * **Output parsers** — [`OutputParser`] ([`ReasoningParser`], [`ToolCallParser`],
//!   [`ParsedAssistant`]): SGLang's reasoning and tool-call parsers by name, one source file
//!   per output format, never failing on model output.
//! * **The session seam** — [`ChatTokenizer`]: what a session server needs from a chat
//!   template + tokenizer (render, incremental tokens, output parsing, decode, boundary fix,
//!   comparator); [`TitoChat`] implements it for every family over a model directory.
//! * **Checks** — [`assert_append_only`] / [`MessageMatcher`]: append-only message validation
//!   with Miles' `strict` normalisation; [`TokenTrajectory`] ([`TurnRecord`], [`TurnSample`],
//!   [`TurnSpan`], [`turn_samples`], [`merge_turn_samples`],
//!   [`assert_pretokenized_prefix`]): the extend-only token trajectory with the runtime
//!   prefix assertion, one-step rollback, loss masks (1 exactly on generated ids), per-turn
//!   samples with trailing-stop trimming and their merge; [`TokenSeqComparator`] /
//!   [`Mismatch`] / [`MismatchType`] / [`MismatchMetric`]: the token-sequence comparator and
//!   session mismatch metric; [`verify()`] ([`VerifyTarget`], [`VerifyReport`],
//!   [`CaseResult`], [`Trajectory`], [`ThinkingMode`], [`parse_trajectories`]): the
//!   chat-template verifier, also exposed by `miles tito` (miles-cli: `render`,
//!   `incremental`, `verify`).
//!
//! The crate depends on tokenizers, minijinja and serde only: no burn, no async runtime.
//!
//! ## Adding a chat family
//!
//! Add one row to the table in `src/family.rs` (the `family_table!` invocation): the variant
//! name and doc line, and a [`FamilySpec`] with the family's template (a new fixed template
//! goes in `templates/`), kwargs, roles, boundary rule, trailing / special tokens, assistant
//! opener, end-of-turn tokens, parsers and detection. Everything else — parsing the name,
//! [`TitoTokenizer`], [`TitoChat`], the session server, detection — reads the row. When the
//! family's output is in a format no parser reads yet, add one file under `src/parsers/` and
//! its variant of [`ToolCallParser`] (or [`ReasoningParser`]).

mod args;
mod chat;
mod comparator;
mod deepseek;
mod error;
mod family;
mod fastdec;
mod fastenc;
mod hf;
mod loose_json;
mod matcher;
mod model;
mod native;
mod parsers;
mod pyfmt;
mod template;
#[cfg(feature = "testkit")]
pub mod testkit;
mod tito;
mod tito_chat;
mod trajectory;
mod verify;

pub use args::RenderArgs;
pub use chat::ChatTokenizer;
pub use comparator::{Mismatch, MismatchMetric, MismatchType, TokenSeqComparator};
pub use deepseek::{DeepSeekEncodeOptions, DeepSeekVersion};
pub use error::{Error, Result};
pub use family::{
    ALL_ROLES, BoundaryRule, Detection, FamilySpec, FamilyTemplate, Incremental, SpecialIds,
    TitoFamily,
};
pub use fastdec::FastDecoder;
pub use fastenc::FastEncoder;
pub use hf::{decode, decode_text, encode};
pub use matcher::{MessageMatcher, TEMPLATE_KEYS, assert_append_only};
pub use model::{HfChat, Rendered, SPECIAL_TOKEN_ATTRIBUTES};
pub use parsers::{OutputParser, ParsedAssistant, ReasoningParser, ToolCallParser};
pub use template::{ChatTemplate, RenderLimits, TemplateClock, normalise_messages, tools_to_json};
pub use tito::{TitoTokenizer, canonical_tools, miles_normalise};
pub use tito_chat::TitoChat;
pub use trajectory::{
    TokenTrajectory, TurnRecord, TurnSample, TurnSpan, assert_pretokenized_prefix,
    merge_turn_samples, turn_samples,
};
pub use verify::{
    CaseResult, DEFAULT_TRAJECTORIES, ThinkingMode, Trajectory, VerifyReport, VerifyTarget,
    parse_trajectories, verify,
};
