//! `f1`: Miles' `rm_hub/f1.py`, SQuAD-style token F1 in [0, 1] after lower-casing and
//! removing punctuation and articles.

use std::collections::HashMap;
use std::sync::LazyLock;

use miles_core::{Error as CoreError, Result as CoreResult, Reward};
use regex::Regex;

use crate::rule::RuleInput;
use miles_core::python;

static ARTICLES: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(a|an|the)\b").unwrap_or_else(|e| panic!("rm_hub pattern: {e}"))
});

/// `normalize_answer`: lower case, ASCII punctuation removed, articles removed, whitespace
/// collapsed.
pub(crate) fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    let no_articles = ARTICLES.replace_all(&no_punct, " ");
    python::split_whitespace(&no_articles)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `f1_score(prediction, ground_truth)[0]`.
pub fn f1_score(prediction: &str, ground_truth: &str) -> f64 {
    let pred = normalize_answer(prediction);
    let truth = normalize_answer(ground_truth);
    let special = ["yes", "no", "noanswer"];
    if (special.contains(&pred.as_str()) || special.contains(&truth.as_str())) && pred != truth {
        return 0.0;
    }
    let pred_tokens: Vec<&str> = pred.split(' ').filter(|t| !t.is_empty()).collect();
    let truth_tokens: Vec<&str> = truth.split(' ').filter(|t| !t.is_empty()).collect();
    let mut counts: HashMap<&str, (usize, usize)> = HashMap::new();
    for t in &pred_tokens {
        counts.entry(t).or_default().0 += 1;
    }
    for t in &truth_tokens {
        counts.entry(t).or_default().1 += 1;
    }
    let same: usize = counts.values().map(|(a, b)| (*a).min(*b)).sum();
    if same == 0 {
        return 0.0;
    }
    let precision = same as f64 / pred_tokens.len() as f64;
    let recall = same as f64 / truth_tokens.len() as f64;
    (2.0 * precision * recall) / (precision + recall)
}

/// The rule's scoring function (a label is required).
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    let label = input
        .label
        .ok_or_else(|| CoreError::Reward("f1 needs a label".into()))?;
    Ok(Reward::Scalar(f1_score(input.response, label)))
}
