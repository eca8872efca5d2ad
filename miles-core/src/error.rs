//! The crate's error type.

use std::path::PathBuf;

/// Every way an operation on miles-core's vocabulary, or a call through one of its seams,
/// can fail.
///
/// Variants carry structured fields so callers can react without parsing messages. Engines,
/// trainers and reward functions implemented in other crates report their failures through
/// [`Error::Engine`], [`Error::Trainer`] and [`Error::Reward`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A [`crate::Sample`] breaks one of its invariants (Miles' `Sample` `validate()`).
    #[error("invalid sample: {field} has {got} entries, expected {expected}")]
    SampleLength {
        /// The offending field (`loss_mask`, `rollout_log_probs`, `tokens`, ...).
        field: &'static str,
        /// The length the invariant requires.
        expected: usize,
        /// The length found.
        got: usize,
    },
    /// A sample operation got an argument it cannot honour (e.g. stripping more tokens than
    /// the response has).
    #[error("invalid sample operation: {0}")]
    SampleOperation(String),
    /// A routed-experts table has an inconsistent shape or an out-of-range value.
    #[error("invalid routed experts: {0}")]
    RoutedExperts(String),
    /// Malformed base64 text.
    #[error("invalid base64 at byte {position}: {reason}")]
    Base64 {
        /// Byte offset into the input where decoding failed.
        position: usize,
        /// What was wrong.
        reason: &'static str,
    },
    /// A tensor buffer or safetensors blob that cannot be decoded or does not match its
    /// declared dtype and shape.
    #[error("invalid tensor {name:?}: {reason}")]
    Tensor {
        /// The tensor's name (HF name for weights), or `""` for the blob as a whole.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// A safetensors file or Hugging Face checkpoint directory that cannot be read: a header
    /// that does not fit the file, a file whose size disagrees with its header, a tensor
    /// that does not match its declared dtype and shape, an index that names a file outside
    /// the directory.
    #[error("{path}: invalid safetensors file: {reason}")]
    Safetensors {
        /// The file (the index, for an index's fault).
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// A value that does not parse as the expected type (weight version, dtype, ...).
    #[error("cannot parse {what} from {input:?}")]
    Parse {
        /// The kind of value expected.
        what: &'static str,
        /// The offending input.
        input: String,
    },
    /// An I/O failure, with the path involved.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// JSON (de)serialisation failed.
    #[error("JSON error: {0}")]
    Json(#[from] serde_json::Error),
    /// An inference engine failed or refused a request.
    #[error("engine error ({kind}): {message}")]
    Engine {
        /// What kind of failure.
        kind: EngineErrorKind,
        /// Human-readable detail.
        message: String,
    },
    /// A policy trainer failed.
    #[error("trainer error: {0}")]
    Trainer(String),
    /// A reward function failed for a sample.
    #[error("reward error: {0}")]
    Reward(String),
    /// A metrics sink could not record.
    #[error("metrics sink error: {0}")]
    Metrics(String),
}

/// The kinds of engine failure a caller may want to treat differently (retry, resubmit, give up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EngineErrorKind {
    /// The engine cannot be reached (connection refused, timeout, shut down).
    Unavailable,
    /// The request itself is invalid (empty input, context too long, bad sampling params).
    InvalidRequest,
    /// The request was aborted (explicitly, or by a pause in abort mode).
    Aborted,
    /// A weight update failed (bad tensors, version going backwards, ...).
    WeightUpdate,
    /// The engine answered with something that breaks the protocol.
    Protocol,
    /// Anything else inside the engine.
    Internal,
}

impl std::fmt::Display for EngineErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unavailable => "unavailable",
            Self::InvalidRequest => "invalid_request",
            Self::Aborted => "aborted",
            Self::WeightUpdate => "weight_update",
            Self::Protocol => "protocol",
            Self::Internal => "internal",
        })
    }
}

impl Error {
    /// Shorthand for an [`Error::Engine`].
    pub fn engine(kind: EngineErrorKind, message: impl Into<String>) -> Self {
        Self::Engine {
            kind,
            message: message.into(),
        }
    }

    /// Wraps an [`std::io::Error`] with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
