//! Overlap of generation and training: the synchronous loop (baseline) against the fully
//! asynchronous one, with the engine and the trainer each busy on one core and rollout time ≈
//! train time. The async loop's wall time per step should approach max(rollout, train)
//! (target ≤ 1.15×), the sync loop's their sum.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use miles_core::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, MemoryMetricsSink, Metrics,
    NamedTensors, PauseMode, PolicyTrainer, RequestId, Result as CoreResult, Sample, TokenId,
    WeightVersion, async_trait,
};
use miles_reward::BuiltinReward;
use miles_rollout::{
    DataSource, LoopConfig, PromptEncoder, PromptRecord, RlLoop, RolloutConfig, RolloutManager,
    SharedTrainer,
};

/// Busy work on the calling thread for `duration` (a core fully used).
fn spin(duration: Duration) {
    let start = Instant::now();
    let mut x = 0u64;
    while start.elapsed() < duration {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// Generates one token per request after `per_request` of busy work on a blocking thread;
/// requests run one at a time (one core).
struct BusyEngine {
    per_request: Duration,
    core: Arc<tokio::sync::Mutex<()>>,
    version: AtomicU64,
}

#[async_trait]
impl InferenceEngine for BusyEngine {
    async fn generate(&self, request: GenerateRequest) -> CoreResult<GenerateOutput> {
        let _core = self.core.lock().await;
        let work = self.per_request;
        let _ = tokio::task::spawn_blocking(move || spin(work)).await;
        Ok(GenerateOutput {
            request_id: request.request_id,
            output_ids: vec![3],
            output_log_probs: vec![-0.1],
            routed_experts: None,
            finish_reason: FinishReason::Stop,
            matched_stop: None,
            weight_version: WeightVersion(self.version.load(Ordering::SeqCst)),
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }
    async fn update_weights(&self, _w: &NamedTensors, version: WeightVersion) -> CoreResult<()> {
        self.version.store(version.0, Ordering::SeqCst);
        Ok(())
    }
    async fn update_weights_from_disk(&self, _d: &Path, version: WeightVersion) -> CoreResult<()> {
        self.version.store(version.0, Ordering::SeqCst);
        Ok(())
    }
    async fn pause(&self, _mode: PauseMode) -> CoreResult<()> {
        Ok(())
    }
    async fn resume(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn flush_cache(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn abort(&self, _id: &RequestId) -> CoreResult<()> {
        Ok(())
    }
    async fn abort_all(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn health(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn weight_version(&self) -> CoreResult<WeightVersion> {
        Ok(WeightVersion(self.version.load(Ordering::SeqCst)))
    }
}

/// Spends `per_step` of busy work per train call (one core).
struct BusyTrainer {
    per_step: Duration,
    version: WeightVersion,
}

impl PolicyTrainer for BusyTrainer {
    fn train(&mut self, _id: u64, _samples: &[Sample]) -> CoreResult<Metrics> {
        spin(self.per_step);
        self.version = self.version.next();
        Ok(Metrics::new())
    }
    fn export_weights(&self) -> CoreResult<NamedTensors> {
        Ok(NamedTensors::new())
    }
    fn weight_version(&self) -> WeightVersion {
        self.version
    }
    fn save_checkpoint(&self, _dir: &Path) -> CoreResult<()> {
        Ok(())
    }
    fn load_checkpoint(&mut self, _dir: &Path) -> CoreResult<()> {
        Ok(())
    }
}

struct Bytes;
impl PromptEncoder for Bytes {
    fn encode(&self, sample: &Sample) -> CoreResult<Vec<TokenId>> {
        Ok(vec![1; 1 + sample.index.unwrap_or(0) as usize % 3])
    }
    fn decode(&self, tokens: &[TokenId]) -> String {
        tokens.iter().map(|t| t.to_string()).collect()
    }
}

/// Enough steps that the async loop's pipeline fill (one rollout before the first step can
/// train) weighs little: ideal async = (STEPS + 1) × 40 ms against sync = STEPS × 80 ms.
const STEPS: u64 = 16;
const GROUPS: usize = 2;
const SAMPLES: usize = 4;
const PER_REQUEST: Duration = Duration::from_millis(5);
/// Rollout per step = GROUPS × SAMPLES × PER_REQUEST = 40 ms = train per step.
const TRAIN: Duration = Duration::from_millis(40);

fn run(asynchronous: bool) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let engine = Arc::new(BusyEngine {
            per_request: PER_REQUEST,
            core: Arc::default(),
            version: AtomicU64::new(0),
        });
        let config = RolloutConfig {
            n_samples_per_prompt: SAMPLES,
            rollout_batch_size: GROUPS,
            rollout_max_response_len: 1,
            ..RolloutConfig::default()
        };
        let manager = Arc::new(
            RolloutManager::new(
                config,
                engine,
                Arc::new(Bytes),
                Arc::new(BuiltinReward::ExactMatch),
            )
            .expect("manager"),
        );
        let prompts = (0..8)
            .map(|i| PromptRecord::text(format!("p{i}"), "3"))
            .collect();
        let data = DataSource::new(prompts, SAMPLES, false, 0).expect("data");
        let trainer: SharedTrainer = Arc::new(Mutex::new(Box::new(BusyTrainer {
            per_step: TRAIN,
            version: WeightVersion(0),
        })));
        let loop_config = LoopConfig {
            num_rollout: STEPS,
            max_weight_staleness: Some(1),
            ..LoopConfig::default()
        };
        let mut rl = RlLoop::new(
            loop_config,
            manager,
            trainer,
            Arc::new(MemoryMetricsSink::new()),
            data,
        )
        .expect("loop");
        if asynchronous {
            rl.run_async().await.expect("async loop");
        } else {
            rl.run_sync().await.expect("sync loop");
        }
    });
}

fn overlap(c: &mut Criterion) {
    let mut group = c.benchmark_group("loop_overlap");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(15));
    group.bench_function("baseline", |b| b.iter(|| run(false)));
    group.bench_function("async", |b| b.iter(|| run(true)));
    group.finish();
    // Target: async per step ≤ 1.15 × max(rollout, train) while sync ≈ rollout + train, so
    // async / sync ≤ 1.15 / 2.
    println!(
        "xtask-result: loop_overlap ours=@loop_overlap/async baseline=@loop_overlap/baseline \
         target=<=0.575 note=async vs sync loop, {STEPS} steps, rollout = train = {} ms per step",
        TRAIN.as_millis()
    );
    println!(
        "loop_overlap: {STEPS} steps, rollout ≈ train ≈ {} ms per step: ideal async ≈ {} ms, sync ≈ {} ms",
        TRAIN.as_millis(),
        (STEPS as u128 + 1) * TRAIN.as_millis(),
        2 * STEPS as u128 * TRAIN.as_millis()
    );
}

criterion_group!(benches, overlap);
criterion_main!(benches);
