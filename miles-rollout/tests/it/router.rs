//! The router: sticky routing, least outstanding requests, failover, re-admission with weight
//! catch-up, and an RL loop that survives an engine dying mid-run.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use miles_core::{
    EngineErrorKind, Error as CoreError, GenerateRequest, InferenceEngine, MemoryMetricsSink,
    NamedTensors, SamplingParams, TensorBytes, WeightVersion,
};
use miles_reward::BuiltinReward;
use miles_rollout::{DataSource, LoopConfig, PromptRecord, RlLoop, RolloutConfig, RolloutManager};
use miles_session::sglang::{EngineFactory, Router};

fn request(key: Option<&str>, tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(
        vec![1, 2],
        SamplingParams {
            max_new_tokens: Some(tokens),
            ..SamplingParams::default()
        },
    );
    request.routing_key = key.map(str::to_owned);
    request
}

fn engines(n: usize, delay: Duration) -> Vec<Arc<TabularEngine>> {
    (0..n).map(|_| TabularEngine::new(delay)).collect()
}

fn router(engines: &[Arc<TabularEngine>], factory: Option<EngineFactory>) -> Arc<Router> {
    Arc::new(Router::new(
        engines
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let engine: Arc<dyn InferenceEngine> = e.clone();
                (format!("engine-{i}"), engine, factory.clone())
            })
            .collect(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sticky_keys_and_least_outstanding_spreading() {
    let fleet = engines(3, Duration::from_millis(2));
    let router = router(&fleet, None);
    // Same routing key → same engine, every time.
    for _ in 0..5 {
        router
            .generate(request(Some("session-a"), 2))
            .await
            .unwrap();
    }
    let counts: Vec<usize> = fleet
        .iter()
        .map(|e| e.generated.load(Ordering::SeqCst))
        .collect();
    assert_eq!(counts.iter().filter(|&&c| c > 0).count(), 1, "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 10);
    // Concurrent unkeyed requests spread over the least loaded engines.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let router = router.clone();
        tasks.spawn(async move { router.generate(request(None, 20)).await.unwrap() });
    }
    while tasks.join_next().await.is_some() {}
    let after: Vec<usize> = fleet
        .iter()
        .map(|e| e.generated.load(Ordering::SeqCst))
        .collect();
    let added: Vec<usize> = after.iter().zip(&counts).map(|(a, b)| a - b).collect();
    assert_eq!(added, [40, 40, 40], "two 20-token requests per engine");
    assert_eq!(router.outstanding(), [0, 0, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_abort_and_readmission_with_weight_catch_up() {
    let fleet = engines(2, Duration::from_millis(2));
    let replacement = TabularEngine::new(Duration::from_millis(2));
    let spare = replacement.clone();
    let factory: EngineFactory = Arc::new(move || Ok(spare.clone() as Arc<dyn InferenceEngine>));
    let router = router(&fleet, Some(factory));
    let mut weights = NamedTensors::new();
    weights.insert(
        "logits",
        TensorBytes::from_f32(vec![VOCAB], &[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0]).unwrap(),
    );
    router
        .update_weights(&weights, WeightVersion(3))
        .await
        .unwrap();
    assert_eq!(router.weight_version().await.unwrap(), WeightVersion(3));

    // A request in flight on a dying engine ends ABORTED, never silently lost.
    let keyed = router.clone();
    let in_flight = tokio::spawn(async move { keyed.generate(request(Some("s"), 200)).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let victim = fleet
        .iter()
        .position(|e| e.generated.load(Ordering::SeqCst) > 0)
        .unwrap();
    fleet[victim].dead.store(true, Ordering::SeqCst);
    let outcome = in_flight.await.unwrap();
    assert!(
        matches!(
            outcome,
            Err(CoreError::Engine {
                kind: EngineErrorKind::Aborted,
                ..
            })
        ),
        "{outcome:?}"
    );
    assert_eq!(router.healthy_engines(), [format!("engine-{}", 1 - victim)]);
    // New requests, even with the same key, go to the survivor.
    let output = router.generate(request(Some("s"), 3)).await.unwrap();
    assert_eq!(output.weight_version, WeightVersion(3));

    // A dead engine that refuses connections is retried elsewhere transparently.
    fleet[victim].dead.store(false, Ordering::SeqCst);
    fleet[1 - victim].dead.store(true, Ordering::SeqCst);
    // engine-(1-victim) is still in rotation but refuses: the router retries on nobody else
    // healthy yet, so it reports unavailable; the health check then swaps in the replacement.
    let refused = router.generate(request(None, 3)).await;
    assert!(matches!(
        refused,
        Err(CoreError::Engine {
            kind: EngineErrorKind::Unavailable,
            ..
        })
    ));
    let healthy = router.check_health().await;
    assert_eq!(
        healthy.len(),
        2,
        "both slots re-created from the factory: {healthy:?}"
    );
    // The re-created engine caught up to the fleet's weights before re-admission.
    assert_eq!(
        replacement.weight_version().await.unwrap(),
        WeightVersion(3)
    );
    let output = router.generate(request(None, 5)).await.unwrap();
    assert_eq!(output.weight_version, WeightVersion(3));
    assert!(
        output.output_ids.iter().filter(|&&t| t == 3).count() >= 4,
        "weights applied: {:?}",
        output.output_ids
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_completes_when_an_engine_dies_mid_run() {
    let fleet = engines(2, Duration::from_millis(1));
    let spare = TabularEngine::new(Duration::from_millis(1));
    let factory_engine = spare.clone();
    let factory: EngineFactory =
        Arc::new(move || Ok(factory_engine.clone() as Arc<dyn InferenceEngine>));
    let router = router(&fleet, Some(factory));
    let seen = Arc::default();
    let sink = Arc::new(MemoryMetricsSink::new());
    let mut config = RolloutConfig {
        n_samples_per_prompt: 8,
        rollout_batch_size: 2,
        rollout_max_response_len: 1,
        ..RolloutConfig::default()
    };
    config.sampling.stop_token_ids = vec![STOP];
    let manager = Arc::new(
        RolloutManager::new(
            config,
            router.clone(),
            Arc::new(DigitEncoder),
            Arc::new(BuiltinReward::ExactMatch),
        )
        .unwrap(),
    );
    let prompts = (0..4)
        .map(|i| PromptRecord::text(format!("q{i}"), "3"))
        .collect();
    let data = DataSource::new(prompts, 8, false, 0).unwrap();
    let loop_config = LoopConfig {
        num_rollout: 10,
        ..LoopConfig::default()
    };
    let mut rl = RlLoop::new(loop_config, manager, trainer(&seen), sink.clone(), data).unwrap();
    let killer_fleet = fleet.clone();
    let killer_router = router.clone();
    let chaos = tokio::spawn(async move {
        // Kill engine 0 once training is under way, then let the health checker restart it.
        while killer_fleet[1].generated.load(Ordering::SeqCst) < 20 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        killer_fleet[0].dead.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(30)).await;
        killer_router.check_health().await
    });
    rl.run_sync().await.unwrap();
    let healthy = chaos.await.unwrap();
    let steps = sink.steps();
    assert_eq!(steps.len(), 10, "every step ran");
    assert!(!healthy.is_empty());
    assert!(
        steps.last().unwrap().1["rollout/raw_reward"] > 0.5,
        "still learned"
    );
    // Every trained sample came from the current weights: nothing stale slipped through.
    for (trainer_version, oldest, _) in seen.lock().unwrap().iter() {
        if let Some(oldest) = oldest {
            assert_eq!(oldest, trainer_version);
        }
    }
    assert_eq!(router.weight_version().await.unwrap(), WeightVersion(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_cannot_load_an_update_keeps_serving_and_gets_the_next_one() {
    let fleet = engines(2, Duration::from_millis(2));
    let router = router(&fleet, None);
    let weights = |favourite: usize| {
        let mut logits = vec![0.0; VOCAB];
        logits[favourite] = 9.0;
        let mut t = NamedTensors::new();
        t.insert(
            "logits",
            TensorBytes::from_f32(vec![VOCAB], &logits).unwrap(),
        );
        t
    };
    // Engine 0 is already at version 5, so version 3 is refused there ("went backwards").
    fleet[0]
        .update_weights(&weights(2), WeightVersion(5))
        .await
        .unwrap();
    router
        .update_weights(&weights(3), WeightVersion(3))
        .await
        .unwrap();
    assert_eq!(
        router.healthy_engines().len(),
        2,
        "the refusing engine stays in rotation"
    );
    assert_eq!(fleet[0].weight_version().await.unwrap(), WeightVersion(5));
    assert_eq!(fleet[1].weight_version().await.unwrap(), WeightVersion(3));
    assert_eq!(router.weight_version().await.unwrap(), WeightVersion(5));
    // Both keep serving; each answer carries the version that produced it.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let router = router.clone();
        tasks.spawn(async move { router.generate(request(None, 10)).await.unwrap() });
    }
    let mut versions = std::collections::BTreeSet::new();
    while let Some(output) = tasks.join_next().await {
        versions.insert(output.unwrap().weight_version);
    }
    assert_eq!(versions.len(), 2, "{versions:?}");
    // The next version reaches every engine.
    router
        .update_weights(&weights(4), WeightVersion(6))
        .await
        .unwrap();
    for engine in &fleet {
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(6));
    }
    // An update no engine can load is an error, and the fleet still serves.
    let mut empty = NamedTensors::new();
    empty.insert("other", TensorBytes::from_f32(vec![1], &[0.0]).unwrap());
    let err = router.update_weights(&empty, WeightVersion(7)).await;
    assert!(
        matches!(
            err,
            Err(CoreError::Engine {
                kind: EngineErrorKind::WeightUpdate,
                ..
            })
        ),
        "{err:?}"
    );
    assert_eq!(router.healthy_engines().len(), 2);
    let output = router.generate(request(None, 2)).await.unwrap();
    assert_eq!(output.weight_version, WeightVersion(6));
}

/// An engine whose weight update waits until every engine of the fleet has started its own:
/// a router that pushes to one engine after the other never gets past the first.
struct Rendezvous {
    inner: Arc<TabularEngine>,
    barrier: Arc<tokio::sync::Barrier>,
}

#[miles_core::async_trait]
impl InferenceEngine for Rendezvous {
    async fn generate(
        &self,
        request: GenerateRequest,
    ) -> miles_core::Result<miles_core::GenerateOutput> {
        self.inner.generate(request).await
    }
    async fn update_weights(
        &self,
        weights: &NamedTensors,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        self.barrier.wait().await;
        self.inner.update_weights(weights, version).await
    }
    async fn update_weights_from_disk(
        &self,
        dir: &std::path::Path,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        self.barrier.wait().await;
        self.inner.update_weights_from_disk(dir, version).await
    }
    async fn pause(&self, mode: miles_core::PauseMode) -> miles_core::Result<()> {
        self.inner.pause(mode).await
    }
    async fn resume(&self) -> miles_core::Result<()> {
        self.inner.resume().await
    }
    async fn flush_cache(&self) -> miles_core::Result<()> {
        self.inner.flush_cache().await
    }
    async fn abort(&self, id: &miles_core::RequestId) -> miles_core::Result<()> {
        self.inner.abort(id).await
    }
    async fn abort_all(&self) -> miles_core::Result<()> {
        self.inner.abort_all().await
    }
    async fn health(&self) -> miles_core::Result<()> {
        self.inner.health().await
    }
    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        self.inner.weight_version().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_updates_reach_every_engine_at_once() {
    let fleet = engines(4, Duration::from_millis(1));
    let barrier = Arc::new(tokio::sync::Barrier::new(fleet.len()));
    let router = Arc::new(Router::new(
        fleet
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let engine: Arc<dyn InferenceEngine> = Arc::new(Rendezvous {
                    inner: e.clone(),
                    barrier: barrier.clone(),
                });
                (format!("engine-{i}"), engine, None)
            })
            .collect(),
    ));
    let mut logits = vec![0.0; VOCAB];
    logits[1] = 9.0;
    let mut weights = NamedTensors::new();
    weights.insert(
        "logits",
        TensorBytes::from_f32(vec![VOCAB], &logits).unwrap(),
    );
    // Sequential pushes would wait at the barrier forever; concurrent ones all pass it.
    tokio::time::timeout(
        Duration::from_secs(30),
        router.update_weights(&weights, WeightVersion(1)),
    )
    .await
    .expect("the update reached the engines one at a time")
    .unwrap();
    for engine in &fleet {
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(1));
    }
    assert_eq!(router.healthy_engines().len(), 4);
}
