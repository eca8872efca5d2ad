//! The crate's error type and its mapping onto HTTP status codes.

/// Every way a session operation, a sample assembly or an engine call made by this crate can
/// fail.
///
/// Each variant has a stable [`Error::label`] (used in `/metrics` and as the OpenAI error
/// `code`) and an HTTP status ([`Error::status`]) following Miles' session-server routes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No session with this id exists (never created, deleted, or being deleted).
    #[error("session not found: session_id={session_id}")]
    SessionNotFound {
        /// The id asked for.
        session_id: String,
    },
    /// The request body is not valid JSON or has wrong field types (the message is Miles'
    /// text where Miles has one: `invalid JSON body: …`).
    #[error("{reason}")]
    InvalidBody {
        /// What was wrong.
        reason: String,
    },
    /// The request body exceeds the configured limit.
    #[error("request body larger than {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The messages are not an append-only extension of the session's history, use a role
    /// the family cannot append, or a rollback would discard more than one assistant turn.
    #[error("{reason}")]
    MessageValidation {
        /// What was wrong.
        reason: String,
    },
    /// `chat_template_kwargs` conflicts with the family's forced kwargs or is malformed.
    #[error("chat template kwarg {key}={value} conflicts with the value registered for {family}")]
    KwargConflict {
        /// The conflicting key.
        key: String,
        /// The value the request asked for.
        value: String,
        /// The TITO family.
        family: String,
    },
    /// Rendering or tokenizing failed, or the new token sequence does not extend the stored
    /// one (Miles' TITO trailing-token trim).
    #[error("tokenization error: {reason}")]
    Tokenization {
        /// What was wrong.
        reason: String,
    },
    /// The engine's answer breaks the protocol (missing log-probs, length mismatch, …).
    #[error("upstream response invalid: {reason}")]
    UpstreamResponse {
        /// What was wrong.
        reason: String,
    },
    /// The engine failed or could not be reached.
    #[error("engine error: {0}")]
    Engine(#[source] miles_core::Error),
    /// Sample assembly found records that break an invariant (trim too large, cursor check).
    #[error("sample assembly failed: {reason}")]
    Assembly {
        /// What was wrong.
        reason: String,
    },
    /// The samples wire codec cannot encode or decode a value.
    #[error("samples codec error on {field}: {reason}")]
    Codec {
        /// The field or tensor concerned.
        field: String,
        /// What was wrong.
        reason: String,
    },
    /// A sample operation from miles-core failed.
    #[error(transparent)]
    Core(miles_core::Error),
    /// An HTTP transport failure talking to an engine.
    #[error("transport error to {url}: {reason}")]
    Transport {
        /// The URL called.
        url: String,
        /// What failed.
        reason: String,
    },
    /// An engine call took longer than its timeout.
    #[error("request to {url} timed out after {seconds} s")]
    Timeout {
        /// The URL called.
        url: String,
        /// The timeout in seconds.
        seconds: f64,
    },
    /// Invalid configuration (command line, server config).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An I/O error (binding a socket, …).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The request lacks `Authorization: Bearer <key>` or the key is wrong.
    #[error("missing or invalid API key (send Authorization: Bearer <key>)")]
    Unauthorized,
    /// A request body that is not `application/json`.
    #[error("unsupported content type {content_type:?}: the body must be application/json")]
    UnsupportedMediaType {
        /// The `Content-Type` sent (empty when none).
        content_type: String,
    },
    /// The request body did not arrive within the body-read timeout.
    #[error("the request body did not arrive within {seconds} s")]
    RequestTimeout {
        /// The timeout in seconds.
        seconds: f64,
    },
    /// The server is at its concurrent-request limit.
    #[error("server overloaded: {limit} requests already in progress, retry later")]
    Overloaded {
        /// The limit.
        limit: usize,
    },
    /// `POST /sessions` while the configured number of sessions is open.
    #[error("too many open sessions (limit {limit}); delete finished sessions first")]
    TooManySessions {
        /// The limit.
        limit: usize,
    },
    /// A tree session (v2) request would extend a generation that ended at the length limit
    /// (Miles' `TruncatedGenerationError`, 409).
    #[error("{reason}")]
    TruncatedGeneration {
        /// Miles' text.
        reason: String,
    },
    /// A tree session's sample picker or post-processor failed or broke its contract (Miles'
    /// hook lane: 422 naming both hooks).
    #[error(
        "session sample hook failed (picker={picker}, postprocessor={postprocessor}): {reason}"
    )]
    SampleHook {
        /// The picker's name.
        picker: String,
        /// The post-processor's name.
        postprocessor: String,
        /// What went wrong.
        reason: String,
    },
    /// A chat turn arrived while another turn of the same session was in progress.
    #[error("session {session_id} already has a turn in progress; send turns one at a time")]
    SessionBusy {
        /// The session.
        session_id: String,
    },
    /// The session reached its per-session cap on records or tokens.
    #[error("session limit reached: {reason}")]
    SessionLimit {
        /// Which cap, and its value.
        reason: String,
    },
    /// The chat template cannot render the request's messages (it raised, or does not handle
    /// a content shape or role they use).
    #[error("the chat template rejected the messages: {reason}")]
    TemplateRejected {
        /// The template's error.
        reason: String,
    },
    /// A request field is outside the server's limits (`n`, stop strings, token budget, …).
    #[error("request outside the server's limits: {reason}")]
    LimitExceeded {
        /// Which limit, and the value sent.
        reason: String,
    },
    /// A subprocess agent ([`crate::command_agent`]) failed: it could not start, exited
    /// non-zero, died of a signal, ran past its timeout, or printed output that breaks the
    /// protocol.
    #[error("agent command {failure}{}", stderr_suffix(stderr_tail))]
    AgentCommand {
        /// What went wrong (`exited with code 3`, `timed out after 5 s`, …).
        failure: String,
        /// The last bytes the agent wrote to stderr (lossy UTF-8; empty when none).
        stderr_tail: String,
    },
}

fn stderr_suffix(tail: &str) -> String {
    if tail.trim().is_empty() {
        String::new()
    } else {
        format!("; stderr tail: {}", tail.trim_end())
    }
}

impl Error {
    /// The stable, bounded label of the error kind (metrics label and OpenAI error `code`).
    pub fn label(&self) -> &'static str {
        match self {
            Self::SessionNotFound { .. } => "session_not_found",
            Self::InvalidBody { .. } => "invalid_body",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::MessageValidation { .. } => "message_validation",
            Self::KwargConflict { .. } => "kwarg_conflict",
            Self::Tokenization { .. } => "tokenization",
            Self::UpstreamResponse { .. } => "upstream_response",
            Self::Engine(e) => match e {
                miles_core::Error::Engine { kind, .. } => match kind {
                    miles_core::EngineErrorKind::InvalidRequest => "engine_invalid_request",
                    miles_core::EngineErrorKind::Unavailable => "engine_unavailable",
                    miles_core::EngineErrorKind::Aborted => "engine_aborted",
                    miles_core::EngineErrorKind::Protocol => "upstream_response",
                    _ => "engine_error",
                },
                _ => "engine_error",
            },
            Self::Assembly { .. } => "assembly",
            Self::Codec { .. } => "codec",
            Self::Core(_) => "sample",
            Self::Transport { .. } => "transport",
            Self::Timeout { .. } => "timeout",
            Self::Config(_) => "config",
            Self::Io(_) => "io",
            Self::Unauthorized => "unauthorized",
            Self::UnsupportedMediaType { .. } => "unsupported_media_type",
            Self::RequestTimeout { .. } => "request_timeout",
            Self::Overloaded { .. } => "overloaded",
            Self::TooManySessions { .. } => "too_many_sessions",
            Self::SessionBusy { .. } => "session_busy",
            Self::TruncatedGeneration { .. } => "truncated_generation",
            Self::SampleHook { .. } => "sample_hook",
            Self::SessionLimit { .. } => "session_limit",
            Self::LimitExceeded { .. } => "limit_exceeded",
            Self::TemplateRejected { .. } => "template_rejected",
            Self::AgentCommand { .. } => "agent_command",
        }
    }

    /// The HTTP status the session server answers with (Miles' session-server routes: not found 404,
    /// validation 400, tokenization 500, upstream 502; assembly 422; engine timeout 504; and
    /// the guards of [`crate::guard`]: 401, 408, 413, 415, 429, 409, 503).
    pub fn status(&self) -> u16 {
        match self {
            Self::SessionNotFound { .. } => 404,
            Self::InvalidBody { .. }
            | Self::MessageValidation { .. }
            | Self::KwargConflict { .. } => 400,
            Self::BodyTooLarge { .. } => 413,
            Self::Unauthorized => 401,
            Self::UnsupportedMediaType { .. } => 415,
            Self::RequestTimeout { .. } => 408,
            Self::Overloaded { .. } => 503,
            Self::TooManySessions { .. } => 429,
            Self::SessionBusy { .. } | Self::TruncatedGeneration { .. } => 409,
            Self::SessionLimit { .. }
            | Self::LimitExceeded { .. }
            | Self::TemplateRejected { .. } => 400,
            Self::Tokenization { .. } | Self::Core(_) | Self::Config(_) | Self::Io(_) => 500,
            Self::UpstreamResponse { .. } | Self::Transport { .. } | Self::AgentCommand { .. } => {
                502
            }
            Self::Timeout { .. } => 504,
            Self::Assembly { .. } | Self::Codec { .. } | Self::SampleHook { .. } => 422,
            Self::Engine(e) => match e {
                miles_core::Error::Engine { kind, .. } => match kind {
                    miles_core::EngineErrorKind::InvalidRequest => 400,
                    miles_core::EngineErrorKind::Unavailable => 503,
                    _ => 502,
                },
                _ => 502,
            },
        }
    }

    /// The OpenAI error `type` for the body (`authentication_error` for 401,
    /// `invalid_request_error` for other 4xx, `server_error` otherwise).
    pub fn openai_type(&self) -> &'static str {
        if matches!(self, Self::Unauthorized) {
            "authentication_error"
        } else if self.status() < 500 {
            "invalid_request_error"
        } else {
            "server_error"
        }
    }

    /// Shorthand for [`Error::Tokenization`].
    pub fn tokenization(reason: impl Into<String>) -> Self {
        Self::Tokenization {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::MessageValidation`].
    pub fn validation(reason: impl Into<String>) -> Self {
        Self::MessageValidation {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::UpstreamResponse`].
    pub fn upstream(reason: impl Into<String>) -> Self {
        Self::UpstreamResponse {
            reason: reason.into(),
        }
    }

    /// Shorthand for [`Error::Assembly`].
    pub fn assembly(reason: impl Into<String>) -> Self {
        Self::Assembly {
            reason: reason.into(),
        }
    }
}

/// miles-tito's errors (rendering, incremental tokenization, the [`miles_tito::ChatTokenizer`]
/// seam) onto this crate's, and so onto HTTP statuses: kwarg conflicts and message validation
/// keep their kinds (400), model output that does not parse is the upstream's (502), everything
/// else (render, suffix diff, tokenizer) is a tokenization error (500; the server answers 400
/// for the render errors the request caused).
impl From<miles_tito::Error> for Error {
    fn from(error: miles_tito::Error) -> Self {
        match error {
            miles_tito::Error::KwargConflict { key, value, family } => {
                Self::KwargConflict { key, value, family }
            }
            miles_tito::Error::MessageValidation { reason, .. } => {
                Self::MessageValidation { reason }
            }
            miles_tito::Error::ModelOutput { reason } => Self::UpstreamResponse { reason },
            other => Self::Tokenization {
                reason: other.to_string(),
            },
        }
    }
}

impl From<miles_core::Error> for Error {
    fn from(error: miles_core::Error) -> Self {
        match error {
            miles_core::Error::Engine { .. } => Self::Engine(error),
            other => Self::Core(other),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The OpenAI-shaped error body `{"error": {"message", "type", "code"}}`.
pub fn error_body(error: &Error) -> serde_json::Value {
    serde_json::json!({"error": {"message": error.to_string(), "type": error.openai_type(), "code": error.label()}})
}
