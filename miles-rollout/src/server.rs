//! SGLang's HTTP protocol served over any [`InferenceEngine`] (MILES_SPEC §7): the routes the
//! SGLang client of miles-session, Miles' rollout code and OpenAI-style agents call, so an
//! embedded engine (or a [`crate::Router`] over a fleet) answers exactly as an SGLang server
//! would.
//!
//! Routes (see [`sglang_router`]): `/generate`, `/v1/chat/completions`, `/v1/models`, `/health`,
//! `/health_generate`, `/model_info` (and the older `/get_model_info`), `/get_server_info`
//! (`/server_info`), `/flush_cache`, `/pause_generation`, `/continue_generation`,
//! `/abort_request`, `/update_weights_from_disk`, `/get_weight_version`.
//!
//! Bad input is answered with a 4xx status and an OpenAI-shaped JSON body
//! `{"error": {"message", "type", "code"}}`; nothing a client sends can panic the server.
//! A request whose client disconnects is aborted in the engine, as SGLang does.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router as HttpRouter;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, PauseMode,
    RequestId, SamplingParams, TokenId, ToolArguments, WeightVersion,
};
use miles_session::chat::ChatTokenizer;
use miles_session::openai::{ChatCompletionRequest, RequestLimits};
use miles_session::server::ROUTING_KEY_HEADER;
use serde_json::{Map, Value, json};
use tokio::task::JoinSet;

use crate::error::{Error, Result};

/// SGLang's default `max_new_tokens` for `/generate` when the request sets none.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// What the server reports about the model it serves, and the tokenizer it uses for text
/// prompts and chat.
#[derive(Clone)]
pub struct ServerInfo {
    /// The checkpoint directory (`model_path` in `/model_info`).
    pub model_path: String,
    /// The tokenizer directory, when one is loaded.
    pub tokenizer_path: Option<String>,
    /// The `model` reported by the OpenAI routes when a request names none.
    pub served_model_name: String,
    /// HF `model_type` (`qwen3`, `glm4_moe`, …).
    pub model_type: Option<String>,
    /// HF `architectures`.
    pub architectures: Vec<String>,
    /// Vocabulary size: prompt ids at or above it are rejected with 400.
    pub vocab_size: Option<usize>,
    /// Context length: prompt + `max_new_tokens` beyond it is rejected with 400.
    pub context_length: Option<usize>,
    /// Chat template + tokenizer (miles-tito through miles-session's adapter); `None` serves
    /// token ids only (`text` prompts and chat are then rejected with 400).
    pub tokenizer: Option<Arc<dyn ChatTokenizer>>,
    /// `max_new_tokens` of `/generate` requests that set none.
    pub default_max_new_tokens: usize,
    /// Largest accepted request body, in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// Bounds on `n`, stop strings and stop ids (the session server's type:
    /// `--max-n`, …), checked on the parsed request before anything is allocated.
    pub limits: RequestLimits,
    /// Largest number of sequences one `/generate` request may expand to (prompts × `n`).
    pub max_sequences: usize,
    /// The only directory tree `/update_weights_from_disk` may read from (canonicalised; a
    /// path outside it, through `..` or a symlink, is 403). `None` disables the route (403):
    /// a server reads the file system only where its operator said it may.
    pub weights_root: Option<PathBuf>,
    /// Served at `GET /metrics` in Prometheus' text format when set (`--enable-metrics`;
    /// `EmbeddedEngine::attach_metrics` keeps SGLang's engine metrics in it).
    pub metrics: Option<Arc<miles_core::prometheus::Registry>>,
    /// The dtype the engine computes in, reported as SGLang's `--dtype` by
    /// `/get_server_info` (SGLang clients publish weight updates in it).
    /// (F32, BF16 or F16; `float32` unless the engine was started with `--bf16` / `--fp16`.)
    pub dtype: miles_core::DType,
}

impl std::fmt::Debug for ServerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerInfo")
            .field("model_path", &self.model_path)
            .field("tokenizer_path", &self.tokenizer_path)
            .field("served_model_name", &self.served_model_name)
            .field("model_type", &self.model_type)
            .field("vocab_size", &self.vocab_size)
            .field("context_length", &self.context_length)
            .field("tokenizer", &self.tokenizer.as_ref().map(|t| t.family()))
            .finish()
    }
}

impl ServerInfo {
    /// Info for a model at `model_path` with nothing else known (no tokenizer, no limits).
    pub fn new(model_path: impl Into<String>) -> Self {
        let model_path = model_path.into();
        Self {
            served_model_name: model_path.clone(),
            model_path,
            tokenizer_path: None,
            model_type: None,
            architectures: Vec::new(),
            vocab_size: None,
            context_length: None,
            tokenizer: None,
            default_max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            max_body_bytes: 64 << 20,
            limits: RequestLimits::default(),
            max_sequences: 1024,
            weights_root: None,
            metrics: None,
            dtype: miles_core::DType::F32,
        }
    }

    /// Lets `/update_weights_from_disk` read checkpoints under `root` (and nowhere else).
    pub fn with_weights_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.weights_root = Some(root.into());
        self
    }

    /// Reads `dir/config.json` (HF layout) for `model_type`, `architectures`, `vocab_size`
    /// and `max_position_embeddings`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let mut info = Self::new(dir.to_string_lossy());
        info.model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_owned);
        info.architectures = config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        info.vocab_size = config
            .get("vocab_size")
            .and_then(Value::as_u64)
            .map(|v| v as usize);
        info.context_length = config
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|v| v as usize);
        Ok(info)
    }

    /// Serves text prompts and chat with `tokenizer`, loaded from `path`.
    pub fn with_tokenizer(
        mut self,
        tokenizer: Arc<dyn ChatTokenizer>,
        path: impl Into<String>,
    ) -> Self {
        self.tokenizer = Some(tokenizer);
        self.tokenizer_path = Some(path.into());
        self
    }
}

/// The miles-tito family (Miles' `--tito-model`) whose template and parsers fit an HF
/// `model_type`: Qwen3 dense / MoE → `qwen3`, GLM-4.5/4.7 MoE → `glm47`, otherwise `default`
/// (the checkpoint's own template, no reasoning / tool-call parsing).
pub fn tito_family_for(model_type: Option<&str>) -> &'static str {
    match model_type {
        Some("qwen3" | "qwen3_moe") => "qwen3",
        Some("qwen3_next") => "qwennext",
        Some("glm4_moe" | "glm4_moe_lite") => "glm47",
        _ => "default",
    }
}

/// Loads the chat tokenizer of `dir` (a `tokenizer.json` next to `tokenizer_config.json` or
/// `chat_template.jinja`) as miles-tito family `family`. `Ok(None)` when `dir` has no
/// `tokenizer.json` (the server then speaks token ids only).
pub fn load_chat_tokenizer(dir: &Path, family: &str) -> Result<Option<Arc<dyn ChatTokenizer>>> {
    if !dir.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    let chat = miles_session::TitoChat::load(dir, family)
        .map_err(|e| Error::Config(format!("tokenizer in {}: {e}", dir.display())))?;
    Ok(Some(Arc::new(chat)))
}

struct AppState {
    engine: Arc<dyn InferenceEngine>,
    info: ServerInfo,
    next_id: AtomicU64,
    started: u64,
}

impl AppState {
    fn fresh_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}{:x}{:08x}",
            self.started,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

type AppStateRef = State<Arc<AppState>>;

/// Builds the SGLang-protocol HTTP routes over `engine`. Serve it with `axum::serve`.
///
/// ```
/// use std::sync::Arc;
/// use miles_rollout::server::{ServerInfo, sglang_router};
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
        .route("/get_weight_version", get(get_weight_version))
        .route("/weight_version", get(get_weight_version))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::disable())
        .with_state(state);
    // `GET /metrics` only with `--enable-metrics`; otherwise the JSON 404 of the fallback,
    // as SGLang answers without `--enable-metrics`.
    match metrics {
        Some(registry) => router.merge(miles_session::metrics_server::router(registry)),
        None => router,
    }
}

/// An HTTP error: status and message, answered as `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn from_engine(error: miles_core::Error) -> Self {
        let status = match &error {
            miles_core::Error::Engine { kind, .. } => match kind {
                EngineErrorKind::InvalidRequest | EngineErrorKind::WeightUpdate => {
                    StatusCode::BAD_REQUEST
                }
                EngineErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            miles_core::Error::Io { .. } | miles_core::Error::Parse { .. } => {
                StatusCode::BAD_REQUEST
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        Self {
            status,
            message: error.to_string(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            400..=499 => "BadRequestError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        let body =
            json!({"error": {"message": self.message, "type": kind, "code": self.status.as_u16()}});
        (self.status, axum::Json(body)).into_response()
    }
}

type ApiResult<T> = std::result::Result<T, ApiError>;

fn json_response(result: ApiResult<Value>) -> Response {
    match result {
        Ok(value) => axum::Json(value).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn read_json(state: &AppState, request: Request, allow_empty: bool) -> ApiResult<Value> {
    let limit = state.info.max_body_bytes;
    let bytes: Bytes = axum::body::to_bytes(request.into_body(), limit)
        .await
        .map_err(|_| ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body over {limit} bytes"),
        })?;
    if allow_empty && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Value::Object(Map::new()));
    }
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    Ok(value)
}

async fn not_found(request: Request) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {} {}", request.method(), request.uri().path()),
    }
    .into_response()
}

async fn method_not_allowed(request: Request) -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    }
    .into_response()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// /generate

/// Aborts a request in the engine when its future is dropped before it finished (the client
/// went away), as SGLang does on disconnect.
struct AbortOnDrop {
    engine: Arc<dyn InferenceEngine>,
    request_id: RequestId,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            let id = self.request_id.clone();
            handle.spawn(async move {
                if let Err(error) = engine.abort(&id).await {
                    tracing::debug!(%error, request = %id, "abort after disconnect failed");
                }
            });
        }
    }
}

/// Per-request output options of `/generate`.
#[derive(Debug, Clone, Copy, Default)]
struct OutputOptions {
    return_logprob: bool,
    return_text_in_logprobs: bool,
}

fn bool_field(body: &Value, key: &str) -> ApiResult<bool> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad_request(format!(
            "{key} must be a boolean, got {other}"
        ))),
    }
}

fn token_ids(value: &Value, what: &str) -> ApiResult<Vec<TokenId>> {
    let Value::Array(items) = value else {
        return Err(ApiError::bad_request(format!(
            "{what} must be a list of ints"
        )));
    };
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| TokenId::try_from(x).ok())
                .ok_or_else(|| ApiError::bad_request(format!("{what} holds {v}, not a token id")))
        })
        .collect()
}

/// The prompts of a `/generate` body and whether it was a batch.
fn parse_prompts(state: &AppState, body: &Value) -> ApiResult<(Vec<Vec<TokenId>>, bool)> {
    let input_ids = body.get("input_ids").filter(|v| !v.is_null());
    let text = body.get("text").filter(|v| !v.is_null());
    let (prompts, batched) = match (input_ids, text) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "either text or input_ids should be provided, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "either text or input_ids should be provided",
            ));
        }
        (Some(ids), None) => match ids {
            Value::Array(items) if items.first().is_some_and(Value::is_array) => (
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| token_ids(v, &format!("input_ids[{i}]")))
                    .collect::<ApiResult<Vec<_>>>()?,
                true,
            ),
            other => (vec![token_ids(other, "input_ids")?], false),
        },
        (None, Some(text)) => {
            let tokenizer = state.info.tokenizer.as_ref().ok_or_else(|| {
                ApiError::bad_request(
                    "this server has no tokenizer: send input_ids (start it with a tokenizer for text)",
                )
            })?;
            let encode = |t: &str| {
                tokenizer
                    .encode(t)
                    .map_err(|e| ApiError::bad_request(format!("cannot tokenize text: {e}")))
            };
            match text {
                Value::String(s) => (vec![encode(s)?], false),
                Value::Array(items) => (
                    items
                        .iter()
                        .map(|v| {
                            v.as_str()
                                .ok_or_else(|| {
                                    ApiError::bad_request("text must be a string or strings")
                                })
                                .and_then(encode)
                        })
                        .collect::<ApiResult<Vec<_>>>()?,
                    true,
                ),
                _ => return Err(ApiError::bad_request("text must be a string or strings")),
            }
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_request("empty batch"));
    }
    for (i, prompt) in prompts.iter().enumerate() {
        check_prompt(&state.info, prompt).map_err(|e| {
            if batched {
                ApiError::bad_request(format!("prompt {i}: {}", e.message))
            } else {
                e
            }
        })?;
    }
    Ok((prompts, batched))
}

fn check_prompt(info: &ServerInfo, prompt: &[TokenId]) -> ApiResult<()> {
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    if let Some(vocab) = info.vocab_size
        && let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab)
    {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is out of the vocabulary (size {vocab})"
        )));
    }
    if let Some(limit) = info.context_length
        && prompt.len() >= limit
    {
        return Err(ApiError::bad_request(format!(
            "the input ({} tokens) is longer than the model's context length ({limit} tokens)",
            prompt.len()
        )));
    }
    Ok(())
}

/// Checks sampling parameters as SGLang's `SamplingParams.verify` does.
fn verify_sampling(params: &SamplingParams) -> ApiResult<()> {
    let bad = |m: String| Err(ApiError::bad_request(m));
    if !params.temperature.is_finite() || params.temperature < 0.0 {
        return bad(format!(
            "temperature must be non-negative, got {}",
            params.temperature
        ));
    }
    if !(params.top_p.is_finite() && params.top_p > 0.0 && params.top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}", params.top_p));
    }
    if params.top_k < 1 && params.top_k != -1 {
        return bad(format!(
            "top_k must be -1 (disable), or at least 1, got {}",
            params.top_k
        ));
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        return bad(format!("min_p must be in [0, 1], got {}", params.min_p));
    }
    if !(-2.0..=2.0).contains(&params.frequency_penalty) {
        return bad(format!(
            "frequency_penalty must be in [-2, 2], got {}",
            params.frequency_penalty
        ));
    }
    if !(-2.0..=2.0).contains(&params.presence_penalty) {
        return bad(format!(
            "presence_penalty must be in [-2, 2], got {}",
            params.presence_penalty
        ));
    }
    if params.n == 0 {
        return bad("n must be at least 1".into());
    }
    if let Some(max) = params.max_new_tokens
        && params.min_new_tokens > max
    {
        return bad(format!(
            "min_new_tokens must be in [0, max_new_tokens], got {}",
            params.min_new_tokens
        ));
    }
    Ok(())
}

/// Checks a request's sampling parameters against the server's [`RequestLimits`] and
/// sequence bound; `prompts` is the number of prompts the request carries.
fn check_limits(info: &ServerInfo, params: &SamplingParams, prompts: usize) -> ApiResult<()> {
    let limits = &info.limits;
    let bad = |m: String| Err(ApiError::bad_request(m));
    if params.n > limits.max_n {
        return bad(format!(
            "n = {} is over this server's limit of {} (--max-n)",
            params.n, limits.max_n
        ));
    }
    match prompts.checked_mul(params.n.max(1)) {
        Some(total) if total <= info.max_sequences => {}
        _ => {
            return bad(format!(
                "{prompts} prompts × n = {} is over this server's limit of {} sequences a request",
                params.n, info.max_sequences
            ));
        }
    }
    if params.stop.len() > limits.max_stop_strings {
        return bad(format!(
            "{} stop strings; at most {} are accepted",
            params.stop.len(),
            limits.max_stop_strings
        ));
    }
    if let Some(long) = params.stop.iter().find(|s| s.len() > limits.max_stop_len) {
        return bad(format!(
            "a stop string of {} bytes is over the limit of {} bytes",
            long.len(),
            limits.max_stop_len
        ));
    }
    if params.stop_token_ids.len() > limits.max_stop_token_ids {
        return bad(format!(
            "{} stop_token_ids; at most {} are accepted",
            params.stop_token_ids.len(),
            limits.max_stop_token_ids
        ));
    }
    Ok(())
}

fn parse_sampling(value: Option<&Value>) -> ApiResult<SamplingParams> {
    match value {
        None | Some(Value::Null) => Ok(SamplingParams::default()),
        Some(v @ Value::Object(_)) => serde_json::from_value(v.clone())
            .map_err(|e| ApiError::bad_request(format!("invalid sampling_params: {e}"))),
        Some(other) => Err(ApiError::bad_request(format!(
            "sampling_params must be an object, got {other}"
        ))),
    }
}

/// `max_new_tokens` of one prompt: the request's (SGLang's default when unset), checked
/// against the context length.
fn resolve_max_new(
    info: &ServerInfo,
    requested: Option<usize>,
    prompt_len: usize,
    default: usize,
) -> ApiResult<usize> {
    let max_new = requested.unwrap_or(default);
    if let Some(limit) = info.context_length
        && prompt_len
            .checked_add(max_new)
            .is_none_or(|total| total > limit)
    {
        return Err(ApiError::bad_request(format!(
            "requested token count exceeds the model's maximum context length of {limit} tokens: \
             {prompt_len} tokens from the input and {max_new} tokens for the completion"
        )));
    }
    Ok(max_new)
}

fn finish_reason_json(output: &GenerateOutput) -> Value {
    match output.finish_reason {
        FinishReason::Stop => json!({
            "type": "stop",
            "matched": output.matched_stop.clone().unwrap_or(Value::Null),
        }),
        FinishReason::Length => json!({"type": "length", "length": output.output_ids.len()}),
        FinishReason::Abort => json!({"type": "abort", "message": "Abort before completion"}),
    }
}

/// `meta_info` of a `/generate` answer (MILES_SPEC §7.2).
fn meta_info(
    state: &AppState,
    rid: &str,
    output: &GenerateOutput,
    options: OutputOptions,
    latency: f64,
) -> ApiResult<Value> {
    let mut meta = json!({
        "id": rid,
        "finish_reason": finish_reason_json(output),
        "prompt_tokens": output.prompt_tokens,
        "weight_version": output.weight_version.to_string(),
        "completion_tokens": output.output_ids.len(),
        "cached_tokens": output.cached_tokens,
        "e2e_latency": latency,
    });
    if options.return_logprob {
        if output.output_log_probs.len() != output.output_ids.len() {
            return Err(ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!(
                    "the engine returned {} log-probs for {} tokens",
                    output.output_log_probs.len(),
                    output.output_ids.len()
                ),
            });
        }
        let tokenizer = state
            .info
            .tokenizer
            .as_ref()
            .filter(|_| options.return_text_in_logprobs);
        let entries: Vec<Value> = output
            .output_ids
            .iter()
            .zip(&output.output_log_probs)
            .map(|(&id, &lp)| {
                let text = tokenizer.map_or(Value::Null, |t| json!(&*t.decode_token(id)));
                json!([lp, id, text])
            })
            .collect();
        meta["output_token_logprobs"] = Value::Array(entries);
    }
    if let Some(routed) = &output.routed_experts {
        meta["routed_experts"] = json!(routed.to_base64());
    }
    Ok(meta)
}

/// Runs one request on the engine; a client disconnect aborts it. An engine-side abort is an
/// answer with finish reason `abort` (as SGLang answers an aborted request), not an error.
async fn run_request(
    engine: Arc<dyn InferenceEngine>,
    request: GenerateRequest,
) -> ApiResult<GenerateOutput> {
    let request_id = request
        .request_id
        .clone()
        .unwrap_or_else(|| RequestId::new(""));
    let prompt_tokens = request.input_ids.len();
    let mut guard = AbortOnDrop {
        engine: engine.clone(),
        request_id,
        armed: true,
    };
    let result = engine.generate(request.clone()).await;
    guard.armed = false;
    match result {
        Ok(output) => Ok(output),
        Err(miles_core::Error::Engine {
            kind: EngineErrorKind::Aborted,
            message,
        }) => {
            tracing::debug!(%message, "request aborted in the engine");
            let weight_version = engine.weight_version().await.unwrap_or_default();
            Ok(GenerateOutput {
                request_id: request.request_id,
                output_ids: Vec::new(),
                output_log_probs: Vec::new(),
                routed_experts: None,
                finish_reason: FinishReason::Abort,
                matched_stop: None,
                weight_version,
                prompt_tokens,
                cached_tokens: 0,
            })
        }
        Err(error) => Err(ApiError::from_engine(error)),
    }
}

/// Runs requests concurrently, answers in order; the first failure fails the call (the other
/// requests are dropped, and so aborted).
async fn run_all(
    engine: &Arc<dyn InferenceEngine>,
    requests: Vec<GenerateRequest>,
) -> ApiResult<Vec<GenerateOutput>> {
    if requests.len() == 1 {
        let request = requests.into_iter().next().expect("one request");
        return Ok(vec![run_request(engine.clone(), request).await?]);
    }
    let mut tasks = JoinSet::new();
    let count = requests.len();
    for (index, request) in requests.into_iter().enumerate() {
        let engine = engine.clone();
        tasks.spawn(async move { (index, run_request(engine, request).await) });
    }
    let mut outputs: Vec<Option<GenerateOutput>> = (0..count).map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        let (index, result) = joined.map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("generation task failed: {e}"),
        })?;
        outputs[index] = Some(result?);
    }
    Ok(outputs.into_iter().flatten().collect())
}

/// Expands `n > 1` into `n` single-sample requests (SGLang answers them as a list); with a
/// seed, sample `i` uses `seed + i` so the samples differ but stay reproducible.
fn expand_n(request: GenerateRequest) -> Vec<GenerateRequest> {
    let n = request.sampling_params.n.max(1);
    if n == 1 {
        return vec![request];
    }
    (0..n)
        .map(|i| {
            let mut one = request.clone();
            one.sampling_params.n = 1;
            one.sampling_params.sampling_seed = request
                .sampling_params
                .sampling_seed
                .map(|s| s.wrapping_add(i as u64));
            one.request_id = request
                .request_id
                .as_ref()
                .map(|id| RequestId::new(format!("{id}-{i}")));
            one
        })
        .collect()
}

fn routing_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get(ROUTING_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn generate(State(state): AppStateRef, request: Request) -> Response {
    let headers = request.headers().clone();
    let result = async {
        let body = read_json(&state, request, false).await?;
        generate_inner(&state, &headers, &body).await
    }
    .await;
    json_response(result)
}

async fn generate_inner(state: &AppState, headers: &HeaderMap, body: &Value) -> ApiResult<Value> {
    if bool_field(body, "stream")? {
        return Err(ApiError::bad_request(
            "stream is not supported by this server; send stream: false",
        ));
    }
    let mut params = parse_sampling(body.get("sampling_params"))?;
    verify_sampling(&params)?;
    let prompt_count = match body.get("input_ids").or_else(|| body.get("text")) {
        Some(Value::Array(items))
            if items.first().is_some_and(|v| v.is_array() || v.is_string()) =>
        {
            items.len()
        }
        _ => 1,
    };
    check_limits(&state.info, &params, prompt_count)?;
    let (prompts, batched) = parse_prompts(state, body)?;
    let options = OutputOptions {
        return_logprob: bool_field(body, "return_logprob")?,
        return_text_in_logprobs: bool_field(body, "return_text_in_logprobs")?,
    };
    let return_routed_experts = bool_field(body, "return_routed_experts")?;
    let routed_experts_start_len = match body.get("routed_experts_start_len") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            ApiError::bad_request("routed_experts_start_len must be a non-negative int")
        })? as usize),
    };
    let rids: Vec<Option<String>> = match body.get("rid") {
        None | Some(Value::Null) => vec![None; prompts.len()],
        Some(Value::String(s)) if !batched => vec![Some(s.clone())],
        Some(Value::Array(ids)) if batched && ids.len() == prompts.len() => ids
            .iter()
            .map(|v| {
                v.as_str()
                    .map(|s| Some(s.to_owned()))
                    .ok_or_else(|| ApiError::bad_request("rid must be a string"))
            })
            .collect::<ApiResult<_>>()?,
        Some(_) => {
            return Err(ApiError::bad_request(
                "rid must be a string (a list of one per prompt for a batch)",
            ));
        }
    };
    let routing_key = routing_key(headers);
    let requested_max = params.max_new_tokens;
    params.max_new_tokens = None;
    let mut requests = Vec::new();
    for (prompt, rid) in prompts.into_iter().zip(rids) {
        let mut one_params = params.clone();
        one_params.max_new_tokens = Some(resolve_max_new(
            &state.info,
            requested_max,
            prompt.len(),
            state.info.default_max_new_tokens,
        )?);
        let mut request = GenerateRequest::new(prompt, one_params);
        request.request_id = Some(RequestId::new(rid.unwrap_or_else(|| state.fresh_id(""))));
        request.routing_key = routing_key.clone();
        request.return_logprob = options.return_logprob;
        request.return_routed_experts = return_routed_experts;
        request.routed_experts_start_len = routed_experts_start_len;
        requests.extend(expand_n(request));
    }
    let ids: Vec<String> = requests
        .iter()
        .map(|r| {
            r.request_id
                .as_ref()
                .map(|id| id.0.clone())
                .unwrap_or_default()
        })
        .collect();
    let started = Instant::now();
    let outputs = run_all(&state.engine, requests).await?;
    let latency = started.elapsed().as_secs_f64();
    let mut answers = Vec::with_capacity(outputs.len());
    for (output, rid) in outputs.iter().zip(&ids) {
        let mut answer = Map::new();
        if let Some(tokenizer) = &state.info.tokenizer {
            answer.insert("text".into(), json!(tokenizer.decode(&output.output_ids)));
        }
        answer.insert("output_ids".into(), json!(output.output_ids));
        answer.insert(
            "meta_info".into(),
            meta_info(state, rid, output, options, latency)?,
        );
        answers.push(Value::Object(answer));
    }
    if !batched && answers.len() == 1 {
        Ok(answers.pop().expect("one answer"))
    } else {
        Ok(Value::Array(answers))
    }
}

// ---------------------------------------------------------------------------------------------
// /v1/chat/completions

async fn chat_completions(State(state): AppStateRef, request: Request) -> Response {
    let headers = request.headers().clone();
    let result = async {
        let body = read_json(&state, request, false).await?;
        chat_inner(&state, &headers, body).await
    }
    .await;
    match result {
        Ok((body, true)) => sse_response(&body),
        Ok((body, false)) => axum::Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

async fn chat_inner(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
) -> ApiResult<(Value, bool)> {
    let tokenizer = state.info.tokenizer.clone().ok_or_else(|| {
        ApiError::bad_request("this server has no tokenizer: chat completions need one")
    })?;
    let chat: ChatCompletionRequest = serde_json::from_value(body)
        .map_err(|e| ApiError::bad_request(format!("invalid chat request: {e}")))?;
    if chat.messages.is_empty() && chat.input_ids.is_none() {
        return Err(ApiError::bad_request("messages must not be empty"));
    }
    let tools = chat.tools.clone().unwrap_or_default();
    let kwargs = match &chat.chat_template_kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "chat_template_kwargs must be an object, got {other}"
            )));
        }
    };
    let kwargs = tokenizer
        .resolve_kwargs(&kwargs)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = match &chat.input_ids {
        Some(ids) => ids.clone(),
        None => tokenizer
            .render(&chat.messages, &tools, true, &kwargs)
            .map_err(|e| ApiError::bad_request(format!("cannot render the chat: {e}")))?,
    };
    check_prompt(&state.info, &prompt)?;

    let mut params = chat.sampling_params(tokenizer.stop_token_ids());
    // The stop token stays in the ids (log-probs, meta_info); text trimming is done below.
    let requested = chat.requested_max_tokens();
    let default_max = state
        .info
        .context_length
        .map_or(state.info.default_max_new_tokens, |limit| {
            limit.saturating_sub(prompt.len())
        });
    params.max_new_tokens = Some(resolve_max_new(
        &state.info,
        requested,
        prompt.len(),
        default_max,
    )?);
    verify_sampling(&params)?;
    check_limits(&state.info, &params, 1)?;

    let mut request = GenerateRequest::new(prompt.clone(), params);
    request.request_id = Some(RequestId::new(
        chat.rid.clone().unwrap_or_else(|| state.fresh_id("chat-")),
    ));
    request.routing_key = routing_key(headers);
    request.return_logprob = true;
    request.return_routed_experts = chat.return_routed_experts.unwrap_or(false);
    request.routed_experts_start_len = chat.routed_experts_start_len;
    let requests = expand_n(request);
    let ids: Vec<String> = requests
        .iter()
        .map(|r| {
            r.request_id
                .as_ref()
                .map(|id| id.0.clone())
                .unwrap_or_default()
        })
        .collect();
    let started = Instant::now();
    let outputs = run_all(&state.engine, requests).await?;
    let latency = started.elapsed().as_secs_f64();

    let options = OutputOptions {
        return_logprob: true,
        return_text_in_logprobs: false,
    };
    let mut choices = Vec::with_capacity(outputs.len());
    let mut completion_tokens = 0;
    for (index, (output, rid)) in outputs.iter().zip(&ids).enumerate() {
        completion_tokens += output.output_ids.len();
        let mut parsed = tokenizer
            .parse_assistant(&output.output_ids, &tools)
            .map_err(|e| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("cannot parse the model output: {e}"),
            })?;
        if !chat.no_stop_trim.unwrap_or(false)
            && output.finish_reason == FinishReason::Stop
            && let Some(Value::String(stop)) = &output.matched_stop
            && let Some(stripped) = parsed.content.strip_suffix(stop.as_str())
        {
            parsed.content = stripped.to_owned();
        }
        let separate = chat.separate_reasoning.unwrap_or(true);
        if !separate && let Some(reasoning) = parsed.reasoning_content.take() {
            parsed.content = format!("<think>{reasoning}</think>{}", parsed.content);
        }
        let tool_calls: Vec<Value> = parsed
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let id = call
                    .id
                    .clone()
                    .unwrap_or_else(|| format!("call_{}", state.fresh_id("")));
                let arguments = match &call.function.arguments {
                    ToolArguments::Json(s) => s.clone(),
                    other => other.to_json_string(),
                };
                json!({"id": id, "index": i, "type": "function",
                       "function": {"name": call.function.name, "arguments": arguments}})
            })
            .collect();
        let finish_reason = match output.finish_reason {
            FinishReason::Stop if !tool_calls.is_empty() => "tool_calls",
            other => other.as_str(),
        };
        let message = json!({
            "role": "assistant",
            "content": parsed.content,
            "reasoning_content": parsed.reasoning_content,
            "tool_calls": if tool_calls.is_empty() { Value::Null } else { Value::Array(tool_calls) },
        });
        let logprobs = if chat.logprobs.unwrap_or(false) {
            let content: Vec<Value> = output
                .output_ids
                .iter()
                .zip(&output.output_log_probs)
                .map(|(&id, &lp)| {
                    let token = tokenizer.decode_token(id);
                    json!({"token": &*token, "logprob": lp,
                           "bytes": token.as_bytes(), "top_logprobs": []})
                })
                .collect();
            json!({"content": content})
        } else {
            Value::Null
        };
        let mut choice = json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "matched_stop": output.matched_stop.clone().unwrap_or(Value::Null),
        });
        if chat.return_meta_info.unwrap_or(false) {
            choice["meta_info"] = meta_info(state, rid, output, options, latency)?;
        }
        choices.push(choice);
    }
    let prompt_tokens = prompt.len();
    let body = json!({
        "id": format!("chatcmpl-{}", state.fresh_id("")),
        "object": "chat.completion",
        "created": now_secs(),
        "model": chat.model.clone().unwrap_or_else(|| state.info.served_model_name.clone()),
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    });
    Ok((body, chat.stream.unwrap_or(false)))
}

/// A non-incremental stream: one `chat.completion.chunk` per choice carrying the whole
/// message, then `data: [DONE]`.
fn sse_response(body: &Value) -> Response {
    let mut text = String::new();
    for choice in body["choices"].as_array().into_iter().flatten() {
        let message = &choice["message"];
        let mut delta = json!({"role": "assistant", "content": message["content"]});
        for key in ["reasoning_content", "tool_calls"] {
            if !message[key].is_null() {
                delta[key] = message[key].clone();
            }
        }
        let chunk = json!({
            "id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"],
            "choices": [{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                         "finish_reason": choice["finish_reason"]}],
            "usage": body["usage"],
        });
        text.push_str(&format!("data: {chunk}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    let mut response = Response::new(Body::from(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

async fn list_models(State(state): AppStateRef) -> Response {
    let mut model = json!({
        "id": state.info.served_model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "miles-rs",
        "root": state.info.model_path,
    });
    if let Some(limit) = state.info.context_length {
        model["max_model_len"] = json!(limit);
    }
    axum::Json(json!({"object": "list", "data": [model]})).into_response()
}

// ---------------------------------------------------------------------------------------------
// Control routes

async fn health(State(state): AppStateRef) -> Response {
    match state.engine.health().await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(error) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: error.to_string(),
        }
        .into_response(),
    }
}

/// SGLang's fault-tolerance heartbeat: healthy only if one token can be generated.
async fn health_generate(State(state): AppStateRef) -> Response {
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: Some(1),
        ..SamplingParams::default()
    };
    let mut request = GenerateRequest::new(vec![0], params);
    request.return_logprob = false;
    request.request_id = Some(RequestId::new(state.fresh_id("health-")));
    let checked = async {
        state.engine.health().await?;
        state.engine.generate(request).await
    }
    .await;
    match checked {
        Ok(_) => StatusCode::OK.into_response(),
        Err(error) => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: error.to_string(),
        }
        .into_response(),
    }
}

async fn current_version(state: &AppState) -> ApiResult<WeightVersion> {
    state
        .engine
        .weight_version()
        .await
        .map_err(ApiError::from_engine)
}

async fn model_info(State(state): AppStateRef) -> Response {
    let result = async {
        let version = current_version(&state).await?;
        let info = &state.info;
        Ok(json!({
            "model_path": info.model_path,
            "tokenizer_path": info.tokenizer_path,
            "is_generation": true,
            "preferred_sampling_params": Value::Null,
            "weight_version": version.to_string(),
            "has_image_understanding": false,
            "has_audio_understanding": false,
            "model_type": info.model_type,
            "architectures": info.architectures,
        }))
    }
    .await;
    json_response(result)
}

async fn server_info(State(state): AppStateRef) -> Response {
    let result = async {
        let version = current_version(&state).await?;
        let info = &state.info;
        Ok(json!({
            "model_path": info.model_path,
            "tokenizer_path": info.tokenizer_path,
            "served_model_name": info.served_model_name,
            "context_length": info.context_length,
            "vocab_size": info.vocab_size,
            // SGLang's `--dtype`: the dtype the embedded engine holds and computes its
            // weights in (`--bf16` / `--fp16`, f32 by default); SGLang clients write weight
            // updates in it.
            "dtype": match info.dtype {
                miles_core::DType::BF16 => "bfloat16",
                miles_core::DType::F16 => "float16",
                _ => "float32",
            },
            "skip_tokenizer_init": info.tokenizer.is_none(),
            "chat_family": info.tokenizer.as_ref().map(|t| t.family().to_owned()),
            "version": concat!("miles-rollout ", env!("CARGO_PKG_VERSION")),
            "weight_version": version.to_string(),
            "internal_states": [{"weight_version": version.to_string()}],
        }))
    }
    .await;
    json_response(result)
}

async fn flush_cache(State(state): AppStateRef) -> Response {
    match state.engine.flush_cache().await {
        Ok(()) => (StatusCode::OK, "Cache flushed.\n").into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            format!("Cache not flushed: {error}\n"),
        )
            .into_response(),
    }
}

async fn pause_generation(State(state): AppStateRef, request: Request) -> Response {
    let result = async {
        let body = read_json(&state, request, true).await?;
        let mode: PauseMode = match body.get("mode") {
            None | Some(Value::Null) => PauseMode::Abort,
            Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                ApiError::bad_request(format!(
                    "mode must be \"abort\", \"retract\" or \"in_place\", got {v}"
                ))
            })?,
        };
        state
            .engine
            .pause(mode)
            .await
            .map_err(ApiError::from_engine)?;
        Ok(json!({"status": "ok", "message": "Generation paused successfully."}))
    }
    .await;
    json_response(result)
}

async fn continue_generation(State(state): AppStateRef) -> Response {
    let result = async {
        state.engine.resume().await.map_err(ApiError::from_engine)?;
        Ok(json!({"status": "ok", "message": "Generation continued successfully."}))
    }
    .await;
    json_response(result)
}

async fn abort_request(State(state): AppStateRef, request: Request) -> Response {
    let result = async {
        let body = read_json(&state, request, false).await?;
        let abort_all = bool_field(&body, "abort_all")?;
        match body.get("rid") {
            _ if abort_all => state.engine.abort_all().await,
            Some(Value::String(rid)) if !rid.is_empty() => {
                state.engine.abort(&RequestId::new(rid.clone())).await
            }
            _ => {
                return Err(ApiError::bad_request(
                    "send {\"rid\": \"<request id>\"} or {\"abort_all\": true}",
                ));
            }
        }
        .map_err(ApiError::from_engine)
    }
    .await;
    match result {
        Ok(()) => StatusCode::OK.into_response(),
        Err(error) => error.into_response(),
    }
}

/// `model_path` of an `update_weights_from_disk` request, canonicalised and confined to the
/// server's weights root: 403 when the server has none, or the path (after `..` and symlinks
/// are resolved) leaves it; 400 when it does not exist. Shards named by an index are confined
/// to the checkpoint directory by the reader itself.
fn confined_weights_path(info: &ServerInfo, model_path: &str) -> ApiResult<PathBuf> {
    let forbidden = |message: String| ApiError {
        status: StatusCode::FORBIDDEN,
        message,
    };
    let Some(root) = &info.weights_root else {
        return Err(forbidden(
            "update_weights_from_disk is disabled: start the server with --weights-root DIR".into(),
        ));
    };
    let root = root.canonicalize().map_err(|e| ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("the weights root {} is unusable: {e}", root.display()),
    })?;
    let requested = Path::new(model_path);
    let path = if requested.is_absolute() {
        requested.to_path_buf()
    } else {
        root.join(requested)
    };
    let canonical = match path.canonicalize() {
        Ok(canonical) => canonical,
        // No existence oracle outside the root: a missing path there is 403 as well.
        Err(_) if !lexically_inside(&path, &root) => {
            return Err(forbidden(format!(
                "model_path {model_path:?} is outside the weights root {}",
                root.display()
            )));
        }
        Err(e) => {
            return Err(ApiError::bad_request(format!(
                "model_path {model_path:?} cannot be read: {e}"
            )));
        }
    };
    if !canonical.starts_with(&root) {
        return Err(forbidden(format!(
            "model_path {model_path:?} is outside the weights root {}",
            root.display()
        )));
    }
    Ok(canonical)
}

/// Whether a path that does not exist would be under `root` (canonical): its nearest
/// existing ancestor is canonicalised and the missing rest, which can hold no symlink, must
/// not go up (`..`).
fn lexically_inside(path: &Path, root: &Path) -> bool {
    let mut missing = Vec::new();
    let mut ancestor = path;
    loop {
        if let Ok(canonical) = ancestor.canonicalize() {
            let goes_up = missing
                .iter()
                .any(|c| matches!(c, std::path::Component::ParentDir));
            return canonical.starts_with(root) && !goes_up;
        }
        let Some(last) = ancestor.components().next_back() else {
            return false;
        };
        missing.push(last);
        match ancestor.parent() {
            Some(parent) => ancestor = parent,
            None => return false,
        }
    }
}

async fn update_weights_from_disk(State(state): AppStateRef, request: Request) -> Response {
    let result = async {
        let body = read_json(&state, request, false).await?;
        let Some(Value::String(model_path)) = body.get("model_path") else {
            return Err(ApiError::bad_request("model_path (a string) is required"));
        };
        let version = match body.get("weight_version") {
            None | Some(Value::Null) => current_version(&state).await?.next(),
            Some(Value::String(s)) => s.parse().map_err(|_| {
                ApiError::bad_request(format!(
                    "weight_version {s:?} is not a version (a non-negative integer)"
                ))
            })?,
            Some(Value::Number(n)) => WeightVersion(n.as_u64().ok_or_else(|| {
                ApiError::bad_request(format!("weight_version {n} is not a version"))
            })?),
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "weight_version {other} is not a version"
                )));
            }
        };
        let flush = match body.get("flush_cache") {
            None | Some(Value::Null) => true,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "flush_cache must be a boolean, got {other}"
                )));
            }
        };
        let model_path = confined_weights_path(&state.info, model_path)?;
        if bool_field(&body, "abort_all_requests")? {
            state
                .engine
                .abort_all()
                .await
                .map_err(ApiError::from_engine)?;
        }
        Ok((model_path, version, flush))
    }
    .await;
    let (model_path, version, flush) = match result {
        Ok(parsed) => parsed,
        Err(error) => {
            // SGLang's `{"success": false, "message"}` beside the OpenAI-shaped error.
            let status = error.status;
            let message = error.message.clone();
            let mut response = error.into_response();
            *response.body_mut() = Body::from(
                json!({"success": false, "message": message,
                       "error": {"message": message, "type": if status.is_client_error() {
                           "BadRequestError" } else { "InternalServerError" },
                           "code": status.as_u16()}})
                .to_string(),
            );
            return response;
        }
    };
    let updated = async {
        state
            .engine
            .update_weights_from_disk(&model_path, version)
            .await?;
        if flush {
            state.engine.flush_cache().await?;
        }
        Ok::<_, miles_core::Error>(())
    }
    .await;
    match updated {
        Ok(()) => axum::Json(json!({
            "success": true,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }))
        .into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"success": false, "message": error.to_string()})),
        )
            .into_response(),
    }
}

async fn get_weight_version(State(state): AppStateRef) -> Response {
    json_response(
        current_version(&state)
            .await
            .map(|v| json!({"weight_version": v.to_string()})),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_limits_bound_n_sequences_and_stops() {
        let info = ServerInfo {
            limits: RequestLimits::default()
                .with_max_n(4)
                .with_stop_strings(2, 3)
                .with_max_stop_token_ids(2),
            max_sequences: 10,
            ..ServerInfo::new("limits")
        };
        let params = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p
        };
        let message = |p: &SamplingParams, prompts: usize| {
            check_limits(&info, p, prompts).map_err(|e| (e.status, e.message))
        };
        assert!(message(&params(&|p| p.n = 4), 2).is_ok());
        assert!(
            message(&params(&|p| p.n = 5), 1)
                .unwrap_err()
                .1
                .contains("n = 5")
        );
        // 3 prompts × 4 = 12 > 10; usize::MAX prompts × 2 overflows and is rejected too.
        assert!(
            message(&params(&|p| p.n = 4), 3)
                .unwrap_err()
                .1
                .contains("3 prompts")
        );
        assert!(message(&params(&|p| p.n = 2), usize::MAX).is_err());
        assert!(message(&params(&|p| p.stop = vec!["a".into(); 3]), 1).is_err());
        assert!(message(&params(&|p| p.stop = vec!["abcd".into()]), 1).is_err());
        assert!(message(&params(&|p| p.stop = vec!["abc".into(); 2]), 1).is_ok());
        assert!(message(&params(&|p| p.stop_token_ids = vec![1, 2, 3]), 1).is_err());
        let (status, _) = message(&params(&|p| p.n = 99), 1).unwrap_err();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        // prompt + max_new past usize is over any context, never a wrap-around.
        let info = ServerInfo {
            context_length: Some(100),
            ..ServerInfo::new("m")
        };
        assert!(resolve_max_new(&info, Some(usize::MAX), 5, 1).is_err());
        assert_eq!(resolve_max_new(&info, Some(95), 5, 1).unwrap(), 95);
        assert!(resolve_max_new(&info, Some(96), 5, 1).is_err());
    }

    #[test]
    fn families_follow_model_types() {
        assert_eq!(tito_family_for(Some("qwen3")), "qwen3");
        assert_eq!(tito_family_for(Some("qwen3_moe")), "qwen3");
        assert_eq!(tito_family_for(Some("glm4_moe")), "glm47");
        assert_eq!(tito_family_for(Some("llama")), "default");
        assert_eq!(tito_family_for(None), "default");
    }

    #[test]
    fn sampling_checks_match_sglang() {
        let ok = SamplingParams::default();
        assert!(verify_sampling(&ok).is_ok());
        for bad in [
            SamplingParams {
                temperature: -0.1,
                ..ok.clone()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..ok.clone()
            },
            SamplingParams {
                top_p: 0.0,
                ..ok.clone()
            },
            SamplingParams {
                top_k: 0,
                ..ok.clone()
            },
            SamplingParams {
                min_p: 1.5,
                ..ok.clone()
            },
            SamplingParams { n: 0, ..ok.clone() },
            SamplingParams {
                max_new_tokens: Some(2),
                min_new_tokens: 3,
                ..ok.clone()
            },
        ] {
            let error = verify_sampling(&bad).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn n_expands_with_distinct_seeds_and_ids() {
        let mut request = GenerateRequest::new(
            vec![1],
            SamplingParams {
                n: 3,
                sampling_seed: Some(10),
                ..SamplingParams::default()
            },
        );
        request.request_id = Some(RequestId::new("r"));
        let expanded = expand_n(request);
        let seeds: Vec<_> = expanded
            .iter()
            .map(|r| r.sampling_params.sampling_seed)
            .collect();
        assert_eq!(seeds, [Some(10), Some(11), Some(12)]);
        let ids: Vec<_> = expanded
            .iter()
            .map(|r| r.request_id.clone().unwrap().0)
            .collect();
        assert_eq!(ids, ["r-0", "r-1", "r-2"]);
        assert!(expanded.iter().all(|r| r.sampling_params.n == 1));
    }

    #[test]
    fn finish_reasons_use_sglang_objects() {
        let mut output = GenerateOutput {
            request_id: None,
            output_ids: vec![4, 5, 6],
            output_log_probs: vec![],
            routed_experts: None,
            finish_reason: FinishReason::Length,
            matched_stop: None,
            weight_version: WeightVersion(1),
            prompt_tokens: 2,
            cached_tokens: 0,
        };
        assert_eq!(
            finish_reason_json(&output),
            json!({"type": "length", "length": 3})
        );
        output.finish_reason = FinishReason::Stop;
        output.matched_stop = Some(json!(6));
        assert_eq!(
            finish_reason_json(&output),
            json!({"type": "stop", "matched": 6})
        );
        output.finish_reason = FinishReason::Abort;
        assert_eq!(finish_reason_json(&output)["type"], "abort");
    }
}
