//! Kimi K2 / K2.5 / K2.6 tool calls (SGLang `kimi_k2`, `kimi_k2_raw_id`):
//! `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
//! <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; the model's
//! id is kept as the call id and its argument text as the arguments.

use super::markup::RawCall;
use crate::error::{Error, Result};

/// The calls of `body` (the text from the section start); a call that does not parse is an
/// error.
pub(crate) fn parse(body: &str) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for block in body.split("<|tool_call_begin|>").skip(1) {
        let (header, after) = block
            .split_once("<|tool_call_argument_begin|>")
            .ok_or_else(|| {
                Error::model_output("kimi tool call without <|tool_call_argument_begin|>")
            })?;
        let (args, _) = after
            .split_once("<|tool_call_end|>")
            .ok_or_else(|| Error::model_output("unterminated kimi tool call"))?;
        let id = header.trim();
        let name = id
            .rsplit_once(':')
            .map_or(id, |(n, _)| n)
            .rsplit('.')
            .next()
            .unwrap_or_default();
        calls.push((Some(id.to_owned()), name.to_owned(), args.trim().to_owned()));
    }
    Ok(calls)
}
