//! The session server as an [`axum::Router`] (Miles' session server): registry, three-phase locking,
//! chat completions over a token-level [`InferenceEngine`], records, samples, metrics. The
//! routes serve linear sessions (v1, the default) or tree sessions (v2, [`crate::tree`]) as
//! [`SessionServerConfig::session_version`] says.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use miles_core::{InferenceEngine, Sample};
use miles_tito::{ChatTokenizer, Mismatch};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use crate::assembly::{
    compute_samples_from_records, merge_samples, truncate_samples_by_total_tokens,
};
use crate::codec::{EmptyReason, SamplesPayload, encode_samples_as};
use crate::error::{Error, Result};
use crate::metrics::ServerMetrics;
pub use crate::server_core::SessionServerConfig;
use crate::server_core::{
    AppState, AppStateRef, BusyGuard, Session, client_response, error_response, lookup, now_secs,
    path_mismatches, prepare_chat, read_body, respond, run_engine, template_rejection,
};
use crate::trajectory::{LinearTrajectory, SessionRecord};
pub use crate::tree::SessionVersion;
use crate::tree::TreeTrajectory;
use crate::tree_server;

/// The sticky routing header sent to engines with every call of a session.
pub const ROUTING_KEY_HEADER: &str = "X-SMG-Routing-Key";

/// A handle on a running session server's state, for embedding (metrics, session counts).
#[derive(Clone)]
pub struct SessionServer {
    state: Arc<AppState>,
}

impl std::fmt::Debug for SessionServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionServer")
            .field("family", &self.state.tokenizer.family())
            .field("sessions_open", &self.sessions_open())
            .finish()
    }
}

impl SessionServer {
    /// A server over `engine`, rendering and parsing with `tokenizer`.
    pub fn new(
        engine: Arc<dyn InferenceEngine>,
        tokenizer: Arc<dyn ChatTokenizer>,
        config: SessionServerConfig,
    ) -> Self {
        Self {
            state: Arc::new(AppState {
                engine,
                tokenizer,
                config,
                sessions: RwLock::new(HashMap::new()),
                metrics: ServerMetrics::default(),
                epoch: Instant::now(),
                next_sweep_ms: AtomicU64::new(0),
            }),
        }
    }

    /// The routes of Miles' session-server routes (+ `/metrics`), behind the guards of
    /// [`SessionServerConfig::guard`] ([`crate::guard::harden`]). Serve it with
    /// [`crate::guard::serve`] for the connection limit and the request-head timeout. Called
    /// inside a Tokio runtime with an idle timeout set, it also starts the idle-session
    /// sweeper (which ends when the server is dropped).
    pub fn router(&self) -> Router {
        if let (Some(timeout), Ok(handle)) = (
            self.state.config.session_idle_timeout,
            tokio::runtime::Handle::try_current(),
        ) {
            let weak = Arc::downgrade(&self.state);
            let period = (timeout / 4).max(Duration::from_millis(10));
            handle.spawn(async move {
                loop {
                    tokio::time::sleep(period).await;
                    let Some(state) = weak.upgrade() else { break };
                    state.sweep_idle();
                }
            });
        }
        let metrics_state = self.state.clone();
        let guard = self
            .state
            .config
            .guard
            .clone()
            .with_max_body_bytes(self.state.config.max_body_bytes)
            .with_on_reject(Some(Arc::new(move |label| {
                metrics_state.metrics.error(label)
            })));
        let router = Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/sessions", post(create_session))
            .route("/sessions/{id}", get(get_session).delete(delete_session))
            .route("/sessions/{id}/v1/chat/completions", post(chat_completions))
            .route("/sessions/{id}/samples", post(samples))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::disable())
            .with_state(self.state.clone());
        crate::guard::harden(router, &guard)
    }

    /// Sessions currently open.
    pub fn sessions_open(&self) -> usize {
        self.state.sessions.read().map(|m| m.len()).unwrap_or(0)
    }

    /// The server's metrics.
    pub fn metrics(&self) -> &ServerMetrics {
        &self.state.metrics
    }
}

async fn not_found(State(state): AppStateRef, request: Request) -> Response {
    let err = Error::InvalidBody {
        reason: format!("no route for {} {}", request.method(), request.uri().path()),
    };
    state.metrics.error("not_found");
    (StatusCode::NOT_FOUND, axum::Json(json!({"error": {"message": err.to_string(), "type": "invalid_request_error", "code": "not_found"}})))
        .into_response()
}

async fn method_not_allowed(State(state): AppStateRef, request: Request) -> Response {
    state.metrics.error("method_not_allowed");
    let message = format!(
        "method {} not allowed on {}",
        request.method(),
        request.uri().path()
    );
    (
        StatusCode::METHOD_NOT_ALLOWED,
        axum::Json(json!({"error": {"message": message, "type": "invalid_request_error", "code": "method_not_allowed"}})),
    )
        .into_response()
}

async fn health(State(state): AppStateRef) -> Response {
    let mut body = json!({"status": "ok"});
    if let Some(id) = &state.config.instance_id {
        body["session_server_instance_id"] = json!(id);
    }
    axum::Json(body).into_response()
}

async fn metrics(State(state): AppStateRef) -> Response {
    state.sweep_idle();
    let open = state.sessions.read().map(|m| m.len()).unwrap_or(0);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(open),
    )
        .into_response()
}

async fn create_session(State(state): AppStateRef) -> Response {
    state.sweep_idle();
    let id = uuid::Uuid::new_v4().simple().to_string();
    let session = Session {
        last_used_ms: AtomicU64::new(state.now_ms()),
        tree: tokio::sync::Mutex::new(TreeTrajectory::with_max_nodes(state.config.max_tree_nodes)),
        ..Session::default()
    };
    let inserted = match state.sessions.write() {
        Ok(mut map) => {
            if state
                .config
                .max_sessions
                .is_some_and(|cap| map.len() >= cap)
            {
                false
            } else {
                map.insert(id.clone(), Arc::new(session));
                true
            }
        }
        Err(_) => false,
    };
    if !inserted {
        let limit = state.config.max_sessions.unwrap_or(0);
        return error_response(&state, Error::TooManySessions { limit });
    }
    state
        .metrics
        .sessions_created
        .fetch_add(1, Ordering::Relaxed);
    axum::Json(json!({"session_id": id})).into_response()
}

async fn delete_session(State(state): AppStateRef, Path(id): Path<String>) -> Response {
    let result = async {
        let session = lookup(&state, &id)?;
        if session.closing.swap(true, Ordering::AcqRel) {
            return Err(Error::SessionNotFound {
                session_id: id.clone(),
            });
        }
        // Wait for in-flight phase 1 / phase 3 critical sections.
        let _guard = session.trajectory.lock().await;
        let _tree_guard = session.tree.lock().await;
        if let Ok(mut map) = state.sessions.write() {
            map.remove(&id);
        }
        state
            .metrics
            .sessions_deleted
            .fetch_add(1, Ordering::Relaxed);
        Ok(StatusCode::NO_CONTENT.into_response())
    }
    .await;
    respond(&state, result)
}

fn mismatches(state: &AppState, trajectory: &LinearTrajectory) -> Option<Vec<Mismatch>> {
    let last_request = &trajectory.records().last()?.request;
    path_mismatches(
        state,
        trajectory.messages(),
        last_request,
        trajectory.token_ids(),
        true,
    )
}

fn session_metadata(state: &AppState, trajectory: &LinearTrajectory) -> Map<String, Value> {
    let mut meta = Map::new();
    if let Some(found) = mismatches(state, trajectory) {
        meta.insert("tito_session_mismatch".into(), json!(found));
    }
    meta.insert(
        "accumulated_token_ids".into(),
        json!(trajectory.token_ids()),
    );
    meta.insert(
        "max_trim_tokens".into(),
        json!(state.tokenizer.max_trim_tokens()),
    );
    meta
}

async fn get_session(State(state): AppStateRef, Path(id): Path<String>) -> Response {
    if state.config.session_version == SessionVersion::V2 {
        return tree_server::get_session(&state, &id).await;
    }
    let result = async {
        let session = lookup(&state, &id)?;
        let trajectory = session.trajectory.lock().await;
        let body = json!({
            "session_id": id,
            "records": trajectory.records(),
            "metadata": session_metadata(&state, &trajectory),
        });
        Ok(axum::Json(body).into_response())
    }
    .await;
    respond(&state, result)
}

async fn chat_completions(
    State(state): AppStateRef,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let started = Instant::now();
    let result = match state.config.session_version {
        SessionVersion::V1 => chat_turn(&state, &id, request).await,
        SessionVersion::V2 => tree_server::chat_turn(&state, &id, request).await,
    };
    respond(
        &state,
        result.map(|(r, engine_time)| {
            let total = started.elapsed();
            state.metrics.turn_latency.observe(total);
            state
                .metrics
                .added_latency
                .observe(total.saturating_sub(engine_time));
            r
        }),
    )
}

async fn chat_turn(state: &AppState, id: &str, request: Request) -> Result<(Response, Duration)> {
    let request_timestamp = now_secs();
    let session = lookup(state, id)?;
    let (_, bytes) = read_body(state, request).await?;
    let chat = prepare_chat(state, &bytes)?;
    let tools = chat.request.tools.clone().unwrap_or_default();
    // One turn at a time per session: a concurrent turn would be answered but could not be
    // recorded (the trajectory is linear), so it is refused up front.
    let Some(_busy) = BusyGuard::exclusive(&session) else {
        return Err(Error::SessionBusy {
            session_id: id.to_owned(),
        });
    };

    // Phase 1 (session lock): closing check, TITO-prepare the prompt ids.
    let prepared = {
        let trajectory = session.trajectory.lock().await;
        if session.closing.load(Ordering::Acquire) {
            return Err(Error::SessionNotFound {
                session_id: id.to_owned(),
            });
        }
        if let Some(cap) = state.config.max_records_per_session
            && trajectory.records().len() >= cap
        {
            return Err(Error::SessionLimit {
                reason: format!("the session already has {cap} records"),
            });
        }
        trajectory
            .prepare(
                &chat.request.messages,
                &tools,
                &chat.kwargs,
                state.tokenizer.as_ref(),
                state.config.message_matcher,
            )
            .map_err(template_rejection)?
    };

    // Phase 2 (no lock): the engine call.
    let prompt_len = prepared.prompt_ids.len();
    let turn = run_engine(state, id, &chat, &prepared.prompt_ids, &tools).await?;

    // Phase 3 (session lock): commit unless the session changed or is closing.
    let mut turn = turn;
    {
        let mut trajectory = session.trajectory.lock().await;
        if session.closing.load(Ordering::Acquire) || trajectory.generation() != prepared.generation
        {
            // Never a 200 for a turn that is not recorded: the session was deleted (or
            // expired) during the engine call.
            state.metrics.turns_skipped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                session = id,
                "session changed or closing during the engine call; turn not recorded"
            );
            return Err(Error::SessionNotFound {
                session_id: id.to_owned(),
            });
        }
        let record = SessionRecord {
            timestamp: now_secs(),
            request_timestamp: Some(request_timestamp),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request: chat.record_body.clone(),
            input_ids: Some(prepared.prompt_ids.clone()),
            response: std::mem::take(&mut turn.body),
            status_code: 200,
        };
        trajectory.commit(
            &prepared,
            &chat.request.messages,
            &turn.output.output_ids,
            turn.assistant.clone(),
            record,
            state.tokenizer.max_trim_tokens(),
        )?;
        state.metrics.turns.fetch_add(1, Ordering::Relaxed);
    }
    let response = client_response(state, chat.stream, prompt_len, &turn)?;
    Ok((response, turn.engine_time))
}

#[derive(Debug, Default, Deserialize)]
struct SamplesRequest {
    #[serde(default)]
    max_seq_len: Option<usize>,
    /// `true`: one sample per turn (Miles' `--generate-multi-samples`), not merged (v1 only).
    #[serde(default)]
    generate_multi_samples: bool,
    /// v2: the agent's metadata (an object; its `reward` becomes the samples' reward with the
    /// default post-processor), `session_metadata.agent` of the reply.
    #[serde(default)]
    metadata: Option<Value>,
}

/// Assembles the session's samples (compute → truncate → merge). With `per_turn` the
/// per-turn samples are returned unmerged (each trimmed of its trailing stop tokens as
/// `compute_samples_from_records` does), the conversation's messages on the last one.
fn assemble(
    state: &AppState,
    trajectory: &LinearTrajectory,
    max_seq_len: Option<usize>,
    per_turn: bool,
) -> Result<SamplesPayload> {
    let tok = state.tokenizer.as_ref();
    // The samples' text as SGLang's detokenizer gives it: special tokens (the end of turn)
    // skipped; the ids keep them.
    let decode = |ids: &[u32]| tok.decode_text(ids, true);
    let session_metadata = session_metadata(state, trajectory);
    if trajectory.records().is_empty() {
        return Ok(SamplesPayload {
            samples: Vec::new(),
            session_metadata,
            empty_reason: Some(EmptyReason::NoRecords),
        });
    }
    let mut samples = compute_samples_from_records(
        &Sample::default(),
        trajectory.records(),
        Some(trajectory.token_ids()),
        tok.max_trim_tokens(),
        &decode,
    )?;
    if let Some(max) = max_seq_len {
        samples = truncate_samples_by_total_tokens(samples, max, &decode)?;
        if samples.is_empty() {
            return Ok(SamplesPayload {
                samples,
                session_metadata,
                empty_reason: Some(EmptyReason::AllTruncated),
            });
        }
    }
    // Miles attaches the conversation only with --save-debug-trajectory-data.
    let messages = state
        .config
        .save_debug_trajectory_data
        .then(|| json!(trajectory.messages()));
    let samples = if per_turn {
        let mut samples = samples;
        if let (Some(last), Some(messages)) = (samples.last_mut(), messages) {
            last.metadata.insert("messages".into(), messages);
        }
        samples
    } else {
        let mut merged = merge_samples(samples, &decode)?;
        if let Some(messages) = messages {
            merged.metadata.insert("messages".into(), messages);
        }
        vec![merged]
    };
    Ok(SamplesPayload {
        samples,
        session_metadata,
        empty_reason: None,
    })
}

async fn samples(State(state): AppStateRef, Path(id): Path<String>, request: Request) -> Response {
    let result = async {
        let session = lookup(&state, &id)?;
        let (headers, bytes) = read_body(&state, request).await?;
        let params: SamplesRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
            SamplesRequest::default()
        } else {
            serde_json::from_slice(&bytes).map_err(|e| Error::InvalidBody {
                reason: format!("invalid JSON body: {e}"),
            })?
        };
        let payload = match state.config.session_version {
            SessionVersion::V1 => {
                let trajectory = session.trajectory.lock().await;
                assemble(
                    &state,
                    &trajectory,
                    params.max_seq_len,
                    params.generate_multi_samples,
                )?
            }
            SessionVersion::V2 => {
                if params.generate_multi_samples {
                    return Err(Error::InvalidBody {
                        reason: "generate_multi_samples is a v1 option: a tree session (v2) \
                                 returns one sample per leaf"
                            .into(),
                    });
                }
                if params.metadata.as_ref().is_some_and(|m| !m.is_object()) {
                    return Err(Error::InvalidBody {
                        reason: "metadata must be a JSON object".into(),
                    });
                }
                let tree = session.tree.lock().await;
                tree_server::assemble(&state, &tree, params.max_seq_len, params.metadata)?
            }
        };
        let wants_json = headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("application/json"));
        if wants_json {
            let body = json!({
                "samples": payload.samples,
                "session_metadata": payload.session_metadata,
                "empty_reason": payload.empty_reason,
            });
            Ok(axum::Json(body).into_response())
        } else {
            let bytes = encode_samples_as(&payload, state.config.session_version.wire())?;
            Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
        }
    }
    .await;
    respond(&state, result)
}
