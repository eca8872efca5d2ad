//! How Python prints values: `repr(float)`, `repr(str)`, `repr()` / `str()` of the values
//! `json.loads` produces (`{'a': 1, 'b': True, 'c': None}`), truthiness and `round(x, n)`.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde_json::Value;

/// Python's `repr(float)` (also its `str()`): the shortest digits that round-trip, in
/// positional notation when the decimal exponent is in `-4 ..= 15` (with `.0` when integral),
/// else `d[.ddd]e±XX` with at least two exponent digits; `inf`, `-inf`, `nan`, `-0.0`.
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.into();
    }
    if value == 0.0 {
        return if value.is_sign_negative() {
            "-0.0"
        } else {
            "0.0"
        }
        .into();
    }
    // `{:e}` gives the shortest round-trip digits: `1.2345e-7`.
    let sci = format!("{:e}", value.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::with_capacity(digits.len() + 8);
    if value.is_sign_negative() {
        out.push('-');
    }
    if !(-4..16).contains(&exp) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
        return out;
    }
    if exp < 0 {
        out.push_str("0.");
        for _ in 0..(-exp - 1) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let int_len = exp as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            for _ in digits.len()..int_len {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    }
    out
}

/// Python's `str.isprintable()` for one character, for the characters chat data realistically
/// contains: everything but the control, format and separator characters listed here (space
/// is printable).
fn is_printable(c: char) -> bool {
    let cp = c as u32;
    !(cp < 0x20
        || (0x7f..=0xa0).contains(&cp)
        || cp == 0xad
        || (0x200b..=0x200f).contains(&cp)
        || (0x2028..=0x202e).contains(&cp)
        || (0x2060..=0x2064).contains(&cp)
        || cp == 0x1680
        || (0x2000..=0x200a).contains(&cp)
        || cp == 0x205f
        || cp == 0x3000
        || cp == 0xfeff
        || (0xd800..=0xf8ff).contains(&cp)
        || (0xfff9..=0xfffb).contains(&cp))
}

/// Python's `repr(str)`: single quotes unless the text holds `'` and no `"`; `\\`, `\n`, `\r`,
/// `\t` and the quote escaped; other unprintable characters as `\xXX`, `\uXXXX` or
/// `\UXXXXXXXX`.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
    out
}

/// Python's `repr()` of a value as `json.loads` produced it: `None`, `True` / `False`,
/// integers, floats as [`float_repr`], strings as [`str_repr`], `[1, 2.5]`, `{'k': 'v'}`
/// (keys in the map's order).
pub fn repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => out.push_str(&float_repr(f)),
            _ => {
                let _ = write!(out, "{n}");
            }
        },
        Value::String(s) => out.push_str(&str_repr(s)),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&str_repr(key));
                out.push_str(": ");
                write_repr(out, item);
            }
            out.push('}');
        }
    }
}

/// Python's `str()` of a value as `json.loads` produced it: a string is itself, anything else
/// its [`repr`] (what `"{}".format(value)` and f-strings print).
pub fn str(value: &Value) -> Cow<'_, str> {
    match value {
        Value::String(s) => Cow::Borrowed(s),
        other => Cow::Owned(repr(other)),
    }
}

/// Python's truthiness of a value as `json.loads` produced it (`bool(value)`): `None`,
/// `False`, zero, `""`, `[]` and `{}` are false.
pub fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(map) => !map.is_empty(),
    }
}

/// Python's `round(x, ndigits)` for a float: the float nearest to `x` rounded to `ndigits`
/// decimals, ties to even on the exact binary value (`round(0.25, 1) == 0.2`,
/// `round(2.675, 2) == 2.67`, `round(2.5, 0) == 2.0`); `inf` / `nan` unchanged. Print it with
/// [`float_repr`] to get Python's text.
pub fn round(x: f64, ndigits: u32) -> f64 {
    if !x.is_finite() {
        return x;
    }
    if ndigits == 0 {
        return x.round_ties_even();
    }
    // Beyond this many decimals every double is already exact (CPython returns x as is).
    if ndigits > 323 {
        return x;
    }
    // Rust formats the exact binary value rounded half to even, as CPython's dtoa does; the
    // nearest double to that decimal is Python's result.
    format!("{x:.prec$}", prec = ndigits as usize)
        .parse()
        .unwrap_or(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn float_repr_matches_python() {
        // for f in cases: print(repr(f))   (CPython 3.11)
        let cases = [
            (1e-05, "1e-05"),
            (1e16, "1e+16"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (f64::NAN, "nan"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e15, "1000000000000000.0"),
            (9999999999999998.0, "9999999999999998.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (-2.5e-7, "-2.5e-07"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
            (100.0, "100.0"),
            (2f64.powi(63), "9.223372036854776e+18"),
            (1e22, "1e+22"),
            (1.2345e-07, "1.2345e-07"),
            (0.5, "0.5"),
            (21.5, "21.5"),
            (123456789.0, "123456789.0"),
            (-2.5e-10, "-2.5e-10"),
        ];
        for (value, expected) in cases {
            assert_eq!(float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn round_matches_python() {
        // for x, n in cases: print(repr(round(x, n)))
        let cases = [
            (0.25, 1, "0.2"),
            (0.35, 1, "0.3"),
            (-1.0, 1, "-1.0"),
            (2.675, 2, "2.67"),
            (0.5, 0, "0.0"),
            (1.5, 0, "2.0"),
            (2.5, 0, "2.0"),
            (-2.5, 0, "-2.0"),
            (1e20, 1, "1e+20"),
            (-0.04, 1, "-0.0"),
            (123.456, 2, "123.46"),
            (1e-05, 1, "0.0"),
            (0.125, 2, "0.12"),
            (0.375, 2, "0.38"),
        ];
        for (x, n, expected) in cases {
            assert_eq!(float_repr(round(x, n)), expected, "round({x}, {n})");
        }
        assert_eq!(round(2.5, 0), 2.0);
        assert_eq!(round(3.5, 0), 4.0);
        assert_eq!(round(-2.5, 0), -2.0);
        assert!(round(f64::NAN, 1).is_nan());
        assert_eq!(round(f64::INFINITY, 3), f64::INFINITY);
    }

    #[test]
    fn repr_and_str_match_python() {
        // repr({'a': 1, 'b': True, 'c': None})
        assert_eq!(
            repr(&json!({"a": 1, "b": true, "c": null})),
            "{'a': 1, 'b': True, 'c': None}"
        );
        // Keys in sorted order, so the map order is the same with or without serde_json's
        // `preserve_order`:
        // v = {"arguments": {"big": 1e16, "city": "Zürich", "list": [1, 2.5, True, None, "😀"],
        //      "neg": -0.0, "nested": {"q": "a\"b\\c\n\t\u0001\u007f"}, "temp": 1e-05},
        //      "name": "get_weather"}
        // print(str(v))
        let v = json!({"arguments": {
            "big": 1e16, "city": "Zürich", "list": [1, 2.5, true, null, "😀"], "neg": -0.0,
            "nested": {"q": "a\"b\\c\n\t\u{1}\u{7f}"}, "temp": 1e-05
        }, "name": "get_weather"});
        let ordered = repr(&v);
        assert_eq!(
            ordered,
            r#"{'arguments': {'big': 1e+16, 'city': 'Zürich', 'list': [1, 2.5, True, None, '😀'], 'neg': -0.0, 'nested': {'q': 'a"b\\c\n\t\x01\x7f'}, 'temp': 1e-05}, 'name': 'get_weather'}"#
        );
        assert_eq!(str(&v), ordered);
        assert_eq!(str(&json!("plain")), "plain");
        assert_eq!(str(&json!(null)), "None");
        // repr(["it's", 'a"b', "both'\"", "tab\t\u200b", "é", "\x7f", "😀", 1e-05, -0.0, 1e16, [], {}])
        assert_eq!(
            repr(&json!([
                "it's",
                "a\"b",
                "both'\"",
                "tab\t\u{200b}",
                "é",
                "\u{7f}",
                "😀",
                1e-05,
                -0.0,
                1e16,
                [],
                {}
            ])),
            r#"["it's", 'a"b', 'both\'"', 'tab\t\u200b', 'é', '\x7f', '😀', 1e-05, -0.0, 1e+16, [], {}]"#
        );
    }

    #[test]
    fn truthiness_matches_python() {
        for falsy in [
            json!(null),
            json!(false),
            json!(0),
            json!(0.0),
            json!(""),
            json!([]),
            json!({}),
        ] {
            assert!(!truthy(&falsy), "{falsy}");
        }
        for truthy_value in [
            json!(true),
            json!(-1),
            json!(0.5),
            json!(" "),
            json!([0]),
            json!({"a": null}),
        ] {
            assert!(truthy(&truthy_value), "{truthy_value}");
        }
    }
}
