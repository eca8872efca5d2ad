//! On-policy distillation (OPD): the teacher's per-token reverse-KL penalty, added to the
//! advantages of any estimator, as Miles' `apply_opd_kl_to_advantages` computes it.
//!
//! For every response token `t`, `A_t ← A_t − opd_kl_coef · kl_t`, where `kl_t` is either
//! precomputed at rollout (the top-k estimate, `Sample::opd_reverse_kl`) or the sampled-token
//! reverse KL `log π_student(y_t) − log π_teacher(y_t)`, the student's log-prob being the old
//! (pre-update) one the advantages use (`rollout_log_probs` with `--use-rollout-logprobs`).
//! The penalty is applied after the estimator and before `--normalize-advantages`.

use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::batch::TrainItem;
use crate::{Error, Result};

/// `--opd-type`: where the teacher's log-probs come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpdType {
    /// An SGLang-compatible server scores each sample during rollout
    /// (`Sample::teacher_log_probs` / `Sample::opd_reverse_kl` arrive with the samples).
    #[default]
    Sglang,
    /// A local teacher (`--opd-teacher-load`) scored by the trainer's own forward (Miles:
    /// a Megatron teacher model).
    Megatron,
}

impl std::str::FromStr for OpdType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "sglang" => Ok(Self::Sglang),
            "megatron" => Ok(Self::Megatron),
            other => Err(Error::Config {
                field: "opd_type",
                value: other.into(),
                reason: "expected sglang or megatron",
            }),
        }
    }
}

/// The trainer's OPD settings (Miles' `--use-opd`, `--opd-type`, `--opd-kl-coef`,
/// `--opd-teacher-load`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OpdConfig {
    /// `--use-opd` (false).
    pub use_opd: bool,
    /// `--opd-type`.
    pub opd_type: OpdType,
    /// `--opd-kl-coef` (1.0).
    pub opd_kl_coef: f64,
    /// `--opd-teacher-load`: the teacher's HF checkpoint with `opd_type = megatron`.
    pub opd_teacher_load: Option<PathBuf>,
}

impl Default for OpdConfig {
    fn default() -> Self {
        Self {
            use_opd: false,
            opd_type: OpdType::Sglang,
            opd_kl_coef: 1.0,
            opd_teacher_load: None,
        }
    }
}

impl OpdConfig {
    /// Miles' argument checks: a finite coefficient; `opd_teacher_load` exactly when the type
    /// is `megatron`; no teacher without `use_opd`.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, value: String, reason| {
            Err(Error::Config {
                field,
                value,
                reason,
            })
        };
        if !self.opd_kl_coef.is_finite() {
            return bad(
                "opd_kl_coef",
                self.opd_kl_coef.to_string(),
                "must be finite",
            );
        }
        let load = self.opd_teacher_load.as_ref();
        let shown = || load.map(|p| p.display().to_string()).unwrap_or_default();
        match (self.use_opd, self.opd_type, load) {
            (false, _, Some(_)) => bad(
                "opd_teacher_load",
                shown(),
                "is set but --use-opd is not enabled. Please add --use-opd flag.",
            ),
            (true, OpdType::Megatron, None) => bad(
                "opd_teacher_load",
                String::new(),
                "is required when --opd-type=megatron",
            ),
            (true, OpdType::Sglang, Some(_)) => bad(
                "opd_teacher_load",
                shown(),
                "should not be set when --opd-type=sglang (the teacher runs on an external \
                 SGLang-compatible server)",
            ),
            _ => Ok(()),
        }
    }

    /// Whether the trainer scores a local teacher (`use_opd` with `opd_type = megatron`).
    pub fn local_teacher(&self) -> bool {
        self.use_opd && self.opd_type == OpdType::Megatron
    }
}

/// Miles' `apply_opd_kl_to_advantages`: subtracts `coef · reverse_kl` from each sample's
/// per-token `advantages` in place and returns the reverse KL of every sample. A sample's
/// reverse KL is `precomputed[i]` when given, else `student[i] − teacher[i]`; lengths must
/// agree. Computed in `f32`, as Miles' tensors are.
pub fn apply_opd_kl_to_advantages(
    coef: f32,
    advantages: &mut [Vec<f32>],
    student: &[&[f32]],
    teacher: &[Option<&[f32]>],
    precomputed: &[Option<&[f32]>],
) -> Result<Vec<Vec<f32>>> {
    let n = advantages.len();
    if student.len() != n || teacher.len() != n || precomputed.len() != n {
        return Err(Error::Sample {
            index: 0,
            reason: format!(
                "OPD length mismatch: advantages={n}, student_log_probs={}, \
                 teacher_log_probs={}, opd_reverse_kl={}",
                student.len(),
                teacher.len(),
                precomputed.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(n);
    for (i, adv) in advantages.iter_mut().enumerate() {
        let mismatch = |what: &str, len: usize| Error::Sample {
            index: i,
            reason: format!(
                "OPD shape mismatch: advantages has {} entries, {what} {len}",
                adv.len()
            ),
        };
        let kl: Vec<f32> = match (precomputed[i], teacher[i]) {
            (Some(kl), _) => kl.to_vec(),
            (None, Some(t)) => {
                if t.len() != student[i].len() {
                    return Err(mismatch("teacher_log_probs", t.len()));
                }
                student[i].iter().zip(t).map(|(s, t)| s - t).collect()
            }
            (None, None) => {
                return Err(Error::Sample {
                    index: i,
                    reason: "OPD requires teacher_log_probs (or opd_reverse_kl), but the \
                             sample has neither: score it with the teacher (--opd-type)"
                        .into(),
                });
            }
        };
        if kl.len() != adv.len() {
            return Err(mismatch("reverse KL", kl.len()));
        }
        for (a, k) in adv.iter_mut().zip(&kl) {
            *a -= coef * k;
        }
        out.push(kl);
    }
    Ok(out)
}

/// Applies the OPD penalty of `config` to the estimator's `outputs` for `items` (in place) and
/// returns each item's reverse KL; `None` without `use_opd`. The student's log-probs are the
/// ones the advantages use (`old`, or the rollout's with `use_rollout_logprobs`); the
/// teacher's come from `local_teacher` (the trainer's own teacher forward) when given, else
/// from the items.
pub(crate) fn apply_to_outputs(
    config: &OpdConfig,
    use_rollout_logprobs: bool,
    items: &[TrainItem],
    old: &[Vec<f32>],
    local_teacher: &[Vec<f32>],
    outputs: &mut [miles_ops::AdvantageOutput],
) -> Result<Option<Vec<Vec<f32>>>> {
    if !config.use_opd {
        return Ok(None);
    }
    let rollout = use_rollout_logprobs;
    let student: Vec<&[f32]> = items
        .iter()
        .zip(old)
        .map(|(item, old)| match (&item.rollout_log_probs, rollout) {
            (Some(r), true) => r.as_slice(),
            _ => old.as_slice(),
        })
        .collect();
    let teacher: Vec<Option<&[f32]>> = items
        .iter()
        .enumerate()
        .map(|(i, item)| match local_teacher.get(i) {
            Some(t) => Some(t.as_slice()),
            None => item.teacher_log_probs.as_deref(),
        })
        .collect();
    let precomputed: Vec<Option<&[f32]>> =
        items.iter().map(|i| i.opd_reverse_kl.as_deref()).collect();
    let mut advantages: Vec<Vec<f32>> = outputs
        .iter_mut()
        .map(|o| std::mem::take(&mut o.advantages))
        .collect();
    let kl = apply_opd_kl_to_advantages(
        config.opd_kl_coef as f32,
        &mut advantages,
        &student,
        &teacher,
        &precomputed,
    );
    for (o, a) in outputs.iter_mut().zip(advantages) {
        o.advantages = a;
    }
    kl.map(Some)
}

/// Miles' `sum_of_sample_mean` of one step's rows: per-sample means over the loss mask (over a
/// rollout's total with per-turn siblings, `mask_sums`), summed; or the token sum with
/// `per_token`.
fn sum_of_sample_mean(
    items: &[TrainItem],
    rows: &[Vec<f32>],
    range: Range<usize>,
    per_token: bool,
    mask_sums: Option<&[f32]>,
) -> f64 {
    range
        .map(|i| {
            let mask = &items[i].loss_mask;
            let total: f64 = rows[i]
                .iter()
                .zip(mask)
                .map(|(v, m)| f64::from(v * m))
                .sum();
            let denom = match (per_token, mask_sums) {
                (true, _) => 1.0,
                (false, Some(sums)) => f64::from(sums[i]),
                (false, None) => mask.iter().map(|&m| f64::from(m)).sum(),
            };
            total / denom.max(1.0)
        })
        .sum()
}

/// `train/opd_reverse_kl` of one optimizer step (`range` of `items`) as Miles' policy loss
/// reports it: `sum_of_sample_mean(opd_reverse_kl)` over the step's loss normalizer (samples,
/// rollouts with per-turn siblings, or tokens with `per_token`), as `pg_loss` is.
pub(crate) fn step_reverse_kl(
    items: &[TrainItem],
    reverse_kl: &[Vec<f32>],
    range: Range<usize>,
    per_token: bool,
    mask_sums: Option<&[f32]>,
) -> f64 {
    let step = &items[range.clone()];
    let normalizer = match mask_sums {
        Some(_) if !per_token => crate::batch::rollouts_of(step).len() as f32,
        _ => crate::batch::step_normalizer(step, per_token),
    };
    sum_of_sample_mean(items, reverse_kl, range, per_token, mask_sums) / f64::from(normalizer)
}

/// `rollout/opd_reverse_kl` and `rollout/teacher_log_probs` (the teacher's log-probs from
/// `local_teacher` when given, else the items'), as Miles' `log_rollout_data` reports them.
pub(crate) fn rollout_metrics(
    items: &[TrainItem],
    reverse_kl: &[Vec<f32>],
    local_teacher: &[Vec<f32>],
) -> miles_core::Metrics {
    let mut out = miles_core::Metrics::new();
    out.insert(
        "rollout/opd_reverse_kl".into(),
        rollout_mean(items, reverse_kl),
    );
    let teacher: Option<Vec<Vec<f32>>> = if local_teacher.is_empty() {
        items.iter().map(|i| i.teacher_log_probs.clone()).collect()
    } else {
        Some(local_teacher.to_vec())
    };
    if let Some(teacher) = teacher {
        out.insert(
            "rollout/teacher_log_probs".into(),
            rollout_mean(items, &teacher),
        );
    }
    out
}

/// `rollout/<key>` as Miles' `log_rollout_data` reports a per-token field: the mean over the
/// samples of each sample's mean over its loss mask.
pub(crate) fn rollout_mean(items: &[TrainItem], rows: &[Vec<f32>]) -> f64 {
    if items.is_empty() {
        return 0.0;
    }
    sum_of_sample_mean(items, rows, 0..items.len(), false, None) / items.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn cases() -> Value {
        serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../fixtures/opd/opd_cases.json"
            ))
            .expect("fixtures/opd/opd_cases.json"),
        )
        .unwrap()
    }

    fn rows(v: &Value) -> Vec<Vec<f32>> {
        serde_json::from_value(v.clone()).unwrap()
    }

    /// Miles' `apply_opd_kl_to_advantages` on the cases of `fixtures/opd/opd_cases.json`
    /// (made by `fixtures/opd/gen_opd_cases.py` running Miles' function): sampled-token
    /// reverse KL and precomputed (top-k) reverse KL, bit for bit in f32.
    #[test]
    fn advantages_match_miles() {
        let cases = cases();
        let cases = cases["advantages"].as_array().unwrap();
        assert_eq!(cases.len(), 4);
        for case in cases {
            let mut adv = rows(&case["advantages"]);
            let student = rows(&case["student"]);
            let teacher = case.get("teacher").map(rows);
            let pre = case.get("precomputed").map(rows);
            let n = adv.len();
            let s: Vec<&[f32]> = student.iter().map(Vec::as_slice).collect();
            let t: Vec<Option<&[f32]>> = (0..n)
                .map(|i| teacher.as_ref().map(|t| t[i].as_slice()))
                .collect();
            let p: Vec<Option<&[f32]>> = (0..n)
                .map(|i| pre.as_ref().map(|p| p[i].as_slice()))
                .collect();
            let coef = case["coef"].as_f64().unwrap() as f32;
            let kl = apply_opd_kl_to_advantages(coef, &mut adv, &s, &t, &p).unwrap();
            assert_eq!(adv, rows(&case["expected_advantages"]), "{case}");
            assert_eq!(kl, rows(&case["expected_reverse_kl"]), "{case}");
        }
    }

    #[test]
    fn a_sample_without_teacher_or_mismatched_lengths_is_an_error() {
        let mut adv = vec![vec![0.0, 0.0]];
        let s: Vec<&[f32]> = vec![&[0.0, 0.0]];
        let err = apply_opd_kl_to_advantages(1.0, &mut adv, &s, &[None], &[None]).unwrap_err();
        assert!(
            err.to_string().contains("requires teacher_log_probs"),
            "{err}"
        );
        let t: &[f32] = &[0.0];
        let err = apply_opd_kl_to_advantages(1.0, &mut adv, &s, &[Some(t)], &[None]).unwrap_err();
        assert!(matches!(err, Error::Sample { index: 0, .. }), "{err}");
        assert_eq!(adv, vec![vec![0.0, 0.0]]);
    }

    #[test]
    fn config_checks_follow_miles() {
        let mut c = OpdConfig::default();
        assert!(c.validate().is_ok());
        c.opd_teacher_load = Some("t".into());
        assert!(c.validate().is_err());
        c.use_opd = true;
        assert!(c.validate().is_err(), "sglang with a teacher checkpoint");
        c.opd_type = OpdType::Megatron;
        assert!(c.validate().is_ok());
        assert!(c.local_teacher());
        c.opd_teacher_load = None;
        assert!(c.validate().is_err());
        assert_eq!("megatron".parse::<OpdType>().unwrap(), OpdType::Megatron);
        assert!("fsdp".parse::<OpdType>().is_err());
    }

    #[test]
    fn metrics_are_sample_means_over_the_loss_mask() {
        let mut a = TrainItem::new(vec![0; 4], 3, 0.0);
        a.loss_mask = vec![1.0, 0.0, 1.0];
        let b = TrainItem::new(vec![0; 2], 1, 0.0);
        let items = vec![a, b];
        let kl = vec![vec![1.0, 100.0, 3.0], vec![4.0]];
        // (1 + 3) / 2 = 2 and 4: mean 3.
        assert_eq!(rollout_mean(&items, &kl), 3.0);
        assert_eq!(step_reverse_kl(&items, &kl, 0..2, false, None), 3.0);
        // Per token: (1 + 3 + 4) / 3 tokens.
        assert_eq!(step_reverse_kl(&items, &kl, 0..2, true, None), 8.0 / 3.0);
        assert_eq!(step_reverse_kl(&items, &kl, 1..2, false, None), 4.0);
        // One rollout of two siblings (mask total 3): (1 + 3 + 4) / 3, one rollout.
        let mut items = items;
        for item in &mut items {
            item.rollout_id = Some(7);
        }
        let sums = [3.0, 3.0];
        assert_eq!(
            step_reverse_kl(&items, &kl, 0..2, false, Some(&sums)),
            8.0 / 3.0
        );
    }
}
