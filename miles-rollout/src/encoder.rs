//! [`ChatPromptEncoder`]: the [`PromptEncoder`] of chat models, built on miles-tito's
//! HF-exact chat templates (the prompt ids are exactly what HF `apply_chat_template` gives).

use std::path::Path;

use miles_core::{EngineErrorKind, Error as CoreError, Prompt, Sample, TokenId};
use miles_tito::{HfChat, RenderArgs};
use serde_json::{Map, Value};

use crate::manager::PromptEncoder;

/// Renders a sample's prompt with the model's chat template and tokenizes it.
///
/// * `Prompt::Messages` are rendered as they are; `Prompt::Text` as one user message, unless
///   `raw_text` is set (then the text is tokenized as is: an already templated prompt);
/// * tools come from `metadata["tools"]` (OpenAI tool specs);
/// * `chat_template_kwargs` (e.g. `{"enable_thinking": false}`) are passed to the template;
/// * the generation prompt is always added.
#[derive(Debug, Clone)]
pub struct ChatPromptEncoder {
    chat: HfChat,
    kwargs: Map<String, Value>,
    raw_text: bool,
}

impl ChatPromptEncoder {
    /// Loads `dir`'s tokenizer and chat template.
    pub fn load(dir: impl AsRef<Path>) -> crate::Result<Self> {
        let chat = HfChat::load(dir.as_ref()).map_err(|e| {
            crate::Error::Config(format!("cannot load {}: {e}", dir.as_ref().display()))
        })?;
        Ok(Self::new(chat))
    }

    /// Wraps a loaded model directory.
    pub fn new(chat: HfChat) -> Self {
        Self {
            chat,
            kwargs: Map::new(),
            raw_text: false,
        }
    }

    /// Template variables (`chat_template_kwargs`).
    pub fn with_kwargs(mut self, kwargs: Map<String, Value>) -> Self {
        self.kwargs = kwargs;
        self
    }

    /// Tokenize `Prompt::Text` as is instead of wrapping it in a user message.
    pub fn with_raw_text(mut self, raw_text: bool) -> Self {
        self.raw_text = raw_text;
        self
    }

    /// The loaded model directory.
    pub fn chat(&self) -> &HfChat {
        &self.chat
    }

    fn error(e: impl std::fmt::Display) -> CoreError {
        CoreError::engine(
            EngineErrorKind::InvalidRequest,
            format!("prompt encoding: {e}"),
        )
    }
}

impl PromptEncoder for ChatPromptEncoder {
    fn encode(&self, sample: &Sample) -> miles_core::Result<Vec<TokenId>> {
        let messages: Vec<Value> = match &sample.prompt {
            Prompt::Text(text) if self.raw_text => {
                return self.chat.encode(text).map_err(Self::error);
            }
            Prompt::Text(text) => vec![serde_json::json!({"role": "user", "content": text})],
            Prompt::Messages(messages) => messages
                .iter()
                .map(serde_json::to_value)
                .collect::<Result<_, _>>()?,
        };
        let tools: Option<Vec<Value>> = sample
            .metadata
            .get("tools")
            .and_then(Value::as_array)
            .cloned();
        let rendered = self
            .chat
            .apply_chat_template(RenderArgs {
                messages: &messages,
                tools: tools.as_deref(),
                add_generation_prompt: true,
                kwargs: &self.kwargs,
            })
            .map_err(Self::error)?;
        rendered
            .ids
            .ok_or_else(|| Self::error("the model directory has no tokenizer"))
    }

    fn decode(&self, tokens: &[TokenId]) -> String {
        match self.chat.tokenizer() {
            Some(t) => miles_tito::decode(t, tokens).unwrap_or_default(),
            None => String::new(),
        }
    }

    fn decode_text(&self, tokens: &[TokenId], skip_special_tokens: bool) -> String {
        match self.chat.tokenizer() {
            Some(t) => miles_tito::decode_text(t, tokens, skip_special_tokens).unwrap_or_default(),
            None => String::new(),
        }
    }
}
