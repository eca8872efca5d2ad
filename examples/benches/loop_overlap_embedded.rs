//! Overlap of generation and training with the embedded engine and the real GRPO trainer:
//! the engine computes on one rayon thread of its own (`EngineConfig::compute_threads`), the
//! trainer on another (`LoopConfig::train_threads`), sized so that a step's rollout takes
//! about as long as its training. The synchronous loop runs first and gives, in the same run,
//! the rollout time and the train time of a step (each measured alone); the fully async loop
//! then runs the same steps. Target: async wall time per step ≤ 1.15 × max(rollout, train),
//! where the sync loop's is ≈ their sum.
//!
//! `MILES_BENCH_QUICK=1` runs 4 steps (a smoke run; the figures are not the issue's).
//! `MILES_OVERLAP_BATCH` / `MILES_OVERLAP_RESPONSE` change the prompts per step and the
//! response length (to rebalance rollout against training on another machine).
//! `MILES_OVERLAP_DEBUG=1` prints every async step's wait / train / update times.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use miles_core::{MemoryMetricsSink, Metrics, PolicyTrainer};
use miles_examples::fleet::AdditionRl;
use miles_examples::toy::ToyModelSpec;
use miles_rollout::{LoopConfig, RlLoop, SharedTrainer};

const N: usize = 4;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One run of `steps` steps; returns the wall time and the per-step metrics.
fn run(rl: &AdditionRl, asynchronous: bool, steps: u64, staleness: u64) -> (f64, Vec<Metrics>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let batch = env("MILES_OVERLAP_BATCH", 8);
        let response = env("MILES_OVERLAP_RESPONSE", 8);
        let engine = rl.engine(64, Some(1)).expect("engine");
        // Partial rollout, as Miles' fully async recipe: requests a weight update interrupts
        // resume on the new weights instead of starting again.
        let rollout = miles_rollout::RolloutConfig {
            partial_rollout: true,
            ..rl.rollout_config(N, batch, response)
        };
        let manager = rl.manager(engine, rollout).expect("manager");
        let trainer: SharedTrainer = Arc::new(Mutex::new(Box::new(
            rl.actor(N, batch * N).expect("actor"),
        ) as Box<dyn PolicyTrainer>));
        let sink = Arc::new(MemoryMetricsSink::new());
        let config = LoopConfig {
            num_rollout: steps,
            max_weight_staleness: Some(staleness),
            train_threads: Some(1),
            ..LoopConfig::default()
        };
        let mut rl_loop = RlLoop::new(
            config,
            manager,
            trainer,
            sink.clone(),
            rl.data(N).expect("data"),
        )
        .expect("loop");
        let started = Instant::now();
        if asynchronous {
            rl_loop.run_async().await.expect("async loop");
        } else {
            rl_loop.run_sync().await.expect("sync loop");
        }
        let wall = started.elapsed().as_secs_f64();
        (wall, sink.steps().into_iter().map(|(_, m)| m).collect())
    })
}

fn mean(metrics: &[Metrics], key: &str) -> f64 {
    let values: Vec<f64> = metrics.iter().filter_map(|m| m.get(key).copied()).collect();
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument that is not ours means "not me".
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with("--") && !"loop_overlap_embedded".contains(a.as_str()))
    {
        return;
    }
    let quick = std::env::var("MILES_BENCH_QUICK").is_ok_and(|v| v == "1");
    let steps: u64 = if quick { 4 } else { 16 };
    let dir = std::env::temp_dir().join(format!("miles-overlap-{}", std::process::id()));
    let spec = ToyModelSpec {
        hidden_size: 64,
        intermediate_size: 128,
        ..ToyModelSpec::default()
    };
    let rl = AdditionRl::build(&dir, &spec, 3, 1000).expect("model");
    // Warm-up (allocator, caches), then the measured runs on fresh engines and trainers.
    let _ = run(&rl, false, 2, 1);
    let (sync_wall, sync) = run(&rl, false, steps, 1);
    // The async loop at a staleness bound of 1 and of 2 versions: with a weight update every
    // step, groups generated while the trainer trains are already one version old when the
    // next step takes them, and those interrupted by the update resume one more version on.
    let (strict_wall, strict) = run(&rl, true, steps, 1);
    let (async_wall, asy) = run(&rl, true, steps, 2);
    let _ = std::fs::remove_dir_all(&dir);

    if std::env::var("MILES_OVERLAP_DEBUG").is_ok() {
        for (i, m) in asy.iter().enumerate() {
            let g = |k: &str| m.get(k).copied().unwrap_or(f64::NAN) * 1e3;
            println!(
                "async step {i}: wait {:.1} ms, train {:.1} ms, update {:.1} ms, step {:.1} ms, queue {}, stale {}, resumed {}",
                g("perf/rollout_wait_time"),
                g("perf/train_time"),
                g("perf/update_weights_time"),
                g("perf/step_time"),
                g("rollout/fully_async/queue_size") / 1e3,
                g("rollout/fully_async/stale_groups_filtered") / 1e3,
                g("rollout/fully_async/aborted_groups_regenerated") / 1e3,
            );
        }
    }
    let rollout = mean(&sync, "perf/rollout_time");
    let train = mean(&sync, "perf/train_time");
    let update = mean(&sync, "perf/update_weights_time");
    let per_step_sync = sync_wall / steps as f64;
    let per_step_async = async_wall / steps as f64;
    let per_step_strict = strict_wall / steps as f64;
    // Steady state: the async loop's first step also waits for the pipeline to fill.
    let steady: Vec<f64> = asy
        .iter()
        .skip(1)
        .filter_map(|m| m.get("perf/step_time").copied())
        .collect();
    let per_step_steady = steady.iter().sum::<f64>() / steady.len().max(1) as f64;
    let bound = rollout.max(train);
    let ms = |s: f64| s * 1e3;
    println!(
        "loop_overlap_embedded: {steps} steps; sync step: rollout {:.1} ms + train {:.1} ms + update {:.1} ms = {:.1} ms wall; async step (max staleness 2) {:.1} ms wall ({:.1} ms after the first), train {:.1} ms of it; overlap ratio {:.2}; staleness mean {:.2}; groups resumed {}",
        ms(rollout),
        ms(train),
        ms(update),
        ms(per_step_sync),
        ms(per_step_async),
        ms(per_step_steady),
        ms(mean(&asy, "perf/train_time")),
        mean(&asy, "perf/overlap_ratio"),
        mean(&asy, "rollout/fully_async/avg_staleness"),
        asy.iter()
            .filter_map(|m| m.get("rollout/fully_async/aborted_groups_regenerated"))
            .sum::<f64>(),
    );
    println!(
        "xtask-result: loop_overlap_embedded ours={:.1}ms baseline={:.1}ms target=<=1.15 note=async wall time per step (max staleness 2, all {steps} steps, pipeline fill included) vs max(rollout, train) of the sync run; embedded GLM-4-MoE engine and GRPO actor on 1 thread each",
        ms(per_step_async),
        ms(bound)
    );
    println!(
        "xtask-result: loop_overlap_embedded_staleness1 ours={:.1}ms baseline={:.1}ms target=<=1.15 note=the same at max staleness 1 ({} stale groups dropped in all)",
        ms(per_step_strict),
        ms(bound),
        strict
            .iter()
            .filter_map(|m| m.get("rollout/fully_async/stale_groups_filtered"))
            .sum::<f64>()
    );
    println!(
        "xtask-result: loop_overlap_embedded_steady ours={:.1}ms baseline={:.1}ms target=<=1.15 note=max staleness 2, after the first step (pipeline filled)",
        ms(per_step_steady),
        ms(bound)
    );
    println!(
        "xtask-result: loop_overlap_embedded_sync ours={:.1}ms baseline={:.1}ms note=sync wall time per step vs rollout + train (≈ 1: nothing overlaps)",
        ms(per_step_sync),
        ms(rollout + train)
    );
}
