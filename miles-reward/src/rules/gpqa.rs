//! `gpqa`: Miles' `rm_hub/gpqa.py`, multiple-choice grading from the option letter in the
//! response (or the correct option's text appearing in it), with choices, valid letters and
//! the correct letter optionally given in the sample metadata. 1.0 / 0.0.

use std::sync::LazyLock;

use miles_core::{Error as CoreError, Result as CoreResult, Reward};
use regex::Regex;
use serde_json::{Map, Value};

use crate::rule::RuleInput;
use miles_core::python;

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("rm_hub pattern {pattern:?}: {e}"))
}

static LETTER_PATTERNS: LazyLock<[Regex; 3]> = LazyLock::new(|| {
    [
        re(r"(?i)(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])"),
        re(r"(?i)([A-Z])\s*(?:is\s*(?:the)?\s*correct)"),
        re(r"(?i)final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])"),
    ]
});
static STANDALONE: LazyLock<Regex> = LazyLock::new(|| re(r"\b([A-Z])\b"));
static NON_ALNUM: LazyLock<Regex> = LazyLock::new(|| re(r"[^a-z0-9]+"));

fn strip_chain_of_thought(text: &str) -> &str {
    match text.rsplit_once("</think>") {
        Some((_, after)) => after,
        None => text,
    }
}

fn normalize_text(text: &str) -> String {
    python::strip(&NON_ALNUM.replace_all(&text.to_lowercase(), " ")).to_owned()
}

fn extract_letter(response: &str, valid: &[String]) -> Option<String> {
    if response.is_empty() {
        return None;
    }
    let text = strip_chain_of_thought(response);
    let valid_upper: Vec<String> = valid.iter().map(|l| l.to_uppercase()).collect();
    for pattern in LETTER_PATTERNS.iter() {
        if let Some(m) = pattern.captures(text).and_then(|c| c.get(1)) {
            let letter = m.as_str().to_uppercase();
            if valid_upper.contains(&letter) {
                return Some(letter);
            }
        }
    }
    let candidates: Vec<&str> = STANDALONE
        .captures_iter(text)
        .filter_map(|c| c.get(1).map(|m| m.as_str()))
        .collect();
    candidates
        .iter()
        .rev()
        .map(|l| l.to_uppercase())
        .find(|l| valid_upper.contains(l))
}

/// Python's `str(value)` for the JSON values metadata can hold.
fn py_str(value: &Value) -> String {
    python::str(value).into_owned()
}

/// Why Miles' gpqa rule raises on this metadata.
#[derive(Debug)]
pub(crate) struct BadMetadata(pub(crate) String);

/// `compute_gpqa_reward(response, label, metadata)`.
pub(crate) fn compute_gpqa_reward(
    response: &str,
    label: Option<&str>,
    metadata: &Map<String, Value>,
) -> Result<f64, BadMetadata> {
    let choices: Option<Vec<String>> = match metadata.get("choices") {
        None | Some(Value::Null) => None,
        Some(Value::Object(map)) => Some(map.values().map(py_str).collect()),
        Some(Value::Array(items)) => Some(items.iter().map(py_str).collect()),
        Some(Value::String(s)) => Some(s.chars().map(String::from).collect()),
        Some(other) => return Err(BadMetadata(format!("choices {other} is not iterable"))),
    };
    let has_choices = choices.as_ref().is_some_and(|c| !c.is_empty());
    let valid_letters: Vec<String> = match metadata.get("valid_letters") {
        Some(v) if python::truthy(v) => match v {
            Value::Array(items) => items.iter().map(|l| py_str(l).to_uppercase()).collect(),
            Value::String(s) => s.chars().map(|c| c.to_uppercase().collect()).collect(),
            Value::Object(o) => o.keys().map(|k| k.to_uppercase()).collect(),
            other => {
                return Err(BadMetadata(format!(
                    "valid_letters {other} is not iterable"
                )));
            }
        },
        _ if has_choices => {
            let n = choices.as_ref().map_or(0, Vec::len).min(26);
            ('A'..='Z').take(n).map(String::from).collect()
        }
        _ => ('A'..='H').map(String::from).collect(),
    };
    let mut correct_letter: Option<String> = match metadata.get("correct_letter") {
        Some(Value::String(s)) => Some(python::strip(s).to_uppercase()),
        _ => None,
    };
    let has_correct = |c: &Option<String>| c.as_ref().is_some_and(|s| !s.is_empty());
    let label_text = label.map(|l| python::strip(l).to_owned());
    if let Some(text) = &label_text
        && text.chars().count() == 1
        && valid_letters.contains(&text.to_uppercase())
        && !has_correct(&correct_letter)
    {
        correct_letter = Some(text.to_uppercase());
    }
    let mut correct_answer_default: Option<String> = None;
    if !has_correct(&correct_letter)
        && has_choices
        && let Some(text) = label_text.as_deref().filter(|t| !t.is_empty())
    {
        let normalized_label = normalize_text(text);
        for (idx, choice) in choices.iter().flatten().enumerate() {
            if normalize_text(choice) == normalized_label {
                // `valid_letters[idx]` raises IndexError in Python when there are fewer
                // valid letters than choices.
                correct_letter = Some(
                    valid_letters
                        .get(idx)
                        .cloned()
                        .ok_or_else(|| BadMetadata("fewer valid letters than choices".into()))?,
                );
                if !metadata.contains_key("correct_answer") {
                    correct_answer_default = Some(choice.clone());
                }
                break;
            }
        }
    }
    let extracted = extract_letter(response, &valid_letters);
    let correct = correct_letter.filter(|c| !c.is_empty());
    if let (Some(e), Some(c)) = (&extracted, &correct) {
        return Ok(if e == c { 1.0 } else { 0.0 });
    }
    let mut candidates: Vec<String> = Vec::new();
    if let (Some(c), Some(choices)) = (&correct, choices.as_ref().filter(|c| !c.is_empty()))
        && let Some(idx) = valid_letters.iter().position(|l| l == c)
        && idx < choices.len()
    {
        candidates.push(choices[idx].clone());
    }
    for key in ["correct_answer", "answer_text"] {
        let value = match (key, metadata.get(key)) {
            ("correct_answer", None) => correct_answer_default.clone().map(Value::String),
            (_, v) => v.cloned(),
        };
        if let Some(v) = value.filter(python::truthy) {
            candidates.push(py_str(&v));
        }
    }
    if let Some(text) = label_text.as_deref().filter(|t| !t.is_empty()) {
        candidates.push(text.to_owned());
    }
    let normalized_response = normalize_text(strip_chain_of_thought(response));
    for target in candidates
        .iter()
        .filter(|t| !t.is_empty())
        .map(|t| normalize_text(t))
    {
        if !target.is_empty() && normalized_response.contains(&target) {
            return Ok(1.0);
        }
    }
    if let (Some(e), None, Some(text)) = (
        &extracted,
        &correct,
        label_text.as_deref().filter(|t| !t.is_empty()),
    ) {
        return Ok(if *e == python::strip(text).to_uppercase() {
            1.0
        } else {
            0.0
        });
    }
    Ok(0.0)
}

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    compute_gpqa_reward(input.response, input.label, &input.sample.metadata)
        .map(Reward::Scalar)
        .map_err(|e| CoreError::Reward(format!("gpqa metadata: {}", e.0)))
}
