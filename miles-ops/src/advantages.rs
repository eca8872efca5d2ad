//! Reward normalisation (Miles' rollout side) and advantage estimators (its actor).
//!
//! These run on the host, per sample, exactly like Miles' rollout-to-train-data conversion:
//! rewards are scalars per sample, per-token quantities (KL, values, loss mask) are slices
//! over the response tokens. Everything is computed in `f64` and returned as `f32`.
//!
//! Pipeline: [`AdvantageCalculator::normalize_rewards`] (group-mean subtraction, optional
//! std division) → [`AdvantageCalculator::compute`] (estimator per sample, then
//! `--normalize-advantages` masked whitening across the batch).

use serde::{Deserialize, Serialize};

use crate::{OpsError, Result};

/// The advantage estimator (`--advantage-estimator`, default `grpo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Group-relative: `A_t = R` (group-normalised reward) on every token.
    /// With `--disable-grpo-std-normalization` this is Dr.GRPO (mean-centred only).
    #[default]
    Grpo,
    /// Same advantages as `grpo`; the policy loss uses a sequence-level ratio.
    Gspo,
    /// Discounted returns of token rewards `−kl_coef·kl_t` plus `R` on the last trainable token.
    ReinforcePlusPlus,
    /// `A_t = R − kl_coef·kl_t` with `R` group-mean-subtracted.
    ReinforcePlusPlusBaseline,
    /// GAE over trainable tokens with a critic's values.
    Ppo,
}

impl AdvantageEstimator {
    /// The Miles CLI value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Gspo => "gspo",
            Self::ReinforcePlusPlus => "reinforce_plus_plus",
            Self::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            Self::Ppo => "ppo",
        }
    }

    /// Whether Miles group-normalises rewards for this estimator (mean subtraction).
    pub fn normalizes_rewards(self) -> bool {
        matches!(
            self,
            Self::Grpo | Self::Gspo | Self::ReinforcePlusPlusBaseline
        )
    }
}

impl std::fmt::Display for AdvantageEstimator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AdvantageEstimator {
    type Err = OpsError;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "grpo" => Self::Grpo,
            "gspo" => Self::Gspo,
            "reinforce_plus_plus" => Self::ReinforcePlusPlus,
            "reinforce_plus_plus_baseline" => Self::ReinforcePlusPlusBaseline,
            "ppo" => Self::Ppo,
            other => {
                return Err(OpsError::InvalidConfig {
                    flag: "advantage-estimator",
                    reason: format!("unknown estimator `{other}`"),
                });
            }
        })
    }
}

/// Epsilon added to the group std before dividing (Miles: `std + 1e-6`).
pub const GROUP_STD_EPS: f64 = 1e-6;
/// Epsilon inside the whitening `rsqrt(var + eps)` (Miles: `1e-8`).
pub const WHITEN_EPS: f64 = 1e-8;

/// Advantage settings, one field per Miles flag, with Miles' defaults.
///
/// Validate once with [`AdvantageConfig::init`]; the resulting [`AdvantageCalculator`] is
/// what computes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdvantageConfig {
    /// `--advantage-estimator` (`grpo`).
    pub advantage_estimator: AdvantageEstimator,
    /// `--gamma` (1.0): discount for `reinforce_plus_plus` and `ppo`.
    pub gamma: f64,
    /// `--lambd` (1.0): GAE λ for `ppo`.
    pub lambd: f64,
    /// `--kl-coef` (0.0): weight of the per-token KL reward shaping.
    pub kl_coef: f64,
    /// `--normalize-advantages` (false): masked whitening across the batch.
    pub normalize_advantages: bool,
    /// `--disable-grpo-std-normalization` (false): Dr.GRPO, no division by the group std.
    pub disable_grpo_std_normalization: bool,
    /// `--disable-rewards-normalization` (false): no group-mean subtraction at all.
    pub disable_rewards_normalization: bool,
    /// `--n-samples-per-prompt` (1): fan-out used to group samples when no group index is
    /// given. Std normalisation is forced off when it is 1.
    pub n_samples_per_prompt: usize,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        Self {
            advantage_estimator: AdvantageEstimator::Grpo,
            gamma: 1.0,
            lambd: 1.0,
            kl_coef: 0.0,
            normalize_advantages: false,
            disable_grpo_std_normalization: false,
            disable_rewards_normalization: false,
            n_samples_per_prompt: 1,
        }
    }
}

impl AdvantageConfig {
    /// Sets `--advantage-estimator`.
    pub fn with_advantage_estimator(mut self, estimator: AdvantageEstimator) -> Self {
        self.advantage_estimator = estimator;
        self
    }
    /// Sets `--gamma`.
    pub fn with_gamma(mut self, gamma: f64) -> Self {
        self.gamma = gamma;
        self
    }
    /// Sets `--lambd`.
    pub fn with_lambd(mut self, lambd: f64) -> Self {
        self.lambd = lambd;
        self
    }
    /// Sets `--kl-coef`.
    pub fn with_kl_coef(mut self, kl_coef: f64) -> Self {
        self.kl_coef = kl_coef;
        self
    }
    /// Sets `--normalize-advantages`.
    pub fn with_normalize_advantages(mut self, on: bool) -> Self {
        self.normalize_advantages = on;
        self
    }
    /// Sets `--disable-grpo-std-normalization` (Dr.GRPO).
    pub fn with_disable_grpo_std_normalization(mut self, on: bool) -> Self {
        self.disable_grpo_std_normalization = on;
        self
    }
    /// Sets `--disable-rewards-normalization`.
    pub fn with_disable_rewards_normalization(mut self, on: bool) -> Self {
        self.disable_rewards_normalization = on;
        self
    }
    /// Sets `--n-samples-per-prompt`.
    pub fn with_n_samples_per_prompt(mut self, n: usize) -> Self {
        self.n_samples_per_prompt = n;
        self
    }

    /// Validates the configuration once.
    pub fn init(self) -> Result<AdvantageCalculator> {
        let unit = |flag: &'static str, v: f64| {
            if v.is_finite() && (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(OpsError::InvalidConfig {
                    flag,
                    reason: format!("{v} is not in [0, 1]"),
                })
            }
        };
        unit("gamma", self.gamma)?;
        unit("lambd", self.lambd)?;
        if !self.kl_coef.is_finite() {
            return Err(OpsError::InvalidConfig {
                flag: "kl-coef",
                reason: format!("{} is not finite", self.kl_coef),
            });
        }
        if self.n_samples_per_prompt == 0 {
            return Err(OpsError::InvalidConfig {
                flag: "n-samples-per-prompt",
                reason: "must be at least 1".into(),
            });
        }
        Ok(AdvantageCalculator { config: self })
    }
}

/// How samples are grouped for reward normalisation (Miles: by `group_index`, else by the
/// fixed fan-out `n_samples_per_prompt`, else one group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping<'a> {
    /// One group id per sample (any order; samples with the same id form a group).
    GroupIndex(&'a [u64]),
    /// Consecutive chunks of `n_samples_per_prompt` samples.
    FanOut,
    /// The whole batch is one group.
    Whole,
}

/// One sample's input to the estimators. Slices cover the response tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdvantageSample<'a> {
    /// Scalar reward, already passed through [`AdvantageCalculator::normalize_rewards`].
    pub reward: f32,
    /// Loss mask over the response tokens (`> 0` = trainable).
    pub loss_mask: &'a [f32],
    /// Per-token KL for reward shaping (needed when `kl_coef ≠ 0`); see
    /// [`crate::shaping_kl`].
    pub kl: Option<&'a [f32]>,
    /// Critic values per response token (needed by `ppo`).
    pub values: Option<&'a [f32]>,
}

impl<'a> AdvantageSample<'a> {
    /// A sample with a reward and a loss mask, no KL, no values.
    pub fn new(reward: f32, loss_mask: &'a [f32]) -> Self {
        Self {
            reward,
            loss_mask,
            kl: None,
            values: None,
        }
    }
    /// Adds the per-token shaping KL.
    pub fn with_kl(mut self, kl: &'a [f32]) -> Self {
        self.kl = Some(kl);
        self
    }
    /// Adds critic values.
    pub fn with_values(mut self, values: &'a [f32]) -> Self {
        self.values = Some(values);
        self
    }
}

/// Advantages and returns of one sample, one entry per response token.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdvantageOutput {
    /// Per-token advantages.
    pub advantages: Vec<f32>,
    /// Per-token returns (value targets for `ppo`; equal to advantages otherwise).
    pub returns: Vec<f32>,
}

/// A validated [`AdvantageConfig`] that normalises rewards and computes advantages.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageCalculator {
    config: AdvantageConfig,
}

impl AdvantageCalculator {
    /// The validated configuration.
    pub fn config(&self) -> &AdvantageConfig {
        &self.config
    }

    /// Group-normalises scalar rewards as Miles' rollout side does.
    ///
    /// Applies only to `grpo`, `gspo` and `reinforce_plus_plus_baseline` unless
    /// `--disable-rewards-normalization`; other estimators get the rewards back unchanged.
    /// Within a group, samples sharing a `rollout_id` count once (they must carry the same
    /// reward); `r ← r − mean`, and for `grpo`/`gspo` with std normalisation, more than one
    /// rollout in the group and `std > 0`: `r ← r / (std + 1e-6)` with the unbiased std.
    /// A group whose rewards are all equal gets exactly 0.
    pub fn normalize_rewards(
        &self,
        rewards: &[f32],
        grouping: Grouping<'_>,
        rollout_ids: Option<&[u64]>,
    ) -> Result<Vec<f32>> {
        let n = rewards.len();
        if let Some(ids) = rollout_ids
            && ids.len() != n
        {
            return Err(OpsError::LengthMismatch {
                what: "rollout_ids",
                expected: n,
                got: ids.len(),
            });
        }
        let cfg = &self.config;
        if cfg.disable_rewards_normalization || !cfg.advantage_estimator.normalizes_rewards() {
            return Ok(rewards.to_vec());
        }
        let groups: Vec<Vec<usize>> = match grouping {
            Grouping::GroupIndex(index) => {
                if index.len() != n {
                    return Err(OpsError::LengthMismatch {
                        what: "group_index",
                        expected: n,
                        got: index.len(),
                    });
                }
                let mut order: Vec<u64> = Vec::new();
                let mut members: std::collections::HashMap<u64, Vec<usize>> =
                    std::collections::HashMap::new();
                for (i, &g) in index.iter().enumerate() {
                    members
                        .entry(g)
                        .or_insert_with(|| {
                            order.push(g);
                            Vec::new()
                        })
                        .push(i);
                }
                order
                    .into_iter()
                    .map(|g| members.remove(&g).unwrap_or_default())
                    .collect()
            }
            Grouping::FanOut => {
                let k = cfg.n_samples_per_prompt;
                if !n.is_multiple_of(k) {
                    return Err(OpsError::UnevenGroups {
                        samples: n,
                        group_size: k,
                    });
                }
                (0..n / k).map(|g| (g * k..(g + 1) * k).collect()).collect()
            }
            Grouping::Whole => vec![(0..n).collect()],
        };
        let std_norm = matches!(
            cfg.advantage_estimator,
            AdvantageEstimator::Grpo | AdvantageEstimator::Gspo
        ) && !cfg.disable_grpo_std_normalization
            && !(matches!(grouping, Grouping::FanOut) && cfg.n_samples_per_prompt == 1);

        let mut out = vec![0f32; n];
        for members in groups {
            // One value per rollout: samples sharing a rollout id are siblings.
            let mut rollout_of = Vec::with_capacity(members.len());
            let mut values: Vec<f64> = Vec::new();
            let mut seen: Vec<(u64, usize)> = Vec::new();
            for &i in &members {
                let slot = match rollout_ids.map(|ids| ids[i]) {
                    Some(id) => match seen.iter().find(|(sid, _)| *sid == id) {
                        Some(&(_, slot)) => {
                            let first = values[slot] as f32;
                            if first.to_bits() != rewards[i].to_bits() {
                                return Err(OpsError::InconsistentRolloutReward {
                                    rollout_id: id,
                                    first,
                                    other: rewards[i],
                                });
                            }
                            slot
                        }
                        None => {
                            values.push(f64::from(rewards[i]));
                            seen.push((id, values.len() - 1));
                            values.len() - 1
                        }
                    },
                    None => {
                        values.push(f64::from(rewards[i]));
                        values.len() - 1
                    }
                };
                rollout_of.push(slot);
            }
            let m = values.len() as f64;
            let mean = values.iter().sum::<f64>() / m;
            let mut centred: Vec<f64> = values.iter().map(|v| v - mean).collect();
            if std_norm && values.len() > 1 {
                let var = centred.iter().map(|c| c * c).sum::<f64>() / (m - 1.0);
                let std = var.sqrt();
                if std > 0.0 {
                    for c in &mut centred {
                        *c /= std + GROUP_STD_EPS;
                    }
                }
            }
            for (&i, &slot) in members.iter().zip(&rollout_of) {
                out[i] = centred[slot] as f32;
            }
        }
        Ok(out)
    }

    /// Runs the configured estimator on every sample, then `--normalize-advantages`.
    pub fn compute(&self, samples: &[AdvantageSample<'_>]) -> Result<Vec<AdvantageOutput>> {
        let cfg = &self.config;
        let mut outputs = Vec::with_capacity(samples.len());
        for (index, s) in samples.iter().enumerate() {
            let len = s.loss_mask.len();
            let kl = self.shaping_kl_of(s, len)?;
            let r = f64::from(s.reward);
            let out = match cfg.advantage_estimator {
                AdvantageEstimator::Grpo | AdvantageEstimator::Gspo => {
                    let a = vec![s.reward; len];
                    AdvantageOutput {
                        returns: a.clone(),
                        advantages: a,
                    }
                }
                AdvantageEstimator::ReinforcePlusPlusBaseline => {
                    let a: Vec<f32> = kl.iter().map(|k| (r - cfg.kl_coef * k) as f32).collect();
                    AdvantageOutput {
                        returns: a.clone(),
                        advantages: a,
                    }
                }
                AdvantageEstimator::ReinforcePlusPlus => {
                    let last = s
                        .loss_mask
                        .iter()
                        .rposition(|&m| m > 0.0)
                        .ok_or(OpsError::FullyMasked { index })?;
                    let mut token_rewards: Vec<f64> = kl.iter().map(|k| -cfg.kl_coef * k).collect();
                    token_rewards[last] += r;
                    let mut returns = vec![0f32; len];
                    let mut running = 0f64;
                    for t in (0..len).rev() {
                        running = token_rewards[t] + cfg.gamma * running;
                        returns[t] = running as f32;
                    }
                    AdvantageOutput {
                        advantages: returns.clone(),
                        returns,
                    }
                }
                AdvantageEstimator::Ppo => {
                    let values = s.values.ok_or(OpsError::MissingInput {
                        what: "values",
                        required_by: "advantage_estimator=ppo",
                    })?;
                    if values.len() != len {
                        return Err(OpsError::LengthMismatch {
                            what: "values",
                            expected: len,
                            got: values.len(),
                        });
                    }
                    self.gae(r, s.loss_mask, &kl, values)
                }
            };
            outputs.push(out);
        }
        if cfg.normalize_advantages {
            let masks: Vec<&[f32]> = samples.iter().map(|s| s.loss_mask).collect();
            whiten_advantages(&mut outputs, &masks)?;
        }
        Ok(outputs)
    }

    fn shaping_kl_of(&self, s: &AdvantageSample<'_>, len: usize) -> Result<Vec<f64>> {
        match s.kl {
            Some(kl) if kl.len() != len => Err(OpsError::LengthMismatch {
                what: "kl",
                expected: len,
                got: kl.len(),
            }),
            Some(kl) => Ok(kl.iter().map(|&k| f64::from(k)).collect()),
            None if self.config.kl_coef != 0.0
                && self.config.advantage_estimator != AdvantageEstimator::Grpo
                && self.config.advantage_estimator != AdvantageEstimator::Gspo =>
            {
                Err(OpsError::MissingInput {
                    what: "kl",
                    required_by: "kl_coef != 0",
                })
            }
            None => Ok(vec![0.0; len]),
        }
    }

    /// GAE on trainable positions only (masked tokens are not transitions).
    fn gae(&self, reward: f64, mask: &[f32], kl: &[f64], values: &[f32]) -> AdvantageOutput {
        let cfg = &self.config;
        let len = mask.len();
        let positions: Vec<usize> = (0..len).filter(|&t| mask[t] > 0.0).collect();
        let mut advantages = vec![0f32; len];
        let mut returns = vec![0f32; len];
        let Some(&last) = positions.last() else {
            return AdvantageOutput {
                advantages,
                returns,
            };
        };
        let mut next_value = 0f64;
        let mut next_adv = 0f64;
        for &t in positions.iter().rev() {
            let mut r = -cfg.kl_coef * kl[t];
            if t == last {
                r += reward;
            }
            let v = f64::from(values[t]);
            let delta = r + cfg.gamma * next_value - v;
            let a = delta + cfg.gamma * cfg.lambd * next_adv;
            advantages[t] = a as f32;
            returns[t] = (a + v) as f32;
            next_value = v;
            next_adv = a;
        }
        AdvantageOutput {
            advantages,
            returns,
        }
    }
}

/// `--normalize-advantages`: masked whitening of all advantages of a batch with one shared
/// mean and (Bessel-corrected) variance: `(a − mean) · rsqrt(var + 1e-8)`.
///
/// Returns [`OpsError::EmptyMask`] if the masks sum to zero.
pub fn whiten_advantages(outputs: &mut [AdvantageOutput], masks: &[&[f32]]) -> Result<()> {
    if outputs.len() != masks.len() {
        return Err(OpsError::LengthMismatch {
            what: "loss masks",
            expected: outputs.len(),
            got: masks.len(),
        });
    }
    let (mut sum, mut sum_sq, mut count) = (0f64, 0f64, 0f64);
    for (out, mask) in outputs.iter().zip(masks) {
        if out.advantages.len() != mask.len() {
            return Err(OpsError::LengthMismatch {
                what: "loss_mask",
                expected: out.advantages.len(),
                got: mask.len(),
            });
        }
        for (&a, &m) in out.advantages.iter().zip(mask.iter()) {
            let (a, m) = (f64::from(a), f64::from(m));
            sum += a * m;
            sum_sq += a * a * m;
            count += m;
        }
    }
    if count == 0.0 {
        return Err(OpsError::EmptyMask);
    }
    let mean = sum / count;
    let mut var = sum_sq / count - mean * mean;
    if count >= 2.0 {
        var *= count / (count - 1.0);
    }
    let scale = 1.0 / (var + WHITEN_EPS).sqrt();
    for out in outputs.iter_mut() {
        for a in &mut out.advantages {
            *a = ((f64::from(*a) - mean) * scale) as f32;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f64], tol: f64) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((f64::from(*x) - y).abs() <= tol, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn grpo_std_normalised_matches_hand_computation() {
        let calc = AdvantageConfig::default()
            .with_n_samples_per_prompt(4)
            .init()
            .unwrap();
        // mean 0.5, unbiased std sqrt(1/3): 0.5 / (0.57735 + 1e-6) = 0.8660239.
        let r = calc
            .normalize_rewards(&[1.0, 0.0, 0.0, 1.0], Grouping::FanOut, None)
            .unwrap();
        close(
            &r,
            &[0.866_023_9, -0.866_023_9, -0.866_023_9, 0.866_023_9],
            1e-6,
        );
    }

    #[test]
    fn dr_grpo_only_subtracts_the_mean() {
        let calc = AdvantageConfig::default()
            .with_n_samples_per_prompt(4)
            .with_disable_grpo_std_normalization(true)
            .init()
            .unwrap();
        let r = calc
            .normalize_rewards(&[1.0, 0.0, 0.0, 1.0], Grouping::FanOut, None)
            .unwrap();
        close(&r, &[0.5, -0.5, -0.5, 0.5], 0.0);
    }

    #[test]
    fn equal_rewards_give_exact_zero() {
        let calc = AdvantageConfig::default()
            .with_n_samples_per_prompt(3)
            .init()
            .unwrap();
        let r = calc
            .normalize_rewards(&[0.1, 0.1, 0.1, 0.7, 0.7, 0.7], Grouping::FanOut, None)
            .unwrap();
        assert!(r.iter().all(|x| *x == 0.0), "{r:?}");
    }

    #[test]
    fn groups_by_index_and_rollout() {
        let calc = AdvantageConfig::default()
            .with_n_samples_per_prompt(3)
            .init()
            .unwrap();
        // Group 7 = samples 0, 2, 4 (rewards 3, 1, 2): std 1 → ±(1/(1+1e-6)), 0.
        // Group 9 = samples 1, 3: rollout 5 twice (one value) and rollout 6.
        let r = calc
            .normalize_rewards(
                &[3.0, 4.0, 1.0, 4.0, 2.0, 0.0],
                Grouping::GroupIndex(&[7, 9, 7, 9, 7, 9]),
                Some(&[1, 5, 2, 5, 3, 6]),
            )
            .unwrap();
        // Group 9 has two rollouts {4, 0}: mean 2, unbiased std sqrt(8) = 2.828427.
        let g9 = 2.0 / (8f64.sqrt() + 1e-6);
        close(&r, &[0.999_999, g9, -0.999_999, g9, 0.0, -g9], 1e-6);
    }

    /// Miles' `_normalize_rewards_by_rollout` run on per-turn siblings by
    /// `fixtures/train/gen_rollout_cases.py` (two prompt groups with rows interleaved,
    /// rollouts of 1-3 samples, the `rollout_id → index` fallback, a single-rollout group).
    #[test]
    fn per_rollout_normalisation_matches_miles() {
        let cases: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../fixtures/train/rollout_cases.json"
            ))
            .expect("fixtures/train/rollout_cases.json"),
        )
        .unwrap();
        let cases = cases["normalize"].as_array().unwrap();
        assert_eq!(cases.len(), 7);
        let mut errors = 0;
        for case in cases {
            let estimator: AdvantageEstimator =
                serde_json::from_value(case["estimator"].clone()).unwrap();
            let std = case["grpo_std_normalization"].as_bool().unwrap();
            let calc = AdvantageConfig::default()
                .with_advantage_estimator(estimator)
                .with_disable_grpo_std_normalization(!std)
                .with_n_samples_per_prompt(2)
                .init()
                .unwrap();
            let rows = case["rows"].as_array().unwrap();
            let rewards: Vec<f32> = rows
                .iter()
                .map(|r| r["reward"].as_f64().unwrap() as f32)
                .collect();
            let groups: Vec<u64> = rows
                .iter()
                .map(|r| r["group_index"].as_u64().unwrap())
                .collect();
            // `rollout_id`, else `index` (Sample::rollout_id).
            let ids: Vec<u64> = rows
                .iter()
                .map(|r| r["rollout_id"].as_u64().or(r["index"].as_u64()).unwrap())
                .collect();
            let got = calc.normalize_rewards(&rewards, Grouping::GroupIndex(&groups), Some(&ids));
            if case.get("error").is_some() {
                assert!(
                    matches!(
                        got,
                        Err(OpsError::InconsistentRolloutReward { rollout_id: 10, .. })
                    ),
                    "{got:?}"
                );
                errors += 1;
                continue;
            }
            let expected: Vec<f64> = case["expected"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            close(&got.unwrap(), &expected, 1e-6);
        }
        assert_eq!(errors, 1);
    }

    #[test]
    fn rollout_siblings_must_agree() {
        let calc = AdvantageConfig::default().init().unwrap();
        let err = calc
            .normalize_rewards(&[1.0, 0.0], Grouping::Whole, Some(&[4, 4]))
            .unwrap_err();
        assert!(matches!(
            err,
            OpsError::InconsistentRolloutReward { rollout_id: 4, .. }
        ));
    }

    #[test]
    fn uneven_fan_out_is_an_error() {
        let calc = AdvantageConfig::default()
            .with_n_samples_per_prompt(4)
            .init()
            .unwrap();
        assert!(matches!(
            calc.normalize_rewards(&[1.0; 6], Grouping::FanOut, None),
            Err(OpsError::UnevenGroups {
                samples: 6,
                group_size: 4
            })
        ));
    }

    #[test]
    fn reinforce_plus_plus_baseline_centres_without_std() {
        let calc = AdvantageConfig::default()
            .with_advantage_estimator(AdvantageEstimator::ReinforcePlusPlusBaseline)
            .with_n_samples_per_prompt(3)
            .with_kl_coef(0.5)
            .init()
            .unwrap();
        let r = calc
            .normalize_rewards(&[3.0, 1.0, 2.0], Grouping::FanOut, None)
            .unwrap();
        close(&r, &[1.0, -1.0, 0.0], 0.0);
        let mask = [1.0, 1.0];
        let kl = [0.2, -0.4];
        let out = calc
            .compute(&[AdvantageSample::new(r[0], &mask).with_kl(&kl)])
            .unwrap();
        close(&out[0].advantages, &[0.9, 1.2], 1e-6);
        assert_eq!(out[0].advantages, out[0].returns);
    }

    #[test]
    fn reinforce_plus_plus_discounted_returns() {
        let calc = AdvantageConfig::default()
            .with_advantage_estimator(AdvantageEstimator::ReinforcePlusPlus)
            .with_gamma(0.5)
            .with_kl_coef(0.1)
            .init()
            .unwrap();
        // Rewards untouched by normalisation for reinforce_plus_plus.
        assert_eq!(
            calc.normalize_rewards(&[1.0, 5.0], Grouping::Whole, None)
                .unwrap(),
            vec![1.0, 5.0]
        );
        // token rewards: [-0.02, -0.04 + 1 (last trainable), -0.1]; G_t = r_t + 0.5 G_{t+1}.
        let mask = [1.0, 1.0, 0.0];
        let kl = [0.2, 0.4, 1.0];
        let out = calc
            .compute(&[AdvantageSample::new(1.0, &mask).with_kl(&kl)])
            .unwrap();
        close(&out[0].advantages, &[0.435, 0.91, -0.1], 1e-6);
        let none = [0.0, 0.0];
        assert!(matches!(
            calc.compute(&[AdvantageSample::new(1.0, &none).with_kl(&none)]),
            Err(OpsError::FullyMasked { index: 0 })
        ));
    }

    #[test]
    fn ppo_gae_skips_masked_tokens() {
        let calc = AdvantageConfig::default()
            .with_advantage_estimator(AdvantageEstimator::Ppo)
            .with_gamma(0.9)
            .with_lambd(0.8)
            .init()
            .unwrap();
        // Trainable positions 0, 2, 3; position 1 (an env token) is not a transition.
        // t=3: δ = 2 − 1 = 1, A = 1; t=2: δ = 0.9·1 − 0.25 = 0.65, A = 0.65 + 0.72·1 = 1.37;
        // t=0: δ = 0.9·0.25 − 0.5 = −0.275, A = −0.275 + 0.72·1.37 = 0.7114.
        let mask = [1.0, 0.0, 1.0, 1.0];
        let values = [0.5, 9.0, 0.25, 1.0];
        let out = calc
            .compute(&[AdvantageSample::new(2.0, &mask).with_values(&values)])
            .unwrap();
        close(&out[0].advantages, &[0.7114, 0.0, 1.37, 1.0], 1e-6);
        close(&out[0].returns, &[1.2114, 0.0, 1.62, 2.0], 1e-6);
        // Fully masked: zeros, not an error.
        let none = [0.0, 0.0];
        let out = calc
            .compute(&[AdvantageSample::new(2.0, &none).with_values(&[1.0, 1.0])])
            .unwrap();
        assert_eq!(out[0].advantages, vec![0.0, 0.0]);
        // Values are required.
        assert!(matches!(
            calc.compute(&[AdvantageSample::new(2.0, &mask)]),
            Err(OpsError::MissingInput { what: "values", .. })
        ));
    }

    #[test]
    fn whitening_uses_masked_bessel_corrected_stats() {
        let calc = AdvantageConfig::default()
            .with_disable_rewards_normalization(true)
            .with_normalize_advantages(true)
            .init()
            .unwrap();
        let m1 = [1.0, 1.0];
        let m2 = [1.0, 0.0];
        // Advantages 1,1 | 4,4 with the last masked: mean 2, var (1+1+4)/3 · ... hand:
        // values {1,1,4}: mean 2, E[x²] = 6, var = 6 − 4 = 2, Bessel 3/2 → 3.
        let out = calc
            .compute(&[
                AdvantageSample::new(1.0, &m1),
                AdvantageSample::new(4.0, &m2),
            ])
            .unwrap();
        let s = 1.0 / (3.0f64 + 1e-8).sqrt();
        close(&out[0].advantages, &[-s, -s], 1e-6);
        close(&out[1].advantages, &[2.0 * s, 2.0 * s], 1e-6);
        let zero = [0.0];
        assert_eq!(
            calc.compute(&[AdvantageSample::new(1.0, &zero)]),
            Err(OpsError::EmptyMask)
        );
    }

    #[test]
    fn estimator_names_are_miles_cli_values() {
        for (e, name) in [
            (AdvantageEstimator::Grpo, "grpo"),
            (AdvantageEstimator::Gspo, "gspo"),
            (AdvantageEstimator::ReinforcePlusPlus, "reinforce_plus_plus"),
            (
                AdvantageEstimator::ReinforcePlusPlusBaseline,
                "reinforce_plus_plus_baseline",
            ),
            (AdvantageEstimator::Ppo, "ppo"),
        ] {
            assert_eq!(serde_json::to_string(&e).unwrap(), format!("\"{name}\""));
            assert_eq!(name.parse::<AdvantageEstimator>().unwrap(), e);
        }
        let cfg: AdvantageConfig =
            serde_json::from_str(r#"{"advantage_estimator":"ppo","lambd":0.95}"#).unwrap();
        assert_eq!(cfg.advantage_estimator, AdvantageEstimator::Ppo);
        assert_eq!(cfg.gamma, 1.0);
        assert!(AdvantageConfig::default().with_gamma(1.5).init().is_err());
    }
}
