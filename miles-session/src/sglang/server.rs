//! SGLang's HTTP protocol served over any [`InferenceEngine`] (SGLang's HTTP API): the routes the
//! SGLang client of miles-session, Miles' rollout code and OpenAI-style agents call, so an
//! embedded engine (or a [`crate::Router`] over a fleet) answers exactly as an SGLang server
//! would.
//!
//! Routes (see [`sglang_router`]): `/generate`, `/v1/chat/completions`, `/v1/models`, `/health`,
//! `/health_generate`, `/model_info` (and the older `/get_model_info`), `/get_server_info`
//! (`/server_info`), `/flush_cache`, `/pause_generation`, `/continue_generation`,
//! `/abort_request`, `/update_weights_from_disk`, `/get_weight_version`,
//! `/release_memory_occupation`, `/resume_memory_occupation` (body `{"tags": [...]}`, SGLang's
//! `weights`, `kv_cache`, `cuda_graph`; null or absent: all; generation is refused with a 400
//! while memory is released).
//!
//! Bad input is answered with a 4xx status and an OpenAI-shaped JSON body
//! `{"error": {"message", "type", "code"}}`; nothing a client sends can panic the server.
//! A request whose client disconnects is aborted in the engine, as SGLang does.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router as HttpRouter;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use miles_core::InferenceEngine;

use super::admin::{
    abort_request, continue_generation, flush_cache, get_weight_version, health, health_generate,
    list_models, model_info, pause_generation, release_memory_occupation, resume_memory_occupation,
    server_info, update_weights_from_disk,
};
use super::chat::chat_completions;
use super::generate::generate;
use super::info::ServerInfo;
use super::state::{AppState, method_not_allowed, not_found};

/// Builds the SGLang-protocol HTTP routes over `engine`. Serve it with `axum::serve`.
///
/// ```
/// use std::sync::Arc;
/// use miles_session::sglang::{ServerInfo, sglang_router};
/// use miles_session::testkit::ToyEngine;
///
/// let app = sglang_router(ToyEngine::new(), ServerInfo::new("toy"));
/// # let _ = app;
/// ```
pub fn sglang_router(engine: Arc<dyn InferenceEngine>, info: ServerInfo) -> HttpRouter {
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let metrics = info.metrics.clone();
    let state = Arc::new(AppState {
        engine,
        info,
        next_id: AtomicU64::new(0),
        started,
        released: Mutex::default(),
    });
    let router = HttpRouter::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(list_models))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/server_info", get(server_info))
        .route("/flush_cache", get(flush_cache).post(flush_cache))
        .route("/pause_generation", post(pause_generation))
        .route("/continue_generation", post(continue_generation))
        .route("/abort_request", post(abort_request))
        .route("/update_weights_from_disk", post(update_weights_from_disk))
        .route(
            "/release_memory_occupation",
            get(release_memory_occupation).post(release_memory_occupation),
        )
        .route(
            "/resume_memory_occupation",
            get(resume_memory_occupation).post(resume_memory_occupation),
        )
        .route("/get_weight_version", get(get_weight_version))
        .route("/weight_version", get(get_weight_version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::disable())
        .with_state(state);
    // `GET /metrics` only with `--enable-metrics`; otherwise the JSON 404 of the fallback,
    // as SGLang answers without `--enable-metrics`.
    match metrics {
        Some(registry) => router.merge(crate::metrics_server::router(registry)),
        None => router,
    }
}
