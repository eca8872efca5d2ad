//! KL estimators (Miles' `compute_approx_kl`).
//!
//! With `d = log_probs − log_probs_base`:
//! `k1 → d`, `k2 → d²/2`, `k3 → exp(−d) − 1 + d`, and `low_var_kl` → k3 with `−d` first
//! cleaned (NaN → 0, ±inf → ±20) and clamped to ±20, the result clamped to `[−10, 10]`.
//! With `--use-unbiased-kl` the estimate is multiplied by the importance ratio
//! `exp(log_probs − old_log_probs)` before the final `low_var_kl` clamp.

use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// The KL estimator (`--kl-loss-type`, default `k1`). Serialised with Miles' CLI values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlLossType {
    /// `d`: unbiased, high variance, can be negative.
    #[default]
    K1,
    /// `d² / 2`.
    K2,
    /// `exp(−d) − 1 + d`: unbiased and non-negative (Schulman's k3).
    K3,
    /// k3 with the log-ratio cleaned and clamped to ±20 and the result clamped to `[−10, 10]`.
    LowVarKl,
}

impl KlLossType {
    /// The Miles CLI value (`k1`, `k2`, `k3`, `low_var_kl`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::K1 => "k1",
            Self::K2 => "k2",
            Self::K3 => "k3",
            Self::LowVarKl => "low_var_kl",
        }
    }
}

impl std::fmt::Display for KlLossType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KlLossType {
    type Err = crate::OpsError;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "k1" => Ok(Self::K1),
            "k2" => Ok(Self::K2),
            "k3" => Ok(Self::K3),
            "low_var_kl" => Ok(Self::LowVarKl),
            other => Err(crate::OpsError::InvalidConfig {
                flag: "kl-loss-type",
                reason: format!("unknown estimator `{other}` (expected k1, k2, k3 or low_var_kl)"),
            }),
        }
    }
}

/// Largest magnitude of the log-ratio inside `low_var_kl` (and of the PPO log-ratio).
pub const LOG_RATIO_CLAMP: f32 = 20.0;
/// Bound of the `low_var_kl` result.
pub const LOW_VAR_KL_CLAMP: f32 = 10.0;

/// Replaces NaN by 0 and ±inf by ±`bound` (elementwise, keeps gradients of finite entries).
pub(crate) fn clean_non_finite<const D: usize>(x: Tensor<D>, bound: f32) -> Tensor<D> {
    let x = x.clone().mask_fill(x.is_nan(), 0.0);
    let pos_inf = x.clone().is_inf().bool_and(x.clone().greater_elem(0.0));
    let neg_inf = x.clone().is_inf().bool_and(x.clone().lower_elem(0.0));
    x.mask_fill(pos_inf, bound).mask_fill(neg_inf, -bound)
}

/// `compute_approx_kl(log_probs, log_probs_base, kl_type)` on tensors of any rank.
///
/// `importance_ratio` (for `--use-unbiased-kl`) multiplies the estimate before the
/// `low_var_kl` clamp. Differentiable with respect to both log-prob inputs.
pub fn compute_approx_kl<const D: usize>(
    log_probs: Tensor<D>,
    log_probs_base: Tensor<D>,
    kl_type: KlLossType,
    importance_ratio: Option<Tensor<D>>,
) -> Tensor<D> {
    let d = log_probs - log_probs_base;
    let kl = match kl_type {
        KlLossType::K1 => d,
        KlLossType::K2 => d.powi_scalar(2).div_scalar(2.0),
        KlLossType::K3 => {
            let neg = d.neg();
            neg.clone().exp().sub_scalar(1.0) - neg
        }
        KlLossType::LowVarKl => {
            let neg =
                clean_non_finite(d.neg(), LOG_RATIO_CLAMP).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP);
            neg.clone().exp().sub_scalar(1.0) - neg
        }
    };
    let kl = match importance_ratio {
        Some(w) => kl * w,
        None => kl,
    };
    match kl_type {
        KlLossType::LowVarKl => kl.clamp(-LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP),
        _ => kl,
    }
}

/// Host (scalar) version of [`compute_approx_kl`] for one token, computed in `f64`.
///
/// Used for reward shaping (`--kl-coef`) where the per-token KL feeds the advantage
/// estimators on the host.
pub fn approx_kl_scalar(log_prob: f32, log_prob_base: f32, kl_type: KlLossType) -> f32 {
    let d = f64::from(log_prob) - f64::from(log_prob_base);
    let kl = match kl_type {
        KlLossType::K1 => d,
        KlLossType::K2 => d * d / 2.0,
        KlLossType::K3 => (-d).exp() - 1.0 + d,
        KlLossType::LowVarKl => {
            let lim = f64::from(LOG_RATIO_CLAMP);
            let neg = if d.is_nan() {
                0.0
            } else {
                (-d).clamp(-lim, lim)
            };
            let lim_out = f64::from(LOW_VAR_KL_CLAMP);
            (neg.exp() - 1.0 - neg).clamp(-lim_out, lim_out)
        }
    };
    kl as f32
}

/// Per-token shaping KL for one sample (the `kl_i` of Miles' reward shaping, weighted by
/// `--kl-coef`).
pub fn shaping_kl(
    log_probs: &[f32],
    ref_log_probs: &[f32],
    kl_type: KlLossType,
) -> crate::Result<Vec<f32>> {
    if log_probs.len() != ref_log_probs.len() {
        return Err(crate::OpsError::LengthMismatch {
            what: "ref_log_probs",
            expected: log_probs.len(),
            got: ref_log_probs.len(),
        });
    }
    Ok(log_probs
        .iter()
        .zip(ref_log_probs)
        .map(|(&a, &b)| approx_kl_scalar(a, b, kl_type))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn kl_tensor(lp: f32, base: f32, kind: KlLossType, ratio: Option<f32>) -> f32 {
        let d = Device::flex();
        let t = |x: f32| Tensor::<1>::from_floats([x], &d);
        compute_approx_kl(t(lp), t(base), kind, ratio.map(t)).into_scalar::<f32>()
    }

    #[test]
    fn estimators_hand_computed() {
        // d = 0.5: k1 = 0.5, k2 = 0.125, k3 = e^−0.5 − 1 + 0.5.
        let k3 = (-0.5f64).exp() - 0.5;
        for (kind, expected) in [
            (KlLossType::K1, 0.5),
            (KlLossType::K2, 0.125),
            (KlLossType::K3, k3),
            (KlLossType::LowVarKl, k3),
        ] {
            let v = kl_tensor(-1.0, -1.5, kind, None);
            assert!((f64::from(v) - expected).abs() < 1e-6, "{kind}: {v}");
            let h = approx_kl_scalar(-1.0, -1.5, kind);
            assert!((f64::from(h) - expected).abs() < 1e-6, "{kind} host: {h}");
        }
    }

    #[test]
    fn low_var_kl_clamps_like_miles() {
        // d = −30: −d clamped to 20 → e^20 − 21 ≫ 10 → 10. d = +30: e^−20 + 19 → 10.
        assert_eq!(kl_tensor(-31.0, -1.0, KlLossType::LowVarKl, None), 10.0);
        assert_eq!(kl_tensor(29.0, -1.0, KlLossType::LowVarKl, None), 10.0);
        assert_eq!(approx_kl_scalar(-31.0, -1.0, KlLossType::LowVarKl), 10.0);
        // NaN log-ratio → 0; −inf log-prob → −d = +inf → 20 → clamped to 10.
        assert_eq!(kl_tensor(f32::NAN, -1.0, KlLossType::LowVarKl, None), 0.0);
        assert_eq!(
            kl_tensor(f32::NEG_INFINITY, -1.0, KlLossType::LowVarKl, None),
            10.0
        );
        // k3 is not clamped.
        assert!(kl_tensor(-31.0, -1.0, KlLossType::K3, None) > 1e8);
        // The unbiased importance ratio multiplies before the clamp.
        let k3 = (-0.5f64).exp() - 0.5;
        let v = kl_tensor(-1.0, -1.5, KlLossType::LowVarKl, Some(2.0));
        assert!((f64::from(v) - 2.0 * k3).abs() < 1e-6);
        assert_eq!(
            kl_tensor(-31.0, -1.0, KlLossType::LowVarKl, Some(0.5)),
            10.0
        );
    }

    #[test]
    fn names_round_trip() {
        for kind in [
            KlLossType::K1,
            KlLossType::K2,
            KlLossType::K3,
            KlLossType::LowVarKl,
        ] {
            assert_eq!(kind.as_str().parse::<KlLossType>().unwrap(), kind);
            assert_eq!(
                serde_json::to_string(&kind).unwrap(),
                format!("\"{}\"", kind.as_str())
            );
        }
        assert!("k4".parse::<KlLossType>().is_err());
        assert_eq!(
            shaping_kl(&[0.0], &[0.0, 1.0], KlLossType::K1),
            Err(crate::OpsError::LengthMismatch {
                what: "ref_log_probs",
                expected: 1,
                got: 2
            })
        );
    }
}
