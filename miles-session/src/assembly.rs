//! Turning session records into training samples (Miles' sample assembly):
//! [`compute_samples_from_records`] (per-turn samples with the trailing-token trim),
//! [`truncate_samples_by_total_tokens`] and [`merge_samples`].

use miles_core::{RoutedExperts, Sample, SampleStatus, TokenId};
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::trajectory::SessionRecord;

/// A decoder from ids to text (the tokenizer's `decode`, special tokens kept).
pub type Decode<'a> = &'a dyn Fn(&[TokenId]) -> String;

/// What one record says about its turn, read from the record's JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordTurn {
    /// `request.input_ids`.
    pub prompt_ids: Vec<TokenId>,
    /// Token ids of `choices[0].meta_info.output_token_logprobs`.
    pub output_ids: Vec<TokenId>,
    /// Their log-probs.
    pub output_log_probs: Vec<f64>,
    /// `choices[0].finish_reason`.
    pub finish_reason: String,
    /// `meta_info.weight_version`, if present.
    pub weight_version: Option<String>,
    /// `meta_info.cached_tokens`.
    pub cached_tokens: u64,
    /// `meta_info.prompt_tokens` (defaults to the prompt length).
    pub prompt_tokens: u64,
    /// `meta_info.routed_experts` (base64 int32), with `routed_experts_num_layers`.
    pub routed_experts: Option<(String, usize)>,
    /// The record's commit time (seconds since the Unix epoch).
    pub timestamp: f64,
    /// When its request arrived.
    pub request_timestamp: Option<f64>,
    /// `meta_info.e2e_latency`: the engine's time for the turn, when reported.
    pub e2e_latency: Option<f64>,
}

fn ids_from(value: &Value, what: &str) -> Result<Vec<TokenId>> {
    let Value::Array(items) = value else {
        return Err(Error::assembly(format!("{what} is not a list")));
    };
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| TokenId::try_from(x).ok())
                .ok_or_else(|| Error::assembly(format!("{what} holds a non-token value {v}")))
        })
        .collect()
}

impl RecordTurn {
    /// Reads a record. Missing or malformed fields are [`Error::Assembly`].
    pub fn from_record(record: &SessionRecord) -> Result<Self> {
        let prompt_ids = match &record.input_ids {
            Some(ids) => ids.clone(),
            None => ids_from(
                record
                    .request
                    .get("input_ids")
                    .ok_or_else(|| Error::assembly("record request has no input_ids"))?,
                "request.input_ids",
            )?,
        };
        let choice = record
            .response
            .get("choices")
            .and_then(|c| c.get(0))
            .ok_or_else(|| Error::assembly("record response has no choices[0]"))?;
        let meta = choice
            .get("meta_info")
            .and_then(Value::as_object)
            .ok_or_else(|| Error::assembly("choices[0] has no meta_info"))?;
        let entries = meta
            .get("output_token_logprobs")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::assembly("meta_info has no output_token_logprobs"))?;
        let mut output_ids = Vec::with_capacity(entries.len());
        let mut output_log_probs = Vec::with_capacity(entries.len());
        for (i, entry) in entries.iter().enumerate() {
            let lp = entry.get(0).and_then(Value::as_f64);
            let id = entry
                .get(1)
                .and_then(Value::as_u64)
                .and_then(|x| TokenId::try_from(x).ok());
            match (lp, id) {
                (Some(lp), Some(id)) => {
                    output_log_probs.push(lp);
                    output_ids.push(id);
                }
                _ => {
                    return Err(Error::assembly(format!(
                        "output_token_logprobs[{i}] = {entry} is not [logprob, token_id, …]"
                    )));
                }
            }
        }
        let finish_reason = match choice.get("finish_reason") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(o)) => o
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("stop")
                .to_owned(),
            _ => "stop".to_owned(),
        };
        let weight_version = match meta.get("weight_version") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Number(n)) => Some(n.to_string()),
            _ => None,
        };
        let routed_experts = match meta.get("routed_experts") {
            Some(Value::String(b64)) => {
                let layers = meta
                    .get("routed_experts_num_layers")
                    .and_then(Value::as_u64)
                    .ok_or_else(|| {
                        Error::assembly(
                            "meta_info.routed_experts without routed_experts_num_layers",
                        )
                    })?;
                Some((b64.clone(), layers as usize))
            }
            _ => None,
        };
        Ok(Self {
            prompt_tokens: meta
                .get("prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(prompt_ids.len() as u64),
            cached_tokens: meta
                .get("cached_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            prompt_ids,
            output_ids,
            output_log_probs,
            finish_reason,
            weight_version,
            routed_experts,
            timestamp: record.timestamp,
            request_timestamp: record.request_timestamp,
            e2e_latency: meta.get("e2e_latency").and_then(Value::as_f64),
        })
    }

    /// Miles' `attach_lifecycle_metadata`: the turn's timing segment, `{"t0", "t1", "turn"}`
    /// (`t1` the commit time, `t0` = `t1 − e2e_latency` or null), with `req_ts` (the request's
    /// arrival) and `prev_t1` (the previous turn's commit) when known. `turn` is 1-based.
    pub fn lifecycle(&self, previous: Option<&RecordTurn>, turn: usize) -> Value {
        let mut segment = Map::new();
        segment.insert(
            "t0".into(),
            self.e2e_latency
                .map_or(Value::Null, |l| json!(self.timestamp - l)),
        );
        segment.insert("t1".into(), json!(self.timestamp));
        segment.insert("turn".into(), json!(turn));
        if let Some(t) = self.request_timestamp {
            segment.insert("req_ts".into(), json!(t));
        }
        if let Some(previous) = previous {
            segment.insert("prev_t1".into(), json!(previous.timestamp));
        }
        Value::Object(segment)
    }
}

/// The status a finish reason implies (`stop`/`tool_calls` → completed, `length` →
/// truncated, `abort` → aborted; anything else completed).
pub fn status_from_finish_reason(reason: &str) -> SampleStatus {
    SampleStatus::from_finish_reason(reason).unwrap_or(SampleStatus::Completed)
}

/// Miles' `compute_samples_from_openai_records`: one sample per record, built on a copy of
/// `template` (identity, prompt, label, metadata).
///
/// With `accumulated` (the session's final token ids), each turn's output is matched against
/// the accumulated sequence at the running cursor; the unmatched tail is trimmed, which may be
/// at most `max_trim_tokens` for a non-final turn and 0 for the final one; after all records
/// the cursor must sit at the end of `accumulated`. Without it, nothing is trimmed.
pub fn compute_samples_from_records(
    template: &Sample,
    records: &[SessionRecord],
    accumulated: Option<&[TokenId]>,
    max_trim_tokens: usize,
    decode: Decode<'_>,
) -> Result<Vec<Sample>> {
    let turns = records
        .iter()
        .map(RecordTurn::from_record)
        .collect::<Result<Vec<_>>>()?;
    compute_samples_from_turns(template, &turns, accumulated, max_trim_tokens, decode)
}

/// [`compute_samples_from_records`] on already-parsed turns.
pub fn compute_samples_from_turns(
    template: &Sample,
    turns: &[RecordTurn],
    accumulated: Option<&[TokenId]>,
    max_trim_tokens: usize,
    decode: Decode<'_>,
) -> Result<Vec<Sample>> {
    let n = turns.len();
    let mut cursor = 0usize;
    let mut samples = Vec::with_capacity(n);
    for (i, turn) in turns.iter().enumerate() {
        let last = i + 1 == n;
        let mut trim = 0usize;
        if let Some(acc) = accumulated {
            cursor = turn.prompt_ids.len();
            let matched = turn
                .output_ids
                .iter()
                .zip(acc.get(cursor..).unwrap_or(&[]))
                .take_while(|(a, b)| a == b)
                .count();
            trim = turn.output_ids.len() - matched;
            let allowed = if last { 0 } else { max_trim_tokens };
            if trim > allowed {
                return Err(Error::assembly(format!(
                    "trim_count {trim} exceeds allowed={allowed} (record {i}, last={last}, output {} tokens, matched {matched})",
                    turn.output_ids.len()
                )));
            }
            cursor += matched;
        }
        let mut tokens = turn.prompt_ids.clone();
        tokens.extend_from_slice(&turn.output_ids);
        let mut sample = template.clone();
        sample.response = decode(&turn.output_ids);
        sample.response_length = turn.output_ids.len();
        sample.loss_mask = Some(vec![1; turn.output_ids.len()]);
        sample.rollout_log_probs = Some(turn.output_log_probs.clone());
        sample.rollout_routed_experts = match &turn.routed_experts {
            Some((b64, layers)) => Some(RoutedExperts::from_base64(
                b64,
                tokens.len().saturating_sub(1),
                *layers,
            )?),
            None => None,
        };
        sample.tokens = tokens;
        sample.status = status_from_finish_reason(&turn.finish_reason);
        if let Some(v) = &turn.weight_version {
            sample.weight_versions.push(v.clone());
        }
        sample.prefix_cache_info.cached_tokens += turn.cached_tokens;
        sample.prefix_cache_info.total_prompt_tokens += turn.prompt_tokens;
        sample.metadata.insert(
            "lifecycle".into(),
            turn.lifecycle(i.checked_sub(1).map(|p| &turns[p]), i + 1),
        );
        sample.validate()?;
        sample.strip_last_output_tokens(trim, decode)?;
        samples.push(sample);
    }
    if let Some(acc) = accumulated
        && n > 0
        && cursor != acc.len()
    {
        return Err(Error::assembly(format!(
            "cursor {cursor} != len(accumulated_token_ids) {} after {n} records",
            acc.len()
        )));
    }
    Ok(samples)
}

/// Miles' `truncate_samples_by_total_tokens`: keeps samples while their token count fits
/// `max_seq_len`; the first that does not is cut to fit (status truncated) if some of its
/// response survives, else dropped, and everything after it is dropped.
pub fn truncate_samples_by_total_tokens(
    samples: Vec<Sample>,
    max_seq_len: usize,
    decode: Decode<'_>,
) -> Result<Vec<Sample>> {
    let mut out = Vec::with_capacity(samples.len());
    for mut sample in samples {
        if sample.tokens.len() <= max_seq_len {
            out.push(sample);
            continue;
        }
        let overshoot = sample.tokens.len() - max_seq_len;
        if sample.response_length > overshoot {
            sample.strip_last_output_tokens(overshoot, decode)?;
            sample.status = SampleStatus::Truncated;
            out.push(sample);
        }
        break;
    }
    Ok(out)
}

/// Metadata keys that may differ between merged samples.
const MERGE_SPECIAL_KEYS: [&str; 3] = ["opd_student_top_logprobs", "lifecycle", "messages"];

fn merge_pair(a: Sample, b: Sample, decode: Decode<'_>) -> Result<Sample> {
    let obs_len = b
        .tokens
        .len()
        .checked_sub(a.tokens.len() + b.response_length)
        .filter(|&v| v > 0)
        .ok_or_else(|| {
            Error::assembly(format!(
                "merge: observation length must be > 0 (a has {} tokens, b has {} with response {})",
                a.tokens.len(),
                b.tokens.len(),
                b.response_length
            ))
        })?;
    if !b.tokens.starts_with(&a.tokens) {
        let at = a
            .tokens
            .iter()
            .zip(&b.tokens)
            .position(|(x, y)| x != y)
            .unwrap_or(0);
        return Err(Error::assembly(format!(
            "merge: tokens of the earlier turn are not a prefix of the later one (first difference at {at})"
        )));
    }
    if !b.prompt_tokens().starts_with(a.prompt_tokens()) {
        return Err(Error::assembly(
            "merge: prompt of the earlier turn is not a prefix of the later one",
        ));
    }
    if a.status != SampleStatus::Completed {
        return Err(Error::assembly(format!(
            "merge: earlier turn has status {:?}, expected completed",
            a.status
        )));
    }
    for (name, x, y) in [
        ("group_index", a.group_index, b.group_index),
        ("index", a.index, b.index),
        ("rollout_id", a.rollout_id, b.rollout_id),
    ] {
        if x != y {
            return Err(Error::assembly(format!(
                "merge: {name} differs ({x:?} vs {y:?})"
            )));
        }
    }
    if a.label != b.label || a.reward != b.reward || a.prompt != b.prompt {
        return Err(Error::assembly("merge: label, reward or prompt differ"));
    }
    for (name, x, y) in [
        (
            "rollout_routed_experts",
            &a.rollout_routed_experts,
            &b.rollout_routed_experts,
        ),
        (
            "rollout_indexer_topk",
            &a.rollout_indexer_topk,
            &b.rollout_indexer_topk,
        ),
    ] {
        if let (Some(x), Some(y)) = (x, y)
            && x.rows() > y.rows()
        {
            return Err(Error::assembly(format!(
                "merge: {name} of the earlier turn has {} rows, more than {}",
                x.rows(),
                y.rows()
            )));
        }
    }
    let strip = |m: &Map<String, Value>| -> Map<String, Value> {
        m.iter()
            .filter(|(k, _)| !MERGE_SPECIAL_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    if strip(&a.metadata) != strip(&b.metadata) {
        return Err(Error::assembly("merge: metadata differs between turns"));
    }
    let mut metadata = b.metadata.clone();
    let concat = |key: &str, fill: Option<Value>| -> Option<Value> {
        let av = a.metadata.get(key);
        let bv = b.metadata.get(key);
        if av.is_none() && bv.is_none() {
            return None;
        }
        let mut out: Vec<Value> = av.and_then(Value::as_array).cloned().unwrap_or_default();
        if let Some(fill) = fill {
            out.extend(std::iter::repeat_n(fill, obs_len));
        }
        out.extend(bv.and_then(Value::as_array).cloned().unwrap_or_default());
        Some(Value::Array(out))
    };
    if let Some(v) = concat("opd_student_top_logprobs", Some(Value::Array(vec![]))) {
        metadata.insert("opd_student_top_logprobs".into(), v);
    }
    // Miles' `_pop_lifecycle`: a turn's segment (an object) or a merged list, concatenated.
    let segments = |v: Option<&Value>| match v {
        None => Vec::new(),
        Some(Value::Array(list)) => list.clone(),
        Some(one) => vec![one.clone()],
    };
    let mut lifecycle = segments(a.metadata.get("lifecycle"));
    lifecycle.extend(segments(b.metadata.get("lifecycle")));
    if !lifecycle.is_empty() {
        metadata.insert("lifecycle".into(), Value::Array(lifecycle));
    }

    let obs_tokens = &b.tokens[a.tokens.len()..a.tokens.len() + obs_len];
    let per_token = |x: Option<Vec<f64>>, y: Option<Vec<f64>>, la: usize, lb: usize| {
        let mut v = x.unwrap_or_else(|| vec![0.0; la]);
        v.extend(std::iter::repeat_n(0.0, obs_len));
        v.extend(y.unwrap_or_else(|| vec![0.0; lb]));
        v
    };
    let (la, lb) = (a.response_length, b.response_length);
    let mut loss_mask = a.loss_mask.clone().unwrap_or_else(|| vec![1; la]);
    loss_mask.extend(std::iter::repeat_n(0u8, obs_len));
    loss_mask.extend(b.loss_mask.clone().unwrap_or_else(|| vec![1; lb]));
    let teacher = if a.teacher_log_probs.is_some() || b.teacher_log_probs.is_some() {
        Some(per_token(
            a.teacher_log_probs.clone(),
            b.teacher_log_probs.clone(),
            la,
            lb,
        ))
    } else {
        None
    };
    let opd_reverse_kl = if a.opd_reverse_kl.is_some() || b.opd_reverse_kl.is_some() {
        Some(per_token(
            a.opd_reverse_kl.clone(),
            b.opd_reverse_kl.clone(),
            la,
            lb,
        ))
    } else {
        None
    };
    let mut weight_versions = a.weight_versions.clone();
    weight_versions.extend(b.weight_versions.iter().cloned());
    let mut spec_info = a.spec_info;
    spec_info.spec_accept_token_num += b.spec_info.spec_accept_token_num;
    spec_info.spec_draft_token_num += b.spec_info.spec_draft_token_num;
    spec_info.spec_verify_ct += b.spec_info.spec_verify_ct;
    spec_info.completion_token_num += b.spec_info.completion_token_num;
    let mut prefix = a.prefix_cache_info;
    prefix.cached_tokens += b.prefix_cache_info.cached_tokens;
    prefix.total_prompt_tokens += b.prefix_cache_info.total_prompt_tokens;
    let response = format!("{}{}{}", a.response, decode(obs_tokens), b.response);
    let merged = Sample {
        response,
        response_length: la + obs_len + lb,
        loss_mask: Some(loss_mask),
        rollout_log_probs: Some(per_token(
            a.rollout_log_probs,
            b.rollout_log_probs.clone(),
            la,
            lb,
        )),
        teacher_log_probs: teacher,
        opd_reverse_kl,
        weight_versions,
        spec_info,
        prefix_cache_info: prefix,
        metadata,
        non_generation_time: a.non_generation_time + b.non_generation_time,
        ..b
    };
    merged.validate()?;
    Ok(merged)
}

/// Miles' `merge_samples`: folds per-turn samples left into one, observation tokens between
/// turns getting loss mask 0 and log-prob 0.0. Extension stops (later turns dropped) when the
/// accumulated sample is not completed, or when it has a replay table and the next turn lacks
/// one. An empty list is an error.
pub fn merge_samples(samples: Vec<Sample>, decode: Decode<'_>) -> Result<Sample> {
    let mut iter = samples.into_iter();
    let mut acc = iter
        .next()
        .ok_or_else(|| Error::assembly("merge_samples needs at least one sample"))?;
    for next in iter {
        if acc.status != SampleStatus::Completed {
            break;
        }
        let lacks =
            |x: &Option<RoutedExperts>, y: &Option<RoutedExperts>| x.is_some() && y.is_none();
        if lacks(&acc.rollout_routed_experts, &next.rollout_routed_experts)
            || lacks(&acc.rollout_indexer_topk, &next.rollout_indexer_topk)
        {
            break;
        }
        acc = merge_pair(acc, next, decode)?;
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn decode(ids: &[TokenId]) -> String {
        ids.iter().map(|i| format!("<{i}>")).collect()
    }

    fn sample(tokens: Vec<TokenId>, response_length: usize, lp: f64) -> Sample {
        let response = decode(&tokens[tokens.len() - response_length..]);
        Sample::builder(Default::default())
            .response(response)
            .tokens(tokens, response_length)
            .loss_mask(vec![1; response_length])
            .rollout_log_probs(vec![lp; response_length])
            .status(SampleStatus::Completed)
            .weight_version(1)
            .build()
            .unwrap()
    }

    #[test]
    fn merge_masks_observation_tokens() {
        // Hand-computed from Miles' sample assembly: tokens [1,2 | 10] then [1,2,10,3,4 | 20,21].
        let a = sample(vec![1, 2, 10], 1, -0.5);
        let b = sample(vec![1, 2, 10, 3, 4, 20, 21], 2, -0.25);
        let merged = merge_samples(vec![a, b], &decode).unwrap();
        assert_eq!(merged.tokens, vec![1, 2, 10, 3, 4, 20, 21]);
        assert_eq!(merged.response_length, 5);
        assert_eq!(merged.loss_mask, Some(vec![1, 0, 0, 1, 1]));
        assert_eq!(
            merged.rollout_log_probs,
            Some(vec![-0.5, 0.0, 0.0, -0.25, -0.25])
        );
        assert_eq!(merged.response, "<10><3><4><20><21>");
        assert_eq!(merged.weight_versions, vec!["1", "1"]);
    }

    #[test]
    fn merge_stops_after_a_non_completed_turn_and_rejects_zero_observation() {
        let mut a = sample(vec![1, 2, 10], 1, -0.5);
        a.status = SampleStatus::Truncated;
        let b = sample(vec![1, 2, 10, 3, 20], 1, -0.25);
        let merged = merge_samples(vec![a.clone(), b], &decode).unwrap();
        assert_eq!(merged, a);
        let c = sample(vec![1, 2, 10], 1, -0.5);
        let d = sample(vec![1, 2, 10, 20], 1, -0.5);
        let err = merge_samples(vec![c, d], &decode).unwrap_err();
        assert!(
            err.to_string().contains("observation length must be > 0"),
            "{err}"
        );
        assert!(merge_samples(vec![], &decode).is_err());
    }

    #[test]
    fn truncation_cuts_the_first_overlong_sample_and_drops_the_rest() {
        let s1 = sample(vec![1, 2, 10], 1, -0.1);
        let s2 = sample(vec![1, 2, 10, 3, 20, 21, 22], 3, -0.1);
        let s3 = sample(vec![1, 2, 10, 3, 20, 21, 22, 4, 30], 1, -0.1);
        let out =
            truncate_samples_by_total_tokens(vec![s1.clone(), s2, s3.clone()], 5, &decode).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], s1);
        assert_eq!(out[1].tokens, vec![1, 2, 10, 3, 20]);
        assert_eq!(out[1].response_length, 1);
        assert_eq!(out[1].status, SampleStatus::Truncated);
        assert_eq!(out[1].response, "<20>");
        // Overshoot ≥ response length: the sample and everything after it are dropped.
        let out = truncate_samples_by_total_tokens(vec![s1.clone(), s3], 7, &decode).unwrap();
        assert_eq!(out, vec![s1]);
    }

    #[test]
    fn record_turn_rejects_malformed_logprob_entries() {
        let record = SessionRecord {
            timestamp: 0.0,
            request_timestamp: None,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request: json!({"input_ids": [1, 2]}),
            input_ids: None,
            response: json!({"choices": [{"meta_info": {"output_token_logprobs": [[-0.1, "x", null]]}}]}),
            status_code: 200,
        };
        assert!(matches!(
            RecordTurn::from_record(&record),
            Err(Error::Assembly { .. })
        ));
    }
}
