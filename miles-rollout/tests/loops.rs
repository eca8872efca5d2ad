//! The rollout manager and the RL loops against the tabular policy of `common` (a real
//! sampling engine and a real REINFORCE trainer over 8 tokens).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use miles_core::{
    Error as CoreError, InferenceEngine, MemoryMetricsSink, PauseMode, Result as CoreResult,
    Reward, RewardFn, Sample, SampleStatus, WeightVersion, async_trait,
};
use miles_rollout::{
    BuiltinReward, DataSource, DynamicFilter, LoopConfig, PromptRecord, RlLoop, RolloutConfig,
    RolloutManager, UnusedSamplesHandler,
};

fn prompts() -> Vec<PromptRecord> {
    (0..6)
        .map(|i| PromptRecord::text(format!("q{i}"), "3"))
        .collect()
}

fn rollout_config(n: usize, batch: usize) -> RolloutConfig {
    let mut config = RolloutConfig {
        n_samples_per_prompt: n,
        rollout_batch_size: batch,
        rollout_max_response_len: 1,
        max_concurrency: 16,
        rollout_seed: Some(11),
        ..RolloutConfig::default()
    };
    config.sampling.stop_token_ids = vec![STOP];
    config
}

fn manager(
    engine: &Arc<TabularEngine>,
    config: RolloutConfig,
    reward: Arc<dyn RewardFn>,
) -> Arc<RolloutManager> {
    Arc::new(RolloutManager::new(config, engine.clone(), Arc::new(DigitEncoder), reward).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_loop_learns_and_versions_every_update() {
    let engine = TabularEngine::new(Duration::from_millis(0));
    let seen = Arc::default();
    let sink = Arc::new(MemoryMetricsSink::new());
    let manager = manager(
        &engine,
        rollout_config(8, 4),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let data = DataSource::new(prompts(), 8, true, 1).unwrap();
    let config = LoopConfig {
        num_rollout: 12,
        ..LoopConfig::default()
    };
    let mut rl = RlLoop::new(config, manager, trainer(&seen), sink.clone(), data).unwrap();
    rl.run_sync().await.unwrap();
    let steps = sink.steps();
    assert_eq!(steps.len(), 12);
    let reward = |i: usize| steps[i].1["rollout/raw_reward"];
    let early = (reward(0) + reward(1)) / 2.0;
    let late = (reward(10) + reward(11)) / 2.0;
    assert!(
        early < 0.4,
        "uniform policy answers 3 one time in 8: {early}"
    );
    assert!(
        late > 0.8 && late > 2.0 * early,
        "reward did not rise: {early} -> {late}"
    );
    // Every step pushed a new version to the engine, and each batch came from the previous one.
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(12));
    for (step, metrics) in &steps {
        assert_eq!(metrics["weight_version"], (*step + 1) as f64);
    }
    for (trainer_version, oldest, _) in seen.lock().unwrap().iter() {
        assert_eq!(
            *oldest,
            Some(*trainer_version),
            "sync loop trains on-policy"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_sampling_aborts_the_surplus_and_recycles_partial_groups() {
    let engine = TabularEngine::with_slow_tail(Duration::from_millis(2), true);
    let mut config = rollout_config(2, 2);
    config.over_sampling_batch_size = Some(6);
    config.rollout_max_response_len = 40;
    config.sampling.stop_token_ids = vec![]; // run to the length limit unless aborted
    config.partial_rollout = true;
    let manager = manager(&engine, config, Arc::new(BuiltinReward::ExactMatch));
    let mut data = DataSource::new(prompts(), 2, false, 0).unwrap();
    let batch = manager.generate_rollout(4, &mut data).await.unwrap();
    assert_eq!(batch.groups.len(), 2);
    assert!(batch.metrics["rollout/aborted_groups"] >= 1.0);
    // Kept groups are complete and ordered by index.
    let first: Vec<u64> = batch.groups.iter().map(|g| g[0].index.unwrap()).collect();
    assert!(first.windows(2).all(|w| w[0] < w[1]));
    for s in batch.groups.iter().flatten() {
        assert_eq!(s.status, SampleStatus::Truncated);
        assert_eq!(s.response_length, 40);
        assert_eq!(s.rollout_log_probs.as_ref().unwrap().len(), 40);
        s.validate().unwrap();
    }
    // The aborted groups that had generated tokens wait in the buffer, tagged, to be resumed.
    assert_eq!(first, [0, 2], "the two fast prompts finish first");
    assert_eq!(batch.metrics["rollout/aborted_groups"], 4.0);
    let recycled = batch.metrics["rollout/partial_groups_recycled"] as usize;
    assert_eq!(recycled, 4, "slow groups had generated a few tokens each");
    assert_eq!(data.buffered_groups(), recycled);
    let resumed = data.get_groups(1).remove(0);
    assert!(
        resumed
            .iter()
            .any(|s| s.response_length > 0 && s.response_length < 40)
    );
    assert_eq!(resumed[0].metadata["start_rollout_id"], 4);
    // Resuming continues the partial response up to the budget.
    let finished = manager.generate_group(resumed.clone()).await;
    for (before, after) in resumed.iter().zip(&finished) {
        assert_eq!(&after.tokens[..before.tokens.len()], &before.tokens[..]);
        assert_eq!(after.response_length, 40);
    }
}

/// Fails for every sample whose response is "5"; the others get exact-match rewards.
struct FlakyReward;
#[async_trait]
impl RewardFn for FlakyReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        if sample.response == "5" {
            return Err(CoreError::Reward("checker crashed on 5".into()));
        }
        BuiltinReward::ExactMatch.reward(sample).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reward_failures_mark_samples_failed_and_filters_drop_flat_groups() {
    let engine = TabularEngine::new(Duration::from_millis(0));
    let mut config = rollout_config(4, 6);
    config.dynamic_filters = vec![DynamicFilter::CheckRewardNonzeroStd];
    let manager = manager(&engine, config, Arc::new(FlakyReward));
    let mut data = DataSource::new(prompts(), 4, false, 0).unwrap();
    let batch = manager.generate_rollout(0, &mut data).await.unwrap();
    assert_eq!(batch.groups.len(), 6);
    let drops: f64 = batch
        .metrics
        .iter()
        .filter(|(k, _)| k.starts_with("rollout/dynamic_filter/drop_zero_std"))
        .map(|(_, v)| v)
        .sum();
    assert!(
        drops >= 1.0,
        "a uniform policy gives many all-zero groups: {:?}",
        batch.metrics
    );
    let mut failed = 0;
    for group in &batch.groups {
        let rewards: Vec<f64> = group
            .iter()
            .map(|s| s.scalar_reward(None).unwrap_or(0.0))
            .collect();
        assert!(rewards.iter().any(|&r| r != rewards[0]), "flat group kept");
        for s in group {
            if s.response == "5" {
                failed += 1;
                assert_eq!(s.status, SampleStatus::Failed);
                assert!(s.remove_sample);
                assert!(
                    s.metadata["failure"]
                        .as_str()
                        .unwrap()
                        .contains("checker crashed")
                );
            }
        }
    }
    assert!(failed > 0, "seeded sampling produces some 5s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_loop_respects_the_staleness_bound_and_learns() {
    for (max_staleness, handler) in [
        (0, UnusedSamplesHandler::Retry),
        (1, UnusedSamplesHandler::Drop),
    ] {
        let engine = TabularEngine::new(Duration::from_millis(1));
        let seen = Arc::default();
        let sink = Arc::new(MemoryMetricsSink::new());
        let mut config = rollout_config(8, 2);
        config.rollout_seed = None;
        let manager = manager(&engine, config, Arc::new(BuiltinReward::ExactMatch));
        let data = DataSource::new(prompts(), 8, true, 2).unwrap();
        let loop_config = LoopConfig {
            num_rollout: 10,
            max_weight_staleness: Some(max_staleness),
            unused_samples_handler: handler,
            pause_generation_mode: PauseMode::InPlace,
            ..LoopConfig::default()
        };
        let mut rl = RlLoop::new(loop_config, manager, trainer(&seen), sink.clone(), data).unwrap();
        rl.run_async().await.unwrap();
        let seen: Vec<Seen> = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 10 * 2 * 8);
        for (trainer_version, oldest, index) in seen.iter() {
            let oldest = oldest.expect("every sample carries its version");
            assert!(
                oldest.staleness(*trainer_version) <= max_staleness,
                "sample {index:?} generated at {oldest} trained at {trainer_version}"
            );
        }
        let steps = sink.steps();
        let last = steps.last().unwrap().1["train/p3"];
        assert!(last > 0.5, "async loop did not learn: p(3) = {last}");
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(10));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_after_a_kill_continues_with_nothing_lost_or_trained_twice() {
    let root = std::env::temp_dir().join(format!("miles-rollout-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let config = LoopConfig {
        num_rollout: 6,
        save_interval: Some(2),
        save: Some(root.clone()),
        ..LoopConfig::default()
    };
    // Reference: one uninterrupted run.
    let reference_seen = Arc::default();
    {
        let engine = TabularEngine::new(Duration::from_millis(0));
        let manager = manager(
            &engine,
            rollout_config(2, 2),
            Arc::new(BuiltinReward::ExactMatch),
        );
        let data = DataSource::new(prompts(), 2, true, 5).unwrap();
        let mut no_save = config.clone();
        no_save.save = None;
        let mut rl = RlLoop::new(
            no_save,
            manager,
            trainer(&reference_seen),
            Arc::new(MemoryMetricsSink::new()),
            data,
        )
        .unwrap();
        rl.run_sync().await.unwrap();
    }
    // A run "killed" after step 3 (checkpoint at step 3 = iter_0000003 after steps 0..=3).
    let first_seen = Arc::default();
    {
        let engine = TabularEngine::new(Duration::from_millis(0));
        let manager = manager(
            &engine,
            rollout_config(2, 2),
            Arc::new(BuiltinReward::ExactMatch),
        );
        let data = DataSource::new(prompts(), 2, true, 5).unwrap();
        let mut short = config.clone();
        short.num_rollout = 4; // killed during step 4, after the step-3 checkpoint
        let mut rl = RlLoop::new(
            short,
            manager,
            trainer(&first_seen),
            Arc::new(MemoryMetricsSink::new()),
            data,
        )
        .unwrap();
        rl.run_sync().await.unwrap();
    }
    // A fresh process resumes.
    let resumed_seen = Arc::default();
    let engine = TabularEngine::new(Duration::from_millis(0));
    let manager = manager(
        &engine,
        rollout_config(2, 2),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let data = DataSource::new(prompts(), 2, true, 5).unwrap();
    let mut rl = RlLoop::new(
        config,
        manager,
        trainer(&resumed_seen),
        Arc::new(MemoryMetricsSink::new()),
        data,
    )
    .unwrap();
    assert_eq!(
        rl.resume().await.unwrap(),
        4,
        "resumes after the last checkpoint (step 3)"
    );
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(4));
    rl.run_sync().await.unwrap();
    // Steps 0..=3 from the first run plus 4..=5 from the resumed one train exactly the samples
    // of the uninterrupted run, at the same versions.
    let first = first_seen.lock().unwrap();
    let resumed = resumed_seen.lock().unwrap();
    let combined: Vec<_> = first[..4 * 4]
        .iter()
        .chain(resumed.iter())
        .cloned()
        .collect();
    let reference = reference_seen.lock().unwrap();
    let indices = |v: &[Seen]| -> Vec<(WeightVersion, Option<u64>)> {
        v.iter().map(|(t, _, i)| (*t, *i)).collect()
    };
    assert_eq!(indices(&combined), indices(&reference));
    std::fs::remove_dir_all(&root).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_out_evaluation_is_logged_before_and_during_training() {
    let engine = TabularEngine::new(Duration::from_millis(0));
    let seen = Arc::default();
    let sink = Arc::new(MemoryMetricsSink::new());
    let train = manager(
        &engine,
        rollout_config(8, 4),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let eval_manager = manager(
        &engine,
        rollout_config(16, 1),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let held_out: Vec<PromptRecord> = (0..4)
        .map(|i| PromptRecord::text(format!("held-out {i}"), "3"))
        .collect();
    let eval = miles_rollout::EvalSet {
        name: "digits".into(),
        prompts: held_out,
        manager: eval_manager,
    };
    let data = DataSource::new(prompts(), 8, true, 1).unwrap();
    let config = LoopConfig {
        num_rollout: 10,
        ..LoopConfig::default()
    };
    let mut rl = RlLoop::new(config, train, trainer(&seen), sink.clone(), data)
        .unwrap()
        .with_eval(vec![eval], 5);
    rl.run_sync().await.unwrap();
    let evals: Vec<(u64, f64)> = sink
        .steps()
        .iter()
        .filter_map(|(step, m)| m.get("eval/digits/raw_reward").map(|r| (*step, *r)))
        .collect();
    // Before training (logged at step 0), after step 4 and after the last step (9).
    assert_eq!(evals.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0, 4, 9]);
    assert!(evals[0].1 < 0.4, "before: {evals:?}");
    assert!(evals[2].1 > 0.8, "after: {evals:?}");
    let steps = sink.steps();
    let last = &steps.last().unwrap().1;
    assert_eq!(last["eval/digits/samples"], 64.0);
}
