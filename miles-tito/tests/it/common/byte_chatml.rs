//! A byte-level ChatML [`ChatTokenizer`] (ids 0–255 are bytes, 256–263 the specials): the
//! seam without a model directory, for the comparator reached through the trait.

use miles_core::{Message, Role, TokenId, ToolSpec};
use miles_tito::{ChatTokenizer, ParsedAssistant, Result};
use serde_json::{Map, Value};

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
            for (special, id) in SPECIALS {
                if bytes[i..].starts_with(special.as_bytes()) {
                    out.push(id);
                    i += special.len();
                    continue 'outer;
                }
            }
            out.push(TokenId::from(bytes[i]));
            i += 1;
        }
        out
    }

    /// ChatML text of `messages` (role and text content), with the generation prompt.
    fn render_text(messages: &[Message], add_generation_prompt: bool) -> String {
        let mut out = String::new();
        for m in messages {
            out.push_str(&format!(
                "<|im_start|>{}\n{}<|im_end|>\n",
                m.role.as_str(),
                m.text()
            ));
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
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
        _tools: &[ToolSpec],
        add_generation_prompt: bool,
        _kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        Ok(self.encode(&Self::render_text(messages, add_generation_prompt)))
    }

    fn tokenize_additional(
        &self,
        old: &[Message],
        new: &[Message],
        _tools: &[ToolSpec],
        _kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        // Every ChatML message renders on its own: the appended ones plus the prompt.
        Ok(self.encode(&Self::render_text(&new[old.len()..], true)))
    }

    fn parse_assistant(&self, ids: &[TokenId], _tools: &[ToolSpec]) -> Result<ParsedAssistant> {
        let text = self.decode(ids);
        Ok(ParsedAssistant {
            content: text.strip_suffix("<|im_end|>").unwrap_or(&text).to_owned(),
            ..ParsedAssistant::default()
        })
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(byte) => bytes.push(byte),
                Err(_) => {
                    if let Some((special, _)) = SPECIALS.iter().find(|(_, i)| *i == id) {
                        bytes.extend_from_slice(special.as_bytes());
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn is_special(&self, id: TokenId) -> bool {
        id >= 256
    }

    fn allowed_append_roles(&self) -> &[Role] {
        &self.allowed
    }

    fn trailing_token_ids(&self) -> &[TokenId] {
        &[10]
    }

    fn assistant_start_str(&self) -> Option<&str> {
        Some("<|im_start|>assistant")
    }
}
