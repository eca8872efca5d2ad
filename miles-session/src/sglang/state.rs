//! The server's shared state and its error answers: `{"error": {"message", "type", "code"}}`
//! with a 4xx / 5xx status.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use miles_core::{EngineErrorKind, InferenceEngine};
use serde_json::{Map, Value, json};

use super::info::ServerInfo;

pub(super) struct AppState {
    pub(super) engine: Arc<dyn InferenceEngine>,
    pub(super) info: ServerInfo,
    pub(super) next_id: AtomicU64,
    pub(super) started: u64,
    /// What `/release_memory_occupation` released and is not back yet.
    pub(super) released: Mutex<Released>,
}

/// The memory the server's engine holds released: generation is refused until it is back.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Released {
    /// Released weights: back with the next successful `/update_weights_from_disk`.
    pub(super) weights: bool,
    /// Released KV cache: back with `/resume_memory_occupation` of `kv_cache`.
    pub(super) kv_cache: bool,
}

impl AppState {
    pub(super) fn released(&self) -> Released {
        *self.released.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn update_released(&self, change: impl FnOnce(&mut Released)) {
        change(&mut self.released.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// A 400 naming what is released and how it comes back, while the engine's memory is
    /// released (a request would otherwise wait for it).
    pub(super) fn check_serving(&self) -> ApiResult<()> {
        let released = self.released();
        let mut missing = Vec::new();
        if released.weights {
            missing.push("the weights (back with /update_weights_from_disk)");
        }
        if released.kv_cache {
            missing.push("the KV cache (back with /resume_memory_occupation of kv_cache)");
        }
        if missing.is_empty() {
            return Ok(());
        }
        Err(ApiError::bad_request(format!(
            "the engine's memory is released (/release_memory_occupation): {} first",
            missing.join(", then ")
        )))
    }

    pub(super) fn fresh_id(&self, prefix: &str) -> String {
        format!(
            "{prefix}{:x}{:08x}",
            self.started,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

pub(super) type AppStateRef = State<Arc<AppState>>;

/// An HTTP error: status and message, answered as `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
}

impl ApiError {
    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    pub(super) fn from_engine(error: miles_core::Error) -> Self {
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

pub(super) type ApiResult<T> = std::result::Result<T, ApiError>;

pub(super) fn json_response(result: ApiResult<Value>) -> Response {
    match result {
        Ok(value) => axum::Json(value).into_response(),
        Err(error) => error.into_response(),
    }
}

pub(super) async fn read_json(
    state: &AppState,
    request: Request,
    allow_empty: bool,
) -> ApiResult<Value> {
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

pub(super) async fn not_found(request: Request) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {} {}", request.method(), request.uri().path()),
    }
    .into_response()
}

pub(super) async fn method_not_allowed(request: Request) -> Response {
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

pub(super) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
