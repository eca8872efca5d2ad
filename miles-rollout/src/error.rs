//! The crate's error type.

use std::path::PathBuf;

/// Errors of miles-rollout.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A dataset row that cannot be used (see [`RowError`]).
    #[error(transparent)]
    DatasetRow(Box<RowError>),
    /// A dataset file whose format cannot be read: an unknown extension, a corrupt or truncated
    /// Parquet file, an undecodable page.
    #[error("dataset {path}: {reason}")]
    DatasetFile {
        /// The file.
        path: PathBuf,
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
    /// On-policy distillation: a teacher answer that cannot be used, a missing input.
    #[error("on-policy distillation: {0}")]
    Opd(String),
    /// Failures dominate the run ([`crate::FailurePolicy`]): the message names the last
    /// failure (the agent's command line) and its agent's last stderr lines.
    #[error("{0}")]
    TooManyFailures(String),
}

/// A dataset row that cannot be used: which file, which row, which key and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("dataset {file} row {row}{}: {kind}", key.as_ref().map(|k| format!(", key {k:?}")).unwrap_or_default())]
pub struct RowError {
    /// The dataset file (`<string>` for text parsed from memory).
    pub file: PathBuf,
    /// 1-based row: the line number in a JSONL file (blank lines counted), the row index in a
    /// Parquet file.
    pub row: usize,
    /// The key the problem is with; `None` for problems with the whole row.
    pub key: Option<String>,
    /// What is wrong.
    pub kind: RowErrorKind,
}

/// What is wrong with a dataset row.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RowErrorKind {
    /// The row is longer than the configured bound (`max_row_bytes`); for JSONL it was not read
    /// into memory.
    #[error("row of at least {bytes} bytes exceeds the limit of {limit} bytes")]
    Oversized {
        /// Bytes seen (a lower bound for a JSONL line cut off at the limit).
        bytes: u64,
        /// The limit.
        limit: usize,
    },
    /// The row (or a byte-array value) is not valid UTF-8.
    #[error("not valid UTF-8")]
    NotUtf8,
    /// The row, or a value that must hold JSON text, is not valid JSON.
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    /// The row is JSON but not an object.
    #[error("not a JSON object")]
    NotAnObject,
    /// The key is absent (or null).
    #[error("missing")]
    MissingKey,
    /// The value has the wrong type.
    #[error("expected {expected}, found {found}")]
    WrongType {
        /// What was expected.
        expected: &'static str,
        /// What was found (a JSON type name).
        found: &'static str,
    },
    /// A message of a message-list prompt is malformed (an unknown role, a non-object entry…).
    #[error("message {index}: {reason}")]
    BadMessage {
        /// 0-based index in the list.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A Parquet value with no JSON counterpart (decimal, date, time, timestamp, a non-finite
    /// float, a map with non-string keys, nesting deeper than 128).
    #[error("unsupported value: {0}")]
    UnsupportedValue(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
