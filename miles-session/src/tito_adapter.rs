//! The miles-tito adapter: [`TitoChat`] implements [`ChatTokenizer`] on top of miles-tito's
//! [`HfChat`] (a model directory loaded as HF transformers does) and [`TitoTokenizer`] (the
//! family's fixed template, forced kwargs, append roles, boundary rule and incremental
//! tokenization), with this crate's [`OutputParser`] for the family's reasoning and tool-call
//! formats (MILES_SPEC §1.2 table).
//!
//! [`load_tokenizer`] has the shape of [`crate::cli::TokenizerLoader`], so the binary serves
//! `--model DIR --tito FAMILY` for every family miles-tito knows.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use miles_core::{Message, Role, TokenId, ToolSpec};
use miles_tito::{HfChat, TitoFamily, TitoTokenizer, TokenSeqComparator};
use serde_json::{Map, Value};

use crate::chat::{self, ChatTokenizer, Mismatch, MismatchType, ParsedAssistant};
use crate::error::{Error, Result};
use crate::parsers::{OutputParser, ReasoningParser, ToolCallParser};

/// Maps a miles-tito error onto this crate's error (and so onto the HTTP status of
/// MILES_SPEC §2.1): kwarg conflicts and message validation keep their kinds, everything else
/// (render, suffix diff, tokenizer) is a tokenization error.
pub fn from_tito(error: miles_tito::Error) -> Error {
    match error {
        miles_tito::Error::KwargConflict { key, value, family } => {
            Error::KwargConflict { key, value, family }
        }
        miles_tito::Error::MessageValidation { reason, .. } => Error::MessageValidation { reason },
        other => Error::Tokenization {
            reason: other.to_string(),
        },
    }
}

/// The reasoning and tool-call parsers the session server uses for a family's output.
///
/// Miles binds SGLang parser names per family (§1.2): `qwen3` + `qwen25` (Qwen3, Qwen-Next),
/// `qwen3` + `qwen3_coder` (Qwen3.5), `nemotron_3` + `qwen3_coder` (Nemotron 3), `glm45` +
/// `glm47` (GLM-4.7), `kimi_k2` + `kimi_k2_raw_id` (Kimi K2.6), `minimax-append-think` +
/// `minimax-m2` (MiniMax M2.5 / M2.7), `deepseek-v3` + `deepseekv32` (DeepSeek V3.2),
/// `deepseek-v4` + `deepseekv4` (DeepSeek V4). Miles leaves Kimi K2.5 unbound; it gets SGLang's
/// Kimi parsers (`kimi_k2` for both), which read its format.
///
/// Where the family's template opens `<think>` in the generation prompt (Qwen3.5, Qwen-Next,
/// Nemotron 3, Kimi K2.5 / K2.6, DeepSeek in thinking mode, the default), the output starts
/// inside the reasoning block: the parser forces reasoning, as SGLang does for these parsers
/// by default; a request that turns thinking off un-forces it
/// ([`OutputParser::for_kwargs`]).
pub fn family_parsers(family: TitoFamily) -> (Option<ReasoningParser>, Option<ToolCallParser>) {
    match family {
        TitoFamily::Qwen3 => (
            Some(ReasoningParser::Qwen3 {
                force_reasoning: false,
            }),
            Some(ToolCallParser::Qwen25),
        ),
        TitoFamily::QwenNext => (
            Some(ReasoningParser::Qwen3 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::Qwen25),
        ),
        TitoFamily::Qwen35 => (
            Some(ReasoningParser::Qwen3 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::Qwen3Coder),
        ),
        TitoFamily::Nemotron3 => (
            Some(ReasoningParser::Nemotron3 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::Qwen3Coder),
        ),
        TitoFamily::Glm47 => (Some(ReasoningParser::Glm45), Some(ToolCallParser::Glm47)),
        TitoFamily::Kimi25 | TitoFamily::Kimi26 => (
            Some(ReasoningParser::KimiK2 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::KimiK2),
        ),
        TitoFamily::MinimaxM25 | TitoFamily::MinimaxM27 => (
            Some(ReasoningParser::MinimaxAppendThink),
            Some(ToolCallParser::MinimaxM2),
        ),
        TitoFamily::DeepseekV32 => (
            Some(ReasoningParser::DeepSeekV3 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::DeepSeekV32),
        ),
        TitoFamily::DeepseekV4 => (
            Some(ReasoningParser::DeepSeekV4 {
                force_reasoning: true,
            }),
            Some(ToolCallParser::DeepSeekV4),
        ),
        TitoFamily::Default => (None, None),
        #[allow(unreachable_patterns)]
        _ => (None, None),
    }
}

/// The texts a family's assistant turn ends with (sent to the engine as stop token ids and
/// stripped from the parsed output).
pub fn family_end_of_turn(family: TitoFamily) -> &'static [&'static str] {
    match family {
        TitoFamily::Qwen3
        | TitoFamily::Qwen35
        | TitoFamily::QwenNext
        | TitoFamily::Nemotron3
        | TitoFamily::Kimi25
        | TitoFamily::Kimi26 => &["<|im_end|>"],
        TitoFamily::Glm47 => &["<|user|>", "<|observation|>", "<|endoftext|>"],
        TitoFamily::MinimaxM25 | TitoFamily::MinimaxM27 => &["[e~["],
        TitoFamily::DeepseekV32 | TitoFamily::DeepseekV4 => &[miles_tito::deepseek::EOS],
        TitoFamily::Default => &[],
        #[allow(unreachable_patterns)]
        _ => &[],
    }
}

/// A TITO family over a loaded model directory, as the session server's [`ChatTokenizer`].
#[derive(Debug, Clone)]
pub struct TitoChat {
    tito: TitoTokenizer,
    parser: OutputParser,
    trailing: Vec<TokenId>,
    stop_ids: Vec<TokenId>,
    comparator: TokenSeqComparator,
    token_texts: Arc<TokenTextCache>,
    tools: Arc<ToolsMemo>,
}

/// The template JSON of the last tool list seen (a session sends the same tools every turn,
/// and every turn renders them twice).
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
            .map(|t| {
                serde_json::to_value(t).map_err(|e| Error::Tokenization {
                    reason: format!("tool spec: {e}"),
                })
            })
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
        let family = TitoFamily::parse(family).map_err(|e| Error::Config(e.to_string()))?;
        let chat = HfChat::load(dir).map_err(|e| Error::Config(e.to_string()))?;
        Self::new(&chat, family)
    }

    /// Builds family `family` over a loaded model directory, with only the family's forced
    /// template kwargs as base kwargs (request kwargs are merged per call).
    pub fn new(chat: &HfChat, family: TitoFamily) -> Result<Self> {
        let tito = TitoTokenizer::new(chat, family, Map::new())
            .map_err(|e| Error::Config(e.to_string()))?;
        let tokenizer = tito.tokenizer().clone();
        let mut end_texts: Vec<String> = family_end_of_turn(family)
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        if let Some(Value::String(eos)) = chat.special_tokens().get("eos_token")
            && !end_texts.contains(eos)
        {
            end_texts.push(eos.clone());
        }
        let stop_ids: Vec<TokenId> = end_texts
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        let (reasoning, tool_calls) = family_parsers(family);
        let parser = OutputParser {
            reasoning,
            tool_calls,
            end_of_turn: end_texts,
        };
        let trailing = tito.trailing_token_ids().iter().copied().collect();
        let comparator = tito.comparator();
        Ok(Self {
            tito,
            parser,
            trailing,
            stop_ids,
            comparator,
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
                .map_err(from_tito)
        }
    }
}

fn mismatch_kind(kind: miles_tito::MismatchType) -> MismatchType {
    match kind {
        miles_tito::MismatchType::SpecialTokenCount => MismatchType::SpecialTokenCount,
        miles_tito::MismatchType::SpecialTokenType => MismatchType::SpecialTokenType,
        miles_tito::MismatchType::NonAssistantText => MismatchType::NonAssistantText,
        miles_tito::MismatchType::AssistantText => MismatchType::AssistantText,
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
        self.with_kwargs(kwargs)?
            .apply_chat_template(messages, tools.as_deref(), add_generation_prompt)
            .map_err(from_tito)
    }

    fn tokenize_additional(
        &self,
        old: &[Message],
        new: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<Vec<TokenId>> {
        let tools = self.tools.json(tools)?;
        self.with_kwargs(kwargs)?
            .tokenize_appended(old, &new[old.len().min(new.len())..], tools.as_deref())
            .map_err(from_tito)
    }

    fn parse_assistant(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
    ) -> Result<ParsedAssistant> {
        let text = self.tito.decode(output_ids).map_err(from_tito)?;
        self.parser.parse(&text, tools)
    }

    fn parse_assistant_with_kwargs(
        &self,
        output_ids: &[TokenId],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
    ) -> Result<ParsedAssistant> {
        let text = self.tito.decode(output_ids).map_err(from_tito)?;
        self.parser.for_kwargs(kwargs).parse(&text, tools)
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
        self.tito.encode(text).map_err(from_tito)
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

    fn compare_sequences(&self, expected: &[TokenId], actual: &[TokenId]) -> Vec<Mismatch> {
        match self.comparator.compare(expected, actual) {
            Ok(found) => found
                .into_iter()
                .map(|m| Mismatch {
                    kind: mismatch_kind(m.kind),
                    segment_index: m.segment_index,
                    expected_text: m.expected_text,
                    actual_text: m.actual_text,
                    detail: m.detail,
                })
                .collect(),
            Err(error) => {
                tracing::warn!(%error, "miles-tito comparator failed; using the generic one");
                chat::compare_sequences(self, expected, actual)
            }
        }
    }
}

/// Loads `dir` as family `family` (a [`crate::cli::TokenizerLoader`]).
pub fn load_tokenizer(dir: &Path, family: &str) -> Result<Arc<dyn ChatTokenizer>> {
    Ok(Arc::new(TitoChat::load(dir, family)?))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn unknown_family_and_missing_dir_are_config_errors() {
        assert!(matches!(
            TitoChat::load(&qwen3_dir(), "qwen9"),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            TitoChat::load(Path::new("/nonexistent/model"), "qwen3"),
            Err(Error::Config(_))
        ));
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
