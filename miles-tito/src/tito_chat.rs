//! [`TitoChat`]: the [`ChatTokenizer`] of a TITO family over a model directory, as a session
//! server uses it — miles-tito's [`HfChat`] (a model directory loaded as HF transformers
//! does) and [`TitoTokenizer`] (the family's template, forced kwargs, append roles, boundary
//! rule and incremental tokenization), with the family's output parser and stop ids from the
//! family table.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use miles_core::{Message, Role, TokenId, ToolSpec};
use serde_json::{Map, Value};

use crate::chat::ChatTokenizer;
use crate::error::{Error, Result};
use crate::family::TitoFamily;
use crate::model::HfChat;
use crate::parsers::{OutputParser, ParsedAssistant};
use crate::tito::TitoTokenizer;

/// A TITO family over a loaded model directory, as the session server's [`ChatTokenizer`].
#[derive(Debug, Clone)]
pub struct TitoChat {
    tito: TitoTokenizer,
    parser: OutputParser,
    trailing: Vec<TokenId>,
    stop_ids: Vec<TokenId>,
    token_texts: Arc<TokenTextCache>,
    tools: Arc<ToolsMemo>,
}

/// The template JSON of the last tool list seen (a session sends the same tools every turn,
/// and every turn renders them twice): each tool as SGLang's protocol models dump it
/// ([`ToolSpec::sglang_dump`]), as Miles' session server and SGLang's chat route render them.
#[derive(Debug, Default)]
struct ToolsMemo {
    last: Mutex<Option<ToolsEntry>>,
}

/// A tool list and its template JSON.
type ToolsEntry = (Vec<ToolSpec>, Arc<[Value]>);

impl ToolsMemo {
    fn json(&self, tools: &[ToolSpec]) -> Result<Option<Arc<[Value]>>> {
        if tools.is_empty() {
            return Ok(None);
        }
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((specs, json)) = last.as_ref()
            && specs.as_slice() == tools
        {
            return Ok(Some(json.clone()));
        }
        let json: Arc<[Value]> = tools
            .iter()
            .map(|t| t.sglang_dump().map_err(|e| Error::json("tool spec", e)))
            .collect::<Result<Vec<_>>>()?
            .into();
        *last = Some((tools.to_vec(), json.clone()));
        Ok(Some(json))
    }
}

/// Decoded text of single token ids, filled as ids are seen (bounded by the vocabulary).
#[derive(Debug, Default)]
struct TokenTextCache {
    texts: RwLock<HashMap<TokenId, Arc<str>>>,
}

impl TokenTextCache {
    fn get_or_insert(&self, id: TokenId, decode: impl FnOnce() -> String) -> Arc<str> {
        if let Some(text) = self
            .texts
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
        {
            return text.clone();
        }
        let text: Arc<str> = decode().into();
        self.texts
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(id)
            .or_insert(text)
            .clone()
    }
}

impl TitoChat {
    /// Loads `dir` (tokenizer.json + tokenizer_config.json / chat_template.jinja) and builds
    /// family `family` (Miles' `--tito-model` name) over it.
    pub fn load(dir: &Path, family: &str) -> Result<Self> {
        let family = TitoFamily::parse(family)?;
        let chat = HfChat::load(dir)?;
        Self::new(&chat, family)
    }

    /// Builds family `family` over a loaded model directory, with only the family's forced
    /// template kwargs as base kwargs (request kwargs are merged per call). The stop ids and
    /// the end-of-turn texts the parser strips are the family's end-of-turn tokens plus the
    /// tokenizer's `eos_token`.
    pub fn new(chat: &HfChat, family: TitoFamily) -> Result<Self> {
        let tito = TitoTokenizer::new(chat, family, Map::new())?;
        let tokenizer = tito.tokenizer().clone();
        let mut parser = family.output_parser();
        let mut end_texts = std::mem::take(&mut parser.end_of_turn);
        if let Some(Value::String(eos)) = chat.special_tokens().get("eos_token")
            && !end_texts.contains(eos)
        {
            end_texts.push(eos.clone());
        }
        let stop_ids: Vec<TokenId> = end_texts
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        parser.end_of_turn = end_texts;
        let trailing = tito.trailing_token_ids().iter().copied().collect();
        Ok(Self {
            tito,
            parser,
            trailing,
            stop_ids,
            token_texts: Arc::default(),
            tools: Arc::default(),
        })
    }

    /// The underlying miles-tito tokenizer (base kwargs: the family's forced ones).
    pub fn tito(&self) -> &TitoTokenizer {
        &self.tito
    }

    /// The output parser in use.
    pub fn output_parser(&self) -> &OutputParser {
        &self.parser
    }

    /// The tokenizer with `kwargs` as its template kwargs (the base one when they are equal).
    fn with_kwargs(&self, kwargs: &Map<String, Value>) -> Result<Cow<'_, TitoTokenizer>> {
        if kwargs == self.tito.kwargs() {
            Ok(Cow::Borrowed(&self.tito))
        } else {
            self.tito
                .clone_with_chat_template_kwargs(kwargs)
                .map(Cow::Owned)
        }
    }
}

impl ChatTokenizer for TitoChat {
    fn family(&self) -> &str {
        self.tito.family().name()
    }

    fn render(
        &self,
        messages: &[Message],
        tools: &[ToolSpec],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        let tools = self.tools.json(tools)?;
        self.with_kwargs(kwargs)?.apply_chat_template(
            messages,
            tools.as_deref(),
            add_generation_prompt,
        )
    }

    fn tokenize_additional(
        &self,
        old: &[Message],
        new: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        let tools = self.tools.json(tools)?;
        self.with_kwargs(kwargs)?.tokenize_appended(
            old,
            &new[old.len().min(new.len())..],
            tools.as_deref(),
        )
    }

    fn parse_assistant(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
    ) -> Result<ParsedAssistant> {
        let text = self.tito.decode(output_ids)?;
        self.parser.parse(&text, tools)
    }

    fn parse_assistant_with_kwargs(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<ParsedAssistant> {
        let text = self.tito.decode(output_ids)?;
        self.parser.for_kwargs(kwargs).parse(&text, tools)
    }

    fn decode_text(&self, ids: &[TokenId], skip_special_tokens: bool) -> String {
        match self.tito.decode_text(ids, skip_special_tokens) {
            Ok(text) => text,
            Err(error) => {
                tracing::warn!(%error, "decoding ids failed");
                String::new()
            }
        }
    }

    fn decode(&self, ids: &[TokenId]) -> String {
        match self.tito.decode(ids) {
            Ok(text) => text,
            Err(error) => {
                tracing::warn!(%error, "decoding ids failed");
                String::new()
            }
        }
    }

    fn decode_token(&self, id: TokenId) -> Arc<str> {
        self.token_texts.get_or_insert(id, || self.decode(&[id]))
    }

    fn encode(&self, text: &str) -> Result<Vec<TokenId>> {
        self.tito.encode(text)
    }

    fn is_special(&self, id: TokenId) -> bool {
        self.tito.special_token_ids().contains(&id)
    }

    fn max_trim_tokens(&self) -> usize {
        self.tito.max_trim_tokens()
    }

    fn allowed_append_roles(&self) -> &[Role] {
        self.tito.family().allowed_append_roles()
    }

    fn forced_kwargs(&self) -> Map<String, Value> {
        self.tito.family().forced_kwargs()
    }

    fn trailing_token_ids(&self) -> &[TokenId] {
        &self.trailing
    }

    fn assistant_start_str(&self) -> Option<&str> {
        self.tito.family().assistant_start_str()
    }

    fn stop_token_ids(&self) -> Vec<TokenId> {
        self.stop_ids.clone()
    }

    fn fix_prefix_boundary(&self, prefix: &[TokenId]) -> Vec<TokenId> {
        self.tito.fix_boundary(prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTokenizer;

    fn qwen3_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3")
    }

    #[test]
    fn qwen3_family_rules_come_from_miles_tito() {
        let chat = TitoChat::load(&qwen3_dir(), "qwen3").unwrap();
        assert_eq!(chat.family(), "qwen3");
        // Qwen3's vocabulary: <|im_end|> = 151645, "\n" = 198 (tokenizer.json).
        assert_eq!(chat.stop_token_ids(), vec![151645]);
        assert_eq!(chat.trailing_token_ids(), &[198]);
        assert_eq!(chat.fix_prefix_boundary(&[1, 151645]), vec![1, 151645, 198]);
        assert_eq!(chat.fix_prefix_boundary(&[1, 2]), vec![1, 2]);
        assert!(chat.is_special(151645));
        assert!(!chat.is_special(198));
        assert_eq!(chat.max_trim_tokens(), 0);
        assert_eq!(chat.assistant_start_str(), Some("<|im_start|>assistant"));
        let mut forced = Map::new();
        forced.insert("clear_thinking".into(), Value::Bool(false));
        assert_eq!(chat.forced_kwargs(), forced);
        let mut conflict = Map::new();
        conflict.insert("clear_thinking".into(), Value::Bool(true));
        assert!(matches!(
            chat.resolve_kwargs(&conflict),
            Err(Error::KwargConflict { .. })
        ));
        assert_eq!(chat.decode(&[151645]), "<|im_end|>");
    }

    #[test]
    fn qwen3_output_parses_reasoning_and_tool_calls() {
        let chat = TitoChat::load(&qwen3_dir(), "qwen3").unwrap();
        let text = "<think>\nplan\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call><|im_end|>";
        let ids = chat.tito().encode(text).unwrap();
        let parsed = chat.parse_assistant(&ids, &[]).unwrap();
        assert_eq!(parsed.reasoning_content.as_deref(), Some("plan\n"));
        assert_eq!(parsed.content, "");
        assert_eq!(parsed.tool_calls.len(), 1);
        assert_eq!(parsed.tool_calls[0].function.name, "f");
    }
}
