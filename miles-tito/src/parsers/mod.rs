//! Reasoning and tool-call parsers for assistant output text, with SGLang's parser names
//! (`--reasoning-parser qwen3|qwen3-thinking|glm45|kimi_k2|nemotron_3|deepseek-r1|deepseek-v3|
//! deepseek-v4|minimax|minimax-append-think|gpt-oss`, `--tool-call-parser qwen25|glm45|glm47|
//! kimi_k2|kimi_k2_raw_id|qwen3_coder|minimax-m2|deepseekv31|deepseekv32|deepseekv4|gpt-oss`).
//!
//! SGLang parses the detokenized output of a chat completion into `reasoning_content`,
//! `content` and `tool_calls`; a session server must do the same from the output ids. A
//! [`ChatTokenizer`](crate::ChatTokenizer) implementation decodes and hands the text to an
//! [`OutputParser`] built from the family's parsers (the family table binds them). The formats
//! and value typing follow SGLang's detectors; no model output makes a parser panic or fail the
//! request (malformed markup stays in `content`).
//!
//! One file per format: [`reasoning`] (every `<think>` variant), `qwen25`, `qwen3_coder`, `glm`,
//! `kimi_k2`, `minimax_m2`, `deepseek_v31`, `deepseek_v32`, `deepseek_v4`, `harmony` (GPT-OSS's
//! channels: reasoning and tool calls); `markup` holds the text helpers they share.

mod deepseek_v31;
mod deepseek_v32;
mod deepseek_v4;
mod glm;
mod harmony;
mod kimi_k2;
mod markup;
mod minimax_m2;
mod qwen25;
mod qwen3_coder;
mod reasoning;

use miles_core::{Message, ToolArguments, ToolCall, ToolSpec};
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use markup::known;

pub use reasoning::ReasoningParser;

/// An assistant turn parsed from output ids with the family's reasoning and tool-call formats.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedAssistant {
    /// The visible text (never `None` on the wire: `""` when only tools were called).
    pub content: String,
    /// The reasoning, when the family separates it (`<think>…</think>`).
    pub reasoning_content: Option<String>,
    /// Tool calls, in order; `id`s are filled in by the parser.
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedAssistant {
    /// The assistant [`Message`] stored in the session history.
    pub fn to_message(&self) -> Message {
        let mut message = Message::assistant(self.content.clone());
        message.reasoning_content = self.reasoning_content.clone();
        if !self.tool_calls.is_empty() {
            message.tool_calls = Some(self.tool_calls.clone());
        }
        message
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
    /// Kimi K2 / K2.5 / K2.6 (`kimi_k2`, `kimi_k2_raw_id`):
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    /// <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; the
    /// model's id is kept as the call id.
    KimiK2,
    /// Qwen3-Coder / Qwen3.5 / Nemotron 3 (`qwen3_coder`): `<tool_call>\n<function=NAME>\n
    /// <parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>`, values typed by the
    /// tool's JSON schema.
    Qwen3Coder,
    /// MiniMax M2 (`minimax-m2`): `<minimax:tool_call>\n<invoke name="NAME"><parameter
    /// name="P">VALUE</parameter>…</invoke>\n</minimax:tool_call>`, values typed by the schema.
    MinimaxM2,
    /// DeepSeek V3.1 (`deepseekv31`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
    /// <｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
    DeepSeekV31,
    /// DeepSeek V3.2 (`deepseekv32`): DSML, `<｜DSML｜function_calls>` holding
    /// `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="P" string="true|false">`
    /// (or a JSON object), also without the `｜DSML｜` prefixes.
    DeepSeekV32,
    /// DeepSeek V4 (`deepseekv4`): DSML as V3.2 in a `<｜DSML｜tool_calls>` block, parsed
    /// strictly (a malformed block, an unknown tool or a bad value is an error).
    DeepSeekV4,
    /// GPT-OSS (`gpt-oss`): commentary-channel blocks `<|start|>assistant<|channel|>commentary
    /// to=functions.NAME <|constrain|>json<|message|>{…}<|call|>` (the reasoning parser leaves
    /// them raw in the answer).
    GptOss,
}

impl ToolCallParser {
    /// The parser for an SGLang `--tool-call-parser` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "qwen25" | "qwen" => Ok(Self::Qwen25),
            "glm45" | "glm" => Ok(Self::Glm45),
            "glm47" => Ok(Self::Glm47),
            "kimi_k2" | "kimi_k2_raw_id" => Ok(Self::KimiK2),
            "qwen3_coder" => Ok(Self::Qwen3Coder),
            "minimax-m2" => Ok(Self::MinimaxM2),
            "deepseekv31" => Ok(Self::DeepSeekV31),
            "deepseekv32" => Ok(Self::DeepSeekV32),
            "deepseekv4" => Ok(Self::DeepSeekV4),
            "gpt-oss" => Ok(Self::GptOss),
            other => Err(Error::UnknownParser {
                kind: "tool-call",
                name: other.to_owned(),
            }),
        }
    }

    fn start_token(self) -> &'static str {
        match self {
            Self::Qwen25 | Self::Glm45 | Self::Glm47 | Self::Qwen3Coder => "<tool_call>",
            Self::KimiK2 => "<|tool_calls_section_begin|>",
            Self::MinimaxM2 => "<minimax:tool_call>",
            Self::DeepSeekV31 => deepseek_v31::V31_CALLS_BEGIN,
            Self::DeepSeekV32 => "<｜DSML｜function_calls>",
            Self::DeepSeekV4 => "<｜DSML｜tool_calls>",
            Self::GptOss => harmony::TOOL_CALL_START,
        }
    }

    /// Whether `text` holds this format's tool-call markup (SGLang's `has_tool_call`).
    pub fn has_tool_call(self, text: &str) -> bool {
        text.contains(self.start_token())
            || (self == Self::DeepSeekV32 && text.contains("<function_calls>"))
    }

    /// Splits `text` into normal text and tool calls, as SGLang's detector for the format
    /// does. Calls to tools not in `tools` are dropped (as SGLang does) unless `tools` is
    /// empty (DeepSeek V4: an error). A Qwen 2.5 block that does not parse is skipped
    /// (SGLang's detector); for the GLM, Kimi, DeepSeek V3.1 and V4 formats a call that does
    /// not parse is an error ([`OutputParser::parse`] then keeps the whole text as content, as
    /// SGLang's chat serving does).
    /// Arguments are JSON strings in Python's spelling (`{"city": "Paris"}`); Kimi's are the
    /// model's text.
    pub fn parse(self, text: &str, tools: &[ToolSpec]) -> Result<(String, Vec<ToolCall>)> {
        let Some(at) = (self.has_tool_call(text))
            .then(|| {
                text.find(self.start_token())
                    .or_else(|| text.find("<function_calls>"))
            })
            .flatten()
        else {
            return Ok((text.to_owned(), Vec::new()));
        };
        let trimmed_prefix = || text[..at].trim().to_owned();
        let body = &text[at..];
        let (normal, calls) = match self {
            Self::Qwen25 => (trimmed_prefix(), qwen25::parse(body)),
            Self::Glm45 | Self::Glm47 => (trimmed_prefix(), glm::parse(body, tools)?),
            Self::KimiK2 => (trimmed_prefix(), kimi_k2::parse(body)?),
            // SGLang keeps the text before the first call as it is.
            Self::Qwen3Coder => (text[..at].to_owned(), qwen3_coder::parse(text, tools)),
            Self::MinimaxM2 => minimax_m2::parse(text, tools),
            Self::DeepSeekV31 => (trimmed_prefix(), deepseek_v31::parse(text)?),
            Self::DeepSeekV32 => deepseek_v32::parse(text),
            Self::DeepSeekV4 => deepseek_v4::parse(text, tools)?,
            Self::GptOss => harmony::tool_calls(text),
        };
        let calls = calls
            .into_iter()
            .filter(|(_, name, _)| known(tools, name))
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
    /// The parser for a request with chat-template `kwargs` (the thinking toggles of
    /// [`ReasoningParser::for_kwargs`]).
    pub fn for_kwargs(&self, kwargs: &Map<String, Value>) -> Self {
        Self {
            reasoning: self.reasoning.map(|r| r.for_kwargs(kwargs)),
            ..self.clone()
        }
    }

    /// Parses decoded assistant output: end-of-turn strings trimmed, reasoning split off, then
    /// tool calls.
    ///
    /// Never fails on model output: a malformed call (an error of the format's parser), or
    /// tool-call markup that yields no call at all (unterminated, unparsable, unknown tools),
    /// leaves the whole answer text as `content` with no calls, so the agent sees what the
    /// model wrote (the session records the exact tokens either way).
    ///
    /// The harmony format (GPT-OSS) keeps its end markers: its blocks are delimited by them
    /// (`<|call|>` ends a tool call, `<|return|>` the answer).
    pub fn parse(&self, text: &str, tools: &[ToolSpec]) -> Result<ParsedAssistant> {
        let harmony = self.reasoning == Some(ReasoningParser::GptOss);
        let mut text = text;
        while let Some(stripped) = self
            .end_of_turn
            .iter()
            .filter(|s| !(harmony && harmony::END_MARKERS.contains(&s.as_str())))
            .find_map(|s| text.strip_suffix(s.as_str()))
        {
            text = stripped;
        }
        let (reasoning_content, rest) = match self.reasoning {
            Some(parser) => parser.parse(text),
            None => (None, text.to_owned()),
        };
        let (content, tool_calls) = match self.tool_calls {
            Some(parser) => match parser.parse(&rest, tools) {
                Ok((_, calls)) if calls.is_empty() && parser.has_tool_call(&rest) => {
                    tracing::warn!(
                        "tool-call markup without a valid call; the text is kept as content"
                    );
                    (rest, Vec::new())
                }
                Ok(parsed) => parsed,
                Err(error) => {
                    tracing::warn!(%error, "tool-call parsing failed; the text is kept as content");
                    (rest, Vec::new())
                }
            },
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
    #[test]
    fn dsml_tags_and_reasoning_toggles() {
        // Mixed DSML / plain tags (SGLang's V3.2 detector), extra spaces, JSON bodies.
        let text = "Ok.\n\n<function_calls>\n<｜DSML｜invoke  name=\"get_weather\" >\n<parameter name=\"city\" string=\"true\"> Oslo </｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</parameter>\n</invoke>\n<invoke name=\"get_weather\">{\"city\": \"Rome\"}</｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let (normal, calls) = ToolCallParser::DeepSeekV32.parse(text, &weather()).unwrap();
        assert_eq!(normal, "Ok.");
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "Oslo", "days": 2}"#.into())
        );
        assert_eq!(
            calls[1].function.arguments,
            ToolArguments::Json(r#"{"city": "Rome"}"#.into())
        );
        // V4 is strict: a repeated parameter is an error.
        let v4 = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">a</｜DSML｜parameter>\n<｜DSML｜parameter name=\"city\" string=\"true\">b</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        assert!(ToolCallParser::DeepSeekV4.parse(v4, &weather()).is_err());

        let mut off = Map::new();
        off.insert("thinking".into(), json!(false));
        let forced = ReasoningParser::DeepSeekV3 {
            force_reasoning: true,
        };
        assert_eq!(
            forced.for_kwargs(&off),
            ReasoningParser::DeepSeekV3 {
                force_reasoning: false
            }
        );
        let mut on = Map::new();
        on.insert("thinking_mode".into(), json!("thinking"));
        assert_eq!(
            ReasoningParser::from_name("deepseek-v4")
                .unwrap()
                .for_kwargs(&on),
            ReasoningParser::DeepSeekV4 {
                force_reasoning: true
            }
        );
        assert_eq!(
            ReasoningParser::from_name("deepseek-r1")
                .unwrap()
                .parse("a</think>b"),
            (Some("a".to_owned()), "b".to_owned())
        );
        // Kimi: the tool section ends an unclosed reasoning block.
        let (r, rest) = ReasoningParser::KimiK2 {
            force_reasoning: true,
        }
        .parse("plan<|tool_calls_section_begin|>x");
        assert_eq!(
            (r.as_deref(), rest.as_str()),
            (Some("plan"), "<|tool_calls_section_begin|>x")
        );
        for name in [
            "qwen3_coder",
            "minimax-m2",
            "deepseekv31",
            "deepseekv32",
            "deepseekv4",
            "kimi_k2_raw_id",
        ] {
            assert!(ToolCallParser::from_name(name).is_ok(), "{name}");
        }
        for name in [
            "deepseek-v3",
            "nemotron_3",
            "minimax-append-think",
            "minimax",
            "qwen3-thinking",
        ] {
            assert!(ReasoningParser::from_name(name).is_ok(), "{name}");
        }
    }
}
