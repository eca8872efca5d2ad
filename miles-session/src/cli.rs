//! Command line of the `miles-session` binary, and the function that runs it.
//!
//! ```text
//! miles-session --engine-url URL --model DIR --tito FAMILY [--host H] [--port P]
//!               [--max-body-bytes N] [--routed-experts --num-layers N] [--max-context-len N]
//!               [--default-max-tokens N] [--engine-timeout-s S] [--instance-id ID]
//!               [--worker-threads N] [--api-key KEY] [--max-request-bytes N] [--max-n N]
//!               [--max-sessions N] [--session-idle-timeout S] [--max-records-per-session N]
//!               [--max-tokens-per-session N] [--request-timeout-s S]
//!               [--header-read-timeout-s S] [--max-connections N]
//!               [--max-concurrent-requests N]
//! ```
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
use miles_tito::ChatTokenizer;

use crate::error::{Error, Result};
use crate::guard::{ApiKey, GuardConfig};
use crate::openai::RequestLimits;
use crate::server::{SessionServer, SessionServerConfig};
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
}

/// The usage text.
pub const USAGE: &str = "usage: miles-session --engine-url URL --model DIR --tito FAMILY [--host H] [--port P] \
[--max-body-bytes N] [--routed-experts --num-layers N] [--max-context-len N] [--default-max-tokens N] \
[--engine-timeout-s S] [--instance-id ID] [--worker-threads N] [--api-key KEY] [--max-request-bytes N] \
[--max-n N] [--max-sessions N] [--session-idle-timeout S] [--max-records-per-session N] [--max-tokens-per-session N] \
[--request-timeout-s S] [--header-read-timeout-s S] [--max-connections N] [--max-concurrent-requests N]";

/// `N`, or `None` for `0`.
fn optional_count(flag: &str, value: &str) -> Result<Option<usize>> {
    let n: usize = number(flag, value)?;
    Ok((n > 0).then_some(n))
}

/// Seconds (finite, ≥ 0), or `None` for `0`.
fn optional_seconds(flag: &str, value: &str) -> Result<Option<Duration>> {
    let s: f64 = number(flag, value)?;
    if !(0.0..1e9).contains(&s) {
        return Err(Error::Config(format!(
            "{flag} expects seconds, got {value:?}"
        )));
    }
    Ok((s > 0.0).then(|| Duration::from_secs_f64(s)))
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| Error::Config(format!("{flag} expects a number, got {value:?}")))
}

impl CliArgs {
    /// Parses arguments (without the program name).
    pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Self> {
        let defaults = SessionServerConfig::default();
        let mut out = CliArgs {
            engine_url: String::new(),
            model: None,
            tito: String::new(),
            host: "127.0.0.1".into(),
            port: 30010,
            max_body_bytes: defaults.max_body_bytes,
            routed_experts: false,
            num_layers: None,
            max_context_len: None,
            default_max_tokens: None,
            engine_timeout_s: 600.0,
            instance_id: None,
            worker_threads: None,
            api_key: None,
            max_n: defaults.limits.max_n,
            max_sessions: defaults.max_sessions,
            session_idle_timeout: defaults.session_idle_timeout,
            max_records_per_session: defaults.max_records_per_session,
            max_tokens_per_session: defaults.max_tokens_per_session,
            request_timeout: defaults.guard.request_timeout,
            header_read_timeout: defaults.guard.header_read_timeout,
            max_connections: defaults.guard.max_connections,
            max_concurrent_requests: defaults.guard.max_concurrent_requests,
        };
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            if flag == "--routed-experts" {
                out.routed_experts = true;
                continue;
            }
            if flag == "--help" || flag == "-h" {
                return Err(Error::Config(USAGE.into()));
            }
            let value = it
                .next()
                .ok_or_else(|| Error::Config(format!("{flag} needs a value\n{USAGE}")))?;
            match flag.as_str() {
                "--engine-url" => out.engine_url = value,
                "--model" => out.model = Some(PathBuf::from(value)),
                "--tito" | "--tito-model" => out.tito = value,
                "--host" => out.host = value,
                "--port" => out.port = number(&flag, &value)?,
                "--max-body-bytes" | "--max-request-bytes" => {
                    out.max_body_bytes = number(&flag, &value)?;
                    if out.max_body_bytes == 0 {
                        return Err(Error::Config(format!("{flag} must be at least 1")));
                    }
                }
                "--api-key" => out.api_key = Some(ApiKey::new(value)?),
                "--max-n" => {
                    out.max_n = number(&flag, &value)?;
                    if out.max_n == 0 {
                        return Err(Error::Config("--max-n must be at least 1".into()));
                    }
                }
                "--max-sessions" => out.max_sessions = optional_count(&flag, &value)?,
                "--session-idle-timeout" | "--session-idle-timeout-s" => {
                    out.session_idle_timeout = optional_seconds(&flag, &value)?;
                }
                "--max-records-per-session" => {
                    out.max_records_per_session = optional_count(&flag, &value)?;
                }
                "--max-tokens-per-session" => {
                    out.max_tokens_per_session = optional_count(&flag, &value)?;
                }
                "--request-timeout-s" => out.request_timeout = optional_seconds(&flag, &value)?,
                "--header-read-timeout-s" => {
                    out.header_read_timeout = optional_seconds(&flag, &value)?;
                }
                "--max-connections" => out.max_connections = optional_count(&flag, &value)?,
                "--max-concurrent-requests" => {
                    out.max_concurrent_requests = optional_count(&flag, &value)?;
                }
                "--num-layers" => out.num_layers = Some(number(&flag, &value)?),
                "--max-context-len" => out.max_context_len = Some(number(&flag, &value)?),
                "--default-max-tokens" => out.default_max_tokens = Some(number(&flag, &value)?),
                "--engine-timeout-s" => out.engine_timeout_s = number(&flag, &value)?,
                "--instance-id" => out.instance_id = Some(value),
                "--worker-threads" => {
                    let n: usize = number(&flag, &value)?;
                    if n == 0 {
                        return Err(Error::Config("--worker-threads must be at least 1".into()));
                    }
                    out.worker_threads = Some(n);
                }
                other => return Err(Error::Config(format!("unknown flag {other}\n{USAGE}"))),
            }
        }
        if out.engine_url.is_empty() || out.tito.is_empty() {
            return Err(Error::Config(format!(
                "--engine-url and --tito are required\n{USAGE}"
            )));
        }
        if out.model.is_none() && out.tito != "byte_chatml" {
            return Err(Error::Config(format!(
                "--model is required for --tito {}\n{USAGE}",
                out.tito
            )));
        }
        if !(out.engine_timeout_s > 0.0
            && out.engine_timeout_s.is_finite()
            && out.engine_timeout_s < 1e9)
        {
            return Err(Error::Config("--engine-timeout-s must be positive".into()));
        }
        if out.api_key.is_none() {
            out.api_key = ApiKey::from_env()?;
        }
        Ok(out)
    }

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

/// Binds, prints `miles-session listening on http://ADDR …` and serves `server` until the
/// process ends, through [`crate::guard::serve`] (connection limit, request-head timeout).
pub async fn serve(args: &CliArgs, server: SessionServer) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port)).await?;
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
        tracing::warn!(%addr, "serving on a non-loopback address without --api-key");
    }
    crate::guard::serve(listener, server.router(), args.guard_config()).await
}

/// [`build`] then [`serve`].
pub async fn run(args: &CliArgs, loader: Option<&TokenizerLoader>) -> Result<()> {
    let server = build(args, loader)?;
    serve(args, server).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Result<CliArgs> {
        CliArgs::parse(s.split_whitespace().map(str::to_owned))
    }

    #[test]
    fn parses_the_documented_command_line() {
        let a = args("--engine-url http://e:30000 --model /m/Qwen3-4B --tito qwen3 --host 0.0.0.0 --port 9000 --routed-experts --num-layers 48").unwrap();
        assert_eq!(a.engine_url, "http://e:30000");
        assert_eq!(a.port, 9000);
        assert!(a.routed_experts);
        assert_eq!(a.num_layers, Some(48));
        assert_eq!(a.server_config().model_name, "Qwen3-4B");
        assert!(matches!(a.tokenizer(None), Err(Error::Config(_))));
        assert!(
            args("--engine-url x --tito qwen3").is_err(),
            "model required"
        );
        assert!(args("--engine-url x --tito byte_chatml --port nine").is_err());
        assert!(args("--engine-url x --tito byte_chatml --bogus 1").is_err());
        let toy = args("--engine-url toy --tito byte_chatml").unwrap();
        assert!(toy.tokenizer(None).is_ok());
        assert_eq!(toy.worker_threads, None);
        let instant = args("--engine-url instant --tito byte_chatml --worker-threads 3").unwrap();
        assert_eq!(instant.worker_threads, Some(3));
        assert!(build(&instant, None).is_ok());
        assert!(args("--engine-url x --tito byte_chatml --worker-threads 0").is_err());
    }

    #[test]
    fn hardening_flags() {
        let a = args("--engine-url toy --tito byte_chatml").unwrap();
        let defaults = SessionServerConfig::default();
        let config = a.server_config();
        assert_eq!(config.max_sessions, defaults.max_sessions);
        assert_eq!(config.session_idle_timeout, defaults.session_idle_timeout);
        assert_eq!(config.limits, defaults.limits);
        assert_eq!(a.host, "127.0.0.1");
        let a = args(
            "--engine-url toy --tito byte_chatml --api-key k3y --max-request-bytes 1000 --max-n 4 \
             --max-sessions 0 --session-idle-timeout 2.5 --max-records-per-session 7 \
             --max-tokens-per-session 0 --request-timeout-s 30 --header-read-timeout-s 0 \
             --max-connections 9 --max-concurrent-requests 0",
        )
        .unwrap();
        assert_eq!(a.api_key, Some(ApiKey::new("k3y").unwrap()));
        assert!(!format!("{a:?}").contains("k3y"), "the key never prints");
        let config = a.server_config();
        assert_eq!(config.max_body_bytes, 1000);
        assert_eq!(config.limits.max_n, 4);
        assert_eq!(config.max_sessions, None);
        assert_eq!(
            config.session_idle_timeout,
            Some(Duration::from_millis(2500))
        );
        assert_eq!(config.max_records_per_session, Some(7));
        assert_eq!(config.max_tokens_per_session, None);
        let guard = a.guard_config();
        assert_eq!(guard.api_key, a.api_key);
        assert_eq!(guard.max_body_bytes, 1000);
        assert_eq!(guard.request_timeout, Some(Duration::from_secs(30)));
        assert_eq!(guard.header_read_timeout, None);
        assert_eq!(guard.max_connections, Some(9));
        assert_eq!(guard.max_concurrent_requests, None);
        for bad in [
            "--max-n 0",
            "--max-request-bytes 0",
            "--api-key clé",
            "--session-idle-timeout -1",
            "--session-idle-timeout inf",
            "--request-timeout-s NaN",
            "--engine-timeout-s 1e300",
            "--max-sessions -3",
        ] {
            let line = format!("--engine-url toy --tito byte_chatml {bad}");
            assert!(args(&line).is_err(), "{bad}");
        }
    }

    #[test]
    fn model_families_load_through_the_miles_tito_adapter() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizers/qwen3");
        for family in ["qwen3", "qwen35", "qwennext", "nemotron3", "default"] {
            let a = args(&format!("--engine-url toy --model {dir} --tito {family}")).unwrap();
            let tok = a.tokenizer(None).unwrap();
            assert_eq!(tok.family(), family);
        }
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tokenizers");
        for (model, family) in [
            ("glm-4.5", "glm47"),
            ("kimi-k2", "kimi25"),
            ("kimi-k2", "kimi26"),
        ] {
            let a = args(&format!(
                "--engine-url toy --model {root}/{model} --tito {family}"
            ))
            .unwrap();
            let tok = a.tokenizer(None).unwrap();
            assert_eq!(tok.family(), family);
            assert!(!tok.stop_token_ids().is_empty(), "{family}");
        }
        let bad = args(&format!("--engine-url toy --model {dir} --tito qwen9")).unwrap();
        assert!(matches!(bad.tokenizer(None), Err(Error::Config(_))));
    }
}
