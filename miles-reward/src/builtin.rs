//! miles-rs' own rewards: exact match, numeric match and a lenient math answer checker
//! (`\boxed{…}` or the last number), selectable by name. Miles' rules with Miles' exact
//! semantics (`--rm-type math`, `dapo`, `deepscaler`, `f1`, `gpqa`, …) are the rm_hub
//! ([`crate::RmType`], [`crate::RmHubReward`]).

use miles_core::{Error as CoreError, Result as CoreResult, Reward, RewardFn, Sample, async_trait};
use serde::{Deserialize, Serialize};

/// The built-in rewards, selectable by name (`exact_match`, `numeric_match`, `math`).
///
/// `math` here is miles-rs' lenient checker (it also accepts the last number when there is
/// no `\boxed{}`); Miles' `--rm-type math` is [`crate::RmType`] /
/// [`crate::RmHubReward`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BuiltinReward {
    /// 1 when the response, trimmed, equals the label, trimmed; else 0.
    ExactMatch,
    /// 1 when the last number of the response is within `tolerance` of the label's number.
    NumericMatch {
        /// Absolute tolerance.
        tolerance: f64,
    },
    /// 1 when the final answer — the last `\boxed{…}`, else the last number — equals the label
    /// after normalisation (spaces, `$`, thousands separators, trailing `.0`, `\left`/`\right`
    /// removed; numbers compared numerically).
    Math,
}

/// The label of a sample, or a reward error saying it has none.
fn label(sample: &Sample) -> CoreResult<&str> {
    sample
        .label
        .as_deref()
        .ok_or_else(|| CoreError::Reward(format!("sample {:?} has no label", sample.index)))
}

fn score(ok: bool) -> Reward {
    Reward::Scalar(if ok { 1.0 } else { 0.0 })
}

#[async_trait]
impl RewardFn for BuiltinReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let label = label(sample)?;
        let response = sample.response.as_str();
        Ok(match *self {
            Self::ExactMatch => score(response.trim() == label.trim()),
            Self::NumericMatch { tolerance } => {
                let want = parse_number(label)
                    .ok_or_else(|| CoreError::Reward(format!("label {label:?} is not a number")))?;
                score(last_number(response).is_some_and(|got| (got - want).abs() <= tolerance))
            }
            Self::Math => score(extract_answer(response).is_some_and(|a| answers_equal(&a, label))),
        })
    }
}

/// The content of the last `\boxed{…}` (balanced braces), else the last number in `text`.
pub fn extract_answer(text: &str) -> Option<String> {
    last_boxed(text).or_else(|| last_number_text(text).map(str::to_owned))
}

/// The content of the last `\boxed{…}` / `\fbox{…}`, with nested braces balanced.
pub fn last_boxed(text: &str) -> Option<String> {
    let start = ["\\boxed{", "\\fbox{"]
        .iter()
        .filter_map(|m| text.rfind(m).map(|at| at + m.len()))
        .max()?;
    let mut depth = 1usize;
    for (offset, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[start..start + offset].to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

/// The text of the last number in `text` (optional sign, digits with `,` separators, optional
/// decimals).
fn last_number_text(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut end = None;
    let mut i = bytes.len();
    while i > 0 {
        i -= 1;
        if bytes[i].is_ascii_digit() {
            end = Some(i + 1);
            break;
        }
    }
    let end = end?;
    let mut start = end;
    while start > 0 {
        let c = bytes[start - 1];
        let separator_between_digits = (c == b',' || c == b'.')
            && start >= 2
            && bytes[start - 2].is_ascii_digit()
            && bytes[start].is_ascii_digit();
        if c.is_ascii_digit() || separator_between_digits {
            start -= 1;
        } else {
            break;
        }
    }
    if start > 0 && bytes[start - 1] == b'-' {
        start -= 1;
    }
    Some(&text[start..end])
}

/// The last number of `text` as f64.
pub fn last_number(text: &str) -> Option<f64> {
    last_number_text(text).and_then(parse_number)
}

/// Parses a number written with optional `,` thousands separators, `$`, spaces or a trailing
/// `.`.
pub fn parse_number(text: &str) -> Option<f64> {
    let cleaned: String = text
        .trim()
        .trim_end_matches('.')
        .chars()
        .filter(|c| !matches!(c, ',' | '$' | ' '))
        .collect();
    cleaned.parse::<f64>().ok().filter(|v| v.is_finite())
}

fn normalise(answer: &str) -> String {
    let mut s = answer.trim().to_owned();
    for noise in ["\\left", "\\right", "\\!", "\\,", "$", " ", "\\%", "%"] {
        s = s.replace(noise, "");
    }
    s = s.trim_end_matches('.').to_owned();
    if let Some(inner) = s.strip_prefix("\\text{").and_then(|r| r.strip_suffix('}')) {
        s = inner.to_owned();
    }
    s
}

/// Whether two final answers are the same: numerically when both parse as numbers, else as
/// normalised strings.
pub fn answers_equal(a: &str, b: &str) -> bool {
    let (a, b) = (normalise(a), normalise(b));
    match (parse_number(&a), parse_number(&b)) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;

    fn sample(response: &str, label: Option<&str>) -> Sample {
        Sample {
            response: response.into(),
            label: label.map(str::to_owned),
            prompt: Prompt::Text(String::new()),
            ..Sample::default()
        }
    }

    fn run(reward: BuiltinReward, response: &str, label: Option<&str>) -> CoreResult<Reward> {
        let s = sample(response, label);
        let future = reward.reward(&s);
        let mut future = std::pin::pin!(future);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        match future.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(v) => v,
            std::task::Poll::Pending => unreachable!("built-in rewards never wait"),
        }
    }

    #[test]
    fn boxed_and_last_number_extraction() {
        assert_eq!(
            last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{42}").as_deref(),
            Some("42")
        );
        assert_eq!(
            last_boxed(r"\boxed{\frac{1}{2}}").as_deref(),
            Some(r"\frac{1}{2}")
        );
        assert_eq!(last_boxed(r"\boxed{unclosed"), None);
        assert_eq!(last_number("a 12, then -3.5 apples."), Some(-3.5));
        assert_eq!(last_number("total: 1,234,567"), Some(1_234_567.0));
        assert_eq!(last_number("no digits"), None);
        assert_eq!(
            extract_answer("x = 7 so the answer is 8").as_deref(),
            Some("8")
        );
    }

    #[test]
    fn builtin_rewards_score_as_specified() {
        let one = Reward::Scalar(1.0);
        let zero = Reward::Scalar(0.0);
        assert_eq!(
            run(BuiltinReward::ExactMatch, " Paris\n", Some("Paris")).unwrap(),
            one
        );
        assert_eq!(
            run(BuiltinReward::ExactMatch, "paris", Some("Paris")).unwrap(),
            zero
        );
        let numeric = BuiltinReward::NumericMatch { tolerance: 1e-6 };
        assert_eq!(run(numeric, "it is 1,000.", Some("1000")).unwrap(), one);
        assert_eq!(run(numeric, "it is 999", Some("1000")).unwrap(), zero);
        assert!(run(numeric, "1", Some("one")).is_err());
        assert_eq!(
            run(BuiltinReward::Math, r"so $\boxed{3.0}$", Some("3")).unwrap(),
            one
        );
        assert_eq!(
            run(
                BuiltinReward::Math,
                r"\boxed{\frac{1}{2}}",
                Some(r"\frac{1}{2}")
            )
            .unwrap(),
            one
        );
        assert_eq!(
            run(BuiltinReward::Math, "the sum is 579", Some("579")).unwrap(),
            one
        );
        assert_eq!(
            run(BuiltinReward::Math, "the sum is 578", Some("579")).unwrap(),
            zero
        );
        assert!(matches!(
            run(BuiltinReward::Math, "5", None),
            Err(CoreError::Reward(_))
        ));
    }
}
