//! The engine handle: [`EmbeddedEngine`] and its [`EngineBuilder`], implementing
//! [`InferenceEngine`] by sending commands to the scheduler thread.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use async_trait::async_trait;
use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelConfig, MoeDispatch, Precision};
use miles_core::{
    DType, EngineErrorKind, Error as CoreError, GenerateOutput, GenerateRequest, InProcessWeights,
    InferenceEngine, InputLogprobRequest, InputLogprobs, MemoryTag, NamedTensors, PauseMode,
    RequestId, WeightVersion,
};
use tokio::sync::oneshot;

use crate::command::{Cmd, Detokenizer, EngineStats, Pending, Shared};
use crate::config::{EngineConfig, read_eos_ids};
use crate::error::{Error, Result};
use crate::scheduler::Scheduler;
use crate::step::{SequenceScorer, TrainerScorer};

/// The embedded burn inference engine (see the module docs).
pub struct EmbeddedEngine {
    commands: mpsc::Sender<Cmd>,
    shared: Arc<Shared>,
    model_config: ModelConfig,
    device: Device,
    precision: Precision,
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

    /// The scorer used by `recompute_logprobs_via_prefill` (default [`TrainerScorer`]: the
    /// trainer's sequence scoring).
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
    pub fn build(self) -> Result<EmbeddedEngine> {
        let c = &self.config;
        let c_precision = c.precision;
        if c.max_running_requests == 0 || c.kv_token_budget == 0 {
            return Err(Error::Config(
                "max_running_requests and kv_token_budget must be positive".into(),
            ));
        }
        // The scheduler always runs inside a pool of the engine's own, so a step's parallel
        // ops fork from a pool thread (which then takes part in the work) instead of being
        // injected into the global pool from outside and waited for (a sleep and a wake-up
        // per op: 1.5x slower at one sequence on 2 cores).
        let threads = c
            .compute_threads
            .unwrap_or_else(|| rayon::current_num_threads().max(1));
        let pool = compute_pool(threads)?;
        c.precision
            .check_device(&self.model.lm_head_weight().device())
            .map_err(bridge_err)?;
        let model = self.model.to_precision(c.precision);
        let model_config = model.config.clone();
        let device = model.lm_head_weight().device();
        let shared = Arc::new(Shared {
            version: AtomicU64::new(c.initial_version.0),
            alive: AtomicBool::new(true),
            weights_released: AtomicBool::new(false),
            kv_released: AtomicBool::new(false),
            stats: Mutex::new(EngineStats::default()),
            metrics: OnceLock::new(),
        });
        let (tx, rx) = mpsc::channel();
        let scheduler = Scheduler::new(
            model,
            self.config,
            self.scorer,
            self.detokenizer,
            shared.clone(),
            rx,
        )?;
        let thread = std::thread::Builder::new()
            .name("miles-engine".into())
            .spawn(move || pool.install(move || scheduler.run()))
            .map_err(|e| Error::Task(format!("cannot start the engine thread: {e}")))?;
        Ok(EmbeddedEngine {
            commands: tx,
            shared,
            model_config,
            device,
            precision: c_precision,
            thread: Mutex::new(Some(thread)),
        })
    }
}

impl EmbeddedEngine {
    /// An engine over `model` with the default scorer and no detokenizer.
    pub fn new(model: CausalLm, config: EngineConfig) -> Result<Self> {
        Self::builder(model).config(config).build()
    }

    /// A builder for an engine over `model`.
    pub fn builder(model: CausalLm) -> EngineBuilder {
        EngineBuilder {
            model,
            config: EngineConfig::default(),
            scorer: Arc::new(TrainerScorer::default()),
            detokenizer: None,
        }
    }

    /// Loads an HF model directory: weights and `config.json`, the EOS ids of
    /// `generation_config.json` / `config.json` (when `config.eos_token_ids` is empty) and
    /// `tokenizer.json` as the detokenizer when present.
    pub fn from_pretrained(dir: &Path, device: &Device, config: EngineConfig) -> Result<Self> {
        let model =
            CausalLm::from_pretrained_in(dir, device, config.precision).map_err(bridge_err)?;
        let mut config = config;
        if config.eos_token_ids.is_empty() {
            config.eos_token_ids = read_eos_ids(dir);
        }
        let mut builder = Self::builder(model).config(config);
        let tok = dir.join("tokenizer.json");
        if tok.exists() {
            let tokenizer = tokenizers::Tokenizer::from_file(&tok)
                .map_err(|e| Error::Config(format!("cannot load {}: {e}", tok.display())))?;
            builder = builder.detokenizer(Arc::new(tokenizer));
        }
        builder.build()
    }

    /// The served model's configuration.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The dtype the engine holds its weights in and computes with
    /// ([`EngineConfig::precision`]).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The device the model lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The version of the loaded weights.
    pub fn current_version(&self) -> WeightVersion {
        WeightVersion(self.shared.version.load(Ordering::SeqCst))
    }

    /// What the engine holds released now
    /// ([`InferenceEngine::release_memory_occupation`]; empty while it serves).
    pub fn released_memory(&self) -> Vec<MemoryTag> {
        let mut tags = Vec::new();
        if self.shared.weights_released.load(Ordering::SeqCst) {
            tags.push(MemoryTag::Weights);
        }
        if self.shared.kv_released.load(Ordering::SeqCst) {
            tags.push(MemoryTag::KvCache);
        }
        tags
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

    fn build_model(&self, tensors: NamedTensors) -> miles_core::Result<CausalLm> {
        CausalLm::from_hf_tensors_in(&self.model_config, tensors, &self.device, self.precision)
            .map_err(|e| CoreError::engine(EngineErrorKind::WeightUpdate, e.to_string()))
    }
}

impl EmbeddedEngine {
    /// Stops the engine now, as if its process died: every request not yet answered (queued,
    /// running, or done and waiting for its log-prob recompute) ends ABORTED with what it had
    /// generated and its decode-time log-probs, later calls fail with an `Unavailable` engine error and
    /// [`InferenceEngine::health`] reports it down (miles-session's `Router` then re-creates it
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

    async fn input_logprobs(
        &self,
        request: InputLogprobRequest,
    ) -> miles_core::Result<InputLogprobs> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::InputLogprobs(Box::new(request), tx))?;
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
        if let Some((name, t)) = weights
            .iter()
            .find(|(_, t)| !matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16))
        {
            return Err(CoreError::engine(
                EngineErrorKind::WeightUpdate,
                format!(
                    "tensor {name}: dtype {} is not a float weight",
                    t.dtype().name()
                ),
            ));
        }
        let model = self.build_model(weights.clone())?;
        self.swap_model(model, version).await
    }

    fn takes_in_process_weights(&self) -> bool {
        true
    }

    /// Takes a `CausalLm` of the same configuration on the engine's device (the trainer's
    /// model, sharing its buffers): cast to the engine's precision when it differs, MoE
    /// dispatch back to the loaded default, then swapped in as a host update is. Anything
    /// else is refused (`Ok(false)`).
    async fn update_weights_in_process(
        &self,
        weights: &InProcessWeights,
        version: WeightVersion,
    ) -> miles_core::Result<bool> {
        let Some(model) = weights.downcast_ref::<CausalLm>() else {
            return Ok(false);
        };
        if model.config != self.model_config
            || model.lora.is_some()
            || model.lm_head_weight().device() != self.device
        {
            return Ok(false);
        }
        let mut model = model.clone().to_precision(self.precision);
        model.set_moe_dispatch(MoeDispatch::default());
        self.swap_model(model, version).await?;
        Ok(true)
    }

    async fn update_weights_from_disk(
        &self,
        dir: &Path,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        let dir: PathBuf = dir.to_path_buf();
        let tensors = tokio::task::spawn_blocking(move || NamedTensors::read_hf_checkpoint(&dir))
            .await
            .map_err(|e| CoreError::engine(EngineErrorKind::Internal, e.to_string()))?
            .map_err(|e| CoreError::engine(EngineErrorKind::WeightUpdate, e.to_string()))?;
        let model = self.build_model(tensors)?;
        self.swap_model(model, version).await
    }

    /// Releases the served weights (the trainer's buffers in process, and the decode copies)
    /// and / or the KV pool once nothing generates (see the crate's `release` module docs).
    async fn release_memory_occupation(&self, tags: &[MemoryTag]) -> miles_core::Result<bool> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::Release(tags.to_vec(), tx))?;
        rx.await.map_err(|_| {
            CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped")
        })?;
        Ok(true)
    }

    /// Allocates the KV pool again (after the weights are back: an `Internal` engine error
    /// before); released weights come back with the next weight update.
    async fn resume_memory_occupation(&self, tags: &[MemoryTag]) -> miles_core::Result<bool> {
        let (tx, rx) = oneshot::channel();
        self.send(Cmd::ResumeMemory(tags.to_vec(), tx))?;
        rx.await
            .map_err(|_| CoreError::engine(EngineErrorKind::Unavailable, "the engine has stopped"))?
            .map_err(|e| CoreError::engine(EngineErrorKind::Internal, e))?;
        Ok(true)
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

fn bridge_err(e: miles_bridge::BridgeError) -> Error {
    Error::Config(e.to_string())
}

/// The engine's own rayon pool of `threads` threads (`miles-engine-N`).
fn compute_pool(threads: usize) -> Result<rayon::ThreadPool> {
    if threads == 0 {
        return Err(Error::Config("compute_threads must be >= 1".into()));
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("miles-engine-{i}"))
        .build()
        .map_err(|e| Error::Task(format!("cannot start {threads} compute threads: {e}")))
}
