//! An [`InferenceEngine`] that talks to an SGLang-compatible server over HTTP (SGLang's HTTP API): `/generate` with `input_ids`, `sampling_params`, `return_logprob`,
//! `return_routed_experts`; pause / continue / flush / abort; `update_weights_from_disk`;
//! `release_memory_occupation` / `resume_memory_occupation` (Miles' `--offload-rollout`).
//!
//! Every malformed answer is an [`miles_core::Error::Engine`] of kind `Protocol`, transport
//! failures and timeouts are `Unavailable`, an HTTP 400 is `InvalidRequest`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper::Method;
use miles_core::{
    DType, EngineErrorKind, GenerateOutput, GenerateRequest, InferenceEngine, MemoryTag,
    NamedTensors, PauseMode, RequestId, RoutedExperts, TokenId, WeightVersion, async_trait,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::error::Error;
use crate::guard::ApiKey;
use crate::http::{HttpClient, HttpResponse};
use crate::server::ROUTING_KEY_HEADER;

use super::wire::{GenerateRequestBody, GenerateResponse, TokenLogprob, parse_weight_version};

/// The dtype weight versions are written in for an SGLang-compatible engine: a policy (ask
/// the engine, keep the export's, or cast), not a storage dtype; the dtype it picks is a
/// [`DType`], the workspace's one storage dtype.
///
/// SGLang loads `update_weights_from_disk` checkpoints into the dtype it serves (its
/// `--dtype`, `bfloat16` for most LLM checkpoints), so writing f32 only doubles the bytes
/// written and read. The default, [`WeightDtype::Served`], asks the engine once
/// (`/get_server_info`'s `dtype`) and writes in that dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WeightDtype {
    /// The dtype the engine serves ([`WeightDtype::from_served`] of `/get_server_info`'s
    /// `dtype`; bf16 when the engine does not say).
    #[default]
    Served,
    /// The trainer's tensors as exported, no cast.
    Exported,
    /// Every float tensor cast to this float dtype.
    Cast(DType),
}

impl WeightDtype {
    /// The dtype to write for an engine that reports serving `dtype` (SGLang's `--dtype`
    /// values): `float32` / `float` → F32, `float16` / `half` → F16, anything else
    /// (`bfloat16`, `auto`, unknown) → BF16, the dtype of the checkpoints SGLang serves by
    /// default.
    pub fn from_served(dtype: &str) -> DType {
        match dtype.parse::<DType>() {
            Ok(float @ (DType::F32 | DType::F16)) => float,
            _ => DType::BF16,
        }
    }
}

/// The part of a version folder's name that says its dtype: `bf16`, `f16`, `f32`, `f64`.
fn dtype_suffix(dtype: DType) -> String {
    dtype.name().to_ascii_lowercase()
}

/// The largest shard [`WeightPublisher`] writes by default: 5 GB, as `save_pretrained`.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Writes weight versions where SGLang-compatible engines read them
/// (`update_weights_from_disk`) as a Hugging Face checkpoint's weight files
/// ([`NamedTensors::write_hf_shards`]: `model.safetensors`, or shards of at most
/// [`WeightPublisher::with_max_shard_bytes`] plus `model.safetensors.index.json`), in the
/// dtype each engine serves: `<root>/v<version>-<dtype>/` (`v7-bf16`), or `<root>/v<version>/`
/// for the tensors as exported. Each (version, dtype) is written **once** however many
/// engines load it, published atomically (written to a temporary folder, then renamed into
/// place), and with [`WeightPublisher::with_keep`] only the newest `K` versions are kept on
/// disk. Share one `Arc` between the [`SglangConfig`]s of a fleet.
///
/// A version is written again if this publisher has not written it itself: a folder left by
/// an earlier (killed) run is never taken for the trainer's current weights.
#[derive(Debug)]
pub struct WeightPublisher {
    root: PathBuf,
    keep: Option<usize>,
    max_shard_bytes: u64,
    /// (version, cast) pairs written, oldest first.
    written: tokio::sync::Mutex<VecDeque<(WeightVersion, Option<DType>)>>,
    writes: AtomicU64,
}

impl WeightPublisher {
    /// A publisher under `root` (created on first use) that keeps every version.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            keep: None,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            written: tokio::sync::Mutex::new(VecDeque::new()),
            writes: AtomicU64::new(0),
        }
    }

    /// The publisher of `root` shared by every engine of this process that writes there
    /// (made on first use, dropped with its last engine): engines configured with the same
    /// [`SglangConfig::shared_weights_dir`] and no publisher of their own write each version
    /// once, never over each other.
    pub fn shared(root: impl Into<PathBuf>) -> Arc<Self> {
        static REGISTRY: std::sync::Mutex<Vec<(PathBuf, std::sync::Weak<WeightPublisher>)>> =
            std::sync::Mutex::new(Vec::new());
        let root = root.into();
        let mut registry = REGISTRY
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        registry.retain(|(_, p)| p.strong_count() > 0);
        if let Some(publisher) = registry
            .iter()
            .find(|(r, _)| *r == root)
            .and_then(|(_, p)| p.upgrade())
        {
            return publisher;
        }
        let publisher = Arc::new(Self::new(root.clone()));
        registry.push((root, Arc::downgrade(&publisher)));
        publisher
    }

    /// Keeps only the newest `keep` versions it wrote (at least 1; engines load the newest,
    /// so 2 leaves a slow engine time to finish loading the one before). A version written in
    /// several dtypes counts once.
    pub fn with_keep(mut self, keep: usize) -> Self {
        self.keep = Some(keep.max(1));
        self
    }

    /// Largest shard, in bytes of tensor data (default [`DEFAULT_MAX_SHARD_BYTES`]; at least
    /// 1).
    pub fn with_max_shard_bytes(mut self, bytes: u64) -> Self {
        self.max_shard_bytes = bytes.max(1);
        self
    }

    /// The directory versions are written under.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The folder of `version` written with float tensors cast to `cast` (`None`: as
    /// exported).
    pub fn version_dir(&self, version: WeightVersion, cast: Option<DType>) -> PathBuf {
        match cast {
            Some(dtype) => self
                .root
                .join(format!("v{}-{}", version.0, dtype_suffix(dtype))),
            None => self.root.join(format!("v{}", version.0)),
        }
    }

    /// How many (version, dtype) folders it has written (each at most once).
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::SeqCst)
    }

    /// Writes `weights` as `version`, float tensors cast to `cast` (`None`: as exported),
    /// unless this publisher already wrote that (version, dtype), and returns the folder to
    /// hand to `update_weights_from_disk`. Callers for the same version wait for the one
    /// write.
    pub async fn publish(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
        cast: Option<DType>,
    ) -> miles_core::Result<PathBuf> {
        if let Some(dtype) = cast
            && !dtype.is_float()
        {
            return Err(miles_core::Error::engine(
                EngineErrorKind::WeightUpdate,
                format!("weights cannot be written as {dtype:?}: not a float dtype"),
            ));
        }
        let dir = self.version_dir(version, cast);
        let mut written = self.written.lock().await;
        if written.contains(&(version, cast)) {
            return Ok(dir);
        }
        // A blocking write of borrowed tensors (no copy of the weights): on a multi-threaded
        // runtime the worker hands its other tasks to the rest of the pool meanwhile.
        let write = || write_version(&self.root, &dir, weights, cast, self.max_shard_bytes);
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(write),
            _ => write(),
        }?;
        self.writes.fetch_add(1, Ordering::SeqCst);
        written.retain(|w| *w != (version, cast));
        written.push_back((version, cast));
        if let Some(keep) = self.keep {
            loop {
                let mut versions: Vec<WeightVersion> = written.iter().map(|w| w.0).collect();
                versions.sort_unstable();
                versions.dedup();
                if versions.len() <= keep {
                    break;
                }
                let oldest = versions[0];
                let (gone, kept): (VecDeque<_>, VecDeque<_>) =
                    written.drain(..).partition(|w| w.0 == oldest);
                *written = kept;
                for (old, old_cast) in gone {
                    let old_dir = self.version_dir(old, old_cast);
                    if let Err(e) = std::fs::remove_dir_all(&old_dir)
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        tracing::warn!(dir = %old_dir.display(), error = %e, "cannot remove an old weight version");
                    }
                }
            }
        }
        Ok(dir)
    }
}

/// Writes `weights` as a HF checkpoint's weight files in `target` through a temporary
/// sibling folder, fsynced and renamed into place (an existing `target` is replaced).
fn write_version(
    root: &Path,
    target: &Path,
    weights: &NamedTensors,
    cast: Option<DType>,
    max_shard_bytes: u64,
) -> miles_core::Result<()> {
    std::fs::create_dir_all(root).map_err(|e| miles_core::Error::io(root, e))?;
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let tmp = root.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = weights.write_hf_shards(&tmp, cast, max_shard_bytes);
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if target.exists() {
        std::fs::remove_dir_all(target).map_err(|e| miles_core::Error::io(target, e))?;
    }
    std::fs::rename(&tmp, target).map_err(|e| miles_core::Error::io(target, e))?;
    Ok(())
}

/// Settings of an [`SglangEngine`].
#[derive(Debug, Clone)]
pub struct SglangConfig {
    /// Base URL, e.g. `http://127.0.0.1:30000`.
    pub base_url: String,
    /// Timeout of `/generate` calls (Miles: `--miles-router-timeout`, 600 s).
    pub generate_timeout: Duration,
    /// Timeout of control calls (pause, flush, weight updates, health).
    pub control_timeout: Duration,
    /// MoE layers of the model: needed to shape `meta_info.routed_experts`.
    pub num_layers: Option<usize>,
    /// A directory the engine can read, for [`InferenceEngine::update_weights`]: tensors are
    /// written there by a [`WeightPublisher`] (`v<version>-<dtype>/`), then loaded with
    /// `update_weights_from_disk`.
    pub shared_weights_dir: Option<PathBuf>,
    /// Writes each weight version to disk once for every engine that shares it (give the
    /// same `Arc` to all engines of a fleet). `None`: [`WeightPublisher::shared`] for
    /// `shared_weights_dir` (one per directory in the process).
    pub publisher: Option<Arc<WeightPublisher>>,
    /// The dtype weight versions are written in for this engine (default: the dtype it
    /// serves).
    pub weight_dtype: WeightDtype,
    /// The engine's `--api-key`, sent as `Authorization: Bearer` with every call.
    pub api_key: Option<ApiKey>,
    /// Largest engine response body read (a larger one is a protocol error); 1 GiB.
    pub max_response_bytes: usize,
}

impl SglangConfig {
    /// Defaults for `base_url`: 600 s generate timeout, 60 s control timeout.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into().trim_end_matches('/').to_owned(),
            generate_timeout: Duration::from_secs(600),
            control_timeout: Duration::from_secs(60),
            num_layers: None,
            shared_weights_dir: None,
            publisher: None,
            weight_dtype: WeightDtype::Served,
            api_key: None,
            max_response_bytes: 1 << 30,
        }
    }

    /// Sets [`SglangConfig::publisher`] (and `shared_weights_dir` to its root).
    pub fn with_publisher(mut self, publisher: Arc<WeightPublisher>) -> Self {
        self.shared_weights_dir = Some(publisher.root().to_path_buf());
        self.publisher = Some(publisher);
        self
    }

    /// Sets [`SglangConfig::weight_dtype`].
    pub fn with_weight_dtype(mut self, dtype: WeightDtype) -> Self {
        self.weight_dtype = dtype;
        self
    }

    /// Sets [`SglangConfig::api_key`].
    pub fn with_api_key(mut self, key: Option<ApiKey>) -> Self {
        self.api_key = key;
        self
    }
}

/// The SGLang-protocol HTTP client.
#[derive(Debug, Clone)]
pub struct SglangEngine {
    config: SglangConfig,
    http: HttpClient,
    /// The publisher of an engine given only `shared_weights_dir`.
    own_publisher: std::sync::OnceLock<Arc<WeightPublisher>>,
    /// The dtype weights are written in, resolved on the first update.
    resolved_dtype: Arc<tokio::sync::OnceCell<Option<DType>>>,
}

fn protocol(message: impl Into<String>) -> miles_core::Error {
    miles_core::Error::engine(EngineErrorKind::Protocol, message)
}

fn to_engine_error(error: Error) -> miles_core::Error {
    match error {
        Error::Engine(e) | Error::Core(e) => e,
        Error::Timeout { .. } | Error::Transport { .. } => {
            miles_core::Error::engine(EngineErrorKind::Unavailable, error.to_string())
        }
        other => protocol(other.to_string()),
    }
}

fn status_error(url: &str, response: &HttpResponse) -> miles_core::Error {
    let body = response.text();
    let message = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("error"))
                .or_else(|| v.get("message"))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_else(|| body.chars().take(300).collect());
    let kind = match response.status.as_u16() {
        400 | 413 | 422 => EngineErrorKind::InvalidRequest,
        502..=504 => EngineErrorKind::Unavailable,
        _ => EngineErrorKind::Internal,
    };
    miles_core::Error::engine(
        kind,
        format!("{url} answered {}: {message}", response.status),
    )
}

/// Checks a `/generate` answer (SGLang's `/generate` answer) against `request` and turns it into the
/// engine's output: counts agree with each other and with the request, log-probs are
/// log-probabilities, routed experts fit the sequence before they are decoded.
pub(crate) fn check_generate_response(
    request: &GenerateRequest,
    answer: GenerateResponse,
    num_layers: Option<usize>,
) -> miles_core::Result<GenerateOutput> {
    let meta = answer.meta_info;
    let finish = meta
        .finish_reason
        .ok_or_else(|| protocol("meta_info has no finish_reason"))?;
    let completion_tokens = meta
        .completion_tokens
        .ok_or_else(|| protocol("meta_info has no completion_tokens"))?;
    let completion_tokens = usize::try_from(completion_tokens)
        .ok()
        .filter(|&n| {
            request
                .sampling_params
                .max_new_tokens
                .is_none_or(|max| n <= max)
        })
        .ok_or_else(|| {
            protocol(format!(
                "completion_tokens = {completion_tokens} is over the requested max_new_tokens {:?}",
                request.sampling_params.max_new_tokens
            ))
        })?;
    let (output_ids, output_log_probs) = match meta.output_token_logprobs {
        Some(entries) => {
            let mut ids: Vec<TokenId> = Vec::with_capacity(entries.len());
            let mut log_probs = Vec::with_capacity(entries.len());
            for (i, TokenLogprob(lp, id, _)) in entries.iter().enumerate() {
                // A log-probability is finite and at most 0 (a little rounding allowed).
                if !(lp.is_finite() && *lp <= LOGPROB_SLACK) {
                    return Err(protocol(format!(
                        "output_token_logprobs[{i}] has log-prob {lp}, not a log-probability"
                    )));
                }
                log_probs.push(*lp);
                ids.push(*id);
            }
            if entries.len() != completion_tokens {
                return Err(protocol(format!(
                    "{} output_token_logprobs for completion_tokens = {completion_tokens}",
                    entries.len()
                )));
            }
            if let Some(listed) = &answer.output_ids
                && *listed != ids
            {
                return Err(protocol("output_ids disagree with output_token_logprobs"));
            }
            (ids, log_probs)
        }
        None if request.return_logprob => {
            return Err(protocol("meta_info has no output_token_logprobs"));
        }
        None => {
            let ids = answer.output_ids.ok_or_else(|| {
                protocol("response has neither output_token_logprobs nor output_ids")
            })?;
            if ids.len() != completion_tokens {
                return Err(protocol(format!(
                    "{} output_ids for completion_tokens = {completion_tokens}",
                    ids.len()
                )));
            }
            (ids, Vec::new())
        }
    };
    let prompt_tokens = match meta.prompt_tokens {
        None => request.input_ids.len(),
        Some(n) => usize::try_from(n)
            .ok()
            .filter(|&n| n == request.input_ids.len())
            .ok_or_else(|| {
                protocol(format!(
                    "prompt_tokens = {n} for {} input ids",
                    request.input_ids.len()
                ))
            })?,
    };
    let routed_experts = match meta.routed_experts {
        Some(b64) if request.return_routed_experts => {
            let layers = num_layers.ok_or_else(|| {
                protocol("routed_experts returned but the client was not told num_layers")
            })?;
            let start = request.routed_experts_start_len.unwrap_or(0);
            let rows = (prompt_tokens + output_ids.len())
                .saturating_sub(1)
                .saturating_sub(start);
            // Bound the payload before decoding it: rows × layers × top-k int32, base64.
            let max_len = rows
                .checked_mul(layers)
                .and_then(|v| v.checked_mul(MAX_EXPERTS_PER_TOKEN * 4))
                .map(|bytes| bytes.div_ceil(3) * 4)
                .ok_or_else(|| protocol("routed_experts shape overflows"))?;
            if b64.len() > max_len {
                return Err(protocol(format!(
                    "routed_experts has {} base64 bytes, more than {rows} rows × {layers} layers × {MAX_EXPERTS_PER_TOKEN} experts allow",
                    b64.len()
                )));
            }
            Some(
                RoutedExperts::from_base64(&b64, rows, layers)
                    .map_err(|e| protocol(e.to_string()))?,
            )
        }
        _ => None,
    };
    let cached_tokens = match meta.cached_tokens {
        None => 0,
        Some(n) => usize::try_from(n)
            .ok()
            .filter(|&n| n <= prompt_tokens)
            .ok_or_else(|| {
                protocol(format!(
                    "cached_tokens = {n} for {prompt_tokens} prompt tokens"
                ))
            })?,
    };
    Ok(GenerateOutput {
        request_id: request.request_id.clone(),
        output_ids,
        output_log_probs,
        routed_experts,
        finish_reason: finish.reason(),
        matched_stop: finish.matched().cloned(),
        weight_version: meta.weight_version.map_or(WeightVersion(0), |v| v.0),
        prompt_tokens,
        cached_tokens,
    })
}

/// Log-probs above this are rejected as not log-probabilities (rounding slack above 0).
const LOGPROB_SLACK: f64 = 1e-3;

/// The most experts per token a `routed_experts` payload may carry (bounds its size before it
/// is decoded).
pub(crate) const MAX_EXPERTS_PER_TOKEN: usize = 256;

impl SglangEngine {
    /// A client for the server at `config.base_url`.
    pub fn new(config: SglangConfig) -> Self {
        let http = HttpClient::new(config.control_timeout)
            .with_api_key(config.api_key.as_ref())
            .with_max_response_bytes(config.max_response_bytes);
        Self {
            config,
            http,
            own_publisher: std::sync::OnceLock::new(),
            resolved_dtype: Arc::new(tokio::sync::OnceCell::new()),
        }
    }

    /// The dtype this engine's weight versions are written in (`None`: as exported):
    /// [`SglangConfig::weight_dtype`], with [`WeightDtype::Served`] resolved by asking the
    /// engine once (`GET /get_server_info`, its `dtype`; bf16 when the route answers an
    /// error status or no `dtype`). A transport failure is returned and asked again next
    /// time.
    pub async fn weight_dtype(&self) -> miles_core::Result<Option<DType>> {
        match self.config.weight_dtype {
            WeightDtype::Exported => Ok(None),
            WeightDtype::Cast(dtype) => Ok(Some(dtype)),
            WeightDtype::Served => self
                .resolved_dtype
                .get_or_try_init(|| async {
                    let url = self.url("/get_server_info");
                    let response = self
                        .http
                        .send_with_timeout(
                            Method::GET,
                            &url,
                            &[],
                            None,
                            self.config.control_timeout,
                        )
                        .await
                        .map_err(to_engine_error)?;
                    let served = if response.status.is_success() {
                        serde_json::from_slice::<Value>(&response.body)
                            .ok()
                            .and_then(|v| v.get("dtype").and_then(Value::as_str).map(str::to_owned))
                    } else {
                        None
                    };
                    Ok(Some(
                        served
                            .as_deref()
                            .map_or(DType::BF16, WeightDtype::from_served),
                    ))
                })
                .await
                .copied(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SglangConfig {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url)
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        timeout: Duration,
        headers: &[(&str, &str)],
    ) -> miles_core::Result<HttpResponse> {
        let url = self.url(path);
        let payload = match body {
            Some(v) => Some((
                "application/json",
                serde_json::to_vec(&v).map_err(miles_core::Error::from)?,
            )),
            None => None,
        };
        let response = self
            .http
            .send_with_timeout(method, &url, headers, payload, timeout)
            .await
            .map_err(to_engine_error)?;
        if !response.status.is_success() {
            return Err(status_error(&url, &response));
        }
        Ok(response)
    }

    async fn control(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> miles_core::Result<HttpResponse> {
        self.call(method, path, body, self.config.control_timeout, &[])
            .await
    }

    /// `POST path` with `{"tags": [...]}` (SGLang's `release_memory_occupation` /
    /// `resume_memory_occupation`): `Ok(false)` when the server has no such route (404: it
    /// cannot release), an error when it answers another failure or `"success": false`.
    async fn memory_occupation(&self, path: &str, tags: &[MemoryTag]) -> miles_core::Result<bool> {
        let url = self.url(path);
        let names: Vec<&str> = tags.iter().map(|t| t.as_str()).collect();
        let body =
            serde_json::to_vec(&json!({ "tags": names })).map_err(miles_core::Error::from)?;
        let response = self
            .http
            .send_with_timeout(
                Method::POST,
                &url,
                &[],
                Some(("application/json", body)),
                self.config.control_timeout,
            )
            .await
            .map_err(to_engine_error)?;
        if response.status.as_u16() == 404 {
            tracing::warn!(%url, "the server has no {path}: its memory stays in use");
            return Ok(false);
        }
        if !response.status.is_success() {
            return Err(status_error(&url, &response));
        }
        // SGLang answers `null`, newer servers `{"success", "message"}`.
        let value: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        if value.get("success").and_then(Value::as_bool) == Some(false) {
            let message = value
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return Err(miles_core::Error::engine(
                EngineErrorKind::Internal,
                format!("{url}: {message}"),
            ));
        }
        Ok(true)
    }
}

#[async_trait]
impl InferenceEngine for SglangEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        if request.input_ids.is_empty() {
            return Err(miles_core::Error::engine(
                EngineErrorKind::InvalidRequest,
                "empty input_ids",
            ));
        }
        let body = serde_json::to_value(GenerateRequestBody::from(&request))?;
        let headers: Vec<(&str, &str)> = request
            .routing_key
            .as_deref()
            .map(|key| vec![(ROUTING_KEY_HEADER, key)])
            .unwrap_or_default();
        let response = self
            .call(
                Method::POST,
                "/generate",
                Some(body),
                self.config.generate_timeout,
                &headers,
            )
            .await?;
        let value: Value = serde_json::from_slice(&response.body).map_err(|e| {
            protocol(format!(
                "/generate answered non-JSON ({e}): {}",
                String::from_utf8_lossy(&response.body[..response.body.len().min(200)])
            ))
        })?;
        let answer = GenerateResponse::deserialize(value)
            .map_err(|e| protocol(format!("/generate answer is not SGLang's: {e}")))?;
        check_generate_response(&request, answer, self.config.num_layers)
    }

    async fn update_weights(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        let publisher = match (&self.config.publisher, &self.config.shared_weights_dir) {
            (Some(p), _) => p.clone(),
            (None, Some(root)) => self
                .own_publisher
                .get_or_init(|| WeightPublisher::shared(root.clone()))
                .clone(),
            (None, None) => {
                return Err(miles_core::Error::engine(
                    EngineErrorKind::WeightUpdate,
                    "update_weights over HTTP needs shared_weights_dir (a directory the engine can read)",
                ));
            }
        };
        let cast = self.weight_dtype().await?;
        let dir = publisher.publish(weights, version, cast).await?;
        self.update_weights_from_disk(&dir, version).await
    }

    async fn update_weights_from_disk(
        &self,
        dir: &Path,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        let body = json!({"model_path": dir.to_string_lossy(), "weight_version": version.to_string(), "flush_cache": true});
        let response = self
            .control(Method::POST, "/update_weights_from_disk", Some(body))
            .await?;
        let value: Value = response.json().map_err(to_engine_error)?;
        if value.get("success").and_then(Value::as_bool) != Some(true) {
            let message = value
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("no message");
            return Err(miles_core::Error::engine(
                EngineErrorKind::WeightUpdate,
                message.to_owned(),
            ));
        }
        Ok(())
    }

    async fn pause(&self, mode: PauseMode) -> miles_core::Result<()> {
        self.control(
            Method::POST,
            "/pause_generation",
            Some(json!({"mode": mode})),
        )
        .await
        .map(drop)
    }

    async fn resume(&self) -> miles_core::Result<()> {
        self.control(Method::POST, "/continue_generation", Some(json!({})))
            .await
            .map(drop)
    }

    async fn flush_cache(&self) -> miles_core::Result<()> {
        self.control(Method::GET, "/flush_cache", None)
            .await
            .map(drop)
    }

    async fn abort(&self, request_id: &RequestId) -> miles_core::Result<()> {
        self.control(
            Method::POST,
            "/abort_request",
            Some(json!({"rid": request_id.0})),
        )
        .await
        .map(drop)
    }

    async fn abort_all(&self) -> miles_core::Result<()> {
        self.control(
            Method::POST,
            "/abort_request",
            Some(json!({"abort_all": true})),
        )
        .await
        .map(drop)
    }

    async fn health(&self) -> miles_core::Result<()> {
        self.control(Method::GET, "/health", None).await.map(drop)
    }

    /// `POST /release_memory_occupation {"tags": [...]}` (`Ok(false)`: the server has no such
    /// route).
    async fn release_memory_occupation(&self, tags: &[MemoryTag]) -> miles_core::Result<bool> {
        self.memory_occupation("/release_memory_occupation", tags)
            .await
    }

    /// `POST /resume_memory_occupation {"tags": [...]}` (`Ok(false)`: the server has no such
    /// route).
    async fn resume_memory_occupation(&self, tags: &[MemoryTag]) -> miles_core::Result<bool> {
        self.memory_occupation("/resume_memory_occupation", tags)
            .await
    }

    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        let response = self
            .control(Method::GET, "/get_weight_version", None)
            .await?;
        let value: Value = response.json().map_err(to_engine_error)?;
        parse_weight_version(value.get("weight_version").unwrap_or(&Value::Null)).map_err(protocol)
    }
}
