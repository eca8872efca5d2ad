//! Reasoning and tool-call parsers for assistant output text, with SGLang's parser names
//! (`--reasoning-parser qwen3|glm45|kimi_k2`, `--tool-call-parser qwen25|glm45|glm47|kimi_k2`).
//!
//! SGLang parses the detokenized output of a chat completion into `reasoning_content`,
//! `content` and `tool_calls`; the session server must do the same from the output ids. A
//! [`ChatTokenizer`](crate::chat::ChatTokenizer) implementation decodes and hands the text to an
//! [`OutputParser`] built from the family's parser names (MILES_SPEC §1.2 table).

use std::io;

use miles_core::{ToolArguments, ToolCall, ToolSpec};
use serde::Serialize;
use serde_json::{Map, Value};

use crate::chat::ParsedAssistant;
use crate::error::{Error, Result};

/// Serialises JSON as Python's `json.dumps(v, ensure_ascii=False)` does (`", "` and `": "`
/// separators), which is how SGLang spells tool-call `arguments`.
pub fn python_json(value: &Value) -> String {
    struct PyFormatter;
    impl serde_json::ser::Formatter for PyFormatter {
        fn begin_array_value<W: ?Sized + io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter);
    match value.serialize(&mut ser) {
        Ok(()) => String::from_utf8(out).unwrap_or_default(),
        Err(_) => value.to_string(),
    }
}

/// How reasoning is separated from the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReasoningParser {
    /// `<think>…</think>` (Qwen3, Qwen3.5, Qwen-Next, Kimi K2 thinking). With
    /// `force_reasoning`, text before `</think>` is reasoning even without `<think>` (the
    /// template opened the block in the generation prompt).
    Qwen3 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// GLM-4.5 / 4.7: `<think>…</think>`.
    Glm45,
    /// Kimi K2: `<think>…</think>`.
    KimiK2,
}

impl ReasoningParser {
    /// The parser for an SGLang `--reasoning-parser` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "qwen3" => Ok(Self::Qwen3 {
                force_reasoning: false,
            }),
            "qwen3-thinking" => Ok(Self::Qwen3 {
                force_reasoning: true,
            }),
            "glm45" => Ok(Self::Glm45),
            "kimi_k2" => Ok(Self::KimiK2),
            other => Err(Error::Config(format!("unknown reasoning parser {other:?}"))),
        }
    }

    /// Splits `text` into `(reasoning, normal text)` as SGLang's detectors do: the start tag is
    /// removed and the text stripped; everything before the end tag is reasoning, the rest
    /// (stripped) is the answer. No end tag: all reasoning (generation cut short).
    pub fn parse(self, text: &str) -> (Option<String>, String) {
        let (start, end, forced) = match self {
            Self::Qwen3 { force_reasoning } => ("<think>", "</think>", force_reasoning),
            Self::Glm45 | Self::KimiK2 => ("<think>", "</think>", false),
        };
        if !forced && !text.contains(start) {
            return (None, text.to_owned());
        }
        let processed = text.replacen(start, "", 1);
        let processed = processed.trim();
        match processed.split_once(end) {
            Some((reasoning, rest)) => (Some(reasoning.to_owned()), rest.trim().to_owned()),
            None => (Some(processed.to_owned()), String::new()),
        }
    }
}

/// How tool calls are written by the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ToolCallParser {
    /// Qwen2.5 / Qwen3: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
    Qwen25,
    /// GLM-4.5: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>`.
    Glm45,
    /// GLM-4.7: as GLM-4.5 without the newlines.
    Glm47,
    /// Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    /// <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`.
    KimiK2,
}

fn known(tools: &[ToolSpec], name: &str) -> bool {
    tools.is_empty() || tools.iter().any(|t| t.function.name == name)
}

fn param_is_string(tools: &[ToolSpec], name: &str, key: &str) -> bool {
    tools
        .iter()
        .find(|t| t.function.name == name)
        .and_then(|t| t.function.parameters.as_ref())
        .and_then(|p| p.pointer(&format!("/properties/{key}/type")))
        .and_then(Value::as_str)
        == Some("string")
}

impl ToolCallParser {
    /// The parser for an SGLang `--tool-call-parser` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "qwen25" | "qwen" => Ok(Self::Qwen25),
            "glm45" | "glm" => Ok(Self::Glm45),
            "glm47" => Ok(Self::Glm47),
            "kimi_k2" => Ok(Self::KimiK2),
            other => Err(Error::Config(format!("unknown tool-call parser {other:?}"))),
        }
    }

    fn start_token(self) -> &'static str {
        match self {
            Self::Qwen25 | Self::Glm45 | Self::Glm47 => "<tool_call>",
            Self::KimiK2 => "<|tool_calls_section_begin|>",
        }
    }

    /// Splits `text` into normal text and tool calls. Calls to tools not in `tools` are dropped
    /// (as SGLang does) unless `tools` is empty. A Qwen 2.5 block that does not parse is
    /// skipped (SGLang's detector); for the other formats a call that does not parse is an
    /// error ([`OutputParser::parse`] then keeps the whole text as content, as SGLang's chat
    /// serving does).
    /// Arguments are JSON strings in Python's spelling (`{"city": "Paris"}`).
    pub fn parse(self, text: &str, tools: &[ToolSpec]) -> Result<(String, Vec<ToolCall>)> {
        let Some(at) = text.find(self.start_token()) else {
            return Ok((text.to_owned(), Vec::new()));
        };
        let normal = text[..at].trim().to_owned();
        let body = &text[at..];
        let mut calls = Vec::new();
        match self {
            Self::Qwen25 => {
                // SGLang's Qwen25Detector: blocks that are unterminated or not JSON are
                // skipped (logged), the others kept.
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
                    if known(tools, &name) {
                        calls.push((None, name, python_json(&args)));
                    }
                }
            }
            Self::Glm45 | Self::Glm47 => {
                for block in body.split("<tool_call>").skip(1) {
                    let Some((inner, _)) = block.split_once("</tool_call>") else {
                        return Err(Error::upstream(format!(
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
                            .ok_or_else(|| Error::upstream("unterminated <arg_key>"))?;
                        let v0 = after.find("<arg_value>").ok_or_else(|| {
                            Error::upstream(format!("<arg_key>{key}</arg_key> without <arg_value>"))
                        })?;
                        let after = &after[v0 + "<arg_value>".len()..];
                        let (raw, after) = after
                            .split_once("</arg_value>")
                            .ok_or_else(|| Error::upstream("unterminated <arg_value>"))?;
                        let key = key.trim();
                        let value = if param_is_string(tools, name, key) {
                            Value::String(raw.to_owned())
                        } else {
                            serde_json::from_str(raw.trim())
                                .unwrap_or_else(|_| Value::String(raw.to_owned()))
                        };
                        args.insert(key.to_owned(), value);
                        rest = after;
                    }
                    if known(tools, name) {
                        calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
                    }
                }
            }
            Self::KimiK2 => {
                for block in body.split("<|tool_call_begin|>").skip(1) {
                    let (header, after) = block
                        .split_once("<|tool_call_argument_begin|>")
                        .ok_or_else(|| {
                            Error::upstream("kimi tool call without <|tool_call_argument_begin|>")
                        })?;
                    let (args, _) = after
                        .split_once("<|tool_call_end|>")
                        .ok_or_else(|| Error::upstream("unterminated kimi tool call"))?;
                    let id = header.trim();
                    let name = id
                        .rsplit_once(':')
                        .map_or(id, |(n, _)| n)
                        .rsplit('.')
                        .next()
                        .unwrap_or_default();
                    if known(tools, name) {
                        calls.push((Some(id.to_owned()), name.to_owned(), args.trim().to_owned()));
                    }
                }
            }
        }
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(i, (id, name, args))| {
                let mut call = ToolCall::function("", name, Map::new());
                call.id = id;
                call.index = Some(i as u32);
                call.function.arguments = ToolArguments::Json(args);
                call
            })
            .collect();
        Ok((normal, calls))
    }
}

/// Reasoning + tool-call parsing of one family's output text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputParser {
    /// The reasoning parser, if the family separates reasoning.
    pub reasoning: Option<ReasoningParser>,
    /// The tool-call parser, if the family calls tools.
    pub tool_calls: Option<ToolCallParser>,
    /// End-of-turn strings removed from the end of the text first (`<|im_end|>`, …).
    pub end_of_turn: Vec<String>,
}

impl OutputParser {
    /// Parses decoded assistant output: end-of-turn strings trimmed, reasoning split off, then
    /// tool calls.
    pub fn parse(&self, text: &str, tools: &[ToolSpec]) -> Result<ParsedAssistant> {
        let mut text = text;
        while let Some(stripped) = self
            .end_of_turn
            .iter()
            .find_map(|s| text.strip_suffix(s.as_str()))
        {
            text = stripped;
        }
        let (reasoning_content, rest) = match self.reasoning {
            Some(parser) => parser.parse(text),
            None => (None, text.to_owned()),
        };
        // A malformed call is the model's mistake, not a request error: like SGLang's chat
        // serving, answer with the text as content and no calls (the agent sees it; the
        // session records the exact tokens either way).
        let (content, tool_calls) = match self.tool_calls {
            Some(parser) => parser.parse(&rest, tools).unwrap_or_else(|error| {
                tracing::warn!(%error, "tool-call parsing failed; the text is kept as content");
                (rest, Vec::new())
            }),
            None => (rest, Vec::new()),
        };
        Ok(ParsedAssistant {
            content,
            reasoning_content,
            tool_calls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<ToolSpec> {
        vec![ToolSpec::function(
            "get_weather",
            "w",
            json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}),
        )]
    }

    #[test]
    fn python_json_spacing() {
        let v = json!({"city": "Zürich", "days": [1, 2], "x": {"a": null}});
        assert_eq!(
            python_json(&v),
            r#"{"city": "Zürich", "days": [1, 2], "x": {"a": null}}"#
        );
    }

    #[test]
    fn qwen3_reasoning_and_qwen25_tool_calls() {
        // SGLang's Qwen3Detector keeps the reasoning's trailing newline and strips the answer.
        let (r, rest) = ReasoningParser::Qwen3 {
            force_reasoning: false,
        }
        .parse("<think>\nplan\n</think>\n\nHi");
        assert_eq!((r.as_deref(), rest.as_str()), (Some("plan\n"), "Hi"));
        let (r, rest) = ReasoningParser::Qwen3 {
            force_reasoning: true,
        }
        .parse("plan</think>ok");
        assert_eq!((r.as_deref(), rest.as_str()), (Some("plan"), "ok"));
        assert_eq!(
            ReasoningParser::Glm45.parse("no tags"),
            (None, "no tags".to_owned())
        );
        let parser = OutputParser {
            reasoning: Some(ReasoningParser::Qwen3 {
                force_reasoning: false,
            }),
            tool_calls: Some(ToolCallParser::Qwen25),
            end_of_turn: vec!["<|im_end|>".into()],
        };
        let text = "<think>\nneed data\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\",\"days\":2}}\n</tool_call>\n<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call><|im_end|>";
        let parsed = parser.parse(text, &weather()).unwrap();
        assert_eq!(parsed.reasoning_content.as_deref(), Some("need data\n"));
        assert_eq!(parsed.content, "Let me check.");
        assert_eq!(parsed.tool_calls.len(), 1, "unknown tools are dropped");
        assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
        assert_eq!(
            parsed.tool_calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "Paris", "days": 2}"#.into())
        );
        // Malformed or unterminated blocks are skipped, the good ones kept (SGLang).
        let parsed = parser
            .parse(
                "Try.<tool_call>\n{broken\n</tool_call><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call><tool_call>{\"name\"",
                &weather(),
            )
            .unwrap();
        assert_eq!(parsed.content, "Try.");
        assert_eq!(parsed.tool_calls.len(), 1);
        assert_eq!(
            parsed.tool_calls[0].function.arguments,
            ToolArguments::Json("{}".into())
        );
    }

    #[test]
    fn glm_arg_key_value_calls() {
        let glm45 = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        let (normal, calls) = ToolCallParser::Glm45.parse(glm45, &weather()).unwrap();
        assert_eq!(normal, "");
        // `city` is a string in the schema: kept raw; `days` parsed as JSON.
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "42", "days": 3}"#.into())
        );
        let glm47 = "I'll look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>";
        let (normal, calls) = ToolCallParser::Glm47.parse(glm47, &weather()).unwrap();
        assert_eq!(normal, "I'll look.");
        assert_eq!(
            calls[0].function.arguments.to_object().unwrap()["city"],
            json!("Oslo")
        );
        let broken = "Hm.<tool_call>get_weather<arg_key>city</arg_key></tool_call>";
        assert!(ToolCallParser::Glm47.parse(broken, &[]).is_err());
        // The output parser answers with the whole text as content and no calls.
        let output = OutputParser {
            reasoning: None,
            tool_calls: Some(ToolCallParser::Glm47),
            end_of_turn: vec![],
        };
        let parsed = output.parse(broken, &[]).unwrap();
        assert_eq!(parsed.content, broken);
        assert!(parsed.tool_calls.is_empty());
    }

    #[test]
    fn kimi_k2_markers_and_ids() {
        let text = "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Nice\"}<|tool_call_end|><|tool_calls_section_end|>";
        let (normal, calls) = ToolCallParser::KimiK2.parse(text, &weather()).unwrap();
        assert_eq!(normal, "Sure.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].id.as_deref(), Some("functions.get_weather:1"));
        assert_eq!(calls[1].index, Some(1));
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json("{\"city\": \"Rome\"}".into())
        );
        assert!(ReasoningParser::from_name("nope").is_err());
        assert_eq!(
            ToolCallParser::from_name("glm47").unwrap(),
            ToolCallParser::Glm47
        );
    }
}
