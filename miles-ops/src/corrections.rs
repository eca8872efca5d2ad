//! Train/inference mismatch corrections: TIS, ICEPOP and MIS (as Miles' policy loss applies them).
//!
//! All weights are computed from the trainer-scored old log-probs and the rollout engine's
//! log-probs, are detached, and multiply the per-token policy-gradient loss. A correction may
//! also return a modified loss mask (rejection), which changes the numerator of the
//! policy-loss reducer only.

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::{OpsError, Result};

/// Safety bound on log importance ratios before `exp` (Miles: 20).
pub const IS_LOG_RATIO_BOUND: f32 = 20.0;

/// The importance-sampling correction applied when `--use-tis` or `--get-mismatch-metrics`
/// is set. Miles selects the non-default ones through `--custom-tis-function-path`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TisFunction {
    /// `vanilla_tis_function`: `pg_loss × clamp(w, tis_clip_low, tis_clip)`.
    #[default]
    VanillaTis,
    /// `icepop_function`: weight `w` inside `[tis_clip_low, tis_clip]`, 0 outside.
    Icepop,
    /// Miles' MIS example (`mis.py`): token / sequence / geometric ratios with truncate,
    /// clip or mask modes, rejection sampling, veto and batch normalisation.
    Mis(MisConfig),
}

/// Aggregation level of an importance ratio (`tis_level` / `rs_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsLevel {
    /// Per-token ratio.
    #[default]
    Token,
    /// `exp(Σ_t log-diff)` over the sample's masked tokens, on every token.
    Sequence,
    /// `exp(mean_t log-diff)` over the sample's masked tokens, on every token.
    Geometric,
}

/// How MIS bounds the weights (`tis_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IsMode {
    /// `clamp(w, 0, upper)`.
    #[default]
    Truncate,
    /// `clamp(w, lower, upper)`.
    Clip,
    /// Keep `w`; drop tokens outside `[lower, upper]` from the loss mask.
    Mask,
}

/// Settings of Miles' MIS example (`examples/.../mis.py::MisConfig`), with its defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MisConfig {
    /// `use_rs` (false): rejection sampling on the loss mask.
    pub use_rs: bool,
    /// `tis_level` (`token`).
    pub tis_level: IsLevel,
    /// `rs_level` (`token`).
    pub rs_level: IsLevel,
    /// `tis_mode` (`truncate`).
    pub tis_mode: IsMode,
    /// `tis_lower_bound` (0.5; `None` → `1 / tis_upper_bound`).
    pub tis_lower_bound: Option<f32>,
    /// `tis_upper_bound` (2.0).
    pub tis_upper_bound: f32,
    /// `rs_lower_bound` (`None` → the TIS lower bound).
    pub rs_lower_bound: Option<f32>,
    /// `rs_upper_bound` (`None` → `tis_upper_bound`).
    pub rs_upper_bound: Option<f32>,
    /// `rs_veto_threshold` (1e-4): a sample with any token ratio below it is rejected.
    pub rs_veto_threshold: Option<f32>,
    /// `tis_batch_normalize` (false): rescale the weights to mean 1 over the batch.
    pub tis_batch_normalize: bool,
}

impl Default for MisConfig {
    fn default() -> Self {
        Self {
            use_rs: false,
            tis_level: IsLevel::Token,
            rs_level: IsLevel::Token,
            tis_mode: IsMode::Truncate,
            tis_lower_bound: Some(0.5),
            tis_upper_bound: 2.0,
            rs_lower_bound: None,
            rs_upper_bound: None,
            rs_veto_threshold: Some(1e-4),
            tis_batch_normalize: false,
        }
    }
}

impl MisConfig {
    fn tis_lower(&self) -> f32 {
        self.tis_lower_bound.unwrap_or(1.0 / self.tis_upper_bound)
    }
    fn rs_bounds(&self) -> (f32, f32) {
        (
            self.rs_lower_bound.unwrap_or(self.tis_lower()),
            self.rs_upper_bound.unwrap_or(self.tis_upper_bound),
        )
    }

    /// Checks the bounds once.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |flag: &'static str, reason: String| Err(OpsError::InvalidConfig { flag, reason });
        if !(self.tis_upper_bound.is_finite() && self.tis_upper_bound > 0.0) {
            return bad(
                "tis-upper-bound",
                format!("{} must be > 0", self.tis_upper_bound),
            );
        }
        let lower = self.tis_lower();
        if self.tis_mode != IsMode::Truncate && !(lower >= 0.0 && lower < self.tis_upper_bound) {
            return bad(
                "tis-lower-bound",
                format!(
                    "{lower} must be in [0, tis_upper_bound={})",
                    self.tis_upper_bound
                ),
            );
        }
        let (rl, ru) = self.rs_bounds();
        if self.use_rs && !(rl >= 0.0 && rl < ru) {
            return bad(
                "rs-lower-bound",
                format!("rs bounds [{rl}, {ru}] are empty"),
            );
        }
        if let Some(v) = self.rs_veto_threshold
            && (v.is_nan() || v <= 0.0)
        {
            return bad("rs-veto-threshold", format!("{v} must be > 0"));
        }
        if self.tis_batch_normalize && self.tis_level == IsLevel::Geometric {
            return bad(
                "tis-batch-normalize",
                "batch normalisation supports tis_level token or sequence only".into(),
            );
        }
        Ok(())
    }
}

/// What a correction returns: detached weights, the (possibly) modified mask, and per-token
/// metrics to be reduced with the *original* mask.
#[derive(Debug, Clone)]
pub struct Correction {
    /// Per-token weights multiplying `pg_loss` (`None`: no reweighting).
    pub weights: Option<Tensor<2>>,
    /// Numerator mask for the policy-loss reducer.
    pub modified_mask: Tensor<2>,
    /// Per-token metric tensors under Miles' names.
    pub metrics: Vec<(&'static str, Tensor<2>)>,
}

/// Masked per-sample sum broadcast to every token (`[b, t]` → `[b, t]`).
fn masked_sum_expand(x: Tensor<2>, mask: Tensor<2>) -> Tensor<2> {
    let [_, t] = x.dims();
    (x * mask).sum_dim(1).repeat_dim(1, t)
}

fn masked_mean_expand(x: Tensor<2>, mask: Tensor<2>) -> Tensor<2> {
    let [_, t] = x.dims();
    let den = mask.clone().sum_dim(1).clamp_min(1.0);
    ((x * mask).sum_dim(1) / den).repeat_dim(1, t)
}

fn level_log_ratio(raw: Tensor<2>, mask: Tensor<2>, level: IsLevel) -> Tensor<2> {
    match level {
        IsLevel::Token => raw,
        IsLevel::Sequence => masked_sum_expand(raw, mask),
        IsLevel::Geometric => masked_mean_expand(raw, mask),
    }
}

impl TisFunction {
    /// Validates the variant's own settings.
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::Mis(c) => c.validate(),
            _ => Ok(()),
        }
    }

    /// Computes the correction for a `[batch, tokens]` batch.
    ///
    /// `tis_clip_low` / `tis_clip` are `--tis-clip-low` / `--tis-clip` (used by
    /// `vanilla_tis` and `icepop`); `use_tis` is `--use-tis` (MIS only reweights with it).
    pub fn compute(
        &self,
        train_log_probs: Tensor<2>,
        rollout_log_probs: Tensor<2>,
        loss_mask: Tensor<2>,
        tis_clip_low: f32,
        tis_clip: f32,
        use_tis: bool,
    ) -> Correction {
        let inactive = loss_mask.clone().lower_equal_elem(0.0);
        // Padding may hold arbitrary log-probs: force a zero log-diff there (weight 1).
        let raw = crate::kl::clean_non_finite(
            (train_log_probs - rollout_log_probs).detach(),
            IS_LOG_RATIO_BOUND,
        )
        .mask_fill(inactive, 0.0);
        match self {
            Self::VanillaTis | Self::Icepop => {
                let w = raw.clamp_max(IS_LOG_RATIO_BOUND * 4.0).exp();
                let weights = if matches!(self, Self::VanillaTis) {
                    w.clone().clamp(tis_clip_low, tis_clip)
                } else {
                    let inside = w
                        .clone()
                        .greater_equal_elem(tis_clip_low)
                        .bool_and(w.clone().lower_equal_elem(tis_clip));
                    w.clone().mask_fill(inside.bool_not(), 0.0)
                };
                let clipfrac = weights.clone().not_equal(w.clone()).float();
                let abs = (w.clone() - 1.0).abs();
                Correction {
                    weights: Some(weights),
                    modified_mask: loss_mask,
                    metrics: vec![("tis", w), ("tis_clipfrac", clipfrac), ("tis_abs", abs)],
                }
            }
            Self::Mis(cfg) => mis(cfg, raw, loss_mask, use_tis),
        }
    }
}

fn mis(cfg: &MisConfig, raw: Tensor<2>, loss_mask: Tensor<2>, use_tis: bool) -> Correction {
    let mut metrics = Vec::new();
    if !use_tis {
        return Correction {
            weights: None,
            modified_mask: loss_mask,
            metrics,
        };
    }
    let mask = loss_mask.clone();
    let mut modified = mask.clone();
    let tis_lower = cfg.tis_lower();
    let upper = cfg.tis_upper_bound;

    let log_ratio_tis = level_log_ratio(raw.clone(), mask.clone(), cfg.tis_level);
    let w = log_ratio_tis
        .clone()
        .clamp(-IS_LOG_RATIO_BOUND, IS_LOG_RATIO_BOUND)
        .exp();
    metrics.push(("tis_weight_before_bound", w.clone()));
    let mut weights = match cfg.tis_mode {
        IsMode::Truncate => {
            metrics.push((
                "tis_truncate_fraction",
                w.clone().greater_elem(upper).float(),
            ));
            w.clamp(0.0, upper) * mask.clone()
        }
        IsMode::Clip => {
            metrics.push((
                "tis_clip_fraction_low",
                w.clone().lower_elem(tis_lower).float(),
            ));
            metrics.push((
                "tis_clip_fraction_high",
                w.clone().greater_elem(upper).float(),
            ));
            w.clamp(tis_lower, upper) * mask.clone()
        }
        IsMode::Mask => {
            metrics.push((
                "tis_mask_fraction_low",
                w.clone().lower_elem(tis_lower).float(),
            ));
            metrics.push((
                "tis_mask_fraction_high",
                w.clone().greater_elem(upper).float(),
            ));
            let inside = w
                .clone()
                .greater_equal_elem(tis_lower)
                .bool_and(w.clone().lower_equal_elem(upper))
                .float();
            modified = mask.clone() * inside;
            w * mask.clone()
        }
    };
    metrics.push(("tis_weight_after_bound", weights.clone()));

    if cfg.use_rs {
        let log_ratio_rs = if cfg.rs_level == cfg.tis_level {
            log_ratio_tis
        } else {
            level_log_ratio(raw.clone(), mask.clone(), cfg.rs_level)
        };
        let rs_w = log_ratio_rs
            .clamp(-IS_LOG_RATIO_BOUND, IS_LOG_RATIO_BOUND)
            .exp();
        let (rl, ru) = cfg.rs_bounds();
        metrics.push(("rs_mask_fraction_low", rs_w.clone().lower_elem(rl).float()));
        metrics.push((
            "rs_mask_fraction_high",
            rs_w.clone().greater_elem(ru).float(),
        ));
        let inside = rs_w
            .clone()
            .greater_equal_elem(rl)
            .bool_and(rs_w.lower_equal_elem(ru))
            .float();
        modified = modified * inside;
        if let Some(threshold) = cfg.rs_veto_threshold {
            let [_, t] = raw.dims();
            let catastrophic = raw
                .clone()
                .lower_elem(threshold.ln())
                .bool_and(mask.clone().greater_elem(0.0))
                .float();
            let seq_has = catastrophic.clone().max_dim(1).repeat_dim(1, t);
            metrics.push(("rs_catastrophic_token_fraction", catastrophic));
            metrics.push(("rs_catastrophic_seq_fraction", seq_has.clone()));
            modified = modified * (seq_has.neg() + 1.0);
        }
    }
    metrics.push(("is_ratio_mean_after_tis_rs", weights.clone()));

    if cfg.tis_batch_normalize {
        let [b, _] = weights.dims();
        let mean = match cfg.tis_level {
            IsLevel::Sequence => {
                let den = mask.clone().sum_dim(1).clamp_min(1.0);
                ((weights.clone() * mask.clone()).sum_dim(1) / den)
                    .sum()
                    .div_scalar(b.max(1) as f32)
            }
            _ => {
                let den = mask.clone().sum().clamp_min(1.0);
                (weights.clone() * mask.clone()).sum() / den
            }
        };
        // mean > 1e-8 ? mean : 1 (no division by ~0).
        let tiny = mean.clone().lower_equal_elem(1e-8);
        let factor = mean.mask_fill(tiny, 1.0).reshape([1, 1]);
        weights = weights / factor.clone();
        metrics.push(("batch_norm_factor", factor.expand(mask.dims())));
    }
    metrics.push((
        "is_ratio_mean_final",
        masked_mean_expand(weights.clone(), mask.clone()),
    ));

    Correction {
        weights: Some(weights.detach()),
        modified_mask: modified.detach(),
        metrics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn rows(t: Tensor<2>) -> Vec<Vec<f32>> {
        let [b, n] = t.dims();
        let v = t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        (0..b).map(|i| v[i * n..(i + 1) * n].to_vec()).collect()
    }

    fn close(a: &[f32], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((f64::from(*x) - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    /// Two samples: train − rollout = [ln 3, ln 0.25, 0] and [0, 0, 0]; all tokens trainable.
    fn run(cfg: MisConfig, use_tis: bool) -> Correction {
        let d = Device::flex();
        let train = Tensor::<2>::zeros([2, 3], &d);
        let rollout =
            Tensor::<2>::from_floats([[-(3f32.ln()), -(0.25f32.ln()), 0.0], [0.0, 0.0, 0.0]], &d);
        let mask = Tensor::<2>::ones([2, 3], &d);
        TisFunction::Mis(cfg).compute(train, rollout, mask, 0.0, 2.0, use_tis)
    }

    fn metric<'a>(c: &'a Correction, name: &str) -> &'a Tensor<2> {
        &c.metrics.iter().find(|(n, _)| *n == name).unwrap().1
    }

    #[test]
    fn mis_token_modes() {
        let c = run(MisConfig::default(), true);
        close(&rows(c.weights.clone().unwrap())[0], &[2.0, 0.25, 1.0]);
        close(
            &rows(metric(&c, "tis_truncate_fraction").clone())[0],
            &[1.0, 0.0, 0.0],
        );
        close(&rows(c.modified_mask)[0], &[1.0, 1.0, 1.0]);

        let c = run(
            MisConfig {
                tis_mode: IsMode::Clip,
                ..Default::default()
            },
            true,
        );
        close(&rows(c.weights.unwrap())[0], &[2.0, 0.5, 1.0]);

        let c = run(
            MisConfig {
                tis_mode: IsMode::Mask,
                ..Default::default()
            },
            true,
        );
        close(&rows(c.weights.unwrap())[0], &[3.0, 0.25, 1.0]);
        let m = rows(c.modified_mask);
        close(&m[0], &[0.0, 0.0, 1.0]);
        close(&m[1], &[1.0, 1.0, 1.0]);
    }

    #[test]
    fn mis_sequence_and_geometric_levels() {
        // Σ log-ratio = ln 0.75; mean = ln(0.75) / 3.
        let c = run(
            MisConfig {
                tis_level: IsLevel::Sequence,
                ..Default::default()
            },
            true,
        );
        close(&rows(c.weights.unwrap())[0], &[0.75; 3]);
        let c = run(
            MisConfig {
                tis_level: IsLevel::Geometric,
                ..Default::default()
            },
            true,
        );
        close(&rows(c.weights.unwrap())[0], &[0.75f64.powf(1.0 / 3.0); 3]);
    }

    #[test]
    fn mis_rejection_sampling_and_veto() {
        // RS bounds default to the TIS bounds [0.5, 2]: tokens with ratio 3 and 0.25 drop.
        let c = run(
            MisConfig {
                use_rs: true,
                rs_veto_threshold: None,
                ..Default::default()
            },
            true,
        );
        close(&rows(c.modified_mask)[0], &[0.0, 0.0, 1.0]);
        // Veto: ratio 0.25 < 0.3 rejects the whole first sample, not the second.
        let c = run(
            MisConfig {
                use_rs: true,
                rs_veto_threshold: Some(0.3),
                ..Default::default()
            },
            true,
        );
        let m = rows(c.modified_mask.clone());
        close(&m[0], &[0.0, 0.0, 0.0]);
        close(&m[1], &[1.0, 1.0, 1.0]);
        let fraction = rows(metric(&c, "rs_catastrophic_seq_fraction").clone());
        close(&fraction[0], &[1.0; 3]);
    }

    #[test]
    fn mis_batch_normalisation_to_mean_one() {
        // Token level: weights [2, 0.25, 1, 1, 1, 1], mean 6.25 / 6.
        let c = run(
            MisConfig {
                tis_batch_normalize: true,
                ..Default::default()
            },
            true,
        );
        let mean = 6.25 / 6.0;
        let w = rows(c.weights.unwrap());
        close(&w[0], &[2.0 / mean, 0.25 / mean, 1.0 / mean]);
        close(&w[1], &[1.0 / mean; 3]);
    }

    #[test]
    fn mis_without_use_tis_changes_nothing() {
        let c = run(MisConfig::default(), false);
        assert!(c.weights.is_none());
        close(&rows(c.modified_mask)[0], &[1.0; 3]);
    }

    #[test]
    fn mis_config_validation_and_serde_tags() {
        assert!(
            MisConfig {
                tis_batch_normalize: true,
                tis_level: IsLevel::Geometric,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        assert!(
            MisConfig {
                tis_upper_bound: 0.0,
                ..Default::default()
            }
            .validate()
            .is_err()
        );
        let f: TisFunction =
            serde_json::from_str(r#"{"type":"mis","tis_mode":"mask","tis_level":"geometric"}"#)
                .unwrap();
        match f {
            TisFunction::Mis(c) => {
                assert_eq!(c.tis_mode, IsMode::Mask);
                assert_eq!(c.tis_level, IsLevel::Geometric);
                assert_eq!(c.tis_upper_bound, 2.0);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            serde_json::to_string(&TisFunction::VanillaTis).unwrap(),
            r#"{"type":"vanilla_tis"}"#
        );
    }
}
