//! A real (tiny) policy for orchestration tests: a tabular softmax policy over 8 tokens served
//! by an async engine that samples token by token, supports abort, pause modes, versioned
//! in-place weight updates and can be killed, and a REINFORCE / GRPO trainer for the same
//! table. The task: answer "3" (exact match), so the reward must rise as the loops train.
#![allow(dead_code, unused_imports)]

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use miles_core::{
    EngineErrorKind, Error as CoreError, FinishReason, GenerateOutput, GenerateRequest,
    InferenceEngine, MemoryMetricsSink, Metrics, NamedTensors, PauseMode, PolicyTrainer, Prompt,
    RequestId, Result as CoreResult, Reward, RewardFn, Sample, SampleStatus, TensorBytes, TokenId,
    WeightVersion, async_trait,
};
use miles_rollout::{PromptEncoder, SharedTrainer};
use tokio::sync::Notify;

pub const VOCAB: usize = 8;

/// (trainer version at train time, oldest version of a trained sample, sample index).
pub type Seen = (WeightVersion, Option<WeightVersion>, Option<u64>);
pub const STOP: TokenId = 7;

pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
    let exp: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

pub struct Rng(pub u64);
impl Rng {
    pub fn uniform(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct EngineState {
    logits: Vec<f32>,
    version: WeightVersion,
    paused: Option<PauseMode>,
}

/// Samples from softmax(logits), one token per `delay`.
pub struct TabularEngine {
    state: Mutex<EngineState>,
    resumed: Notify,
    abort_epoch: AtomicU64,
    aborted: Mutex<HashSet<RequestId>>,
    delay: Duration,
    /// Prompts whose second token is ≥ 2 ("q2", "q3", …) generate 10× slower.
    slow_tail: bool,
    counter: AtomicU64,
    pub generated: AtomicUsize,
    /// A dead engine refuses new requests (unavailable), fails in-flight ones and health checks.
    pub dead: AtomicBool,
}

impl TabularEngine {
    pub fn new(delay: Duration) -> Arc<Self> {
        Self::with_slow_tail(delay, false)
    }

    pub fn with_slow_tail(delay: Duration, slow_tail: bool) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(EngineState {
                logits: vec![0.0; VOCAB],
                version: WeightVersion(0),
                paused: None,
            }),
            resumed: Notify::new(),
            abort_epoch: AtomicU64::new(0),
            aborted: Mutex::new(HashSet::new()),
            delay,
            slow_tail,
            counter: AtomicU64::new(0),
            generated: AtomicUsize::new(0),
            dead: AtomicBool::new(false),
        })
    }
}

#[async_trait]
impl InferenceEngine for TabularEngine {
    async fn generate(&self, request: GenerateRequest) -> CoreResult<GenerateOutput> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(CoreError::engine(
                EngineErrorKind::Unavailable,
                "connection refused",
            ));
        }
        if request.input_ids.is_empty() {
            return Err(CoreError::engine(
                EngineErrorKind::InvalidRequest,
                "empty input_ids",
            ));
        }
        let epoch = self.abort_epoch.load(Ordering::SeqCst);
        let seed = request
            .sampling_params
            .sampling_seed
            .unwrap_or_else(|| self.counter.fetch_add(1, Ordering::SeqCst));
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xABCD);
        let max = request.sampling_params.max_new_tokens.unwrap_or(16);
        let (mut ids, mut log_probs) = (Vec::new(), Vec::new());
        let mut finish = FinishReason::Length;
        let delay = if self.slow_tail && request.input_ids.get(1).is_some_and(|&t| t >= 2) {
            self.delay * 10
        } else {
            self.delay
        };
        while ids.len() < max {
            loop {
                let paused = self.state.lock().unwrap().paused;
                match paused {
                    None => break,
                    Some(PauseMode::Abort) => {
                        finish = FinishReason::Abort;
                        break;
                    }
                    Some(_) => self.resumed.notified().await,
                }
            }
            let cancelled = self.abort_epoch.load(Ordering::SeqCst) != epoch
                || request
                    .request_id
                    .as_ref()
                    .is_some_and(|id| self.aborted.lock().unwrap().contains(id));
            if self.dead.load(Ordering::SeqCst) {
                return Err(CoreError::engine(
                    EngineErrorKind::Internal,
                    "engine process died",
                ));
            }
            if cancelled || finish == FinishReason::Abort {
                finish = FinishReason::Abort;
                break;
            }
            let probs = softmax(&self.state.lock().unwrap().logits);
            let u = rng.uniform();
            let mut acc = 0.0;
            let mut token = VOCAB - 1;
            for (t, p) in probs.iter().enumerate() {
                acc += p;
                if u < acc {
                    token = t;
                    break;
                }
            }
            ids.push(token as TokenId);
            log_probs.push(probs[token].ln());
            self.generated.fetch_add(1, Ordering::SeqCst);
            if request
                .sampling_params
                .stop_token_ids
                .contains(&(token as TokenId))
            {
                finish = FinishReason::Stop;
                break;
            }
            tokio::time::sleep(delay).await;
        }
        Ok(GenerateOutput {
            request_id: request.request_id,
            output_ids: ids,
            output_log_probs: log_probs,
            routed_experts: None,
            finish_reason: finish,
            matched_stop: None,
            weight_version: self.state.lock().unwrap().version,
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
    ) -> CoreResult<()> {
        let logits = weights
            .get("logits")
            .ok_or_else(|| CoreError::engine(EngineErrorKind::WeightUpdate, "missing logits"))?
            .to_f32()?;
        let mut state = self.state.lock().unwrap();
        if version < state.version {
            return Err(CoreError::engine(
                EngineErrorKind::WeightUpdate,
                "version went backwards",
            ));
        }
        state.logits = logits;
        state.version = version;
        Ok(())
    }

    async fn update_weights_from_disk(
        &self,
        _dir: &Path,
        _version: WeightVersion,
    ) -> CoreResult<()> {
        Err(CoreError::engine(
            EngineErrorKind::WeightUpdate,
            "not supported",
        ))
    }

    async fn pause(&self, mode: PauseMode) -> CoreResult<()> {
        self.state.lock().unwrap().paused = Some(mode);
        Ok(())
    }

    async fn resume(&self) -> CoreResult<()> {
        self.state.lock().unwrap().paused = None;
        self.resumed.notify_waiters();
        Ok(())
    }

    async fn flush_cache(&self) -> CoreResult<()> {
        Ok(())
    }

    async fn abort(&self, request_id: &RequestId) -> CoreResult<()> {
        self.aborted.lock().unwrap().insert(request_id.clone());
        Ok(())
    }

    async fn abort_all(&self) -> CoreResult<()> {
        self.abort_epoch.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn health(&self) -> CoreResult<()> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(CoreError::engine(EngineErrorKind::Unavailable, "dead"));
        }
        Ok(())
    }

    async fn weight_version(&self) -> CoreResult<WeightVersion> {
        Ok(self.state.lock().unwrap().version)
    }
}

/// Tokens are digits: prompt text bytes → ids, ids → digits (the stop token decodes to "").
pub struct DigitEncoder;
impl PromptEncoder for DigitEncoder {
    fn encode(&self, sample: &Sample) -> CoreResult<Vec<TokenId>> {
        match &sample.prompt {
            Prompt::Text(t) => Ok(t.bytes().map(|b| TokenId::from(b) % VOCAB as u32).collect()),
            Prompt::Messages(_) => Err(CoreError::Reward("text prompts only".into())),
        }
    }
    fn decode(&self, tokens: &[TokenId]) -> String {
        tokens
            .iter()
            .filter(|&&t| t != STOP)
            .map(|t| t.to_string())
            .collect()
    }
}

/// REINFORCE with group-mean baselines on the logit table; records what it trained on.
pub struct TabularTrainer {
    logits: Vec<f32>,
    lr: f32,
    version: WeightVersion,
    /// (trainer version at train time, oldest version of each trained sample, sample index).
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl PolicyTrainer for TabularTrainer {
    fn train(&mut self, _rollout_id: u64, samples: &[Sample]) -> CoreResult<Metrics> {
        let probs = softmax(&self.logits);
        let mut grad = vec![0.0f64; VOCAB];
        let mut groups: std::collections::BTreeMap<u64, Vec<&Sample>> = Default::default();
        for s in samples {
            groups
                .entry(s.group_index.unwrap_or(0))
                .or_default()
                .push(s);
            self.seen
                .lock()
                .unwrap()
                .push((self.version, s.oldest_weight_version(), s.index));
        }
        for group in groups.values() {
            let rewards: Vec<f64> = group
                .iter()
                .map(|s| s.scalar_reward(None).unwrap_or(0.0))
                .collect();
            let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
            for (s, r) in group.iter().zip(&rewards) {
                let mask = s.effective_loss_mask();
                for (t, m) in s.response_tokens().iter().zip(mask) {
                    if m == 0 {
                        continue;
                    }
                    for (v, g) in grad.iter_mut().enumerate() {
                        let onehot = if v == *t as usize { 1.0 } else { 0.0 };
                        *g += (r - mean) * (onehot - probs[v]);
                    }
                }
            }
        }
        let n = samples.len().max(1) as f64;
        for (l, g) in self.logits.iter_mut().zip(&grad) {
            *l += self.lr * (*g / n) as f32;
        }
        self.version = self.version.next();
        Ok(Metrics::from([(
            "train/p3".to_string(),
            softmax(&self.logits)[3],
        )]))
    }

    fn export_weights(&self) -> CoreResult<NamedTensors> {
        let mut t = NamedTensors::new();
        t.insert("logits", TensorBytes::from_f32(vec![VOCAB], &self.logits)?);
        Ok(t)
    }

    fn weight_version(&self) -> WeightVersion {
        self.version
    }

    fn save_checkpoint(&self, dir: &Path) -> CoreResult<()> {
        std::fs::create_dir_all(dir).map_err(|e| CoreError::io(dir, e))?;
        let mut t = self.export_weights()?;
        t.set_metadata("version", self.version.to_string());
        let path = dir.join("model.safetensors");
        std::fs::write(&path, t.to_safetensors_bytes()).map_err(|e| CoreError::io(path, e))
    }

    fn load_checkpoint(&mut self, dir: &Path) -> CoreResult<()> {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| CoreError::io(path, e))?;
        let t = NamedTensors::from_safetensors_bytes(&bytes)?;
        self.logits = t
            .get("logits")
            .ok_or_else(|| CoreError::Trainer("no logits".into()))?
            .to_f32()?;
        self.version = t.metadata()["version"].parse()?;
        Ok(())
    }
}

pub fn trainer(seen: &Arc<Mutex<Vec<Seen>>>) -> SharedTrainer {
    Arc::new(Mutex::new(Box::new(TabularTrainer {
        logits: vec![0.0; VOCAB],
        lr: 8.0,
        version: WeightVersion(0),
        seen: seen.clone(),
    })))
}
