//! The training sample: one trajectory with everything the trainer needs (Miles' `Sample`).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::message::Message;
use crate::routed::RoutedExperts;
use crate::weights::WeightVersion;

/// A token id.
pub type TokenId = u32;

/// The prompt of a sample: raw text or chat messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Raw text (already templated, or a completion-style prompt).
    Text(String),
    /// Chat messages to be rendered with the model's chat template.
    Messages(Vec<Message>),
}

impl Default for Prompt {
    fn default() -> Self {
        Self::Text(String::new())
    }
}

/// A reward: a scalar, or a dict of named values (Miles allows both; the trainer reads a key).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Reward {
    /// A single scalar reward.
    Scalar(f64),
    /// Named reward components.
    Map(Map<String, Value>),
}

impl Reward {
    /// The scalar reward: the value itself, or `map[key]` when `key` is given (Miles'
    /// `--reward-key`). `None` when missing or not a number.
    pub fn scalar(&self, key: Option<&str>) -> Option<f64> {
        match (self, key) {
            (Self::Scalar(v), _) => Some(*v),
            (Self::Map(map), Some(key)) => map.get(key).and_then(Value::as_f64),
            (Self::Map(_), None) => None,
        }
    }
}

impl From<f64> for Reward {
    fn from(v: f64) -> Self {
        Self::Scalar(v)
    }
}

/// Where a sample is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SampleStatus {
    /// Not generated yet.
    #[default]
    Pending,
    /// Generation ended normally (stop token / stop string / tool call).
    Completed,
    /// Generation hit a length limit.
    Truncated,
    /// Generation was aborted (explicit abort, weight-update pause, transport failure).
    Aborted,
    /// Generation or reward failed; the reason is in `metadata`.
    Failed,
}

impl SampleStatus {
    /// The status implied by an engine finish reason (`stop`/`tool_calls` → completed,
    /// `length` → truncated, `abort` → aborted), as Miles maps `finish_reason.type`.
    pub fn from_finish_reason(reason: &str) -> Option<Self> {
        match reason {
            "stop" | "tool_calls" => Some(Self::Completed),
            "length" => Some(Self::Truncated),
            "abort" => Some(Self::Aborted),
            _ => None,
        }
    }
}

/// Speculative-decoding counters (summed when samples merge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SpecInfo {
    /// Accepted draft tokens.
    pub spec_accept_token_num: u64,
    /// Drafted tokens.
    pub spec_draft_token_num: u64,
    /// Verification steps.
    pub spec_verify_ct: u64,
    /// Completion tokens.
    pub completion_token_num: u64,
}

/// Prefix-cache counters (summed when samples merge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PrefixCacheInfo {
    /// Prompt tokens served from the cache.
    pub cached_tokens: u64,
    /// Prompt tokens in all.
    pub total_prompt_tokens: u64,
}

/// One trajectory: prompt + response tokens, the per-token training masks and rollout
/// log-probs, the MoE routes, the reward and the weight versions that produced it.
///
/// Field names and defaults follow Miles' `Sample`. The invariants of Miles' `validate()` are
/// checked by [`Sample::validate`], by [`SampleBuilder::build`] and on deserialisation:
/// `response_length ≤ tokens.len()`; `loss_mask`, `rollout_log_probs` and `teacher_log_probs`
/// have `response_length` entries; routed-experts (and indexer) rows equal `tokens.len() − 1`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "SampleWire", into = "SampleWire")]
pub struct Sample {
    /// Index of the prompt group (the `n_samples_per_prompt` samples of one prompt share it).
    pub group_index: Option<u64>,
    /// Global index of the sample.
    pub index: Option<u64>,
    /// Rollout id; `None` means "same as `index`" (see [`Sample::rollout_id`]).
    pub rollout_id: Option<u64>,
    /// The prompt.
    pub prompt: Prompt,
    /// Prompt tokens followed by response tokens.
    pub tokens: Vec<TokenId>,
    /// The decoded response text.
    pub response: String,
    /// Number of response tokens at the end of `tokens`.
    pub response_length: usize,
    /// The reference answer, if any.
    pub label: Option<String>,
    /// The reward, once computed.
    pub reward: Option<Reward>,
    /// 1 for tokens trained on, 0 for masked ones (tool outputs, observations); one entry per
    /// response token. `None` means all ones.
    pub loss_mask: Option<Vec<u8>>,
    /// Weight versions the response was generated with, one per generation call, as strings
    /// (engines report `"7"`, or `"default"` before the first update).
    pub weight_versions: Vec<String>,
    /// Log-probs of the response tokens under the rollout policy.
    pub rollout_log_probs: Option<Vec<f64>>,
    /// MoE expert choices per forwarded position, `[tokens.len() − 1, layers, top_k]`.
    pub rollout_routed_experts: Option<RoutedExperts>,
    /// DeepSeek sparse-attention indexer choices, same row count as routed experts.
    pub rollout_indexer_topk: Option<RoutedExperts>,
    /// Log-probs of the response tokens under a teacher (on-policy distillation).
    pub teacher_log_probs: Option<Vec<f64>>,
    /// Per-token reverse-KL estimate precomputed at rollout (on-policy distillation with
    /// `--opd-log-prob-top-k > 0`; Miles' `opd_reverse_kl`).
    pub opd_reverse_kl: Option<Vec<f64>>,
    /// When true the trainer zeroes this sample's loss mask.
    pub remove_sample: bool,
    /// Lifecycle status.
    pub status: SampleStatus,
    /// Free-form metadata.
    pub metadata: Map<String, Value>,
    /// Sticky routing key sent to the engine router (`X-SMG-Routing-Key`).
    pub routing_key: Option<String>,
    /// Seconds spent outside generation (tool execution), for throughput metrics.
    pub non_generation_time: f64,
    /// Speculative-decoding counters.
    pub spec_info: SpecInfo,
    /// Prefix-cache counters.
    pub prefix_cache_info: PrefixCacheInfo,
}

impl Default for Sample {
    fn default() -> Self {
        Self {
            group_index: None,
            index: None,
            rollout_id: None,
            prompt: Prompt::default(),
            tokens: Vec::new(),
            response: String::new(),
            response_length: 0,
            label: None,
            reward: None,
            loss_mask: None,
            weight_versions: Vec::new(),
            rollout_log_probs: None,
            rollout_routed_experts: None,
            rollout_indexer_topk: None,
            teacher_log_probs: None,
            opd_reverse_kl: None,
            remove_sample: false,
            status: SampleStatus::Pending,
            metadata: Map::new(),
            routing_key: None,
            non_generation_time: 0.0,
            spec_info: SpecInfo::default(),
            prefix_cache_info: PrefixCacheInfo::default(),
        }
    }
}

impl Sample {
    /// Starts a [`SampleBuilder`] for a prompt.
    pub fn builder(prompt: Prompt) -> SampleBuilder {
        SampleBuilder {
            sample: Sample {
                prompt,
                ..Sample::default()
            },
        }
    }

    /// Checks Miles' invariants (see the type's docs).
    pub fn validate(&self) -> Result<()> {
        if self.tokens.len() < self.response_length {
            return Err(Error::SampleLength {
                field: "tokens",
                expected: self.response_length,
                got: self.tokens.len(),
            });
        }
        let per_token: [(&'static str, Option<usize>); 4] = [
            ("loss_mask", self.loss_mask.as_ref().map(Vec::len)),
            (
                "rollout_log_probs",
                self.rollout_log_probs.as_ref().map(Vec::len),
            ),
            (
                "teacher_log_probs",
                self.teacher_log_probs.as_ref().map(Vec::len),
            ),
            ("opd_reverse_kl", self.opd_reverse_kl.as_ref().map(Vec::len)),
        ];
        for (field, len) in per_token {
            if let Some(got) = len
                && got != self.response_length
            {
                return Err(Error::SampleLength {
                    field,
                    expected: self.response_length,
                    got,
                });
            }
        }
        if let Some(mask) = &self.loss_mask
            && let Some(bad) = mask.iter().find(|v| **v > 1)
        {
            return Err(Error::SampleOperation(format!(
                "loss_mask holds {bad}; only 0 and 1 are allowed"
            )));
        }
        let rows = self.tokens.len().saturating_sub(1);
        for (field, table) in [
            ("rollout_routed_experts", &self.rollout_routed_experts),
            ("rollout_indexer_topk", &self.rollout_indexer_topk),
        ] {
            if let Some(table) = table
                && table.rows() != rows
            {
                return Err(Error::SampleLength {
                    field,
                    expected: rows,
                    got: table.rows(),
                });
            }
        }
        Ok(())
    }

    /// The scalar reward (`reward_key` selects a component of dict rewards), or `None` when
    /// there is no usable reward.
    pub fn scalar_reward(&self, reward_key: Option<&str>) -> Option<f64> {
        self.reward.as_ref().and_then(|r| r.scalar(reward_key))
    }

    /// The rollout id, falling back to `index` as Miles does.
    pub fn rollout_id(&self) -> Option<u64> {
        self.rollout_id.or(self.index)
    }

    /// The prompt part of `tokens`.
    pub fn prompt_tokens(&self) -> &[TokenId] {
        &self.tokens[..self.tokens.len() - self.response_length.min(self.tokens.len())]
    }

    /// The response part of `tokens`.
    pub fn response_tokens(&self) -> &[TokenId] {
        &self.tokens[self.tokens.len() - self.response_length.min(self.tokens.len())..]
    }

    /// The loss mask, materialised (all ones when `None`), zeroed when `remove_sample`.
    pub fn effective_loss_mask(&self) -> Vec<u8> {
        if self.remove_sample {
            return vec![0; self.response_length];
        }
        self.loss_mask
            .clone()
            .unwrap_or_else(|| vec![1; self.response_length])
    }

    /// The oldest numeric weight version the sample saw (`None` if none is numeric).
    pub fn oldest_weight_version(&self) -> Option<WeightVersion> {
        self.weight_versions
            .iter()
            .filter_map(|v| v.parse::<WeightVersion>().ok())
            .min()
    }

    /// Appends response tokens produced by one generation call, with their log-probs and a
    /// loss-mask value, keeping every per-token field aligned. `log_probs` must have one entry
    /// per token (or be `None` when the sample records none).
    pub fn append_response(
        &mut self,
        tokens: &[TokenId],
        log_probs: Option<&[f64]>,
        loss_mask: u8,
    ) -> Result<()> {
        if let Some(lp) = log_probs
            && lp.len() != tokens.len()
        {
            return Err(Error::SampleLength {
                field: "rollout_log_probs",
                expected: tokens.len(),
                got: lp.len(),
            });
        }
        if loss_mask > 1 {
            return Err(Error::SampleOperation(format!(
                "loss_mask value {loss_mask}; only 0 and 1 are allowed"
            )));
        }
        let previous = self.response_length;
        self.tokens.extend_from_slice(tokens);
        self.response_length += tokens.len();
        let mask = self.loss_mask.get_or_insert_with(|| vec![1; previous]);
        mask.extend(std::iter::repeat_n(loss_mask, tokens.len()));
        match (log_probs, &mut self.rollout_log_probs) {
            (Some(lp), Some(existing)) => existing.extend_from_slice(lp),
            (Some(lp), None) => {
                let mut all = vec![0.0; previous];
                all.extend_from_slice(lp);
                self.rollout_log_probs = Some(all);
            }
            (None, Some(existing)) => existing.extend(std::iter::repeat_n(0.0, tokens.len())),
            (None, None) => {}
        }
        if let Some(teacher) = &mut self.teacher_log_probs {
            teacher.extend(std::iter::repeat_n(0.0, tokens.len()));
        }
        if let Some(kl) = &mut self.opd_reverse_kl {
            kl.extend(std::iter::repeat_n(0.0, tokens.len()));
        }
        Ok(())
    }

    /// Removes the last `n` response tokens from `tokens` and every per-token field (and the
    /// replay tables), then re-decodes the response with `decode` (Miles'
    /// `strip_last_output_tokens`). `n > response_length` is an error and changes nothing.
    pub fn strip_last_output_tokens(
        &mut self,
        n: usize,
        decode: &dyn Fn(&[TokenId]) -> String,
    ) -> Result<()> {
        if n > self.response_length {
            return Err(Error::SampleOperation(format!(
                "cannot strip {n} tokens from a response of {}",
                self.response_length
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let keep = self.tokens.len() - n;
        // Check the replay tables first so a failure leaves the sample untouched.
        for table in [&self.rollout_routed_experts, &self.rollout_indexer_topk]
            .into_iter()
            .flatten()
        {
            if table.rows() < n {
                return Err(Error::SampleOperation(format!(
                    "replay table has {} rows, cannot strip {n}",
                    table.rows()
                )));
            }
        }
        self.tokens.truncate(keep);
        self.response_length -= n;
        let len = self.response_length;
        if let Some(mask) = &mut self.loss_mask {
            mask.truncate(len);
        }
        if let Some(lp) = &mut self.rollout_log_probs {
            lp.truncate(len);
        }
        if let Some(lp) = &mut self.teacher_log_probs {
            lp.truncate(len);
        }
        if let Some(kl) = &mut self.opd_reverse_kl {
            kl.truncate(len);
        }
        for table in [
            &mut self.rollout_routed_experts,
            &mut self.rollout_indexer_topk,
        ]
        .into_iter()
        .flatten()
        {
            table.strip_last(n)?;
        }
        if let Some(Value::Array(top)) = self.metadata.get_mut("opd_student_top_logprobs") {
            top.truncate(len);
        }
        self.response = decode(self.response_tokens());
        Ok(())
    }

    /// Clears everything generated and marks the sample aborted so it can be generated again;
    /// identity, prompt, label and metadata are kept (Miles' `reset_for_retry`).
    pub fn reset_for_retry(&mut self) {
        let prompt_len = self.tokens.len() - self.response_length.min(self.tokens.len());
        self.tokens.truncate(prompt_len);
        self.response.clear();
        self.response_length = 0;
        self.reward = None;
        self.loss_mask = None;
        self.weight_versions.clear();
        self.rollout_log_probs = None;
        self.rollout_routed_experts = None;
        self.rollout_indexer_topk = None;
        self.teacher_log_probs = None;
        self.opd_reverse_kl = None;
        self.spec_info = SpecInfo::default();
        self.prefix_cache_info = PrefixCacheInfo::default();
        self.non_generation_time = 0.0;
        self.status = SampleStatus::Aborted;
    }
}

/// Builds a [`Sample`] and validates it once at the end.
#[derive(Debug, Clone)]
pub struct SampleBuilder {
    sample: Sample,
}

impl SampleBuilder {
    /// Sets prompt + response tokens and the response length.
    pub fn tokens(mut self, tokens: Vec<TokenId>, response_length: usize) -> Self {
        self.sample.tokens = tokens;
        self.sample.response_length = response_length;
        self
    }

    /// Sets the decoded response.
    pub fn response(mut self, response: impl Into<String>) -> Self {
        self.sample.response = response.into();
        self
    }

    /// Sets the loss mask.
    pub fn loss_mask(mut self, mask: Vec<u8>) -> Self {
        self.sample.loss_mask = Some(mask);
        self
    }

    /// Sets the rollout log-probs.
    pub fn rollout_log_probs(mut self, log_probs: Vec<f64>) -> Self {
        self.sample.rollout_log_probs = Some(log_probs);
        self
    }

    /// Sets the routed experts.
    pub fn routed_experts(mut self, table: RoutedExperts) -> Self {
        self.sample.rollout_routed_experts = Some(table);
        self
    }

    /// Sets group index and index.
    pub fn ids(mut self, group_index: u64, index: u64) -> Self {
        self.sample.group_index = Some(group_index);
        self.sample.index = Some(index);
        self
    }

    /// Sets the label.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.sample.label = Some(label.into());
        self
    }

    /// Sets the reward.
    pub fn reward(mut self, reward: impl Into<Reward>) -> Self {
        self.sample.reward = Some(reward.into());
        self
    }

    /// Sets the status.
    pub fn status(mut self, status: SampleStatus) -> Self {
        self.sample.status = status;
        self
    }

    /// Appends a weight version.
    pub fn weight_version(mut self, version: impl ToString) -> Self {
        self.sample.weight_versions.push(version.to_string());
        self
    }

    /// Sets one metadata entry.
    pub fn metadata(mut self, key: impl Into<String>, value: Value) -> Self {
        self.sample.metadata.insert(key.into(), value);
        self
    }

    /// Validates and returns the sample.
    pub fn build(self) -> Result<Sample> {
        self.sample.validate()?;
        Ok(self.sample)
    }
}

/// Serde shape of [`Sample`]: Miles' field names, defaults for absent fields.
#[derive(Serialize, Deserialize)]
#[serde(default)]
struct SampleWire {
    group_index: Option<u64>,
    index: Option<u64>,
    rollout_id: Option<u64>,
    prompt: Prompt,
    tokens: Vec<TokenId>,
    response: String,
    response_length: usize,
    label: Option<String>,
    reward: Option<Reward>,
    loss_mask: Option<Vec<u8>>,
    weight_versions: Vec<String>,
    rollout_log_probs: Option<Vec<f64>>,
    rollout_routed_experts: Option<RoutedExperts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    rollout_indexer_topk: Option<RoutedExperts>,
    #[serde(skip_serializing_if = "Option::is_none")]
    teacher_log_probs: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    opd_reverse_kl: Option<Vec<f64>>,
    remove_sample: bool,
    status: SampleStatus,
    metadata: Map<String, Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    routing_key: Option<String>,
    non_generation_time: f64,
    spec_info: SpecInfo,
    prefix_cache_info: PrefixCacheInfo,
}

impl Default for SampleWire {
    fn default() -> Self {
        Sample::default().into()
    }
}

impl From<Sample> for SampleWire {
    fn from(s: Sample) -> Self {
        Self {
            group_index: s.group_index,
            index: s.index,
            rollout_id: s.rollout_id,
            prompt: s.prompt,
            tokens: s.tokens,
            response: s.response,
            response_length: s.response_length,
            label: s.label,
            reward: s.reward,
            loss_mask: s.loss_mask,
            weight_versions: s.weight_versions,
            rollout_log_probs: s.rollout_log_probs,
            rollout_routed_experts: s.rollout_routed_experts,
            rollout_indexer_topk: s.rollout_indexer_topk,
            teacher_log_probs: s.teacher_log_probs,
            opd_reverse_kl: s.opd_reverse_kl,
            remove_sample: s.remove_sample,
            status: s.status,
            metadata: s.metadata,
            routing_key: s.routing_key,
            non_generation_time: s.non_generation_time,
            spec_info: s.spec_info,
            prefix_cache_info: s.prefix_cache_info,
        }
    }
}

impl TryFrom<SampleWire> for Sample {
    type Error = Error;

    fn try_from(w: SampleWire) -> Result<Self> {
        let sample = Sample {
            group_index: w.group_index,
            index: w.index,
            rollout_id: w.rollout_id,
            prompt: w.prompt,
            tokens: w.tokens,
            response: w.response,
            response_length: w.response_length,
            label: w.label,
            reward: w.reward,
            loss_mask: w.loss_mask,
            weight_versions: w.weight_versions,
            rollout_log_probs: w.rollout_log_probs,
            rollout_routed_experts: w.rollout_routed_experts,
            rollout_indexer_topk: w.rollout_indexer_topk,
            teacher_log_probs: w.teacher_log_probs,
            opd_reverse_kl: w.opd_reverse_kl,
            remove_sample: w.remove_sample,
            status: w.status,
            metadata: w.metadata,
            routing_key: w.routing_key,
            non_generation_time: w.non_generation_time,
            spec_info: w.spec_info,
            prefix_cache_info: w.prefix_cache_info,
        };
        sample.validate()?;
        Ok(sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn routed(rows: usize) -> RoutedExperts {
        RoutedExperts::new(rows, 1, 2, vec![0; rows * 2]).unwrap()
    }

    fn decode(tokens: &[TokenId]) -> String {
        tokens.iter().map(|t| format!("<{t}>")).collect()
    }

    #[test]
    fn builder_checks_every_invariant() {
        let ok = Sample::builder(Prompt::Text("2+2=".into()))
            .tokens(vec![1, 2, 3, 4, 5], 2)
            .loss_mask(vec![1, 1])
            .rollout_log_probs(vec![-0.5, -0.25])
            .routed_experts(routed(4))
            .build()
            .unwrap();
        assert_eq!(ok.prompt_tokens(), &[1, 2, 3]);
        assert_eq!(ok.response_tokens(), &[4, 5]);

        let short_mask = Sample::builder(Prompt::default())
            .tokens(vec![1, 2, 3], 2)
            .loss_mask(vec![1])
            .build();
        assert!(matches!(
            short_mask,
            Err(Error::SampleLength {
                field: "loss_mask",
                expected: 2,
                got: 1
            })
        ));
        let bad_lp = Sample::builder(Prompt::default())
            .tokens(vec![1, 2, 3], 2)
            .rollout_log_probs(vec![0.0; 3])
            .build();
        assert!(matches!(
            bad_lp,
            Err(Error::SampleLength {
                field: "rollout_log_probs",
                ..
            })
        ));
        let bad_rows = Sample::builder(Prompt::default())
            .tokens(vec![1, 2, 3], 1)
            .routed_experts(routed(3))
            .build();
        assert!(matches!(
            bad_rows,
            Err(Error::SampleLength {
                field: "rollout_routed_experts",
                expected: 2,
                got: 3
            })
        ));
        let too_long = Sample::builder(Prompt::default())
            .tokens(vec![1], 2)
            .build();
        assert!(matches!(
            too_long,
            Err(Error::SampleLength {
                field: "tokens",
                ..
            })
        ));
    }

    #[test]
    fn deserialisation_validates_and_fills_defaults() {
        let sample: Sample = serde_json::from_value(json!({
            "prompt": [{"role": "user", "content": "hi"}],
            "tokens": [7, 8, 9],
            "response_length": 1,
            "status": "truncated",
            "reward": {"acc": 1.0}
        }))
        .unwrap();
        assert_eq!(sample.status, SampleStatus::Truncated);
        assert_eq!(
            sample.reward.as_ref().unwrap().scalar(Some("acc")),
            Some(1.0)
        );
        assert!(matches!(sample.prompt, Prompt::Messages(ref m) if m.len() == 1));
        let bad = serde_json::from_value::<Sample>(json!({
            "tokens": [7, 8, 9], "response_length": 2, "loss_mask": [1]
        }));
        assert!(bad.is_err());
        let round = serde_json::to_value(&sample).unwrap();
        assert_eq!(serde_json::from_value::<Sample>(round).unwrap(), sample);
    }

    #[test]
    fn strip_keeps_fields_aligned() {
        let mut s = Sample::builder(Prompt::default())
            .tokens(vec![1, 2, 3, 4, 5], 3)
            .loss_mask(vec![1, 0, 1])
            .rollout_log_probs(vec![-1.0, -2.0, -3.0])
            .routed_experts(routed(4))
            .build()
            .unwrap();
        s.metadata
            .insert("opd_student_top_logprobs".into(), json!([[1], [2], [3]]));
        assert!(s.strip_last_output_tokens(4, &decode).is_err());
        assert_eq!(s.tokens.len(), 5, "failed strip must not change the sample");
        s.strip_last_output_tokens(2, &decode).unwrap();
        assert_eq!(s.tokens, vec![1, 2, 3]);
        assert_eq!(s.response_length, 1);
        assert_eq!(s.loss_mask, Some(vec![1]));
        assert_eq!(s.rollout_log_probs, Some(vec![-1.0]));
        assert_eq!(s.rollout_routed_experts.as_ref().unwrap().rows(), 2);
        assert_eq!(s.metadata["opd_student_top_logprobs"], json!([[1]]));
        assert_eq!(s.response, "<3>");
        s.validate().unwrap();
    }

    #[test]
    fn append_reset_and_versions() {
        let mut s = Sample::builder(Prompt::default())
            .tokens(vec![1, 2], 0)
            .build()
            .unwrap();
        s.append_response(&[3, 4], Some(&[-0.1, -0.2]), 1).unwrap();
        s.append_response(&[5], None, 0).unwrap();
        assert_eq!(s.loss_mask, Some(vec![1, 1, 0]));
        assert_eq!(s.rollout_log_probs, Some(vec![-0.1, -0.2, 0.0]));
        assert!(s.append_response(&[6], Some(&[]), 1).is_err());
        s.validate().unwrap();
        s.weight_versions = vec!["default".into(), "4".into(), "3".into()];
        assert_eq!(s.oldest_weight_version(), Some(WeightVersion(3)));
        s.reset_for_retry();
        assert_eq!(s.tokens, vec![1, 2]);
        assert_eq!(s.status, SampleStatus::Aborted);
        assert!(s.weight_versions.is_empty());
        s.validate().unwrap();
        assert_eq!(
            SampleStatus::from_finish_reason("tool_calls"),
            Some(SampleStatus::Completed)
        );
        assert_eq!(
            SampleStatus::from_finish_reason("length"),
            Some(SampleStatus::Truncated)
        );
        assert_eq!(SampleStatus::from_finish_reason("weird"), None);
    }

    #[test]
    fn remove_sample_zeroes_the_mask() {
        let mut s = Sample::builder(Prompt::default())
            .tokens(vec![1, 2, 3], 2)
            .build()
            .unwrap();
        assert_eq!(s.effective_loss_mask(), vec![1, 1]);
        s.remove_sample = true;
        assert_eq!(s.effective_loss_mask(), vec![0, 0]);
        assert_eq!(s.rollout_id(), None);
        s.index = Some(9);
        assert_eq!(s.rollout_id(), Some(9));
    }
}
