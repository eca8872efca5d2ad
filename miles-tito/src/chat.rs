//! The seam between a session server and a chat template + tokenizer.
//!
//! [`ChatTokenizer`] is everything a session server needs from a TITO tokenizer: render a
//! conversation to prompt ids, tokenize appended messages incrementally against the stored
//! prefix, parse the model's output ids back into an assistant message, decode, and classify
//! special tokens for the mismatch metric. [`crate::TitoChat`] implements it over the family
//! table; the server depends only on this trait, so a test double (or another tokenizer
//! library) plugs in the same way and gets the crate's comparator through the default
//! [`ChatTokenizer::compare_sequences`].

use miles_core::{Message, Role, TokenId, ToolSpec};
use serde_json::{Map, Value};

use crate::comparator::{Mismatch, TokenView, compare_with};
use crate::error::{Error, Result};
use crate::parsers::ParsedAssistant;

/// A chat template plus tokenizer of one model family, as the session server uses it.
///
/// Required methods render, tokenize incrementally, parse and decode; the rest have defaults
/// that match Miles' `default` family (no forced kwargs, every role appendable, no trailing
/// trim, plain concatenation at the prefix boundary).
pub trait ChatTokenizer: Send + Sync {
    /// The family name (Miles' `--tito-model` value: `qwen3`, `glm47`, …).
    fn family(&self) -> &str;

    /// Renders `messages` (+ `tools`) with the chat template and tokenizes the text
    /// (`apply_chat_template(..., tokenize=True)`).
    fn render(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>>;

    /// Token ids of `new[old.len()..]` followed by the generation prompt, computed
    /// incrementally (Miles' `tokenize_additional_messages`). `new` is already
    /// validated as an append-only extension of `old` (its first `old.len()` messages match
    /// `old`'s under the strict matcher), so implementations read `old` and the appended tail
    /// only.
    fn tokenize_additional(
        &self,
        old: &[Message],
        new: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>>;

    /// Parses generated ids (stop token included) into an assistant message.
    fn parse_assistant(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
    ) -> Result<ParsedAssistant>;

    /// [`ChatTokenizer::parse_assistant`] for a request with chat-template `kwargs`: a family
    /// whose parser depends on the thinking toggles (`enable_thinking`, `thinking`, …: whether
    /// the output starts inside reasoning) reads them here. Default: the kwargs are ignored.
    fn parse_assistant_with_kwargs(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<ParsedAssistant> {
        let _ = kwargs;
        self.parse_assistant(output_ids, tools)
    }

    /// Decodes ids to text, special tokens included.
    fn decode(&self, ids: &[TokenId]) -> String;

    /// Decodes ids to text, special tokens left out when `skip_special_tokens` (SGLang's
    /// response text). Default: [`ChatTokenizer::decode`] (an implementation without special
    /// tokens).
    fn decode_text(&self, ids: &[TokenId], skip_special_tokens: bool) -> String {
        let _ = skip_special_tokens;
        self.decode(ids)
    }

    /// Decodes one id (the `token` of OpenAI `logprobs.content`); implementations may cache.
    fn decode_token(&self, id: TokenId) -> std::sync::Arc<str> {
        self.decode(&[id]).into()
    }

    /// Encodes text to ids, special tokens recognised (used to script test and benchmark
    /// engines with the ids of a text). Default: not supported ([`Error::Tokenizer`]).
    fn encode(&self, text: &str) -> Result<Vec<TokenId>> {
        Err(Error::Tokenizer(format!(
            "family {} cannot encode text ({} bytes)",
            self.family(),
            text.len()
        )))
    }

    /// Whether `id` is a special token (comparator segment boundary).
    fn is_special(&self, id: TokenId) -> bool;

    /// Tokens a turn may end with that the stored prefix may drop at the next turn (GLM: 1).
    fn max_trim_tokens(&self) -> usize {
        0
    }

    /// Roles that may be appended after a stored assistant turn.
    fn allowed_append_roles(&self) -> &[Role] {
        &[Role::Tool, Role::User, Role::System, Role::Assistant]
    }

    /// Template kwargs the family forces (e.g. `clear_thinking=false`).
    fn forced_kwargs(&self) -> Map<String, Value> {
        Map::new()
    }

    /// Ids the comparator strips from both tails before comparing (the `\n` after
    /// `<|im_end|>` for Qwen3, …).
    fn trailing_token_ids(&self) -> &[TokenId] {
        &[]
    }

    /// The text that opens an assistant turn (`<|im_start|>assistant`), used by the
    /// comparator to classify assistant text. `None`: every text segment is non-assistant.
    fn assistant_start_str(&self) -> Option<&str> {
        None
    }

    /// Stop token ids sent to the engine with every request (the family's end-of-turn ids).
    fn stop_token_ids(&self) -> Vec<TokenId> {
        Vec::new()
    }

    /// The per-family boundary fix applied to the stored prefix before the incremental ids
    /// are appended: e.g. Qwen3 appends `\n` after a final `<|im_end|>`, GLM
    /// drops a final `<|observation|>`/`<|user|>`. Default: unchanged.
    fn fix_prefix_boundary(&self, prefix: &[TokenId]) -> Vec<TokenId> {
        prefix.to_vec()
    }

    /// `merge_tokens`: boundary-fixed prefix ⊕ incremental ids.
    fn merge_tokens(
        &self,
        old: &[Message],
        new: &[Message],
        pretokenized: &[TokenId],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        let mut ids = self.fix_prefix_boundary(pretokenized);
        ids.extend(self.tokenize_additional(old, new, tools, kwargs)?);
        Ok(ids)
    }

    /// Merges request kwargs over the forced ones; a request value that differs from a forced
    /// one is [`Error::KwargConflict`].
    fn resolve_kwargs(&self, request: &Map<String, Value>) -> Result<Map<String, Value>> {
        let forced = self.forced_kwargs();
        for (key, value) in request {
            if let Some(forced_value) = forced.get(key)
                && forced_value != value
            {
                return Err(Error::KwargConflict {
                    key: key.clone(),
                    value: value.to_string(),
                    family: self.family().to_owned(),
                });
            }
        }
        let mut merged = request.clone();
        for (key, value) in forced {
            merged.insert(key, value);
        }
        Ok(merged)
    }

    /// Compares the canonical tokenization `expected` with the session's `actual` ids with
    /// the crate's token-sequence comparator, reading segment boundaries, trailing ids,
    /// assistant openers and text from this trait's methods.
    fn compare_sequences(&self, expected: &[TokenId], actual: &[TokenId]) -> Vec<Mismatch> {
        let view = ChatView(self);
        // `ChatView::decode` cannot fail.
        compare_with(&view, expected, actual).unwrap_or_default()
    }
}

/// A [`ChatTokenizer`] as the comparator reads it.
struct ChatView<'a, T: ?Sized>(&'a T);

impl<T: ChatTokenizer + ?Sized> TokenView for ChatView<'_, T> {
    fn is_special(&self, id: u32) -> bool {
        self.0.is_special(id)
    }

    fn is_trailing(&self, id: u32) -> bool {
        self.0.trailing_token_ids().contains(&id)
    }

    fn assistant_start(&self) -> Option<&str> {
        self.0.assistant_start_str()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(self.0.decode(ids))
    }
}
