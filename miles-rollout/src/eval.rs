//! Held-out evaluation: one [`EvalSet`] per dataset (`--eval-config` / `--eval-prompt-data`),
//! each generated and scored on the current weights with its own sampling, and logged under
//! Miles' metric names (`log_eval_rollout_data`).

use std::sync::Arc;

use miles_core::{Metrics, Sample, SampleStatus};

use crate::data::{DataSource, PromptRecord};
use crate::error::{Error, Result};
use crate::manager::{PromptEncoder, RolloutManager, passrate_metrics, rollout_metrics};

/// A held-out prompt set evaluated on the current weights (one dataset of `--eval-config`, or
/// `--eval-prompt-data NAME PATH`), with its own reward and sampling (its manager's config:
/// `n_samples_per_prompt`, sampling, response and context limits, `reward_key` =
/// `--eval-reward-key`).
pub struct EvalSet {
    /// Name used in the metric keys (`eval/<name>`, `eval/<name>/...`).
    pub name: String,
    /// The prompts.
    pub prompts: Vec<PromptRecord>,
    /// Generates and scores them (its config's `n_samples_per_prompt` applies).
    pub manager: Arc<RolloutManager>,
}

impl EvalSet {
    /// Generates every prompt's group on the current weights and returns the set's metrics
    /// ([`eval_metrics`]).
    pub async fn evaluate(&self) -> Result<Metrics> {
        let n = self.manager.config().n_samples_per_prompt;
        let mut source = DataSource::new(self.prompts.clone(), n, false, 0)?;
        let mut tasks = tokio::task::JoinSet::new();
        for group in source.get_groups(self.prompts.len()) {
            let manager = self.manager.clone();
            tasks.spawn(async move { manager.generate_group(group).await });
        }
        let mut groups = Vec::with_capacity(self.prompts.len());
        while let Some(joined) = tasks.join_next().await {
            groups.push(joined.map_err(|e| Error::Task(format!("eval task failed: {e}")))?);
        }
        // Prompt order (Miles sorts by sample index), so pass@k sees contiguous groups.
        groups.sort_by_key(|g| g.first().and_then(|s| s.index).unwrap_or(u64::MAX));
        Ok(eval_metrics(&self.name, &groups, self.manager.config()))
    }
}

/// The metrics of one evaluated set, under Miles' names (`log_eval_rollout_data`):
/// * `eval/<name>`: the mean reward (read with `reward_key`; a sample without one counts 0),
///   `eval/<name>-none_reward_ratio`: the share of samples without a reward,
///   `eval/<name>-truncated_ratio` (and `eval/<name>/truncated_ratio`): the share cut by the
///   length limit;
/// * `eval/<name>/response_len/{mean,median,max,min}`;
/// * with `log_passrate`: `eval/<name>-pass@k`, k = 1, 2, 4, … up to the set's samples per
///   prompt;
/// * miles-rs' own: `eval/<name>/raw_reward` (= `eval/<name>`), `eval/<name>/samples`, and the
///   session-mismatch rates of agentic samples (`eval/<name>/tito_session_mismatch_rate/...`).
pub fn eval_metrics(name: &str, groups: &[Vec<Sample>], config: &crate::RolloutConfig) -> Metrics {
    let mut metrics: Metrics = rollout_metrics(groups, config.reward_key.as_deref())
        .into_iter()
        .filter_map(|(key, value)| {
            key.strip_prefix("rollout/")
                .map(|rest| (format!("eval/{name}/{rest}"), value))
        })
        .collect();
    let samples: Vec<&Sample> = groups.iter().flatten().collect();
    let n = samples.len();
    let rewards: Vec<Option<f64>> = samples
        .iter()
        .map(|s| s.scalar_reward(config.reward_key.as_deref()))
        .collect();
    let none = rewards.iter().filter(|r| r.is_none()).count();
    let ratio = |count: usize| if n > 0 { count as f64 / n as f64 } else { 0.0 };
    metrics.insert(format!("eval/{name}-none_reward_ratio"), ratio(none));
    if none > 0 {
        tracing::warn!(
            "eval/{name}: {none}/{n} samples have no reward (errored / aborted); counted as 0.0"
        );
    }
    let sum: f64 = rewards.iter().map(|r| r.unwrap_or(0.0)).sum();
    metrics.insert(
        format!("eval/{name}"),
        if n > 0 { sum / n as f64 } else { 0.0 },
    );
    let truncated = samples
        .iter()
        .filter(|s| s.status == SampleStatus::Truncated)
        .count();
    metrics.insert(format!("eval/{name}-truncated_ratio"), ratio(truncated));
    let mut lengths: Vec<f64> = samples.iter().map(|s| s.response_length as f64).collect();
    if !lengths.is_empty() {
        lengths.sort_by(f64::total_cmp);
        let mid = lengths.len() / 2;
        let median = if lengths.len().is_multiple_of(2) {
            (lengths[mid - 1] + lengths[mid]) / 2.0
        } else {
            lengths[mid]
        };
        metrics.insert(format!("eval/{name}/response_len/median"), median);
        metrics.insert(format!("eval/{name}/response_len/min"), lengths[0]);
    }
    for (key, value) in passrate_metrics(config, groups) {
        if let Some(k) = key.strip_prefix("passrate/") {
            metrics.insert(format!("eval/{name}-{k}"), value);
        }
    }
    metrics
}

/// The prompts whose encoded length (chat template applied, as the engine gets them) is at most
/// `max_len` tokens (Miles' `--eval-max-prompt-len` / `filter_long_prompt`); all of them for
/// `None`. Returns the kept prompts and how many were dropped.
pub fn filter_long_prompts(
    prompts: Vec<PromptRecord>,
    encoder: &dyn PromptEncoder,
    max_len: Option<usize>,
) -> Result<(Vec<PromptRecord>, usize)> {
    let Some(max_len) = max_len else {
        return Ok((prompts, 0));
    };
    let total = prompts.len();
    let mut kept = Vec::with_capacity(total);
    for record in prompts {
        if encoder.encode(&record.to_sample())?.len() <= max_len {
            kept.push(record);
        }
    }
    let dropped = total - kept.len();
    Ok((kept, dropped))
}
