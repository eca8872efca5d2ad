//! DeepSeek V3.2 and V4 prompt encoders, and Miles' bridge to them (MILES_SPEC §1.3.1).
//!
//! Neither model ships a Jinja chat template: prompts are built by Python encoders
//! (`encode_messages`). This module reproduces, byte for byte, the two encoders Miles renders
//! with — its vendored `encoding_dsv32` (upstream's with `drop_thinking=False` honoured on
//! every turn) and sglang's `encoding_dsv4` — and Miles' bridge around them
//! ([`apply_chat_template`]): tool-call arguments as JSON, tools (validated like sglang's
//! `Tool` model) injected into the first system message, the thinking mode resolved from
//! `thinking_mode` / `enable_thinking` / `thinking`, and the generation suffix stripped when
//! no generation prompt is asked for.
//!
//! Messages are JSON objects and are read the way the Python reads dicts, so every message kind
//! the encoders know works: `system` (with `tools`, `response_format`), `user` (V4: merged with
//! adjacent tool results and users, `task`), `assistant` (`reasoning_content`, `tool_calls`
//! in DSML, V4 `wo_eos`), `tool`, `developer`, and V4's `latest_reminder`; encoder keywords
//! `drop_thinking`, `add_default_bos_token`, `context` and (V4) `reasoning_effort`. Input the
//! Python rejects is an [`Error::DeepSeekEncoding`] naming the exception Python raises.

use std::borrow::Cow;

use miles_core::python::{self, JsonDumpOptions, repr, str as py_str, truthy};
use serde_json::{Map, Value as Json, json};

use crate::error::{Error, Result};

/// `<｜begin▁of▁sentence｜>`.
pub const BOS: &str = "<｜begin▁of▁sentence｜>";
/// `<｜end▁of▁sentence｜>`.
pub const EOS: &str = "<｜end▁of▁sentence｜>";
/// `<think>`.
pub const THINK_START: &str = "<think>";
/// `</think>`.
pub const THINK_END: &str = "</think>";
/// `<｜User｜>`.
pub const USER_TOKEN: &str = "<｜User｜>";
/// `<｜Assistant｜>`.
pub const ASSISTANT_TOKEN: &str = "<｜Assistant｜>";
/// `<｜latest_reminder｜>` (V4).
pub const LATEST_REMINDER_TOKEN: &str = "<｜latest_reminder｜>";

const RESPONSE_FORMAT_PREFIX: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

const V32_TOOLS_PREFIX: &str = "## Tools\n\
You have access to a set of tools you can use to answer the user's question.\n\
You can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following as part of your reply to the user:\n\
<｜DSML｜function_calls>\n\
<｜DSML｜invoke name=\"$FUNCTION_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$FUNCTION_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜function_calls>\n\
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The \"string\" attribute should be set to \"true\" for string type parameters and \"false\" for other types (numbers, booleans, arrays, objects).\n\
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:\n\
<｜DSML｜function_calls>\n\
...\n\
</｜DSML｜function_calls>\n\
<function_results>\n\
...\n\
</function_results>\n\
<think>...thinking about results</think>\n\
Here are the functions available in JSONSchema format:\n\
<functions>\n";
const V32_TOOLS_SUFFIX: &str = "\n</functions>\n";

const V4_TOOLS_PREFIX: &str = "## Tools\n\
\n\
You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\
\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\
\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\
\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\
\n\
Otherwise, output directly after </think> with tool calls or final response.\n\
\n\
### Available Tool Schemas\n\
\n";
const V4_TOOLS_SUFFIX: &str = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// V4 task tokens (`task` on a user message).
const V4_TASKS: [(&str, &str); 6] = [
    ("action", "<｜action｜>"),
    ("query", "<｜query｜>"),
    ("authority", "<｜authority｜>"),
    ("domain", "<｜domain｜>"),
    ("title", "<｜title｜>"),
    ("read_url", "<｜read_url｜>"),
];

/// Which DeepSeek encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeepSeekVersion {
    /// DeepSeek V3.2 (Miles' vendored `encoding_dsv32`).
    V32,
    /// DeepSeek V4 (sglang's `encoding_dsv4`).
    V4,
}

impl DeepSeekVersion {
    /// The checkpoint's `config.json` `model_type` (`deepseek_v32`, `deepseek_v4`).
    pub fn model_type(self) -> &'static str {
        match self {
            Self::V32 => "deepseek_v32",
            Self::V4 => "deepseek_v4",
        }
    }

    /// The version a `config.json` `model_type` routes to, if any.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "deepseek_v32" => Some(Self::V32),
            "deepseek_v4" => Some(Self::V4),
            _ => None,
        }
    }

    /// The generation suffix Miles strips when `add_generation_prompt=False`, for a
    /// conversation ending with `tail_role`.
    fn generation_suffix(self, tail_role: &Json, think: &str) -> Option<String> {
        let role = tail_role.as_str()?;
        match (self, role) {
            (_, "user" | "developer") | (Self::V4, "tool") => {
                Some(format!("{ASSISTANT_TOKEN}{think}"))
            }
            (Self::V32, "tool") => Some(format!("\n\n{think}")),
            _ => None,
        }
    }
}

impl std::fmt::Display for DeepSeekVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

// ---------------------------------------------------------------------------------------------
// Python semantics over JSON values
// ---------------------------------------------------------------------------------------------

/// A Python exception: its class name and message.
struct Raise {
    exception: &'static str,
    message: String,
}

type Py<T> = std::result::Result<T, Raise>;

fn raise<T>(exception: &'static str, message: impl Into<String>) -> Py<T> {
    Err(Raise {
        exception,
        message: message.into(),
    })
}

impl Raise {
    fn into_error(self, version: DeepSeekVersion) -> Error {
        Error::DeepSeekEncoding {
            encoder: version.model_type(),
            exception: self.exception,
            message: self.message,
        }
    }
}

static NULL: Json = Json::Null;

/// `json.dumps(value, ensure_ascii=False)`, as the encoder writes tool schemas and arguments.
fn to_json(value: &Json) -> String {
    python::json_dumps(value, &JsonDumpOptions::unicode())
}

fn py_type(value: &Json) -> &'static str {
    match value {
        Json::Null => "NoneType",
        Json::Bool(_) => "bool",
        Json::Number(n) if n.is_f64() => "float",
        Json::Number(_) => "int",
        Json::String(_) => "str",
        Json::Array(_) => "list",
        Json::Object(_) => "dict",
    }
}

fn is_str(value: &Json, text: &str) -> bool {
    value.as_str() == Some(text)
}

fn as_dict(value: &Json) -> Py<&Map<String, Json>> {
    match value {
        Json::Object(map) => Ok(map),
        other => raise(
            "AttributeError",
            format!("'{}' object has no attribute 'get'", py_type(other)),
        ),
    }
}

/// `d.get(key)`.
fn get<'a>(value: &'a Json, key: &str) -> Py<&'a Json> {
    Ok(as_dict(value)?.get(key).unwrap_or(&NULL))
}

/// `d.get(key, default)`.
fn get_or<'a>(value: &'a Json, key: &str, default: &'a Json) -> Py<&'a Json> {
    Ok(as_dict(value)?.get(key).unwrap_or(default))
}

/// `value[key]` with a string key.
fn subscript<'a>(value: &'a Json, key: &str) -> Py<&'a Json> {
    match value {
        Json::Object(map) => match map.get(key) {
            Some(item) => Ok(item),
            None => raise("KeyError", format!("'{key}'")),
        },
        Json::Array(_) => raise(
            "TypeError",
            "list indices must be integers or slices, not str",
        ),
        Json::String(_) => raise("TypeError", "string indices must be integers, not 'str'"),
        other => raise(
            "TypeError",
            format!("'{}' object is not subscriptable", py_type(other)),
        ),
    }
}

/// `for item in value`.
fn iterate(value: &Json) -> Py<Vec<Cow<'_, Json>>> {
    match value {
        Json::Array(items) => Ok(items.iter().map(Cow::Borrowed).collect()),
        Json::Object(map) => Ok(map
            .keys()
            .map(|k| Cow::Owned(Json::String(k.clone())))
            .collect()),
        Json::String(s) => Ok(s
            .chars()
            .map(|c| Cow::Owned(Json::String(c.to_string())))
            .collect()),
        other => raise(
            "TypeError",
            format!("'{}' object is not iterable", py_type(other)),
        ),
    }
}

/// `len(value)`.
fn py_len(value: &Json) -> Py<usize> {
    match value {
        Json::Array(items) => Ok(items.len()),
        Json::Object(map) => Ok(map.len()),
        Json::String(s) => Ok(s.chars().count()),
        other => raise(
            "TypeError",
            format!("object of type '{}' has no len()", py_type(other)),
        ),
    }
}

/// `str(value or "")`.
fn or_empty(value: &Json) -> Cow<'_, str> {
    if truthy(value) {
        py_str(value)
    } else {
        Cow::Borrowed("")
    }
}

/// The right operand of `str + value`.
fn concat_operand(value: &Json) -> Py<&str> {
    match value {
        Json::String(s) => Ok(s),
        other => raise(
            "TypeError",
            format!(
                "can only concatenate str (not \"{}\") to str",
                py_type(other)
            ),
        ),
    }
}

/// `sep.join(items)` where every item must be a string.
fn join_strings(items: &[Cow<'_, Json>], sep: &str) -> Py<String> {
    let mut out = String::new();
    for (i, item) in items.iter().enumerate() {
        let Json::String(s) = item.as_ref() else {
            return raise(
                "TypeError",
                format!(
                    "sequence item {i}: expected str instance, {} found",
                    py_type(item)
                ),
            );
        };
        if i > 0 {
            out.push_str(sep);
        }
        out.push_str(s);
    }
    Ok(out)
}

/// `json.loads(text)` for tool-call arguments.
fn json_loads(text: &str) -> Py<Json> {
    serde_json::from_str(text).or_else(|e| raise("JSONDecodeError", e.to_string()))
}

/// Whether a value can be a dict key (`hash()` succeeds).
fn hashable(value: &Json) -> Py<()> {
    match value {
        Json::Array(_) | Json::Object(_) => raise(
            "TypeError",
            format!("unhashable type: '{}'", py_type(value)),
        ),
        _ => Ok(()),
    }
}

/// A message's role, compared with `==` against role names.
fn role_of(message: &Json) -> Py<&Json> {
    get(message, "role")
}

fn find_last_user_index(messages: &[Json]) -> Py<isize> {
    for (idx, message) in messages.iter().enumerate().rev() {
        let role = role_of(message)?;
        if is_str(role, "user") || is_str(role, "developer") {
            return Ok(idx as isize);
        }
    }
    Ok(-1)
}

// ---------------------------------------------------------------------------------------------
// Shared encoder pieces
// ---------------------------------------------------------------------------------------------

/// `[tool["function"] for tool in tools]`.
fn tools_from_openai(tools: &Json) -> Py<Vec<Json>> {
    iterate(tools)?
        .iter()
        .map(|tool| subscript(tool, "function").cloned())
        .collect()
}

/// `[{"name": tc["function"]["name"], "arguments": tc["function"]["arguments"]}]`.
fn tool_calls_from_openai(calls: &Json) -> Py<Vec<(Json, Json)>> {
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
fn encode_arguments_to_dsml(arguments: &Json) -> Py<String> {
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
fn tool_calls_block(calls: &[(Json, Json)], block: &str) -> Py<String> {
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

fn render_tools(version: DeepSeekVersion, tools: &[Json]) -> String {
    let schemas: Vec<String> = tools.iter().map(to_json).collect();
    let (prefix, suffix) = match version {
        DeepSeekVersion::V32 => (V32_TOOLS_PREFIX, V32_TOOLS_SUFFIX),
        DeepSeekVersion::V4 => (V4_TOOLS_PREFIX, V4_TOOLS_SUFFIX),
    };
    format!("{prefix}{}{suffix}", schemas.join("\n"))
}

fn response_format_text(response_format: &Json) -> String {
    format!("\n\n{RESPONSE_FORMAT_PREFIX}{}", to_json(response_format))
}

/// The fields every message kind reads.
struct Fields<'a> {
    role: &'a Json,
    content: &'a Json,
    tools: Option<Vec<Json>>,
    response_format: &'a Json,
    tool_calls: Option<Vec<(Json, Json)>>,
    reasoning_content: &'a Json,
}

fn fields(message: &Json) -> Py<Fields<'_>> {
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

fn system_text(version: DeepSeekVersion, f: &Fields<'_>) -> String {
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
pub struct EncodeOptions {
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

impl Default for EncodeOptions {
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

impl EncodeOptions {
    fn thinking(&self) -> bool {
        is_str(&self.thinking_mode, "thinking")
    }

    fn mode_is_valid(&self) -> bool {
        self.thinking() || is_str(&self.thinking_mode, "chat")
    }

    /// `context if context else []`, and `context + messages` needing a list.
    fn context(&self) -> Py<&[Json]> {
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
    fn opener(&self, condition: bool) -> &'static str {
        if self.thinking() && (!self.drop_thinking || condition) {
            THINK_START
        } else {
            THINK_END
        }
    }
}

/// Runs the version's `encode_messages`.
pub fn encode_messages(
    version: DeepSeekVersion,
    messages: &[Json],
    options: &EncodeOptions,
) -> Result<String> {
    match version {
        DeepSeekVersion::V32 => encode_v32(messages, options),
        DeepSeekVersion::V4 => encode_v4(messages, options),
    }
    .map_err(|e| e.into_error(version))
}

// ---------------------------------------------------------------------------------------------
// V3.2
// ---------------------------------------------------------------------------------------------

fn encode_v32(messages: &[Json], options: &EncodeOptions) -> Py<String> {
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

/// Roles whose messages V3.2's `drop_thinking` keeps as they are.
const KEEP_V32: [&str; 3] = ["user", "system", "tool"];
/// Roles whose messages V4's `drop_thinking` keeps as they are.
const KEEP_V4: [&str; 5] = [
    "user",
    "system",
    "tool",
    "latest_reminder",
    "direct_search_results",
];

/// `drop_thinking`: before the last user message, assistant messages lose their
/// `reasoning_content`, messages of the `keep` roles stay as they are, any other is dropped.
fn drop_thinking(messages: &[Json], keep: &[&str]) -> Py<Vec<Json>> {
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

fn render_v32(
    index: usize,
    messages: &[Json],
    options: &EncodeOptions,
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

// ---------------------------------------------------------------------------------------------
// V4
// ---------------------------------------------------------------------------------------------

/// Tool messages become `tool_result` blocks of a user message; a user message (or tool
/// result) directly after such a merged user message joins it.
fn merge_tool_messages(messages: &[Json]) -> Py<Vec<Json>> {
    static EMPTY: Json = Json::String(String::new());
    let mut merged: Vec<Json> = Vec::with_capacity(messages.len());
    for message in messages {
        let role = role_of(message)?;
        let joinable = |merged: &[Json], need_no_task: bool| -> Py<bool> {
            let Some(last) = merged.last() else {
                return Ok(false);
            };
            Ok(is_str(role_of(last)?, "user")
                && as_dict(last)?.contains_key("content_blocks")
                && (!need_no_task || get(last, "task")?.is_null()))
        };
        if is_str(role, "tool") {
            let block = json!({
                "type": "tool_result",
                "tool_use_id": get_or(message, "tool_call_id", &EMPTY)?,
                "content": get_or(message, "content", &EMPTY)?,
            });
            if joinable(&merged, false)? {
                push_block(merged.last_mut(), block)?;
            } else {
                merged.push(json!({"role": "user", "content_blocks": [block]}));
            }
        } else if is_str(role, "user") {
            let content = get_or(message, "content", &EMPTY)?;
            let block = json!({"type": "text", "text": content});
            if joinable(&merged, true)? {
                push_block(merged.last_mut(), block)?;
            } else {
                let mut new = Map::new();
                new.insert("role".into(), json!("user"));
                new.insert("content".into(), content.clone());
                new.insert("content_blocks".into(), json!([block]));
                let source = as_dict(message)?;
                for key in ["task", "wo_eos", "mask"] {
                    if let Some(value) = source.get(key) {
                        new.insert(key.into(), value.clone());
                    }
                }
                merged.push(Json::Object(new));
            }
        } else {
            merged.push(message.clone());
        }
    }
    Ok(merged)
}

fn push_block(target: Option<&mut Json>, block: Json) -> Py<()> {
    match target.and_then(|m| m.get_mut("content_blocks")) {
        Some(Json::Array(blocks)) => {
            blocks.push(block);
            Ok(())
        }
        Some(other) => raise(
            "AttributeError",
            format!("'{}' object has no attribute 'append'", py_type(other)),
        ),
        None => raise("KeyError", "'content_blocks'"),
    }
}

/// Within each user message, tool results follow the order of the preceding assistant's
/// tool calls (by id; unknown ids sort first).
fn sort_tool_results(messages: &mut [Json]) -> Py<()> {
    static EMPTY_STR: Json = Json::String(String::new());
    let empty_obj = Json::Object(Map::new());
    let mut order: Vec<(Json, usize)> = Vec::new();
    for message in messages.iter_mut() {
        let role = role_of(message)?.clone();
        if is_str(&role, "assistant") && truthy(get(message, "tool_calls")?) {
            order.clear();
            for (idx, call) in iterate(get(message, "tool_calls")?)?.iter().enumerate() {
                let id = get(call, "id")?;
                let id = if truthy(id) {
                    id
                } else {
                    get_or(get_or(call, "function", &empty_obj)?, "id", &EMPTY_STR)?
                };
                if truthy(id) {
                    hashable(id)?;
                    match order.iter_mut().find(|(k, _)| k == id) {
                        Some(entry) => entry.1 = idx,
                        None => order.push((id.clone(), idx)),
                    }
                }
            }
        } else if is_str(&role, "user") && truthy(get(message, "content_blocks")?) {
            let blocks: Vec<Json> = iterate(get(message, "content_blocks")?)?
                .into_iter()
                .map(Cow::into_owned)
                .collect();
            let mut tool_blocks = Vec::new();
            for block in &blocks {
                if is_str(get(block, "type")?, "tool_result") {
                    tool_blocks.push(block.clone());
                }
            }
            if tool_blocks.len() > 1 && !order.is_empty() {
                let mut keyed = Vec::with_capacity(tool_blocks.len());
                for block in tool_blocks {
                    let id = get_or(&block, "tool_use_id", &EMPTY_STR)?;
                    hashable(id)?;
                    let key = order.iter().find(|(k, _)| k == id).map_or(0, |(_, v)| *v);
                    keyed.push((key, block));
                }
                keyed.sort_by_key(|(key, _)| *key);
                let mut sorted = keyed.into_iter().map(|(_, b)| b);
                let mut new_blocks = Vec::with_capacity(blocks.len());
                for block in blocks {
                    if is_str(get(&block, "type")?, "tool_result") {
                        new_blocks.extend(sorted.next());
                    } else {
                        new_blocks.push(block);
                    }
                }
                if let Json::Object(map) = message {
                    map.insert("content_blocks".into(), Json::Array(new_blocks));
                }
            }
        }
    }
    Ok(())
}

fn encode_v4(messages: &[Json], options: &EncodeOptions) -> Py<String> {
    let merged = merge_tool_messages(messages)?;
    let raw_context = options.context()?;
    let n_context = raw_context.len();
    let mut combined: Vec<Json> = raw_context.iter().cloned().chain(merged).collect();
    sort_tool_results(&mut combined)?;
    let messages = combined.split_off(n_context);
    let context = if n_context > 0 {
        let mut context = merge_tool_messages(&combined)?;
        sort_tool_results(&mut context)?;
        context
    } else {
        Vec::new()
    };
    let mut full: Vec<Json> = context.iter().chain(&messages).cloned().collect();
    let mut prompt = String::new();
    if options.add_default_bos_token && context.is_empty() {
        prompt.push_str(BOS);
    }
    let mut any_tools = false;
    for message in &full {
        any_tools |= truthy(get(message, "tools")?);
    }
    let drop = options.drop_thinking && !any_tools;
    let (count, context_len) = if options.thinking() && drop {
        full = drop_thinking(&full, &KEEP_V4)?;
        let count = full.len() as isize - drop_thinking(&context, &KEEP_V4)?.len() as isize;
        (count, full.len() as isize - count)
    } else {
        (messages.len() as isize, context.len() as isize)
    };
    let effective = EncodeOptions {
        drop_thinking: drop,
        ..options.clone()
    };
    for idx in 0..count.max(0) {
        render_v4((idx + context_len) as usize, &full, &effective, &mut prompt)?;
    }
    Ok(prompt)
}

fn render_v4(
    index: usize,
    messages: &[Json],
    options: &EncodeOptions,
    prompt: &mut String,
) -> Py<()> {
    if index >= messages.len() {
        return raise("AssertionError", "");
    }
    if !options.mode_is_valid() {
        return raise(
            "AssertionError",
            format!("Invalid thinking_mode `{}`", py_str(&options.thinking_mode)),
        );
    }
    static FALSE: Json = Json::Bool(false);
    static EMPTY: Json = Json::String(String::new());
    let message = &messages[index];
    let last_user = find_last_user_index(messages)?;
    let f = fields(message)?;
    let wo_eos = get_or(message, "wo_eos", &FALSE)?;
    let effort = &options.reasoning_effort;
    if !(effort.is_null() || is_str(effort, "max") || is_str(effort, "high")) {
        return raise(
            "AssertionError",
            format!("Invalid reasoning effort: {}", py_str(effort)),
        );
    }
    let idx = index as isize;
    let thinking = options.thinking();
    if index == 0 && thinking && is_str(effort, "max") {
        prompt.push_str(REASONING_EFFORT_MAX);
    }
    match f.role.as_str() {
        Some("system") => prompt.push_str(&system_text(DeepSeekVersion::V4, &f)),
        Some("developer") => {
            if !truthy(f.content) {
                return raise(
                    "AssertionError",
                    format!("Invalid message for role `developer`: {}", repr(message)),
                );
            }
            prompt.push_str(USER_TOKEN);
            prompt.push_str(concat_operand(f.content)?);
            if let Some(tools) = &f.tools {
                prompt.push_str("\n\n");
                prompt.push_str(&render_tools(DeepSeekVersion::V4, tools));
            }
            if truthy(f.response_format) {
                prompt.push_str(&response_format_text(f.response_format));
            }
        }
        Some("user") => {
            prompt.push_str(USER_TOKEN);
            let blocks = get(message, "content_blocks")?;
            if truthy(blocks) {
                let mut parts: Vec<Cow<'_, Json>> = Vec::new();
                for block in iterate(blocks)? {
                    let kind = get(&block, "type")?;
                    if is_str(kind, "text") {
                        parts.push(Cow::Owned(get_or(&block, "text", &EMPTY)?.clone()));
                    } else if is_str(kind, "tool_result") {
                        let content = get_or(&block, "content", &EMPTY)?;
                        let text = match content {
                            Json::Array(items) => {
                                let mut texts: Vec<Cow<'_, Json>> = Vec::new();
                                for item in items {
                                    let item_kind = get(item, "type")?;
                                    if is_str(item_kind, "text") {
                                        texts.push(Cow::Borrowed(get_or(item, "text", &EMPTY)?));
                                    } else {
                                        texts.push(Cow::Owned(Json::String(format!(
                                            "[Unsupported {}]",
                                            py_str(item_kind)
                                        ))));
                                    }
                                }
                                join_strings(&texts, "\n\n")?
                            }
                            other => py_str(other).into_owned(),
                        };
                        parts.push(Cow::Owned(Json::String(format!(
                            "<tool_result>{text}</tool_result>"
                        ))));
                    } else {
                        parts.push(Cow::Owned(Json::String(format!(
                            "[Unsupported {}]",
                            py_str(kind)
                        ))));
                    }
                }
                prompt.push_str(&join_strings(&parts, "\n\n")?);
            } else if truthy(f.content) {
                prompt.push_str(concat_operand(f.content)?);
            }
        }
        Some("latest_reminder") => {
            prompt.push_str(LATEST_REMINDER_TOKEN);
            prompt.push_str(&py_str(f.content));
        }
        Some("tool") => {
            return raise(
                "NotImplementedError",
                "deepseek_v4 merges tool messages into user; please preprocess with merge_tool_messages()",
            );
        }
        Some("assistant") => {
            let calls_text = match &f.tool_calls {
                Some(calls) => tool_calls_block(calls, "tool_calls")?,
                None => String::new(),
            };
            let prev_has_task = index >= 1 && !get(&messages[index - 1], "task")?.is_null();
            if thinking && !prev_has_task && (!options.drop_thinking || idx > last_user) {
                prompt.push_str(&or_empty(f.reasoning_content));
                prompt.push_str(THINK_END);
            }
            prompt.push_str(&or_empty(f.content));
            prompt.push_str(&calls_text);
            if !truthy(wo_eos) {
                prompt.push_str(EOS);
            }
        }
        _ => {
            return raise(
                "NotImplementedError",
                format!("Unknown role: {}", py_str(f.role)),
            );
        }
    }

    // What follows this message decides the transition tokens.
    if index + 1 < messages.len() {
        let next = role_of(&messages[index + 1])?;
        if !(is_str(next, "assistant") || is_str(next, "latest_reminder")) {
            return Ok(());
        }
    }
    let task = get(message, "task")?;
    if !task.is_null() {
        hashable(task)?;
        let Some(token) = V4_TASKS
            .iter()
            .find(|(name, _)| is_str(task, name))
            .map(|(_, token)| *token)
        else {
            return raise(
                "AssertionError",
                format!(
                    "Invalid task: '{}'. Valid tasks are: {:?}",
                    py_str(task),
                    V4_TASKS.map(|(name, _)| name)
                ),
            );
        };
        if is_str(task, "action") {
            prompt.push_str(ASSISTANT_TOKEN);
            prompt.push_str(if thinking { THINK_START } else { THINK_END });
        }
        prompt.push_str(token);
    } else if is_str(f.role, "user") || is_str(f.role, "developer") {
        prompt.push_str(ASSISTANT_TOKEN);
        prompt.push_str(options.opener(idx >= last_user));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Miles' bridge
// ---------------------------------------------------------------------------------------------

/// The encoder call Miles' bridge makes for chat-template `kwargs`: `enable_thinking`, then
/// `thinking`, set `thinking_mode` when it is not given (true → `"thinking"`, false →
/// `"chat"`; null is ignored), defaulting to `"thinking"`; every other kwarg is an encoder
/// keyword.
fn encode_config(version: DeepSeekVersion, kwargs: &Map<String, Json>) -> Py<EncodeOptions> {
    let mut kwargs = kwargs.clone();
    for alias in ["enable_thinking", "thinking"] {
        if let Some(value) = kwargs.shift_remove(alias)
            && !value.is_null()
        {
            let mode = if truthy(&value) { "thinking" } else { "chat" };
            kwargs.entry("thinking_mode").or_insert(json!(mode));
        }
    }
    let mut options = EncodeOptions::default();
    for (key, value) in kwargs {
        match key.as_str() {
            "thinking_mode" => options.thinking_mode = value,
            "context" => options.context = value,
            "drop_thinking" => options.drop_thinking = truthy(&value),
            "add_default_bos_token" => options.add_default_bos_token = truthy(&value),
            "reasoning_effort" if version == DeepSeekVersion::V4 => {
                options.reasoning_effort = value;
            }
            other => {
                return raise(
                    "TypeError",
                    format!("encode_messages() got an unexpected keyword argument '{other}'"),
                );
            }
        }
    }
    Ok(options)
}

/// Whether chat-template `kwargs` resolve to thinking mode (Miles'
/// `render_thinking_enabled`): the resolved `thinking_mode` is `"thinking"`.
pub fn thinking_enabled(kwargs: &Map<String, Json>) -> bool {
    let mut mode = kwargs.get("thinking_mode").cloned();
    for alias in ["enable_thinking", "thinking"] {
        if mode.is_none()
            && let Some(value) = kwargs.get(alias)
            && !value.is_null()
        {
            mode = Some(json!(if truthy(value) { "thinking" } else { "chat" }));
        }
    }
    mode.is_none_or(|m| is_str(&m, "thinking"))
}

/// A pydantic (lax mode) `bool`.
fn lax_bool(value: &Json, field: &str) -> Py<bool> {
    const TRUE: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
    const FALSE: [&str; 6] = ["0", "off", "f", "false", "n", "no"];
    let parsed = match value {
        Json::Bool(b) => Some(*b),
        Json::Number(n) => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f == 1.0 {
                Some(true)
            } else if f == 0.0 {
                Some(false)
            } else {
                None
            }
        }
        Json::String(s) => {
            let lower = s.to_lowercase();
            if TRUE.contains(&lower.as_str()) {
                Some(true)
            } else if FALSE.contains(&lower.as_str()) {
                Some(false)
            } else {
                None
            }
        }
        _ => None,
    };
    parsed.map_or_else(
        || {
            raise(
                "ValidationError",
                format!("{field}: Input should be a valid boolean"),
            )
        },
        Ok,
    )
}

fn optional_lax_bool(value: Option<&Json>, field: &str) -> Py<Option<bool>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(v) => lax_bool(v, field).map(Some),
    }
}

fn required_str(value: Option<&Json>, field: &str) -> Py<Json> {
    match value {
        Some(Json::String(s)) => Ok(Json::String(s.clone())),
        None => raise("ValidationError", format!("{field}: Field required")),
        Some(_) => raise(
            "ValidationError",
            format!("{field}: Input should be a valid string"),
        ),
    }
}

/// sglang's `Tool.model_validate(tool).model_dump()`: the tool validated (unknown keys
/// dropped) and dumped with every field.
fn tool_dump(tool: &Json) -> Py<Json> {
    let Json::Object(map) = tool else {
        return raise(
            "ValidationError",
            "Input should be a valid dictionary or instance of Tool",
        );
    };
    let kind = match map.get("type") {
        None => json!("function"),
        Some(v) => required_str(Some(v), "type")?,
    };
    let function = match map.get("function") {
        None => return raise("ValidationError", "function: Field required"),
        Some(Json::Object(f)) => f,
        Some(_) => {
            return raise(
                "ValidationError",
                "function: Input should be a valid dictionary or instance of Function",
            );
        }
    };
    let description = match function.get("description") {
        None | Some(Json::Null) => Json::Null,
        Some(v) => required_str(Some(v), "function.description")?,
    };
    let name = required_str(function.get("name"), "function.name")?;
    let parameters = function.get("parameters").cloned().unwrap_or(Json::Null);
    let strict = match function.get("strict") {
        None => false,
        Some(v) => lax_bool(v, "function.strict")?,
    };
    let function_defer =
        optional_lax_bool(function.get("defer_loading"), "function.defer_loading")?;
    let tool_defer = optional_lax_bool(map.get("defer_loading"), "defer_loading")?;
    let mut out_function = Map::new();
    out_function.insert("description".into(), description);
    out_function.insert("name".into(), name);
    out_function.insert("parameters".into(), parameters);
    out_function.insert("strict".into(), Json::Bool(strict));
    if let Some(defer) = function_defer.or(tool_defer) {
        out_function.insert("defer_loading".into(), Json::Bool(defer));
    }
    Ok(json!({
        "type": kind,
        "function": Json::Object(out_function),
        "defer_loading": tool_defer,
    }))
}

/// Miles' `normalize_tool_arguments(messages, "json")` as far as it changes a render: an
/// assistant message's missing or null `content` becomes `""` (arguments given as objects
/// and as JSON strings render alike).
fn normalise(messages: &[Json]) -> Py<Vec<Json>> {
    let mut out = Vec::with_capacity(messages.len());
    for message in messages {
        let mut message = message.clone();
        if is_str(role_of(&message)?, "assistant") {
            if get(&message, "content")?.is_null()
                && let Json::Object(map) = &mut message
            {
                map.insert("content".into(), json!(""));
            }
            if let Json::Array(calls) = get(&message, "tool_calls")? {
                for call in calls {
                    let function = get(call, "function")?;
                    if truthy(function) {
                        get(function, "arguments")?;
                    }
                }
            }
        }
        out.push(message);
    }
    Ok(out)
}

fn bridge(
    version: DeepSeekVersion,
    messages: &[Json],
    tools: Option<&[Json]>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Json>,
) -> Py<String> {
    let mut messages = normalise(messages)?;
    // An unknown keyword is reported when the encoder is called, after the tools are
    // validated, as in Python.
    let config = encode_config(version, kwargs);
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let first_is_system = match messages.first() {
            Some(first) => is_str(role_of(first)?, "system"),
            None => false,
        };
        if !first_is_system {
            messages.insert(0, json!({"role": "system", "content": ""}));
        }
        let dumps = tools.iter().map(tool_dump).collect::<Py<Vec<Json>>>()?;
        if let Json::Object(first) = &mut messages[0] {
            first.insert("tools".into(), Json::Array(dumps));
        }
    }
    let options = config?;
    let rendered = match version {
        DeepSeekVersion::V32 => encode_v32(&messages, &options)?,
        DeepSeekVersion::V4 => encode_v4(&messages, &options)?,
    };
    let Some(last) = messages.last() else {
        return Ok(rendered);
    };
    if add_generation_prompt {
        return Ok(rendered);
    }
    let think = if options.thinking() {
        THINK_START
    } else {
        THINK_END
    };
    match version.generation_suffix(role_of(last)?, think) {
        Some(suffix) if rendered.ends_with(&suffix) => {
            Ok(rendered[..rendered.len() - suffix.len()].to_owned())
        }
        _ => Ok(rendered),
    }
}

/// Miles' `apply_chat_template` for a DeepSeek checkpoint (`template.py` →
/// `deepseek.apply_chat_template`): renders `messages` with the version's encoder under the
/// chat-template `kwargs` (see the module docs), with `tools` injected into the first system
/// message, and without the next assistant opener when `add_generation_prompt` is false.
pub fn apply_chat_template(
    version: DeepSeekVersion,
    messages: &[Json],
    tools: Option<&[Json]>,
    add_generation_prompt: bool,
    kwargs: &Map<String, Json>,
) -> Result<String> {
    bridge(version, messages, tools, add_generation_prompt, kwargs)
        .map_err(|e| e.into_error(version))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(version: DeepSeekVersion, messages: Json, kwargs: Json, gen_prompt: bool) -> String {
        apply_chat_template(
            version,
            messages.as_array().unwrap(),
            None,
            gen_prompt,
            kwargs.as_object().unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn v32_user_turns_and_generation_suffix() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        let kwargs = json!({"drop_thinking": false, "thinking": true});
        assert_eq!(
            render(DeepSeekVersion::V32, messages.clone(), kwargs.clone(), true),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
        );
        assert_eq!(
            render(DeepSeekVersion::V32, messages, kwargs, false),
            "<｜begin▁of▁sentence｜><｜User｜>hi"
        );
    }

    #[test]
    fn v4_folds_tool_results_into_one_user_turn() {
        let messages = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{\"x\": \"y\"}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
        ]);
        let text = render(
            DeepSeekVersion::V4,
            messages,
            json!({"thinking": false}),
            true,
        );
        assert!(text.ends_with(
            "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result><｜Assistant｜></think>"
        ));
        assert!(
            text.contains("<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>")
        );
        assert!(
            text.contains("<｜DSML｜parameter name=\"x\" string=\"true\">y</｜DSML｜parameter>")
        );
    }

    #[test]
    fn thinking_resolution_follows_the_bridge() {
        let map = |v: Json| v.as_object().unwrap().clone();
        assert!(thinking_enabled(&Map::new()));
        assert!(!thinking_enabled(&map(json!({"enable_thinking": false}))));
        assert!(thinking_enabled(&map(
            json!({"thinking": false, "enable_thinking": true})
        )));
        assert!(!thinking_enabled(&map(
            json!({"thinking_mode": "chat", "enable_thinking": true})
        )));
        assert!(thinking_enabled(&map(
            json!({"enable_thinking": null, "thinking": null})
        )));
        assert!(!thinking_enabled(&map(json!({"thinking_mode": null}))));
    }

    #[test]
    fn json_string_arguments_differ_from_python_only_where_documented() {
        // COMPATIBILITY.md: Python's json.loads accepts NaN and keeps big integers exact.
        let dsml = |args: &str| encode_arguments_to_dsml(&json!(args));
        assert!(matches!(
            dsml("{\"x\": NaN}"),
            Err(Raise {
                exception: "JSONDecodeError",
                ..
            })
        ));
        let big = dsml("{\"x\": 123456789012345678901234567890}")
            .ok()
            .unwrap();
        assert!(big.contains(">1.2345678901234568e+29<"), "{big}");
        let neg_zero = dsml("{\"x\": -0}").ok().unwrap();
        assert!(neg_zero.contains(">-0.0<"), "{neg_zero}");
        // Everything else round-trips as Python prints it.
        let text = dsml("{\"f\": 1.0, \"e\": 1E3, \"s\": \"\\u00e9\", \"l\": [1, null, true]}")
            .ok()
            .unwrap();
        assert_eq!(
            text,
            "<｜DSML｜parameter name=\"f\" string=\"false\">1.0</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"e\" string=\"false\">1000.0</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"s\" string=\"true\">é</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"l\" string=\"false\">[1, null, true]</｜DSML｜parameter>"
        );
    }

    #[test]
    fn rejected_input_names_the_python_exception() {
        let err = apply_chat_template(
            DeepSeekVersion::V32,
            &[json!({"role": "user", "content": "x"})],
            None,
            true,
            json!({"reasoning_effort": "max"}).as_object().unwrap(),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            Error::DeepSeekEncoding {
                exception: "TypeError",
                ..
            }
        ));
        let err = apply_chat_template(
            DeepSeekVersion::V4,
            &[json!({"role": "user", "content": "x"}), json!(3)],
            None,
            true,
            &Map::new(),
        )
        .unwrap_err();
        assert!(matches!(
            err,
            Error::DeepSeekEncoding {
                exception: "AttributeError",
                ..
            }
        ));
    }
}
