//! `dapo`: Miles' `rm_hub/math_dapo_utils.py` (DAPO / Minerva): the last `Answer: …` line of
//! the response's last 300 characters, normalised, against the integer label;
//! `{"score": ±1.0, "acc": bool, "pred": str}`.

use std::sync::LazyLock;

use miles_core::{Error as CoreError, Result as CoreResult, Reward};
use regex::Regex;
use serde_json::Map;

use crate::rule::RuleInput;
use miles_core::python;

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("rm_hub pattern {pattern:?}: {e}"))
}

const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED_EXPRESSIONS: &[&str] = &[
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
];

struct Patterns {
    dollars: Regex,
    text: Regex,
    textbf: Regex,
    overline: Regex,
    boxed: Regex,
    frac: Regex,
    sqrt: Regex,
    answer: Regex,
}

static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| Patterns {
    dollars: re(r"(.*?)(\$)(.*?)(\$)(.*)"),
    text: re(r"(\\text\{)(.*?)(\})"),
    textbf: re(r"(\\textbf\{)(.*?)(\})"),
    overline: re(r"(\\overline\{)(.*?)(\})"),
    boxed: re(r"(\\boxed\{)(.*)(\})"),
    frac: re(r"(frac)([^{])(.)"),
    sqrt: re(r"(sqrt)([^{])"),
    answer: re(r"(?i)Answer\s*:\s*([^\n]+)"),
});

/// `normalize_final_answer`.
pub(crate) fn normalize_final_answer(final_answer: &str) -> String {
    let p = &*PATTERNS;
    let mut s = final_answer
        .rsplit('=')
        .next()
        .unwrap_or_default()
        .to_owned();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for expr in REMOVED_EXPRESSIONS {
        s = s.replace(expr, "");
    }
    s = p.dollars.replace_all(&s, "$$${3}$$").into_owned();
    s = p.text.replace_all(&s, "${2}").into_owned();
    s = p.textbf.replace_all(&s, "${2}").into_owned();
    s = p.overline.replace_all(&s, "${2}").into_owned();
    s = p.boxed.replace_all(&s, "${2}").into_owned();
    s = p.frac.replace_all(&s, "frac{${2}}{${3}}").into_owned();
    s = p.sqrt.replace_all(&s, "sqrt{${2}}").into_owned();
    s = s.replace('$', "");
    if python::is_digit_str(&s.replace(',', "")) {
        s = s.replace(',', "");
    }
    python::strip(&s).to_owned()
}

/// What Miles' `dapo` rule returns: `{"score": ±1.0, "acc": bool, "pred": str}`.
#[derive(Debug, Clone, PartialEq)]
pub struct DapoScore {
    /// 1.0 when correct, else -1.0.
    pub score: f64,
    /// Whether the prediction equals the label.
    pub acc: bool,
    /// The normalised prediction (`[INVALID]` normalised when there is no `Answer:` line).
    pub pred: String,
}

/// `compute_score` (Minerva mode, no strict box); `None` where Miles raises: a label that
/// is not a number after normalisation (`int(float(gt))`), or an infinite / NaN one.
pub fn compute_score(solution: &str, ground_truth: &str) -> Option<DapoScore> {
    let solution = python::last_chars(solution, 300);
    let extracted = PATTERNS
        .answer
        .captures_iter(solution)
        .last()
        .and_then(|c| c.get(1))
        .map_or("[INVALID]", |m| m.as_str());
    let pred = normalize_final_answer(extracted);
    let gt = normalize_final_answer(ground_truth);
    let gt = python::int_string(python::float(&gt)?)?;
    let acc = pred == gt;
    Some(DapoScore {
        score: if acc { 1.0 } else { -1.0 },
        acc,
        pred,
    })
}

/// The rule's scoring function (a missing label is Python's `None`, which is no number).
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    let label = input.label.unwrap_or("None");
    let score = compute_score(input.response, label)
        .ok_or_else(|| CoreError::Reward(format!("dapo label {label:?} is not a number")))?;
    let mut map = Map::new();
    map.insert("score".into(), score.score.into());
    map.insert("acc".into(), score.acc.into());
    map.insert("pred".into(), score.pred.into());
    Ok(Reward::Map(map))
}
