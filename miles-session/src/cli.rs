//! What `miles session` (miles-cli) runs: the session server's options ([`CliArgs`]), the
//! server they build ([`build`]) and serving it ([`bind`], [`serve`]).
//!
//! Exposure: the server binds 127.0.0.1 unless `--host` says otherwise. With `--api-key KEY`
//! (or the `MILES_API_KEY` environment variable) every route but `/health` needs
//! `Authorization: Bearer KEY`. Limits that take `0` turn off (`--max-sessions 0`, …).
//!
//! `--engine-url toy` serves the in-process [`crate::testkit::ToyEngine`] and `--tito
//! byte_chatml` the [`crate::testkit::ByteChatml`] tokenizer (no model needed), for trying the
//! server and for load tests. `--engine-url instant` serves the in-process
//! [`crate::testkit::InstantEngine`] (pre-tokenized tool-call / answer replies in the family's
//! own tokens, no engine cost) for measuring the server's added latency with a real tokenizer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use miles_core::InferenceEngine;
use miles_tito::{ChatTokenizer, MessageMatcher};

use crate::error::{Error, Result};
use crate::guard::{ApiKey, GuardConfig};
use crate::openai::RequestLimits;
use crate::server::{SessionServer, SessionServerConfig, SessionVersion};
use crate::sglang::{SglangConfig, SglangEngine};
use crate::testkit::{ByteChatml, InstantEngine, ToyEngine};

/// Builds the chat tokenizer of a family from a model directory (default:
/// [`crate::tito_adapter::load_tokenizer`]).
pub type TokenizerLoader = dyn Fn(&std::path::Path, &str) -> Result<Arc<dyn ChatTokenizer>>;

/// Parsed command line.
#[derive(Debug, Clone, PartialEq)]
pub struct CliArgs {
    /// SGLang-compatible engine base URL, or `toy`.
    pub engine_url: String,
    /// Model directory (tokenizer + chat template).
    pub model: Option<PathBuf>,
    /// TITO family (`qwen3`, `glm47`, …, or `byte_chatml`).
    pub tito: String,
    /// Bind address.
    pub host: String,
    /// Port (0: any free port).
    pub port: u16,
    /// Server settings.
    pub max_body_bytes: usize,
    /// Ask the engine for routed experts.
    pub routed_experts: bool,
    /// MoE layers (needed with `--routed-experts` over SGLang).
    pub num_layers: Option<usize>,
    /// Context limit.
    pub max_context_len: Option<usize>,
    /// Default `max_tokens`.
    pub default_max_tokens: Option<usize>,
    /// Engine timeout in seconds.
    pub engine_timeout_s: f64,
    /// Instance id reported by `/health`.
    pub instance_id: Option<String>,
    /// Tokio worker threads (default: one per core).
    pub worker_threads: Option<usize>,
    /// Required bearer key (`--api-key`, else `MILES_API_KEY`).
    pub api_key: Option<ApiKey>,
    /// Largest `n`.
    pub max_n: usize,
    /// Most open sessions.
    pub max_sessions: Option<usize>,
    /// Session idle timeout.
    pub session_idle_timeout: Option<Duration>,
    /// Most records per session.
    pub max_records_per_session: Option<usize>,
    /// Most trajectory tokens per session.
    pub max_tokens_per_session: Option<usize>,
    /// Handler timeout.
    pub request_timeout: Option<Duration>,
    /// Time to receive a request head.
    pub header_read_timeout: Option<Duration>,
    /// Most connections at once.
    pub max_connections: Option<usize>,
    /// Most requests in progress at once.
    pub max_concurrent_requests: Option<usize>,
    /// How a request's history is compared with the stored one (`--session-message-matcher`).
    pub message_matcher: MessageMatcher,
    /// Put the conversation on samples as `metadata.messages` (Miles'
    /// `--save-debug-trajectory-data`).
    pub save_debug_trajectory_data: bool,
    /// Which session server (Miles' `--use-session-server [v1|v2]`): the linear one
    /// (default) or tree sessions.
    pub session_version: SessionVersion,
}

impl CliArgs {
    /// The server settings these arguments ask for.
    pub fn server_config(&self) -> SessionServerConfig {
        SessionServerConfig {
            max_body_bytes: self.max_body_bytes,
            model_name: self
                .model
                .as_ref()
                .and_then(|m| m.file_name())
                .map_or_else(|| "miles".to_owned(), |n| n.to_string_lossy().into_owned()),
            return_routed_experts: self.routed_experts,
            default_max_tokens: self.default_max_tokens,
            max_context_len: self.max_context_len,
            engine_timeout: Duration::from_secs_f64(self.engine_timeout_s),
            instance_id: self.instance_id.clone(),
            limits: RequestLimits::default().with_max_n(self.max_n),
            guard: self.guard_config(),
            max_sessions: self.max_sessions,
            session_idle_timeout: self.session_idle_timeout,
            max_records_per_session: self.max_records_per_session,
            max_tokens_per_session: self.max_tokens_per_session,
            message_matcher: self.message_matcher,
            save_debug_trajectory_data: self.save_debug_trajectory_data,
            session_version: self.session_version,
            ..SessionServerConfig::default()
        }
    }

    /// The HTTP guards these arguments ask for.
    pub fn guard_config(&self) -> GuardConfig {
        GuardConfig::default()
            .with_api_key(self.api_key.clone())
            .with_max_body_bytes(self.max_body_bytes)
            .with_request_timeout(self.request_timeout)
            .with_header_read_timeout(self.header_read_timeout)
            .with_max_connections(self.max_connections)
            .with_max_concurrent_requests(self.max_concurrent_requests)
    }

    /// The engine: the SGLang client for a URL, the toy engine for `toy`, or the
    /// [`InstantEngine`] scripted in `tokenizer`'s tokens for `instant` (benchmarks).
    pub fn engine(&self, tokenizer: &dyn ChatTokenizer) -> Result<Arc<dyn InferenceEngine>> {
        if self.engine_url == "toy" {
            return Ok(ToyEngine::new());
        }
        if self.engine_url == "instant" {
            return Ok(InstantEngine::for_chatml(tokenizer)?);
        }
        let mut config = SglangConfig::new(&self.engine_url);
        config.generate_timeout = Duration::from_secs_f64(self.engine_timeout_s);
        config.num_layers = self.num_layers;
        Ok(Arc::new(SglangEngine::new(config)))
    }

    /// The tokenizer: `byte_chatml` built in, any other family through `loader`, or through
    /// miles-tito's [`miles_tito::TitoChat`] ([`crate::tito_adapter::load_tokenizer`]) when
    /// `loader` is `None`.
    pub fn tokenizer(&self, loader: Option<&TokenizerLoader>) -> Result<Arc<dyn ChatTokenizer>> {
        if self.tito == "byte_chatml" {
            return Ok(Arc::new(ByteChatml::default()));
        }
        let model = self
            .model
            .as_deref()
            .ok_or_else(|| Error::Config("--model is required".into()))?;
        match loader {
            Some(load) => load(model, &self.tito),
            None => crate::tito_adapter::load_tokenizer(model, &self.tito),
        }
    }
}

/// Builds the server the arguments ask for (loads the tokenizer, sets up the engine client).
pub fn build(args: &CliArgs, loader: Option<&TokenizerLoader>) -> Result<SessionServer> {
    let tokenizer = args.tokenizer(loader)?;
    let engine = args.engine(tokenizer.as_ref())?;
    Ok(SessionServer::new(engine, tokenizer, args.server_config()))
}

/// Binds `--host:--port`, prints `miles-session listening on http://ADDR …` (the line a
/// supervisor or a test waits for) and warns when the address is beyond loopback without an
/// API key.
pub async fn bind(args: &CliArgs) -> Result<tokio::net::TcpListener> {
    let listener = crate::guard::bind(&args.host, args.port)
        .await
        .map_err(|e| Error::Config(format!("cannot bind {}:{}: {e}", args.host, args.port)))?;
    let addr = listener.local_addr()?;
    println!(
        "miles-session listening on http://{addr} (tito {}, engine {}, api key {})",
        args.tito,
        args.engine_url,
        if args.api_key.is_some() {
            "required"
        } else {
            "off"
        }
    );
    if args.api_key.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            %addr,
            "serving on a non-loopback address without --api-key: anyone who can reach it can use the engine"
        );
    }
    Ok(listener)
}

/// [`bind`], then serves `server` until the process ends, through [`crate::guard::serve`]
/// (connection limit, request-head timeout).
pub async fn serve(args: &CliArgs, server: SessionServer) -> Result<()> {
    let listener = bind(args).await?;
    crate::guard::serve(listener, server.router(), args.guard_config()).await
}

/// [`build`] then [`serve`].
pub async fn run(args: &CliArgs, loader: Option<&TokenizerLoader>) -> Result<()> {
    let server = build(args, loader)?;
    serve(args, server).await
}
