//! The rollout manager and the RL loops against the tabular policy of `common` (a real
//! sampling engine and a real REINFORCE trainer over 8 tokens).

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use miles_core::rng::SplitMix64;
use miles_core::{
    Error as CoreError, InferenceEngine, MemoryMetricsSink, PauseMode, Result as CoreResult,
    Reward, RewardFn, Sample, SampleStatus, WeightVersion, async_trait,
};
use miles_reward::BuiltinReward;
use miles_rollout::{
    DataSource, DynamicFilter, LoopConfig, PromptRecord, RlLoop, RolloutConfig, RolloutManager,
    UnusedSamplesHandler,
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
async fn reward_failures_regenerate_their_groups_and_filters_drop_flat_groups() {
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
    // A group with a failed reward is generated again (up to the bound) or dropped: no kept
    // group holds one, and the failures are counted by kind.
    for group in &batch.groups {
        let rewards: Vec<f64> = group
            .iter()
            .map(|s| s.scalar_reward(None).unwrap_or(0.0))
            .collect();
        assert!(rewards.iter().any(|&r| r != rewards[0]), "flat group kept");
        for s in group {
            assert_ne!(s.response, "5");
            assert_ne!(s.status, SampleStatus::Failed);
        }
    }
    let failed = batch.metrics["rollout/failed_samples/reward"];
    assert!(failed > 0.0, "seeded sampling produces some 5s");
    assert_eq!(batch.metrics["rollout/failed_samples"], failed);
    assert!(
        batch.metrics["rollout/failed_groups_regenerated"]
            + batch.metrics["rollout/failed_groups_dropped"]
            > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_loop_respects_the_staleness_bound_and_learns() {
    for (max_staleness, handler, overlap_weight_updates) in [
        (0, UnusedSamplesHandler::Retry, false),
        (1, UnusedSamplesHandler::Drop, false),
        // Weights pushed in the background while the next step trains: the bound still
        // holds, and the last push has landed when the loop returns.
        (1, UnusedSamplesHandler::Drop, true),
        (0, UnusedSamplesHandler::Retry, true),
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
            overlap_weight_updates,
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

/// Property: whatever the settings and timing, no sample staler than
/// `--max-weight-staleness` reaches the trainer, every step trains a full batch, and the
/// staleness histogram accounts for every trained group. 24 random cases (seeded): bound
/// (any feasible one: at least `update_weights_interval − 1`), update interval, unused-samples handler, buffer size, group and batch sizes, background
/// weight pushes, pause mode and engine latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn property_no_sample_staler_than_the_bound_reaches_the_trainer() {
    let mut rng = SplitMix64::new(0x5EED);
    let mut next = |bound: u64| rng.next_u64() % bound;
    // The infeasible setting is a typed error, not a loop that never fills a batch.
    {
        let engine = TabularEngine::new(Duration::from_millis(0));
        let manager = manager(
            &engine,
            rollout_config(2, 1),
            Arc::new(BuiltinReward::ExactMatch),
        );
        let loop_config = LoopConfig {
            num_rollout: 3,
            update_weights_interval: 3,
            max_weight_staleness: Some(1),
            ..LoopConfig::default()
        };
        let data = DataSource::new(prompts(), 2, false, 0).unwrap();
        let mut rl = RlLoop::new(
            loop_config,
            manager,
            trainer(&Arc::default()),
            Arc::new(MemoryMetricsSink::new()),
            data,
        )
        .unwrap();
        let err = rl.run_async().await.unwrap_err().to_string();
        assert!(err.contains("update_weights_interval"), "{err}");
    }
    for case in 0..24 {
        let interval = 1 + next(3);
        // A bound below `interval − 1` is refused (fresh samples already lag that much).
        let max_staleness = interval - 1 + next(2);
        let handler = if next(2) == 0 {
            UnusedSamplesHandler::Drop
        } else {
            UnusedSamplesHandler::Retry
        };
        let n = 2 + next(4) as usize;
        let batch = 1 + next(3) as usize;
        let factor = [0.5, 1.0, 2.0, 3.0][next(4) as usize];
        let overlap = next(2) == 1;
        let mode = [PauseMode::InPlace, PauseMode::Retract, PauseMode::Abort][next(3) as usize];
        let delay = Duration::from_micros(200 + 300 * next(4));
        let steps = 4 + next(4);
        let label = format!(
            "case {case}: bound {max_staleness}, interval {interval}, {handler:?}, n {n}, batch {batch}, buffer {factor}, overlap {overlap}, {mode:?}, {delay:?}"
        );

        let engine = TabularEngine::new(delay);
        let seen = Arc::default();
        let sink = Arc::new(MemoryMetricsSink::new());
        let mut config = rollout_config(n, batch);
        config.rollout_seed = None;
        let manager = manager(&engine, config, Arc::new(BuiltinReward::ExactMatch));
        let data = DataSource::new(prompts(), n, true, case).unwrap();
        let loop_config = LoopConfig {
            num_rollout: steps,
            update_weights_interval: interval,
            max_weight_staleness: Some(max_staleness),
            unused_samples_handler: handler,
            pause_generation_mode: mode,
            async_data_buffer_capacity_factor: factor,
            overlap_weight_updates: overlap,
            ..LoopConfig::default()
        };
        let mut rl = RlLoop::new(loop_config, manager, trainer(&seen), sink.clone(), data).unwrap();
        rl.run_async().await.expect(&label);

        let seen: Vec<Seen> = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), steps as usize * batch * n, "{label}");
        for (trainer_version, oldest, index) in &seen {
            let oldest = oldest.expect("every sample carries its version");
            assert!(
                oldest.staleness(*trainer_version) <= max_staleness,
                "{label}: sample {index:?} generated at {oldest} trained at {trainer_version}"
            );
        }
        for (step, metrics) in sink.steps() {
            let histogram: f64 = metrics
                .iter()
                .filter(|(k, _)| k.starts_with("rollout/fully_async/staleness_hist/"))
                .map(|(k, v)| {
                    let lag: u64 = k.rsplit('/').next().unwrap().parse().unwrap();
                    assert!(lag <= max_staleness, "{label}: step {step} histogram {k}");
                    *v
                })
                .sum();
            assert_eq!(histogram, batch as f64, "{label}: step {step}");
        }
        assert_eq!(
            engine.weight_version().await.unwrap(),
            WeightVersion(steps / interval * interval),
            "{label}"
        );
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

/// One async run over the tabular engine, checkpointing every 2 steps into `root`.
async fn async_run(
    root: &std::path::Path,
    num_rollout: u64,
    resume: bool,
) -> (Vec<Seen>, u64, Vec<String>) {
    let engine = TabularEngine::new(Duration::from_millis(3));
    let manager = manager(
        &engine,
        rollout_config(2, 2),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let data = DataSource::new(prompts(), 2, true, 5).unwrap();
    let config = LoopConfig {
        num_rollout,
        save_interval: Some(2),
        save: Some(root.to_path_buf()),
        keep_checkpoints: Some(2),
        pause_generation_mode: PauseMode::InPlace,
        ..LoopConfig::default()
    };
    let seen = Arc::default();
    let mut rl = RlLoop::new(
        config,
        manager,
        trainer(&seen),
        Arc::new(MemoryMetricsSink::new()),
        data,
    )
    .unwrap();
    let start = if resume {
        rl.resume().await.unwrap()
    } else {
        0
    };
    let notes = rl.resume_notes().to_vec();
    rl.run_async().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    (seen, start, notes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_checkpoints_keep_in_flight_prompts_and_fall_back_past_corrupt_ones() {
    use std::collections::BTreeSet;
    let root = std::env::temp_dir().join(format!("miles-async-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // A run "killed" after its step-3 checkpoint, while the worker had groups generating
    // and queued.
    let (first, _, _) = async_run(&root, 4, false).await;
    assert_eq!(first.len(), 4 * 2 * 2);
    let names: Vec<String> = miles_rollout::checkpoint::checkpoints(&root)
        .into_iter()
        .map(|(_, p)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["iter_0000003", "iter_0000001"]);
    let dir = root.join("iter_0000003");
    miles_rollout::checkpoint::verify_checkpoint(&dir).unwrap();
    let state: miles_rollout::RolloutCheckpoint =
        serde_json::from_slice(&std::fs::read(dir.join("rollout_state.json")).unwrap()).unwrap();
    let trained: BTreeSet<u64> = first.iter().map(|(_, _, i)| i.unwrap()).collect();
    assert_eq!(trained.len(), first.len(), "no sample trained twice");
    let buffered: BTreeSet<u64> = state
        .data
        .buffer
        .iter()
        .flatten()
        .map(|s| s.index.unwrap())
        .collect();
    assert!(
        !buffered.is_empty(),
        "groups were in flight at the checkpoint"
    );
    assert!(
        state
            .data
            .buffer
            .iter()
            .flatten()
            .all(|s| s.response_length == 0 && s.reward.is_none()),
        "in-flight groups are stored to be generated again"
    );
    // Every sample handed out before the checkpoint is either trained or in the checkpoint,
    // never both, never neither.
    assert!(trained.is_disjoint(&buffered));
    let handed_out: BTreeSet<u64> = (0..state.data.cursor.sample_index).collect();
    let accounted: BTreeSet<u64> = trained.union(&buffered).copied().collect();
    assert_eq!(accounted, handed_out);

    // A fresh process resumes: the in-flight prompts are generated again and trained once.
    let (resumed, start, notes) = async_run(&root, 10, true).await;
    assert_eq!(start, 4);
    assert!(notes.last().unwrap().contains("iter_0000003"), "{notes:?}");
    let again: BTreeSet<u64> = resumed.iter().map(|(_, _, i)| i.unwrap()).collect();
    assert_eq!(again.len(), resumed.len(), "no sample trained twice");
    assert!(
        trained.is_disjoint(&again),
        "nothing trained twice across the kill"
    );
    assert!(
        buffered.is_subset(&again),
        "in-flight prompts were regenerated"
    );

    // The newest checkpoint truncated: resume falls back to the one before and says why.
    let names: Vec<u64> = miles_rollout::checkpoint::checkpoints(&root)
        .into_iter()
        .map(|(step, _)| step)
        .collect();
    assert_eq!(names, [9, 7]);
    let newest = root.join("iter_0000009/rollout_state.json");
    let text = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &text[..text.len() / 2]).unwrap();
    let engine = TabularEngine::new(Duration::from_millis(0));
    let mut rl = RlLoop::new(
        LoopConfig {
            num_rollout: 10,
            save: Some(root.clone()),
            ..LoopConfig::default()
        },
        manager(
            &engine,
            rollout_config(2, 2),
            Arc::new(BuiltinReward::ExactMatch),
        ),
        trainer(&Arc::default()),
        Arc::new(MemoryMetricsSink::new()),
        DataSource::new(prompts(), 2, true, 5).unwrap(),
    )
    .unwrap();
    assert_eq!(rl.resume().await.unwrap(), 8);
    let notes = rl.resume_notes();
    assert!(
        notes[0].contains("iter_0000009") && notes[0].contains("rollout_state.json"),
        "{notes:?}"
    );
    assert!(notes[1].contains("iter_0000007"), "{notes:?}");
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

/// 1 when the agent's final answer mentions the label.
struct MentionsLabel;

#[async_trait]
impl RewardFn for MentionsLabel {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let answer = sample.metadata["final_answer"].as_str().unwrap_or("");
        let label = sample.label.as_deref().unwrap_or("?");
        Ok(Reward::Scalar(f64::from(u8::from(answer.contains(label)))))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_generation_goes_through_a_session_server() {
    use miles_rollout::{AgentGenerator, tito_mismatch_metrics};
    use miles_session::agent::AgentDriverConfig;
    use miles_session::server::{SessionServer, SessionServerConfig};
    use miles_session::testkit::{ByteChatml, ToyEngine, WeatherAgent};

    let engine = ToyEngine::new();
    let server = SessionServer::new(
        engine.clone(),
        Arc::new(ByteChatml::default()),
        SessionServerConfig {
            return_routed_experts: true,
            ..SessionServerConfig::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = server.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let prompts = vec![
        PromptRecord::text("What is the weather in Paris?", "sunny"),
        PromptRecord::text("What is the weather in Oslo?", "rainy"),
    ];
    let run = |fail: bool| {
        let generator = Arc::new(AgentGenerator::new(
            Arc::new(WeatherAgent {
                fail_after_first_turn: fail,
            }),
            AgentDriverConfig::new(url.clone()),
        ));
        let manager = RolloutManager::new(
            RolloutConfig {
                n_samples_per_prompt: 2,
                rollout_batch_size: 2,
                rollout_max_response_len: 512,
                rollout_seed: Some(5),
                ..RolloutConfig::default()
            },
            engine.clone(),
            Arc::new(DigitEncoder),
            Arc::new(MentionsLabel),
        )
        .unwrap()
        .with_generator(generator);
        let prompts = prompts.clone();
        async move {
            let mut data = DataSource::new(prompts, 2, false, 0).unwrap();
            manager.generate_rollout(0, &mut data).await
        }
    };

    let batch = run(false).await.unwrap();
    assert_eq!(batch.groups.len(), 2);

    let rewards: Vec<f64> = batch
        .samples()
        .iter()
        .map(|s| s.scalar_reward(None).unwrap())
        .collect();
    // The toy engine answers "The weather is sunny." for both cities.
    assert_eq!(rewards, [1.0, 1.0, 0.0, 0.0]);
    for s in batch.samples() {
        s.validate().unwrap();
        assert_eq!(s.status, SampleStatus::Completed);
        // Two model turns (tool call, answer) and the tool's output between them, which is
        // not trained on: the loss mask has zeros inside the response.
        let mask = s.loss_mask.as_ref().unwrap();
        assert_eq!(mask.len(), s.response_length);
        assert_eq!(mask[0], 1);
        assert_eq!(*mask.last().unwrap(), 1);
        assert!(mask.contains(&0), "tool output masked out");
        assert_eq!(
            s.rollout_log_probs.as_ref().unwrap().len(),
            s.response_length
        );
        assert_eq!(
            s.rollout_routed_experts.as_ref().unwrap().rows(),
            s.tokens.len() - 1
        );
        // Two engine calls, each at the toy engine's version.
        assert_eq!(s.weight_versions, ["7", "7"]);
        assert_eq!(s.metadata["tito_session_mismatch"], serde_json::json!([]));
    }
    let samples = batch.samples();
    let refs: Vec<&Sample> = samples.iter().collect();
    let tito = tito_mismatch_metrics(&refs);
    assert_eq!(tito["rollout/tito_session_mismatch_rate/v1"], 0.0);
    assert_eq!(
        batch.metrics["rollout/tito_session_mismatch_rate/v1/special_token_count"],
        0.0
    );

    // A failing agent: every sample FAILED, its group generated again twice then dropped,
    // never trained on; after 16 failures in a row the rollout stops with an error naming the
    // failure.
    let error = run(true).await.unwrap_err();
    assert!(
        matches!(error, miles_rollout::Error::TooManyFailures(_)),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("16 samples in a row failed") && message.contains("tool crashed"),
        "{message}"
    );
}

/// [`MentionsLabel`], counting the samples it scores.
struct CountingMentionsLabel(Arc<std::sync::atomic::AtomicUsize>);

#[async_trait]
impl RewardFn for CountingMentionsLabel {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        MentionsLabel.reward(sample).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_multi_samples_gives_per_turn_siblings_scored_once_per_rollout() {
    use miles_rollout::AgentGenerator;
    use miles_session::agent::AgentDriverConfig;
    use miles_session::server::{SessionServer, SessionServerConfig};
    use miles_session::testkit::{ByteChatml, ToyEngine, WeatherAgent};

    let engine = ToyEngine::new();
    let server = SessionServer::new(
        engine.clone(),
        Arc::new(ByteChatml::default()),
        SessionServerConfig {
            return_routed_experts: true,
            ..SessionServerConfig::default()
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = server.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let prompts = vec![
        PromptRecord::text("What is the weather in Paris?", "sunny"),
        PromptRecord::text("What is the weather in Oslo?", "rainy"),
    ];
    let scored = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let generator = Arc::new(AgentGenerator::new(
        Arc::new(WeatherAgent {
            fail_after_first_turn: false,
        }),
        AgentDriverConfig::new(url.clone()).with_generate_multi_samples(true),
    ));
    let manager = RolloutManager::new(
        RolloutConfig {
            n_samples_per_prompt: 2,
            rollout_batch_size: 2,
            rollout_max_response_len: 512,
            rollout_seed: Some(5),
            ..RolloutConfig::default()
        },
        engine.clone(),
        Arc::new(DigitEncoder),
        Arc::new(CountingMentionsLabel(scored.clone())),
    )
    .unwrap()
    .with_generator(generator);
    let mut data = DataSource::new(prompts, 2, false, 0).unwrap();
    let batch = manager.generate_rollout(0, &mut data).await.unwrap();
    // Two prompts × two rollouts × two turns: groups of four samples, four rewards computed.
    assert_eq!(batch.groups.len(), 2);
    assert!(batch.groups.iter().all(|g| g.len() == 4));
    assert_eq!(scored.load(std::sync::atomic::Ordering::SeqCst), 4);
    assert_eq!(batch.metrics["rollout/samples"], 8.0);
    let samples = batch.samples();
    let ids: Vec<Option<u64>> = samples.iter().map(|s| s.rollout_id).collect();
    assert_eq!(
        ids,
        [
            Some(0),
            Some(0),
            Some(1),
            Some(1),
            Some(2),
            Some(2),
            Some(3),
            Some(3)
        ]
    );
    let rewards: Vec<f64> = samples
        .iter()
        .map(|s| s.scalar_reward(None).unwrap())
        .collect();
    assert_eq!(rewards, [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    for pair in samples.chunks(2) {
        // Turn 1's context is turn 0 plus the tool output; each trains only on its output.
        assert!(pair[1].tokens.starts_with(&pair[0].tokens));
        for s in pair {
            s.validate().unwrap();
            assert_eq!(s.status, SampleStatus::Completed);
            assert_eq!(
                s.loss_mask.as_deref(),
                Some(&vec![1u8; s.response_length][..])
            );
            assert_eq!(
                s.rollout_routed_experts.as_ref().unwrap().rows(),
                s.tokens.len() - 1
            );
            assert_eq!(s.weight_versions, ["7"]);
        }
    }
    // Back in the data source, a group is its prompts again (one sample per rollout, reset).
    data.add_groups(vec![batch.groups[0].clone()]).unwrap();
    let again = data.get_groups(1).remove(0);
    assert_eq!(again.len(), 2);
    assert!(
        again
            .iter()
            .all(|s| s.response_length == 0 && s.reward.is_none())
    );
    assert_eq!(
        again.iter().map(|s| s.index).collect::<Vec<_>>(),
        [Some(0), Some(1)]
    );
}

/// `get_weather(city)` → "sunny" for Paris, an error otherwise.
struct Weather;

#[async_trait]
impl miles_rollout::ToolExecutor for Weather {
    async fn execute_one(
        &self,
        name: &str,
        params: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, String> {
        assert_eq!(name, "get_weather");
        match params.get("city").and_then(|c| c.as_str()) {
            Some("Paris") => Ok("sunny".into()),
            other => Err(format!("no weather for {other:?}")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_tool_loop_appends_tool_outputs_with_tito_and_masks_them() {
    use miles_core::{InferenceEngine as _, Message, Prompt, SamplingParams};
    use miles_rollout::{MultiTurnGenerator, SampleGenerator};
    use miles_session::testkit::{ByteChatml, ToyEngine};
    use miles_tito::ChatTokenizer;

    let engine = ToyEngine::new();
    let chat = Arc::new(ByteChatml::default());
    let _: &dyn ChatTokenizer = chat.as_ref();
    let tool = miles_session::testkit::weather_tool();
    let generator = MultiTurnGenerator::new(
        engine.clone(),
        chat.clone(),
        vec![tool.clone()],
        Arc::new(Weather),
    )
    .with_max_turns(4)
    .with_routed_experts(true);
    let ask = |city: &str| Sample {
        prompt: Prompt::Messages(vec![Message::user(format!(
            "What is the weather in {city}?"
        ))]),
        ..Sample::default()
    };
    let sampling = SamplingParams {
        max_new_tokens: Some(400),
        ..SamplingParams::default()
    };
    let s = generator.generate(ask("Paris"), sampling.clone()).await;
    assert_eq!(s.status, SampleStatus::Completed, "{:?}", s.metadata);
    s.validate().unwrap();
    assert!(s.response.contains("<tool_call>"));
    assert!(s.response.contains("sunny"));
    // SGLang's text: special tokens (the turns' `<|im_end|>`, the tool message's markers)
    // skipped, the final stop trimmed; the ids keep them all.
    assert!(
        s.response.ends_with("The weather is sunny."),
        "{}",
        s.response
    );
    assert!(!s.response.contains("<|im_end|>"), "{}", s.response);
    let kept = generator
        .generate(
            ask("Paris"),
            SamplingParams {
                skip_special_tokens: false,
                no_stop_trim: true,
                ..sampling.clone()
            },
        )
        .await;
    assert!(
        kept.response.ends_with("The weather is sunny.<|im_end|>"),
        "{}",
        kept.response
    );
    assert_eq!(kept.tokens, s.tokens);
    // Loss mask: 1 on the model's ids, 0 on the tool message between the turns; log-prob 0
    // there; the engine's log-probs on the model's ids.
    let mask = s.loss_mask.as_ref().unwrap();
    let lp = s.rollout_log_probs.as_ref().unwrap();
    let zeros = mask.iter().filter(|&&m| m == 0).count();
    assert!(zeros > 0 && mask[0] == 1 && *mask.last().unwrap() == 1);
    let first_zero = mask.iter().position(|&m| m == 0).unwrap();
    let tool_text =
        chat.decode(&s.tokens[s.tokens.len() - s.response_length + first_zero..][..zeros]);
    assert!(
        tool_text.contains("<tool_response>\nsunny\n</tool_response>"),
        "{tool_text:?}"
    );
    for (m, l) in mask.iter().zip(lp) {
        if *m == 0 {
            assert_eq!(*l, 0.0);
        } else {
            assert!(*l < 0.0);
        }
    }
    assert_eq!(s.weight_versions.len(), 2, "two engine calls");
    assert_eq!(
        s.rollout_routed_experts.as_ref().unwrap().rows(),
        s.tokens.len() - 1
    );

    // A failing tool answers the model with its error; a budget too small truncates.
    let s = generator.generate(ask("Oslo"), sampling.clone()).await;
    assert_eq!(s.status, SampleStatus::Completed);
    assert!(
        s.response.contains("error: no weather for"),
        "{}",
        s.response
    );
    let short = SamplingParams {
        max_new_tokens: Some(5),
        ..sampling
    };
    let s = generator.generate(ask("Paris"), short).await;
    assert_eq!(s.status, SampleStatus::Truncated);
    assert_eq!(s.response_length, 5);
    assert_eq!(engine.weight_version().await.unwrap().0, 7);
}

/// Every engine down: the samples' engine calls fail, the failures are counted as `engine`,
/// and the rollout ends with a clear error naming the engine's answer instead of training on
/// nothing or regenerating forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_stops_the_rollout_with_its_error() {
    let engine = TabularEngine::new(Duration::from_millis(0));
    engine.dead.store(true, std::sync::atomic::Ordering::SeqCst);
    let manager = manager(
        &engine,
        rollout_config(4, 8),
        Arc::new(BuiltinReward::ExactMatch),
    );
    let mut data = DataSource::new(prompts(), 4, false, 0).unwrap();
    let error = manager.generate_rollout(0, &mut data).await.unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, miles_rollout::Error::TooManyFailures(_)),
        "{message}"
    );
    assert!(
        message.contains("16 samples in a row failed") && message.contains("connection refused"),
        "{message}"
    );
    let mut metrics = miles_core::Metrics::new();
    manager.failures().take_metrics(&mut metrics);
    assert!(
        metrics["rollout/failed_samples/engine"] >= 16.0,
        "{metrics:?}"
    );
}
