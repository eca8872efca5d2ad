//! The RL loops: synchronous (rollout → train → update weights) and fully asynchronous
//! (generation keeps running while the trainer trains), with versioned weight updates,
//! staleness control and checkpoints that carry the rollout side (Miles' fully-async loop).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use miles_core::{
    InProcessWeights, InferenceEngine, MemoryTag, Metrics, MetricsSink, PauseMode, PolicyTrainer,
    Sample, WeightVersion,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::data::{DataSource, DataSourceState};
use crate::error::{Error, Result};
use crate::eval::EvalSet;
use crate::failures::retry_failed_group;
use crate::manager::{RolloutManager, mask_unusable, passrate_metrics, rollout_metrics};
use crate::{FilterVerdict, group_staleness};

/// What to do with groups that are too stale to train on
/// (`--async-unused-samples-handler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnusedSamplesHandler {
    /// Drop them (Miles' default).
    #[default]
    Drop,
    /// Reset them and re-queue their prompts to be generated again.
    Retry,
}

/// Loop settings, with Miles' flag names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoopConfig {
    /// Training steps (`--num-rollout`).
    pub num_rollout: u64,
    /// Push weights to the engines every this many steps (`--update-weights-interval`, 1).
    pub update_weights_interval: u64,
    /// Maximum versions a group may lag the trainer (`--max-weight-staleness`; `None` = no bound).
    pub max_weight_staleness: Option<u64>,
    /// Handling of stale groups in the async loop.
    pub unused_samples_handler: UnusedSamplesHandler,
    /// How engines pause for a weight update (`--pause-generation-mode`, Miles: retract).
    pub pause_generation_mode: PauseMode,
    /// Async buffer capacity = factor × rollout_batch_size groups
    /// (`--async-data-buffer-capacity-factor`, 2.0).
    pub async_data_buffer_capacity_factor: f64,
    /// Save a checkpoint every this many steps (`--save-interval`).
    pub save_interval: Option<u64>,
    /// Where checkpoints go (`--save`).
    pub save: Option<PathBuf>,
    /// Threads the trainer computes with: train steps, checkpoints and weight exports run in
    /// a rayon pool of this size of its own (`None`: the process-wide pool). With
    /// `EngineConfig::compute_threads` this splits the cores between generation and
    /// training, so the fully async loop overlaps them instead of time-slicing them.
    pub train_threads: Option<usize>,
    /// Fully async loop only: push new weights to the engines in the background while the
    /// next step trains, instead of waiting for the push (pause → flush → update → resume →
    /// version check) before training again. The push still pauses and flushes the engines,
    /// so no sample mixes versions, and each push finishes before the next starts (its
    /// errors fail the loop one step later); the engines then serve the previous version
    /// for the length of a push, which the staleness bound accounts for. Off by default
    /// (Miles waits for the update).
    pub overlap_weight_updates: bool,
    /// Keep only the newest this many checkpoints under `save` (`--keep-checkpoints`;
    /// `None` keeps all).
    pub keep_checkpoints: Option<usize>,
    /// Synchronous loop only (Miles' `--offload-rollout`): before each training step that
    /// ends with a weight push, the engines release what `offload_rollout_level` names
    /// ([`InferenceEngine::release_memory_occupation`]) and take it back at the push. In
    /// process this lets the optimizer update the trainer's buffers in place (the engine no
    /// longer holds them) and frees the engine's decode copies and KV pool for the training
    /// pass. The fully async loop generates while it trains and never releases. Off by
    /// default here; `miles train` turns it on (an embedded engine is colocated).
    pub offload_rollout: bool,
    /// What `offload_rollout` releases (`--offload-rollout-level`; Miles' default: the KV
    /// cache and the weights).
    pub offload_rollout_level: Vec<MemoryTag>,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            num_rollout: 1,
            update_weights_interval: 1,
            max_weight_staleness: None,
            unused_samples_handler: UnusedSamplesHandler::Drop,
            pause_generation_mode: PauseMode::Retract,
            async_data_buffer_capacity_factor: 2.0,
            save_interval: None,
            save: None,
            train_threads: None,
            overlap_weight_updates: false,
            keep_checkpoints: None,
            offload_rollout: false,
            offload_rollout_level: vec![MemoryTag::KvCache, MemoryTag::Weights],
        }
    }
}

/// The rollout side of a checkpoint (the trainer saves its own part beside it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutCheckpoint {
    /// The step to run next.
    pub next_rollout_id: u64,
    /// The weight version the engines hold.
    pub weight_version: WeightVersion,
    /// Data cursor and buffered groups.
    pub data: DataSourceState,
}

/// A trainer shared with blocking threads.
pub type SharedTrainer = Arc<Mutex<Box<dyn PolicyTrainer>>>;

/// Drives one [`RolloutManager`] and one [`PolicyTrainer`].
pub struct RlLoop {
    config: LoopConfig,
    manager: Arc<RolloutManager>,
    trainer: SharedTrainer,
    metrics: Arc<dyn MetricsSink>,
    data: DataSource,
    next_rollout_id: u64,
    evals: Vec<EvalSet>,
    eval_interval: Option<u64>,
    skip_eval_before_train: bool,
    evaluations: Vec<(Option<u64>, Metrics)>,
    train_pool: Option<Arc<rayon::ThreadPool>>,
    resume_notes: Vec<String>,
    stop: Option<watch::Receiver<bool>>,
    stopped: bool,
}

/// Resolves once `stop` holds `true`; never without a stop signal (or once its sender is gone
/// without having asked to stop).
async fn stop_requested(stop: Option<watch::Receiver<bool>>) {
    if let Some(mut stop) = stop
        && stop.wait_for(|asked| *asked).await.is_ok()
    {
        return;
    }
    std::future::pending::<()>().await;
}

impl RlLoop {
    /// A loop starting at step 0.
    pub fn new(
        config: LoopConfig,
        manager: Arc<RolloutManager>,
        trainer: SharedTrainer,
        metrics: Arc<dyn MetricsSink>,
        data: DataSource,
    ) -> Result<Self> {
        if config.update_weights_interval == 0 {
            return Err(Error::Config("update_weights_interval must be >= 1".into()));
        }
        if config.async_data_buffer_capacity_factor.is_nan()
            || config.async_data_buffer_capacity_factor <= 0.0
        {
            return Err(Error::Config(
                "async_data_buffer_capacity_factor must be > 0".into(),
            ));
        }
        let train_pool = config
            .train_threads
            .map(|threads| compute_pool(threads, "miles-train").map(Arc::new))
            .transpose()?;
        Ok(Self {
            config,
            manager,
            trainer,
            metrics,
            data,
            next_rollout_id: 0,
            evals: Vec::new(),
            eval_interval: None,
            skip_eval_before_train: false,
            evaluations: Vec::new(),
            train_pool,
            resume_notes: Vec::new(),
            stop: None,
            stopped: false,
        })
    }

    /// Evaluates `sets` before training (unless [`RlLoop::skip_eval_before_train`]), after
    /// every `eval_interval` steps (`--eval-interval`) and after the last step, logging each
    /// set's `eval/<name>...` metrics and `eval/step` at the step just finished (0 before
    /// training).
    pub fn with_eval(mut self, sets: Vec<EvalSet>, eval_interval: u64) -> Self {
        self.evals = sets;
        self.eval_interval = (eval_interval > 0).then_some(eval_interval);
        self
    }

    /// No evaluation before the first step (`--skip-eval-before-train`).
    pub fn skip_eval_before_train(mut self, skip: bool) -> Self {
        self.skip_eval_before_train = skip;
        self
    }

    /// The evaluations this loop ran, in order: the step each followed (`None`: before
    /// training) and its metrics.
    pub fn evaluations(&self) -> &[(Option<u64>, Metrics)] {
        &self.evaluations
    }

    /// Stops the loop early when `stop` turns `true` (a user's SIGINT / SIGTERM): generation in
    /// progress is dropped (its prompts go back to the data source), a step being trained
    /// finishes, a checkpoint of the last finished step is written when `save` is set (unless
    /// that step's checkpoint exists), and [`RlLoop::run_sync`] / [`RlLoop::run_async`]
    /// return `Ok`; [`RlLoop::stopped`] then says so. A later [`RlLoop::resume`] continues
    /// from that checkpoint.
    pub fn with_stop(mut self, stop: watch::Receiver<bool>) -> Self {
        self.stop = Some(stop);
        self
    }

    /// Whether the last run ended early on the stop signal of [`RlLoop::with_stop`].
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    fn stop_asked(&self) -> bool {
        self.stop.as_ref().is_some_and(|stop| *stop.borrow())
    }

    /// After a stop: the checkpoint of the last finished step, if there is one and it is not
    /// written yet.
    async fn save_on_stop(&self) -> Result<()> {
        let (Some(root), Some(last)) = (&self.config.save, self.next_rollout_id.checked_sub(1))
        else {
            return Ok(());
        };
        if root.join(format!("iter_{last:07}")).exists() {
            return Ok(());
        }
        tracing::info!(step = last, "stopped: writing a checkpoint");
        self.save_checkpoint(last, self.data.state()).await
    }

    /// Runs every eval set now and returns their metrics.
    pub async fn evaluate(&self) -> Result<Metrics> {
        let mut metrics = Metrics::new();
        for set in &self.evals {
            metrics.extend(set.evaluate().await?);
        }
        Ok(metrics)
    }

    /// Whether held-out evaluation runs after `finished_step` (`None`: before training).
    fn eval_due(&self, finished_step: Option<u64>) -> bool {
        let Some(interval) = self.eval_interval else {
            return false;
        };
        !self.evals.is_empty()
            && match finished_step {
                None => true,
                Some(step) => {
                    (step + 1).is_multiple_of(interval) || step + 1 == self.config.num_rollout
                }
            }
    }

    async fn maybe_eval(
        &mut self,
        finished_step: Option<u64>,
        metrics: &mut Metrics,
    ) -> Result<()> {
        if self.eval_due(finished_step) {
            let mut eval = self.evaluate().await?;
            eval.insert("eval/step".into(), finished_step.unwrap_or(0) as f64);
            metrics.extend(eval.clone());
            self.evaluations.push((finished_step, eval));
        }
        Ok(())
    }

    async fn eval_before_training(&mut self) -> Result<()> {
        if self.next_rollout_id == 0
            && !self.skip_eval_before_train
            && self.eval_interval.is_some()
            && !self.evals.is_empty()
        {
            let mut metrics = Metrics::new();
            self.maybe_eval(None, &mut metrics).await?;
            self.metrics.log(0, &metrics)?;
        }
        Ok(())
    }

    /// The step the loop runs next.
    pub fn next_rollout_id(&self) -> u64 {
        self.next_rollout_id
    }

    /// The data source (its cursor advances as the loop runs).
    pub fn data(&self) -> &DataSource {
        &self.data
    }

    /// Resumes from the latest checkpoint under `save` if there is one: trainer state, data
    /// cursor and buffer, and the engines get the trainer's weights at its version. Returns
    /// the step it resumes at (0 when there was nothing to resume).
    ///
    /// Checkpoints that are incomplete or fail their manifest (truncated, corrupt) are
    /// skipped for the newest valid one; [`RlLoop::resume_notes`] says which and why (also
    /// logged as warnings).
    pub async fn resume(&mut self) -> Result<u64> {
        let Some(root) = self.config.save.clone() else {
            return Ok(0);
        };
        let (found, skipped) = crate::checkpoint::latest_valid_checkpoint(&root);
        for note in &skipped {
            tracing::warn!("resume: {note}");
        }
        self.resume_notes = skipped;
        let Some(dir) = found else {
            return Ok(0);
        };
        self.resume_notes
            .push(format!("resumed from {}", dir.display()));
        let state_path = dir.join(crate::checkpoint::ROLLOUT_STATE_FILE);
        let text = std::fs::read_to_string(&state_path).map_err(|source| Error::Io {
            path: state_path.clone(),
            source,
        })?;
        let state: RolloutCheckpoint = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", state_path.display())))?;
        let trainer_dir = dir.join("trainer");
        let trainer = self.trainer.clone();
        self.on_trainer(move || {
            lock(&trainer)?
                .load_checkpoint(&trainer_dir)
                .map_err(Error::from)
        })
        .await?;
        self.data.restore(state.data)?;
        self.next_rollout_id = state.next_rollout_id;
        self.push_weights().await?;
        Ok(self.next_rollout_id)
    }

    /// The synchronous loop: for each step, generate a batch, train on it, then (every
    /// `update_weights_interval` steps) push the new weights to the engines.
    pub async fn run_sync(&mut self) -> Result<()> {
        self.stopped = false;
        self.eval_before_training().await?;
        while self.next_rollout_id < self.config.num_rollout {
            if self.stop_asked() {
                self.stopped = true;
                break;
            }
            let rollout_id = self.next_rollout_id;
            let started = Instant::now();
            let before = self.data.state();
            let stop = self.stop.clone();
            let generated = tokio::select! {
                batch = self.manager.generate_rollout(rollout_id, &mut self.data) => Some(batch?),
                () = stop_requested(stop) => None,
            };
            let Some(batch) = generated else {
                // Generation stopped: its prompts are taken again after a resume.
                self.data.restore(before)?;
                self.stopped = true;
                break;
            };
            let rollout_time = started.elapsed().as_secs_f64();
            let mut metrics = batch.metrics.clone();
            metrics.insert("perf/rollout_time".into(), rollout_time);
            let samples = batch.samples();
            sample_perf_metrics(&samples, rollout_time, &mut metrics);
            // The trainer waits for the whole rollout.
            metrics.insert("perf/train_wait_time".into(), rollout_time);
            let offloaded = self.offload_rollout(rollout_id).await?;
            let version = self
                .train_and_update(rollout_id, samples, &mut metrics, None, None, &offloaded)
                .await?;
            // Nothing generates while the synchronous loop trains.
            metrics.insert("perf/overlap_ratio".into(), 0.0);
            metrics.insert("weight_version".into(), version.0 as f64);
            metrics.insert("perf/step_time".into(), started.elapsed().as_secs_f64());
            self.maybe_eval(Some(rollout_id), &mut metrics).await?;
            self.metrics.log(rollout_id, &metrics)?;
            self.next_rollout_id += 1;
            self.maybe_save(rollout_id).await?;
        }
        if self.stopped {
            self.save_on_stop().await?;
        }
        Ok(())
    }

    /// With [`LoopConfig::offload_rollout`], when step `rollout_id` ends with a push, has the
    /// engines release `offload_rollout_level` for the training step; returns what was released
    /// (empty: nothing, e.g. an engine that cannot). Without a push this step the engines keep
    /// everything: the next rollout needs the current weights.
    async fn offload_rollout(&self, rollout_id: u64) -> Result<Vec<MemoryTag>> {
        let pushes = (rollout_id + 1).is_multiple_of(self.config.update_weights_interval);
        let level = &self.config.offload_rollout_level;
        if !self.config.offload_rollout || !pushes || level.is_empty() {
            return Ok(Vec::new());
        }
        let released = self
            .manager
            .engine()
            .release_memory_occupation(level)
            .await?;
        Ok(if released { level.clone() } else { Vec::new() })
    }

    /// Runs `work` on a blocking thread, inside the trainer's pool when it has one.
    async fn on_trainer<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        match self.train_pool.clone() {
            Some(pool) => blocking(move || pool.install(work)).await,
            None => blocking(work).await,
        }
    }

    /// The trainer's weights and version, exported on the trainer's pool: in process when
    /// the engine takes that and the trainer has it, else as host tensors.
    async fn export_weights(&self) -> Result<(Exported, WeightVersion)> {
        let shared = self.trainer.clone();
        let in_process = self.manager.engine().takes_in_process_weights();
        self.on_trainer(move || export(&shared, in_process)).await
    }

    /// [`update_weights`] with the export on the trainer's pool.
    async fn push_weights(&self) -> Result<WeightVersion> {
        let (weights, version) = self.export_weights().await?;
        push_to_engine(
            self.manager.engine(),
            &self.trainer,
            weights,
            version,
            self.config.pause_generation_mode,
        )
        .await
    }

    /// Trains on `samples` and updates the engines when due. With `generation` (the async
    /// loop's busy clock) it also logs `perf/overlap_ratio`: the share of the train time during
    /// which generation was running. With `background` (see
    /// [`LoopConfig::overlap_weight_updates`]) the push runs as a task left in the slot, after
    /// the previous one has finished. `offloaded`: what the engines released for this step
    /// ([`RlLoop::offload_rollout`]), taken back right after the push.
    async fn train_and_update(
        &self,
        rollout_id: u64,
        samples: Vec<Sample>,
        metrics: &mut Metrics,
        generation: Option<&BusyClock>,
        background: Option<&mut Option<PendingPush>>,
        offloaded: &[MemoryTag],
    ) -> Result<WeightVersion> {
        let trainer = self.trainer.clone();
        let train_tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
        let train_started = Instant::now();
        let busy_before = generation.map(BusyClock::busy);
        let train_metrics = self
            .on_trainer(move || {
                lock(&trainer)?
                    .train(rollout_id, &samples)
                    .map_err(Error::from)
            })
            .await?;
        let train_time = train_started.elapsed();
        metrics.insert("perf/train_time".into(), train_time.as_secs_f64());
        // Miles' names for the trainer side (`train_metric_utils.py`): the actor's time, its
        // tokens per second over every token of every sample, and the share of the step the
        // trainer spent waiting for data.
        metrics.insert("perf/actor_train_time".into(), train_time.as_secs_f64());
        if !train_time.is_zero() {
            metrics.insert(
                "perf/actor_train_tok_per_s".into(),
                train_tokens as f64 / train_time.as_secs_f64(),
            );
        }
        if let Some(&wait) = metrics.get("perf/train_wait_time") {
            let total = wait + train_time.as_secs_f64();
            if total > 0.0 {
                metrics.insert("perf/wait_time_ratio".into(), wait / total);
            }
        }
        if let (Some(clock), Some(before)) = (generation, busy_before)
            && !train_time.is_zero()
        {
            let overlapped = clock.busy().saturating_sub(before);
            metrics.insert(
                "perf/overlap_ratio".into(),
                (overlapped.as_secs_f64() / train_time.as_secs_f64()).min(1.0),
            );
        }
        metrics.extend(train_metrics);
        if (rollout_id + 1).is_multiple_of(self.config.update_weights_interval) {
            let update_started = Instant::now();
            let version = match background {
                None => {
                    // Miles' order: resume the weights, push them, then the KV cache (a
                    // remote SGLang must hold its weights' memory again before an update
                    // writes into it; the embedded engine gets them back with the push).
                    let engine = self.manager.engine();
                    if offloaded.contains(&MemoryTag::Weights) {
                        engine
                            .resume_memory_occupation(&[MemoryTag::Weights])
                            .await?;
                    }
                    let version = self.push_weights().await?;
                    let rest: Vec<MemoryTag> = offloaded
                        .iter()
                        .copied()
                        .filter(|t| *t != MemoryTag::Weights)
                        .collect();
                    if !rest.is_empty() {
                        engine.resume_memory_occupation(&rest).await?;
                    }
                    version
                }
                Some(slot) => {
                    settle(slot).await?;
                    let (weights, version) = self.export_weights().await?;
                    let engine = self.manager.engine().clone();
                    let trainer = self.trainer.clone();
                    let mode = self.config.pause_generation_mode;
                    *slot = Some(tokio::spawn(async move {
                        push_to_engine(&engine, &trainer, weights, version, mode).await
                    }));
                    version
                }
            };
            // The time the step spent on the update (with a background push: the export and
            // the wait for the previous push).
            metrics.insert(
                "perf/update_weights_time".into(),
                update_started.elapsed().as_secs_f64(),
            );
            Ok(version)
        } else {
            if let Some(slot) = background {
                // Read the version the engines settle on, not one mid-push.
                settle(slot).await?;
            }
            Ok(self.manager.engine().weight_version().await?)
        }
    }

    /// The fully asynchronous loop: a background worker keeps up to
    /// `rollout_batch_size` groups generating and pushes finished, filtered groups into a
    /// bounded buffer; each step drains `rollout_batch_size` groups, routes groups staler
    /// than `max_weight_staleness` to the unused-samples handler, trains, and updates the
    /// engines' weights every `update_weights_interval` steps (generation paused meanwhile).
    pub async fn run_async(&mut self) -> Result<()> {
        // Between two updates the trainer moves ahead of the engines by up to
        // `update_weights_interval − 1` versions, so even fresh samples lag that much: a
        // tighter bound could never fill a batch.
        if let Some(max) = self.config.max_weight_staleness
            && max + 1 < self.config.update_weights_interval
        {
            return Err(Error::Config(format!(
                "max_weight_staleness {max} is below update_weights_interval - 1 = {}: samples \
                 generated between two weight updates would all be too stale to train on",
                self.config.update_weights_interval - 1
            )));
        }
        self.eval_before_training().await?;
        let batch_size = self.manager.config().rollout_batch_size;
        let capacity = ((self.config.async_data_buffer_capacity_factor * batch_size as f64).floor()
            as usize)
            .max(1);
        let (sender, mut receiver) = mpsc::channel::<Vec<Sample>>(capacity);
        let placeholder = placeholder_source(&self.data)?;
        let clock = Arc::new(BusyClock::default());
        let data = Arc::new(tokio::sync::Mutex::new(std::mem::replace(
            &mut self.data,
            placeholder,
        )));
        let in_flight = Arc::new(InFlight::default());
        let worker = tokio::spawn(generation_worker(
            self.manager.clone(),
            data.clone(),
            sender,
            batch_size,
            clock.clone(),
            in_flight.clone(),
        ));
        let mut pending = None;
        let outcome = self
            .async_steps(
                &mut receiver,
                &data,
                batch_size,
                &clock,
                &mut pending,
                &in_flight,
            )
            .await;
        // The last push must land (and its version check pass) before the loop returns.
        let settled = settle(&mut pending).await;
        worker.abort();
        let _ = worker.await;
        // Groups the worker had taken and not finished go back too (regenerated from scratch).
        let unfinished = in_flight.take_all();
        // Groups still buffered were generated but not trained on: return them to the data
        // source so a checkpoint keeps them.
        receiver.close();
        let mut leftover = Vec::new();
        while let Ok(group) = receiver.try_recv() {
            in_flight.finished(&group);
            leftover.push(group);
        }
        leftover.extend(in_flight_for_retry(unfinished));
        let mut source = Arc::try_unwrap(data)
            .map_err(|_| Error::Task("generation worker still holds the data source".into()))?
            .into_inner();
        source.add_groups(leftover)?;
        self.data = source;
        outcome.and(settled)?;
        if self.stopped {
            self.save_on_stop().await?;
        }
        Ok(())
    }

    async fn async_steps(
        &mut self,
        receiver: &mut mpsc::Receiver<Vec<Sample>>,
        data: &Arc<tokio::sync::Mutex<DataSource>>,
        batch_size: usize,
        clock: &BusyClock,
        pending: &mut Option<PendingPush>,
        in_flight: &InFlight,
    ) -> Result<()> {
        let overlap = self.config.overlap_weight_updates;
        self.stopped = false;
        while self.next_rollout_id < self.config.num_rollout {
            if self.stop_asked() {
                self.stopped = true;
                return Ok(());
            }
            let rollout_id = self.next_rollout_id;
            let started = Instant::now();
            let current = lock(&self.trainer)?.weight_version();
            let mut groups = Vec::with_capacity(batch_size);
            let mut stale = 0u64;
            let mut staleness = Vec::new();
            while groups.len() < batch_size {
                let stop = self.stop.clone();
                let received = tokio::select! {
                    group = receiver.recv() => Some(group),
                    () = stop_requested(stop) => None,
                };
                let Some(received) = received else {
                    // Stopped while waiting: the groups already here are kept for a resume.
                    data.lock().await.add_groups(std::mem::take(&mut groups))?;
                    self.stopped = true;
                    return Ok(());
                };
                let Some(group) = received else {
                    self.manager.failures().check()?;
                    return Err(Error::Task("the generation worker stopped".into()));
                };
                in_flight.finished(&group);
                let lag = group_staleness(&group, current);
                let too_stale = matches!(
                    (self.config.max_weight_staleness, lag),
                    (Some(max), Some(lag)) if lag > max
                );
                if too_stale {
                    stale += 1;
                    if self.config.unused_samples_handler == UnusedSamplesHandler::Retry {
                        let mut group = group;
                        group.iter_mut().for_each(Sample::reset_for_retry);
                        data.lock().await.add_groups(vec![group])?;
                    }
                    continue;
                }
                staleness.push(lag.unwrap_or(0) as f64);
                groups.push(group);
            }
            let wait_time = started.elapsed().as_secs_f64();
            let mut metrics = rollout_metrics(&groups, self.manager.config().reward_key.as_deref());
            metrics.extend(passrate_metrics(self.manager.config(), &groups));
            metrics.insert("perf/rollout_wait_time".into(), wait_time);
            metrics.insert("perf/train_wait_time".into(), wait_time);
            metrics.insert(
                "rollout/fully_async/stale_groups_filtered".into(),
                stale as f64,
            );
            metrics.insert(
                "rollout/fully_async/aborted_groups_regenerated".into(),
                clock
                    .aborted_groups
                    .swap(0, std::sync::atomic::Ordering::SeqCst) as f64,
            );
            if !staleness.is_empty() {
                metrics.insert(
                    "rollout/fully_async/avg_staleness".into(),
                    staleness.iter().sum::<f64>() / staleness.len() as f64,
                );
                metrics.insert(
                    "rollout/fully_async/max_staleness".into(),
                    staleness.iter().copied().fold(0.0, f64::max),
                );
                // The staleness histogram: groups trained at each lag.
                let mut histogram = std::collections::BTreeMap::<u64, u64>::new();
                for &lag in &staleness {
                    *histogram.entry(lag as u64).or_default() += 1;
                }
                for (lag, groups) in histogram {
                    metrics.insert(
                        format!("rollout/fully_async/staleness_hist/{lag}"),
                        groups as f64,
                    );
                }
            }
            metrics.insert(
                "rollout/fully_async/queue_size".into(),
                receiver.len() as f64,
            );
            self.manager.failures().take_metrics(&mut metrics);
            let samples: Vec<Sample> = groups.into_iter().flatten().collect();
            // Generation overlaps training: the throughput over the time the trainer waited
            // is not the engines' throughput. The sample-side figures are logged here, the
            // throughput below over the whole step (in steady state the engines produce one
            // batch per step).
            sample_perf_metrics(&samples, f64::NAN, &mut metrics);
            let response_tokens: usize = samples.iter().map(|s| s.response_length).sum();
            let version = self
                .train_and_update(
                    rollout_id,
                    samples,
                    &mut metrics,
                    Some(clock),
                    overlap.then_some(&mut *pending),
                    &[],
                )
                .await?;
            metrics.insert("weight_version".into(), version.0 as f64);
            let step_time = started.elapsed().as_secs_f64();
            metrics.insert("perf/step_time".into(), step_time);
            if step_time > 0.0 {
                metrics.insert(
                    "perf/tokens_per_gpu_per_sec".into(),
                    response_tokens as f64 / step_time,
                );
            }
            if self.eval_due(Some(rollout_id)) {
                // Evaluate the new weights, not the ones a push in flight replaces.
                settle(pending).await?;
            }
            self.maybe_eval(Some(rollout_id), &mut metrics).await?;
            self.metrics.log(rollout_id, &metrics)?;
            self.next_rollout_id += 1;
            if self.should_save(rollout_id) {
                // The checkpoint needs the data source: borrow it back from the worker's lock.
                // Groups taken from it but not trained yet (generating, or queued for the
                // trainer) go into the checkpoint's buffer, to be generated again after a
                // resume: nothing is skipped, nothing is trained twice.
                let state = {
                    let source = data.lock().await;
                    let mut state = source.state();
                    state
                        .buffer
                        .extend(in_flight_for_retry(in_flight.snapshot()));
                    state
                };
                self.save_checkpoint(rollout_id, state).await?;
            }
        }
        Ok(())
    }

    fn should_save(&self, rollout_id: u64) -> bool {
        matches!(
            (self.config.save_interval, &self.config.save),
            (Some(every), Some(_)) if every > 0 && ((rollout_id + 1).is_multiple_of(every) || rollout_id + 1 == self.config.num_rollout)
        )
    }

    async fn maybe_save(&self, rollout_id: u64) -> Result<()> {
        if self.should_save(rollout_id) {
            self.save_checkpoint(rollout_id, self.data.state()).await?;
        }
        Ok(())
    }

    async fn save_checkpoint(&self, rollout_id: u64, data: DataSourceState) -> Result<()> {
        let Some(root) = self.config.save.clone() else {
            return Ok(());
        };
        let dir = root.join(format!("iter_{rollout_id:07}"));
        let partial = root.join(format!(".iter_{rollout_id:07}.partial"));
        std::fs::create_dir_all(&root).map_err(|source| Error::Io {
            path: root.clone(),
            source,
        })?;
        let _ = std::fs::remove_dir_all(&partial);
        let trainer = self.trainer.clone();
        let trainer_dir = partial.join("trainer");
        let version = self
            .on_trainer(move || {
                let trainer = lock(&trainer)?;
                trainer.save_checkpoint(&trainer_dir)?;
                Ok(trainer.weight_version())
            })
            .await?;
        let state = RolloutCheckpoint {
            next_rollout_id: rollout_id + 1,
            weight_version: version,
            data,
        };
        let path = partial.join(crate::checkpoint::ROLLOUT_STATE_FILE);
        let json = serde_json::to_vec_pretty(&state)
            .map_err(|e| Error::Config(format!("cannot serialise the rollout state: {e}")))?;
        std::fs::write(&path, json).map_err(|source| Error::Io { path, source })?;
        // Publish atomically and durably: every file fsynced, a manifest of sizes and
        // checksums, rename, parent fsynced. A run killed mid-save leaves only a `.partial`
        // folder behind.
        crate::checkpoint::publish(&partial, &dir)?;
        if let Some(keep) = self.config.keep_checkpoints {
            crate::checkpoint::prune(&root, keep)?;
        }
        Ok(())
    }

    /// What the last [`RlLoop::resume`] found: checkpoints skipped (and why), and the one it
    /// resumed from.
    pub fn resume_notes(&self) -> &[String] {
        &self.resume_notes
    }
}

/// The newest complete, valid `iter_NNNNNNN` checkpoint under `root` (checked against its
/// manifest; see [`crate::checkpoint::latest_valid_checkpoint`]).
pub fn latest_checkpoint(root: &Path) -> Option<PathBuf> {
    crate::checkpoint::latest_valid_checkpoint(root).0
}

/// Pushes the trainer's weights to `engine` at the trainer's version: pause, flush (unless
/// paused in place), update, resume, then check the engine reports that version.
pub async fn update_weights(
    engine: &Arc<dyn InferenceEngine>,
    trainer: &SharedTrainer,
    mode: PauseMode,
) -> Result<WeightVersion> {
    let shared = trainer.clone();
    let in_process = engine.takes_in_process_weights();
    let (weights, version) = blocking(move || export(&shared, in_process)).await?;
    push_to_engine(engine, trainer, weights, version, mode).await
}

/// What a push hands the engines: the trainer's weights in process (an engine of the same
/// process, no host copy) or as HF-named host tensors.
enum Exported {
    InProcess(InProcessWeights),
    Host(miles_core::NamedTensors),
}

/// The trainer's weights and version; in process when `in_process` and the trainer has them.
fn export(trainer: &SharedTrainer, in_process: bool) -> Result<(Exported, WeightVersion)> {
    let trainer = lock(trainer)?;
    let version = trainer.weight_version();
    if in_process && let Some(weights) = trainer.export_in_process()? {
        return Ok((Exported::InProcess(weights), version));
    }
    Ok((Exported::Host(trainer.export_weights()?), version))
}

/// A weight push running in the background (see [`LoopConfig::overlap_weight_updates`]).
type PendingPush = tokio::task::JoinHandle<Result<WeightVersion>>;

/// Waits for the push in `slot`, if any, and returns its error.
async fn settle(slot: &mut Option<PendingPush>) -> Result<()> {
    if let Some(push) = slot.take() {
        push.await
            .map_err(|e| Error::Task(format!("weight push task failed: {e}")))??;
    }
    Ok(())
}

/// Pause, flush (unless paused in place), update to `version`, resume, check the version.
/// In-process weights the engine refuses (another device, say) are exported again as host
/// tensors of the same version.
async fn push_to_engine(
    engine: &Arc<dyn InferenceEngine>,
    trainer: &SharedTrainer,
    weights: Exported,
    version: WeightVersion,
    mode: PauseMode,
) -> Result<WeightVersion> {
    engine.pause(mode).await?;
    let updated = async {
        if mode != PauseMode::InPlace {
            engine.flush_cache().await?;
        }
        let weights = match weights {
            Exported::Host(weights) => weights,
            Exported::InProcess(weights) => {
                if engine.update_weights_in_process(&weights, version).await? {
                    return Ok(());
                }
                let shared = trainer.clone();
                let (host, now) = blocking(move || {
                    let trainer = lock(&shared)?;
                    Ok((trainer.export_weights()?, trainer.weight_version()))
                })
                .await?;
                if now != version {
                    return Err(Error::Task(format!(
                        "the engine refused in-process weights of version {version} and the \
                         trainer has moved on to {now}"
                    )));
                }
                host
            }
        };
        Ok(engine.update_weights(&weights, version).await?)
    }
    .await;
    // Always resume, even when the update failed, so generation is never left paused.
    let resumed = engine.resume().await;
    updated?;
    resumed?;
    let reported = engine.weight_version().await?;
    if reported != version {
        return Err(Error::Task(format!(
            "engine reports weight version {reported} after updating to {version}"
        )));
    }
    Ok(version)
}

/// Keeps `in_flight` groups generating, pushing finished groups that pass the filters (and
/// hold no aborted sample) into `sender`; stops when the receiver is gone.
async fn generation_worker(
    manager: Arc<RolloutManager>,
    data: Arc<tokio::sync::Mutex<DataSource>>,
    sender: mpsc::Sender<Vec<Sample>>,
    in_flight: usize,
    clock: Arc<BusyClock>,
    taken: Arc<InFlight>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        while tasks.len() < in_flight {
            let groups = {
                // Taken and registered under the data lock, so a checkpoint sees each group
                // either in the data source or in flight, never in neither.
                let mut source = data.lock().await;
                let groups = source.get_groups(1);
                groups.iter().for_each(|g| taken.taken(g));
                groups
            };
            for group in groups {
                let manager = manager.clone();
                let busy = clock.enter();
                tasks.spawn(async move {
                    let _busy = busy;
                    manager.generate_group(group).await
                });
            }
        }
        let Some(joined) = tasks.join_next().await else {
            continue;
        };
        let Ok(group) = joined else { continue };
        if manager.failures().check().is_err() {
            // Failures dominate: stop generating; the steps report the error.
            taken.finished(&group);
            return;
        }
        // A group with a FAILED sample: generated again (up to the bound) or dropped. (The
        // in-flight registry knows a group by its first sample.)
        let head: Vec<Sample> = group.iter().take(1).cloned().collect();
        let mut group = match retry_failed_group(group, &manager.config().failure) {
            Ok(group) => group,
            Err(retry) => {
                taken.finished(&head);
                match retry {
                    Some(retry) => {
                        manager.failures().group_regenerated();
                        let mut source = data.lock().await;
                        if source.add_groups(vec![retry]).is_err() {
                            return;
                        }
                    }
                    None => manager.failures().group_dropped(),
                }
                continue;
            }
        };
        if group
            .iter()
            .any(|s| s.status == miles_core::SampleStatus::Aborted)
        {
            // Aborted by a weight update or an engine that died. With partial rollout the
            // samples resume from what they generated (each keeps every weight version it
            // saw, so staleness counts from the oldest); otherwise they start again.
            clock
                .aborted_groups
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if !crate::manager::keep_partial(&mut group, manager.config().partial_rollout) {
                group.iter_mut().for_each(Sample::reset_for_retry);
            }
            let mut source = data.lock().await;
            taken.finished(&group);
            if source.add_groups(vec![group]).is_err() {
                return;
            }
            continue;
        }
        if let FilterVerdict::Drop { .. } = manager.verdict(&group) {
            taken.finished(&group);
            continue;
        }
        mask_unusable(&mut group);
        if sender.send(group).await.is_err() {
            return;
        }
    }
}

/// Groups the async loop's worker took from the data source that are not yet trained,
/// dropped by a filter or returned to the data source: generating, or queued for the
/// trainer. A checkpoint stores them as groups to generate again.
#[derive(Debug, Default)]
struct InFlight {
    groups: Mutex<std::collections::BTreeMap<(u64, u64), Vec<Sample>>>,
}

impl InFlight {
    fn key(group: &[Sample]) -> (u64, u64) {
        group.first().map_or((u64::MAX, u64::MAX), |s| {
            (
                s.group_index.unwrap_or(u64::MAX),
                s.index.unwrap_or(u64::MAX),
            )
        })
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<(u64, u64), Vec<Sample>>> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn taken(&self, group: &[Sample]) {
        self.lock().insert(Self::key(group), group.to_vec());
    }

    fn finished(&self, group: &[Sample]) {
        self.lock().remove(&Self::key(group));
    }

    fn snapshot(&self) -> Vec<Vec<Sample>> {
        self.lock().values().cloned().collect()
    }

    fn take_all(&self) -> Vec<Vec<Sample>> {
        std::mem::take(&mut *self.lock()).into_values().collect()
    }
}

/// In-flight groups as the data source re-serves them: reset, to be generated again.
fn in_flight_for_retry(groups: Vec<Vec<Sample>>) -> Vec<Vec<Sample>> {
    groups
        .into_iter()
        .map(|mut group| {
            group.iter_mut().for_each(Sample::reset_for_retry);
            group
        })
        .collect()
}

/// What the async generation worker reports to the steps: the time during which at least
/// one generation task is in flight, and the groups it had to regenerate.
#[derive(Debug, Default)]
struct BusyClock {
    state: Mutex<BusyState>,
    /// Groups that came back with an aborted sample (a weight update, an engine that died)
    /// and were queued again, since the last step took the count.
    aborted_groups: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct BusyState {
    active: usize,
    since: Option<Instant>,
    total: std::time::Duration,
}

impl BusyClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, BusyState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks one task in flight until the guard drops (finished or aborted).
    fn enter(self: &Arc<Self>) -> BusyGuard {
        let mut state = self.lock();
        if state.active == 0 {
            state.since = Some(Instant::now());
        }
        state.active += 1;
        BusyGuard(self.clone())
    }

    /// Busy time so far, the current stretch included.
    fn busy(&self) -> std::time::Duration {
        let state = self.lock();
        state.total + state.since.map_or_else(Default::default, |t| t.elapsed())
    }
}

struct BusyGuard(Arc<BusyClock>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.active -= 1;
        if state.active == 0
            && let Some(since) = state.since.take()
        {
            state.total += since.elapsed();
        }
    }
}

/// A data source standing in while the real one is shared with the async worker.
fn placeholder_source(like: &DataSource) -> Result<DataSource> {
    DataSource::new(
        vec![crate::data::PromptRecord::text("", "")],
        like.n_samples_per_prompt(),
        false,
        0,
    )
}

fn lock(trainer: &SharedTrainer) -> Result<std::sync::MutexGuard<'_, Box<dyn PolicyTrainer>>> {
    trainer
        .lock()
        .map_err(|_| Error::Task("the trainer lock is poisoned (a train step panicked)".into()))
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::Task(format!("blocking task failed: {e}")))?
}

/// Miles' sample-side perf metrics (`_compute_perf_metrics_from_samples`):
/// `perf/tokens_per_gpu_per_sec` (response tokens / `rollout_time`, one engine device) and
/// `perf/longest_sample_tokens_per_sec` when `rollout_time` is a finite positive number, and
/// the `perf/non_generation_time/{mean,max,min}` statistics when any sample spent time
/// outside generation (tool calls).
pub fn sample_perf_metrics(samples: &[Sample], rollout_time: f64, metrics: &mut Metrics) {
    if samples.is_empty() {
        return;
    }
    if rollout_time.is_finite() && rollout_time > 0.0 {
        let total: usize = samples.iter().map(|s| s.response_length).sum();
        let longest = samples.iter().map(|s| s.response_length).max().unwrap_or(0);
        metrics.insert(
            "perf/tokens_per_gpu_per_sec".into(),
            total as f64 / rollout_time,
        );
        metrics.insert(
            "perf/longest_sample_tokens_per_sec".into(),
            longest as f64 / rollout_time,
        );
    }
    let times: Vec<f64> = samples.iter().map(|s| s.non_generation_time).collect();
    if times.iter().any(|&t| t > 0.0) {
        let n = times.len() as f64;
        metrics.insert(
            "perf/non_generation_time/mean".into(),
            times.iter().sum::<f64>() / n,
        );
        metrics.insert(
            "perf/non_generation_time/max".into(),
            times.iter().copied().fold(f64::MIN, f64::max),
        );
        metrics.insert(
            "perf/non_generation_time/min".into(),
            times.iter().copied().fold(f64::MAX, f64::min),
        );
    }
}

/// A rayon pool of `threads` threads named `name-N`, for work that must stay on its own
/// cores (the loop's [`LoopConfig::train_threads`]). burn's CPU backend parallelises through
/// the rayon pool it is called from, so running inside [`rayon::ThreadPool::install`] bounds
/// its cores.
pub fn compute_pool(threads: usize, name: &str) -> Result<rayon::ThreadPool> {
    if threads == 0 {
        return Err(Error::Config(format!(
            "{name}: compute threads must be >= 1"
        )));
    }
    let prefix = name.to_string();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{prefix}-{i}"))
        .build()
        .map_err(|e| {
            Error::Task(format!(
                "{name}: cannot start {threads} compute threads: {e}"
            ))
        })
}
