//! pass@k as Miles logs it with `--log-passrate`: the unbiased estimator
//! `1 - C(n - c, k) / C(n, k)` per prompt (n samples, c of them with reward exactly 1),
//! averaged over prompts, for k = 1, 2, 4, … up to the group size.

use std::collections::BTreeMap;

use miles_core::Sample;

/// The unbiased pass@k estimate of one prompt with `n` samples of which `correct` passed:
/// `1 - C(n - c, k) / C(n, k)`, computed as Miles does as `1 - Π_{i = n-c+1}^{n} (1 - k / i)`
/// (1 when fewer than `k` samples failed).
pub fn pass_at_k(n: usize, correct: usize, k: usize) -> f64 {
    let failed = n.saturating_sub(correct);
    if failed < k {
        return 1.0;
    }
    let product: f64 = (failed + 1..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product();
    1.0 - product
}

/// Miles' `compute_pass_rate`: `rewards` holds whole groups of `group_size` contiguous
/// samples; a sample passes when its reward is exactly 1. Returns `pass@k` for every power of
/// two `k <= group_size`, the mean over groups; empty for a group size of 1 (or 0), or when
/// the rewards are not whole groups.
pub fn pass_rate(rewards: &[f64], group_size: usize) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if group_size <= 1 || rewards.is_empty() || !rewards.len().is_multiple_of(group_size) {
        return out;
    }
    let correct: Vec<usize> = rewards
        .chunks(group_size)
        .map(|g| g.iter().filter(|r| **r == 1.0).count())
        .collect();
    let mut k = 1;
    while k <= group_size {
        let sum: f64 = correct.iter().map(|&c| pass_at_k(group_size, c, k)).sum();
        out.insert(format!("pass@{k}"), sum / correct.len() as f64);
        k *= 2;
    }
    out
}

/// Miles' `_compute_passrate_from_samples`: samples grouped by `group_index` (in order of
/// first appearance), only complete groups of `group_size` counted (incomplete ones — a
/// filter removed samples — are left out, with a warning), rewards read with `reward_key`
/// (a sample without a scalar reward counts as failed). Keys as [`pass_rate`]'s.
pub fn pass_rate_of_samples(
    samples: &[Sample],
    group_size: usize,
    reward_key: Option<&str>,
) -> BTreeMap<String, f64> {
    if group_size <= 1 {
        return BTreeMap::new();
    }
    let mut order: Vec<Option<u64>> = Vec::new();
    let mut groups: BTreeMap<Option<u64>, Vec<f64>> = BTreeMap::new();
    for sample in samples {
        let reward = sample.scalar_reward(reward_key).unwrap_or(0.0);
        let group = groups.entry(sample.group_index).or_insert_with(|| {
            order.push(sample.group_index);
            Vec::new()
        });
        group.push(reward);
    }
    let complete: Vec<&Vec<f64>> = order
        .iter()
        .map(|g| &groups[g])
        .filter(|g| g.len() == group_size)
        .collect();
    if complete.len() < order.len() {
        tracing::warn!(
            excluded = order.len() - complete.len(),
            groups = order.len(),
            group_size,
            "pass@k: incomplete groups (fewer than n_samples_per_prompt samples) excluded"
        );
    }
    let flat: Vec<f64> = complete.into_iter().flatten().copied().collect();
    pass_rate(&flat, group_size)
}
