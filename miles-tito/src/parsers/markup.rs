//! Text helpers shared by the tool-call formats: Python's `json.dumps` spelling of arguments,
//! tag scanning (`OPEN(.*?)CLOSE` bodies, the earliest of several markers, `ATTR="VALUE"`
//! attributes), Python number parsing, and the tool-list checks every detector makes.

use miles_core::ToolSpec;
use serde_json::Value;

/// Serialises JSON as Python's `json.dumps(v, ensure_ascii=False)` does (`", "` and `": "`
/// separators, Python's float repr such as `1e-05`), which is how SGLang spells tool-call
/// `arguments`.
pub(crate) fn python_json(value: &Value) -> String {
    miles_core::python::json_dumps(value, &miles_core::python::JsonDumpOptions::unicode())
}

/// A parsed call: model-given id, name, arguments as a JSON string.
pub(crate) type RawCall = (Option<String>, String, String);

/// Whether `name` is a tool of the request (every name is when the request lists none).
pub(crate) fn known(tools: &[ToolSpec], name: &str) -> bool {
    tools.is_empty() || tools.iter().any(|t| t.function.name == name)
}

/// Whether the tool's schema declares parameter `key` as a string.
pub(crate) fn param_is_string(tools: &[ToolSpec], name: &str, key: &str) -> bool {
    tools
        .iter()
        .find(|t| t.function.name == name)
        .and_then(|t| t.function.parameters.as_ref())
        .and_then(|p| p.pointer(&format!("/properties/{key}/type")))
        .and_then(Value::as_str)
        == Some("string")
}

/// Python's `float(raw)` as a JSON number (non-finite values are not JSON numbers: `None`).
pub(crate) fn py_float(raw: &str) -> Option<f64> {
    raw.trim().parse::<f64>().ok().filter(|f| f.is_finite())
}

/// An integral float as a JSON integer, otherwise as a float.
pub(crate) fn int_or_float(f: f64) -> Value {
    if f.fract() == 0.0 && f.abs() < 9.0e15 {
        Value::from(f as i64)
    } else {
        serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
    }
}

/// Removes one leading and one trailing `\n`.
pub(crate) fn strip_one_newline(s: &str) -> &str {
    let s = s.strip_prefix('\n').unwrap_or(s);
    s.strip_suffix('\n').unwrap_or(s)
}

/// `<tool_call>(.*?)</tool_call>` bodies, in order.
pub(crate) fn delimited<'a>(text: &'a str, open: &str, close: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(s) = rest.find(open) {
        let after = &rest[s + open.len()..];
        let Some(e) = after.find(close) else { break };
        out.push(&after[..e]);
        rest = &after[e + close.len()..];
    }
    out
}

/// The earliest of `needles` in `hay` at or after `from`: `(position, needle index)`.
pub(crate) fn find_first(hay: &str, from: usize, needles: &[&str]) -> Option<(usize, usize)> {
    needles
        .iter()
        .enumerate()
        .filter_map(|(i, n)| hay.get(from..)?.find(n).map(|p| (from + p, i)))
        .min()
}

/// Bodies of `OPEN(.*?)CLOSE|OPEN(.*)$`: each `OPEN` up to the next `CLOSE`, the last one
/// unclosed up to the end of the text.
pub(crate) fn tag_bodies<'a>(text: &'a str, open: &str, close: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(s) = rest.find(open) {
        let after = &rest[s + open.len()..];
        match after.find(close) {
            Some(e) => {
                out.push(&after[..e]);
                rest = &after[e + close.len()..];
            }
            None => {
                out.push(after);
                break;
            }
        }
    }
    out
}

/// The marker of DeepSeek's DSML tags (`<｜DSML｜invoke …>`).
pub(crate) const DSML: &str = "｜DSML｜";

/// Parses `ATTR="VALUE"` attributes (each after at least one whitespace) and the closing `>`
/// of an opening tag at the start of `s`: `(values, bytes consumed)`.
pub(crate) fn tag_attributes<'a>(s: &'a str, names: &[&str]) -> Option<(Vec<&'a str>, usize)> {
    let mut at = 0;
    let mut values = Vec::with_capacity(names.len());
    for name in names {
        let ws = s[at..].len() - s[at..].trim_start().len();
        if ws == 0 {
            return None;
        }
        at += ws;
        let rest = s[at..].strip_prefix(name)?.strip_prefix("=\"")?;
        let end = rest.find('"').filter(|&e| e > 0)?;
        values.push(&rest[..end]);
        at = s.len() - rest.len() + end + 1;
    }
    let rest = s[at..].trim_start();
    let rest = rest.strip_prefix('>')?;
    Some((values, s.len() - rest.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn python_json_spacing() {
        let v = json!({"city": "Zürich", "days": [1, 2], "x": {"a": null}});
        assert_eq!(
            python_json(&v),
            r#"{"city": "Zürich", "days": [1, 2], "x": {"a": null}}"#
        );
    }

    #[test]
    fn python_json_floats_are_pythons() {
        // python3 -c 'import json; print(json.dumps(json.loads("{\"lr\": 1e-5, \"big\": 1e16,
        //   \"neg\": -0.0, \"args\": {\"w\": [0.1, 2.5e-7]}}"), ensure_ascii=False))'
        let v: Value = serde_json::from_str(
            r#"{"lr": 1e-5, "big": 1e16, "neg": -0.0, "args": {"w": [0.1, 2.5e-7]}}"#,
        )
        .unwrap();
        assert_eq!(
            python_json(&v),
            r#"{"lr": 1e-05, "big": 1e+16, "neg": -0.0, "args": {"w": [0.1, 2.5e-07]}}"#
        );
    }
}
