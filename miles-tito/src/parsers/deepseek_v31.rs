//! DeepSeek V3.1 tool calls (SGLang `deepseekv31`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
//! <｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.

use serde_json::Value;

use super::markup::{RawCall, delimited, python_json};
use crate::error::{Error, Result};

/// Opens the tool-call section.
pub(crate) const V31_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const V31_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const V31_CALL_END: &str = "<｜tool▁call▁end｜>";
const V31_SEP: &str = "<｜tool▁sep｜>";

/// The calls of `text`; a call that does not parse is an error.
pub(crate) fn parse(text: &str) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for inner in delimited(text, V31_CALL_BEGIN, V31_CALL_END) {
        // `<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>` (greedy name).
        let (name, args) = inner
            .rsplit_once(V31_SEP)
            .ok_or_else(|| Error::model_output("deepseek tool call without <｜tool▁sep｜>"))?;
        let args: Value = serde_json::from_str(args)
            .map_err(|e| Error::model_output(format!("deepseek tool call arguments: {e}")))?;
        calls.push((None, name.to_owned(), python_json(&args)));
    }
    Ok(calls)
}
