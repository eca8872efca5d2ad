//! The crate's error type.

use std::path::PathBuf;

/// Errors of miles-rollout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dataset line that cannot be used.
    #[error("dataset line {line}: {reason}")]
    Dataset {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// An invalid configuration value.
    #[error("invalid rollout config: {0}")]
    Config(String),
    /// A file could not be read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// An error from a seam (engine, trainer, reward, metrics) or from miles-core's types.
    #[error(transparent)]
    Core(#[from] miles_core::Error),
    /// A background task died.
    #[error("rollout task failed: {0}")]
    Task(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
