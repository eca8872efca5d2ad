//! Append-only token trajectories, loss masks and per-turn samples (Miles' runtime prefix
//! check, `LinearTrajectory` token state, and the token part of its sample assembly and
//! `merge_samples`).
//!
//! A [`TokenTrajectory`] holds the exact ids of a session: each turn's prompt (stored prefix
//! plus template-rendered appendix) followed by the ids the model generated. Its only
//! mutator is [`TokenTrajectory::extend`], which enforces the runtime prefix assertion; a
//! rollback produces a new value ([`TokenTrajectory::rolled_back`]).

use serde::Serialize;

use crate::error::{Error, Result};

/// One generated turn: the prompt it was generated from and the completion length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TurnSpan {
    /// Length of the prompt (ids before the completion) for this turn.
    pub prompt_len: usize,
    /// Number of generated ids.
    pub completion_len: usize,
}

/// The ids of a multi-turn session, append-only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenTrajectory {
    ids: Vec<u32>,
    loss_mask: Vec<u8>,
    turns: Vec<TurnSpan>,
    checkpoints: Vec<Checkpoint>,
    max_trim_tokens: usize,
}

/// What is needed to restore the state after a turn: its length and the last
/// `max_trim_tokens` ids and mask entries, which a later prompt may have replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Checkpoint {
    len: usize,
    tail_ids: Vec<u32>,
    tail_mask: Vec<u8>,
}

/// `assert_pretokenized_prefix`: `new` must agree with `prev` on its first
/// `len(prev) - max_trim_tokens` ids.
pub fn assert_pretokenized_prefix(prev: &[u32], new: &[u32], max_trim_tokens: usize) -> Result<()> {
    let check_len = prev.len().saturating_sub(max_trim_tokens);
    if check_len == 0 {
        return Ok(());
    }
    let limit = check_len.min(new.len());
    let first_diff = (0..limit).find(|&i| prev[i] != new[i]);
    match first_diff {
        Some(index) => Err(Error::PrefixMismatch {
            index,
            stored_len: prev.len(),
            new_len: new.len(),
            checked: check_len,
        }),
        None if new.len() < check_len => Err(Error::PrefixMismatch {
            index: new.len(),
            stored_len: prev.len(),
            new_len: new.len(),
            checked: check_len,
        }),
        None => Ok(()),
    }
}

impl TokenTrajectory {
    /// An empty trajectory whose prompts may drop up to `max_trim_tokens` trailing stored ids
    /// (1 for GLM-4.7, else 0).
    pub fn new(max_trim_tokens: usize) -> Self {
        Self {
            max_trim_tokens,
            ..Self::default()
        }
    }

    /// Appends one turn: `prompt_ids` must extend the stored ids (up to the allowed trim) and
    /// `completion_ids` are what the model generated. Loss mask: 1 on generated ids, 0 on
    /// everything the template added.
    pub fn extend(&mut self, prompt_ids: &[u32], completion_ids: &[u32]) -> Result<()> {
        let mut new = Vec::with_capacity(prompt_ids.len() + completion_ids.len());
        new.extend_from_slice(prompt_ids);
        new.extend_from_slice(completion_ids);
        assert_pretokenized_prefix(&self.ids, &new, self.max_trim_tokens)?;
        let kept = self
            .ids
            .iter()
            .zip(prompt_ids)
            .take_while(|(a, b)| a == b)
            .count();
        self.loss_mask.truncate(kept);
        self.loss_mask.resize(prompt_ids.len(), 0);
        self.loss_mask.resize(new.len(), 1);
        let tail_start = new.len().saturating_sub(self.max_trim_tokens);
        self.checkpoints.push(Checkpoint {
            len: new.len(),
            tail_ids: new[tail_start..].to_vec(),
            tail_mask: self.loss_mask[tail_start..].to_vec(),
        });
        self.ids = new;
        self.turns.push(TurnSpan {
            prompt_len: prompt_ids.len(),
            completion_len: completion_ids.len(),
        });
        Ok(())
    }

    /// The trajectory as it was before its last turn (one-step assistant rollback). Fails
    /// when there is no turn.
    pub fn rolled_back(&self) -> Result<Self> {
        if self.turns.is_empty() {
            return Err(Error::Trajectory("no assistant turn to roll back".into()));
        }
        let keep = self.turns.len() - 1;
        let mut out = Self {
            ids: Vec::new(),
            loss_mask: Vec::new(),
            turns: self.turns[..keep].to_vec(),
            checkpoints: self.checkpoints[..keep].to_vec(),
            max_trim_tokens: self.max_trim_tokens,
        };
        if let Some(cp) = out.checkpoints.last() {
            let head = cp.len - cp.tail_ids.len();
            out.ids = self.ids[..head].to_vec();
            out.ids.extend_from_slice(&cp.tail_ids);
            out.loss_mask = self.loss_mask[..head].to_vec();
            out.loss_mask.extend_from_slice(&cp.tail_mask);
        }
        Ok(out)
    }

    /// All ids.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The merged loss mask (1 = model-generated id still present in the trajectory).
    pub fn loss_mask(&self) -> &[u8] {
        &self.loss_mask
    }

    /// The turns.
    pub fn turns(&self) -> &[TurnSpan] {
        &self.turns
    }

    /// Number of generated turns.
    pub fn num_turns(&self) -> usize {
        self.turns.len()
    }

    /// Allowed trailing trim.
    pub fn max_trim_tokens(&self) -> usize {
        self.max_trim_tokens
    }
}

/// One generated turn as recorded by the session server: the prompt sent and the ids
/// returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnRecord {
    /// Prompt ids (`input_ids`).
    pub prompt: Vec<u32>,
    /// Generated ids.
    pub output: Vec<u32>,
}

/// A per-turn training sample (tokens, response length, loss mask over the response).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnSample {
    /// Prompt ⊕ kept output ids.
    pub tokens: Vec<u32>,
    /// Number of kept output ids.
    pub response_length: usize,
    /// One entry per response id (all 1: every kept output id is trainable).
    pub loss_mask: Vec<u8>,
}

/// `compute_samples_from_openai_records`' token part: one sample per record, with
/// trailing stop ids that the next prompt does not keep trimmed (at most `max_trim_tokens`,
/// none on the last record), checked against the session's accumulated ids.
pub fn turn_samples(
    records: &[TurnRecord],
    accumulated: Option<&[u32]>,
    max_trim_tokens: usize,
) -> Result<Vec<TurnSample>> {
    let mut out = Vec::with_capacity(records.len());
    let mut cursor_end = 0usize;
    for (i, record) in records.iter().enumerate() {
        let last = i + 1 == records.len();
        let mut trim = 0usize;
        if let Some(acc) = accumulated {
            let cursor = record.prompt.len();
            let matched = record
                .output
                .iter()
                .enumerate()
                .take_while(|(j, id)| acc.get(cursor + j) == Some(id))
                .count();
            trim = record.output.len() - matched;
            let allowed = if last { 0 } else { max_trim_tokens };
            if trim > allowed {
                return Err(Error::Trajectory(format!(
                    "trim_count {trim} exceeds allowed={allowed} (record {i})"
                )));
            }
            cursor_end = cursor + matched;
        }
        let kept = record.output.len() - trim;
        let mut tokens = record.prompt.clone();
        tokens.extend_from_slice(&record.output[..kept]);
        out.push(TurnSample {
            tokens,
            response_length: kept,
            loss_mask: vec![1; kept],
        });
    }
    if let Some(acc) = accumulated
        && cursor_end != acc.len()
    {
        return Err(Error::Trajectory(format!(
            "cursor {cursor_end} != len(accumulated_token_ids) {}",
            acc.len()
        )));
    }
    Ok(out)
}

/// Merges per-turn samples into one (`merge_samples`, token part): tokens of the last,
/// loss mask `a ⊕ 0^obs ⊕ b` where `obs` are the ids the template added between turns.
pub fn merge_turn_samples(samples: &[TurnSample]) -> Result<TurnSample> {
    let mut iter = samples.iter();
    let Some(first) = iter.next() else {
        return Err(Error::Trajectory("no samples to merge".into()));
    };
    let prompt_len = first.tokens.len() - first.response_length;
    let mut acc = first.clone();
    for b in iter {
        let b_prompt_len = b.tokens.len() - b.response_length;
        if b_prompt_len <= acc.tokens.len() || b.tokens[..acc.tokens.len()] != acc.tokens[..] {
            return Err(Error::Trajectory(format!(
                "sample of {} tokens does not extend the merged {} tokens with new observation tokens",
                b.tokens.len(),
                acc.tokens.len()
            )));
        }
        let obs = b_prompt_len - acc.tokens.len();
        acc.loss_mask.extend(std::iter::repeat_n(0, obs));
        acc.loss_mask.extend_from_slice(&b.loss_mask);
        acc.response_length += obs + b.response_length;
        acc.tokens = b.tokens.clone();
    }
    debug_assert_eq!(acc.tokens.len() - prompt_len, acc.response_length);
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_assertion_with_trim() {
        assert!(assert_pretokenized_prefix(&[], &[1], 0).is_ok());
        assert!(assert_pretokenized_prefix(&[1, 2, 99], &[1, 2, 3], 1).is_ok());
        let err = assert_pretokenized_prefix(&[1, 2, 99], &[1, 2, 3], 0).unwrap_err();
        assert!(matches!(
            err,
            Error::PrefixMismatch {
                index: 2,
                checked: 3,
                ..
            }
        ));
        let err = assert_pretokenized_prefix(&[1, 2, 3], &[1], 0).unwrap_err();
        assert!(matches!(err, Error::PrefixMismatch { index: 1, .. }));
    }

    #[test]
    fn glm_style_loss_mask_and_rollback() {
        // Miles' worked example of sample assembly: STOP = 99 is dropped and re-rendered by the template.
        let mut t = TokenTrajectory::new(1);
        t.extend(&[1, 2, 3], &[10, 99]).unwrap();
        t.extend(&[1, 2, 3, 10, 4, 5, 6], &[20, 99]).unwrap();
        t.extend(&[1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9], &[30, 99])
            .unwrap();
        assert_eq!(t.ids(), &[1, 2, 3, 10, 4, 5, 6, 20, 7, 8, 9, 30, 99]);
        assert_eq!(t.loss_mask(), &[0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 1]);
        let back = t.rolled_back().unwrap();
        // Turn 2's stop token, replaced by turn 3's prompt, is restored.
        assert_eq!(back.ids(), &[1, 2, 3, 10, 4, 5, 6, 20, 99]);
        assert_eq!(back.loss_mask(), &[0, 0, 0, 1, 0, 0, 0, 1, 1]);
        assert_eq!(back.num_turns(), 2);
        assert_eq!(back.rolled_back().unwrap().ids(), &[1, 2, 3, 10, 99]);
        assert!(
            back.rolled_back()
                .unwrap()
                .rolled_back()
                .unwrap()
                .ids()
                .is_empty()
        );
        assert!(TokenTrajectory::new(0).rolled_back().is_err());
        // A prompt that rewrites history is rejected and leaves the trajectory untouched.
        let before = t.clone();
        assert!(t.extend(&[1, 2, 4], &[5]).is_err());
        assert_eq!(t, before);
    }
}
