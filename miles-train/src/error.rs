//! The crate's error type.

use std::path::PathBuf;

/// Errors of miles-train.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value is out of its valid range.
    #[error("invalid config: {field} = {value}: {reason}")]
    Config {
        /// The flag (Miles / Megatron name, with underscores).
        field: &'static str,
        /// The offending value.
        value: String,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// A training sample cannot be used.
    #[error("sample {index}: {reason}")]
    Sample {
        /// Position of the sample in the batch handed to `train`.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A checkpoint is missing, corrupt or does not match the model.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The checkpoint directory or file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A file-system operation failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A loss, advantage or log-prob computation rejected its input.
    #[error(transparent)]
    Ops(#[from] miles_ops::OpsError),
    /// The model rejected its input or weights.
    #[error(transparent)]
    Bridge(#[from] miles_bridge::BridgeError),
    /// The routing-replay layer rejected its input.
    #[error(transparent)]
    R3(#[from] miles_r3::R3Error),
    /// A miles-core operation (metrics sink, sample) failed.
    #[error(transparent)]
    Core(#[from] miles_core::Error),
    /// A non-finite loss or gradient norm: the step was not applied.
    #[error("non-finite {what} at step {step}: the update was skipped")]
    NonFinite {
        /// `loss` or `grad_norm`.
        what: &'static str,
        /// The optimizer step.
        step: u64,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Self::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

impl From<Error> for miles_core::Error {
    fn from(e: Error) -> Self {
        miles_core::Error::Trainer(e.to_string())
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
