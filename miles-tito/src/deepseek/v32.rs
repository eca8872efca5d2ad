//! The DeepSeek V3.2 encoder (Miles' vendored `encoding_dsv32`, `drop_thinking=False`
//! honoured on every turn).

use serde_json::Value as Json;

use super::common::*;
use super::pydict::*;
use super::tokens::*;
use super::version::DeepSeekVersion;
use miles_core::python::{repr, str as py_str};

pub(super) fn encode_v32(messages: &[Json], options: &DeepSeekEncodeOptions) -> Py<String> {
    let context = options.context()?;
    let mut full: Vec<Json> = context.iter().chain(messages).cloned().collect();
    let mut prompt = String::new();
    if options.add_default_bos_token && context.is_empty() {
        prompt.push_str(BOS);
    }
    if options.thinking() && options.drop_thinking {
        full = drop_thinking(&full, &KEEP_V32)?;
    }
    for idx in 0..messages.len() {
        render_v32(idx + context.len(), &full, options, &mut prompt)?;
    }
    Ok(prompt)
}

pub(super) fn render_v32(
    index: usize,
    messages: &[Json],
    options: &DeepSeekEncodeOptions,
    prompt: &mut String,
) -> Py<()> {
    let len = messages.len();
    if index >= len {
        return raise(
            "DS32EncodingError",
            format!("Index {index} out of range for messages list of length {len}"),
        );
    }
    if !options.mode_is_valid() {
        return raise(
            "DS32EncodingError",
            format!("Invalid thinking_mode `{}`", py_str(&options.thinking_mode)),
        );
    }
    let message = &messages[index];
    let last_user = find_last_user_index(messages)?;
    let f = fields(message)?;
    let idx = index as isize;
    let thinking = options.thinking();
    let drop = options.drop_thinking;
    match f.role.as_str() {
        Some("system") => prompt.push_str(&system_text(DeepSeekVersion::V32, &f)),
        Some("developer") => {
            if !truthy(f.content) {
                return raise(
                    "DS32EncodingError",
                    format!("Invalid message for role `developer`: {}", repr(message)),
                );
            }
            prompt.push_str(USER_TOKEN);
            if let Some(tools) = &f.tools {
                prompt.push_str("\n\n");
                prompt.push_str(&render_tools(DeepSeekVersion::V32, tools));
            }
            if truthy(f.response_format) {
                prompt.push_str(&response_format_text(f.response_format));
            }
            prompt.push_str("\n\n# The user's message is: ");
            prompt.push_str(&py_str(f.content));
            prompt.push_str(ASSISTANT_TOKEN);
            prompt.push_str(options.opener(idx == last_user));
        }
        Some("user") => {
            prompt.push_str(USER_TOKEN);
            prompt.push_str(&py_str(f.content));
            prompt.push_str(ASSISTANT_TOKEN);
            prompt.push_str(options.opener(idx == last_user));
        }
        Some("tool") => {
            // Python indexing: `messages[-1]` is the last message.
            let at = |i: isize| {
                &messages[if i < 0 {
                    (len as isize + i) as usize
                } else {
                    i as usize
                }]
            };
            let mut prev = idx - 1;
            let mut assistant = at(prev);
            while prev >= 0 && is_str(role_of(assistant)?, "tool") {
                prev -= 1;
                assistant = at(prev);
            }
            let valid = idx == 0 || (prev >= 0 && is_str(role_of(assistant)?, "assistant"));
            if !valid {
                return raise(
                    "DS32EncodingError",
                    format!("Invalid messages at {index}:\n{}", repr(assistant)),
                );
            }
            let order = idx - prev;
            let calls = get(assistant, "tool_calls")?;
            let count = if truthy(calls) {
                py_len(calls)? as isize
            } else {
                0
            };
            if !(truthy(calls) && count >= order) {
                return raise("DS32EncodingError", "No tool calls but found tool output");
            }
            if order == 1 {
                prompt.push_str("\n\n<function_results>");
            }
            prompt.push_str("\n<result>");
            prompt.push_str(&py_str(f.content));
            prompt.push_str("</result>");
            if order == count {
                prompt.push_str("\n</function_results>\n\n");
                prompt.push_str(options.opener(idx >= last_user));
            }
        }
        Some("assistant") => {
            let calls_text = match &f.tool_calls {
                Some(calls) => tool_calls_block(calls, "function_calls")?,
                None => String::new(),
            };
            if drop
                && thinking
                && idx > last_user
                && !(truthy(f.reasoning_content) || f.tool_calls.is_some())
            {
                return raise(
                    "DS32EncodingError",
                    format!(
                        "ThinkingMode: thinking, invalid message without reasoning_content/tool_calls `{}` after last user message",
                        repr(message)
                    ),
                );
            }
            if thinking && (!drop || idx > last_user) {
                prompt.push_str(&or_empty(f.reasoning_content));
                prompt.push_str(THINK_END);
            }
            prompt.push_str(&or_empty(f.content));
            prompt.push_str(&calls_text);
            prompt.push_str(EOS);
        }
        _ => {
            return raise(
                "NotImplementedError",
                format!("Unknown role: {}", py_str(f.role)),
            );
        }
    }
    Ok(())
}
