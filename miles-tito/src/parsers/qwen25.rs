//! Qwen 2.5 / Qwen3 tool calls (SGLang `qwen25`): `<tool_call>\n{"name": …, "arguments":
//! {…}}\n</tool_call>` blocks.

use serde_json::{Map, Value};

use super::markup::{RawCall, python_json};

/// SGLang's `Qwen25Detector`: blocks that are unterminated or not JSON are skipped (logged),
/// the others kept.
pub(crate) fn parse(body: &str) -> Vec<RawCall> {
    let mut calls = Vec::new();
    for block in body.split("<tool_call>").skip(1) {
        let Some((inner, _)) = block.split_once("</tool_call>") else {
            tracing::warn!(block = %format!("{block:.80}"), "unterminated <tool_call> skipped");
            continue;
        };
        let v: Value = match serde_json::from_str(inner.trim()) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(%e, inner = %format!("{inner:.80}"), "tool call that is not JSON skipped");
                continue;
            }
        };
        let name = v
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let args = v
            .get("arguments")
            .or_else(|| v.get("parameters"))
            .cloned()
            .unwrap_or(Value::Object(Map::new()));
        calls.push((None, name, python_json(&args)));
    }
    calls
}
