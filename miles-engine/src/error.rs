//! The crate's error type.

/// Errors of miles-engine (starting and loading an engine; requests fail with
/// miles-core's engine errors, as every [`miles_core::InferenceEngine`] does).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An invalid engine configuration, or a model directory / tokenizer that cannot be loaded.
    #[error("invalid engine config: {0}")]
    Config(String),
    /// A thread or pool could not be started.
    #[error("engine task failed: {0}")]
    Task(String),
    /// An error of the HTTP front (miles-session: the server's model info, its chat tokenizer,
    /// binding and serving).
    #[error(transparent)]
    Server(#[from] miles_session::Error),
    /// An error from miles-core's types.
    #[error(transparent)]
    Core(#[from] miles_core::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
