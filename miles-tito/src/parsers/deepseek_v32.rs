//! DeepSeek V3.2 tool calls (SGLang `deepseekv32`): DSML, a `<｜DSML｜function_calls>` block
//! holding `<｜DSML｜invoke name="NAME">` elements with `<｜DSML｜parameter name="P"
//! string="true|false">` children (or a JSON object), the `｜DSML｜` prefixes optional.

use serde_json::{Map, Value};

use super::markup::{DSML, RawCall, find_first, python_json, tag_attributes};

/// One DSML element `<(｜DSML｜)?TAG ATTRS>(.*?)</(｜DSML｜)?TAG>` found at or after `from`:
/// `(start, attribute values, body, end)`; `None` when there is none (a tag without its close
/// is not an element).
fn dsml_element<'a>(
    text: &'a str,
    from: usize,
    tag: &str,
    attrs: &[&str],
) -> Option<(usize, Vec<&'a str>, &'a str, usize)> {
    let opens = [format!("<{DSML}{tag}"), format!("<{tag}")];
    let closes = [format!("</{DSML}{tag}>"), format!("</{tag}>")];
    let opens = [opens[0].as_str(), opens[1].as_str()];
    let closes = [closes[0].as_str(), closes[1].as_str()];
    let mut at = from;
    while let Some((start, which)) = find_first(text, at, &opens) {
        let head = start + opens[which].len();
        if let Some((values, used)) = tag_attributes(&text[head..], attrs) {
            let body_start = head + used;
            let (close, which) = find_first(text, body_start, &closes)?;
            return Some((
                start,
                values,
                &text[body_start..close],
                close + closes[which].len(),
            ));
        }
        at = start + 1;
    }
    None
}

/// DSML invoke arguments (SGLang `DeepSeekV32Detector`): a JSON object body, or
/// `<(｜DSML｜)?parameter name="P" string="true|false">V</(｜DSML｜)?parameter>` elements
/// (`string="true"`: the stripped text; otherwise JSON, else the stripped text).
fn dsml_arguments(body: &str) -> Map<String, Value> {
    let trimmed = body.trim();
    if trimmed.starts_with('{')
        && trimmed.ends_with('}')
        && let Ok(Value::Object(map)) = serde_json::from_str(trimmed)
    {
        return map;
    }
    let mut args = Map::new();
    let mut at = 0;
    while let Some((_, attrs, value, end)) =
        dsml_element(body, at, "parameter", &["name", "string"])
    {
        at = end;
        let value = value.trim();
        let value = if attrs[1] == "true" {
            Value::String(value.to_owned())
        } else {
            serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()))
        };
        args.insert(attrs[0].to_owned(), value);
    }
    args
}

/// `(normal text, calls)` of `text`.
pub(crate) fn parse(text: &str) -> (String, Vec<RawCall>) {
    let open = [
        format!("<{DSML}function_calls>"),
        "<function_calls>".to_owned(),
    ];
    let close = [
        format!("</{DSML}function_calls>"),
        "</function_calls>".to_owned(),
    ];
    let Some((start, which)) = find_first(text, 0, &[&open[0], &open[1]]) else {
        return (text.to_owned(), Vec::new());
    };
    let normal = text[..start].trim().to_owned();
    let body_start = start + open[which].len();
    let Some((end, _)) = find_first(text, body_start, &[&close[0], &close[1]]) else {
        return (normal, Vec::new());
    };
    let block = &text[body_start..end];
    let mut calls = Vec::new();
    let mut at = 0;
    while let Some((_, attrs, body, next)) = dsml_element(block, at, "invoke", &["name"]) {
        at = next;
        let args = dsml_arguments(body);
        calls.push((None, attrs[0].to_owned(), python_json(&Value::Object(args))));
    }
    (normal, calls)
}
