//! The model and control routes: models, health, model / server info, cache flush, pause /
//! continue, abort, weight updates from disk and the weight version.

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use miles_core::{GenerateRequest, MemoryTag, PauseMode, RequestId, SamplingParams, WeightVersion};
use serde_json::{Value, json};

use super::info::ServerInfo;
use super::state::{ApiError, ApiResult, AppState, AppStateRef, json_response, read_json};
use super::wire::flag;

pub(super) async fn list_models(State(state): AppStateRef) -> Response {
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

pub(super) async fn health(State(state): AppStateRef) -> Response {
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
pub(super) async fn health_generate(State(state): AppStateRef) -> Response {
    let params = SamplingParams {
        temperature: 0.0,
        max_new_tokens: Some(1),
        ..SamplingParams::default()
    };
    let mut request = GenerateRequest::new(vec![0], params);
    request.return_logprob = false;
    request.request_id = Some(RequestId::new(state.fresh_id("health-")));
    if let Err(error) = state.check_serving() {
        return ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: error.message,
        }
        .into_response();
    }
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

pub(super) async fn current_version(state: &AppState) -> ApiResult<WeightVersion> {
    state
        .engine
        .weight_version()
        .await
        .map_err(ApiError::from_engine)
}

pub(super) async fn model_info(State(state): AppStateRef) -> Response {
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

pub(super) async fn server_info(State(state): AppStateRef) -> Response {
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
                dtype @ (miles_core::DType::BF16 | miles_core::DType::F16) => dtype.torch_name(),
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

pub(super) async fn flush_cache(State(state): AppStateRef) -> Response {
    match state.engine.flush_cache().await {
        Ok(()) => (StatusCode::OK, "Cache flushed.\n").into_response(),
        Err(error) => (
            StatusCode::BAD_REQUEST,
            format!("Cache not flushed: {error}\n"),
        )
            .into_response(),
    }
}

pub(super) async fn pause_generation(State(state): AppStateRef, request: Request) -> Response {
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

pub(super) async fn continue_generation(State(state): AppStateRef) -> Response {
    let result = async {
        state.engine.resume().await.map_err(ApiError::from_engine)?;
        Ok(json!({"status": "ok", "message": "Generation continued successfully."}))
    }
    .await;
    json_response(result)
}

pub(super) async fn abort_request(State(state): AppStateRef, request: Request) -> Response {
    let result = async {
        let body = read_json(&state, request, false).await?;
        let abort_all = flag(body.get("abort_all"), "abort_all").map_err(ApiError::bad_request)?;
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
pub(super) fn confined_weights_path(info: &ServerInfo, model_path: &str) -> ApiResult<PathBuf> {
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
pub(super) fn lexically_inside(path: &Path, root: &Path) -> bool {
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

pub(super) async fn update_weights_from_disk(
    State(state): AppStateRef,
    request: Request,
) -> Response {
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
        if flag(body.get("abort_all_requests"), "abort_all_requests")
            .map_err(ApiError::bad_request)?
        {
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
    if updated.is_ok() {
        state.update_released(|r| r.weights = false);
    }
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

pub(super) async fn get_weight_version(State(state): AppStateRef) -> Response {
    json_response(
        current_version(&state)
            .await
            .map(|v| json!({"weight_version": v.to_string()})),
    )
}

/// The `tags` of a `/release_memory_occupation` or `/resume_memory_occupation` body (SGLang's
/// `ReleaseMemoryOccupationReqInput.tags`): `weights`, `kv_cache`, and `cuda_graph`, which
/// Miles sends with `kv_cache` and this server has nothing for; null or absent: all of them.
fn memory_tags(body: &Value) -> ApiResult<Vec<MemoryTag>> {
    let expected = "expected a list of \"weights\", \"kv_cache\", \"cuda_graph\" or null";
    let items = match body.get("tags") {
        None | Some(Value::Null) => return Ok(vec![MemoryTag::Weights, MemoryTag::KvCache]),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(ApiError::bad_request(format!("tags {other}: {expected}")));
        }
    };
    let mut tags = Vec::new();
    for item in items {
        let tag = match item.as_str() {
            Some("weights") => MemoryTag::Weights,
            Some("kv_cache") => MemoryTag::KvCache,
            Some("cuda_graph") => continue,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "unknown memory tag {item}: {expected}"
                )));
            }
        };
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    Ok(tags)
}

fn tag_names(tags: &[MemoryTag]) -> String {
    if tags.is_empty() {
        return "nothing".into();
    }
    tags.iter()
        .map(|t| t.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// SGLang's `/release_memory_occupation`: the engine frees `tags` once nothing generates
/// (idempotent); generation is refused until they are back.
pub(super) async fn release_memory_occupation(
    State(state): AppStateRef,
    request: Request,
) -> Response {
    let result = async {
        let body = read_json(&state, request, true).await?;
        let tags = memory_tags(&body)?;
        if !tags.is_empty() {
            let released = state
                .engine
                .release_memory_occupation(&tags)
                .await
                .map_err(ApiError::from_engine)?;
            if !released {
                return Err(ApiError::bad_request(
                    "this server's engine cannot release its memory",
                ));
            }
            state.update_released(|r| {
                r.weights |= tags.contains(&MemoryTag::Weights);
                r.kv_cache |= tags.contains(&MemoryTag::KvCache);
            });
        }
        Ok(json!({"success": true, "message": format!("released {}", tag_names(&tags))}))
    }
    .await;
    json_response(result)
}

/// SGLang's `/resume_memory_occupation`: the KV cache is allocated again (after the weights
/// are back); released weights come back with the next `/update_weights_from_disk` (Miles'
/// order: resume `weights`, update the weights, resume `kv_cache`). Idempotent.
pub(super) async fn resume_memory_occupation(
    State(state): AppStateRef,
    request: Request,
) -> Response {
    let result = async {
        let body = read_json(&state, request, true).await?;
        let tags = memory_tags(&body)?;
        if !tags.is_empty() {
            let resumed = state
                .engine
                .resume_memory_occupation(&tags)
                .await
                .map_err(ApiError::from_engine)?;
            if !resumed {
                return Err(ApiError::bad_request(
                    "this server's engine cannot release its memory",
                ));
            }
            if tags.contains(&MemoryTag::KvCache) {
                state.update_released(|r| r.kv_cache = false);
            }
        }
        let mut message = format!("resumed {}", tag_names(&tags));
        if state.released().weights {
            message.push_str("; the weights come back with /update_weights_from_disk");
        }
        Ok(json!({"success": true, "message": message}))
    }
    .await;
    json_response(result)
}
