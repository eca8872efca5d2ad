//! [`RenderArgs`]: what a chat template renders.

use serde_json::{Map, Value as Json};

/// What to render: the HF `apply_chat_template` arguments other than the template itself.
#[derive(Debug, Clone, Copy)]
pub struct RenderArgs<'a> {
    /// The conversation, as JSON objects (OpenAI message shape).
    pub messages: &'a [Json],
    /// Tool specifications (`tools=`), or `None`.
    pub tools: Option<&'a [Json]>,
    /// Append the assistant generation prompt.
    pub add_generation_prompt: bool,
    /// Extra template variables (`chat_template_kwargs`: `enable_thinking`, …).
    pub kwargs: &'a Map<String, Json>,
}
