//! Token-sequence comparator and session mismatch metric.
//!
//! Compares the tokens a session accumulated with a canonical re-tokenization of its
//! messages. Both sequences lose their trailing stop ids, are cut into segments (each
//! special id alone, runs of ordinary ids together), and aligned segment by segment. One
//! algorithm serves a HF tokenizer ([`TokenSeqComparator`]) and any
//! [`ChatTokenizer`](crate::ChatTokenizer) (its default `compare_sequences`).

use std::collections::BTreeSet;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use crate::error::Result;
use crate::hf;

/// The kind of a token-sequence mismatch (Miles' comparator types; also the metric suffixes
/// of `tito_session_mismatch_rate/…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MismatchType {
    /// The segment structures differ (count or special/content pattern).
    SpecialTokenCount,
    /// Aligned special tokens differ.
    SpecialTokenType,
    /// Text outside assistant content differs.
    NonAssistantText,
    /// Assistant content differs (tolerated: inherited tokens may differ from canonical
    /// tokenization).
    AssistantText,
}

impl MismatchType {
    /// All types, in Miles' order.
    pub const ALL: [MismatchType; 4] = [
        Self::SpecialTokenCount,
        Self::SpecialTokenType,
        Self::NonAssistantText,
        Self::AssistantText,
    ];

    /// Miles' (snake-case) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SpecialTokenCount => "special_token_count",
            Self::SpecialTokenType => "special_token_type",
            Self::NonAssistantText => "non_assistant_text",
            Self::AssistantText => "assistant_text",
        }
    }
}

/// One mismatch between the canonical and the session token sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    /// The kind.
    #[serde(rename = "type")]
    pub kind: MismatchType,
    /// Index of the differing segment, or -1 for a structural mismatch.
    pub segment_index: i64,
    /// Text of the expected side (segment text or structure description).
    pub expected_text: String,
    /// Text of the actual side.
    pub actual_text: String,
    /// Human-readable detail.
    pub detail: String,
}

/// What the comparator reads from a tokenizer: the segment-boundary ids, the trailing ids
/// stripped first, the text that opens an assistant turn, and the text of ids.
pub(crate) trait TokenView {
    /// Whether `id` is a segment boundary (a special token).
    fn is_special(&self, id: u32) -> bool;
    /// Whether `id` is stripped from the end of both sequences before comparing.
    fn is_trailing(&self, id: u32) -> bool;
    /// The text that opens an assistant turn (`None`: assistant text cannot be classified).
    fn assistant_start(&self) -> Option<&str>;
    /// The text of `ids`, special tokens included.
    fn decode(&self, ids: &[u32]) -> Result<String>;
}

/// A run of ordinary ids, or one special id.
#[derive(Debug, Clone, Copy)]
struct Segment<'a> {
    special: bool,
    ids: &'a [u32],
}

fn segments<'a, V: TokenView + ?Sized>(view: &V, ids: &'a [u32]) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &id) in ids.iter().enumerate() {
        if view.is_special(id) {
            if start < i {
                out.push(Segment {
                    special: false,
                    ids: &ids[start..i],
                });
            }
            out.push(Segment {
                special: true,
                ids: &ids[i..=i],
            });
            start = i + 1;
        }
    }
    if start < ids.len() {
        out.push(Segment {
            special: false,
            ids: &ids[start..],
        });
    }
    out
}

fn strip<'a, V: TokenView + ?Sized>(view: &V, mut ids: &'a [u32]) -> &'a [u32] {
    while let Some((last, rest)) = ids.split_last() {
        if view.is_trailing(*last) {
            ids = rest;
        } else {
            break;
        }
    }
    ids
}

fn describe<V: TokenView + ?Sized>(view: &V, segments: &[Segment<'_>]) -> Result<String> {
    let mut parts = Vec::with_capacity(segments.len());
    for seg in segments {
        if seg.special {
            parts.push(format!("[{}]", view.decode(seg.ids)?));
        } else {
            parts.push(format!("({} tokens)", seg.ids.len()));
        }
    }
    Ok(parts.join(" "))
}

fn is_assistant_content<V: TokenView + ?Sized>(
    view: &V,
    segments: &[Segment<'_>],
    index: usize,
) -> Result<bool> {
    let Some(start) = view.assistant_start() else {
        return Ok(false);
    };
    if index == 0 || !segments[index - 1].special {
        return Ok(false);
    }
    let head = &segments[index].ids[..segments[index].ids.len().min(20)];
    let text = view.decode(segments[index - 1].ids)? + &view.decode(head)?;
    Ok(text.starts_with(start))
}

/// `compare_sequences(expected, actual)` over any [`TokenView`]: every mismatch, or an empty
/// list. Both sequences lose their trailing ids, are cut into segments and aligned.
pub(crate) fn compare_with<V: TokenView + ?Sized>(
    view: &V,
    expected: &[u32],
    actual: &[u32],
) -> Result<Vec<Mismatch>> {
    let exp = segments(view, strip(view, expected));
    let act = segments(view, strip(view, actual));
    let same_shape =
        exp.len() == act.len() && exp.iter().zip(&act).all(|(a, b)| a.special == b.special);
    if !same_shape {
        return Ok(vec![Mismatch {
            kind: MismatchType::SpecialTokenCount,
            segment_index: -1,
            expected_text: describe(view, &exp)?,
            actual_text: describe(view, &act)?,
            detail: format!(
                "segment structure differs: expected {} segments, actual {}",
                exp.len(),
                act.len()
            ),
        }]);
    }
    let mut out = Vec::new();
    for (i, (e, a)) in exp.iter().zip(&act).enumerate() {
        if e.ids == a.ids {
            continue;
        }
        let expected_text = view.decode(e.ids)?;
        let actual_text = view.decode(a.ids)?;
        if e.special {
            out.push(Mismatch {
                kind: MismatchType::SpecialTokenType,
                segment_index: i as i64,
                detail: format!("special token {expected_text:?} != {actual_text:?}"),
                expected_text,
                actual_text,
            });
            continue;
        }
        if expected_text == actual_text {
            // Same text, different tokenization of it: not a mismatch Miles reports
            // (content is compared by decoded text).
            continue;
        }
        let assistant =
            is_assistant_content(view, &exp, i)? && is_assistant_content(view, &act, i)?;
        out.push(Mismatch {
            kind: if assistant {
                MismatchType::AssistantText
            } else {
                MismatchType::NonAssistantText
            },
            segment_index: i as i64,
            detail: format!(
                "content segment {i} differs ({} vs {} tokens)",
                e.ids.len(),
                a.ids.len()
            ),
            expected_text,
            actual_text,
        });
    }
    Ok(out)
}

/// Compares token sequences of a HF tokenizer (Miles' `TokenSeqComparator`).
#[derive(Debug, Clone)]
pub struct TokenSeqComparator {
    tokenizer: Arc<Tokenizer>,
    special_ids: BTreeSet<u32>,
    trim_trailing_ids: BTreeSet<u32>,
    assistant_start_str: Option<String>,
}

impl TokenSeqComparator {
    /// A comparator with explicit segment-boundary ids, trailing ids to strip, and the text
    /// that opens assistant turns (`None`: assistant text cannot be classified).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        special_ids: BTreeSet<u32>,
        trim_trailing_ids: BTreeSet<u32>,
        assistant_start_str: Option<String>,
    ) -> Self {
        Self {
            tokenizer,
            special_ids,
            trim_trailing_ids,
            assistant_start_str,
        }
    }

    /// `compare_sequences(expected, actual)`: every mismatch, or an empty list.
    pub fn compare(&self, expected: &[u32], actual: &[u32]) -> Result<Vec<Mismatch>> {
        compare_with(self, expected, actual)
    }
}

impl TokenView for TokenSeqComparator {
    fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    fn is_trailing(&self, id: u32) -> bool {
        self.trim_trailing_ids.contains(&id)
    }

    fn assistant_start(&self) -> Option<&str> {
        self.assistant_start_str.as_deref()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        hf::decode(&self.tokenizer, ids)
    }
}

/// The session mismatch metric over many samples: `rate` = fraction of samples with at
/// least one mismatch; `per_type[t]` = fraction with at least one mismatch of type `t`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MismatchMetric {
    /// Samples that carried a mismatch list.
    pub samples: usize,
    /// Fraction with any mismatch.
    pub rate: f64,
    /// Fraction per type, in [`MismatchType::ALL`] order.
    pub per_type: Vec<(MismatchType, f64)>,
}

impl MismatchMetric {
    /// Aggregates per-sample mismatch lists (samples without a list are not passed in).
    pub fn from_samples<'a>(samples: impl IntoIterator<Item = &'a [Mismatch]>) -> Option<Self> {
        let mut n = 0usize;
        let mut any = 0usize;
        let mut per = [0usize; 4];
        for mismatches in samples {
            n += 1;
            if !mismatches.is_empty() {
                any += 1;
            }
            for (k, kind) in MismatchType::ALL.iter().enumerate() {
                if mismatches.iter().any(|m| m.kind == *kind) {
                    per[k] += 1;
                }
            }
        }
        if n == 0 {
            return None;
        }
        Some(Self {
            samples: n,
            rate: any as f64 / n as f64,
            per_type: MismatchType::ALL
                .iter()
                .zip(per)
                .map(|(kind, count)| (*kind, count as f64 / n as f64))
                .collect(),
        })
    }

    /// Metric names and values as Miles logs them under `prefix`
    /// (e.g. `tito_session_mismatch_rate/v1`).
    pub fn to_named(&self, prefix: &str) -> Vec<(String, f64)> {
        let mut out = vec![(prefix.to_owned(), self.rate)];
        for (kind, value) in &self.per_type {
            out.push((format!("{prefix}/{}", kind.as_str()), *value));
        }
        out
    }
}
