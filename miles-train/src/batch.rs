//! Samples → validated training items, optimizer steps and micro-batches.

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use miles_core::{RoutedExperts, Sample};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, TrainConfig};

/// How the samples of one micro-batch are laid out for the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchLayout {
    /// One forward per sample, at its exact length: log-probs are batch-invariant bit for bit
    /// (the default, and what the embedded engine's scoring uses).
    #[default]
    PerSample,
    /// All samples concatenated into one row (varlen): attention stays inside each sample,
    /// positions restart at 0 per sample. Equal to `per_sample` up to float rounding.
    Packed,
    /// One row per sample, right-padded to the longest; padding is never attended to.
    /// Equal to `per_sample` up to float rounding.
    Padded,
}

impl std::str::FromStr for BatchLayout {
    type Err = Error;
    /// `per_sample`, `packed` or `padded` (the serde names).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per_sample" => Ok(Self::PerSample),
            "packed" => Ok(Self::Packed),
            "padded" => Ok(Self::Padded),
            other => Err(Error::Config {
                field: "batch_layout",
                value: other.to_string(),
                reason: "expected per_sample, packed or padded",
            }),
        }
    }
}

/// One sample, checked and converted for training. Vectors over the response cover the last
/// `response_length` entries of `tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainItem {
    /// Prompt + response token ids.
    pub tokens: Vec<u32>,
    /// Number of response tokens at the end of `tokens` (≥ 1, < `tokens.len()`).
    pub response_length: usize,
    /// Loss mask over the response (1 = model-generated, trainable).
    pub loss_mask: Vec<f32>,
    /// Scalar reward (0 for SFT data without one).
    pub reward: f32,
    /// Inference-engine log-probs of the response tokens, if recorded.
    pub rollout_log_probs: Option<Vec<f32>>,
    /// Routing chosen by the engine, `[tokens − 1, layers, top_k]` (R3).
    pub routed_experts: Option<RoutedExperts>,
    /// Prompt group (`group_index`).
    pub group_index: Option<u64>,
    /// Rollout id (`rollout_id`, else `index`).
    pub rollout_id: Option<u64>,
}

impl TrainItem {
    /// Converts `sample` (at position `index` of the batch). A missing reward is an error
    /// unless `require_reward` is false (SFT data).
    pub fn from_sample(
        index: usize,
        sample: &Sample,
        reward_key: Option<&str>,
        require_reward: bool,
    ) -> Result<Self> {
        let bad = |reason: String| Error::Sample { index, reason };
        let n = sample.tokens.len();
        let r = sample.response_length;
        if r == 0 {
            return Err(bad("response_length is 0: nothing to train on".into()));
        }
        if r >= n {
            return Err(bad(format!(
                "response_length {r} leaves no prompt token among {n} tokens"
            )));
        }
        let loss_mask: Vec<f32> = sample
            .effective_loss_mask()
            .into_iter()
            .map(f32::from)
            .collect();
        if loss_mask.len() != r {
            return Err(bad(format!(
                "loss_mask has {} entries, response_length is {r}",
                loss_mask.len()
            )));
        }
        let reward = match sample.scalar_reward(reward_key) {
            Some(v) if v.is_finite() => v as f32,
            Some(v) => return Err(bad(format!("reward {v} is not finite"))),
            None if require_reward => {
                return Err(bad(format!(
                    "no scalar reward{}",
                    reward_key.map_or(String::new(), |k| format!(" under key {k:?}"))
                )));
            }
            None => 0.0,
        };
        let rollout_log_probs = match &sample.rollout_log_probs {
            Some(lp) if lp.len() != r => {
                return Err(bad(format!(
                    "rollout_log_probs has {} entries, response_length is {r}",
                    lp.len()
                )));
            }
            Some(lp) => Some(lp.iter().map(|&v| v as f32).collect()),
            None => None,
        };
        if let Some(routed) = &sample.rollout_routed_experts
            && routed.rows() != n - 1
        {
            return Err(bad(format!(
                "rollout_routed_experts has {} rows, expected tokens - 1 = {}",
                routed.rows(),
                n - 1
            )));
        }
        Ok(Self {
            tokens: sample.tokens.clone(),
            response_length: r,
            loss_mask,
            reward,
            rollout_log_probs,
            routed_experts: sample.rollout_routed_experts.clone(),
            group_index: sample.group_index,
            rollout_id: sample.rollout_id(),
        })
    }

    /// A plain item (tests, SFT): every response token trainable, no rollout data.
    pub fn new(tokens: Vec<u32>, response_length: usize, reward: f32) -> Self {
        Self {
            loss_mask: vec![1.0; response_length],
            tokens,
            response_length,
            reward,
            rollout_log_probs: None,
            routed_experts: None,
            group_index: None,
            rollout_id: None,
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the item has no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// Splits `n` samples into optimizer steps (Miles: `global_batch_size` samples per step, or
/// `n / num_steps_per_rollout`, rounded up). The last step may be smaller.
pub fn plan_steps(
    n: usize,
    global_batch_size: Option<usize>,
    num_steps: Option<usize>,
) -> Vec<Range<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let size = match (global_batch_size, num_steps) {
        (Some(g), _) => g.max(1),
        (None, Some(k)) => n.div_ceil(k.max(1)),
        (None, None) => n,
    };
    (0..n)
        .step_by(size)
        .map(|start| start..(start + size).min(n))
        .collect()
}

/// Splits consecutive samples of `lengths` (token counts) into micro-batches: `micro_batch_size`
/// samples each, or — with `max_tokens` — as many consecutive samples as fit in the token
/// budget (a sample longer than the budget gets a micro-batch of its own).
pub fn plan_micro_batches(
    lengths: &[usize],
    micro_batch_size: usize,
    max_tokens: Option<usize>,
) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut tokens = 0;
    for (i, &len) in lengths.iter().enumerate() {
        let full = match max_tokens {
            Some(budget) => i > start && tokens + len > budget,
            None => i - start >= micro_batch_size.max(1),
        };
        if full {
            out.push(start..i);
            start = i;
            tokens = 0;
        }
        tokens += len;
    }
    if start < lengths.len() {
        out.push(start..lengths.len());
    }
    out
}

/// Divisor of one optimizer step's loss: its sample count (per-sample mode) or its number of
/// trainable tokens (`calculate_per_token_loss`).
pub(crate) fn step_normalizer(items: &[TrainItem], per_token: bool) -> f32 {
    if per_token {
        items
            .iter()
            .map(|i| i.loss_mask.iter().sum::<f32>())
            .sum::<f32>()
            .max(1.0)
    } else {
        items.len() as f32
    }
}

/// The micro-batches of one step's `items` under `config` (fixed size or token budget).
pub(crate) fn micro_batches_of(config: &TrainConfig, items: &[TrainItem]) -> Vec<Range<usize>> {
    let lengths: Vec<usize> = items.iter().map(TrainItem::len).collect();
    let budget = config
        .use_dynamic_batch_size
        .then_some(config.max_tokens_per_gpu)
        .flatten();
    plan_micro_batches(&lengths, config.micro_batch_size, budget)
}

/// Host rows right-padded with zeros to `width`, as a `[rows, width]` tensor.
pub(crate) fn pad_rows(rows: &[&[f32]], width: usize, device: &Device) -> Tensor<2> {
    let mut flat = Vec::with_capacity(rows.len() * width);
    for r in rows {
        flat.extend_from_slice(r);
        flat.extend(std::iter::repeat_n(0.0, width - r.len()));
    }
    Tensor::from_data(TensorData::new(flat, [rows.len(), width]), device)
}

/// A device vector right-padded with zeros to `width`, as a `[1, width]` row.
pub(crate) fn pad_row(t: Tensor<1>, width: usize) -> Tensor<2> {
    let n = t.dims()[0];
    let t = if n < width {
        let device = t.device();
        Tensor::cat(vec![t, Tensor::zeros([width - n], &device)], 0)
    } else {
        t
    };
    t.reshape([1, width])
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Reward;

    #[test]
    fn steps_follow_global_batch_size_or_step_count() {
        assert_eq!(plan_steps(8, Some(4), None), vec![0..4, 4..8]);
        assert_eq!(plan_steps(8, Some(3), Some(99)), vec![0..3, 3..6, 6..8]);
        assert_eq!(plan_steps(8, None, Some(2)), vec![0..4, 4..8]);
        assert_eq!(plan_steps(7, None, Some(2)), vec![0..4, 4..7]);
        assert_eq!(plan_steps(5, None, None), vec![0..5]);
        assert!(plan_steps(0, None, None).is_empty());
    }

    #[test]
    fn micro_batches_by_count_and_by_token_budget() {
        let lens = [10, 20, 30, 40, 5];
        assert_eq!(plan_micro_batches(&lens, 2, None), vec![0..2, 2..4, 4..5]);
        // Budget 50: 10+20 | 30 | 40+5; 30+40 > 50 closes the batch before 40.
        assert_eq!(
            plan_micro_batches(&lens, 1, Some(50)),
            vec![0..2, 2..3, 3..5]
        );
        // An oversized sample gets its own micro-batch.
        assert_eq!(plan_micro_batches(&[100, 1], 1, Some(50)), vec![0..1, 1..2]);
        assert!(plan_micro_batches(&[], 1, None).is_empty());
    }

    #[test]
    fn from_sample_checks_lengths_and_reward() {
        let mut s = Sample {
            tokens: vec![1, 2, 3, 4],
            response_length: 2,
            reward: Some(Reward::Scalar(1.5)),
            ..Sample::default()
        };
        let item = TrainItem::from_sample(0, &s, None, true).unwrap();
        assert_eq!(item.loss_mask, vec![1.0, 1.0]);
        assert_eq!(item.reward, 1.5);

        s.loss_mask = Some(vec![1, 0]);
        assert_eq!(
            TrainItem::from_sample(0, &s, None, true).unwrap().loss_mask,
            vec![1.0, 0.0]
        );
        s.rollout_log_probs = Some(vec![-0.5]);
        let err = TrainItem::from_sample(3, &s, None, true).unwrap_err();
        assert!(matches!(err, Error::Sample { index: 3, .. }), "{err}");
        s.rollout_log_probs = None;
        s.response_length = 4;
        assert!(TrainItem::from_sample(0, &s, None, true).is_err());
        s.response_length = 2;
        s.reward = None;
        assert!(TrainItem::from_sample(0, &s, None, true).is_err());
        assert_eq!(
            TrainItem::from_sample(0, &s, None, false).unwrap().reward,
            0.0
        );
    }
}
