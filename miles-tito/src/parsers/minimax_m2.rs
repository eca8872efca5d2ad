//! MiniMax M2 / M2.5 / M2.7 tool calls (SGLang `minimax-m2`): `<minimax:tool_call>\n<invoke
//! name="NAME"><parameter name="P">VALUE</parameter>…</invoke>\n</minimax:tool_call>`, values
//! typed by the tool's schema; an unclosed block stays text.

use miles_core::ToolSpec;
use serde_json::{Map, Value};

use super::markup::{RawCall, int_or_float, py_float, python_json, tag_bodies};

/// The JSON-schema types a MiniMax parameter may have: `type` (string or list), the types of
/// `enum` values, and those of `anyOf` / `oneOf` / `allOf` choices; `["string"]` when none.
fn schema_types(schema: &Value, out: &mut Vec<String>) {
    let Some(schema) = schema.as_object() else {
        return;
    };
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.to_lowercase()),
        Some(Value::Array(ts)) => {
            out.extend(ts.iter().filter_map(Value::as_str).map(str::to_lowercase))
        }
        _ => {}
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        for v in values {
            out.push(
                match v {
                    Value::Null => "null",
                    Value::Bool(_) => "boolean",
                    Value::Number(n) if n.is_f64() => "number",
                    Value::Number(_) => "integer",
                    Value::String(_) => "string",
                    Value::Array(_) => "array",
                    Value::Object(_) => "object",
                }
                .to_owned(),
            );
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = schema.get(key) {
            for choice in choices {
                schema_types(choice, out);
            }
        }
    }
}

/// A `minimax-m2` parameter value typed by its schema (SGLang `MinimaxM2Detector`): `null` /
/// `none` / `nil` are null; otherwise the schema's types are tried in the order integer,
/// number, boolean (`true/1/yes/on`, `false/0/no/off`), object, array, string, the first that
/// converts wins; then JSON; then the string. (SGLang also answers null for any value of a
/// type list containing `null`; that is not reproduced.)
fn minimax_value(raw: &str, fname: &str, key: &str, tools: &[ToolSpec]) -> Value {
    if matches!(raw.to_lowercase().as_str(), "null" | "none" | "nil") {
        return Value::Null;
    }
    let mut types = Vec::new();
    if let Some(schema) = tools
        .iter()
        .find(|t| t.function.name == fname)
        .and_then(|t| t.function.parameters.as_ref())
        .and_then(|p| {
            p.pointer(&format!(
                "/properties/{}",
                key.replace('~', "~0").replace('/', "~1")
            ))
        })
    {
        schema_types(schema, &mut types);
    }
    if types.is_empty() {
        types.push("string".into());
    }
    let has = |names: &[&str]| names.iter().any(|n| types.iter().any(|t| t == n));
    for group in [
        &["integer", "int"][..],
        &["number", "float"],
        &["boolean", "bool"],
        &["object"],
        &["array"],
        &["string", "str", "text"],
    ] {
        if !has(group) {
            continue;
        }
        match group[0] {
            "integer" => {
                if let Ok(i) = raw.trim().parse::<i64>() {
                    return Value::from(i);
                }
            }
            "number" => {
                if let Some(f) = py_float(raw) {
                    return int_or_float(f);
                }
            }
            "boolean" => match raw.trim().to_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => return Value::Bool(true),
                "false" | "0" | "no" | "off" => return Value::Bool(false),
                _ => {}
            },
            "object" | "array" => {
                if let Ok(v) = serde_json::from_str(raw) {
                    return v;
                }
            }
            _ => return Value::String(raw.to_owned()),
        }
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned()))
}

/// `(normal text, calls)` of `text`.
pub(crate) fn parse(text: &str, tools: &[ToolSpec]) -> (String, Vec<RawCall>) {
    const START: &str = "<minimax:tool_call>";
    const END: &str = "</minimax:tool_call>";
    let mut normal = String::new();
    let mut calls = Vec::new();
    let mut cursor = 0;
    loop {
        let Some(s) = text[cursor..].find(START).map(|s| cursor + s) else {
            normal.push_str(&text[cursor..]);
            break;
        };
        normal.push_str(&text[cursor..s]);
        let Some(e) = text[s..].find(END).map(|e| s + e) else {
            // An unclosed block stays text (SGLang).
            normal.push_str(&text[s..]);
            break;
        };
        cursor = e + END.len();
        let block = &text[s..cursor];
        // `<invoke name="(.*?)</invoke>|<invoke name="(.*)$`
        for invoke in tag_bodies(block, "<invoke name=\"", "</invoke>") {
            let Some((fname, body)) = invoke.split_once("\">") else {
                continue;
            };
            let fname = fname.trim();
            let mut args = Map::new();
            for param in tag_bodies(body, "<parameter name=\"", "</parameter>") {
                let Some((pname, value)) = param.split_once("\">") else {
                    continue;
                };
                let pname = pname.trim();
                let value = value.trim_start_matches('\n').trim_end_matches('\n');
                args.insert(pname.to_owned(), minimax_value(value, fname, pname, tools));
            }
            calls.push((None, fname.to_owned(), python_json(&Value::Object(args))));
        }
    }
    (normal, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn minimax_values_follow_the_schema() {
        let tools = vec![ToolSpec::function(
            "f",
            "",
            json!({"type": "object", "properties": {
                "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"},
                "e": {"enum": [1, 2]}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "opt": {"type": ["string", "null"]}
            }}),
        )];
        let cases = [
            ("s", "12", json!("12")),
            ("i", "12", json!(12)),
            ("i", "x", json!("x")),
            ("n", "2.0", json!(2)),
            ("n", "2.5", json!(2.5)),
            ("b", "on", json!(true)),
            ("b", "0", json!(false)),
            ("o", r#"{"a": 1}"#, json!({"a": 1})),
            ("e", "2", json!(2)),
            ("u", "7", json!(7)),
            ("u", "seven", json!("seven")),
            ("opt", "text", json!("text")),
            ("opt", "None", Value::Null),
            ("missing", "[1]", json!("[1]")),
        ];
        for (key, raw, want) in cases {
            assert_eq!(minimax_value(raw, "f", key, &tools), want, "{key}={raw:?}");
        }
    }
}
