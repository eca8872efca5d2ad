//! The crate's error type.

use std::path::PathBuf;

/// Every way loading, rendering, incremental tokenization or verification can fail.
///
/// Variants carry structured fields so callers (the session server maps them to HTTP codes)
/// can react without parsing messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file or value is malformed or has the wrong shape.
    #[error("invalid JSON in {what}: {reason}")]
    Json {
        /// What was being read (`tokenizer_config.json`, `messages`, ...).
        what: String,
        /// What was wrong.
        reason: String,
    },
    /// The model directory has no chat template (neither in `tokenizer_config.json` nor in
    /// `chat_template.jinja`), or a named template does not exist.
    #[error("no chat template found: {0}")]
    NoChatTemplate(String),
    /// The Jinja source does not compile.
    #[error("chat template syntax error: {message}")]
    TemplateSyntax {
        /// minijinja's description, with line information.
        message: String,
    },
    /// The template called `raise_exception(message)` (HF raises `TemplateError`).
    #[error("chat template raised: {message}")]
    TemplateRaised {
        /// The message passed to `raise_exception`.
        message: String,
    },
    /// Rendering failed at run time (undefined value used, unsupported method such as
    /// `list.append` in HF's immutable sandbox, type error, ...). HF raises for the same input.
    #[error("chat template render error: {message}")]
    Render {
        /// minijinja's description.
        message: String,
    },
    /// Input HF would reject before rendering (a message that is not an object, an empty
    /// conversation, a reserved kwarg name).
    #[error("invalid render input: {0}")]
    InvalidInput(String),
    /// The tokenizer failed to load, encode or decode.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// No tokenizer is available for an operation that needs token ids.
    #[error("no tokenizer loaded (model directory has no tokenizer.json)")]
    NoTokenizer,
    /// A TITO family name that Miles does not define (or that this crate does not support).
    #[error("unknown TITO tokenizer family {name:?} (known: {known})")]
    UnknownFamily {
        /// The name given.
        name: String,
        /// The supported names, comma separated.
        known: String,
    },
    /// A chat-template kwarg conflicts with the value the family forces.
    #[error("chat template kwarg {key}={value} conflicts with the value registered for {family}")]
    KwargConflict {
        /// The kwarg.
        key: String,
        /// The conflicting value supplied by the caller (JSON).
        value: String,
        /// The family that forces another value.
        family: String,
    },
    /// The family requires a property of the tokenizer that does not hold (e.g. `"\n"` must
    /// be a single token, a boundary token must exist).
    #[error("tokenizer unsuitable for TITO family {family}: {reason}")]
    FamilyTokenizer {
        /// The family.
        family: String,
        /// What does not hold.
        reason: String,
    },
    /// The new message list is not an append-only extension of the stored one.
    #[error("message validation failed: {reason}")]
    MessageValidation {
        /// Index of the first offending message, when there is one.
        index: Option<usize>,
        /// Miles-style description (`message mismatch at index i …`, `appended message at
        /// index k has role=…`).
        reason: String,
    },
    /// The rendered appendix is not a suffix of the rendered base context (the suffix check of
    /// `tokenize_additional_messages`).
    #[error("rendered suffix diff failed for {roles:?}")]
    SuffixDiff {
        /// Roles of the appended messages.
        roles: Vec<String>,
    },
    /// A DeepSeek encoder (or Miles' bridge to it) rejected the input; `exception` names the
    /// Python exception raised for the same input (`DS32EncodingError`, `ValueError`,
    /// `JSONDecodeError`, `AssertionError`, `TypeError`, `KeyError`, `AttributeError`,
    /// `NotImplementedError`, `ValidationError`).
    #[error("{encoder} encoder rejected the input ({exception}): {message}")]
    DeepSeekEncoding {
        /// `deepseek_v32` or `deepseek_v4`.
        encoder: &'static str,
        /// The Python exception class raised for this input.
        exception: &'static str,
        /// What was wrong.
        message: String,
    },
    /// A family that diffs real-history renders (DeepSeek V4) found the render of the stored
    /// messages is not a prefix of the render of the new ones.
    #[error(
        "{family} render is not append-only for the appended messages (prefix render changed; check drop_thinking and tool-result ordering)"
    )]
    RenderNotAppendOnly {
        /// The renderer (`deepseek_v4`).
        family: String,
    },
    /// A new token sequence does not extend the stored one (the runtime prefix check).
    #[error(
        "pretokenized prefix mismatch at token {index}: stored {stored_len} tokens, new sequence {new_len} tokens (checked {checked})"
    )]
    PrefixMismatch {
        /// First differing position.
        index: usize,
        /// Length of the stored sequence.
        stored_len: usize,
        /// Length of the new sequence.
        new_len: usize,
        /// Number of positions that had to agree.
        checked: usize,
    },
    /// Rendering hit a [`crate::RenderLimits`] bound: the template ran out of
    /// fuel (instructions), recursed too deep or produced too much output. Templates are
    /// untrusted input: such a template is rejected, never allowed to hang or exhaust memory.
    #[error("chat template exceeded its {limit} limit ({detail})")]
    RenderLimit {
        /// `fuel`, `recursion` or `output size`.
        limit: &'static str,
        /// The bound, in words.
        detail: String,
    },
    /// A trajectory operation that the current state does not allow (rollback with nothing
    /// to roll back, a trim beyond the allowed count, ...).
    #[error("trajectory error: {0}")]
    Trajectory(String),
    /// A reasoning or tool-call parser name that SGLang does not define (or that this crate
    /// does not support).
    #[error("unknown {kind} parser {name:?}")]
    UnknownParser {
        /// `reasoning` or `tool-call`.
        kind: &'static str,
        /// The name given.
        name: String,
    },
    /// The model's output does not parse in its family's format (a malformed tool call).
    /// [`crate::OutputParser::parse`] never returns it: it keeps such text as content.
    #[error("model output does not parse: {reason}")]
    ModelOutput {
        /// What was malformed.
        reason: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Shorthand for [`Error::ModelOutput`].
    pub fn model_output(reason: impl Into<String>) -> Self {
        Self::ModelOutput {
            reason: reason.into(),
        }
    }

    pub(crate) fn json(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Json {
            what: what.into(),
            reason: reason.to_string(),
        }
    }
}
