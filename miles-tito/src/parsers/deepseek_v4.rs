//! DeepSeek V4 tool calls (SGLang `deepseekv4`): DSML as V3.2 in a `<｜DSML｜tool_calls>` block,
//! parsed strictly.

use miles_core::ToolSpec;
use serde_json::{Map, Value};

use super::markup::{DSML, RawCall, find_first, known, python_json, tag_attributes};
use crate::error::{Error, Result};

/// DeepSeek V4's strict DSML (SGLang `DeepSeekV4Detector`): the text before the first DSML
/// marker (less a trailing blank line) is content; then `<｜DSML｜tool_calls>` blocks of
/// `<｜DSML｜invoke name="…">` elements holding only parameters (or one JSON object), with
/// `string` either `true` or `false`, JSON for non-strings, no repeated parameter, known
/// tools; any other DSML markup is an error. Text after the blocks is content.
pub(crate) fn parse(text: &str, tools: &[ToolSpec]) -> Result<(String, Vec<RawCall>)> {
    let open_block = format!("<{DSML}tool_calls>");
    let close_block = format!("</{DSML}tool_calls>");
    let open_invoke = format!("<{DSML}invoke");
    let close_invoke = format!("</{DSML}invoke>");
    let open_param = format!("<{DSML}parameter");
    let close_param = format!("</{DSML}parameter>");
    let bad = |what: &str| Error::model_output(format!("DeepSeek V4 tool output: {what}"));
    let Some((first, _)) = find_first(text, 0, &[&format!("<{DSML}"), &format!("</{DSML}")]) else {
        return Ok((text.to_owned(), Vec::new()));
    };
    let mut normal = text[..first]
        .strip_suffix("\n\n")
        .unwrap_or(&text[..first])
        .to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(after) = rest.strip_prefix(open_block.as_str()) {
        rest = after.trim_start();
        while let Some(after) = rest.strip_prefix(open_invoke.as_str()) {
            let (names, used) =
                tag_attributes(after, &["name"]).ok_or_else(|| bad("malformed invoke tag"))?;
            let name = names[0];
            if !known(tools, name) {
                return Err(bad(&format!("undefined tool {name:?}")));
            }
            let body_and_rest = &after[used..];
            let end = body_and_rest
                .find(close_invoke.as_str())
                .ok_or_else(|| bad("unterminated invoke"))?;
            let body = &body_and_rest[..end];
            rest = body_and_rest[end + close_invoke.len()..].trim_start();
            let args = if body.trim_start().starts_with('{') {
                match serde_json::from_str(body.trim()) {
                    Ok(Value::Object(map)) => map,
                    _ => return Err(bad("invoke arguments are not a JSON object")),
                }
            } else {
                let mut args = Map::new();
                let mut params = body.trim_start();
                while let Some(after) = params.strip_prefix(open_param.as_str()) {
                    let (attrs, used) = tag_attributes(after, &["name", "string"])
                        .ok_or_else(|| bad("malformed parameter tag"))?;
                    let value_and_rest = &after[used..];
                    let end = value_and_rest
                        .find(close_param.as_str())
                        .ok_or_else(|| bad("unterminated parameter"))?;
                    let value = value_and_rest[..end].trim();
                    params = value_and_rest[end + close_param.len()..].trim_start();
                    let value = match attrs[1] {
                        "true" => Value::String(value.to_owned()),
                        "false" => serde_json::from_str(value).map_err(|e| {
                            bad(&format!("parameter {:?} is not JSON: {e}", attrs[0]))
                        })?,
                        other => return Err(bad(&format!("string flag {other:?}"))),
                    };
                    if args.insert(attrs[0].to_owned(), value).is_some() {
                        return Err(bad(&format!("repeated parameter {:?}", attrs[0])));
                    }
                }
                if !params.is_empty() {
                    return Err(bad("text between parameters"));
                }
                args
            };
            calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
        }
        match rest.strip_prefix(close_block.as_str()) {
            Some(after) => rest = after.trim_start_matches('\n'),
            None if rest.trim().is_empty() => rest = "",
            None => return Err(bad("malformed tool_calls block")),
        }
    }
    if rest.contains(DSML) {
        return Err(bad("DSML markup outside a tool_calls block"));
    }
    normal.push_str(rest);
    Ok((normal, calls))
}
