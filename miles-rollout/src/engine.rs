//! The embedded inference engine: any miles-bridge [`CausalLm`] served through
//! [`InferenceEngine`] on a non-autodiff device (flex by default).
//!
//! One scheduler thread owns the model. Between decode steps it takes commands (new requests,
//! aborts, pause / resume, cache flushes, weight updates), admits waiting requests while the KV
//! token budget allows (prefill one sequence at a time, reusing the longest cached prefix), then
//! runs one batched decode step over every running sequence: continuous batching. Each sequence
//! samples from its own seeded generator, so a request's tokens do not depend on what it was
//! batched with.
//!
//! Versions: a weight update waits until no sequence is mid-generation (admission stops, the
//! running ones finish), then swaps the weights and flushes the prefix cache; every output
//! carries the single version all its tokens were generated with. Sequences held by an in-place
//! or retract pause when an update arrives end with finish reason `abort` at the old version
//! (their partial output is returned, as Miles' partial rollout expects) rather than continuing
//! on new weights.
//!
//! Log-probs: per-token log-probs of the sampled tokens under the untempered distribution. With
//! `recompute_logprobs_via_prefill` (default on) they are recomputed after the sequence ends by
//! a [`SequenceScorer`] over the whole sequence; plug in the trainer's scoring function (as
//! `miles-examples` does with miles-train's) and rollout log-probs equal the trainer's bit for
//! bit. Aborted requests keep their decode-time log-probs: a weight update ends every
//! interrupted request at once, and a prefill per request then would stall the update (the
//! difference is float rounding under the same weights, which TIS absorbs).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use async_trait::async_trait;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{
    CausalLm, FloatDtype, HostTensor, KvCache, ModelConfig, ModelInput, TensorMap,
    checkpoint::read_checkpoint_dir,
};
use miles_core::{
    DType, EngineErrorKind, Error as CoreError, FinishReason, GenerateOutput, GenerateRequest,
    InferenceEngine, NamedTensors, PauseMode, RequestId, RoutedExperts, WeightVersion,
};
use miles_r3::Fallthrough;
use serde_json::Value;
use tokio::sync::oneshot;

/// SGLang's default `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// Configuration of an [`EmbeddedEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences decoded together in one step.
    pub max_running_requests: usize,
    /// KV-cache budget in tokens: a request reserves `prompt + max_new_tokens` while it runs;
    /// requests that do not fit wait. A request larger than the whole budget is rejected.
    pub kv_token_budget: usize,
    /// Tokens of finished / prefilled sequences kept for prefix reuse (0 disables reuse).
    pub prefix_cache_tokens: usize,
    /// After a sequence ends (stop or length; not abort), recompute its log-probs with the
    /// [`SequenceScorer`] over the whole sequence (Miles' `recompute_logprobs_via_prefill`).
    pub recompute_logprobs_via_prefill: bool,
    /// `max_new_tokens` when a request does not set it.
    pub default_max_new_tokens: usize,
    /// Token ids that end generation besides a request's `stop_token_ids` (the model's EOS).
    pub eos_token_ids: Vec<u32>,
    /// Seed for requests without `sampling_seed` (mixed with a per-request counter).
    pub seed: u64,
    /// Version the initial weights carry.
    pub initial_version: WeightVersion,
    /// Threads the engine computes with: its scheduler runs in a rayon pool of this size of
    /// its own (`None`: the process-wide pool). Pinning the engine and the trainer to pools
    /// of their own keeps generation and training from competing for the same cores, the
    /// in-process counterpart of giving rollout and training separate GPUs.
    pub compute_threads: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running_requests: 32,
            kv_token_budget: 65_536,
            prefix_cache_tokens: 16_384,
            recompute_logprobs_via_prefill: true,
            default_max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            eos_token_ids: Vec::new(),
            seed: 0,
            initial_version: WeightVersion(0),
            compute_threads: None,
        }
    }
}

/// Computes the log-probs of the last `response_length` tokens of `tokens` in one pass over
/// the whole sequence. The engine calls it on its scheduler thread with the weights that
/// generated the sequence.
pub trait SequenceScorer: Send + Sync {
    /// `log p(tokens[n − R + i] | tokens[..n − R + i])` for `i < R`.
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String>;
}

/// The engine's own scorer: one full forward at the sequence's length, log-softmax, gather.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillScorer;

impl SequenceScorer for PrefillScorer {
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String> {
        let n = tokens.len();
        if response_length == 0 || response_length >= n {
            return Err(format!(
                "response of {response_length} tokens in a sequence of {n}"
            ));
        }
        let device = model.lm_head_weight().device();
        let ids = ids_row(tokens, &device);
        let out = model
            .forward(&ModelInput::new(ids), &Fallthrough)
            .map_err(|e| e.to_string())?;
        let [_, _, vocab] = out.logits.dims();
        let rows =
            out.logits
                .reshape([n, vocab])
                .narrow(0, n - 1 - response_length, response_length);
        let targets = Tensor::<1, Int>::from_data(
            TensorData::new(
                tokens[n - response_length..]
                    .iter()
                    .map(|&t| t as i32)
                    .collect(),
                [response_length],
            ),
            &device,
        )
        .reshape([response_length, 1]);
        log_softmax(rows, 1)
            .gather(1, targets)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))
    }
}

/// Turns output ids into text, for stop strings.
pub trait Detokenizer: Send + Sync {
    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> String;
}

impl Detokenizer for tokenizers::Tokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        std::ops::Deref::deref(self)
            .decode(ids, false)
            .unwrap_or_default()
    }
}

/// Counters of an engine's life, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Decode steps run.
    pub decode_steps: u64,
    /// Largest number of sequences decoded in one step.
    pub max_batch: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u64,
    /// Tokens prefilled.
    pub prefill_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Requests that had to wait for KV budget.
    pub budget_waits: u64,
}

enum Cmd {
    Generate(Box<Pending>),
    Abort(RequestId),
    AbortAll,
    Pause(PauseMode, oneshot::Sender<()>),
    Resume,
    Flush(oneshot::Sender<()>),
    Update(Box<CausalLm>, WeightVersion, oneshot::Sender<()>),
    Shutdown,
}

struct Pending {
    request: GenerateRequest,
    reply: oneshot::Sender<miles_core::Result<GenerateOutput>>,
}

struct Shared {
    version: AtomicU64,
    alive: AtomicBool,
    stats: Mutex<EngineStats>,
    /// SGLang-named Prometheus metrics the scheduler keeps current, once attached.
    metrics: OnceLock<Arc<miles_core::prometheus::SglangMetrics>>,
}

/// The embedded burn inference engine (see the module docs).
pub struct EmbeddedEngine {
    commands: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
    model_config: ModelConfig,
    device: Device,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for EmbeddedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedEngine")
            .field("architecture", &self.model_config.architecture)
            .field("version", &self.shared.version.load(Ordering::SeqCst))
            .finish()
    }
}

/// Builds an [`EmbeddedEngine`] with an optional scorer and detokenizer.
pub struct EngineBuilder {
    model: CausalLm,
    config: EngineConfig,
    scorer: Arc<dyn SequenceScorer>,
    detokenizer: Option<Arc<dyn Detokenizer>>,
}

impl EngineBuilder {
    /// Replaces the engine configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// The scorer used by `recompute_logprobs_via_prefill` (default [`PrefillScorer`]).
    pub fn scorer(mut self, scorer: Arc<dyn SequenceScorer>) -> Self {
        self.scorer = scorer;
        self
    }

    /// The detokenizer used for stop strings (without one, stop strings are rejected).
    pub fn detokenizer(mut self, detokenizer: Arc<dyn Detokenizer>) -> Self {
        self.detokenizer = Some(detokenizer);
        self
    }

    /// Starts the scheduler thread.
    pub fn build(self) -> crate::Result<EmbeddedEngine> {
        let c = &self.config;
        if c.max_running_requests == 0 || c.kv_token_budget == 0 {
            return Err(crate::Error::Config(
                "max_running_requests and kv_token_budget must be positive".into(),
            ));
        }
        let pool = c
            .compute_threads
            .map(|threads| crate::compute_pool(threads, "miles-engine"))
            .transpose()?;
        let model_config = self.model.config.clone();
        let device = self.model.lm_head_weight().device();
        let shared = Arc::new(Shared {
            version: AtomicU64::new(c.initial_version.0),
            alive: AtomicBool::new(true),
            stats: Mutex::new(EngineStats::default()),
            metrics: OnceLock::new(),
        });
        let (tx, rx) = mpsc::channel();
        let scheduler = Scheduler::new(
            self.model,
            self.config,
            self.scorer,
            self.detokenizer,
            shared.clone(),
            rx,
        );
        let thread = std::thread::Builder::new()
            .name("miles-engine".into())
            .spawn(move || match pool {
                Some(pool) => pool.install(move || scheduler.run()),
                None => scheduler.run(),
            })
            .map_err(|e| crate::Error::Task(format!("cannot start the engine thread: {e}")))?;
        Ok(EmbeddedEngine {
            commands: tx,
            shared,
            model_config,
            device,
            thread: Mutex::new(Some(thread)),
        })
    }
}

impl EmbeddedEngine {
    /// An engine over `model` with the default scorer and no detokenizer.
    pub fn new(model: CausalLm, config: EngineConfig) -> crate::Result<Self> {
        Self::builder(model).config(config).build()
    }

    /// A builder for an engine over `model`.
    pub fn builder(model: CausalLm) -> EngineBuilder {
        EngineBuilder {
            model,
            config: EngineConfig::default(),
            scorer: Arc::new(PrefillScorer),
            detokenizer: None,
        }
    }

    /// Loads an HF model directory: weights and `config.json`, the EOS ids of
    /// `generation_config.json` / `config.json` (when `config.eos_token_ids` is empty) and
    /// `tokenizer.json` as the detokenizer when present.
    pub fn from_pretrained(
        dir: &Path,
        device: &Device,
        config: EngineConfig,
    ) -> crate::Result<Self> {
        let model = CausalLm::from_pretrained(dir, device).map_err(bridge_err)?;
        let mut config = config;
        if config.eos_token_ids.is_empty() {
            config.eos_token_ids = read_eos_ids(dir);
        }
        let mut builder = Self::builder(model).config(config);
        let tok = dir.join("tokenizer.json");
        if tok.exists() {
            let tokenizer = tokenizers::Tokenizer::from_file(&tok)
                .map_err(|e| crate::Error::Config(format!("cannot load {}: {e}", tok.display())))?;
            builder = builder.detokenizer(Arc::new(tokenizer));
        }
        builder.build()
    }

    /// The served model's configuration.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The device the model lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The version of the loaded weights.
    pub fn current_version(&self) -> WeightVersion {
        WeightVersion(self.shared.version.load(Ordering::SeqCst))
    }

    /// Counters since start.
    pub fn stats(&self) -> EngineStats {
        *self.shared.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `metrics` (SGLang's names: running / queued requests, KV-cache usage, prompt and
    /// generated tokens, requests finished and aborted, time to first token, inter-token
    /// latency, end-to-end latency, weight version) current from the scheduler. Only the
    /// first call takes effect; returns whether this one did.
    pub fn attach_metrics(&self, metrics: Arc<miles_core::prometheus::SglangMetrics>) -> bool {
        metrics.weight_version.set(self.current_version().0 as f64);
        self.shared.metrics.set(metrics).is_ok()
    }

    fn send(&self, cmd: Cmd) -> miles_core::Result<()> {
        self.commands
            .send(cmd)
            .map_err(|_| CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped"))
    }

    async fn swap_model(&self, model: CausalLm, version: WeightVersion) -> miles_core::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Update(Box::new(model), version, tx))?;
        rx.await
            .map_err(|_| CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped"))
    }

    fn build_model(&self, tensors: TensorMap) -> miles_core::Result<CausalLm> {
        CausalLm::from_hf_tensors(&self.model_config, tensors, &self.device)
            .map_err(|e| CoreError::engine(EngineErrorKind::WeightUpdate, e.to_string()))
    }
}

impl EmbeddedEngine {
    /// Stops the engine now, as if its process died: requests in flight end ABORTED with what
    /// they had generated, later calls fail with an `Unavailable` engine error and
    /// [`InferenceEngine::health`] reports it down (a [`crate::Router`] then re-creates it
    /// through its factory). Blocks until the scheduler thread has exited; idempotent.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Cmd::Shutdown);
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
        self.shared.alive.store(false, Ordering::SeqCst);
    }
}

impl Drop for EmbeddedEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[async_trait]
impl InferenceEngine for EmbeddedEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Generate(Box::new(Pending { request, reply: tx })))?;
        rx.await.map_err(|_| {
            CoreError::engine(
                EngineErrorKind::Unavailable,
                "the engine stopped mid-request",
            )
        })?
    }

    async fn update_weights(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        let mut map = TensorMap::new();
        for (name, t) in weights.iter() {
            let dtype = match t.dtype() {
                DType::F32 => FloatDtype::F32,
                DType::BF16 => FloatDtype::Bf16,
                DType::F16 => FloatDtype::F16,
                other => {
                    return Err(CoreError::engine(
                        EngineErrorKind::WeightUpdate,
                        format!(
                            "tensor {name}: dtype {} is not a float weight",
                            other.name()
                        ),
                    ));
                }
            };
            map.insert(
                name.to_string(),
                HostTensor {
                    dtype,
                    shape: t.shape().to_vec(),
                    bytes: t.data().to_vec(),
                },
            );
        }
        let model = self.build_model(map)?;
        self.swap_model(model, version).await
    }

    async fn update_weights_from_disk(
        &self,
        dir: &Path,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        let dir: PathBuf = dir.to_path_buf();
        let tensors = tokio::task::spawn_blocking(move || read_checkpoint_dir(&dir))
            .await
            .map_err(|e| CoreError::engine(EngineErrorKind::Internal, e.to_string()))?
            .map_err(|e| CoreError::engine(EngineErrorKind::WeightUpdate, e.to_string()))?;
        let model = self.build_model(tensors)?;
        self.swap_model(model, version).await
    }

    async fn pause(&self, mode: PauseMode) -> miles_core::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Pause(mode, tx))?;
        rx.await
            .map_err(|_| CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped"))
    }

    async fn resume(&self) -> miles_core::Result<()> {
        self.send(Cmd::Resume)
    }

    async fn flush_cache(&self) -> miles_core::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Flush(tx))?;
        rx.await
            .map_err(|_| CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped"))
    }

    async fn abort(&self, request_id: &RequestId) -> miles_core::Result<()> {
        self.send(Cmd::Abort(request_id.clone()))
    }

    async fn abort_all(&self) -> miles_core::Result<()> {
        self.send(Cmd::AbortAll)
    }

    async fn health(&self) -> miles_core::Result<()> {
        if self.shared.alive.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(CoreError::engine(
                EngineErrorKind::Unavailable,
                "the engine thread has stopped",
            ))
        }
    }

    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        Ok(self.current_version())
    }
}

fn bridge_err(e: miles_bridge::BridgeError) -> crate::Error {
    crate::Error::Config(e.to_string())
}

/// EOS ids from `generation_config.json`, else `config.json` (an id or a list).
pub fn read_eos_ids(dir: &Path) -> Vec<u32> {
    for file in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
            continue;
        };
        let Ok(json) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let ids: Vec<u32> = match json.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| v as u32).into_iter().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        };
        if !ids.is_empty() {
            return ids;
        }
    }
    Vec::new()
}

/// The id of `tokenizer_config.json`'s `eos_token` (a string or `{"content": …}`) in the
/// directory's `tokenizer.json`: the end of a turn for checkpoints whose configs leave
/// `eos_token_id` null (what [`read_eos_ids`] reads). Training and rollout code that needs
/// an end-of-turn id falls back to it; the engine's own stop rule stays the config's.
pub fn eos_from_tokenizer_config(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let json: Value = serde_json::from_str(&text).ok()?;
    let token = match json.get("eos_token")? {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content")?.as_str()?.to_owned(),
        _ => return None,
    };
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).ok()?;
    tokenizer.token_to_id(&token)
}

fn ids_row(tokens: &[u32], device: &Device) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(
            tokens.iter().map(|&t| t as i32).collect(),
            [1, tokens.len()],
        ),
        device,
    )
}

/// Temperature ≥ 0, top-p in (0, 1], min-p in [0, 1] (NaN fails every check).
fn valid_sampling(params: &miles_core::SamplingParams) -> bool {
    params.temperature >= 0.0
        && params.top_p > 0.0
        && params.top_p <= 1.0
        && (0.0..=1.0).contains(&params.min_p)
}

/// A small, fast, seedable generator (SplitMix64), one per sequence.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Samples one token from `logits` with the request's parameters; returns the token and its
/// log-prob under the untempered distribution.
fn sample_token(logits: &[f32], params: &miles_core::SamplingParams, rng: &mut Rng) -> (u32, f64) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = (logits
        .iter()
        .map(|&x| ((x - max) as f64).exp())
        .sum::<f64>())
    .ln()
        + max as f64;
    let greedy = params.temperature <= 0.0 || params.top_k == 1;
    let token = if greedy {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best
    } else {
        let t = params.temperature as f64;
        let u = rng.uniform();
        let plain = params.top_k < 1 && params.top_p >= 1.0 && params.min_p <= 0.0;
        if plain {
            let weights: Vec<f64> = logits
                .iter()
                .map(|&x| ((x as f64 - max as f64) / t).exp())
                .collect();
            pick(&weights, u, |i| i)
        } else {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            if params.top_k > 0 {
                order.truncate(params.top_k as usize);
            }
            let mut probs: Vec<f64> = order
                .iter()
                .map(|&i| ((logits[i] as f64 - max as f64) / t).exp())
                .collect();
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
            if params.min_p > 0.0 {
                let floor = params.min_p as f64 * probs[0];
                let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
                probs.truncate(keep);
            }
            if params.top_p < 1.0 {
                let total: f64 = probs.iter().sum();
                let mut cum = 0.0;
                let mut keep = probs.len();
                for (i, p) in probs.iter().enumerate() {
                    cum += p / total;
                    if cum >= params.top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
                probs.truncate(keep.max(1));
            }
            pick(&probs, u, |i| order[i])
        }
    };
    (token as u32, logits[token] as f64 - lse)
}

/// Index drawn with probability proportional to `weights`, mapped through `map`.
fn pick(weights: &[f64], u: f64, map: impl Fn(usize) -> usize) -> usize {
    let total: f64 = weights.iter().sum();
    let target = u * total;
    let mut cum = 0.0;
    for (i, w) in weights.iter().enumerate() {
        cum += w;
        if target < cum {
            return map(i);
        }
    }
    map(weights.len() - 1)
}

/// One request inside the scheduler.
struct Seq {
    pending: Pending,
    /// Prompt + output so far.
    tokens: Vec<u32>,
    prompt_len: usize,
    max_new: usize,
    log_probs: Vec<f64>,
    /// Routing rows `[positions forwarded, moe layers, top_k]`, flattened.
    routing: Vec<i32>,
    rng: Rng,
    cached_tokens: usize,
    /// Tokens reserved against the KV budget.
    reserved: usize,
    /// Version the KV cache of a retracted sequence was computed with.
    retracted_at: Option<u64>,
    /// Already counted as waiting for KV budget.
    waited: bool,
    finish: Option<(FinishReason, Option<Value>)>,
    /// When the engine received the request.
    arrived: Instant,
    /// When the last token was sampled.
    last_token: Option<Instant>,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens whose keys are in the cache (all but the last sampled one).
    fn cached_len(&self) -> usize {
        if self.output_len() == 0 {
            self.tokens.len()
        } else {
            self.tokens.len() - 1
        }
    }
}

struct PrefixEntry {
    tokens: Vec<u32>,
    cache: KvCache,
    routing: Vec<i32>,
    last_used: u64,
}

struct Scheduler {
    /// The current weights (shared with finished sequences still waiting for their answer).
    model: Arc<CausalLm>,
    config: EngineConfig,
    scorer: Arc<dyn SequenceScorer>,
    detokenizer: Option<Arc<dyn Detokenizer>>,
    shared: Arc<Shared>,
    commands: mpsc::Receiver<Cmd>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    batch: KvCache,
    paused: Option<PauseMode>,
    updates: VecDeque<(Box<CausalLm>, WeightVersion, oneshot::Sender<()>)>,
    /// Finished sequences whose log-probs are still to be recomputed, each with the weights
    /// (and their version) that generated it. They are answered one per scheduler iteration,
    /// so a burst of sequences finishing together never holds a pause or an update for long.
    finished: VecDeque<(Seq, Arc<CausalLm>, WeightVersion)>,
    prefix: Vec<PrefixEntry>,
    clock: u64,
    counter: u64,
    reserved: usize,
    route_width: usize,
    stats: EngineStats,
    /// Start of the current `sglang:gen_throughput` window and the tokens generated before it.
    throughput_mark: (Instant, u64),
}

/// The window over which `sglang:gen_throughput` is measured (SGLang logs it per decode log
/// interval; here it is refreshed once a second).
const THROUGHPUT_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

impl Scheduler {
    fn new(
        model: CausalLm,
        config: EngineConfig,
        scorer: Arc<dyn SequenceScorer>,
        detokenizer: Option<Arc<dyn Detokenizer>>,
        shared: Arc<Shared>,
        commands: mpsc::Receiver<Cmd>,
    ) -> Self {
        let c = &model.config;
        let moe_layers = (0..c.num_hidden_layers)
            .filter(|&l| c.is_moe_layer(l))
            .count();
        let route_width = moe_layers * c.num_experts_per_tok;
        Self {
            model: Arc::new(model),
            config,
            scorer,
            detokenizer,
            shared,
            commands,
            waiting: VecDeque::new(),
            running: Vec::new(),
            batch: KvCache::new(),
            paused: None,
            updates: VecDeque::new(),
            finished: VecDeque::new(),
            prefix: Vec::new(),
            clock: 0,
            counter: 0,
            reserved: 0,
            route_width,
            throughput_mark: (Instant::now(), 0),
            stats: EngineStats::default(),
        }
    }

    fn version(&self) -> WeightVersion {
        WeightVersion(self.shared.version.load(Ordering::SeqCst))
    }

    fn run(mut self) {
        loop {
            let idle = self.running.is_empty()
                && (self.waiting.is_empty() || self.paused.is_some())
                && self.updates.is_empty()
                && self.finished.is_empty();
            let first = if idle {
                match self.commands.recv() {
                    Ok(cmd) => Some(cmd),
                    Err(_) => break,
                }
            } else {
                None
            };
            let mut batch: Vec<Cmd> = first.into_iter().collect();
            batch.extend(self.commands.try_iter());
            if !batch.into_iter().all(|cmd| self.handle(cmd)) {
                break;
            }
            // A panic inside the model (a backend bug, an out-of-memory) fails the requests in
            // flight with a typed error; the engine keeps serving.
            let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if let Some((seq, model, version)) = self.finished.pop_front() {
                    self.answer(seq, &model, version);
                }
                self.apply_updates();
                if self.paused.is_none() && self.updates.is_empty() {
                    self.admit();
                }
                if self.paused.is_none() && !self.running.is_empty() {
                    self.decode_step();
                }
            }));
            if let Err(panic) = step {
                let what = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                self.fail_running(&format!("engine step failed: {what}"));
                self.reserved = 0;
            }
            self.publish_stats();
        }
        // Shutting down: finished sequences get their answer, everything still queued ends
        // as aborted.
        while let Some((seq, model, version)) = self.finished.pop_front() {
            self.answer(seq, &model, version);
        }
        let rest: Vec<Seq> = self
            .waiting
            .drain(..)
            .chain(self.running.drain(..))
            .collect();
        for seq in rest {
            self.finish_aborted(seq);
        }
        self.shared.alive.store(false, Ordering::SeqCst);
    }

    fn publish_stats(&mut self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            *s = self.stats;
        }
        if let Some(metrics) = self.shared.metrics.get() {
            let (since, tokens_then) = self.throughput_mark;
            let elapsed = since.elapsed();
            if elapsed >= THROUGHPUT_WINDOW {
                let tokens = self.stats.generated_tokens;
                metrics
                    .gen_throughput
                    .set(tokens.saturating_sub(tokens_then) as f64 / elapsed.as_secs_f64());
                self.throughput_mark = (Instant::now(), tokens);
            }
            metrics.num_running_reqs.set(self.running.len() as f64);
            metrics.num_queue_reqs.set(self.waiting.len() as f64);
            metrics.num_used_tokens.set(self.reserved as f64);
            metrics
                .token_usage
                .set(self.reserved as f64 / self.config.kv_token_budget.max(1) as f64);
            metrics.weight_version.set(self.version().0 as f64);
        }
    }

    /// Handles one command; `false` to shut down.
    fn handle(&mut self, cmd: Cmd) -> bool {
        match cmd {
            Cmd::Generate(pending) => self.enqueue(*pending),
            Cmd::Abort(rid) => {
                let matches = |s: &Seq| s.pending.request.request_id.as_ref() == Some(&rid);
                if let Some(seq) = self
                    .waiting
                    .iter()
                    .position(matches)
                    .and_then(|i| self.waiting.remove(i))
                {
                    self.finish_aborted(seq);
                }
                if let Some(i) = self.running.iter().position(matches) {
                    self.running[i].finish = Some((FinishReason::Abort, None));
                    self.retire_finished();
                }
            }
            Cmd::AbortAll => self.abort_everything(),
            Cmd::Pause(mode, reply) => {
                match mode {
                    PauseMode::Abort => self.abort_everything(),
                    PauseMode::InPlace => {}
                    PauseMode::Retract => self.retract_running(),
                }
                self.paused = Some(mode);
                let _ = reply.send(());
            }
            Cmd::Resume => self.paused = None,
            Cmd::Flush(reply) => {
                self.prefix.clear();
                let _ = reply.send(());
            }
            Cmd::Update(model, version, reply) => self.updates.push_back((model, version, reply)),
            Cmd::Shutdown => return false,
        }
        true
    }

    fn enqueue(&mut self, pending: Pending) {
        let request = &pending.request;
        let params = &request.sampling_params;
        let bad = |reason: String| -> miles_core::Result<GenerateOutput> {
            Err(CoreError::engine(EngineErrorKind::InvalidRequest, reason))
        };
        let vocab = self.model.config.vocab_size;
        let max_new = params
            .max_new_tokens
            .unwrap_or(self.config.default_max_new_tokens);
        let problem = if request.input_ids.is_empty() {
            Some("input_ids is empty".to_string())
        } else if let Some(t) = request.input_ids.iter().find(|&&t| t as usize >= vocab) {
            Some(format!("token id {t} is outside the vocabulary of {vocab}"))
        } else if params.n != 1 {
            Some(format!(
                "n = {} is not supported by one generate call; send n requests",
                params.n
            ))
        } else if !params.stop.is_empty() && self.detokenizer.is_none() {
            Some("stop strings need a tokenizer; this engine has none".to_string())
        } else if !valid_sampling(params) {
            Some("temperature must be ≥ 0, top_p in (0, 1], min_p in [0, 1]".to_string())
        } else if request.input_ids.len() >= self.model.config.max_position_embeddings {
            Some(format!(
                "prompt of {} tokens does not fit the context of {}",
                request.input_ids.len(),
                self.model.config.max_position_embeddings
            ))
        } else if request.input_ids.len().saturating_add(max_new) > self.config.kv_token_budget {
            Some(format!(
                "prompt ({} tokens) + max_new_tokens ({max_new}) exceeds the KV budget of {} \
                 tokens: this request could never be admitted",
                request.input_ids.len(),
                self.config.kv_token_budget
            ))
        } else {
            None
        };
        if let Some(reason) = problem {
            let _ = pending.reply.send(bad(reason));
            return;
        }
        self.counter += 1;
        let seed = params.sampling_seed.unwrap_or_else(|| {
            self.config
                .seed
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(self.counter)
        });
        let tokens = request.input_ids.clone();
        let prompt_len = tokens.len();
        let max_new = max_new.min(self.model.config.max_position_embeddings - prompt_len);
        self.waiting.push_back(Seq {
            pending,
            tokens,
            prompt_len,
            max_new,
            log_probs: Vec::new(),
            routing: Vec::new(),
            rng: Rng(seed),
            cached_tokens: 0,
            reserved: 0,
            retracted_at: None,
            waited: false,
            finish: None,
            arrived: Instant::now(),
            last_token: None,
        });
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.prompt_tokens_total.inc_by(prompt_len as f64);
        }
    }

    fn abort_everything(&mut self) {
        while let Some(seq) = self.waiting.pop_front() {
            self.finish_aborted(seq);
        }
        for seq in &mut self.running {
            seq.finish = Some((FinishReason::Abort, None));
        }
        self.retire_finished();
    }

    /// Releases the KV cache of running sequences and puts them back at the front of the queue.
    fn retract_running(&mut self) {
        let version = self.version().0;
        let running: Vec<Seq> = self.running.drain(..).collect();
        self.batch = KvCache::new();
        for mut seq in running.into_iter().rev() {
            self.reserved -= seq.reserved;
            seq.reserved = 0;
            seq.retracted_at = Some(version);
            self.waiting.push_front(seq);
        }
    }

    fn apply_updates(&mut self) {
        if self.updates.is_empty() {
            return;
        }
        if self.paused.is_some() {
            // Held sequences cannot continue on new weights without mixing versions.
            for seq in &mut self.running {
                seq.finish = Some((FinishReason::Abort, None));
            }
            self.retire_finished();
        }
        if !self.running.is_empty() {
            return; // wait until no sequence is mid-generation
        }
        let current = self.version().0;
        let stale: Vec<usize> = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, s)| s.retracted_at.is_some_and(|v| v == current))
            .map(|(i, _)| i)
            .collect();
        for i in stale.into_iter().rev() {
            if let Some(seq) = self.waiting.remove(i) {
                self.finish_aborted(seq);
            }
        }
        while let Some((model, version, reply)) = self.updates.pop_front() {
            self.model = Arc::new(*model);
            self.shared.version.store(version.0, Ordering::SeqCst);
            let _ = reply.send(());
        }
        self.prefix.clear();
    }

    fn admit(&mut self) {
        let mut new_caches = Vec::new();
        while self.running.len() + new_caches.len() < self.config.max_running_requests {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = front.tokens.len() + front.max_new - front.output_len();
            if self.reserved + need > self.config.kv_token_budget {
                if !front.waited {
                    self.stats.budget_waits += 1;
                    if let Some(f) = self.waiting.front_mut() {
                        f.waited = true;
                    }
                }
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            seq.reserved = need;
            self.reserved += need;
            match self.prefill(&mut seq) {
                Ok(cache) => {
                    new_caches.push(cache);
                    self.running.push(seq);
                }
                Err(e) => {
                    self.reserved -= seq.reserved;
                    let _ = seq.pending.reply.send(Err(CoreError::engine(
                        EngineErrorKind::Internal,
                        format!("prefill failed: {e}"),
                    )));
                }
            }
        }
        if !new_caches.is_empty() {
            let mut parts = vec![std::mem::take(&mut self.batch)];
            parts.extend(new_caches);
            match KvCache::concat_rows(parts) {
                Ok(batch) => self.batch = batch,
                Err(e) => self.fail_running(&e.to_string()),
            }
            self.stats.max_batch = self.stats.max_batch.max(self.running.len());
        }
        // A sequence may have ended on its first token.
        self.retire_finished();
    }

    /// Runs the prompt (or, for a retracted sequence, everything but its last token) through
    /// the model on a fresh one-row cache, reusing the longest cached prefix.
    fn prefill(&mut self, seq: &mut Seq) -> Result<KvCache, String> {
        let resumed = seq.output_len() > 0;
        let target = seq.cached_len();
        let (mut cache, hit, hit_routing) = self.lookup_prefix(&seq.tokens[..target], !resumed);
        if !resumed {
            seq.cached_tokens = hit;
            self.stats.cached_prompt_tokens += hit as u64;
        }
        seq.routing = hit_routing;
        let rest = &seq.tokens[hit..target];
        if rest.is_empty() {
            // Only a resumed sequence can get here (a fresh one always keeps one token).
            return Ok(cache);
        }
        let device = self.model.lm_head_weight().device();
        let out = self
            .model
            .forward_cached(
                &ModelInput::new(ids_row(rest, &device)),
                &mut cache,
                &Fallthrough,
            )
            .map_err(|e| e.to_string())?;
        self.stats.prefill_tokens += rest.len() as u64;
        if self.route_width > 0 {
            let per_layer = routing_to_host(&out.routing)?;
            append_routing(&mut seq.routing, &per_layer, rest.len());
        }
        if !resumed {
            let [_, m, vocab] = out.logits.dims();
            let last = out
                .logits
                .narrow(1, m - 1, 1)
                .reshape([vocab])
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .map_err(|e| format!("{e:?}"))?;
            self.insert_prefix(
                seq.tokens[..target].to_vec(),
                cache.clone(),
                seq.routing.clone(),
            );
            self.push_token(seq, &last);
        }
        Ok(cache)
    }

    /// Longest cached prefix of `tokens` (at most `len − 1` when `keep_one`): the cache, its
    /// length and its routing rows.
    fn lookup_prefix(&mut self, tokens: &[u32], keep_one: bool) -> (KvCache, usize, Vec<i32>) {
        let limit = if keep_one {
            tokens.len().saturating_sub(1)
        } else {
            tokens.len()
        };
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.prefix.iter().enumerate() {
            let common = e
                .tokens
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(limit);
            if common > 0 && best.is_none_or(|(_, c)| common > c) {
                best = Some((i, common));
            }
        }
        let Some((i, common)) = best else {
            return (KvCache::new(), 0, Vec::new());
        };
        self.clock += 1;
        let entry = &mut self.prefix[i];
        entry.last_used = self.clock;
        let cache = if common == entry.tokens.len() {
            entry.cache.clone()
        } else {
            entry.cache.truncate(common)
        };
        let routing =
            entry.routing[..(common * self.route_width).min(entry.routing.len())].to_vec();
        (cache, common, routing)
    }

    fn insert_prefix(&mut self, tokens: Vec<u32>, cache: KvCache, routing: Vec<i32>) {
        let budget = self.config.prefix_cache_tokens;
        if budget == 0 || tokens.len() > budget || tokens.is_empty() {
            return;
        }
        // An entry that is a prefix of the new one is covered by it.
        self.prefix
            .retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        if self.prefix.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return;
        }
        self.clock += 1;
        self.prefix.push(PrefixEntry {
            tokens,
            cache,
            routing,
            last_used: self.clock,
        });
        while self.prefix.iter().map(|e| e.tokens.len()).sum::<usize>() > budget {
            let Some(oldest) = self
                .prefix
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.prefix.swap_remove(oldest);
        }
    }

    /// Samples the next token of `seq` from `logits` and checks the stop conditions.
    fn push_token(&mut self, seq: &mut Seq, logits: &[f32]) {
        let params = &seq.pending.request.sampling_params;
        let (token, lp) = sample_token(logits, params, &mut seq.rng);
        seq.tokens.push(token);
        seq.log_probs.push(lp);
        self.stats.generated_tokens += 1;
        let now = Instant::now();
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.generation_tokens_total.inc();
            match seq.last_token {
                None => metrics
                    .time_to_first_token_seconds
                    .observe(now.duration_since(seq.arrived).as_secs_f64()),
                Some(last) => metrics
                    .inter_token_latency_seconds
                    .observe(now.duration_since(last).as_secs_f64()),
            }
        }
        seq.last_token = Some(now);
        let produced = seq.output_len();
        let may_stop = produced >= params.min_new_tokens;
        if may_stop
            && (params.stop_token_ids.contains(&token)
                || self.config.eos_token_ids.contains(&token))
        {
            seq.finish = Some((FinishReason::Stop, Some(Value::from(token))));
            return;
        }
        if may_stop
            && !params.stop.is_empty()
            && let Some(detok) = &self.detokenizer
        {
            let text = detok.decode(&seq.tokens[seq.prompt_len..]);
            if let Some(s) = params
                .stop
                .iter()
                .find(|s| !s.is_empty() && text.contains(s.as_str()))
            {
                seq.finish = Some((FinishReason::Stop, Some(Value::from(s.clone()))));
                return;
            }
        }
        if produced >= seq.max_new {
            seq.finish = Some((FinishReason::Length, None));
        }
    }

    fn decode_step(&mut self) {
        let device = self.model.lm_head_weight().device();
        let rows = self.running.len();
        let ids: Vec<i32> = self
            .running
            .iter()
            .map(|s| *s.tokens.last().unwrap_or(&0) as i32)
            .collect();
        let input = Tensor::<2, Int>::from_data(TensorData::new(ids, [rows, 1]), &device);
        let out =
            match self
                .model
                .forward_cached(&ModelInput::new(input), &mut self.batch, &Fallthrough)
            {
                Ok(out) => out,
                Err(e) => {
                    self.fail_running(&e.to_string());
                    return;
                }
            };
        self.stats.decode_steps += 1;
        let vocab = self.model.config.vocab_size;
        let logits = match out
            .logits
            .reshape([rows, vocab])
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
        {
            Ok(v) => v,
            Err(e) => {
                self.fail_running(&format!("{e:?}"));
                return;
            }
        };
        if self.route_width > 0 {
            match routing_to_host(&out.routing) {
                Ok(per_layer) => {
                    let k = self.model.config.num_experts_per_tok;
                    for (r, seq) in self.running.iter_mut().enumerate() {
                        for layer in &per_layer {
                            seq.routing.extend_from_slice(&layer[r * k..(r + 1) * k]);
                        }
                    }
                }
                Err(e) => {
                    self.fail_running(&e);
                    return;
                }
            }
        }
        let mut running = std::mem::take(&mut self.running);
        for (r, seq) in running.iter_mut().enumerate() {
            self.push_token(seq, &logits[r * vocab..(r + 1) * vocab]);
        }
        self.running = running;
        self.retire_finished();
    }

    /// Removes finished sequences from the running batch and answers them.
    fn retire_finished(&mut self) {
        if self.running.iter().all(|s| s.finish.is_none()) {
            return;
        }
        let keep: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].finish.is_none())
            .collect();
        let done_rows: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].finish.is_some())
            .collect();
        // Finished sequences' caches go to the prefix cache (multi-turn reuse).
        if self.config.prefix_cache_tokens > 0 {
            for &i in &done_rows {
                let seq = &self.running[i];
                if seq
                    .finish
                    .as_ref()
                    .is_some_and(|f| f.0 != FinishReason::Abort)
                    && let Ok(one) = self.batch.select_rows(&[i])
                {
                    let cached = seq.cached_len();
                    let tokens = seq.tokens[..cached].to_vec();
                    let routing =
                        seq.routing[..(cached * self.route_width).min(seq.routing.len())].to_vec();
                    self.insert_prefix(tokens, one.compact(), routing);
                }
            }
        }
        self.batch = if keep.is_empty() {
            KvCache::new()
        } else {
            match self.batch.select_rows(&keep) {
                Ok(b) => b,
                Err(e) => {
                    let msg = e.to_string();
                    self.fail_running(&msg);
                    return;
                }
            }
        };
        let mut all: Vec<Option<Seq>> = self.running.drain(..).map(Some).collect();
        for &i in &done_rows {
            if let Some(seq) = all[i].take() {
                self.reserved -= seq.reserved;
                self.finish(seq);
            }
        }
        self.running = all.into_iter().flatten().collect();
        // Keep the padded key axis close to the longest row.
        let longest = self.running.iter().map(Seq::cached_len).max().unwrap_or(0);
        if !self.running.is_empty() && self.batch.len() > longest + longest / 4 + 64 {
            self.batch = self.batch.compact();
        }
    }

    fn fail_running(&mut self, reason: &str) {
        let running: Vec<Seq> = self.running.drain(..).collect();
        self.batch = KvCache::new();
        for seq in running {
            self.reserved = self.reserved.saturating_sub(seq.reserved);
            let _ = seq.pending.reply.send(Err(CoreError::engine(
                EngineErrorKind::Internal,
                reason.to_string(),
            )));
        }
    }

    fn finish_aborted(&mut self, mut seq: Seq) {
        self.reserved = self.reserved.saturating_sub(seq.reserved);
        seq.finish = Some((FinishReason::Abort, None));
        let model = self.model.clone();
        self.answer(seq, &model, self.version());
    }

    /// Answers a finished sequence now, or queues it (with the current weights) when its
    /// log-probs must be recomputed first.
    fn finish(&mut self, seq: Seq) {
        let model = self.model.clone();
        let version = self.version();
        if self.needs_recompute(&seq) {
            self.finished.push_back((seq, model, version));
        } else {
            self.answer(seq, &model, version);
        }
    }

    /// Whether the sequence's log-probs are recomputed by the scorer: a stop or length finish
    /// with generated tokens, when asked for (aborted outputs keep their decode log-probs).
    fn needs_recompute(&self, seq: &Seq) -> bool {
        self.config.recompute_logprobs_via_prefill
            && seq.pending.request.return_logprob
            && seq
                .finish
                .as_ref()
                .is_some_and(|f| f.0 != FinishReason::Abort)
            && seq.tokens.len() > seq.prompt_len
    }

    /// Builds the output of a finished sequence and sends it; `model` holds the weights that
    /// generated it (for the log-prob recompute) and `version` their version.
    fn answer(&mut self, seq: Seq, model: &CausalLm, version: WeightVersion) {
        let recompute = self.needs_recompute(&seq);
        if let Some(metrics) = self.shared.metrics.get() {
            metrics.num_requests_total.inc();
            if matches!(seq.finish, None | Some((FinishReason::Abort, _))) {
                metrics.num_aborted_requests_total.inc();
            }
            metrics
                .e2e_request_latency_seconds
                .observe(seq.arrived.elapsed().as_secs_f64());
        }
        let Seq {
            pending,
            tokens,
            prompt_len,
            mut log_probs,
            routing,
            cached_tokens,
            finish,
            ..
        } = seq;
        let request = &pending.request;
        let (finish_reason, matched_stop) = finish.unwrap_or((FinishReason::Abort, None));
        let output_ids = tokens[prompt_len..].to_vec();
        if recompute {
            match self.scorer.score(model, &tokens, output_ids.len()) {
                Ok(lp) if lp.len() == output_ids.len() => {
                    log_probs = lp.into_iter().map(f64::from).collect();
                }
                Ok(lp) => {
                    let _ = pending.reply.send(Err(CoreError::engine(
                        EngineErrorKind::Internal,
                        format!(
                            "scorer returned {} log-probs for {} tokens",
                            lp.len(),
                            output_ids.len()
                        ),
                    )));
                    return;
                }
                Err(e) => {
                    let _ = pending.reply.send(Err(CoreError::engine(
                        EngineErrorKind::Internal,
                        format!("log-prob recompute failed: {e}"),
                    )));
                    return;
                }
            }
        }
        let routed_experts = if request.return_routed_experts && self.route_width > 0 {
            // SGLang's wire form: every hidden layer, dense layers' rows zero.
            let c = &self.model.config;
            let k = c.num_experts_per_tok;
            let layers = c.num_hidden_layers;
            // A sequence aborted before (or during) prefill has fewer routed rows than
            // tokens: report the rows it has.
            let rows = tokens
                .len()
                .saturating_sub(1)
                .min(routing.len() / self.route_width);
            let start = request.routed_experts_start_len.unwrap_or(0).min(rows);
            let mut data = Vec::with_capacity((rows - start) * layers * k);
            for row in start..rows {
                let mut moe =
                    routing[row * self.route_width..(row + 1) * self.route_width].chunks_exact(k);
                for layer in 0..layers {
                    match c.is_moe_layer(layer).then(|| moe.next()).flatten() {
                        Some(chosen) => data.extend_from_slice(chosen),
                        None => data.extend(std::iter::repeat_n(0, k)),
                    }
                }
            }
            RoutedExperts::new(rows - start, layers, k, data).ok()
        } else {
            None
        };
        let output = GenerateOutput {
            request_id: request.request_id.clone(),
            output_log_probs: if request.return_logprob {
                log_probs
            } else {
                Vec::new()
            },
            output_ids,
            routed_experts,
            finish_reason,
            matched_stop,
            weight_version: version,
            prompt_tokens: prompt_len,
            cached_tokens,
        };
        let _ = pending.reply.send(Ok(output));
    }
}

/// Each MoE layer's chosen experts as host `i32`, `[tokens × top_k]` per layer.
fn routing_to_host(routing: &[miles_bridge::MoeRouting]) -> Result<Vec<Vec<i32>>, String> {
    routing
        .iter()
        .map(|r| {
            r.experts
                .clone()
                .into_data()
                .convert::<i32>()
                .try_to_vec::<i32>()
                .map_err(|e| format!("{e:?}"))
        })
        .collect()
}

/// Appends `tokens` rows (`[layers, top_k]` each) from per-layer `[tokens × top_k]` tables.
fn append_routing(out: &mut Vec<i32>, per_layer: &[Vec<i32>], tokens: usize) {
    let Some(first) = per_layer.first() else {
        return;
    };
    let k = first.len() / tokens.max(1);
    for t in 0..tokens {
        for layer in per_layer {
            out.extend_from_slice(&layer[t * k..(t + 1) * k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::SamplingParams;

    #[test]
    fn greedy_picks_the_argmax_and_reports_its_log_prob() {
        let logits = [0.0f32, 2.0, 1.0];
        let params = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let (tok, lp) = sample_token(&logits, &params, &mut Rng(1));
        assert_eq!(tok, 1);
        let lse = (1.0f64 + 2f64.exp() + 1f64.exp()).ln();
        assert!((lp - (2.0 - lse)).abs() < 1e-12);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.5f32, -1.0, 3.0, 2.9];
        for params in [
            SamplingParams {
                top_k: 1,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 1e-6,
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 0.999,
                ..SamplingParams::default()
            },
        ] {
            for seed in 0..20 {
                assert_eq!(sample_token(&logits, &params, &mut Rng(seed)).0, 2);
            }
        }
    }

    #[test]
    fn top_k_restricts_the_support_and_sampling_follows_the_distribution() {
        let logits = [1.0f32, 0.0, 2.0, -5.0];
        let params = SamplingParams {
            top_k: 2,
            ..SamplingParams::default()
        };
        let mut rng = Rng(42);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample_token(&logits, &params, &mut rng).0 as usize] += 1;
        }
        assert_eq!(counts[1] + counts[3], 0);
        // p(2) = e^2 / (e^2 + e^1) = 0.731.
        let p2 = counts[2] as f64 / 20_000.0;
        assert!((p2 - 0.7311).abs() < 0.015, "p2 = {p2}");
        // Plain sampling at temperature 0.5: p ∝ exp(2x).
        let params = SamplingParams {
            temperature: 0.5,
            ..SamplingParams::default()
        };
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample_token(&logits, &params, &mut rng).0 as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&x| (2.0 * x as f64).exp()).sum();
        let p0 = (2.0f64).exp() / z;
        assert!((counts[0] as f64 / 20_000.0 - p0).abs() < 0.015);
    }

    #[test]
    fn seeded_generators_repeat() {
        let mut a = Rng(7);
        let mut b = Rng(7);
        assert_eq!(
            (0..5).map(|_| a.next_u64()).collect::<Vec<_>>(),
            (0..5).map(|_| b.next_u64()).collect::<Vec<_>>()
        );
    }
}
