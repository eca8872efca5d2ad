//! Compiled renderers for chat templates miles-tito ships: the same text as the Jinja
//! template through minijinja, written as Rust.
//!
//! A [`ChatTemplate`](crate::ChatTemplate) whose source is byte-identical to a template known
//! here renders through its compiled form when the input has the shapes the compiled form
//! handles (string roles, string system contents, tool calls as a list of objects with string
//! names and object or string arguments); any other input (a list system content, a
//! non-string tool name or role, …) renders through minijinja as before, so the output and
//! the errors never differ from the template's.
//! `tests` below check the equality on generated conversations.
//!
//! A session renders two small conversations per turn (the synthetic context of
//! `tokenize_additional_messages`, without and with the appended messages); through minijinja
//! most of that is interpreter work, compiled it is string appends.

use miles_core::python::{self, JsonDumpOptions, truthy};
use serde_json::{Map, Value as Json};

use crate::args::RenderArgs;

/// A template with a compiled renderer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compiled {
    /// `templates/qwen3_fixed.jinja` (the `qwen3` family).
    Qwen3Fixed,
    /// `templates/qwen3_thinking_2507_and_next_fixed.jinja` (the `qwennext` family): the
    /// same template with a generation prompt that opens `<think>`.
    QwenNextFixed,
}

pub(crate) const QWEN3_FIXED: &str = include_str!("../templates/qwen3_fixed.jinja");
pub(crate) const QWEN_NEXT_FIXED: &str =
    include_str!("../templates/qwen3_thinking_2507_and_next_fixed.jinja");

const QWEN3_TOOLS_HEADER: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";
const QWEN3_TOOLS_FOOTER: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

impl Compiled {
    /// The compiled form of `source`, if it has one.
    pub(crate) fn detect(source: &str) -> Option<Self> {
        if source == QWEN3_FIXED {
            Some(Self::Qwen3Fixed)
        } else if source == QWEN_NEXT_FIXED {
            Some(Self::QwenNextFixed)
        } else {
            None
        }
    }

    /// Renders `args`, or `None` when the input needs the Jinja template. `special_tokens`
    /// are the template variables under the kwargs; `tools_text` gives
    /// `"\n" ~ tool|tojson` over every tool, concatenated.
    pub(crate) fn render(
        self,
        args: &RenderArgs<'_>,
        special_tokens: &Map<String, Json>,
        tools_text: impl FnOnce(&[Json]) -> std::sync::Arc<str>,
    ) -> Option<String> {
        let variable = |key: &str| lookup(args.kwargs, key).or_else(|| lookup(special_tokens, key));
        qwen3_fixed(args, variable, tools_text, self == Self::QwenNextFixed)
    }
}

/// A message field as the template sees it after HF's normalisation: `None` when absent or
/// null (null-valued keys are dropped).
fn field<'a>(message: &'a Map<String, Json>, key: &str) -> Option<&'a Json> {
    lookup(message, key).filter(|v| !v.is_null())
}

/// `map.get(key)`; a scan when the map is small (a message, a kwargs map), which is cheaper
/// than hashing the key with serde_json's SipHash.
fn lookup<'a>(map: &'a Map<String, Json>, key: &str) -> Option<&'a Json> {
    if map.len() <= 8 {
        map.iter().find_map(|(k, v)| (k == key).then_some(v))
    } else {
        map.get(key)
    }
}

/// A message's role, which the compiled renderers need to be a string.
fn role(message: &Map<String, Json>) -> Option<&str> {
    field(message, "role")?.as_str()
}

/// `qwen3_fixed.jinja`, or with `next` its Qwen3-Next / thinking-2507 variant (whose
/// generation prompt always opens `<think>`).
fn qwen3_fixed<'v>(
    args: &RenderArgs<'_>,
    variable: impl Fn(&str) -> Option<&'v Json>,
    tools_text: impl FnOnce(&[Json]) -> std::sync::Arc<str>,
    next: bool,
) -> Option<String> {
    let messages: Vec<&Map<String, Json>> = args
        .messages
        .iter()
        .map(Json::as_object)
        .collect::<Option<_>>()?;
    let roles: Vec<&str> = messages.iter().map(|m| role(m)).collect::<Option<_>>()?;
    let first = *messages.first()?;
    let size: usize = messages
        .iter()
        .map(|m| {
            field(m, "content")
                .and_then(Json::as_str)
                .map_or(0, str::len)
                + 64
        })
        .sum();
    let mut out = String::with_capacity(size + 512);

    // The system block, with the tool list when there is one.
    let tools = args.tools.filter(|t| !t.is_empty());
    let system_content = || field(first, "content").and_then(Json::as_str);
    if let Some(tools) = tools {
        out.push_str("<|im_start|>system\n");
        if roles[0] == "system" {
            out.push_str(system_content()?);
            out.push_str("\n\n");
        }
        out.push_str(QWEN3_TOOLS_HEADER);
        out.push_str(&tools_text(tools));
        out.push_str(QWEN3_TOOLS_FOOTER);
    } else if roles[0] == "system" {
        out.push_str("<|im_start|>system\n");
        out.push_str(system_content()?);
        out.push_str("<|im_end|>\n");
    }

    // The last user query that is not a wrapped tool response.
    let mut last_query_index = messages.len() - 1;
    for (index, message) in messages.iter().enumerate().rev() {
        if roles[index] == "user"
            && let Some(content) = field(message, "content").and_then(Json::as_str)
            && !(content.starts_with("<tool_response>") && content.ends_with("</tool_response>"))
        {
            last_query_index = index;
            break;
        }
    }
    // `not (clear_thinking | default(true))`: every assistant turn keeps its reasoning.
    let keep_all_reasoning = match variable("clear_thinking") {
        None => false,
        Some(value) => !truthy(value),
    };

    for (index, message) in messages.iter().enumerate() {
        let role = roles[index];
        let mut content = field(message, "content")
            .and_then(Json::as_str)
            .unwrap_or("");
        if role == "user" || (role == "system" && index > 0) {
            for part in ["<|im_start|>", role, "\n", content, "<|im_end|>\n"] {
                out.push_str(part);
            }
        } else if role == "assistant" {
            let reasoning = ["reasoning_content", "thinking", "reasoning"]
                .iter()
                .find_map(|key| field(message, key));
            let mut reasoning_content = "";
            match reasoning.map(|r| r.as_str()) {
                Some(Some(text)) => reasoning_content = text,
                _ => {
                    if let Some((before, _)) = content.split_once("</think>") {
                        let before = before.trim_end_matches('\n');
                        reasoning_content = before
                            .rsplit_once("<think>")
                            .map_or(before, |(_, after)| after)
                            .trim_start_matches('\n');
                        content = content
                            .rsplit_once("</think>")
                            .map_or(content, |(_, after)| after)
                            .trim_start_matches('\n');
                    }
                }
            }
            if keep_all_reasoning || index > last_query_index {
                out.push_str("<|im_start|>assistant\n<think>\n");
                out.push_str(reasoning_content.trim_matches('\n'));
                out.push_str("\n</think>\n\n");
                out.push_str(content.trim_start_matches('\n'));
            } else {
                out.push_str("<|im_start|>assistant\n");
                out.push_str(content);
            }
            if let Some(calls) = field(message, "tool_calls")
                && truthy(calls)
            {
                for (position, call) in calls.as_array()?.iter().enumerate() {
                    if position > 0 || !content.is_empty() {
                        out.push('\n');
                    }
                    let mut call = call.as_object()?;
                    if let Some(function) = field(call, "function")
                        && truthy(function)
                    {
                        call = function.as_object()?;
                    }
                    out.push_str("<tool_call>\n{\"name\": \"");
                    out.push_str(field(call, "name")?.as_str()?);
                    out.push_str("\", \"arguments\": ");
                    match field(call, "arguments")? {
                        Json::String(text) => out.push_str(text),
                        arguments @ Json::Object(_) => {
                            out.push_str(&python::json_dumps(
                                arguments,
                                &JsonDumpOptions::unicode(),
                            ));
                        }
                        _ => return None,
                    }
                    out.push_str("}\n</tool_call>");
                }
            }
            out.push_str("<|im_end|>\n");
        } else if role == "tool" {
            if index == 0 || roles[index - 1] != "tool" {
                out.push_str("<|im_start|>user");
            }
            out.push_str("\n<tool_response>\n");
            out.push_str(content);
            out.push_str("\n</tool_response>");
            if index + 1 == messages.len() || roles[index + 1] != "tool" {
                out.push_str("<|im_end|>\n");
            }
        }
    }

    if args.add_generation_prompt {
        if next {
            out.push_str("<|im_start|>assistant\n<think>\n");
        } else {
            out.push_str("<|im_start|>assistant\n");
            if variable("enable_thinking") == Some(&Json::Bool(false)) {
                out.push_str("<think>\n\n</think>\n\n");
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn compiled_form_only_for_the_exact_source() {
        assert_eq!(Compiled::detect(QWEN3_FIXED), Some(Compiled::Qwen3Fixed));
        assert_eq!(
            Compiled::detect(QWEN_NEXT_FIXED),
            Some(Compiled::QwenNextFixed)
        );
        assert_eq!(Compiled::detect(&format!("{QWEN3_FIXED}\n")), None);
        assert_eq!(Compiled::detect("{{ messages }}"), None);
    }

    #[test]
    fn session_shapes_take_the_compiled_path() {
        let messages = vec![
            json!({"role": "system", "content": "dummy system"}),
            json!({"role": "assistant", "content": "", "reasoning_content": " ",
                   "tool_calls": [{"id": "c1", "type": "function",
                                   "function": {"name": "f", "arguments": {"a": [1, 2.5]}}}]}),
            json!({"role": "tool", "content": "ok", "tool_call_id": "c1"}),
        ];
        let mut kwargs = Map::new();
        kwargs.insert("clear_thinking".into(), json!(false));
        let args = RenderArgs {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            kwargs: &kwargs,
        };
        let text = Compiled::Qwen3Fixed
            .render(&args, &Map::new(), |_| "".into())
            .expect("compiled");
        assert_eq!(
            text,
            "<|im_start|>system\ndummy system<|im_end|>\n<|im_start|>assistant\n<think>\n \n</think>\n\n\
             <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2.5]}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
