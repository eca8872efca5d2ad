//! Loss aggregation (Miles' `sum_of_sample_mean` / per-token loss) and per-step metrics.
//!
//! Batches are padded `[batch, tokens]` tensors with a float loss mask (`> 0` = trainable).
//! The default reducer is Miles' `sum_of_sample_mean`: `Σ_samples Σ_t x·mask / max(den, 1)`
//! where `den` is the sample's mask sum or, when given, its `rollout_mask_sums` entry.
//! `--calculate-per-token-loss` switches to the token sum `Σ x·mask`.

use burn::tensor::{Bool, Tensor};
use serde::{Deserialize, Serialize};

/// Which reducer aggregates per-token terms (`--calculate-per-token-loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregation {
    /// `sum_of_sample_mean` (Miles' default): each sample's token mean, summed over samples.
    #[default]
    SampleMean,
    /// `--calculate-per-token-loss`: the plain token sum.
    PerToken,
}

/// A reducer bound to one batch's masks (Miles' `sum_of_sample_mean` closure).
#[derive(Debug, Clone)]
pub struct Reducer {
    mask: Tensor<2>,
    inactive: Tensor<2, Bool>,
    denominators: Tensor<2>,
    aggregation: LossAggregation,
}

impl Reducer {
    /// Builds the reducer. `numerator_mask` weights the tokens; `denominators` (`[batch]`,
    /// Miles' `rollout_mask_sums`) overrides the per-sample mask sums.
    pub fn new(
        numerator_mask: Tensor<2>,
        denominators: Option<Tensor<1>>,
        aggregation: LossAggregation,
    ) -> Self {
        let [b, _] = numerator_mask.dims();
        let denominators = match denominators {
            Some(d) => d.reshape([b, 1]),
            None => numerator_mask.clone().sum_dim(1),
        }
        .clamp_min(1.0);
        let inactive = numerator_mask.clone().lower_equal_elem(0.0);
        Self {
            mask: numerator_mask,
            inactive,
            denominators,
            aggregation,
        }
    }

    /// The numerator mask.
    pub fn mask(&self) -> &Tensor<2> {
        &self.mask
    }

    /// Reduces a `[batch, tokens]` per-token quantity to a `[1]` tensor. Values at masked
    /// positions never contribute (not even NaN or ±inf).
    pub fn reduce(&self, x: Tensor<2>) -> Tensor<1> {
        let x = x.mask_fill(self.inactive.clone(), 0.0) * self.mask.clone();
        match self.aggregation {
            LossAggregation::SampleMean => (x.sum_dim(1) / self.denominators.clone()).sum(),
            LossAggregation::PerToken => x.sum(),
        }
    }
}

/// Named scalar metrics (Miles' `train/…` names without the prefix), each a `[1]` tensor.
#[derive(Debug, Clone, Default)]
pub struct LossMetrics {
    entries: Vec<(&'static str, Tensor<1>)>,
}

impl LossMetrics {
    /// Adds (or replaces) a metric; the value is detached.
    pub fn insert(&mut self, name: &'static str, value: Tensor<1>) {
        let value = value.detach();
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.entries.push((name, value)),
        }
    }
    /// The metric named `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor<1>> {
        self.entries
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v)
    }
    /// Metric names in insertion order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.iter().map(|(n, _)| *n)
    }
    /// Number of metrics.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether there is no metric.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Reads every metric back to the host, all in one read (see [`read_scalars`]).
    pub fn to_f64(&self) -> Vec<(&'static str, f64)> {
        let values: Vec<Tensor<1>> = self.entries.iter().map(|(_, v)| v.clone()).collect();
        self.names().zip(read_scalars(&values)).collect()
    }

    /// The metrics as `(name, tensor)` pairs in insertion order (still on the device).
    pub fn entries(&self) -> impl Iterator<Item = (&'static str, &Tensor<1>)> + '_ {
        self.entries.iter().map(|(n, v)| (*n, v))
    }
}

/// The first element of each tensor as `f64` (read as `f32`), all read back from the device
/// in one read: the tensors are concatenated there first. An empty tensor, or a read that
/// fails, gives NaN.
pub fn read_scalars(values: &[Tensor<1>]) -> Vec<f64> {
    if values.is_empty() {
        return Vec::new();
    }
    let mut starts = Vec::with_capacity(values.len());
    let mut at = 0;
    for v in values {
        let n = v.dims()[0];
        starts.push((at, n));
        at += n;
    }
    let flat: Vec<Tensor<1>> = values
        .iter()
        .map(|v| v.clone().cast(burn::tensor::FloatDType::F32))
        .collect();
    let read = Tensor::cat(flat, 0)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default();
    starts
        .into_iter()
        .map(|(start, n)| {
            (n > 0)
                .then(|| read.get(start))
                .flatten()
                .map_or(f64::NAN, |&v| f64::from(v))
        })
        .collect()
}
