//! Samples → validated training items, optimizer steps and micro-batches.

use std::ops::Range;

use burn::tensor::{Device, Tensor, TensorData};
use miles_core::{RoutedExperts, Sample};
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

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
    /// One row per prompt: the samples of the micro-batch whose prompts (the token ids before
    /// the response) are identical share one row `[prompt, response 1, response 2, …]`, rows
    /// right-padded to the longest. The prompt is computed once; each response attends to the
    /// prompt and to its own earlier tokens, never to another response, at the positions it
    /// has in its own sequence (a sliding window is measured by them), and its first token's
    /// log-prob comes from the prompt's last position. GRPO's groups then cost one prompt
    /// each instead of one per sample. Equal to `per_sample` up to float rounding. Not with
    /// linear-attention layers (Qwen3.5's Gated DeltaNet: their recurrent state would run
    /// through the other responses) nor with rollout routing replay (`use_routing_replay`):
    /// both refused when the actor is built.
    SharedPrefix,
}

impl std::str::FromStr for BatchLayout {
    type Err = Error;
    /// `per_sample`, `packed`, `padded` or `shared_prefix` (the serde names).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "per_sample" => Ok(Self::PerSample),
            "packed" => Ok(Self::Packed),
            "padded" => Ok(Self::Padded),
            "shared_prefix" => Ok(Self::SharedPrefix),
            other => Err(Error::Config {
                field: "batch_layout",
                value: other.to_string(),
                reason: "expected per_sample, packed, padded or shared_prefix",
            }),
        }
    }
}

/// The rows of [`BatchLayout::SharedPrefix`]: the items grouped by identical prompt (the
/// token ids before the response), each row the positions of its items in `items`, rows in
/// order of their first item and items in their order.
pub(crate) fn shared_prefix_rows(items: &[&TrainItem]) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut row_of: std::collections::HashMap<&[u32], usize> = std::collections::HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let prompt = &item.tokens[..item.len() - item.response_length];
        match row_of.get(prompt) {
            Some(&r) => rows[r].push(i),
            None => {
                row_of.insert(prompt, rows.len());
                rows.push(vec![i]);
            }
        }
    }
    rows
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
    /// Teacher log-probs of the response tokens (on-policy distillation), if scored.
    pub teacher_log_probs: Option<Vec<f32>>,
    /// Precomputed per-token reverse KL (top-k on-policy distillation), if any.
    pub opd_reverse_kl: Option<Vec<f32>>,
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
                return Err(bad(match (&sample.reward, reward_key) {
                    (Some(miles_core::Reward::Map(map)), None) => format!(
                        "the reward is a dict with keys [{}]: name the one to train on with \
                         --reward-key KEY (TrainConfig::reward_key)",
                        map.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                    (Some(miles_core::Reward::Map(map)), Some(key)) => format!(
                        "the reward dict has no number under --reward-key {key:?}; its keys: [{}]",
                        map.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                    _ => format!(
                        "no scalar reward{}",
                        reward_key.map_or(String::new(), |k| format!(" under key {k:?}"))
                    ),
                }));
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
        let per_token = |field: &str, values: &Option<Vec<f64>>| match values {
            Some(v) if v.len() != r => Err(bad(format!(
                "{field} has {} entries, response_length is {r}",
                v.len()
            ))),
            Some(v) => Ok(Some(v.iter().map(|&x| x as f32).collect::<Vec<f32>>())),
            None => Ok(None),
        };
        let teacher_log_probs = per_token("teacher_log_probs", &sample.teacher_log_probs)?;
        let opd_reverse_kl = per_token("opd_reverse_kl", &sample.opd_reverse_kl)?;
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
            teacher_log_probs,
            opd_reverse_kl,
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
            teacher_log_probs: None,
            opd_reverse_kl: None,
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

/// Whether two items share a rollout id (per-turn siblings of one rollout, Miles'
/// `--generate-multi-samples`). Items without a rollout id are rollouts of their own.
pub fn has_siblings(items: &[TrainItem]) -> bool {
    let mut ids: Vec<u64> = items.iter().filter_map(|i| i.rollout_id).collect();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    ids.len() != n
}

/// The items' rollouts in order of first appearance, each as the positions of its items
/// (items without a rollout id are rollouts of their own).
pub fn rollouts_of(items: &[TrainItem]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut slot_of: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for (i, item) in items.iter().enumerate() {
        match item.rollout_id {
            Some(id) => match slot_of.get(&id) {
                Some(&slot) => out[slot].push(i),
                None => {
                    slot_of.insert(id, out.len());
                    out.push(vec![i]);
                }
            },
            None => out.push(vec![i]),
        }
    }
    out
}

/// Miles' `_compute_rollout_mask_sums`: for every item, the loss-mask total of its whole
/// rollout (the sum over all its siblings), so that the per-sample reduction divided by it
/// gives one token-weighted mean per rollout even when siblings land in different
/// micro-batches.
pub fn rollout_mask_sums(items: &[TrainItem]) -> Vec<f32> {
    let mut out = vec![0f32; items.len()];
    for rollout in rollouts_of(items) {
        let total: f32 = rollout
            .iter()
            .map(|&i| items[i].loss_mask.iter().sum::<f32>())
            .sum();
        for i in rollout {
            out[i] = total;
        }
    }
    out
}

/// Splits items whose siblings are contiguous (see [`rollouts_of`]) into optimizer steps of
/// whole rollouts: `global_batch_size` counts rollouts, not samples (Miles' per-rollout
/// schedule), or the rollouts are split into `num_steps` steps, rounded up. The last step may
/// be smaller. An error if the siblings of a rollout are not contiguous.
pub fn plan_rollout_steps(
    items: &[TrainItem],
    global_batch_size: Option<usize>,
    num_steps: Option<usize>,
) -> Result<Vec<Range<usize>>> {
    let rollouts = rollouts_of(items);
    let mut bounds = Vec::with_capacity(rollouts.len());
    let mut next = 0;
    for rollout in &rollouts {
        let contiguous = rollout.iter().enumerate().all(|(k, &i)| i == next + k);
        if !contiguous {
            return Err(Error::Sample {
                index: rollout[0],
                reason: "the samples of a rollout must be contiguous to plan steps".into(),
            });
        }
        bounds.push(next..next + rollout.len());
        next += rollout.len();
    }
    Ok(plan_steps(rollouts.len(), global_batch_size, num_steps)
        .into_iter()
        .map(|r| bounds[r.start].start..bounds[r.end - 1].end)
        .collect())
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
    fn layouts_parse_by_their_serde_names() {
        for (name, layout) in [
            ("per_sample", BatchLayout::PerSample),
            ("packed", BatchLayout::Packed),
            ("padded", BatchLayout::Padded),
            ("shared_prefix", BatchLayout::SharedPrefix),
        ] {
            assert_eq!(name.parse::<BatchLayout>().unwrap(), layout);
            assert_eq!(
                serde_json::to_string(&layout).unwrap(),
                format!("\"{name}\"")
            );
        }
        let err = "shared".parse::<BatchLayout>().unwrap_err().to_string();
        assert!(err.contains("shared_prefix"), "{err}");
    }

    #[test]
    fn shared_prefix_rows_group_identical_prompts_in_order() {
        let mk = |prompt: &[u32], response: &[u32]| {
            TrainItem::new(
                prompt.iter().chain(response).copied().collect(),
                response.len(),
                0.0,
            )
        };
        let items = [
            mk(&[1, 2], &[3]),
            mk(&[4], &[5, 6]),
            mk(&[1, 2], &[7, 8]),
            // Same tokens as item 0, another split: another prompt.
            mk(&[1], &[2, 3]),
            mk(&[4], &[9]),
            mk(&[1, 2], &[3]),
        ];
        let refs: Vec<&TrainItem> = items.iter().collect();
        assert_eq!(
            shared_prefix_rows(&refs),
            vec![vec![0, 2, 5], vec![1, 4], vec![3]]
        );
        assert!(shared_prefix_rows(&[]).is_empty());
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

    fn item(rollout_id: Option<u64>, mask: &[u8]) -> TrainItem {
        let mut item = TrainItem::new(vec![0; mask.len() + 1], mask.len(), 0.0);
        item.loss_mask = mask.iter().map(|&m| f32::from(m)).collect();
        item.rollout_id = rollout_id;
        item
    }

    /// Miles' `_compute_rollout_mask_sums` on the cases of `fixtures/train/rollout_cases.json`
    /// (run by `fixtures/train/gen_rollout_cases.py`). Miles' loss masks may be empty; ours
    /// have at least one response token, so an empty mask is skipped with its expected sum
    /// checked to be that of the rest.
    #[test]
    fn rollout_mask_sums_match_miles() {
        let cases: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../fixtures/train/rollout_cases.json"
            ))
            .expect("fixtures/train/rollout_cases.json"),
        )
        .unwrap();
        let cases = cases["mask_sums"].as_array().unwrap();
        assert_eq!(cases.len(), 3);
        for case in cases {
            let ids = case["rollout_ids"].as_array().unwrap();
            let masks = case["loss_masks"].as_array().unwrap();
            let expected = case["expected"].as_array().unwrap();
            let mut items = Vec::new();
            let mut want = Vec::new();
            for ((id, mask), e) in ids.iter().zip(masks).zip(expected) {
                let mask: Vec<u8> = serde_json::from_value(mask.clone()).unwrap();
                if mask.is_empty() {
                    continue;
                }
                items.push(item(id.as_u64(), &mask));
                want.push(e.as_f64().unwrap() as f32);
            }
            assert_eq!(rollout_mask_sums(&items), want, "{case}");
        }
    }

    #[test]
    fn siblings_stay_together_and_steps_count_rollouts() {
        let items = vec![
            item(Some(10), &[1, 1]),
            item(Some(10), &[1]),
            item(Some(11), &[1]),
            item(None, &[1]),
            item(Some(12), &[1]),
            item(Some(12), &[1]),
            item(Some(12), &[1]),
        ];
        assert!(has_siblings(&items));
        assert!(!has_siblings(&items[2..4]));
        assert_eq!(
            rollouts_of(&items),
            vec![vec![0, 1], vec![2], vec![3], vec![4, 5, 6]]
        );
        // Two rollouts per step: [10, 11] and [None, 12].
        assert_eq!(
            plan_rollout_steps(&items, Some(2), None).unwrap(),
            vec![0..3, 3..7]
        );
        assert_eq!(
            plan_rollout_steps(&items, Some(3), None).unwrap(),
            vec![0..4, 4..7]
        );
        assert_eq!(
            plan_rollout_steps(&items, None, Some(2)).unwrap(),
            vec![0..3, 3..7]
        );
        assert_eq!(plan_rollout_steps(&items, None, None).unwrap(), vec![0..7]);
        // Siblings apart cannot be planned.
        let apart = vec![
            item(Some(1), &[1]),
            item(Some(2), &[1]),
            item(Some(1), &[1]),
        ];
        assert!(plan_rollout_steps(&apart, Some(1), None).is_err());
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

    #[test]
    fn a_dict_reward_without_a_key_names_the_keys_and_the_flag() {
        // Miles' dapo rule returns {score, acc, pred}.
        let reward: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"score": 1.0, "acc": true, "pred": "42"}"#).unwrap();
        let s = Sample {
            tokens: vec![1, 2, 3, 4],
            response_length: 2,
            reward: Some(Reward::Map(reward)),
            ..Sample::default()
        };
        let err = TrainItem::from_sample(0, &s, None, true)
            .unwrap_err()
            .to_string();
        // (Key order follows serde_json's map: sorted, or insertion order with
        // `preserve_order`.)
        assert!(err.contains("the reward is a dict with keys ["), "{err}");
        for key in ["score", "acc", "pred"] {
            assert!(err.contains(key), "{key}: {err}");
        }
        assert!(err.contains("--reward-key KEY"), "{err}");
        let err = TrainItem::from_sample(0, &s, Some("acc"), true)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no number under --reward-key \"acc\""),
            "{err}"
        );
        assert_eq!(
            TrainItem::from_sample(0, &s, Some("score"), true)
                .unwrap()
                .reward,
            1.0
        );
    }
}
