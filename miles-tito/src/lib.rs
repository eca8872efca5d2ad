//! # miles-tito
//!
//! HF-exact chat templates and token-in-token-out (TITO) incremental tokenization for
//! multi-turn RL: the tokens the trainer sees are exactly the tokens the model produced, and
//! each new turn costs only its own tokens (MILES_SPEC §1).
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
//! What the crate owns:
//!
//! * [`HfChat`] / [`ChatTemplate`] ([`model`], [`template`], [`pyfmt`]): loading a model
//!   directory like transformers (`tokenizer.json`, `tokenizer_config.json` special tokens and
//!   `chat_template` string or named list, `chat_template.jinja`) and rendering with
//!   minijinja configured like HF's immutable Jinja2 sandbox. Text and ids equal
//!   transformers 5.24 exactly on 3762 renders over 33 real templates
//!   (`tests/it/hf_exact.rs`). Where HF raises (`raise_exception`, `list.append`, undefined
//!   values), rendering returns a typed [`Error`]. A template byte-identical to one the crate
//!   ships in compiled form (so far `qwen3_fixed.jinja` and its Qwen3-Next variant) renders through that Rust form when
//!   the input has the shapes it handles, with the template's exact text
//!   ([`ChatTemplate::is_compiled`], [`ChatTemplate::interpreted`]).
//! * [`FastEncoder`] ([`fastenc`]): an id-exact faster path for
//!   `encode(text, add_special_tokens=False)` on byte-level BPE tokenizers with the
//!   GPT-4-style split regex (Qwen2/Qwen3, Llama 3, GLM-4.x), used by [`HfChat`] and
//!   [`TitoTokenizer`] when the tokenizer qualifies; anything else goes through HF
//!   tokenizers unchanged.
//! * [`FastDecoder`] ([`fastdec`]): a text-exact table-driven path for
//!   `decode(ids, skip_special_tokens=False)` on tokenizers whose decoder is `ByteLevel`,
//!   used by [`TitoTokenizer::decode`] (the session server decodes every model output).
//! * [`TitoFamily`] / [`TitoTokenizer`] ([`tito`]): Miles' families (`default`, `qwen3`,
//!   `qwen35`, `qwennext`, `glm47`, `nemotron3`, `kimi25`, `kimi26`, `minimax_m25`,
//!   `minimax_m27`, `deepseekv32`, `deepseekv4`) with their embedded fixed templates or
//!   DeepSeek encoders, forced kwargs (conflicts are errors), allowed append roles and boundary
//!   rules; `tokenize_additional_messages` against the synthetic context with the
//!   rendered-suffix check (DeepSeek V4: against the real histories), `merge_tokens`,
//!   `clone_with_chat_template_kwargs` (with DeepSeek's thinking-alias group), and a session
//!   replay.
//! * [`deepseek`]: the DeepSeek V3.2 and V4 prompt encoders (no Jinja template exists for
//!   them), byte-exact with the Python encoders Miles renders with, and Miles' bridge to them
//!   ([`deepseek::apply_chat_template`]); [`HfChat`] routes a directory whose `config.json`
//!   `model_type` is `deepseek_v32` / `deepseek_v4` there.
//! * [`assert_append_only`] / [`MessageMatcher`] ([`matcher`]): append-only message
//!   validation with Miles' `strict` normalisation (§1.6).
//! * [`TokenTrajectory`] ([`trajectory`]): the extend-only token trajectory with the runtime
//!   prefix assertion (§1.9), one-step rollback, loss masks (1 exactly on generated ids),
//!   per-turn samples with trailing-stop trimming (§3.2) and their merge (§3.3).
//! * [`TokenSeqComparator`] / [`MismatchMetric`] ([`comparator`]): the token-sequence
//!   comparator and session mismatch metric (§1.10, §2.7).
//! * [`verify`]: the chat-template verifier (§1.8), also exposed by the `miles-tito` binary
//!   (`render`, `incremental`, `verify`).
//!
//! The crate depends on tokenizers, minijinja and serde only: no burn, no async runtime.

pub mod comparator;
pub mod deepseek;
pub mod error;
pub mod fastdec;
pub mod fastenc;
pub mod matcher;
pub mod model;
mod native;
pub mod pyfmt;
pub mod template;
pub mod tito;
pub mod trajectory;
pub mod verify;

pub use comparator::{Mismatch, MismatchMetric, MismatchType, TokenSeqComparator};
pub use deepseek::DeepSeekVersion;
pub use error::{Error, Result};
pub use fastdec::FastDecoder;
pub use fastenc::FastEncoder;
pub use matcher::{MessageMatcher, assert_append_only};
pub use model::{HfChat, Rendered};
pub use template::{ChatTemplate, RenderArgs, RenderLimits};
pub use tito::{BoundaryRule, TitoFamily, TitoTokenizer};
pub use trajectory::{
    TokenTrajectory, TurnRecord, TurnSample, TurnSpan, assert_pretokenized_prefix,
};
