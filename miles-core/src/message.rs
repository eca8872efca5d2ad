//! OpenAI-shaped chat messages, tool calls and tool specifications.
//!
//! These are the shapes agents send to the session server and chat templates render. They
//! round-trip through serde exactly as the OpenAI chat-completions API spells them; fields
//! that are absent (or `null`) are skipped when serialising, the way HF transformers drops
//! `null`-valued message keys before rendering.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// System instructions.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call.
    Tool,
    /// Instructions from the application developer (current OpenAI clients send it in place
    /// of `system`; SGLang accepts it). Rendered as the chat template renders it.
    Developer,
}

impl Role {
    /// The role's wire name (`"system"`, `"user"`, `"assistant"`, `"tool"`, `"developer"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
            Self::Developer => "developer",
        }
    }
}

/// Message content: plain text or a list of typed parts (`[{"type": "text", "text": …}]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts, kept as JSON objects so templates see them as sent.
    Parts(Vec<Value>),
}

impl Content {
    /// The text of the content: the string itself, or the concatenation of the `text` of
    /// every `{"type": "text"}` part.
    pub fn text(&self) -> String {
        match self {
            Self::Text(text) => text.clone(),
            Self::Parts(parts) => parts
                .iter()
                .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect(),
        }
    }
}

impl From<&str> for Content {
    fn from(text: &str) -> Self {
        Self::Text(text.to_owned())
    }
}

impl From<String> for Content {
    fn from(text: String) -> Self {
        Self::Text(text)
    }
}

/// One chat message.
///
/// Unknown keys are preserved in [`Message::extra`] so that templates which read custom keys
/// render exactly what the agent sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// The text (absent for an assistant turn that only calls tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The model's reasoning, separated from `content` (thinking models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls made by an assistant turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// For a `tool` message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For a `tool` message: the tool's name; otherwise an optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any other keys, as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Message {
    /// A message with the given role and text content and nothing else.
    pub fn new(role: Role, content: impl Into<Content>) -> Self {
        Self {
            role,
            content: Some(content.into()),
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
            extra: Map::new(),
        }
    }

    /// A system message.
    pub fn system(content: impl Into<Content>) -> Self {
        Self::new(Role::System, content)
    }

    /// A user message.
    pub fn user(content: impl Into<Content>) -> Self {
        Self::new(Role::User, content)
    }

    /// An assistant message with text content.
    pub fn assistant(content: impl Into<Content>) -> Self {
        Self::new(Role::Assistant, content)
    }

    /// A tool-result message answering the call `tool_call_id`.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<Content>) -> Self {
        Self {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }

    /// Sets the reasoning content.
    pub fn with_reasoning(mut self, reasoning: impl Into<String>) -> Self {
        self.reasoning_content = Some(reasoning.into());
        self
    }

    /// Sets the tool calls.
    pub fn with_tool_calls(mut self, calls: Vec<ToolCall>) -> Self {
        self.tool_calls = Some(calls);
        self
    }

    /// Sets the name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The content's text, or `""` when there is none.
    pub fn text(&self) -> String {
        self.content.as_ref().map(Content::text).unwrap_or_default()
    }

    /// The message as a JSON object with `null`-valued keys removed (what HF transformers
    /// hands to a chat template).
    pub fn to_template_value(&self) -> Value {
        let mut value = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Value::Object(map) = &mut value {
            map.retain(|_, v| !v.is_null());
        }
        value
    }
}

/// A call of a function tool made by the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call id (`call_…`), echoed by the tool message that answers it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Position among the parallel calls of one turn (present in responses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// The function called and its arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".to_owned()
}

impl ToolCall {
    /// A function call with an id and arguments given as a JSON object.
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: Map<String, Value>,
    ) -> Self {
        Self {
            id: Some(id.into()),
            index: None,
            kind: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments: ToolArguments::Object(arguments),
            },
        }
    }
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// Its arguments.
    #[serde(default = "ToolArguments::empty")]
    pub arguments: ToolArguments,
}

/// Tool-call arguments as agents send them: a JSON object, or a string holding JSON (the
/// OpenAI wire form). Templates differ in which they need (GLM iterates an object, DeepSeek
/// prints a string), so both forms convert to the other.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ToolArguments {
    /// A JSON object.
    Object(Map<String, Value>),
    /// A string that should hold a JSON object.
    Json(String),
}

impl ToolArguments {
    /// No arguments (`{}`).
    pub fn empty() -> Self {
        Self::Object(Map::new())
    }

    /// The arguments as an object; a JSON string is parsed (an empty string is `{}`).
    pub fn to_object(&self) -> Result<Map<String, Value>> {
        match self {
            Self::Object(map) => Ok(map.clone()),
            Self::Json(text) if text.trim().is_empty() => Ok(Map::new()),
            Self::Json(text) => match serde_json::from_str::<Value>(text)? {
                Value::Object(map) => Ok(map),
                _ => Err(Error::Parse {
                    what: "tool-call arguments object",
                    input: text.clone(),
                }),
            },
        }
    }

    /// The arguments as a JSON string: a string is returned as given, an object is
    /// serialised compactly (`{"a":1}`).
    pub fn to_json_string(&self) -> String {
        match self {
            Self::Json(text) => text.clone(),
            Self::Object(map) => Value::Object(map.clone()).to_string(),
        }
    }
}

/// A tool the model may call, as listed in a request's `tools`.
///
/// Deserialising follows Miles' session server (`extract_tool_dicts`): an item without a
/// `function` key is a bare function declaration and is wrapped as
/// `{"type": "function", "function": item}`; the tool must then validate as SGLang's OpenAI
/// protocol model `Tool` does (`type` a string, `function.name` a string, `description` a
/// string or null, `strict` / `defer_loading` booleans in pydantic's lax sense), else
/// deserialising fails. Serialising gives the tool as sent (after the wrapping); what chat
/// templates see is [`ToolSpec::sglang_dump`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolSpec {
    /// `"function"` unless the client says otherwise.
    #[serde(rename = "type")]
    pub kind: String,
    /// The function's declaration.
    pub function: FunctionSpec,
    /// Any other keys of the tool object (`defer_loading`, …), as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ToolSpec {
    /// A function tool with a description and a JSON-schema `parameters` object.
    pub fn function(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Value,
    ) -> Self {
        Self {
            kind: function_type(),
            function: FunctionSpec {
                name: name.into(),
                description: Some(description.into()),
                parameters: Some(parameters),
                extra: Map::new(),
            },
            extra: Map::new(),
        }
    }

    /// The tool as SGLang's `Tool.model_validate(tool).model_dump()` gives it — what Miles'
    /// session server and SGLang's chat route hand to the chat template, so what a template's
    /// `tool | tojson` prints: `{"type", "function": {"description", "name", "parameters",
    /// "strict"[, "defer_loading"]}, "defer_loading"}` in that order, `description` /
    /// `parameters` / the tool's `defer_loading` `null` when absent, `strict` `false` when
    /// absent, the tool's `defer_loading` copied into the function when the function has none,
    /// every other key dropped. (The order holds where `serde_json`'s `preserve_order` is on,
    /// as in every crate that renders templates.)
    ///
    /// Fails on a `strict` or `defer_loading` that is no boolean in pydantic's lax sense
    /// (`true` / `false`, `0` / `1`, `"yes"`, `"off"`, …), as SGLang's validation does.
    pub fn sglang_dump(&self) -> Result<Value> {
        let function = &self.function;
        let strict = match function.extra.get("strict") {
            None => false,
            Some(v) => lax_bool(v, "tool `function.strict` as a boolean")?,
        };
        let function_defer = optional_lax_bool(
            function.extra.get("defer_loading"),
            "tool `function.defer_loading` as a boolean",
        )?;
        let tool_defer = optional_lax_bool(
            self.extra.get("defer_loading"),
            "tool `defer_loading` as a boolean",
        )?;
        let mut dumped = Map::new();
        dumped.insert(
            "description".into(),
            function
                .description
                .clone()
                .map_or(Value::Null, Value::String),
        );
        dumped.insert("name".into(), Value::String(function.name.clone()));
        dumped.insert(
            "parameters".into(),
            function.parameters.clone().unwrap_or(Value::Null),
        );
        dumped.insert("strict".into(), Value::Bool(strict));
        if let Some(defer) = function_defer.or(tool_defer) {
            dumped.insert("defer_loading".into(), Value::Bool(defer));
        }
        let mut tool = Map::new();
        tool.insert("type".into(), Value::String(self.kind.clone()));
        tool.insert("function".into(), Value::Object(dumped));
        tool.insert(
            "defer_loading".into(),
            tool_defer.map_or(Value::Null, Value::Bool),
        );
        Ok(Value::Object(tool))
    }
}

impl<'de> Deserialize<'de> for ToolSpec {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        use serde::de::Error as _;
        let mut map = Map::<String, Value>::deserialize(deserializer)?;
        if !map.contains_key("function") {
            // Miles' wrapping of a bare function declaration.
            let mut wrapped = Map::new();
            wrapped.insert("type".into(), Value::String(function_type()));
            wrapped.insert("function".into(), Value::Object(map));
            map = wrapped;
        }
        let kind = match map.remove("type") {
            None => function_type(),
            Some(Value::String(kind)) => kind,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "tool `type` must be a string, got {other}"
                )));
            }
        };
        let function = map.remove("function").unwrap_or(Value::Null);
        let function: FunctionSpec = serde_json::from_value(function)
            .map_err(|e| D::Error::custom(format!("tool `function`: {e}")))?;
        let spec = Self {
            kind,
            function,
            extra: map,
        };
        spec.sglang_dump().map_err(D::Error::custom)?;
        Ok(spec)
    }
}

/// A pydantic (lax mode) `bool`: a JSON boolean, the numbers `0` / `1`, or one of the strings
/// `0 off f false n no` / `1 on t true y yes` in any case; `None` for anything else.
pub fn pydantic_lax_bool(value: &Value) -> Option<bool> {
    const TRUE: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
    const FALSE: [&str; 6] = ["0", "off", "f", "false", "n", "no"];
    match value {
        Value::Bool(b) => Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(1.0) => Some(true),
            Some(0.0) => Some(false),
            _ => None,
        },
        Value::String(s) => {
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
    }
}

/// [`pydantic_lax_bool`], or a parse error naming `field`.
fn lax_bool(value: &Value, field: &'static str) -> Result<bool> {
    let parsed = pydantic_lax_bool(value);
    parsed.ok_or_else(|| Error::Parse {
        what: field,
        input: value.to_string(),
    })
}

fn optional_lax_bool(value: Option<&Value>, field: &'static str) -> Result<Option<bool>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => lax_bool(v, field).map(Some),
    }
}

/// The declaration of a function tool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionSpec {
    /// The function's name.
    pub name: String,
    /// What it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON schema of its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    /// Any other keys (`strict`, `defer_loading`, …), as sent.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_assistant_tool_call_round_trips() {
        let wire = json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
            }]
        });
        let message: Message = serde_json::from_value(wire).unwrap();
        assert_eq!(message.role, Role::Assistant);
        assert_eq!(message.content, None);
        let call = &message.tool_calls.as_ref().unwrap()[0];
        assert_eq!(call.function.name, "get_weather");
        assert_eq!(
            call.function.arguments.to_object().unwrap()["city"],
            json!("Paris")
        );
        // Null content is dropped, as HF transformers does before rendering.
        let back = message.to_template_value();
        assert!(back.get("content").is_none());
        assert_eq!(
            back["tool_calls"][0]["function"]["arguments"],
            json!("{\"city\": \"Paris\"}")
        );
    }

    #[test]
    fn arguments_as_object_serialise_compactly() {
        let mut args = Map::new();
        args.insert("x".into(), json!(1));
        args.insert("y".into(), json!("é"));
        let call = ToolCall::function("c", "f", args);
        assert_eq!(
            call.function.arguments.to_json_string(),
            r#"{"x":1,"y":"é"}"#
        );
        let value = serde_json::to_value(&call).unwrap();
        assert_eq!(value["type"], json!("function"));
        assert_eq!(value["function"]["arguments"], json!({"x": 1, "y": "é"}));
    }

    #[test]
    fn non_object_argument_string_is_a_typed_error() {
        let args = ToolArguments::Json("[1, 2]".into());
        assert!(matches!(args.to_object(), Err(Error::Parse { .. })));
        let broken = ToolArguments::Json("{not json".into());
        assert!(matches!(broken.to_object(), Err(Error::Json(_))));
        assert_eq!(
            ToolArguments::Json("  ".into()).to_object().unwrap(),
            Map::new()
        );
    }

    #[test]
    fn unknown_keys_and_parts_are_kept() {
        let wire = json!({
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}],
            "custom_key": 7
        });
        let message: Message = serde_json::from_value(wire.clone()).unwrap();
        assert_eq!(message.text(), "ab");
        assert_eq!(message.extra["custom_key"], json!(7));
        assert_eq!(serde_json::to_value(&message).unwrap(), wire);
    }

    #[test]
    fn tool_message_and_spec_shapes() {
        let message = Message::tool("call_9", "42").with_name("calc");
        assert_eq!(
            serde_json::to_value(&message).unwrap(),
            json!({"role": "tool", "content": "42", "tool_call_id": "call_9", "name": "calc"})
        );
        let spec = ToolSpec::function("calc", "adds", json!({"type": "object"}));
        assert_eq!(
            serde_json::to_value(&spec).unwrap(),
            json!({"type": "function", "function": {"name": "calc", "description": "adds", "parameters": {"type": "object"}}})
        );
    }

    #[test]
    fn tools_dump_as_sglang_protocol_models_do() {
        // Expected values: SGLang 0.5.16's `Tool.model_validate(t).model_dump()` after Miles'
        // wrapping (fixtures/session/miles_tool_renders.json, cases `bare_function`,
        // `defer_loading`).
        let bare: ToolSpec =
            serde_json::from_value(json!({"name": "lookup", "parameters": {"type": "object"}}))
                .unwrap();
        assert_eq!(
            bare.sglang_dump().unwrap(),
            json!({"type": "function", "function": {"description": null, "name": "lookup",
                   "parameters": {"type": "object"}, "strict": false}, "defer_loading": null})
        );
        let deferred: ToolSpec = serde_json::from_value(json!({"type": "function",
            "defer_loading": true, "function": {"name": "f", "description": "late", "parameters": {}}}))
        .unwrap();
        assert_eq!(
            deferred.sglang_dump().unwrap(),
            json!({"type": "function", "function": {"description": "late", "name": "f",
                   "parameters": {}, "strict": false, "defer_loading": true}, "defer_loading": true})
        );
        let lax: ToolSpec = serde_json::from_value(
            json!({"function": {"name": "g", "defer_loading": false, "strict": 1}}),
        )
        .unwrap();
        assert_eq!(
            lax.sglang_dump().unwrap()["function"],
            json!({"description": null, "name": "g", "parameters": null, "strict": true, "defer_loading": false})
        );
        // What SGLang's validation refuses.
        for bad in [
            json!({"function": {"name": "f", "strict": "maybe"}}),
            json!({"function": {"name": "f", "strict": null}}),
            json!({"function": {"name": "f", "description": 5}}),
            json!({"function": {"description": "d"}}),
            json!({"type": 3, "function": {"name": "f"}}),
            json!({"function": {"name": "f"}, "defer_loading": "later"}),
        ] {
            assert!(
                serde_json::from_value::<ToolSpec>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }
}
