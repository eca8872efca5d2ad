//! The session server as an [`axum::Router`] (Miles' session server): registry, three-phase locking,
//! chat completions over a token-level [`InferenceEngine`], records, samples, metrics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use miles_core::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, Message, RequestId, Sample,
    SamplingParams, ToolArguments, ToolSpec,
};
use miles_tito::{ChatTokenizer, MessageMatcher, Mismatch};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::Mutex;

use crate::assembly::{
    compute_samples_from_records, merge_samples, truncate_samples_by_total_tokens,
};
use crate::codec::{EmptyReason, SamplesPayload, encode_samples};
use crate::error::{Error, Result};
use crate::guard::GuardConfig;
use crate::metrics::ServerMetrics;
use crate::openai;
use crate::openai::{ChatCompletionRequest, RequestLimits, sse_response};
use crate::trajectory::{LinearTrajectory, SessionRecord};

/// The sticky routing header sent to engines with every call of a session.
pub const ROUTING_KEY_HEADER: &str = "X-SMG-Routing-Key";

/// Session server settings.
#[derive(Debug, Clone)]
pub struct SessionServerConfig {
    /// Largest accepted request body, in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// The `model` reported in responses when the request names none.
    pub model_name: String,
    /// Ask engines for routed experts (R3) and keep them in the records.
    pub return_routed_experts: bool,
    /// `max_new_tokens` when the request sets neither `max_tokens` nor
    /// `max_completion_tokens`.
    pub default_max_tokens: Option<usize>,
    /// Context limit: prompts at or over it are rejected with 400 before reaching the engine,
    /// and `max_new_tokens` is capped to what is left.
    pub max_context_len: Option<usize>,
    /// Timeout of one engine call (→ 504).
    pub engine_timeout: Duration,
    /// Reported by `/health` as `session_server_instance_id`.
    pub instance_id: Option<String>,
    /// Bounds on request fields (`n`, stop strings, stop token ids, sampling ranges).
    pub limits: RequestLimits,
    /// The HTTP guards ([`crate::guard`]: API key, JSON content type, timeouts, concurrency)
    /// applied by [`SessionServer::router`]; its body limit is replaced by
    /// [`SessionServerConfig::max_body_bytes`].
    pub guard: GuardConfig,
    /// Most sessions open at once (`POST /sessions` past it → 429).
    pub max_sessions: Option<usize>,
    /// A session without requests for this long is closed (counted in
    /// `miles_session_sessions_expired_total`).
    pub session_idle_timeout: Option<Duration>,
    /// Most records (committed turns) per session (400 past it).
    pub max_records_per_session: Option<usize>,
    /// Most tokens in a session's trajectory (prompt + completion): prompts at or over it are
    /// rejected with 400 and `max_new_tokens` is capped to what is left, like the context.
    pub max_tokens_per_session: Option<usize>,
    /// Chat-template kwargs applied to every render (Miles' `--apply-chat-template-kwargs`,
    /// e.g. `{"enable_thinking": false}`); a request's `chat_template_kwargs` are merged over
    /// them. Default: none.
    pub chat_template_kwargs: Map<String, Value>,
    /// Put the conversation (`metadata.messages`) on the last sample of a session, as Miles
    /// does with `--save-debug-trajectory-data`. Default: off.
    pub save_debug_trajectory_data: bool,
    /// How a request's history is compared with the stored one (Miles'
    /// `--session-message-matcher`: `strict`, `loose_tool_call`, `role_content_only`), for
    /// rollback detection and the append-only check. Default: strict.
    pub message_matcher: MessageMatcher,
}

impl Default for SessionServerConfig {
    fn default() -> Self {
        Self {
            max_body_bytes: 16 << 20,
            model_name: "miles".to_owned(),
            return_routed_experts: false,
            default_max_tokens: None,
            max_context_len: None,
            engine_timeout: Duration::from_secs(600),
            instance_id: None,
            limits: RequestLimits::default(),
            guard: GuardConfig::default(),
            max_sessions: Some(65_536),
            session_idle_timeout: Some(Duration::from_secs(3600)),
            max_records_per_session: Some(4096),
            max_tokens_per_session: Some(1 << 20),
            chat_template_kwargs: Map::new(),
            save_debug_trajectory_data: false,
            message_matcher: MessageMatcher::Strict,
        }
    }
}

/// One open session: its trajectory behind an async lock, the closing flag, the flag of a
/// turn in progress and the time of its last request.
#[derive(Debug, Default)]
struct Session {
    trajectory: Mutex<LinearTrajectory>,
    closing: AtomicBool,
    busy: AtomicBool,
    /// Milliseconds since the server's epoch.
    last_used_ms: AtomicU64,
}

/// Clears a session's busy flag when the turn ends (also when the request is cancelled).
struct BusyGuard<'a>(&'a Session);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// Shared state behind the router.
struct AppState {
    engine: Arc<dyn InferenceEngine>,
    tokenizer: Arc<dyn ChatTokenizer>,
    config: SessionServerConfig,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    metrics: ServerMetrics,
    /// The server's clock origin (session idle times are measured from it).
    epoch: Instant,
    /// When the next idle sweep is due, in milliseconds since `epoch`.
    next_sweep_ms: AtomicU64,
}

impl AppState {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Closes the sessions idle for longer than the timeout (no request since, no turn in
    /// progress). Runs at most every quarter of the timeout, on any request and from the
    /// background sweeper.
    fn sweep_idle(&self) {
        let Some(timeout) = self.config.session_idle_timeout else {
            return;
        };
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let now = self.now_ms();
        let due = self.next_sweep_ms.load(Ordering::Relaxed);
        if now < due
            || self
                .next_sweep_ms
                .compare_exchange(
                    due,
                    now + (timeout_ms / 4).max(1),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        let expired = |s: &Session| {
            !s.busy.load(Ordering::Acquire)
                && now.saturating_sub(s.last_used_ms.load(Ordering::Acquire)) > timeout_ms
        };
        let any = self
            .sessions
            .read()
            .map(|m| m.values().any(|s| expired(s)))
            .unwrap_or(false);
        if !any {
            return;
        }
        let mut removed = 0u64;
        if let Ok(mut map) = self.sessions.write() {
            map.retain(|_, s| {
                // A session whose lock is held is being read or deleted: keep it this round;
                // one already closing is left to its DELETE.
                let close = expired(s)
                    && s.trajectory.try_lock().is_ok()
                    && !s.closing.swap(true, Ordering::AcqRel);
                removed += u64::from(close);
                !close
            });
        }
        if removed > 0 {
            self.metrics
                .sessions_expired
                .fetch_add(removed, Ordering::Relaxed);
            tracing::info!(removed, "closed idle sessions");
        }
    }
}

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

type AppStateRef = State<Arc<AppState>>;

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn error_response(state: &AppState, error: Error) -> Response {
    state.metrics.error(error.label());
    tracing::debug!(label = error.label(), %error, "request failed");
    crate::guard::rejection(&error)
}

fn respond(state: &AppState, result: Result<Response>) -> Response {
    result.unwrap_or_else(|e| error_response(state, e))
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

fn lookup(state: &AppState, id: &str) -> Result<Arc<Session>> {
    state.sweep_idle();
    let session = state
        .sessions
        .read()
        .ok()
        .and_then(|m| m.get(id).cloned())
        .ok_or_else(|| Error::SessionNotFound {
            session_id: id.to_owned(),
        })?;
    if session.closing.load(Ordering::Acquire) {
        return Err(Error::SessionNotFound {
            session_id: id.to_owned(),
        });
    }
    session
        .last_used_ms
        .fetch_max(state.now_ms(), Ordering::AcqRel);
    Ok(session)
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

/// The effective template kwargs of a request body: the server's
/// [`SessionServerConfig::chat_template_kwargs`], the request's `chat_template_kwargs` (an
/// object) merged over them, then the family's forced ones.
fn request_kwargs(
    tokenizer: &dyn ChatTokenizer,
    base: &Map<String, Value>,
    body: &Value,
) -> Result<Map<String, Value>> {
    let mut merged = base.clone();
    match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(map)) => merged.extend(map.clone()),
        Some(other) => {
            return Err(Error::InvalidBody {
                reason: format!("chat_template_kwargs must be an object, got {other}"),
            });
        }
    }
    Ok(tokenizer.resolve_kwargs(&merged)?)
}

fn mismatches(state: &AppState, trajectory: &LinearTrajectory) -> Option<Vec<Mismatch>> {
    if trajectory.token_ids().is_empty() {
        return None;
    }
    let last_request = trajectory.records().last().map(|r| &r.request)?;
    let kwargs = request_kwargs(
        state.tokenizer.as_ref(),
        &state.config.chat_template_kwargs,
        last_request,
    )
    .ok()?;
    match state.tokenizer.render(
        trajectory.messages(),
        &trajectory.last_tools(),
        false,
        &kwargs,
    ) {
        Ok(expected) => {
            let found = state
                .tokenizer
                .compare_sequences(&expected, trajectory.token_ids());
            let kinds: Vec<_> = found.iter().map(|m| m.kind).collect();
            state.metrics.mismatch_check(&kinds);
            Some(found)
        }
        Err(error) => {
            tracing::warn!(%error, "mismatch metric: rendering the session failed");
            None
        }
    }
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

async fn read_body(state: &AppState, request: Request) -> Result<(HeaderMap, Bytes)> {
    let (parts, body) = request.into_parts();
    let limit = state.config.max_body_bytes;
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| Error::BodyTooLarge { limit })?;
    Ok((parts.headers, bytes))
}

/// A validated chat request: the typed fields, the body to record, the kwargs to render with.
struct PreparedChat {
    request: ChatCompletionRequest,
    record_body: Value,
    kwargs: Map<String, Value>,
    stream: bool,
}

/// A render error the request caused (the template raised, or cannot render these messages:
/// a content shape or role it does not handle) is the client's 400, as in SGLang; other
/// tokenization failures (template limits, tokenizer errors) stay 500.
fn template_rejection(error: Error) -> Error {
    match error {
        Error::Tokenization { reason } if is_template_rejection(&reason) => {
            Error::TemplateRejected { reason }
        }
        other => other,
    }
}

/// Whether a tokenization reason is miles-tito's render error, `raise_exception` or invalid
/// render input (recognised by the prefixes of their own messages).
fn is_template_rejection(reason: &str) -> bool {
    let prefixes = [
        miles_tito::Error::Render {
            message: String::new(),
        }
        .to_string(),
        miles_tito::Error::TemplateRaised {
            message: String::new(),
        }
        .to_string(),
        miles_tito::Error::InvalidInput(String::new()).to_string(),
    ];
    prefixes.iter().any(|p| reason.starts_with(p.as_str()))
}

fn prepare_chat(state: &AppState, bytes: &[u8]) -> Result<PreparedChat> {
    let mut body: Value = serde_json::from_slice(bytes).map_err(|e| Error::InvalidBody {
        reason: format!("invalid JSON body: {e}"),
    })?;
    let Value::Object(map) = &mut body else {
        return Err(Error::InvalidBody {
            reason: "invalid request body: body must be a JSON object".into(),
        });
    };
    map.remove("stream_options");
    let request = ChatCompletionRequest::deserialize(&body).map_err(|e| Error::InvalidBody {
        reason: format!("invalid request body: {e}"),
    })?;
    request
        .check_limits(&state.config.limits)
        .map_err(|reason| Error::LimitExceeded { reason })?;
    if request.n.is_some_and(|n| n != 1) {
        return Err(Error::InvalidBody {
            reason: "invalid request body: only n=1 is supported in a session".into(),
        });
    }
    let kwargs = request_kwargs(
        state.tokenizer.as_ref(),
        &state.config.chat_template_kwargs,
        &body,
    )?;
    let Value::Object(map) = &mut body else {
        unreachable!("checked above")
    };
    map.remove("stream");
    map.insert("logprobs".into(), json!(true));
    map.insert("return_meta_info".into(), json!(true));
    map.insert("no_stop_trim".into(), json!(false));
    if state.config.return_routed_experts {
        map.insert("return_routed_experts".into(), json!(true));
    }
    if kwargs.is_empty() {
        map.remove("chat_template_kwargs");
    } else {
        map.insert("chat_template_kwargs".into(), Value::Object(kwargs.clone()));
    }
    let stream = request.stream.unwrap_or(false);
    Ok(PreparedChat {
        request,
        record_body: body,
        kwargs,
        stream,
    })
}

fn sampling_params(
    state: &AppState,
    request: &ChatCompletionRequest,
    prompt_len: usize,
) -> Result<SamplingParams> {
    // `n` is checked to be 1 when the body is prepared.
    let params = request.sampling_params(state.tokenizer.stop_token_ids());
    let mut max_new = request
        .requested_max_tokens()
        .or(state.config.default_max_tokens);
    let bounds = [
        (state.config.max_context_len, "the context length"),
        (
            state.config.max_tokens_per_session,
            "the session's token limit",
        ),
    ];
    for (limit, what) in bounds {
        let Some(limit) = limit else { continue };
        let room = limit
            .checked_sub(prompt_len)
            .filter(|&r| r > 0)
            .ok_or_else(|| {
                Error::validation(format!(
                    "the prompt has {prompt_len} tokens, at or over {what} {limit}"
                ))
            })?;
        if params.min_new_tokens > room {
            return Err(Error::validation(format!(
                "min_tokens = {} can never fit: the prompt has {prompt_len} tokens and {what} is {limit}",
                params.min_new_tokens
            )));
        }
        max_new = Some(max_new.map_or(room, |m| m.min(room)));
    }
    Ok(SamplingParams {
        max_new_tokens: max_new,
        ..params
    })
}

/// Builds the chat-completion JSON (with `meta_info`) from an engine output.
fn completion_body(
    state: &AppState,
    request: &ChatCompletionRequest,
    prompt_len: usize,
    output: &GenerateOutput,
    tools: &[ToolSpec],
    kwargs: &Map<String, Value>,
) -> Result<(Value, Message)> {
    if output.output_log_probs.len() != output.output_ids.len() {
        return Err(Error::upstream(format!(
            "engine returned {} log-probs for {} output tokens",
            output.output_log_probs.len(),
            output.output_ids.len()
        )));
    }
    let tok = state.tokenizer.as_ref();
    // The parser sees the kwargs the prompt was rendered with (the server's and the request's).
    let mut parsed = tok.parse_assistant_with_kwargs(&output.output_ids, tools, kwargs)?;
    if output.finish_reason == FinishReason::Stop
        && let Some(Value::String(stop)) = &output.matched_stop
        && let Some(stripped) = parsed.content.strip_suffix(stop.as_str())
    {
        parsed.content = stripped.to_owned();
    }
    for (i, call) in parsed.tool_calls.iter_mut().enumerate() {
        call.index = Some(i as u32);
        if call.id.is_none() {
            call.id = Some(format!(
                "call_{}",
                &uuid::Uuid::new_v4().simple().to_string()[..24]
            ));
        }
        // Stored in the OpenAI wire form, so the agent's echo matches strictly.
        call.function.arguments = ToolArguments::Json(call.function.arguments.to_json_string());
    }
    let finish_reason = match output.finish_reason {
        FinishReason::Stop if !parsed.tool_calls.is_empty() => "tool_calls",
        other => other.as_str(),
    };
    let assistant = parsed.to_message();
    let mut message = json!({"role": "assistant", "content": parsed.content});
    if let Some(reasoning) = &parsed.reasoning_content {
        message["reasoning_content"] = json!(reasoning);
    }
    if !parsed.tool_calls.is_empty() {
        let calls: Vec<Value> = parsed
            .tool_calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "index": c.index, "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments.to_json_string()}})
            })
            .collect();
        message["tool_calls"] = Value::Array(calls);
    }
    let logprob_entries: Vec<Value> = output
        .output_ids
        .iter()
        .zip(&output.output_log_probs)
        .map(|(id, lp)| json!([lp, id, Value::Null]))
        .collect();
    let completion_tokens = output.output_ids.len();
    let mut finish = json!({"type": output.finish_reason.as_str()});
    if let Some(matched) = &output.matched_stop {
        finish["matched"] = matched.clone();
    }
    let mut meta = json!({
        "finish_reason": finish,
        "prompt_tokens": prompt_len,
        "completion_tokens": completion_tokens,
        "cached_tokens": output.cached_tokens,
        "output_token_logprobs": logprob_entries,
        "weight_version": output.weight_version.to_string(),
    });
    if let Some(table) = &output.routed_experts {
        meta["routed_experts"] = json!(table.to_base64());
        meta["routed_experts_num_layers"] = json!(table.layers());
    }
    let body = openai::completion_body(
        format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
        now_secs() as u64,
        request
            .model
            .clone()
            .unwrap_or_else(|| state.config.model_name.clone()),
        vec![json!({
            "index": 0,
            "message": message,
            "finish_reason": finish_reason,
            "meta_info": meta,
        })],
        prompt_len,
        completion_tokens,
    );
    Ok((body, assistant))
}

/// Keys of a choice's `meta_info` that stay in the record but never reach the client.
const CLIENT_HIDDEN_META: [&str; 3] = [
    "routed_experts",
    "routed_experts_num_layers",
    "indexer_topk",
];

/// The response the client sees, serialised straight from the recorded body (no copy of it):
/// OpenAI `logprobs.content` added to every choice (derived from
/// `meta_info.output_token_logprobs`, so records do not store it twice), routed experts /
/// indexer data removed from every choice's `meta_info`.
struct ClientView<'a> {
    body: &'a Value,
    tok: &'a dyn ChatTokenizer,
}

impl serde::Serialize for ClientView<'_> {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Value::Object(map) = self.body else {
            return self.body.serialize(serializer);
        };
        let mut out = serializer.serialize_map(Some(map.len()))?;
        for (key, value) in map {
            match (key.as_str(), value) {
                ("choices", Value::Array(choices)) => {
                    let choices: Vec<ClientChoice<'_>> = choices
                        .iter()
                        .map(|choice| ClientChoice {
                            choice,
                            tok: self.tok,
                        })
                        .collect();
                    out.serialize_entry(key, &choices)?;
                }
                _ => out.serialize_entry(key, value)?,
            }
        }
        out.end()
    }
}

struct ClientChoice<'a> {
    choice: &'a Value,
    tok: &'a dyn ChatTokenizer,
}

impl serde::Serialize for ClientChoice<'_> {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let Value::Object(map) = self.choice else {
            return self.choice.serialize(serializer);
        };
        let mut out = serializer.serialize_map(None)?;
        for (key, value) in map {
            match (key.as_str(), value) {
                ("logprobs", _) => {}
                ("meta_info", Value::Object(meta)) => {
                    out.serialize_entry(key, &FilteredMeta(meta))?;
                }
                _ => out.serialize_entry(key, value)?,
            }
        }
        let entries = map
            .get("meta_info")
            .and_then(|m| m.get("output_token_logprobs"))
            .and_then(Value::as_array)
            .map_or(&[][..], Vec::as_slice);
        out.serialize_entry(
            "logprobs",
            &LogprobsContent {
                entries,
                tok: self.tok,
            },
        )?;
        out.end()
    }
}

struct FilteredMeta<'a>(&'a Map<String, Value>);

impl serde::Serialize for FilteredMeta<'_> {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_map(
            self.0
                .iter()
                .filter(|(k, _)| !CLIENT_HIDDEN_META.contains(&k.as_str())),
        )
    }
}

/// `{"content": [{"token", "logprob", "top_logprobs": []}, …]}` from SGLang
/// `[logprob, id, text]` triples.
struct LogprobsContent<'a> {
    entries: &'a [Value],
    tok: &'a dyn ChatTokenizer,
}

impl serde::Serialize for LogprobsContent<'_> {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        struct Entry<'a>(&'a Value, &'a dyn ChatTokenizer);
        impl serde::Serialize for Entry<'_> {
            fn serialize<S: serde::Serializer>(
                &self,
                serializer: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                use serde::ser::SerializeMap;
                let id = self.0.get(1).and_then(Value::as_u64).unwrap_or(0) as u32;
                let mut out = serializer.serialize_map(Some(3))?;
                out.serialize_entry("token", &*self.1.decode_token(id))?;
                out.serialize_entry("logprob", &self.0.get(0))?;
                out.serialize_entry("top_logprobs", &[(); 0])?;
                out.end()
            }
        }
        let mut out = serializer.serialize_map(Some(1))?;
        out.serialize_entry(
            "content",
            &self
                .entries
                .iter()
                .map(|e| Entry(e, self.tok))
                .collect::<Vec<_>>(),
        )?;
        out.end()
    }
}

/// The client's JSON body (see [`ClientView`]).
fn client_json(tok: &dyn ChatTokenizer, body: &Value) -> Result<Vec<u8>> {
    serde_json::to_vec(&ClientView { body, tok }).map_err(|e| Error::Codec {
        field: "response".into(),
        reason: e.to_string(),
    })
}

async fn chat_completions(
    State(state): AppStateRef,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let started = Instant::now();
    let result = chat_turn(&state, &id, request).await;
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
    if session.busy.swap(true, Ordering::AcqRel) {
        return Err(Error::SessionBusy {
            session_id: id.to_owned(),
        });
    }
    let _busy = BusyGuard(&session);

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
    let params = sampling_params(state, &chat.request, prompt_len)?;
    let mut generate = GenerateRequest::new(prepared.prompt_ids.clone(), params);
    generate.routing_key = Some(id.to_owned());
    generate.request_id = Some(RequestId::new(uuid::Uuid::new_v4().simple().to_string()));
    generate.return_routed_experts = state.config.return_routed_experts;
    let engine_started = Instant::now();
    let output =
        match tokio::time::timeout(state.config.engine_timeout, state.engine.generate(generate))
            .await
        {
            Ok(result) => result?,
            Err(_) => {
                return Err(Error::Timeout {
                    url: "engine generate".into(),
                    seconds: state.config.engine_timeout.as_secs_f64(),
                });
            }
        };
    let engine_time = engine_started.elapsed();
    state.metrics.engine_latency.observe(engine_time);
    let (mut body, assistant) = completion_body(
        state,
        &chat.request,
        prompt_len,
        &output,
        &tools,
        &chat.kwargs,
    )?;
    // SGLang reports the engine's time; Miles' per-turn lifecycle starts the turn there.
    body["choices"][0]["meta_info"]["e2e_latency"] = json!(engine_time.as_secs_f64());
    let record_body = chat.record_body;
    let client_bytes = client_json(state.tokenizer.as_ref(), &body)?;

    // Phase 3 (session lock): commit unless the session changed or is closing.
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
        } else {
            let record = SessionRecord {
                timestamp: now_secs(),
                request_timestamp: Some(request_timestamp),
                method: "POST".into(),
                path: "/v1/chat/completions".into(),
                request: record_body,
                input_ids: Some(prepared.prompt_ids.clone()),
                response: body,
                status_code: 200,
            };
            trajectory.commit(
                &prepared,
                &chat.request.messages,
                &output.output_ids,
                assistant,
                record,
                state.tokenizer.max_trim_tokens(),
            )?;
            state.metrics.turns.fetch_add(1, Ordering::Relaxed);
        }
    }
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_len as u64, Ordering::Relaxed);
    state
        .metrics
        .completion_tokens
        .fetch_add(output.output_ids.len() as u64, Ordering::Relaxed);
    let response = if chat.stream {
        let body: Value = serde_json::from_slice(&client_bytes).map_err(|e| Error::Codec {
            field: "response".into(),
            reason: e.to_string(),
        })?;
        sse_response(&body)
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            client_bytes,
        )
            .into_response()
    };
    Ok((response, engine_time))
}

#[derive(Debug, Default, Deserialize)]
struct SamplesRequest {
    #[serde(default)]
    max_seq_len: Option<usize>,
    /// `true`: one sample per turn (Miles' `--generate-multi-samples`), not merged.
    #[serde(default)]
    generate_multi_samples: bool,
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
        let payload = {
            let trajectory = session.trajectory.lock().await;
            assemble(
                &state,
                &trajectory,
                params.max_seq_len,
                params.generate_multi_samples,
            )?
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
            let bytes = encode_samples(&payload)?;
            Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
        }
    }
    .await;
    respond(&state, result)
}
