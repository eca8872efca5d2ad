//! Miles' bridge to the encoders (its `apply_chat_template` for DeepSeek checkpoints) and the
//! public entry points [`DeepSeekVersion::encode_messages`] and
//! [`DeepSeekVersion::apply_chat_template`].

use serde_json::{Map, Value as Json, json};

use super::common::*;
use super::pydict::*;
use super::tokens::*;
use super::v4::encode_v4;
use super::v32::encode_v32;
use super::version::DeepSeekVersion;
use crate::error::Result;

impl DeepSeekVersion {
    /// Runs the version's `encode_messages`.
    pub fn encode_messages(
        self,
        messages: &[Json],
        options: &DeepSeekEncodeOptions,
    ) -> Result<String> {
        match self {
            DeepSeekVersion::V32 => encode_v32(messages, options),
            DeepSeekVersion::V4 => encode_v4(messages, options),
        }
        .map_err(|e| e.into_error(self))
    }

    /// Miles' `apply_chat_template` for a DeepSeek checkpoint (`template.py` →
    /// `deepseek.apply_chat_template`): renders `messages` with the version's encoder under
    /// the chat-template `kwargs` (tool-call arguments as JSON, the thinking mode resolved from
    /// `thinking_mode` / `enable_thinking` / `thinking`), with `tools` injected into the first
    /// system message, and without the next assistant opener when `add_generation_prompt` is
    /// false.
    pub fn apply_chat_template(
        self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String> {
        bridge(self, messages, tools, add_generation_prompt, kwargs).map_err(|e| e.into_error(self))
    }
}

/// The encoder call Miles' bridge makes for chat-template `kwargs`: `enable_thinking`, then
/// `thinking`, set `thinking_mode` when it is not given (true → `"thinking"`, false →
/// `"chat"`; null is ignored), defaulting to `"thinking"`; every other kwarg is an encoder
/// keyword.
pub(super) fn encode_config(
    version: DeepSeekVersion,
    kwargs: &Map<String, Json>,
) -> Py<DeepSeekEncodeOptions> {
    let mut kwargs = kwargs.clone();
    for alias in ["enable_thinking", "thinking"] {
        if let Some(value) = kwargs.shift_remove(alias)
            && !value.is_null()
        {
            let mode = if truthy(&value) { "thinking" } else { "chat" };
            kwargs.entry("thinking_mode").or_insert(json!(mode));
        }
    }
    let mut options = DeepSeekEncodeOptions::default();
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
pub(crate) fn thinking_enabled(kwargs: &Map<String, Json>) -> bool {
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

/// A pydantic (lax mode) `bool` ([`miles_core::pydantic_lax_bool`]), else pydantic's error.
pub(super) fn lax_bool(value: &Json, field: &str) -> Py<bool> {
    let parsed = miles_core::pydantic_lax_bool(value);
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

pub(super) fn optional_lax_bool(value: Option<&Json>, field: &str) -> Py<Option<bool>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(v) => lax_bool(v, field).map(Some),
    }
}

pub(super) fn required_str(value: Option<&Json>, field: &str) -> Py<Json> {
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
pub(super) fn tool_dump(tool: &Json) -> Py<Json> {
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
pub(super) fn normalise(messages: &[Json]) -> Py<Vec<Json>> {
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

pub(super) fn bridge(
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
