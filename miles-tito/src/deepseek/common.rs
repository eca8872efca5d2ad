//! The pieces both encoders share: tools and tool calls in DSML, system text, the encoder
//! keywords ([`DeepSeekEncodeOptions`]) and `drop_thinking`.

use std::borrow::Cow;

use serde_json::{Value as Json, json};

use super::pydict::*;
use super::tokens::*;
use super::version::DeepSeekVersion;
use miles_core::python::{self, JsonDumpOptions, str as py_str};

/// `json.dumps(value, ensure_ascii=False)`, as the encoder writes tool schemas and arguments.
fn to_json(value: &Json) -> String {
    python::json_dumps(value, &JsonDumpOptions::unicode())
}

/// `[tool["function"] for tool in tools]`.
pub(super) fn tools_from_openai(tools: &Json) -> Py<Vec<Json>> {
    iterate(tools)?
        .iter()
        .map(|tool| subscript(tool, "function").cloned())
        .collect()
}

/// `[{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}]`.
pub(super) fn tool_calls_from_openai(calls: &Json) -> Py<Vec<(Json, Json)>> {
    let mut out = Vec::new();
    for call in iterate(calls)? {
        let function = subscript(&call, "function")?;
        let name = subscript(function, "name")?.clone();
        let arguments = subscript(function, "arguments")?.clone();
        out.push((name, arguments));
    }
    Ok(out)
}

/// Tool-call arguments as DSML parameters.
pub(super) fn encode_arguments_to_dsml(arguments: &Json) -> Py<String> {
    let parsed;
    let arguments = match arguments {
        Json::String(text) => {
            parsed = json_loads(text)?;
            &parsed
        }
        other => other,
    };
    let Json::Object(map) = arguments else {
        return raise(
            "ValueError",
            "Assistant tool call function.arguments must be a JSON object.",
        );
    };
    let mut out = String::new();
    for (i, (key, value)) in map.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let (is_str, text) = match value {
            Json::String(s) => ("true", Cow::Borrowed(s.as_str())),
            other => ("false", Cow::Owned(to_json(other))),
        };
        out.push_str(&format!(
            "<｜DSML｜parameter name=\"{key}\" string=\"{is_str}\">{text}</｜DSML｜parameter>"
        ));
    }
    Ok(out)
}

/// The assistant's tool-call block: `\n\n<｜DSML｜BLOCK>\n…\n</｜DSML｜BLOCK>`.
pub(super) fn tool_calls_block(calls: &[(Json, Json)], block: &str) -> Py<String> {
    let mut invokes = Vec::with_capacity(calls.len());
    for (name, arguments) in calls {
        invokes.push(format!(
            "<｜DSML｜invoke name=\"{}\">\n{}\n</｜DSML｜invoke>",
            py_str(name),
            encode_arguments_to_dsml(arguments)?
        ));
    }
    Ok(format!(
        "\n\n<｜DSML｜{block}>\n{}\n</｜DSML｜{block}>",
        invokes.join("\n")
    ))
}

pub(super) fn render_tools(version: DeepSeekVersion, tools: &[Json]) -> String {
    let schemas: Vec<String> = tools.iter().map(to_json).collect();
    let (prefix, suffix) = match version {
        DeepSeekVersion::V32 => (V32_TOOLS_PREFIX, V32_TOOLS_SUFFIX),
        DeepSeekVersion::V4 => (V4_TOOLS_PREFIX, V4_TOOLS_SUFFIX),
    };
    format!("{prefix}{}{suffix}", schemas.join("\n"))
}

pub(super) fn response_format_text(response_format: &Json) -> String {
    format!("\n\n{RESPONSE_FORMAT_PREFIX}{}", to_json(response_format))
}

/// The fields every message kind reads.
pub(super) struct Fields<'a> {
    pub(super) role: &'a Json,
    pub(super) content: &'a Json,
    pub(super) tools: Option<Vec<Json>>,
    pub(super) response_format: &'a Json,
    pub(super) tool_calls: Option<Vec<(Json, Json)>>,
    pub(super) reasoning_content: &'a Json,
}

pub(super) fn fields(message: &Json) -> Py<Fields<'_>> {
    let role = get(message, "role")?;
    let content = get(message, "content")?;
    let tools = get(message, "tools")?;
    let response_format = get(message, "response_format")?;
    let tool_calls = get(message, "tool_calls")?;
    let reasoning_content = get(message, "reasoning_content")?;
    Ok(Fields {
        role,
        content,
        tools: if truthy(tools) {
            Some(tools_from_openai(tools)?)
        } else {
            None
        },
        response_format,
        tool_calls: if truthy(tool_calls) {
            Some(tool_calls_from_openai(tool_calls)?)
        } else {
            None
        },
        reasoning_content,
    })
}

pub(super) fn system_text(version: DeepSeekVersion, f: &Fields<'_>) -> String {
    let mut out = or_empty(f.content).into_owned();
    if let Some(tools) = &f.tools {
        out.push_str("\n\n");
        out.push_str(&render_tools(version, tools));
    }
    if truthy(f.response_format) {
        out.push_str(&response_format_text(f.response_format));
    }
    out
}

/// The encoder keywords (`encode_messages(messages, thinking_mode, context=None,
/// drop_thinking=True, add_default_bos_token=True[, reasoning_effort=None])`).
#[derive(Debug, Clone)]
pub struct DeepSeekEncodeOptions {
    /// `"thinking"` or `"chat"` (anything else is rejected when a message is rendered).
    pub thinking_mode: Json,
    /// Preceding messages, already encoded (truthy: a list).
    pub context: Json,
    /// Drop reasoning before the last user turn (Python truthiness).
    pub drop_thinking: bool,
    /// Prepend `<｜begin▁of▁sentence｜>` when there is no context.
    pub add_default_bos_token: bool,
    /// V4 only: `"max"`, `"high"` or null.
    pub reasoning_effort: Json,
}

impl Default for DeepSeekEncodeOptions {
    fn default() -> Self {
        Self {
            thinking_mode: json!("thinking"),
            context: Json::Null,
            drop_thinking: true,
            add_default_bos_token: true,
            reasoning_effort: Json::Null,
        }
    }
}

impl DeepSeekEncodeOptions {
    pub(super) fn thinking(&self) -> bool {
        is_str(&self.thinking_mode, "thinking")
    }

    pub(super) fn mode_is_valid(&self) -> bool {
        self.thinking() || is_str(&self.thinking_mode, "chat")
    }

    /// `context if context else []`, and `context + messages` needing a list.
    pub(super) fn context(&self) -> Py<&[Json]> {
        match &self.context {
            c if !truthy(c) => Ok(&[]),
            Json::Array(items) => Ok(items),
            other => raise(
                "TypeError",
                format!(
                    "unsupported operand type(s) for +: '{}' and 'list'",
                    py_type(other)
                ),
            ),
        }
    }

    /// The think token that opens an assistant turn: `<think>` when thinking and (the drop
    /// rule does not apply or `condition` holds), else `</think>`.
    pub(super) fn opener(&self, condition: bool) -> &'static str {
        if self.thinking() && (!self.drop_thinking || condition) {
            THINK_START
        } else {
            THINK_END
        }
    }
}

/// Roles whose messages V3.2's `drop_thinking` keeps as they are.
pub(super) const KEEP_V32: [&str; 3] = ["user", "system", "tool"];
/// Roles whose messages V4's `drop_thinking` keeps as they are.
pub(super) const KEEP_V4: [&str; 5] = [
    "user",
    "system",
    "tool",
    "latest_reminder",
    "direct_search_results",
];

/// `drop_thinking`: before the last user message, assistant messages lose their
/// `reasoning_content`, messages of the `keep` roles stay as they are, any other is dropped.
pub(super) fn drop_thinking(messages: &[Json], keep: &[&str]) -> Py<Vec<Json>> {
    let last_user = find_last_user_index(messages)?;
    let mut out = Vec::with_capacity(messages.len());
    for (idx, message) in messages.iter().enumerate() {
        let role = role_of(message)?;
        if keep.iter().any(|r| is_str(role, r)) || idx as isize >= last_user {
            out.push(message.clone());
        } else if is_str(role, "assistant") {
            let mut copy = message.clone();
            if let Json::Object(map) = &mut copy {
                map.shift_remove("reasoning_content");
            }
            out.push(copy);
        }
    }
    Ok(out)
}
