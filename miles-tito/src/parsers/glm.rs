//! GLM-4.5 / GLM-4.7 tool calls (SGLang `glm45`, `glm47`): `<tool_call>NAME` followed by
//! `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs (GLM-4.5 puts newlines between
//! them), values typed by the tool's schema.

use miles_core::ToolSpec;
use serde_json::{Map, Value};

use super::markup::{RawCall, param_is_string, python_json};
use crate::error::{Error, Result};

/// The calls of `body` (the text from the first `<tool_call>`); a call that does not parse
/// is an error.
pub(crate) fn parse(body: &str, tools: &[ToolSpec]) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for block in body.split("<tool_call>").skip(1) {
        let Some((inner, _)) = block.split_once("</tool_call>") else {
            return Err(Error::model_output(format!(
                "unterminated <tool_call>: {block:.80}"
            )));
        };
        let (name, mut rest) = match inner.find("<arg_key>") {
            Some(i) => (inner[..i].trim(), &inner[i..]),
            None => (inner.trim(), ""),
        };
        let mut args = Map::new();
        while let Some(k0) = rest.find("<arg_key>") {
            let after = &rest[k0 + "<arg_key>".len()..];
            let (key, after) = after
                .split_once("</arg_key>")
                .ok_or_else(|| Error::model_output("unterminated <arg_key>"))?;
            let v0 = after.find("<arg_value>").ok_or_else(|| {
                Error::model_output(format!("<arg_key>{key}</arg_key> without <arg_value>"))
            })?;
            let after = &after[v0 + "<arg_value>".len()..];
            let (raw, after) = after
                .split_once("</arg_value>")
                .ok_or_else(|| Error::model_output("unterminated <arg_value>"))?;
            let key = key.trim();
            let value = if param_is_string(tools, name, key) {
                Value::String(raw.to_owned())
            } else {
                serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_owned()))
            };
            args.insert(key.to_owned(), value);
            rest = after;
        }
        calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
    }
    Ok(calls)
}
