//! Fault injection with the embedded engine and the real trainer: two embedded GLM-4-MoE
//! engines behind the router, the GRPO actor, the fully async loop. Engine 0 is killed
//! mid-run while it holds requests; its requests end ABORTED and are regenerated on the
//! other engine, the health checker re-creates it through its factory and brings it to the
//! current weights, and the run trains every step exactly once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use miles_core::{InferenceEngine, MemoryMetricsSink, PolicyTrainer};
use miles_engine::EmbeddedEngine;
use miles_examples::fleet::AdditionRl;
use miles_examples::toy::ToyModelSpec;
use miles_rollout::{LoopConfig, RlLoop, SharedTrainer};
use miles_session::sglang::{EngineFactory, Router};

const STEPS: u64 = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_embedded_engine_mid_run_loses_nothing_and_training_continues() {
    kill_engine_mid_run(false).await;
    // Weights pushed in the background while the next step trains: a push that meets the
    // dead engine takes it out of rotation and the run goes on the same way.
    kill_engine_mid_run(true).await;
}

async fn kill_engine_mid_run(overlap_weight_updates: bool) {
    let dir = std::env::temp_dir().join(format!(
        "miles-fault-{}-{overlap_weight_updates}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let spec = ToyModelSpec {
        hidden_size: 32,
        intermediate_size: 64,
        ..ToyModelSpec::default()
    };
    let rl = Arc::new(AdditionRl::build(&dir, &spec, 5, 200).unwrap());

    // Every engine ever made, per slot, so the test can kill the live one and see the new one.
    let made: Arc<Mutex<Vec<Vec<Arc<EmbeddedEngine>>>>> = Arc::new(Mutex::new(vec![vec![]; 2]));
    let factory = |slot: usize| -> EngineFactory {
        let rl = rl.clone();
        let made = made.clone();
        Arc::new(move || {
            let engine = rl.engine(16, None).map_err(|e| {
                miles_core::Error::engine(miles_core::EngineErrorKind::Internal, e.to_string())
            })?;
            made.lock().unwrap()[slot].push(engine.clone());
            Ok(engine as Arc<dyn InferenceEngine>)
        })
    };
    let slots = (0..2)
        .map(|i| {
            let f = factory(i);
            (format!("engine-{i}"), f().unwrap(), Some(f))
        })
        .collect();
    let router = Arc::new(Router::new(slots));
    let checker = router.spawn_health_checker(Duration::from_millis(50));

    // 4 prompts × 4 samples, up to 24 tokens: engines hold requests most of the time.
    let manager = rl
        .manager(router.clone(), rl.rollout_config(4, 4, 24))
        .unwrap();
    let trainer: SharedTrainer = Arc::new(Mutex::new(
        Box::new(rl.actor(4, 16).unwrap()) as Box<dyn PolicyTrainer>
    ));
    let sink = Arc::new(MemoryMetricsSink::new());
    let config = LoopConfig {
        num_rollout: STEPS,
        max_weight_staleness: Some(1),
        overlap_weight_updates,
        ..LoopConfig::default()
    };
    let mut rl_loop = RlLoop::new(
        config,
        manager,
        trainer.clone(),
        sink.clone(),
        rl.data(4).unwrap(),
    )
    .unwrap();

    // The killer: once a step has trained and engine 0 holds requests, shut it down.
    let killed_busy = Arc::new(AtomicBool::new(false));
    let killer = {
        let (router, made, sink, killed_busy) = (
            router.clone(),
            made.clone(),
            sink.clone(),
            killed_busy.clone(),
        );
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let trained = sink
                    .steps()
                    .iter()
                    .any(|(_, m)| m.contains_key("train/pg_loss"));
                if trained && router.outstanding()[0] >= 2 {
                    break;
                }
                assert!(Instant::now() < deadline, "engine 0 never got busy");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            killed_busy.store(router.outstanding()[0] > 0, Ordering::SeqCst);
            let victim = made.lock().unwrap()[0][0].clone();
            tokio::task::spawn_blocking(move || victim.shutdown())
                .await
                .unwrap();
        })
    };

    rl_loop.run_async().await.expect("the run completes");
    killer.await.expect("the killer ran");

    // Every step trained exactly once, in order, on samples within the staleness bound.
    let train: Vec<_> = sink
        .steps()
        .into_iter()
        .filter(|(_, m)| m.contains_key("train/pg_loss"))
        .collect();
    let steps: Vec<u64> = train.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (0..STEPS).collect::<Vec<_>>());
    for (_, m) in &train {
        assert_eq!(m["rollout/samples"], 16.0);
        // Groups with an aborted sample were regenerated, never trained on.
        assert_eq!(m["train/removed_samples_dropped"], 0.0);
        assert!(m["rollout/fully_async/max_staleness"] <= 1.0);
        assert!(m["train/pg_loss"].is_finite());
        assert!((0.0..=1.0).contains(&m["perf/overlap_ratio"]));
    }
    assert_eq!(
        trainer.lock().unwrap().weight_version(),
        miles_core::WeightVersion(STEPS)
    );

    // The dead engine's requests were regenerated, not trained on or lost (the count also
    // holds requests a weight update retracted, which end ABORTED so no sample mixes versions).
    let regenerated: f64 = train
        .iter()
        .map(|(_, m)| m["rollout/fully_async/aborted_groups_regenerated"])
        .sum();
    let made_now = made.lock().unwrap().clone();
    let killed = &made_now[0][0];
    assert!(killed.health().await.is_err(), "the killed engine is down");
    println!(
        "fault injection (overlap_weight_updates = {overlap_weight_updates}): engine 0 killed with requests in flight = {}, groups regenerated (engine death and weight updates) = {regenerated}, engines made = {:?}",
        killed_busy.load(Ordering::SeqCst),
        made_now.iter().map(Vec::len).collect::<Vec<_>>()
    );
    assert!(killed_busy.load(Ordering::SeqCst));
    assert!(
        regenerated >= 1.0,
        "the dead engine's groups are regenerated"
    );

    // The health checker re-created engine 0 and brought it to the trainer's weights.
    let deadline = Instant::now() + Duration::from_secs(30);
    while router.healthy_engines().len() < 2 {
        assert!(Instant::now() < deadline, "engine 0 was never re-admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    checker.abort();
    let made_now = made.lock().unwrap().clone();
    assert!(made_now[0].len() >= 2, "the factory re-created engine 0");
    assert_eq!(made_now[1].len(), 1, "engine 1 was never replaced");
    let replacement = made_now[0].last().unwrap();
    assert_eq!(
        replacement.weight_version().await.unwrap(),
        router.weight_version().await.unwrap()
    );
    assert_eq!(
        replacement.weight_version().await.unwrap(),
        miles_core::WeightVersion(STEPS)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
