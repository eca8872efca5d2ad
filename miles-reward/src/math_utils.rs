//! Miles' `rm_hub/math_utils.py` (itself from DeepScaleR / Hendrycks' MATH): `\boxed{}`
//! extraction, the MATH ("mathd") normaliser, the sympy grader's normaliser and its
//! equivalence check (through `sympy_lite`), `grade_answer_verl` (the `math` rule) and the
//! grading step `deepscaler` and `gemma_math` share.

use std::sync::LazyLock;

use miles_core::python;
use miles_core::{Error as CoreError, Result as CoreResult};
use regex::Regex;

use crate::{latex2text, sympy_lite};

fn re(pattern: &str) -> Regex {
    // The patterns are constants of this file; a failure is a bug here, caught by every test.
    Regex::new(pattern).unwrap_or_else(|e| panic!("rm_hub pattern {pattern:?}: {e}"))
}

/// `last_boxed_only_string`: the last `\boxed…` (else `\fbox…`) up to its balancing `}`.
pub(crate) fn last_boxed_only_string(s: &str) -> Option<&str> {
    let idx = s.rfind("\\boxed").or_else(|| s.rfind("\\fbox"))?;
    let mut open: i64 = 0;
    for (offset, b) in s.as_bytes()[idx..].iter().enumerate() {
        match b {
            b'{' => open += 1,
            b'}' => {
                open -= 1;
                if open == 0 {
                    return Some(&s[idx..idx + offset + 1]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `remove_boxed`: the inside of `\boxed{…}`, `None` when it is not of that shape.
pub(crate) fn remove_boxed(s: &str) -> Option<&str> {
    s.strip_prefix("\\boxed{")?.strip_suffix('}')
}

/// `extract_answer`: the content of the last `\boxed{}`; `None` without `\boxed` or when it
/// is not a complete `\boxed{…}`.
pub fn extract_answer(passage: &str) -> Option<&str> {
    if passage.contains("\\boxed") {
        last_boxed_only_string(passage).and_then(remove_boxed)
    } else {
        None
    }
}

static TEXT_WRAPPED: LazyLock<Regex> = LazyLock::new(|| re(r"^\\text\{(?P<text>.+?)\}\n?\z"));

/// Python `$` (no MULTILINE) matches at the end or before a final newline: the patterns above
/// spell that as `\n?\z`.
fn text_unwrapped(s: &str) -> Option<&str> {
    TEXT_WRAPPED
        .captures(s)
        .and_then(|c| c.name("text"))
        .map(|m| m.as_str())
}

/// `mathd_normalize_answer`.
pub(crate) fn mathd_normalize_answer(answer: &str) -> String {
    let mut answer = python::strip(answer);
    if let Some(text) = text_unwrapped(answer) {
        answer = python::strip(text);
    }
    strip_string(answer).unwrap_or_else(|()| answer.to_owned())
}

fn fix_fracs(string: &str) -> Result<String, ()> {
    let mut parts = string.split("\\frac");
    let mut new = parts.next().unwrap_or_default().to_owned();
    for sub in parts {
        new.push_str("\\frac");
        let mut chars = sub.chars();
        let first = chars.next().ok_or(())?; // IndexError in Python
        if first == '{' {
            new.push_str(sub);
            continue;
        }
        let Some(second) = chars.next() else {
            return Ok(string.to_owned());
        };
        let rest = chars.as_str();
        if second != '{' {
            new.push('{');
            new.push(first);
            new.push_str("}{");
            new.push(second);
            new.push('}');
            new.push_str(rest);
        } else {
            new.push('{');
            new.push(first);
            new.push('}');
            new.push(second);
            new.push_str(rest);
        }
    }
    Ok(new)
}

fn is_canonical_int(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'))
        && s != "-0"
}

fn fix_a_slash_b(string: &str) -> String {
    let mut parts = string.split('/');
    let (Some(a), Some(b), None) = (parts.next(), parts.next(), parts.next()) else {
        return string.to_owned();
    };
    if is_canonical_int(a) && is_canonical_int(b) {
        format!("\\frac{{{a}}}{{{b}}}")
    } else {
        string.to_owned()
    }
}

fn fix_sqrt(string: &str) -> Result<String, ()> {
    if !string.contains("\\sqrt") {
        return Ok(string.to_owned());
    }
    let mut parts = string.split("\\sqrt");
    let mut new = parts.next().unwrap_or_default().to_owned();
    for split in parts {
        let first = split.chars().next().ok_or(())?;
        if first != '{' {
            new.push_str("\\sqrt{");
            new.push(first);
            new.push('}');
            new.push_str(&split[first.len_utf8()..]);
        } else {
            new.push_str("\\sqrt");
            new.push_str(split);
        }
    }
    Ok(new)
}

/// `_strip_string`; `Err` where Python raises (the caller then keeps the answer).
fn strip_string(string: &str) -> Result<String, ()> {
    let mut s = string.replace('\n', "");
    s = s.replace("\\!", "");
    s = s.replace("\\\\", "\\");
    s = s.replace("tfrac", "frac").replace("dfrac", "frac");
    s = s.replace("\\left", "").replace("\\right", "");
    s = s.replace("^{\\circ}", "").replace("^\\circ", "");
    s = s.replace("\\$", "");
    if s.contains("\\text{ ") {
        let mut splits = s.split("\\text{ ");
        let (Some(first), Some(_), None) = (splits.next(), splits.next(), splits.next()) else {
            return Err(()); // assert len(splits) == 2
        };
        s = first.to_owned();
    }
    s = s.replace("\\%", "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Ok(s);
    }
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    {
        let mut eq = s.split('=');
        if let (Some(lhs), Some(rhs), None) = (eq.next(), eq.next(), eq.next())
            && lhs.chars().count() <= 2
        {
            s = rhs.to_owned();
        }
    }
    s = fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".into();
    }
    Ok(fix_a_slash_b(&s))
}

const UNITS: &[&str] = &[
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
];

static UNIT_RES: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    UNITS
        .iter()
        .map(|u| re(&format!(r"{u}(es)?(s)? *(\^[0-9]+)?")))
        .collect()
});
static CIRC: LazyLock<Regex> = LazyLock::new(|| re(r"\^ *\\circ"));
static THIN_COMMA: LazyLock<Regex> = LazyLock::new(|| re(r",\\! *"));
static MINUS_SPACES: LazyLock<Regex> = LazyLock::new(|| re(r"- *"));
static MIXED: LazyLock<Regex> = LazyLock::new(|| re(r"([0-9]) +([0-9])"));

fn is_int_float(x: f64) -> bool {
    x.is_finite() && (x - python::round(x, 0)).abs() <= 1e-7
}

/// `_strip_properly_formatted_commas`: the `(\d)(,)(\d\d\d)($|\D)` substitution repeated to a
/// fixed point (each pass as `re.sub` scans: left to right, non-overlapping). Bounded: at most
/// 64 passes (a pass that removes nothing ends it; real inputs need two or three).
pub(crate) fn strip_properly_formatted_commas(expr: &str) -> String {
    let mut current: Vec<char> = expr.chars().collect();
    for _ in 0..64 {
        let mut out = Vec::with_capacity(current.len());
        let mut i = 0;
        let mut changed = false;
        while i < current.len() {
            let c = current[i];
            let matches = c.is_numeric_digit()
                && current.get(i + 1) == Some(&',')
                && (2..5).all(|k| current.get(i + k).is_some_and(|d| d.is_numeric_digit()))
                && current.get(i + 5).is_none_or(|d| !d.is_numeric_digit());
            if matches {
                out.push(c);
                out.extend_from_slice(&current[i + 2..i + 5]);
                if let Some(&d) = current.get(i + 5) {
                    out.push(d);
                }
                i += 6;
                changed = true;
            } else {
                out.push(c);
                i += 1;
            }
        }
        current = out;
        if !changed {
            break;
        }
    }
    current.into_iter().collect()
}

/// Python's `\d` in a str pattern: any Unicode decimal digit.
trait NumericDigit {
    fn is_numeric_digit(&self) -> bool;
}

impl NumericDigit for char {
    fn is_numeric_digit(&self) -> bool {
        python::decimal_digit(*self).is_some()
    }
}

fn str_is_int(x: &str) -> bool {
    python::float(&strip_properly_formatted_commas(x)).is_some_and(is_int_float)
}

fn str_to_int(x: &str) -> Option<String> {
    python::float(&x.replace(',', "")).and_then(python::int_string)
}

fn parse_latex(expr: &str) -> Result<String, latex2text::Raised> {
    let expr = expr
        .replace("\\tfrac", "\\frac")
        .replace("\\dfrac", "\\frac")
        .replace("\\frac", " \\frac");
    let expr = latex2text::latex_to_text(&expr)?
        .replace('\u{221a}', "sqrt")
        .replace('\u{3c0}', "pi")
        .replace('\u{221e}', "inf")
        .replace('\u{222a}', "U")
        .replace(['\u{b7}', '\u{d7}'], "*");
    Ok(python::strip(&expr).to_owned())
}

/// `_normalize` of the sympy grader.
pub(crate) fn normalize(expr: &str) -> String {
    let mut expr = match text_unwrapped(expr) {
        Some(text) => text.to_owned(),
        None => expr.to_owned(),
    };
    expr = expr.replace("\\%", "%").replace("\\$", "$");
    expr = expr.replace(['$', '%'], "");
    expr = expr.replace(" or ", " , ").replace(" and ", " , ");
    expr = expr
        .replace("million", "*10^6")
        .replace("billion", "*10^9")
        .replace("trillion", "*10^12");
    for unit in UNIT_RES.iter() {
        expr = unit.replace_all(&expr, "").into_owned();
    }
    expr = CIRC.replace_all(&expr, "").into_owned();
    if expr.starts_with('{') && expr.ends_with('}') {
        let mut chars = expr.chars();
        chars.next();
        chars.next_back();
        expr = chars.as_str().to_owned();
    }
    expr = THIN_COMMA.replace_all(&expr, "").into_owned();
    if let Some(x) = python::float(&expr)
        && is_int_float(x)
        && let Some(s) = python::int_string(python::round(x, 0))
    {
        expr = s;
    }
    if expr.contains('\\')
        && let Ok(parsed) = parse_latex(&expr)
    {
        expr = parsed;
    }
    expr = MINUS_SPACES.replace_all(&expr, "-").into_owned();
    expr = MIXED.replace_all(&expr, "$1+$2").into_owned();
    expr = expr.replace(' ', "").replace(['{', '}'], "");
    expr = expr.to_lowercase();
    if str_is_int(&expr)
        && let Some(s) = str_to_int(&expr)
    {
        expr = s;
    }
    expr
}

static BAD_REGEXES: LazyLock<[Regex; 2]> =
    LazyLock::new(|| [re(r"\^[0-9]+\^"), re(r"\^[0-9][0-9]+")]);

fn should_allow_eval(expr: &str) -> bool {
    let stripped = expr.replace("sqrt", "").replace("frac", "");
    let mut letters: Vec<char> = stripped.chars().filter(|c| python::is_alpha(*c)).collect();
    letters.sort_unstable();
    letters.dedup();
    if letters.len() > 2 {
        return false;
    }
    if expr.contains("^{") || expr.contains("^(") {
        return false;
    }
    !BAD_REGEXES.iter().any(|r| r.is_match(expr))
}

fn are_equal_under_sympy(ground_truth: &str, given: &str) -> bool {
    let expr = format!("({ground_truth})-({given})");
    should_allow_eval(&expr) && sympy_lite::difference_is_zero(ground_truth, given)
}

const TUPLE_CHARS: &[char] = &['(', ')', '[', ']'];

fn split_tuple(expr: &str) -> Vec<String> {
    let expr = strip_properly_formatted_commas(expr);
    if expr.is_empty() {
        return Vec::new();
    }
    let chars: Vec<char> = expr.chars().collect();
    if chars.len() > 2
        && TUPLE_CHARS.contains(&chars[0])
        && TUPLE_CHARS.contains(&chars[chars.len() - 1])
        && !chars[1..chars.len() - 1]
            .iter()
            .any(|c| TUPLE_CHARS.contains(c))
    {
        let inner: String = chars[1..chars.len() - 1].iter().collect();
        inner
            .split(',')
            .map(|e| python::strip(e).to_owned())
            .collect()
    } else {
        vec![expr]
    }
}

static FRAC: LazyLock<Regex> = LazyLock::new(|| re(r"^-?[0-9]+.?/0*[1-9][0-9]*.?\n?\z"));

/// `grade_answer_sympy`.
pub(crate) fn grade_answer_sympy(given_answer: &str, ground_truth: &str) -> bool {
    let truth = normalize(ground_truth);
    let given = normalize(given_answer);
    if truth == given {
        return true;
    }
    if given.is_empty() {
        return false;
    }
    let truth_elems = split_tuple(&truth);
    let given_elems = split_tuple(&given);
    if truth_elems.len() > 1
        && (truth.chars().next() != given.chars().next()
            || truth.chars().next_back() != given.chars().next_back())
    {
        return false;
    }
    if truth_elems.len() != given_elems.len() {
        return false;
    }
    let mut is_correct = false; // Python leaves it unset for empty tuples: only `()`-like
    for (t, g) in truth_elems.iter().zip(&given_elems) {
        is_correct = if FRAC.is_match(t) && FRAC.is_match(g) {
            t == g
        } else if str_is_int(t) != str_is_int(g) {
            false
        } else {
            are_equal_under_sympy(t, g)
        };
        if !is_correct {
            break;
        }
    }
    is_correct
}

/// `grade_answer_mathd`.
pub(crate) fn grade_answer_mathd(given_answer: &str, ground_truth: &str) -> bool {
    mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)
}

/// `grade_answer_verl`: Miles' `math` rule. `ground_truth` `None` or empty scores false.
pub fn grade_answer_verl(solution: &str, ground_truth: Option<&str>) -> bool {
    let Some(truth) = ground_truth.filter(|t| !t.is_empty()) else {
        return false;
    };
    let truth = if truth.contains("\\boxed") {
        extract_answer(truth)
    } else {
        Some(truth)
    };
    let Some(given) = extract_answer(solution) else {
        return false;
    };
    // A ground truth whose `\boxed` cannot be extracted becomes None in Python: mathd
    // compares None with a string (false) and the sympy grader returns false.
    let Some(truth) = truth else {
        return false;
    };
    grade_answer_mathd(given, truth) || grade_answer_sympy(given, truth)
}

/// `deepscaler`'s grading of the text after the reasoning (shared by `gemma_math`): the last
/// `\boxed{}` of `solution` against the label (itself unboxed when it holds a `\boxed`),
/// equal under the MATH normaliser or the sympy grader. 0 without a `\boxed{}` answer or with
/// an empty label; an error without a label.
pub(crate) fn grade_boxed_solution(solution: &str, label: Option<&str>) -> CoreResult<f64> {
    let Some(given) = extract_answer(solution) else {
        return Ok(0.0);
    };
    let Some(label) = label else {
        return Err(CoreError::Reward("deepscaler needs a label".into()));
    };
    if label.is_empty() {
        return Ok(0.0);
    }
    let truth = if label.contains("\\boxed") {
        match extract_answer(label) {
            Some(t) => t,
            None => return Ok(0.0),
        }
    } else {
        label
    };
    let ok = grade_answer_mathd(given, truth) || grade_answer_sympy(given, truth);
    Ok(if ok { 1.0 } else { 0.0 })
}
