//! The one error type of miles-cli: any crate's error, a usage mistake, or a file at fault.

use std::path::PathBuf;

/// Errors of the `miles` command and its building blocks (and of the examples' toolkit).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The fixture is in none of the searched folders.
    #[error(
        "fixture {relative:?} not found; searched {searched:?} (copy it into the repo's fixtures/ or check out ../shared beside the repo)"
    )]
    Missing {
        /// The path asked for, relative to a fixtures folder.
        relative: PathBuf,
        /// The folders searched, in order.
        searched: Vec<PathBuf>,
    },
    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file or line could not be read or written.
    #[error("JSON error in {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A line of a JSONL file is malformed.
    #[error("{path}:{line}: {reason}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Building, saving or using a tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A task or toolkit parameter is out of range.
    #[error("invalid {what}: {reason}")]
    Invalid {
        /// The parameter.
        what: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A metric needed for a plot is absent from every line.
    #[error("no values for any of {names:?} in the metrics")]
    NoMetric {
        /// The names looked for.
        names: Vec<String>,
    },
    /// Drawing a plot failed.
    #[error("plot: {0}")]
    Plot(String),
    /// A command-line argument is wrong (the message is for the user).
    #[error("{0}")]
    Args(String),
    /// miles-tito failed (template, tokenization, verification).
    #[error(transparent)]
    Tito(#[from] miles_tito::Error),
    /// miles-bridge failed (config, weights).
    #[error(transparent)]
    Bridge(#[from] miles_bridge::BridgeError),
    /// miles-train failed.
    #[error(transparent)]
    Train(#[from] miles_train::Error),
    /// The embedded engine could not start or load.
    #[error(transparent)]
    Engine(#[from] miles_engine::Error),
    /// miles-rollout failed (manager, data, loop).
    #[error(transparent)]
    Rollout(#[from] miles_rollout::Error),
    /// miles-session failed (session server, SGLang client / server, router).
    #[error(transparent)]
    Session(#[from] miles_session::Error),
    /// A miles-core seam failed (trainer, sample).
    #[error(transparent)]
    Core(#[from] miles_core::Error),
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
