//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while configuring, loading, running or exporting a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config, index, input) is malformed.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A config field is missing, inconsistent or unsupported.
    #[error("config field `{field}`: {message}")]
    Config {
        /// The offending field (HF name).
        field: String,
        /// Why it was rejected.
        message: String,
    },
    /// The checkpoint's `model_type` has no architecture here.
    #[error("unsupported model_type `{model_type}` (supported: {supported})")]
    UnsupportedArchitecture {
        /// HF `model_type`.
        model_type: String,
        /// The supported `model_type`s, comma-separated.
        supported: String,
    },
    /// The checkpoint's `config.json` has no `model_type` (or it is not a string), so its
    /// architecture is unknown.
    #[error("config.json has no `model_type` (supported: {supported})")]
    MissingModelType {
        /// The supported `model_type`s, comma-separated.
        supported: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("missing tensor `{name}`")]
    MissingTensor {
        /// HF name of the tensor.
        name: String,
    },
    /// The checkpoint holds a tensor the model does not use.
    #[error("unexpected tensor `{name}`")]
    UnexpectedTensor {
        /// HF name of the tensor.
        name: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Name of the tensor.
        name: String,
        /// Shape the model expects.
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
    },
    /// A tensor is stored in a dtype this crate does not read or write.
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// Name of the tensor.
        name: String,
        /// The dtype, as safetensors spells it.
        dtype: String,
    },
    /// Model input is inconsistent (shapes, token ids out of range, cache misuse).
    #[error("invalid input: {message}")]
    Input {
        /// What is wrong.
        message: String,
    },
    /// A sequence cannot be scored (response length out of range, a token id outside the
    /// vocabulary, log-probs that cannot be read back).
    #[error("cannot score the sequence: {reason}")]
    Scoring {
        /// What is wrong.
        reason: String,
    },
    /// Host weights could not be read, written or converted (miles-core's safetensors codec:
    /// a malformed or truncated file, an index naming a file outside the checkpoint, a cast
    /// to a non-float dtype).
    #[error(transparent)]
    Weights(#[from] miles_core::Error),
    /// The fused log-prob op rejected its input.
    #[error(transparent)]
    Ops(#[from] miles_ops::OpsError),
    /// The router hook refused the routing request.
    #[error(transparent)]
    Router(#[from] miles_r3::R3Error),
}

impl BridgeError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn config(field: &str, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn input(message: impl Into<String>) -> Self {
        Self::Input {
            message: message.into(),
        }
    }
}
