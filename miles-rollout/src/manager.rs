//! The rollout manager: groups of samples per prompt, bounded concurrency, rewards, dynamic
//! filters, over-sampling with abort of the surplus and partial rollout (Miles' rollout manager).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use miles_core::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, Metrics, RequestId, RewardFn,
    Sample, SampleStatus, SamplingParams, TokenId, async_trait, output_text,
};
use miles_session::agent::{Agent, AgentDriverConfig};
use miles_session::http::HttpClient;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::data::DataSource;
use crate::error::{Error, Result};
use crate::failures::{FailurePolicy, FailureTracker, retry_failed_group};
use crate::opd::OpdTeacher;
use crate::{DynamicFilter, FilterVerdict};

/// Turns a sample's prompt into token ids and response tokens back into text. miles-tito's
/// chat templates implement it for chat models; a plain tokenizer does for text prompts.
pub trait PromptEncoder: Send + Sync {
    /// The prompt token ids of a fresh sample (chat template applied, generation prompt
    /// added, tools from `metadata["tools"]`).
    fn encode(&self, sample: &Sample) -> miles_core::Result<Vec<TokenId>>;

    /// Decodes response tokens.
    fn decode(&self, tokens: &[TokenId]) -> String;

    /// Decodes response tokens, special tokens left out when `skip_special_tokens` (the
    /// response text as SGLang gives it). Default: [`PromptEncoder::decode`].
    fn decode_text(&self, tokens: &[TokenId], skip_special_tokens: bool) -> String {
        let _ = skip_special_tokens;
        self.decode(tokens)
    }
}

/// How one sample is generated, in place of the manager's single engine call (Miles'
/// `--custom-generate-function-path`). It gets the sample as the data source made it (prompt,
/// label, metadata, index) and the sampling parameters of this sample (per-turn
/// `max_new_tokens` = `rollout_max_response_len`, `sampling_seed` from `rollout_seed`), and
/// returns the generated sample: tokens, `response_length`, `loss_mask`, rollout log-probs,
/// status. It must not fail: a failure is a sample with status ABORTED or FAILED (the
/// manager scores only COMPLETED and TRUNCATED samples). [`AgentGenerator`] is the agentic
/// one.
#[async_trait]
pub trait SampleGenerator: Send + Sync {
    /// Generates `sample`.
    async fn generate(&self, sample: Sample, sampling: SamplingParams) -> Sample;

    /// Generates `sample` as one or more training samples (Miles: a generate function may
    /// return `list[Sample]`, e.g. one per turn under `--generate-multi-samples`). Siblings
    /// of one rollout carry the same explicit `rollout_id`; the manager scores the rollout
    /// once and gives every sibling that reward. The default is [`SampleGenerator::generate`].
    async fn generate_samples(&self, sample: Sample, sampling: SamplingParams) -> Vec<Sample> {
        vec![self.generate(sample, sampling).await]
    }
}

/// Multi-turn agentic generation through a session server (Miles'
/// `generate_hub/agentic_tool_call.generate`, Miles' `agentic_tool_call.generate`): each sample opens a session,
/// the user's [`Agent`] talks to it as to an OpenAI endpoint, and the session's records
/// become the training sample (exact token ids, log-probs, routed experts; tool outputs
/// masked out of the loss). The session server must serve the engine the manager trains
/// against (so that weight updates reach it).
pub struct AgentGenerator {
    agent: Arc<dyn Agent>,
    config: AgentDriverConfig,
    http: HttpClient,
}

impl AgentGenerator {
    /// `agent` against the session server of `config.server_url`.
    pub fn new(agent: Arc<dyn Agent>, config: AgentDriverConfig) -> Self {
        let http = HttpClient::new(config.http_timeout);
        Self {
            agent,
            config,
            http,
        }
    }

    /// The same generator with [`AgentDriverConfig::generate_multi_samples`] set to `on`
    /// (e.g. off for evaluation, which scores whole conversations).
    pub fn with_generate_multi_samples(&self, on: bool) -> Self {
        Self {
            agent: self.agent.clone(),
            config: self.config.clone().with_generate_multi_samples(on),
            http: self.http.clone(),
        }
    }
}

#[async_trait]
impl SampleGenerator for AgentGenerator {
    async fn generate(&self, sample: Sample, sampling: SamplingParams) -> Sample {
        miles_session::agent::generate(
            self.agent.as_ref(),
            &sample,
            &sampling,
            &self.config,
            &self.http,
        )
        .await
    }

    async fn generate_samples(&self, sample: Sample, sampling: SamplingParams) -> Vec<Sample> {
        miles_session::agent::generate_samples(
            self.agent.as_ref(),
            &sample,
            &sampling,
            &self.config,
            &self.http,
        )
        .await
    }
}

/// Rollout settings, with Miles' flag names and defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutConfig {
    /// Samples per prompt (`--n-samples-per-prompt`, 1).
    pub n_samples_per_prompt: usize,
    /// Groups per training step (`--rollout-batch-size`).
    pub rollout_batch_size: usize,
    /// Groups fetched each time the scheduler has room (`--over-sampling-batch-size`,
    /// defaults to `rollout_batch_size`).
    pub over_sampling_batch_size: Option<usize>,
    /// Concurrent generate calls (`--sglang-server-concurrency` × engines).
    pub max_concurrency: usize,
    /// Sampling (`--rollout-temperature`, `--rollout-top-p`, `--rollout-top-k`,
    /// `--rollout-stop`, `--rollout-stop-token-ids`).
    pub sampling: SamplingParams,
    /// Maximum response tokens (`--rollout-max-response-len`).
    pub rollout_max_response_len: usize,
    /// Maximum prompt + response tokens (`--rollout-max-context-len`).
    pub rollout_max_context_len: Option<usize>,
    /// With a seed, `sampling_seed = rollout_seed + sample index` (deterministic rollout).
    pub rollout_seed: Option<u64>,
    /// Dynamic-sampling filters applied to each finished group (`--dynamic-sampling-filter-path`).
    pub dynamic_filters: Vec<DynamicFilter>,
    /// Key of dict rewards (`--reward-key`).
    pub reward_key: Option<String>,
    /// Return aborted, partially generated groups to the data source to be resumed
    /// (`--partial-rollout`).
    pub partial_rollout: bool,
    /// Ask engines for routed experts (`--use-rollout-routing-replay`).
    pub return_routed_experts: bool,
    /// Log pass@k over each rollout's complete groups (`passrate/pass@k`) and each evaluation
    /// set (`eval/<name>-pass@k`), k = 1, 2, 4, … up to the group size (Miles'
    /// `--log-passrate`; a sample passes when its reward is exactly 1).
    pub log_passrate: bool,
    /// Failed samples (agents, rewards, engine errors): group regeneration bound and when the
    /// run stops (miles-rs' own; Miles has none).
    pub failure: FailurePolicy,
}

impl Default for RolloutConfig {
    fn default() -> Self {
        Self {
            n_samples_per_prompt: 1,
            rollout_batch_size: 1,
            over_sampling_batch_size: None,
            max_concurrency: 512,
            sampling: SamplingParams::default(),
            rollout_max_response_len: 1024,
            rollout_max_context_len: None,
            rollout_seed: None,
            dynamic_filters: Vec::new(),
            reward_key: None,
            partial_rollout: false,
            return_routed_experts: false,
            failure: FailurePolicy::default(),
            log_passrate: false,
        }
    }
}

impl RolloutConfig {
    /// Checks the values once.
    pub fn validate(self) -> Result<Self> {
        if self.n_samples_per_prompt == 0 || self.rollout_batch_size == 0 {
            return Err(Error::Config(
                "n_samples_per_prompt and rollout_batch_size must be >= 1".into(),
            ));
        }
        if self.max_concurrency == 0 {
            return Err(Error::Config("max_concurrency must be >= 1".into()));
        }
        if self.over_sampling_batch_size == Some(0) {
            return Err(Error::Config(
                "over_sampling_batch_size must be >= 1".into(),
            ));
        }
        self.failure.validate()?;
        Ok(self)
    }
}

/// What one rollout step produced.
#[derive(Debug, Clone, Default)]
pub struct RolloutBatch {
    /// Kept groups, ordered by their first sample's index.
    pub groups: Vec<Vec<Sample>>,
    /// Metrics under Miles' names (`rollout/raw_reward`, `rollout/response_len`,
    /// `rollout/truncated_ratio`, `rollout/dynamic_filter/drop_<reason>`, …).
    pub metrics: Metrics,
}

impl RolloutBatch {
    /// All samples, group after group.
    pub fn samples(&self) -> Vec<Sample> {
        self.groups.iter().flatten().cloned().collect()
    }
}

/// Generates groups through one engine (a router over many is itself an engine).
pub struct RolloutManager {
    config: RolloutConfig,
    engine: Arc<dyn InferenceEngine>,
    encoder: Arc<dyn PromptEncoder>,
    reward: Arc<dyn RewardFn>,
    generator: Option<Arc<dyn SampleGenerator>>,
    teacher: Option<Arc<OpdTeacher>>,
    permits: Arc<Semaphore>,
    next_request: Arc<AtomicU64>,
    failures: Arc<FailureTracker>,
}

impl RolloutManager {
    /// A manager over `engine`, scoring with `reward`.
    pub fn new(
        config: RolloutConfig,
        engine: Arc<dyn InferenceEngine>,
        encoder: Arc<dyn PromptEncoder>,
        reward: Arc<dyn RewardFn>,
    ) -> Result<Self> {
        let config = config.validate()?;
        Ok(Self {
            permits: Arc::new(Semaphore::new(config.max_concurrency)),
            failures: Arc::new(FailureTracker::new(config.failure.clone())),
            config,
            engine,
            encoder,
            reward,
            generator: None,
            teacher: None,
            next_request: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Generates each sample with `generator` (e.g. an [`AgentGenerator`]) instead of one
    /// engine call. Concurrency limits, rewards, filters, over-sampling and abort stay the
    /// manager's; the engine is still what weight updates and `abort_all` go to.
    pub fn with_generator(mut self, generator: Arc<dyn SampleGenerator>) -> Self {
        self.generator = Some(generator);
        self
    }

    /// Scores every sample with an on-policy-distillation teacher after its reward (Miles'
    /// `--use-opd --opd-type sglang`): per-turn siblings each on their own tokens.
    pub fn with_opd_teacher(mut self, teacher: Arc<OpdTeacher>) -> Self {
        self.teacher = Some(teacher);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &RolloutConfig {
        &self.config
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<dyn InferenceEngine> {
        &self.engine
    }

    /// The failure counts and the stop rule of this manager's runs.
    pub fn failures(&self) -> &FailureTracker {
        &self.failures
    }

    fn group_worker(&self) -> GroupWorker {
        GroupWorker {
            config: Arc::new(self.config.clone()),
            engine: self.engine.clone(),
            encoder: self.encoder.clone(),
            reward: self.reward.clone(),
            generator: self.generator.clone(),
            teacher: self.teacher.clone(),
            permits: self.permits.clone(),
            next_request: self.next_request.clone(),
            failures: self.failures.clone(),
        }
    }

    /// Generates, scores and filters groups until `rollout_batch_size` groups are kept, then
    /// aborts the surplus in flight. A group with a FAILED sample is generated again up to
    /// [`FailurePolicy::max_group_retries`] times, then dropped; when failures dominate
    /// ([`FailurePolicy`]) the rollout ends with [`Error::TooManyFailures`]. With `partial_rollout`, aborted groups that generated
    /// something go back to `data` (tagged `metadata.start_rollout_id = rollout_id`) to be
    /// resumed; otherwise they are dropped.
    pub async fn generate_rollout(
        &self,
        rollout_id: u64,
        data: &mut DataSource,
    ) -> Result<RolloutBatch> {
        let target = self.config.rollout_batch_size;
        let fetch = self.config.over_sampling_batch_size.unwrap_or(target);
        let worker = self.group_worker();
        let mut in_flight: JoinSet<Vec<Sample>> = JoinSet::new();
        let mut kept: Vec<Vec<Sample>> = Vec::new();
        let mut drops: BTreeMap<String, u64> = BTreeMap::new();
        let mut failed_tasks = 0u64;
        while kept.len() < target {
            // Group scheduler: room while pending groups < remaining budget.
            while in_flight.len() < target - kept.len() {
                for group in data.get_groups(fetch) {
                    let worker = worker.clone();
                    in_flight.spawn(async move { worker.run_group(group).await });
                }
            }
            let joined = in_flight.join_next().await;
            self.failures.check()?;
            match joined {
                Some(Ok(group)) => match retry_failed_group(group, &self.config.failure) {
                    Ok(mut group) => match self.verdict(&group) {
                        FilterVerdict::Keep => {
                            mask_unusable(&mut group);
                            kept.push(group);
                        }
                        FilterVerdict::Drop { reason } => *drops.entry(reason).or_default() += 1,
                    },
                    Err(Some(retry)) => {
                        self.failures.group_regenerated();
                        data.add_groups(vec![retry])?;
                    }
                    Err(None) => self.failures.group_dropped(),
                },
                Some(Err(join_error)) => {
                    failed_tasks += 1;
                    tracing::warn!(%join_error, "a rollout group task failed; skipped");
                    if failed_tasks > 8 * target as u64 {
                        return Err(Error::Task(format!(
                            "{failed_tasks} group tasks failed: {join_error}"
                        )));
                    }
                }
                None => unreachable!("the scheduler keeps at least one group in flight"),
            }
        }
        let leftovers = in_flight.len();
        let mut recycled = 0u64;
        if leftovers > 0 {
            self.engine.abort_all().await?;
            let mut returned = Vec::new();
            while let Some(joined) = in_flight.join_next().await {
                let Ok(mut group) = joined else { continue };
                if keep_partial(&mut group, self.config.partial_rollout) {
                    for sample in &mut group {
                        sample
                            .metadata
                            .entry("start_rollout_id")
                            .or_insert(Value::from(rollout_id));
                    }
                    returned.push(group);
                }
            }
            recycled = returned.len() as u64;
            data.add_groups(returned)?;
        }
        kept.sort_by_key(|g| g.first().and_then(|s| s.index).unwrap_or(u64::MAX));
        let mut metrics = rollout_metrics(&kept, self.config.reward_key.as_deref());
        metrics.extend(passrate_metrics(&self.config, &kept));
        for (reason, count) in drops {
            metrics.insert(
                format!("rollout/dynamic_filter/drop_{reason}"),
                count as f64,
            );
        }
        metrics.insert("rollout/aborted_groups".into(), leftovers as f64);
        self.failures.take_metrics(&mut metrics);
        metrics.insert("rollout/partial_groups_recycled".into(), recycled as f64);
        Ok(RolloutBatch {
            groups: kept,
            metrics,
        })
    }

    /// Generates and scores one group (no filters): for evaluation and the async loop.
    pub async fn generate_group(&self, group: Vec<Sample>) -> Vec<Sample> {
        self.group_worker().run_group(group).await
    }

    /// The dynamic-filter verdict on a finished group (first drop wins).
    pub fn verdict(&self, group: &[Sample]) -> FilterVerdict {
        for filter in &self.config.dynamic_filters {
            if let drop @ FilterVerdict::Drop { .. } =
                filter.apply(group, self.config.reward_key.as_deref())
            {
                return drop;
            }
        }
        FilterVerdict::Keep
    }
}

/// Everything a group task needs, cheap to clone into it.
#[derive(Clone)]
struct GroupWorker {
    config: Arc<RolloutConfig>,
    engine: Arc<dyn InferenceEngine>,
    encoder: Arc<dyn PromptEncoder>,
    reward: Arc<dyn RewardFn>,
    generator: Option<Arc<dyn SampleGenerator>>,
    teacher: Option<Arc<OpdTeacher>>,
    permits: Arc<Semaphore>,
    next_request: Arc<AtomicU64>,
    failures: Arc<FailureTracker>,
}

impl GroupWorker {
    async fn run_group(&self, group: Vec<Sample>) -> Vec<Sample> {
        let mut tasks = JoinSet::new();
        let size = group.len();
        for (slot, sample) in group.into_iter().enumerate() {
            let worker = self.clone();
            tasks.spawn(async move { (slot, worker.run_sample(sample).await) });
        }
        let mut out: Vec<Option<Vec<Sample>>> = vec![None; size];
        while let Some(joined) = tasks.join_next().await {
            if let Ok((slot, mut samples)) = joined
                && !samples.is_empty()
            {
                // Siblings all carry the rollout's id (Miles: `rollout_id or index`).
                if samples.len() > 1 {
                    let id = samples.iter().find_map(Sample::rollout_id);
                    for s in &mut samples {
                        s.rollout_id = s.rollout_id.or(id);
                    }
                }
                out[slot] = Some(samples);
            }
        }
        // One entry per rollout: its samples (one, or its per-turn siblings).
        let mut rollouts: Vec<Vec<Sample>> = out
            .into_iter()
            .map(|s| {
                s.unwrap_or_else(|| {
                    let mut failed = Sample {
                        status: SampleStatus::Failed,
                        remove_sample: true,
                        ..Sample::default()
                    };
                    failed
                        .metadata
                        .insert("failure".into(), Value::from("generation task panicked"));
                    failed
                        .metadata
                        .insert("failure_kind".into(), Value::from("panic"));
                    vec![failed]
                })
            })
            .collect();
        // Rewards for the rollouts that finished generating (group-level reward functions see
        // the whole group): one reward per rollout, computed on its last sample and given to
        // every sibling. A rollout with an unfinished (aborted, failed) sibling gets none, as
        // in Miles.
        let scored: Vec<usize> = (0..rollouts.len())
            .filter(|&i| rollouts[i].iter().all(finished_generating))
            .collect();
        if !scored.is_empty() {
            let subset: Vec<Sample> = scored
                .iter()
                .filter_map(|&i| rollouts[i].last().cloned())
                .collect();
            let rewards = self.reward.reward_group(&subset).await;
            for (&i, reward) in scored.iter().zip(rewards) {
                for sample in &mut rollouts[i] {
                    match &reward {
                        Ok(reward) => sample.reward = Some(reward.clone()),
                        Err(error) => {
                            sample.status = SampleStatus::Failed;
                            sample
                                .metadata
                                .insert("failure".into(), Value::from(format!("reward: {error}")));
                            sample
                                .metadata
                                .insert("failure_kind".into(), Value::from("reward"));
                        }
                    }
                }
            }
            // On-policy distillation: the teacher scores every rewarded sample.
            if let Some(teacher) = &self.teacher {
                for &i in &scored {
                    if rollouts[i].iter().all(|s| s.status != SampleStatus::Failed) {
                        teacher.score_all(&mut rollouts[i]).await;
                    }
                }
            }
        }
        let out: Vec<Sample> = rollouts.into_iter().flatten().collect();
        self.failures.record(&out);
        out
    }

    async fn run_sample(&self, mut sample: Sample) -> Vec<Sample> {
        // A recycled partial group holds samples that had finished before the abort: they
        // keep their response (generating again would run past their stop).
        if finished_generating(&sample) {
            return vec![sample];
        }
        let Ok(_permit) = self.permits.acquire().await else {
            sample.status = SampleStatus::Aborted;
            return vec![sample];
        };
        if let Some(generator) = &self.generator {
            let sampling = self.sampling_for(&sample, self.config.rollout_max_response_len);
            return generator.generate_samples(sample, sampling).await;
        }
        if let Err(reason) = self.generate_into(&mut sample).await {
            sample.status = SampleStatus::Failed;
            sample
                .metadata
                .insert("failure".into(), Value::from(reason.to_string()));
        }
        vec![sample]
    }

    /// The rollout sampling parameters for `sample` with `max_new_tokens` = `budget` and
    /// `sampling_seed` = `rollout_seed + index`.
    fn sampling_for(&self, sample: &Sample, budget: usize) -> SamplingParams {
        let mut sampling = self.config.sampling.clone();
        sampling.max_new_tokens = Some(budget);
        if let (Some(seed), Some(index)) = (self.config.rollout_seed, sample.index) {
            sampling.sampling_seed = Some(seed.wrapping_add(index));
        }
        sampling
    }

    /// One generate call for `sample`, resuming a partial response if there is one.
    async fn generate_into(&self, sample: &mut Sample) -> Result<()> {
        let config = &self.config;
        if sample.tokens.is_empty() {
            sample.tokens = self.encoder.encode(sample)?;
            sample.response_length = 0;
        }
        let mut budget = config
            .rollout_max_response_len
            .saturating_sub(sample.response_length);
        if let Some(context) = config.rollout_max_context_len {
            budget = budget.min(context.saturating_sub(sample.tokens.len()));
        }
        if budget == 0 {
            sample.status = SampleStatus::Truncated;
            return Ok(());
        }
        let sampling = self.sampling_for(sample, budget);
        let mut request = GenerateRequest::new(sample.tokens.clone(), sampling.clone());
        request.request_id = Some(RequestId::new(format!(
            "rollout-{}",
            self.next_request.fetch_add(1, Ordering::Relaxed)
        )));
        request.routing_key = sample.routing_key.clone();
        request.return_routed_experts = config.return_routed_experts;
        let output = match self.engine.generate(request).await {
            Ok(output) => output,
            Err(error) => {
                sample.status = SampleStatus::Aborted;
                sample
                    .metadata
                    .insert("engine_error".into(), Value::from(error.to_string()));
                return Ok(());
            }
        };
        let matched = output.matched_stop.clone();
        apply_output(sample, output)?;
        // SGLang's text: special tokens skipped and the matched stop trimmed unless asked.
        sample.response = output_text(
            sample.response_tokens(),
            matched.as_ref(),
            &sampling,
            |ids, skip| self.encoder.decode_text(ids, skip),
        );
        Ok(())
    }
}

/// Appends one engine call's output to `sample`: the generated ids with loss mask 1 and
/// their log-probs, the routed experts (which must cover every token but the last), the
/// weight version, prefix-cache counts, and the status from the finish reason (stop →
/// COMPLETED, length → TRUNCATED, abort → ABORTED).
pub(crate) fn apply_output(sample: &mut Sample, output: GenerateOutput) -> Result<()> {
    let log_probs = (output.output_log_probs.len() == output.output_ids.len())
        .then_some(output.output_log_probs.as_slice());
    sample.append_response(&output.output_ids, log_probs, 1)?;
    // A request aborted before it was prefilled ran no row: its (empty) table says nothing
    // about the sample's rows, which keep what earlier turns recorded.
    let ran_nothing = output.finish_reason == FinishReason::Abort && output.output_ids.is_empty();
    if let Some(routes) = output.routed_experts.filter(|_| !ran_nothing) {
        let rows = sample.tokens.len().saturating_sub(1);
        if routes.rows() != rows {
            return Err(Error::Core(miles_core::Error::SampleLength {
                field: "rollout_routed_experts",
                expected: rows,
                got: routes.rows(),
            }));
        }
        sample.rollout_routed_experts = Some(routes);
    }
    sample
        .weight_versions
        .push(output.weight_version.to_string());
    sample.prefix_cache_info.cached_tokens += output.cached_tokens as u64;
    sample.prefix_cache_info.total_prompt_tokens += output.prompt_tokens as u64;
    sample.status = match output.finish_reason {
        FinishReason::Stop => SampleStatus::Completed,
        FinishReason::Length => SampleStatus::Truncated,
        FinishReason::Abort => SampleStatus::Aborted,
    };
    Ok(())
}

/// Partial rollout of an interrupted group: with `partial_rollout` and some tokens generated,
/// the group is kept to resume from its partial output (its failed samples start again) and
/// `true` is returned; otherwise the group is left as it is and `false` returned.
pub(crate) fn keep_partial(group: &mut [Sample], partial_rollout: bool) -> bool {
    if !partial_rollout || group.iter().all(|s| s.response_length == 0) {
        return false;
    }
    for sample in group.iter_mut() {
        if sample.status == SampleStatus::Failed {
            sample.reset_for_retry();
        }
    }
    true
}

/// Whether a sample has finished generating (stop or length).
fn finished_generating(sample: &Sample) -> bool {
    matches!(
        sample.status,
        SampleStatus::Completed | SampleStatus::Truncated
    )
}

/// Aborted or failed samples of a kept group stay in it (group statistics need them) but are
/// never trained on: `remove_sample` zeroes their loss mask.
pub fn mask_unusable(group: &mut [Sample]) {
    for sample in group {
        if matches!(sample.status, SampleStatus::Aborted | SampleStatus::Failed) {
            sample.remove_sample = true;
        }
    }
}

/// Miles' rollout metrics over kept groups.
pub fn rollout_metrics(groups: &[Vec<Sample>], reward_key: Option<&str>) -> Metrics {
    let samples: Vec<&Sample> = groups.iter().flatten().collect();
    let mut metrics = Metrics::new();
    let n = samples.len().max(1) as f64;
    let rewards: Vec<f64> = samples
        .iter()
        .map(|s| s.scalar_reward(reward_key).unwrap_or(0.0))
        .collect();
    metrics.insert("rollout/raw_reward".into(), rewards.iter().sum::<f64>() / n);
    let lengths: Vec<f64> = samples.iter().map(|s| s.response_length as f64).collect();
    metrics.insert(
        "rollout/response_len/mean".into(),
        lengths.iter().sum::<f64>() / n,
    );
    metrics.insert(
        "rollout/response_len/max".into(),
        lengths.iter().copied().fold(0.0, f64::max),
    );
    let truncated = samples
        .iter()
        .filter(|s| s.status == SampleStatus::Truncated)
        .count();
    metrics.insert("rollout/truncated_ratio".into(), truncated as f64 / n);
    metrics.insert("rollout/samples".into(), samples.len() as f64);
    metrics.extend(tito_mismatch_metrics(&samples));
    metrics
}

/// `passrate/pass@k` over `groups` when the config asks for it (`--log-passrate`, Miles'
/// `_compute_passrate_from_samples`: complete groups only); empty otherwise.
pub fn passrate_metrics(config: &RolloutConfig, groups: &[Vec<Sample>]) -> Metrics {
    if !config.log_passrate {
        return Metrics::new();
    }
    let samples: Vec<Sample> = groups.iter().flatten().cloned().collect();
    crate::passrate::pass_rate_of_samples(
        &samples,
        config.n_samples_per_prompt,
        config.reward_key.as_deref(),
    )
    .into_iter()
    .map(|(k, v)| (format!("passrate/{k}"), v))
    .collect()
}

/// The mismatch types a session server reports, in Miles' order. All but `assistant_text`
/// are hard failures of token-in-token-out; `assistant_text` is tolerated (the model's own
/// tokens may differ from the canonical tokenization of their text, which is what TITO keeps).
pub const TITO_MISMATCH_TYPES: [&str; 4] = [
    "special_token_count",
    "special_token_type",
    "non_assistant_text",
    "assistant_text",
];

/// Miles' session-mismatch rollout metrics over the samples that carry
/// `metadata.tito_session_mismatch` (agentic samples from a session server):
/// `rollout/tito_session_mismatch_rate/v1` = the fraction with at least one mismatch, and
/// `rollout/tito_session_mismatch_rate/v1/<type>` = the fraction with one of that type. Empty
/// when no sample carries it.
pub fn tito_mismatch_metrics(samples: &[&Sample]) -> Metrics {
    let lists: Vec<&Vec<Value>> = samples
        .iter()
        .filter_map(|s| s.metadata.get("tito_session_mismatch")?.as_array())
        .collect();
    let mut metrics = Metrics::new();
    if lists.is_empty() {
        return metrics;
    }
    let n = lists.len() as f64;
    let key = "rollout/tito_session_mismatch_rate/v1";
    let any = lists.iter().filter(|l| !l.is_empty()).count();
    metrics.insert(key.into(), any as f64 / n);
    for kind in TITO_MISMATCH_TYPES {
        let with = lists
            .iter()
            .filter(|l| {
                l.iter()
                    .any(|m| m.get("type").and_then(Value::as_str) == Some(kind))
            })
            .count();
        metrics.insert(format!("{key}/{kind}"), with as f64 / n);
    }
    metrics
}
