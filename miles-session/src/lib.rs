//! # miles-session
//!
//! The OpenAI-compatible **session server** of miles-rs, as a library (an [`axum::Router`]
//! builder, [`server::SessionServer`]), served by `miles session` (miles-cli). It sits between
//! agent code and inference engines and records exactly what the model produced: for every
//! chat turn the prompt ids (built incrementally, token-in-token-out, never re-tokenized), the
//! output ids, their log-probs and the MoE routes. It talks to engines only through token-level
//! `generate` ([`miles_core::InferenceEngine`]). Behaviour follows Miles' session server, agentic generation and samples codec, and SGLang's HTTP API.
//!
//! What the crate owns:
//!
//! * [`server`]: routes `/health`, `/sessions`, `/sessions/{id}` (GET / DELETE),
//!   `/sessions/{id}/v1/chat/completions` (incl. fake SSE streaming), `/sessions/{id}/samples`,
//!   `/metrics` (Prometheus text); the session registry and three-phase locking; typed
//!   OpenAI-shaped JSON errors.
//! * [`guard`]: the HTTP guards applied by the router (bearer API key, JSON-only bodies, body
//!   and request timeouts, request and connection caps, request-head timeout), reusable by any
//!   axum server of the workspace.
//! * [`trajectory`]: the linear trajectory with one-step rollback, and the records.
//! * [`tree`] and [`tree_samples`]: tree sessions (Miles' session server v2, selected with
//!   [`server::SessionServerConfig::session_version`] = [`tree::SessionVersion::V2`]): a
//!   request that diverges from the history branches into an append-only tree instead of
//!   rolling back; every leaf is assembled into a sample, then Miles' picker (`drop_retries`)
//!   and post-processor (`default_postprocess`), or your own ([`tree_samples::SamplePicker`],
//!   [`tree_samples::SamplePostprocessor`]), choose and finish the training samples.
//! * The server reaches chat templates and tokenizers only through miles-tito's
//!   [`miles_tito::ChatTokenizer`] seam (render, incremental tokenization, output parsing,
//!   decode; with miles-tito's strict append-only validation and token-sequence comparator
//!   behind the `tito_session_mismatch` metric).
//! * [`assembly`] and [`codec`]: records → training [`miles_core::Sample`]s (trailing-token
//!   trim, truncation, merge) and Miles' safetensors samples wire format.
//! * [`agent`]: the agent driver (`agentic_tool_call.generate`).
//! * `command_agent` (Unix): agents in any language, a subprocess per sample talking to the
//!   session over its OpenAI API (`CommandAgent`: stdin/stdout JSON protocol, timeouts that
//!   kill the process group).
//! * [`openai`]: the typed chat-completions body (with SGLang's extensions) and its mapping to
//!   sampling parameters, shared with the SGLang-compatible server of [`sglang`].
//! * [`sglang`]: SGLang's HTTP protocol, both ends (the client [`sglang::SglangEngine`], the server
//!   [`sglang::sglang_router`]) and the [`sglang::Router`] over engines.
//! * [`tito_adapter`]: the loader `miles session` uses for [`miles_tito::TitoChat`] (the family table's
//!   [`miles_tito::ChatTokenizer`] over a model directory) for `--model DIR --tito FAMILY`.
//! * [`metrics_server`]: a `/metrics` endpoint for any [`miles_core::prometheus::Registry`]
//!   (trainer processes, `miles serve`), as a router, an async `serve` or a
//!   self-contained [`metrics_server::MetricsServer`] thread.
//! * [`testkit`] (feature `testkit`): a byte-level ChatML tokenizer, a deterministic engine and an instant engine
//!   (tests, load tests, benchmarks, trying `miles session` without a model).
//! * [`loadgen`] (feature `testkit`): the closed-loop load generator (8-turn tool-calling sessions over HTTP) and a
//!   handle on a server process, behind the example, the benchmark and the memory test.
//!
//! It never depends on burn.
//!
//! ```
//! use std::sync::Arc;
//! use miles_session::server::{SessionServer, SessionServerConfig};
//! use miles_session::testkit::{ByteChatml, ToyEngine};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let server = SessionServer::new(ToyEngine::new(), Arc::new(ByteChatml::default()), SessionServerConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let base = format!("http://{}", listener.local_addr()?);
//! tokio::spawn(axum::serve(listener, server.router()).into_future());
//!
//! // An agent opens a session and chats through it like any OpenAI endpoint.
//! let http = miles_session::http::HttpClient::new(std::time::Duration::from_secs(10));
//! let created: serde_json::Value = http.post_json(&format!("{base}/sessions"), &serde_json::json!({}), &[]).await?.json()?;
//! let session = format!("{base}/sessions/{}", created["session_id"].as_str().unwrap());
//! let body = serde_json::json!({"messages": [{"role": "user", "content": "hello"}]});
//! let reply: serde_json::Value = http.post_json(&format!("{session}/v1/chat/completions"), &body, &[]).await?.json()?;
//! assert_eq!(reply["choices"][0]["message"]["content"], "You said: hello");
//!
//! // The recorded turn becomes a training sample: prompt + response ids, loss mask, log-probs.
//! let samples: serde_json::Value = http
//!     .post_json(&format!("{session}/samples"), &serde_json::json!({}), &[("accept", "application/json")])
//!     .await?
//!     .json()?;
//! let sample: miles_core::Sample = serde_json::from_value(samples["samples"][0].clone())?;
//! assert_eq!(sample.status, miles_core::SampleStatus::Completed);
//! assert_eq!(sample.loss_mask.as_ref().map(Vec::len), Some(sample.response_length));
//! assert_eq!(server.sessions_open(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

pub mod agent;
mod api_key;
pub mod assembly;
#[cfg(feature = "testkit")]
pub mod cli;
pub mod codec;
#[cfg(unix)]
pub mod command_agent;
mod error;
pub mod guard;
pub mod http;
#[cfg(feature = "testkit")]
pub mod loadgen;
pub mod metrics;
pub mod metrics_server;
pub mod openai;
pub mod server;
mod server_core;
pub mod sglang;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod tito_adapter;
pub mod trajectory;
pub mod tree;
pub mod tree_samples;
mod tree_server;

pub use error::{Error, Result};
