//! The JSON-object equivalence of Miles' `loose_tool_call` matcher: tool-call arguments
//! compared as JSON objects rather than as text — object keys in any order, insignificant
//! whitespace, numbers compared as exact decimals (`1`, `1.0`, `1e0` and `10e-1` are equal;
//! `1e999` is a number, not an overflow) — while JSON types stay apart (`true` is not `1`,
//! `null` is not `"null"`) and arrays keep their order.
//!
//! Argument text is read by a small JSON reader of its own rather than serde_json, because the
//! equivalence needs each number's exact digits (serde_json rounds them to f64) and must
//! refuse what Python's `json.loads` call in Miles refuses: duplicate keys, `NaN` /
//! `Infinity`, anything but one object. Anything unreadable yields `None`, and the matcher
//! falls back to comparing the raw values.

use miles_core::ToolArguments;
use serde_json::{Map, Number, Value as Json};

/// Deepest nesting read (Python's recursion limit stops Miles' reader near 1,000; anything
/// deeper compares raw here).
const MAX_DEPTH: usize = 512;

/// A JSON value in the matcher's normal form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tagged {
    /// `null`.
    Null,
    /// `true` / `false`.
    Bool(bool),
    /// A string (unescaped).
    Str(String),
    /// A number as an exact decimal: `digits × 10^exponent`, no leading or trailing zero in
    /// `digits` (zero is `("", 0)`, of either sign), `negative` only for a non-zero number.
    Num {
        /// Sign of a non-zero number.
        negative: bool,
        /// Significant digits.
        digits: String,
        /// Power of ten.
        exponent: i64,
    },
    /// An array, in order.
    Arr(Vec<Tagged>),
    /// An object, sorted by key (keys are unique).
    Obj(Vec<(String, Tagged)>),
}

/// The arguments in normal form when they are a JSON object: an object as given, or text
/// holding exactly one JSON object; an empty or all-missing text is the empty object, as in
/// Miles. `None` when the text is not one valid JSON object.
pub(crate) fn normalized_arguments(arguments: &ToolArguments) -> Option<Tagged> {
    match arguments {
        ToolArguments::Object(map) => Some(tag_map(map)),
        ToolArguments::Json(text) if text.is_empty() => Some(Tagged::Obj(Vec::new())),
        ToolArguments::Json(text) => {
            let mut reader = Reader {
                text: text.as_bytes(),
                source: text,
                at: 0,
            };
            reader.skip_ws();
            let value = reader.value(0)?;
            reader.skip_ws();
            (reader.at == reader.text.len() && matches!(value, Tagged::Obj(_))).then_some(value)
        }
    }
}

fn tag_map(map: &Map<String, Json>) -> Tagged {
    let mut entries: Vec<(String, Tagged)> =
        map.iter().map(|(k, v)| (k.clone(), tag_value(v))).collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Tagged::Obj(entries)
}

fn tag_value(value: &Json) -> Tagged {
    match value {
        Json::Null => Tagged::Null,
        Json::Bool(b) => Tagged::Bool(*b),
        Json::String(s) => Tagged::Str(s.clone()),
        Json::Number(n) => tag_number(n),
        Json::Array(items) => Tagged::Arr(items.iter().map(tag_value).collect()),
        Json::Object(map) => tag_map(map),
    }
}

/// An in-memory number: an integer exactly, a float as Python's `str(float)` writes it (the
/// shortest text that reads back as the same double), as Miles' `Decimal(str(value))`.
fn tag_number(n: &Number) -> Tagged {
    let text = match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => i.to_string(),
        (None, Some(u), _) => u.to_string(),
        (None, None, Some(f)) => miles_core::python::float_repr(f),
        _ => n.to_string(),
    };
    decimal(&text).unwrap_or(Tagged::Null)
}

/// Reads a number literal (`-?digits(.digits)?([eE][+-]?digits)?`, also Python's `inf`-free
/// float repr) into its exact decimal normal form.
fn decimal(text: &str) -> Option<Tagged> {
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exp) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], rest[i + 1..].parse::<i64>().ok()?),
        None => (rest, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return None;
    }
    let mut exponent = exp.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let all = format!("{int}{frac}");
    let mut digits = all.trim_start_matches('0').to_string();
    while digits.ends_with('0') {
        digits.pop();
        exponent = exponent.checked_add(1)?;
    }
    if digits.is_empty() {
        return Some(Tagged::Num {
            negative: false,
            digits,
            exponent: 0,
        });
    }
    Some(Tagged::Num {
        negative,
        digits,
        exponent,
    })
}

struct Reader<'a> {
    text: &'a [u8],
    source: &'a str,
    at: usize,
}

impl Reader<'_> {
    fn skip_ws(&mut self) {
        while self
            .text
            .get(self.at)
            .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.text.get(self.at) == Some(&byte) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn literal(&mut self, word: &str, value: Tagged) -> Option<Tagged> {
        let end = self.at + word.len();
        (self.text.get(self.at..end) == Some(word.as_bytes())).then(|| {
            self.at = end;
            value
        })
    }

    fn value(&mut self, depth: usize) -> Option<Tagged> {
        if depth > MAX_DEPTH {
            return None;
        }
        match *self.text.get(self.at)? {
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'"' => self.string().map(Tagged::Str),
            b't' => self.literal("true", Tagged::Bool(true)),
            b'f' => self.literal("false", Tagged::Bool(false)),
            b'n' => self.literal("null", Tagged::Null),
            b'-' | b'0'..=b'9' => self.number(),
            // `NaN`, `Infinity` and anything else: not JSON Miles accepts.
            _ => None,
        }
    }

    fn object(&mut self, depth: usize) -> Option<Tagged> {
        self.at += 1;
        let mut entries: Vec<(String, Tagged)> = Vec::new();
        self.skip_ws();
        if !self.eat(b'}') {
            loop {
                self.skip_ws();
                if self.text.get(self.at) != Some(&b'"') {
                    return None;
                }
                let key = self.string()?;
                self.skip_ws();
                if !self.eat(b':') {
                    return None;
                }
                self.skip_ws();
                let value = self.value(depth + 1)?;
                entries.push((key, value));
                self.skip_ws();
                if self.eat(b'}') {
                    break;
                }
                if !self.eat(b',') {
                    return None;
                }
            }
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        // A duplicate key is an error in Miles' reader.
        if entries.windows(2).any(|w| w[0].0 == w[1].0) {
            return None;
        }
        Some(Tagged::Obj(entries))
    }

    fn array(&mut self, depth: usize) -> Option<Tagged> {
        self.at += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.eat(b']') {
            return Some(Tagged::Arr(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            if self.eat(b']') {
                return Some(Tagged::Arr(items));
            }
            if !self.eat(b',') {
                return None;
            }
        }
    }

    /// A string token, unescaped by serde_json (which refuses raw control characters and
    /// bad escapes, as Python's strict reader does).
    fn string(&mut self) -> Option<String> {
        let start = self.at;
        self.at += 1;
        loop {
            match *self.text.get(self.at)? {
                b'\\' => self.at += 2,
                b'"' => break,
                _ => self.at += 1,
            }
        }
        self.at += 1;
        serde_json::from_str::<String>(self.source.get(start..self.at)?).ok()
    }

    /// A number token in JSON's grammar (`-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`).
    fn number(&mut self) -> Option<Tagged> {
        let start = self.at;
        self.eat(b'-');
        let digits = |r: &mut Self| {
            let from = r.at;
            while r.text.get(r.at).is_some_and(u8::is_ascii_digit) {
                r.at += 1;
            }
            r.at - from
        };
        let int_start = self.at;
        let int = digits(self);
        if int == 0 || (int > 1 && self.text[int_start] == b'0') {
            return None;
        }
        if self.eat(b'.') && digits(self) == 0 {
            return None;
        }
        if self.eat(b'e') || self.eat(b'E') {
            if !self.eat(b'+') {
                self.eat(b'-');
            }
            if digits(self) == 0 {
                return None;
            }
        }
        decimal(self.source.get(start..self.at)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Option<Tagged> {
        normalized_arguments(&ToolArguments::Json(s.into()))
    }

    #[test]
    fn numbers_compare_as_exact_decimals() {
        assert_eq!(decimal("1"), decimal("1.0"));
        assert_eq!(decimal("1e0"), decimal("10e-1"));
        assert_eq!(decimal("1e999"), decimal("10e998"));
        assert_eq!(decimal("-0"), decimal("0.000"));
        assert_ne!(decimal("1"), decimal("-1"));
        assert_ne!(decimal("0.1"), decimal("0.10000000000000001"));
        assert_eq!(
            decimal("1e-05"),
            Some(Tagged::Num {
                negative: false,
                digits: "1".into(),
                exponent: -5
            })
        );
    }

    #[test]
    fn only_one_strict_json_object_is_read() {
        assert!(text(r#" {"a": [1, {"b": null}], "c": "\u00e9"} "#).is_some());
        for bad in [
            "[]",
            "1",
            "{invalid}",
            r#"{"x":1,"x":2}"#,
            r#"{"x":NaN}"#,
            r#"{"x":-Infinity}"#,
            r#"{"x":01}"#,
            r#"{"x":1.}"#,
            r#"{"x":1} extra"#,
            r#"{"x":"unterminated}"#,
            " ",
        ] {
            assert_eq!(text(bad), None, "{bad}");
        }
        assert_eq!(text(""), Some(Tagged::Obj(Vec::new())));
        let deep = format!("{{\"x\":{}0{}}}", "[".repeat(2000), "]".repeat(2000));
        assert_eq!(text(&deep), None);
    }
}
