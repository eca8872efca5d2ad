//! # miles-rollout
//!
//! Rollout orchestration for RL post-training: the rollout manager (groups, rewards, dynamic
//! filters, over-sampling with abort, staleness control, partial rollout), prompt data and the
//! synchronous / fully-asynchronous RL loops. It drives any [`miles_core::InferenceEngine`]
//! (the embedded engine of miles-engine, SGLang servers through miles-session's client, a
//! miles-session `Router` over a fleet) and any [`miles_core::PolicyTrainer`] through
//! miles-core's traits, and never imports miles-train, miles-engine or burn: it is burn-free
//! with every feature set.
//!
//! Available now:
//! * data: JSONL / Parquet prompt datasets ([`load_dataset`], [`DataSource`]), epochs,
//!   seeded shuffling, a resumable cursor and a buffer of returned groups;
//! * the [`RolloutManager`] — groups of `n_samples_per_prompt`, bounded
//!   concurrency, rewards (any [`miles_core::RewardFn`]; Miles' rules and a reward model over
//!   HTTP are in miles-reward), dynamic filters, over-sampling with abort of the surplus, partial
//!   rollout — with three generation modes: single-turn (one engine call per sample, the
//!   default), agentic ([`AgentGenerator`]: a user agent talks to a session server over
//!   HTTP) and the token-level multi-turn tool loop ([`MultiTurnGenerator`] with a user
//!   [`ToolExecutor`]); any [`SampleGenerator`] plugs in
//!   with [`RolloutManager::with_generator`];
//! * the synchronous and fully-asynchronous [`RlLoop`] with versioned weight updates
//!   (pause → flush → update → resume → version check), staleness control and resumable
//!   checkpoints;
//! * the group-level checks: the staleness bound ([`group_staleness`],
//!   `--max-weight-staleness`) and the dynamic-sampling filters ([`DynamicFilter`]).
//!
//! ```
//! use miles_core::{Prompt, Sample, WeightVersion};
//! use miles_rollout::{DynamicFilter, FilterVerdict, group_staleness};
//!
//! let mut group: Vec<Sample> = (0..2)
//!     .map(|_| Sample::builder(Prompt::Text("q".into())).build().unwrap())
//!     .collect();
//! group[0].weight_versions = vec!["3".into()];
//! group[1].weight_versions = vec!["5".into(), "6".into()];
//! // Generated with weights as old as version 3, the trainer is at 7: 4 versions stale.
//! assert_eq!(group_staleness(&group, WeightVersion(7)), Some(4));
//!
//! group[0].reward = Some(1.0.into());
//! group[1].reward = Some(1.0.into());
//! // Equal rewards carry no GRPO signal: the group is dropped.
//! assert_eq!(
//!     DynamicFilter::CheckRewardNonzeroStd.apply(&group, None),
//!     FilterVerdict::Drop { reason: "zero_std_1.0".into() }
//! );
//! ```

pub mod checkpoint;
mod data;
mod encoder;
mod error;
mod loops;
mod manager;
mod multi_turn;

pub use data::{
    DEFAULT_MAX_ROW_BYTES, DataCursor, DataSource, DataSourceState, DatasetFormat, DatasetKeys,
    DatasetOptions, LoadedDataset, PromptDataPath, PromptRecord, REPORTED_BAD_ROWS, RowRange,
    SkippedRows, collapse_siblings, load_dataset, load_jsonl, parse_jsonl,
};
pub use encoder::ChatPromptEncoder;
pub use error::{Error, Result, RowError, RowErrorKind};
pub use loops::{
    EvalSet, LoopConfig, RlLoop, RolloutCheckpoint, SharedTrainer, UnusedSamplesHandler,
    latest_checkpoint, sample_perf_metrics, update_weights,
};
pub use manager::{
    AgentGenerator, PromptEncoder, RolloutBatch, RolloutConfig, RolloutManager, SampleGenerator,
    TITO_MISMATCH_TYPES, mask_unusable, rollout_metrics, tito_mismatch_metrics,
};
pub use multi_turn::{MultiTurnGenerator, ToolExecutor};

use miles_core::python;
use miles_core::{Sample, SampleStatus, WeightVersion};
use serde::{Deserialize, Serialize};

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

/// Staleness of a group for the trainer at `current`: `current − min over samples of their
/// oldest weight version` (MILES_SPEC §6.3). `None` when no sample carries a numeric version.
pub fn group_staleness(group: &[Sample], current: WeightVersion) -> Option<u64> {
    group
        .iter()
        .filter_map(Sample::oldest_weight_version)
        .min()
        .map(|oldest| oldest.staleness(current))
}

/// Whether a group may reach the trainer under `--max-weight-staleness` (`None` = no bound).
/// Groups without a numeric version are never stale.
pub fn within_staleness(group: &[Sample], current: WeightVersion, max: Option<u64>) -> bool {
    match (max, group_staleness(group, current)) {
        (Some(max), Some(staleness)) => staleness <= max,
        _ => true,
    }
}

/// The verdict of a dynamic-sampling filter on one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FilterVerdict {
    /// Keep the group.
    Keep,
    /// Drop it, with Miles' reason label.
    Drop {
        /// Why (`zero_std_<r0>`, `group_has_aborted`).
        reason: String,
    },
}

/// Built-in dynamic-sampling filters, named as Miles' `filter_hub` functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DynamicFilter {
    /// Keep a group iff the float64 standard deviation of its rewards exceeds 1e-8; the drop
    /// reason is `zero_std_<first reward rounded to 1 decimal>`.
    CheckRewardNonzeroStd,
    /// Drop a group if any sample was aborted (`group_has_aborted`).
    CheckNoAborted,
}

impl DynamicFilter {
    /// Applies the filter; `reward_key` selects a component of dict rewards. Missing rewards
    /// count as 0.
    pub fn apply(self, group: &[Sample], reward_key: Option<&str>) -> FilterVerdict {
        match self {
            Self::CheckRewardNonzeroStd => {
                let rewards: Vec<f64> = group
                    .iter()
                    .map(|s| s.scalar_reward(reward_key).unwrap_or(0.0))
                    .collect();
                if rewards.is_empty() {
                    return FilterVerdict::Drop {
                        reason: "empty_group".into(),
                    };
                }
                let n = rewards.len() as f64;
                let mean = rewards.iter().sum::<f64>() / n;
                let std = (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
                if std > 1e-8 {
                    FilterVerdict::Keep
                } else {
                    FilterVerdict::Drop {
                        reason: format!(
                            "zero_std_{}",
                            python::float_repr(python::round(rewards[0], 1))
                        ),
                    }
                }
            }
            Self::CheckNoAborted => {
                if group.iter().any(|s| s.status == SampleStatus::Aborted) {
                    FilterVerdict::Drop {
                        reason: "group_has_aborted".into(),
                    }
                } else {
                    FilterVerdict::Keep
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;

    fn sample(reward: f64, versions: &[&str]) -> Sample {
        let mut s = Sample::builder(Prompt::Text(String::new()))
            .reward(reward)
            .build()
            .unwrap();
        s.weight_versions = versions.iter().map(|v| v.to_string()).collect();
        s
    }

    #[test]
    fn staleness_uses_the_oldest_version_of_any_sample() {
        let group = [sample(0.0, &["4", "2"]), sample(1.0, &["5"])];
        assert_eq!(group_staleness(&group, WeightVersion(5)), Some(3));
        assert!(within_staleness(&group, WeightVersion(5), Some(3)));
        assert!(!within_staleness(&group, WeightVersion(6), Some(3)));
        assert!(within_staleness(&group, WeightVersion(100), None));
        let unversioned = [sample(0.0, &["default"])];
        assert_eq!(group_staleness(&unversioned, WeightVersion(9)), None);
        assert!(within_staleness(&unversioned, WeightVersion(9), Some(0)));
    }

    #[test]
    fn reward_std_filter_matches_miles_labels() {
        let varied = [sample(0.0, &[]), sample(1.0, &[])];
        assert_eq!(
            DynamicFilter::CheckRewardNonzeroStd.apply(&varied, None),
            FilterVerdict::Keep
        );
        let flat = [sample(0.25, &[]), sample(0.25, &[])];
        // Python: f"zero_std_{round(0.25, 1)}" == "zero_std_0.2" (banker's rounding).
        assert_eq!(
            DynamicFilter::CheckRewardNonzeroStd.apply(&flat, None),
            FilterVerdict::Drop {
                reason: "zero_std_0.2".into()
            }
        );
        let tricky = [sample(0.35, &[]), sample(0.35, &[])];
        // Python: round(0.35, 1) == 0.3 (0.35 is stored just below the tie).
        assert_eq!(
            DynamicFilter::CheckRewardNonzeroStd.apply(&tricky, None),
            FilterVerdict::Drop {
                reason: "zero_std_0.3".into()
            }
        );
        let negative = [sample(-1.0, &[]), sample(-1.0, &[])];
        assert_eq!(
            DynamicFilter::CheckRewardNonzeroStd.apply(&negative, None),
            FilterVerdict::Drop {
                reason: "zero_std_-1.0".into()
            }
        );
    }

    #[test]
    fn aborted_filter() {
        let mut group = [sample(0.0, &[]), sample(1.0, &[])];
        assert_eq!(
            DynamicFilter::CheckNoAborted.apply(&group, None),
            FilterVerdict::Keep
        );
        group[1].status = SampleStatus::Aborted;
        assert_eq!(
            DynamicFilter::CheckNoAborted.apply(&group, None),
            FilterVerdict::Drop {
                reason: "group_has_aborted".into()
            }
        );
    }
}
