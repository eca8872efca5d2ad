//! The policy loss (Miles' `policy_loss_function`): PPO clip with asymmetric
//! `eps_clip_high`, dual clip `eps_clip_c`, GSPO sequence ratio, OPSM, TIS / ICEPOP / MIS
//! corrections, KL loss against a reference policy and the entropy bonus, aggregated with
//! loss masks, plus Miles' metrics.
//!
//! Everything is plain burn tensor ops on `[batch, tokens]` tensors, so it runs on any
//! device and under autodiff.

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::advantages::AdvantageEstimator;
use crate::corrections::TisFunction;
use crate::kl::{KlLossType, LOG_RATIO_CLAMP, clean_non_finite, compute_approx_kl};
use crate::reduce::{LossAggregation, LossMetrics, Reducer};
use crate::{OpsError, Result};

/// Policy-loss settings, one field per Miles flag, with Miles' defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyLossConfig {
    /// `--advantage-estimator`: `gspo` switches to the sequence-level ratio.
    pub advantage_estimator: AdvantageEstimator,
    /// `--eps-clip` (0.2): lower clip `1 − eps_clip`.
    pub eps_clip: f32,
    /// `--eps-clip-high` (`None` → `eps_clip`): upper clip `1 + eps_clip_high` (DAPO).
    pub eps_clip_high: Option<f32>,
    /// `--eps-clip-c` (`None`): dual-clip bound, must be > 1.
    pub eps_clip_c: Option<f32>,
    /// `--use-opsm` (false): off-policy sequence masking.
    pub use_opsm: bool,
    /// `--opsm-delta` (1e-4).
    pub opsm_delta: f32,
    /// `--use-tis` (false).
    pub use_tis: bool,
    /// `--tis-clip` (2.0).
    pub tis_clip: f32,
    /// `--tis-clip-low` (0.0).
    pub tis_clip_low: f32,
    /// The correction (`--custom-tis-function-path`; default `vanilla_tis`).
    pub tis_function: TisFunction,
    /// `--get-mismatch-metrics` (false).
    pub get_mismatch_metrics: bool,
    /// `--use-rollout-logprobs` (false): the PPO ratio uses the rollout log-probs as old.
    pub use_rollout_logprobs: bool,
    /// `--use-kl-loss` (false).
    pub use_kl_loss: bool,
    /// `--kl-loss-coef` (0.0).
    pub kl_loss_coef: f32,
    /// `--kl-loss-type` (`k1`).
    pub kl_loss_type: KlLossType,
    /// `--use-unbiased-kl` (false): KL × `exp(logp − old_logp)`.
    pub use_unbiased_kl: bool,
    /// `--entropy-coef` (0.0).
    pub entropy_coef: f32,
    /// `--calculate-per-token-loss` (false).
    pub calculate_per_token_loss: bool,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            advantage_estimator: AdvantageEstimator::Grpo,
            eps_clip: 0.2,
            eps_clip_high: None,
            eps_clip_c: None,
            use_opsm: false,
            opsm_delta: 1e-4,
            use_tis: false,
            tis_clip: 2.0,
            tis_clip_low: 0.0,
            tis_function: TisFunction::VanillaTis,
            get_mismatch_metrics: false,
            use_rollout_logprobs: false,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            kl_loss_type: KlLossType::K1,
            use_unbiased_kl: false,
            entropy_coef: 0.0,
            calculate_per_token_loss: false,
        }
    }
}

impl PolicyLossConfig {
    /// Validates the configuration once and returns the loss.
    pub fn init(self) -> Result<PolicyLoss> {
        let bad =
            |flag: &'static str, reason: String| Err(OpsError::InvalidConfig { flag, reason });
        if !(self.eps_clip.is_finite() && self.eps_clip >= 0.0 && self.eps_clip < 1.0) {
            return bad("eps-clip", format!("{} is not in [0, 1)", self.eps_clip));
        }
        if let Some(h) = self.eps_clip_high
            && !(h.is_finite() && h >= 0.0)
        {
            return bad("eps-clip-high", format!("{h} must be finite and >= 0"));
        }
        if let Some(c) = self.eps_clip_c
            && !(c.is_finite() && c > 1.0)
        {
            return bad(
                "eps-clip-c",
                format!("the dual-clip bound must be greater than 1.0, got {c}"),
            );
        }
        if !(self.opsm_delta.is_finite()) {
            return bad("opsm-delta", format!("{} is not finite", self.opsm_delta));
        }
        if !(self.tis_clip_low >= 0.0
            && self.tis_clip.is_finite()
            && self.tis_clip > self.tis_clip_low)
        {
            return bad(
                "tis-clip",
                format!(
                    "need 0 <= tis_clip_low ({}) < tis_clip ({})",
                    self.tis_clip_low, self.tis_clip
                ),
            );
        }
        self.tis_function.validate()?;
        if !self.kl_loss_coef.is_finite() {
            return bad(
                "kl-loss-coef",
                format!("{} is not finite", self.kl_loss_coef),
            );
        }
        if !self.entropy_coef.is_finite() {
            return bad(
                "entropy-coef",
                format!("{} is not finite", self.entropy_coef),
            );
        }
        Ok(PolicyLoss { config: self })
    }
}

/// One batch for [`PolicyLoss::forward`]; every tensor is `[batch, tokens]` (padded) unless
/// noted.
#[derive(Debug, Clone)]
pub struct PolicyLossInput {
    /// Current policy log-probs of the taken tokens (differentiable).
    pub log_probs: Tensor<2>,
    /// Trainer-scored log-probs of the policy that generated the data (Miles' `log_probs`).
    pub old_log_probs: Tensor<2>,
    /// Advantages per token.
    pub advantages: Tensor<2>,
    /// Loss mask (`> 0` = trainable, 0 = prompt/tool/padding).
    pub loss_mask: Tensor<2>,
    /// Inference-engine log-probs (TIS, mismatch metrics, `--use-rollout-logprobs`).
    pub rollout_log_probs: Option<Tensor<2>>,
    /// Reference-policy log-probs (`--use-kl-loss`).
    pub ref_log_probs: Option<Tensor<2>>,
    /// Per-token entropy of the current policy (entropy bonus / observation).
    pub entropy: Option<Tensor<2>>,
    /// `[batch]`: Miles' `rollout_mask_sums`, the per-sample denominators.
    pub rollout_mask_sums: Option<Tensor<1>>,
    /// Divisor of the reduced loss and metrics: number of rollouts in the global step
    /// (per-sample mode) or number of tokens (per-token mode). `None`: this batch's sample
    /// count, resp. its mask sum.
    pub normalizer: Option<f32>,
}

impl PolicyLossInput {
    /// An input with the four required tensors.
    pub fn new(
        log_probs: Tensor<2>,
        old_log_probs: Tensor<2>,
        advantages: Tensor<2>,
        loss_mask: Tensor<2>,
    ) -> Self {
        Self {
            log_probs,
            old_log_probs,
            advantages,
            loss_mask,
            rollout_log_probs: None,
            ref_log_probs: None,
            entropy: None,
            rollout_mask_sums: None,
            normalizer: None,
        }
    }
    /// Adds rollout (inference) log-probs.
    pub fn with_rollout_log_probs(mut self, t: Tensor<2>) -> Self {
        self.rollout_log_probs = Some(t);
        self
    }
    /// Adds reference log-probs.
    pub fn with_ref_log_probs(mut self, t: Tensor<2>) -> Self {
        self.ref_log_probs = Some(t);
        self
    }
    /// Adds per-token entropy.
    pub fn with_entropy(mut self, t: Tensor<2>) -> Self {
        self.entropy = Some(t);
        self
    }
    /// Sets per-sample denominators (`rollout_mask_sums`).
    pub fn with_rollout_mask_sums(mut self, t: Tensor<1>) -> Self {
        self.rollout_mask_sums = Some(t);
        self
    }
    /// Sets the normaliser (global batch size or token count).
    pub fn with_normalizer(mut self, n: f32) -> Self {
        self.normalizer = Some(n);
        self
    }
}

/// The loss and its metrics.
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    /// `[1]` total loss `pg − entropy_coef·entropy + kl_loss_coef·kl`, divided by the
    /// normaliser; differentiable.
    pub loss: Tensor<1>,
    /// Metrics under Miles' names (`loss`, `pg_loss`, `entropy_loss`, `pg_clipfrac`,
    /// `ppo_kl`, `ess_ratio`, `kl_loss`, `ois`, `tis`, `tis_clipfrac`, `tis_abs`,
    /// `opsm_clipfrac`, `train_rollout_logprob_abs_diff`, `train_rollout_kl`, MIS metrics).
    pub metrics: LossMetrics,
}

/// A validated [`PolicyLossConfig`].
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLoss {
    config: PolicyLossConfig,
}

fn check_shape(what: &'static str, t: &Tensor<2>, dims: [usize; 2]) -> Result<()> {
    if t.dims() != dims {
        return Err(OpsError::ShapeMismatch {
            what,
            expected: dims.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

/// Per-sample masked mean broadcast over the tokens (`[b, t]` → `[b, t]`).
fn sequence_mean(x: Tensor<2>, mask: Tensor<2>) -> Tensor<2> {
    let [_, t] = x.dims();
    let den = mask.clone().sum_dim(1).clamp_min(1.0);
    ((x * mask).sum_dim(1) / den).repeat_dim(1, t)
}

/// PPO clipped surrogate on per-token `ppo_kl = old − new` (Miles' `compute_policy_loss`).
///
/// Returns `(pg_losses, clipfrac)`: `ratio = exp(−ppo_kl)`, `L1 = −ratio·A`,
/// `L2 = −clamp(ratio, 1−eps_clip, 1+eps_clip_high)·A`, `L = max(L1, L2)`,
/// `clipfrac = [L2 > L1]`; with `eps_clip_c`, `L = min(L, −eps_clip_c·A)` where `A < 0`.
/// Runs the fused op ([`crate::clipped_pg_loss`]: one pass each way, a CubeCL
/// kernel on GPU backends) where it is registered, its plain-op twin elsewhere.
pub fn compute_policy_loss<const D: usize>(
    ppo_kl: Tensor<D>,
    advantages: Tensor<D>,
    eps_clip: f32,
    eps_clip_high: f32,
    eps_clip_c: Option<f32>,
) -> (Tensor<D>, Tensor<D>) {
    crate::clipped::clipped_pg_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c)
}

impl PolicyLoss {
    /// The validated configuration.
    pub fn config(&self) -> &PolicyLossConfig {
        &self.config
    }

    /// Whether a correction (TIS / ICEPOP / MIS) runs.
    fn corrects(&self) -> bool {
        self.config.use_tis || self.config.get_mismatch_metrics
    }

    /// Computes the loss and metrics for one batch.
    pub fn forward(&self, input: PolicyLossInput) -> Result<PolicyLossOutput> {
        let cfg = &self.config;
        let dims = input.log_probs.dims();
        check_shape("old_log_probs", &input.old_log_probs, dims)?;
        check_shape("advantages", &input.advantages, dims)?;
        check_shape("loss_mask", &input.loss_mask, dims)?;
        for (what, t) in [
            ("rollout_log_probs", &input.rollout_log_probs),
            ("ref_log_probs", &input.ref_log_probs),
            ("entropy", &input.entropy),
        ] {
            if let Some(t) = t {
                check_shape(what, t, dims)?;
            }
        }
        if let Some(s) = &input.rollout_mask_sums
            && s.dims() != [dims[0]]
        {
            return Err(OpsError::ShapeMismatch {
                what: "rollout_mask_sums",
                expected: vec![dims[0]],
                got: s.dims().to_vec(),
            });
        }
        let need_rollout = self.corrects() || cfg.use_rollout_logprobs;
        if need_rollout && input.rollout_log_probs.is_none() {
            return Err(OpsError::MissingInput {
                what: "rollout_log_probs",
                required_by: "--use-tis / --get-mismatch-metrics / --use-rollout-logprobs",
            });
        }
        if cfg.use_kl_loss && input.ref_log_probs.is_none() {
            return Err(OpsError::MissingInput {
                what: "ref_log_probs",
                required_by: "--use-kl-loss",
            });
        }
        if cfg.entropy_coef != 0.0 && input.entropy.is_none() {
            return Err(OpsError::MissingInput {
                what: "entropy",
                required_by: "--entropy-coef != 0",
            });
        }

        let aggregation = if cfg.calculate_per_token_loss {
            LossAggregation::PerToken
        } else {
            LossAggregation::SampleMean
        };
        let mask = input.loss_mask.clone();
        let inactive = mask.clone().lower_equal_elem(0.0);
        let log_probs = input.log_probs;
        let train_old = input.old_log_probs.detach();
        let old = if cfg.use_rollout_logprobs {
            input
                .rollout_log_probs
                .clone()
                .map(Tensor::detach)
                .unwrap_or_else(|| train_old.clone())
        } else {
            train_old.clone()
        };

        // ppo_kl: token-level, or the GSPO per-sequence mean broadcast to every token.
        let clean_old = old.clone().mask_fill(inactive.clone(), 0.0);
        let clean_new = log_probs.clone().mask_fill(inactive.clone(), 0.0);
        let token_kl = clean_old.clone() - clean_new.clone();
        let ppo_kl = if cfg.advantage_estimator == AdvantageEstimator::Gspo {
            sequence_mean(token_kl.clone(), mask.clone())
        } else {
            token_kl.clone()
        };
        let zero_nonfinite = |x: Tensor<2>| {
            let bad = x.clone().is_nan().bool_or(x.clone().is_inf());
            x.mask_fill(bad, 0.0).mask_fill(inactive.clone(), 0.0)
        };
        let ppo_kl = zero_nonfinite(ppo_kl);
        let advantages = zero_nonfinite(input.advantages.detach());
        // log_ratio = clamp(−ppo_kl, ±20); ratio = exp(log_ratio).
        let clamped_kl = clean_non_finite(ppo_kl.clone(), LOG_RATIO_CLAMP)
            .clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
        let eps_high = cfg.eps_clip_high.unwrap_or(cfg.eps_clip);
        let (mut pg_loss, pg_clipfrac) = compute_policy_loss(
            clamped_kl,
            advantages.clone(),
            cfg.eps_clip,
            eps_high,
            cfg.eps_clip_c,
        );

        let mut metrics = LossMetrics::default();
        let base_reducer = Reducer::new(mask.clone(), input.rollout_mask_sums.clone(), aggregation);

        // OPSM: drop negative-advantage tokens of sequences that drifted too far.
        let mut opsm_clipfrac = None;
        if cfg.use_opsm {
            let seq_kl = sequence_mean(token_kl.detach(), mask.clone());
            let drop = advantages
                .clone()
                .lower_elem(0.0)
                .bool_and(seq_kl.greater_elem(cfg.opsm_delta))
                .float()
                * mask.clone();
            let masked = drop.clone().sum_dim(1);
            let total = mask.clone().sum_dim(1).clamp_min(1.0);
            opsm_clipfrac = Some((masked / total).sum());
            pg_loss = pg_loss * (drop.neg() + 1.0);
        }

        // TIS / ICEPOP / MIS.
        let mut reducer = base_reducer.clone();
        let mut mismatch_metrics = Vec::new();
        if self.corrects() {
            let rollout = input.rollout_log_probs.clone().map(Tensor::detach).ok_or(
                OpsError::MissingInput {
                    what: "rollout_log_probs",
                    required_by: "--use-tis",
                },
            )?;
            mismatch_metrics.push(("ois", ppo_kl.clone().detach().neg().exp()));
            let correction = cfg.tis_function.compute(
                train_old.clone(),
                rollout,
                mask.clone(),
                cfg.tis_clip_low,
                cfg.tis_clip,
                cfg.use_tis,
            );
            if let Some(w) = correction.weights {
                pg_loss = pg_loss * w;
            }
            mismatch_metrics.extend(correction.metrics);
            reducer = Reducer::new(
                correction.modified_mask,
                input.rollout_mask_sums.clone(),
                aggregation,
            );
        }

        // ESS ratio per sample: (Σw)² / (n · max(Σw², 1e-8)), w = exp(−ppo_kl) on the mask.
        let w = ppo_kl.clone().detach().neg().exp() * mask.clone();
        let n = mask.clone().sum_dim(1);
        let ess = w.clone().sum_dim(1).powi_scalar(2)
            / (n.clone().clamp_min(1.0) * w.powi_scalar(2).sum_dim(1).clamp_min(1e-8));
        let has_tokens = n.greater_elem(0.0).float();
        let ess_ratio = (ess * has_tokens.clone()).sum();

        let pg = reducer.reduce(pg_loss);
        let clipfrac = reducer.reduce(pg_clipfrac);
        let ppo_kl_metric = reducer.reduce(ppo_kl.clone());
        let mut loss = pg.clone();

        let entropy_loss = match input.entropy {
            Some(entropy) => {
                let e = reducer.reduce(entropy);
                if cfg.entropy_coef != 0.0 {
                    loss = loss - e.clone().mul_scalar(cfg.entropy_coef);
                    e
                } else {
                    e.detach()
                }
            }
            None => pg.zeros_like().detach(),
        };

        let mut kl_loss = None;
        if cfg.use_kl_loss {
            let reference = input
                .ref_log_probs
                .clone()
                .ok_or(OpsError::MissingInput {
                    what: "ref_log_probs",
                    required_by: "--use-kl-loss",
                })?
                .detach()
                .mask_fill(inactive.clone(), 0.0);
            let ratio = cfg
                .use_unbiased_kl
                .then(|| (clean_new.clone() - clean_old.clone()).exp());
            let kl = compute_approx_kl(clean_new.clone(), reference, cfg.kl_loss_type, ratio);
            let kl = zero_nonfinite(kl);
            let k = reducer.reduce(kl);
            if cfg.kl_loss_coef != 0.0 {
                loss = loss + k.clone().mul_scalar(cfg.kl_loss_coef);
            }
            kl_loss = Some(k);
        }

        // Normaliser: global batch size (per-sample) or token count (per-token).
        let normalizer = match input.normalizer {
            Some(n) => Tensor::<1>::from_floats([n], &mask.device()),
            None => match aggregation {
                LossAggregation::SampleMean => {
                    Tensor::<1>::from_floats([dims[0] as f32], &mask.device())
                }
                LossAggregation::PerToken => base_reducer.mask().clone().sum().detach(),
            },
        }
        .clamp_min(1.0);
        let norm = |t: Tensor<1>| t / normalizer.clone();
        let loss = norm(loss);

        metrics.insert("loss", loss.clone());
        metrics.insert("pg_loss", norm(pg));
        metrics.insert("entropy_loss", norm(entropy_loss));
        metrics.insert("pg_clipfrac", norm(clipfrac));
        metrics.insert("ppo_kl", norm(ppo_kl_metric));
        metrics.insert("ess_ratio", norm(ess_ratio));
        if let Some(rollout) = &input.rollout_log_probs {
            let rollout = rollout.clone().detach().mask_fill(inactive.clone(), 0.0);
            let train = train_old.clone().mask_fill(inactive.clone(), 0.0);
            let abs_diff = zero_nonfinite((train.clone() - rollout.clone()).abs());
            metrics.insert(
                "train_rollout_logprob_abs_diff",
                norm(base_reducer.reduce(abs_diff)),
            );
            let kl = zero_nonfinite(compute_approx_kl(
                rollout,
                train,
                KlLossType::LowVarKl,
                None,
            ));
            metrics.insert("train_rollout_kl", norm(base_reducer.reduce(kl)));
        }
        if let Some(k) = kl_loss {
            metrics.insert("kl_loss", norm(k));
        }
        for (name, value) in mismatch_metrics {
            metrics.insert(name, norm(base_reducer.reduce(value)));
        }
        if let Some(f) = opsm_clipfrac {
            metrics.insert("opsm_clipfrac", norm(f));
        }
        Ok(PolicyLossOutput { loss, metrics })
    }
}

/// Value loss for a critic (`value_loss_function`): `clip(V, V_old ± value_clip)`,
/// `max((Vc − R)², (V − R)²)` reduced with `reducer`; also returns `value_clipfrac`.
pub fn value_loss(
    values: Tensor<2>,
    old_values: Tensor<2>,
    returns: Tensor<2>,
    value_clip: f32,
    reducer: &Reducer,
) -> (Tensor<1>, Tensor<1>) {
    let old_values = old_values.detach();
    let returns = returns.detach();
    let clipped = old_values.clone() + (values.clone() - old_values).clamp(-value_clip, value_clip);
    let l_clip = (clipped - returns.clone()).powi_scalar(2);
    let l_plain = (values - returns).powi_scalar(2);
    let clipfrac = l_clip.clone().greater(l_plain.clone()).float();
    let loss = l_clip.max_pair(l_plain);
    (reducer.reduce(loss), reducer.reduce(clipfrac))
}

/// SFT loss `−reduce(log_probs)`.
pub fn sft_loss(log_probs: Tensor<2>, reducer: &Reducer) -> Tensor<1> {
    reducer.reduce(log_probs).neg()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::corrections::TisFunction;
    use burn::tensor::Device;

    fn t2(rows: &[&[f32]], device: &Device) -> Tensor<2> {
        let b = rows.len();
        let t = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::<1>::from_floats(flat.as_slice(), device).reshape([b, t])
    }

    fn metric(out: &PolicyLossOutput, name: &str) -> f64 {
        f64::from(
            out.metrics
                .get(name)
                .unwrap_or_else(|| panic!("missing metric {name}"))
                .clone()
                .into_scalar::<f32>(),
        )
    }

    fn assert_close(a: f64, b: f64, tol: f64) {
        assert!((a - b).abs() <= tol, "{a} vs {b}");
    }

    /// Four tokens: ratios e^0.1, e^0.3, e^−0.5, e^1.5 with advantages 1, 1, −1, −1.
    fn clip_case(cfg: PolicyLossConfig) -> PolicyLossOutput {
        let d = Device::flex();
        let old = t2(&[&[-1.0, -1.0, -1.0, -1.0]], &d);
        let new = t2(&[&[-0.9, -0.7, -1.5, 0.5]], &d);
        let adv = t2(&[&[1.0, 1.0, -1.0, -1.0]], &d);
        let mask = t2(&[&[1.0, 1.0, 1.0, 1.0]], &d);
        cfg.init()
            .unwrap()
            .forward(PolicyLossInput::new(new, old, adv, mask))
            .unwrap()
    }

    #[test]
    fn ppo_clip_hand_computed() {
        let out = clip_case(PolicyLossConfig::default());
        // Token losses: −e^0.1 (inside), −1.2 (clipped high), 0.8 (clipped low), e^1.5.
        let expected = (-(0.1f64).exp() - 1.2 + 0.8 + 1.5f64.exp()) / 4.0;
        assert_close(metric(&out, "pg_loss"), expected, 1e-5);
        assert_close(metric(&out, "pg_clipfrac"), 0.5, 1e-7);
        assert_close(metric(&out, "loss"), expected, 1e-5);
        // ppo_kl = mean(old − new) = mean(−0.1, −0.3, 0.5, −1.5)
        assert_close(metric(&out, "ppo_kl"), -1.4 / 4.0, 1e-6);
    }

    #[test]
    fn asymmetric_and_dual_clip() {
        let out = clip_case(PolicyLossConfig {
            eps_clip_high: Some(0.4),
            ..Default::default()
        });
        let expected = (-(0.1f64).exp() - 0.3f64.exp() + 0.8 + 1.5f64.exp()) / 4.0;
        assert_close(metric(&out, "pg_loss"), expected, 1e-5);
        assert_close(metric(&out, "pg_clipfrac"), 0.25, 1e-7);

        let out = clip_case(PolicyLossConfig {
            eps_clip_c: Some(3.0),
            ..Default::default()
        });
        // A < 0 tokens: min(0.8, 3) = 0.8 and min(e^1.5, 3) = 3.
        let expected = (-(0.1f64).exp() - 1.2 + 0.8 + 3.0) / 4.0;
        assert_close(metric(&out, "pg_loss"), expected, 1e-5);

        assert!(
            PolicyLossConfig {
                eps_clip_c: Some(1.0),
                ..Default::default()
            }
            .init()
            .is_err()
        );
    }

    #[test]
    fn gspo_uses_the_sequence_ratio() {
        let d = Device::flex();
        let old = t2(&[&[-1.0, -1.0, 0.0]], &d);
        let new = t2(&[&[-0.9, -0.7, 55.0]], &d); // last token masked, garbage
        let adv = t2(&[&[1.0, 1.0, f32::NAN]], &d);
        let mask = t2(&[&[1.0, 1.0, 0.0]], &d);
        let out = PolicyLossConfig {
            advantage_estimator: AdvantageEstimator::Gspo,
            ..Default::default()
        }
        .init()
        .unwrap()
        .forward(PolicyLossInput::new(new, old, adv, mask))
        .unwrap();
        // Sequence log-ratio mean(0.1, 0.3) = 0.2 → ratio e^0.2 = 1.2214 > 1.2: both clipped.
        assert_close(metric(&out, "pg_loss"), -1.2, 1e-6);
        assert_close(metric(&out, "pg_clipfrac"), 1.0, 1e-7);
        assert_close(metric(&out, "ppo_kl"), -0.2, 1e-6);
    }

    fn tis_case(tis_function: TisFunction) -> PolicyLossOutput {
        let d = Device::flex();
        let lp = t2(&[&[-1.0, -1.0, -1.0]], &d);
        // train − rollout = ln 3, ln 0.5, 0.
        let rollout = t2(&[&[-1.0 - 3f32.ln(), -1.0 - 0.5f32.ln(), -1.0]], &d);
        let adv = t2(&[&[1.0, 1.0, 1.0]], &d);
        let mask = t2(&[&[1.0, 1.0, 1.0]], &d);
        PolicyLossConfig {
            use_tis: true,
            tis_clip: 2.0,
            tis_clip_low: 0.6,
            tis_function,
            ..Default::default()
        }
        .init()
        .unwrap()
        .forward(PolicyLossInput::new(lp.clone(), lp, adv, mask).with_rollout_log_probs(rollout))
        .unwrap()
    }

    #[test]
    fn vanilla_tis_truncates_weights() {
        let out = tis_case(TisFunction::VanillaTis);
        // weights clamp([3, 0.5, 1], 0.6, 2) = [2, 0.6, 1]; on-policy token loss = −A·w.
        assert_close(metric(&out, "pg_loss"), -(2.0 + 0.6 + 1.0) / 3.0, 1e-5);
        assert_close(metric(&out, "tis"), (3.0 + 0.5 + 1.0) / 3.0, 1e-5);
        assert_close(metric(&out, "tis_clipfrac"), 2.0 / 3.0, 1e-6);
        assert_close(metric(&out, "tis_abs"), (2.0 + 0.5) / 3.0, 1e-5);
        assert_close(metric(&out, "ois"), 1.0, 1e-6);
        // |train − rollout| = ln 3, ln 2, 0.
        assert_close(
            metric(&out, "train_rollout_logprob_abs_diff"),
            (3f64.ln() + 2f64.ln()) / 3.0,
            1e-5,
        );
    }

    #[test]
    fn icepop_zeroes_tokens_outside_the_band() {
        let out = tis_case(TisFunction::Icepop);
        assert_close(metric(&out, "pg_loss"), -1.0 / 3.0, 1e-6);
        assert_close(metric(&out, "tis_clipfrac"), 2.0 / 3.0, 1e-6);
    }

    #[test]
    fn kl_loss_and_entropy_terms() {
        let d = Device::flex();
        let lp = t2(&[&[-1.0, -2.0]], &d);
        let reference = t2(&[&[-1.5, -2.0]], &d);
        let adv = t2(&[&[0.0, 0.0]], &d);
        let mask = t2(&[&[1.0, 1.0]], &d);
        let entropy = t2(&[&[2.0, 4.0]], &d);
        let out = PolicyLossConfig {
            use_kl_loss: true,
            kl_loss_coef: 0.1,
            kl_loss_type: KlLossType::K3,
            entropy_coef: 0.01,
            ..Default::default()
        }
        .init()
        .unwrap()
        .forward(
            PolicyLossInput::new(lp.clone(), lp, adv, mask)
                .with_ref_log_probs(reference)
                .with_entropy(entropy),
        )
        .unwrap();
        // k3 at d = 0.5: e^−0.5 − 1 + 0.5; at d = 0: 0. Sample mean over 2 tokens.
        let kl = ((-0.5f64).exp() - 0.5) / 2.0;
        assert_close(metric(&out, "kl_loss"), kl, 1e-6);
        assert_close(metric(&out, "entropy_loss"), 3.0, 1e-6);
        assert_close(metric(&out, "loss"), 0.1 * kl - 0.01 * 3.0, 1e-6);
        assert!(
            PolicyLossConfig {
                use_kl_loss: true,
                ..Default::default()
            }
            .init()
            .unwrap()
            .forward(PolicyLossInput::new(
                t2(&[&[0.0]], &d),
                t2(&[&[0.0]], &d),
                t2(&[&[0.0]], &d),
                t2(&[&[1.0]], &d)
            ))
            .is_err()
        );
    }

    #[test]
    fn aggregation_modes_and_denominators() {
        let d = Device::flex();
        // On-policy with A = −x gives token loss x.
        let lp = t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]], &d);
        let adv = t2(&[&[-1.0, -2.0, -9.0], &[-4.0, -9.0, -9.0]], &d);
        let mask = t2(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]], &d);
        let input = PolicyLossInput::new(lp.clone(), lp, adv, mask);
        let sample_mean = PolicyLossConfig::default().init().unwrap();
        let out = sample_mean.forward(input.clone()).unwrap();
        assert_close(metric(&out, "pg_loss"), (1.5 + 4.0) / 2.0, 1e-6);
        let per_token = PolicyLossConfig {
            calculate_per_token_loss: true,
            ..Default::default()
        }
        .init()
        .unwrap();
        let out = per_token.forward(input.clone()).unwrap();
        assert_close(metric(&out, "pg_loss"), 7.0 / 3.0, 1e-6);
        let out = sample_mean
            .forward(
                input
                    .with_rollout_mask_sums(Tensor::<1>::from_floats([4.0, 4.0], &d))
                    .with_normalizer(8.0),
            )
            .unwrap();
        assert_close(metric(&out, "pg_loss"), (3.0 / 4.0 + 4.0 / 4.0) / 8.0, 1e-6);
    }

    #[test]
    fn opsm_masks_drifted_negative_sequences() {
        let d = Device::flex();
        // Sample 0 drifted (old − new = 0.5 > δ) with A < 0: dropped. Sample 1 on-policy.
        let old = t2(&[&[-1.0, -1.0], &[-1.0, -1.0]], &d);
        let new = t2(&[&[-1.5, -1.5], &[-1.0, -1.0]], &d);
        let adv = t2(&[&[-1.0, -1.0], &[-1.0, -1.0]], &d);
        let mask = t2(&[&[1.0, 1.0], &[1.0, 1.0]], &d);
        let out = PolicyLossConfig {
            use_opsm: true,
            eps_clip: 0.5,
            ..Default::default()
        }
        .init()
        .unwrap()
        .forward(PolicyLossInput::new(new, old, adv, mask))
        .unwrap();
        assert_close(metric(&out, "pg_loss"), 1.0 / 2.0, 1e-6);
        assert_close(metric(&out, "opsm_clipfrac"), 1.0 / 2.0, 1e-6);
    }

    #[test]
    fn missing_inputs_and_bad_shapes_are_errors() {
        let d = Device::flex();
        let a = t2(&[&[0.0, 0.0]], &d);
        let b = t2(&[&[0.0]], &d);
        let loss = PolicyLossConfig::default().init().unwrap();
        assert!(matches!(
            loss.forward(PolicyLossInput::new(a.clone(), b, a.clone(), a.clone())),
            Err(OpsError::ShapeMismatch {
                what: "old_log_probs",
                ..
            })
        ));
        let tis = PolicyLossConfig {
            use_tis: true,
            ..Default::default()
        }
        .init()
        .unwrap();
        assert!(matches!(
            tis.forward(PolicyLossInput::new(a.clone(), a.clone(), a.clone(), a)),
            Err(OpsError::MissingInput {
                what: "rollout_log_probs",
                ..
            })
        ));
    }

    #[test]
    fn value_loss_clips_around_old_values() {
        let d = Device::flex();
        let v = t2(&[&[1.0, 0.0]], &d);
        let v_old = t2(&[&[0.0, 0.0]], &d);
        let ret = t2(&[&[0.0, 1.0]], &d);
        let reducer = Reducer::new(t2(&[&[1.0, 1.0]], &d), None, LossAggregation::SampleMean);
        let (loss, clipfrac) = value_loss(v, v_old, ret, 0.2, &reducer);
        // Token 0: clipped V = 0.2 → max(0.04, 1) = 1; token 1: max(1, 1) = 1.
        assert_close(f64::from(loss.into_scalar::<f32>()), 1.0, 1e-6);
        assert_close(f64::from(clipfrac.into_scalar::<f32>()), 0.0, 1e-6);
    }
}
