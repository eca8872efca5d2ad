//! Learning-rate schedule with Megatron's `OptimizerParamScheduler` semantics.

use serde::{Deserialize, Serialize};

use crate::Error;

/// How the learning rate decays after warm-up (`--lr-decay-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecayStyle {
    /// Stay at `lr` (Miles' default).
    #[default]
    Constant,
    /// Linear from `lr` to `min_lr` over the decay window.
    Linear,
    /// Half-cosine from `lr` to `min_lr` over the decay window.
    Cosine,
}

/// Learning rate per optimizer step: linear warm-up from `lr_warmup_init` to `lr` over
/// `lr_warmup_iters` steps, then the decay style down to `min_lr` at `lr_decay_iters`
/// (steps counted from 0, decay window measured from the end of warm-up), `min_lr` after.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LrSchedule {
    /// Peak learning rate (`--lr`, Miles default 1e-6).
    pub lr: f64,
    /// Floor (`--min-lr`, default 0).
    pub min_lr: f64,
    /// Warm-up steps (`--lr-warmup-iters`, default 0).
    pub lr_warmup_iters: u64,
    /// Learning rate at step 0 of warm-up (`--lr-warmup-init`, default 0).
    pub lr_warmup_init: f64,
    /// Step at which decay reaches `min_lr` (`--lr-decay-iters`); required unless constant.
    pub lr_decay_iters: Option<u64>,
    /// Decay style (`--lr-decay-style`, default constant).
    pub lr_decay_style: LrDecayStyle,
}

impl Default for LrSchedule {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            min_lr: 0.0,
            lr_warmup_iters: 0,
            lr_warmup_init: 0.0,
            lr_decay_iters: None,
            lr_decay_style: LrDecayStyle::Constant,
        }
    }
}

impl LrSchedule {
    /// Checks the values once; downstream code uses the returned schedule.
    pub fn validate(self) -> Result<Self, Error> {
        let config = |field, value: String, reason| Error::Config {
            field,
            value,
            reason,
        };
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(config("lr", self.lr.to_string(), "must be finite and >= 0"));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(config(
                "min_lr",
                self.min_lr.to_string(),
                "must lie in [0, lr]",
            ));
        }
        if !(self.lr_warmup_init.is_finite() && self.lr_warmup_init >= 0.0) {
            return Err(config(
                "lr_warmup_init",
                self.lr_warmup_init.to_string(),
                "must be finite and >= 0",
            ));
        }
        if self.lr_decay_style != LrDecayStyle::Constant {
            match self.lr_decay_iters {
                None => {
                    return Err(config(
                        "lr_decay_iters",
                        "None".into(),
                        "required by linear / cosine decay",
                    ));
                }
                Some(decay) if decay <= self.lr_warmup_iters => {
                    return Err(config(
                        "lr_decay_iters",
                        decay.to_string(),
                        "must exceed lr_warmup_iters",
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(self)
    }

    /// The learning rate at optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if self.lr_warmup_iters > 0 && step <= self.lr_warmup_iters {
            return self.lr_warmup_init
                + (self.lr - self.lr_warmup_init) * step as f64 / self.lr_warmup_iters as f64;
        }
        let Some(decay_iters) = self.lr_decay_iters else {
            return self.lr;
        };
        if self.lr_decay_style == LrDecayStyle::Constant {
            return self.lr;
        }
        if step > decay_iters {
            return self.min_lr;
        }
        let ratio =
            (step - self.lr_warmup_iters) as f64 / (decay_iters - self.lr_warmup_iters) as f64;
        let coefficient = match self.lr_decay_style {
            LrDecayStyle::Constant => 1.0,
            LrDecayStyle::Linear => 1.0 - ratio,
            LrDecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
        };
        self.min_lr + coefficient * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_default_is_miles_lr() {
        let s = LrSchedule::default().validate().unwrap();
        assert_eq!(s.lr_at(0), 1e-6);
        assert_eq!(s.lr_at(10_000), 1e-6);
    }

    #[test]
    fn linear_decay_and_warmup_init() {
        let s = LrSchedule {
            lr: 1.0,
            min_lr: 0.0,
            lr_warmup_iters: 4,
            lr_warmup_init: 0.2,
            lr_decay_iters: Some(8),
            lr_decay_style: LrDecayStyle::Linear,
        }
        .validate()
        .unwrap();
        let got: Vec<f64> = (0..10).map(|i| s.lr_at(i)).collect();
        let want = [0.2, 0.4, 0.6, 0.8, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
    }

    #[test]
    fn cosine_quarter_points() {
        let s = LrSchedule {
            lr: 2.0,
            min_lr: 1.0,
            lr_decay_iters: Some(4),
            lr_decay_style: LrDecayStyle::Cosine,
            ..LrSchedule::default()
        }
        .validate()
        .unwrap();
        // min + 0.5 (cos(pi r) + 1) (max - min) at r = 0, 1/4, 1/2, 3/4, 1.
        let want = [
            2.0,
            1.0 + 0.5 * (0.5f64.sqrt() + 1.0),
            1.5,
            1.0 + 0.5 * (1.0 - 0.5f64.sqrt()),
            1.0,
        ];
        for (i, w) in want.iter().enumerate() {
            assert!((s.lr_at(i as u64) - w).abs() < 1e-12);
        }
    }

    #[test]
    fn invalid_configs_are_typed_errors() {
        let no_decay = LrSchedule {
            lr_decay_style: LrDecayStyle::Cosine,
            ..LrSchedule::default()
        };
        assert!(matches!(
            no_decay.validate(),
            Err(Error::Config {
                field: "lr_decay_iters",
                ..
            })
        ));
        let bad_min = LrSchedule {
            min_lr: 1.0,
            ..LrSchedule::default()
        };
        assert!(matches!(
            bad_min.validate(),
            Err(Error::Config {
                field: "min_lr",
                ..
            })
        ));
        let nan = LrSchedule {
            lr: f64::NAN,
            ..LrSchedule::default()
        };
        assert!(nan.validate().is_err());
    }
}
