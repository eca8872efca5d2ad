//! Group-level checks before a group reaches the trainer: the staleness bound
//! (`--max-weight-staleness`) and the dynamic-sampling filters.

use miles_core::python;
use miles_core::{Sample, SampleStatus, WeightVersion};
use serde::{Deserialize, Serialize};

/// Staleness of a group for the trainer at `current`: `current − min over samples of their
/// oldest weight version` (Miles' staleness bound). `None` when no sample carries a numeric version.
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
