//! What both session servers share (the linear one of [`crate::server`] and the tree one of
//! `tree_server`): the settings, the registry of sessions and its idle sweep, request parsing,
//! the engine call of a turn and the client's view of a completion.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use miles_core::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, Message, RequestId,
    SamplingParams, TokenId, ToolArguments, ToolSpec,
};
use miles_tito::{ChatTokenizer, MessageMatcher, Mismatch};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::Mutex;

use crate::error::{Error, Result};
use crate::guard::GuardConfig;
use crate::metrics::ServerMetrics;
use crate::openai;
use crate::openai::{ChatCompletionRequest, RequestLimits, sse_response};
use crate::trajectory::LinearTrajectory;
use crate::tree::{MAX_TREE_NODES, SessionVersion, TreeTrajectory};
use crate::tree_samples::SampleHooks;

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
    /// applied by `SessionServer::router`; its body limit is replaced by
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
    /// rollback detection and the append-only check (v1) or the attach-point search (v2).
    /// Default: strict.
    pub message_matcher: MessageMatcher,
    /// Which session server (Miles' `--use-session-server`): [`SessionVersion::V1`], the
    /// linear server (default), or [`SessionVersion::V2`], tree sessions ([`crate::tree`]).
    pub session_version: SessionVersion,
    /// v2: most nodes (generations, all branches) per session (Miles' `MAX_NODES`, 1024);
    /// past it a turn is refused with 400 `session_limit`.
    pub max_tree_nodes: usize,
    /// v2: the samples op's pick and post-process hooks (Miles'
    /// `--session-sample-picker-path` / `--session-sample-postprocessor-path`; default
    /// `drop_retries` and `default_postprocess`).
    pub sample_hooks: SampleHooks,
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
            session_version: SessionVersion::V1,
            max_tree_nodes: MAX_TREE_NODES,
            sample_hooks: SampleHooks::default(),
        }
    }
}

/// One open session: its trajectory behind an async lock (the linear one for v1, the tree
/// for v2; the other stays empty), the closing flag, the number of turns in progress and the
/// time of its last request.
#[derive(Debug, Default)]
pub(crate) struct Session {
    pub(crate) trajectory: Mutex<LinearTrajectory>,
    pub(crate) tree: Mutex<TreeTrajectory>,
    pub(crate) closing: AtomicBool,
    pub(crate) turns_in_flight: AtomicUsize,
    /// Milliseconds since the server's epoch.
    pub(crate) last_used_ms: AtomicU64,
}

/// Counts a turn in progress until dropped (also when the request is cancelled).
pub(crate) struct BusyGuard<'a>(&'a Session);

impl<'a> BusyGuard<'a> {
    /// The only turn in progress (v1: `None` when another one is).
    pub(crate) fn exclusive(session: &'a Session) -> Option<Self> {
        session
            .turns_in_flight
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| Self(session))
    }

    /// One more turn in progress (v2: concurrent turns become siblings).
    pub(crate) fn shared(session: &'a Session) -> Self {
        session.turns_in_flight.fetch_add(1, Ordering::AcqRel);
        Self(session)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.turns_in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Shared state behind the router.
pub(crate) struct AppState {
    pub(crate) engine: Arc<dyn InferenceEngine>,
    pub(crate) tokenizer: Arc<dyn ChatTokenizer>,
    pub(crate) config: SessionServerConfig,
    pub(crate) sessions: RwLock<HashMap<String, Arc<Session>>>,
    pub(crate) metrics: ServerMetrics,
    /// The server's clock origin (session idle times are measured from it).
    pub(crate) epoch: Instant,
    /// When the next idle sweep is due, in milliseconds since `epoch`.
    pub(crate) next_sweep_ms: AtomicU64,
}

impl AppState {
    pub(crate) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Closes the sessions idle for longer than the timeout (no request since, no turn in
    /// progress). Runs at most every quarter of the timeout, on any request and from the
    /// background sweeper.
    pub(crate) fn sweep_idle(&self) {
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
            s.turns_in_flight.load(Ordering::Acquire) == 0
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
                    && s.tree.try_lock().is_ok()
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

pub(crate) type AppStateRef = State<Arc<AppState>>;

pub(crate) fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub(crate) fn error_response(state: &AppState, error: Error) -> Response {
    state.metrics.error(error.label());
    tracing::debug!(label = error.label(), %error, "request failed");
    crate::guard::rejection(&error)
}

pub(crate) fn respond(state: &AppState, result: Result<Response>) -> Response {
    result.unwrap_or_else(|e| error_response(state, e))
}

pub(crate) fn lookup(state: &AppState, id: &str) -> Result<Arc<Session>> {
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

/// The effective template kwargs of a request body: the server's
/// [`SessionServerConfig::chat_template_kwargs`], the request's `chat_template_kwargs` (an
/// object) merged over them, then the family's forced ones.
pub(crate) fn request_kwargs(
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

pub(crate) async fn read_body(state: &AppState, request: Request) -> Result<(HeaderMap, Bytes)> {
    let (parts, body) = request.into_parts();
    let limit = state.config.max_body_bytes;
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| Error::BodyTooLarge { limit })?;
    Ok((parts.headers, bytes))
}

/// A validated chat request: the typed fields, the body to record, the kwargs to render with.
pub(crate) struct PreparedChat {
    pub(crate) request: ChatCompletionRequest,
    pub(crate) record_body: Value,
    pub(crate) kwargs: Map<String, Value>,
    pub(crate) stream: bool,
}

/// A render error the request caused (the template raised, or cannot render these messages:
/// a content shape or role it does not handle) is the client's 400, as in SGLang; other
/// tokenization failures (template limits, tokenizer errors) stay 500.
pub(crate) fn template_rejection(error: Error) -> Error {
    match error {
        Error::Tokenization { reason } if is_template_rejection(&reason) => {
            Error::TemplateRejected { reason }
        }
        other => other,
    }
}

/// Whether a tokenization reason is miles-tito's render error, `raise_exception` or invalid
/// render input (recognised by the prefixes of their own messages).
pub(crate) fn is_template_rejection(reason: &str) -> bool {
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

pub(crate) fn prepare_chat(state: &AppState, bytes: &[u8]) -> Result<PreparedChat> {
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

pub(crate) fn sampling_params(
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
pub(crate) fn completion_body(
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
pub(crate) const CLIENT_HIDDEN_META: [&str; 3] = [
    "routed_experts",
    "routed_experts_num_layers",
    "indexer_topk",
];

/// The response the client sees, serialised straight from the recorded body (no copy of it):
/// OpenAI `logprobs.content` added to every choice (derived from
/// `meta_info.output_token_logprobs`, so records do not store it twice), routed experts /
/// indexer data removed from every choice's `meta_info`.
pub(crate) struct ClientView<'a> {
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

pub(crate) struct ClientChoice<'a> {
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

pub(crate) struct FilteredMeta<'a>(&'a Map<String, Value>);

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
pub(crate) struct LogprobsContent<'a> {
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
pub(crate) fn client_json(tok: &dyn ChatTokenizer, body: &Value) -> Result<Vec<u8>> {
    serde_json::to_vec(&ClientView { body, tok }).map_err(|e| Error::Codec {
        field: "response".into(),
        reason: e.to_string(),
    })
}

/// The `tito_session_mismatch` of one path: `messages` rendered (tools and kwargs of its last
/// request) and compared with `token_ids`; `None` for an empty path or a failed render.
/// `count` adds the result to the mismatch metrics.
pub(crate) fn path_mismatches(
    state: &AppState,
    messages: &[Message],
    last_request: &Value,
    token_ids: &[TokenId],
    count: bool,
) -> Option<Vec<Mismatch>> {
    if token_ids.is_empty() {
        return None;
    }
    let kwargs = request_kwargs(
        state.tokenizer.as_ref(),
        &state.config.chat_template_kwargs,
        last_request,
    )
    .ok()?;
    let tools: Vec<ToolSpec> = last_request
        .get("tools")
        .and_then(|t| serde_json::from_value(t.clone()).ok())
        .unwrap_or_default();
    match state.tokenizer.render(messages, &tools, false, &kwargs) {
        Ok(expected) => {
            let found = state.tokenizer.compare_sequences(&expected, token_ids);
            if count {
                let kinds: Vec<_> = found.iter().map(|m| m.kind).collect();
                state.metrics.mismatch_check(&kinds);
            }
            Some(found)
        }
        Err(error) => {
            tracing::warn!(%error, "mismatch metric: rendering the session failed");
            None
        }
    }
}

/// Phase 2 of a turn, done: what the engine produced and the bodies made of it.
pub(crate) struct EngineTurn {
    /// The engine's output.
    pub(crate) output: GenerateOutput,
    /// The recorded completion body (with `meta_info`).
    pub(crate) body: Value,
    /// The parsed assistant message.
    pub(crate) assistant: Message,
    /// The client's JSON bytes.
    pub(crate) client_bytes: Vec<u8>,
    /// The engine call's duration.
    pub(crate) engine_time: Duration,
}

/// Phase 2 of a turn (no session lock held): the engine call for `prompt_ids`, under the
/// engine timeout, and the completion bodies.
pub(crate) async fn run_engine(
    state: &AppState,
    id: &str,
    chat: &PreparedChat,
    prompt_ids: &[TokenId],
    tools: &[ToolSpec],
) -> Result<EngineTurn> {
    let prompt_len = prompt_ids.len();
    let params = sampling_params(state, &chat.request, prompt_len)?;
    let mut generate = GenerateRequest::new(prompt_ids.to_vec(), params);
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
        tools,
        &chat.kwargs,
    )?;
    // SGLang reports the engine's time; Miles' per-turn lifecycle starts the turn there.
    body["choices"][0]["meta_info"]["e2e_latency"] = json!(engine_time.as_secs_f64());
    let client_bytes = client_json(state.tokenizer.as_ref(), &body)?;
    Ok(EngineTurn {
        output,
        body,
        assistant,
        client_bytes,
        engine_time,
    })
}

/// Counts a recorded turn's tokens and builds the client's response (JSON, or one SSE chunk
/// and `[DONE]` when the request streamed).
pub(crate) fn client_response(
    state: &AppState,
    stream: bool,
    prompt_len: usize,
    turn: &EngineTurn,
) -> Result<Response> {
    state
        .metrics
        .prompt_tokens
        .fetch_add(prompt_len as u64, Ordering::Relaxed);
    state
        .metrics
        .completion_tokens
        .fetch_add(turn.output.output_ids.len() as u64, Ordering::Relaxed);
    if stream {
        let body: Value = serde_json::from_slice(&turn.client_bytes).map_err(|e| Error::Codec {
            field: "response".into(),
            reason: e.to_string(),
        })?;
        Ok(sse_response(&body))
    } else {
        Ok((
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            turn.client_bytes.clone(),
        )
            .into_response())
    }
}
