//! A byte-level ChatML [`ChatTokenizer`](crate::ChatTokenizer) for tests, benchmarks and trying
//! servers without a model (feature `testkit`): ids 0–255 are bytes, 256–263 the specials, with
//! a ChatML / Qwen3-style template and Qwen3's TITO boundary rule.

use miles_core::{Message, Role, TokenId, ToolCall, ToolSpec};
use serde_json::{Map, Value, json};

use crate::{ChatTokenizer, ParsedAssistant};

/// Id of `<|im_start|>`.
pub const IM_START: TokenId = 256;
/// Id of `<|im_end|>`.
pub const IM_END: TokenId = 257;
/// The special tokens and their ids.
pub const SPECIALS: [(&str, TokenId); 8] = [
    ("<|im_start|>", 256),
    ("<|im_end|>", 257),
    ("<think>", 258),
    ("</think>", 259),
    ("<tool_call>", 260),
    ("</tool_call>", 261),
    ("<tool_response>", 262),
    ("</tool_response>", 263),
];

/// Bytes are ids 0..=255; the 8 specials above are 256..=263.
#[derive(Debug, Clone)]
pub struct ByteChatml {
    /// Roles that may be appended after a stored assistant turn.
    pub allowed: Vec<Role>,
}

impl Default for ByteChatml {
    fn default() -> Self {
        Self {
            allowed: vec![Role::Tool, Role::User, Role::System, Role::Assistant],
        }
    }
}

impl ByteChatml {
    /// Encodes text: specials matched greedily, every other byte its own id.
    pub fn encode(&self, text: &str) -> Vec<TokenId> {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        'outer: while i < bytes.len() {
            if bytes[i] == b'<' {
                for (s, id) in SPECIALS {
                    if bytes[i..].starts_with(s.as_bytes()) {
                        out.push(id);
                        i += s.len();
                        continue 'outer;
                    }
                }
            }
            out.push(bytes[i] as TokenId);
            i += 1;
        }
        out
    }

    fn call_json(call: &ToolCall) -> String {
        let args = call.function.arguments.to_object().unwrap_or_default();
        json!({"name": call.function.name, "arguments": Value::Object(args)}).to_string()
    }

    /// The template, as text.
    pub fn render_text(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> String {
        let mut out = String::new();
        let mut rest = messages;
        if !tools.is_empty() {
            out.push_str("<|im_start|>system\n");
            if let Some(first) = messages.first().filter(|m| m.role == Role::System) {
                out.push_str(&first.text());
                out.push_str("\n\n");
                rest = &messages[1..];
            }
            out.push_str("# Tools\n<tools>");
            for tool in tools {
                out.push('\n');
                out.push_str(&serde_json::to_string(tool).unwrap_or_default());
            }
            out.push_str("\n</tools><|im_end|>\n");
        }
        for (i, m) in rest.iter().enumerate() {
            match m.role {
                Role::System | Role::User | Role::Developer => {
                    out.push_str(&format!(
                        "<|im_start|>{}\n{}<|im_end|>\n",
                        m.role.as_str(),
                        m.text()
                    ));
                }
                Role::Assistant => {
                    out.push_str("<|im_start|>assistant\n");
                    if let Some(r) = m.reasoning_content.as_deref() {
                        out.push_str(&format!("<think>\n{r}\n</think>\n\n"));
                    }
                    let content = m.text();
                    out.push_str(&content);
                    for (k, call) in m.tool_calls.iter().flatten().enumerate() {
                        if k > 0 || !content.is_empty() {
                            out.push('\n');
                        }
                        out.push_str(&format!(
                            "<tool_call>\n{}\n</tool_call>",
                            Self::call_json(call)
                        ));
                    }
                    out.push_str("<|im_end|>\n");
                }
                Role::Tool => {
                    if i == 0 || rest[i - 1].role != Role::Tool {
                        out.push_str("<|im_start|>user");
                    }
                    out.push_str(&format!(
                        "\n<tool_response>\n{}\n</tool_response>",
                        m.text()
                    ));
                    if i + 1 == rest.len() || rest[i + 1].role != Role::Tool {
                        out.push_str("<|im_end|>\n");
                    }
                }
            }
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
            if kwargs.get("enable_thinking") == Some(&Value::Bool(false)) {
                out.push_str("<think>\n\n</think>\n\n");
            }
        }
        out
    }
}

impl ChatTokenizer for ByteChatml {
    fn family(&self) -> &str {
        "byte_chatml"
    }

    fn render(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> crate::Result<Vec<TokenId>> {
        Ok(self.encode(&self.render_text(messages, tools, add_generation_prompt, kwargs)))
    }

    fn tokenize_additional(
        &self,
        old: &[Message],
        new: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> crate::Result<Vec<TokenId>> {
        let mut dummy = Message::assistant("").with_reasoning(" ");
        dummy.tool_calls = Some(
            old.last()
                .and_then(|m| m.tool_calls.clone())
                .unwrap_or_default(),
        );
        let base = vec![Message::system("dummy system"), dummy];
        let without = self.render_text(&base, tools, false, kwargs);
        let mut all = base;
        all.extend_from_slice(&new[old.len()..]);
        let with = self.render_text(&all, tools, true, kwargs);
        let suffix = with
            .strip_prefix(&without)
            .ok_or_else(|| crate::Error::SuffixDiff {
                roles: new[old.len()..]
                    .iter()
                    .map(|m| m.role.as_str().to_owned())
                    .collect(),
            })?;
        Ok(self.encode(suffix))
    }

    fn parse_assistant(
        &self,
        ids: &[TokenId],
        _tools: &[ToolSpec],
    ) -> crate::Result<ParsedAssistant> {
        let text = self.decode(ids);
        let text = text.strip_suffix("<|im_end|>").unwrap_or(&text);
        let (reasoning, rest) = match text
            .strip_prefix("<think>\n")
            .and_then(|t| t.split_once("\n</think>\n\n"))
        {
            Some((r, rest)) => (Some(r.to_owned()), rest),
            None => (None, text),
        };
        let (content, calls_text) = match rest.split_once("<tool_call>") {
            Some((c, calls)) => (
                c.strip_suffix('\n').unwrap_or(c),
                Some(format!("<tool_call>{calls}")),
            ),
            None => (rest, None),
        };
        let mut tool_calls = Vec::new();
        if let Some(calls) = calls_text {
            for part in calls.split("<tool_call>\n").skip(1) {
                let body = part.trim_start_matches('\n');
                let Some((json_text, _)) = body.split_once("\n</tool_call>") else {
                    return Err(crate::Error::model_output(format!(
                        "unterminated tool call: {body}"
                    )));
                };
                let v: Value = serde_json::from_str(json_text)
                    .map_err(|e| crate::Error::model_output(e.to_string()))?;
                let name = v["name"].as_str().unwrap_or_default().to_owned();
                let args = v["arguments"].as_object().cloned().unwrap_or_default();
                let mut call = ToolCall::function("", name, args);
                call.id = None;
                tool_calls.push(call);
            }
        }
        Ok(ParsedAssistant {
            content: content.to_owned(),
            reasoning_content: reasoning,
            tool_calls,
        })
    }

    fn decode_text(&self, ids: &[TokenId], skip_special_tokens: bool) -> String {
        if !skip_special_tokens {
            return ChatTokenizer::decode(self, ids);
        }
        // As in Qwen3's tokenizer, only the turn markers are special; `<think>`,
        // `<tool_call>`, `<tool_response>` and their closers stay in the text.
        let plain: Vec<TokenId> = ids
            .iter()
            .copied()
            .filter(|&id| id != IM_START && id != IM_END)
            .collect();
        ChatTokenizer::decode(self, &plain)
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            if id < 256 {
                bytes.push(id as u8);
            } else if let Some((s, _)) = SPECIALS.iter().find(|(_, i)| *i == id) {
                bytes.extend_from_slice(s.as_bytes());
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn encode(&self, text: &str) -> crate::Result<Vec<TokenId>> {
        Ok(ByteChatml::encode(self, text))
    }

    fn is_special(&self, id: TokenId) -> bool {
        id >= 256
    }

    fn allowed_append_roles(&self) -> &[Role] {
        &self.allowed
    }

    fn forced_kwargs(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("clear_thinking".into(), json!(false));
        m
    }

    fn trailing_token_ids(&self) -> &[TokenId] {
        &[10]
    }

    fn assistant_start_str(&self) -> Option<&str> {
        Some("<|im_start|>assistant")
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        vec![IM_END]
    }

    fn fix_prefix_boundary(&self, prefix: &[TokenId]) -> Vec<TokenId> {
        let mut ids = prefix.to_vec();
        if ids.last() == Some(&IM_END) {
            ids.push(10);
        }
        ids
    }
}
