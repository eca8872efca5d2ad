//! TITO tokenizer families and incremental tokenization (MILES_SPEC §1.2, §1.4).
//!
//! A [`TitoTokenizer`] pins one chat template (the family's fixed template, or the model's
//! own), the kwargs the family forces, the roles that may be appended to a session, and the
//! family's boundary rule. [`TitoTokenizer::tokenize_additional_messages`] renders only the
//! appended messages (plus the next generation prompt) against a two-message synthetic
//! context, and [`TitoTokenizer::merge_tokens`] joins them to the stored token prefix after
//! fixing the boundary where the model stopped.
//!
//! The DeepSeek V3.2 / V4 families render with the DeepSeek encoders ([`crate::deepseek`])
//! instead of a Jinja template; V4 diffs the renders of the real histories instead of the
//! synthetic context, because its encoder folds adjacent tool results and user turns.

use std::collections::BTreeSet;
use std::sync::Arc;

use miles_core::{Message, Role};
use serde_json::{Map, Value as Json, json};
use tokenizers::Tokenizer;

use crate::comparator::TokenSeqComparator;
use crate::deepseek::{self, DeepSeekVersion};
use crate::error::{Error, Result};
use crate::fastenc::FastEncoder;
use crate::matcher::{MessageMatcher, assert_append_only};
use crate::model::{self, HfChat};
use crate::template::ChatTemplate;

/// All four appendable roles (`VALID_APPEND_ROLES`).
pub const ALL_ROLES: [Role; 4] = [Role::Tool, Role::User, Role::System, Role::Assistant];
const NO_SYSTEM: [Role; 3] = [Role::Tool, Role::User, Role::Assistant];

/// A TITO tokenizer family, named as Miles' `--tito-model` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TitoFamily {
    /// The model's own template, plain concatenation, no forced kwargs.
    Default,
    /// Qwen3 with `qwen3_fixed.jinja`.
    Qwen3,
    /// Qwen3.5 with `qwen3.5_fixed.jinja` (no mid-session system messages).
    Qwen35,
    /// Qwen3 thinking-2507 / Qwen3-Next with `qwen3_thinking_2507_and_next_fixed.jinja`.
    QwenNext,
    /// GLM-4.7: native template, `<|observation|>`/`<|user|>` trim.
    Glm47,
    /// Nemotron 3: native template, `truncate_history_thinking=False`.
    Nemotron3,
    /// Kimi K2.5 with `kimi_k25_fixed.jinja`.
    Kimi25,
    /// Kimi K2.6: native template, `preserve_thinking=True`.
    Kimi26,
    /// MiniMax M2.5 with `minimax_m25_fixed.jinja`.
    MinimaxM25,
    /// MiniMax M2.7 with `minimax_m27_fixed.jinja`.
    MinimaxM27,
    /// DeepSeek V3.2: Miles' vendored `encoding_dsv32` encoder, `drop_thinking=False`.
    DeepseekV32,
    /// DeepSeek V4: sglang's `encoding_dsv4` encoder, `drop_thinking=False`, incremental
    /// tokens from the real histories' renders (no mid-session system messages).
    DeepseekV4,
}

/// How the stored prefix is joined to the incremental tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundaryRule {
    /// Plain concatenation (default, Kimi).
    Concat,
    /// The template writes `END\n` after every message but the model stops at `END`: when
    /// the prefix ends with `END`, append the `\n` token (Qwen, Nemotron: `<|im_end|>`;
    /// MiniMax: `[e~[`).
    NewlineAfter(&'static str),
    /// The model's stop tokens double as the next message's opener: drop one trailing
    /// `<|observation|>` or `<|user|>` (GLM-4.7, `max_trim_tokens = 1`).
    TrimStopOpeners,
}

impl TitoFamily {
    /// Every supported family.
    pub const ALL: [TitoFamily; 12] = [
        Self::Default,
        Self::Qwen3,
        Self::Qwen35,
        Self::QwenNext,
        Self::Glm47,
        Self::Nemotron3,
        Self::Kimi25,
        Self::Kimi26,
        Self::MinimaxM25,
        Self::MinimaxM27,
        Self::DeepseekV32,
        Self::DeepseekV4,
    ];

    /// Miles' name (`qwen3`, `glm47`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::Default => "default",
            Self::Qwen3 => "qwen3",
            Self::Qwen35 => "qwen35",
            Self::QwenNext => "qwennext",
            Self::Glm47 => "glm47",
            Self::Nemotron3 => "nemotron3",
            Self::Kimi25 => "kimi25",
            Self::Kimi26 => "kimi26",
            Self::MinimaxM25 => "minimax_m25",
            Self::MinimaxM27 => "minimax_m27",
            Self::DeepseekV32 => "deepseekv32",
            Self::DeepseekV4 => "deepseekv4",
        }
    }

    /// Parses a Miles family name.
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| Error::UnknownFamily {
                name: name.to_owned(),
                known: Self::ALL.map(Self::name).join(", "),
            })
    }

    /// The fixed template's file name and Jinja source, or `None` for the model's own.
    pub fn fixed_template(self) -> Option<(&'static str, &'static str)> {
        match self {
            Self::Qwen3 => Some((
                "qwen3_fixed.jinja",
                include_str!("../templates/qwen3_fixed.jinja"),
            )),
            Self::Qwen35 => Some((
                "qwen3.5_fixed.jinja",
                include_str!("../templates/qwen3.5_fixed.jinja"),
            )),
            Self::QwenNext => Some((
                "qwen3_thinking_2507_and_next_fixed.jinja",
                include_str!("../templates/qwen3_thinking_2507_and_next_fixed.jinja"),
            )),
            Self::Kimi25 => Some((
                "kimi_k25_fixed.jinja",
                include_str!("../templates/kimi_k25_fixed.jinja"),
            )),
            Self::MinimaxM25 => Some((
                "minimax_m25_fixed.jinja",
                include_str!("../templates/minimax_m25_fixed.jinja"),
            )),
            Self::MinimaxM27 => Some((
                "minimax_m27_fixed.jinja",
                include_str!("../templates/minimax_m27_fixed.jinja"),
            )),
            Self::Default
            | Self::Glm47
            | Self::Nemotron3
            | Self::Kimi26
            | Self::DeepseekV32
            | Self::DeepseekV4 => None,
        }
    }

    /// The kwargs the family forces (`extra_kwargs`).
    pub fn forced_kwargs(self) -> Map<String, Json> {
        let (key, value) = match self {
            Self::Default => return Map::new(),
            Self::Qwen3 | Self::Qwen35 | Self::QwenNext | Self::Glm47 => ("clear_thinking", false),
            Self::MinimaxM25 | Self::MinimaxM27 => ("clear_thinking", false),
            Self::Nemotron3 => ("truncate_history_thinking", false),
            Self::Kimi25 | Self::Kimi26 => ("preserve_thinking", true),
            Self::DeepseekV32 | Self::DeepseekV4 => ("drop_thinking", false),
        };
        let mut map = Map::new();
        map.insert(key.to_owned(), Json::Bool(value));
        map
    }

    /// Roles that may be appended to a session.
    pub fn allowed_append_roles(self) -> &'static [Role] {
        match self {
            Self::Qwen35 | Self::MinimaxM25 | Self::MinimaxM27 | Self::DeepseekV4 => &NO_SYSTEM,
            _ => &ALL_ROLES,
        }
    }

    /// The text that opens an assistant turn (comparator classification), if known.
    pub fn assistant_start_str(self) -> Option<&'static str> {
        match self {
            Self::Default => None,
            Self::Qwen3 | Self::Qwen35 | Self::QwenNext => Some("<|im_start|>assistant"),
            Self::Nemotron3 => Some("<|im_start|>assistant\n"),
            Self::Glm47 => Some("<|assistant|>"),
            Self::Kimi25 | Self::Kimi26 => Some("<|im_assistant|>"),
            Self::MinimaxM25 | Self::MinimaxM27 => Some("]~b]ai"),
            Self::DeepseekV32 | Self::DeepseekV4 => Some(deepseek::ASSISTANT_TOKEN),
        }
    }

    /// How many trailing stored tokens the next prompt may drop (§1.9).
    pub fn max_trim_tokens(self) -> usize {
        usize::from(self == Self::Glm47)
    }

    /// The family's boundary rule.
    pub fn boundary_rule(self) -> BoundaryRule {
        match self {
            Self::Default | Self::Kimi25 | Self::Kimi26 | Self::DeepseekV32 | Self::DeepseekV4 => {
                BoundaryRule::Concat
            }
            Self::Qwen3 | Self::Qwen35 | Self::QwenNext | Self::Nemotron3 => {
                BoundaryRule::NewlineAfter("<|im_end|>")
            }
            Self::MinimaxM25 | Self::MinimaxM27 => BoundaryRule::NewlineAfter("[e~["),
            Self::Glm47 => BoundaryRule::TrimStopOpeners,
        }
    }

    /// The kwargs a tokenizer of this family renders with: `kwargs` with the family's forced
    /// kwargs merged in (a caller value that differs from a forced one is
    /// [`Error::KwargConflict`]); the DeepSeek families also set `thinking` to whether the
    /// kwargs resolve to thinking mode.
    pub fn merge_kwargs(self, kwargs: Map<String, Json>) -> Result<Map<String, Json>> {
        let mut kwargs = merge_forced(self, kwargs)?;
        if self.deepseek_encoder().is_some() {
            let thinking = deepseek::thinking_enabled(&kwargs);
            kwargs.insert("thinking".into(), Json::Bool(thinking));
        }
        Ok(kwargs)
    }

    /// The DeepSeek encoder the family renders with, for the DeepSeek families.
    pub fn deepseek_encoder(self) -> Option<DeepSeekVersion> {
        match self {
            Self::DeepseekV32 => Some(DeepSeekVersion::V32),
            Self::DeepseekV4 => Some(DeepSeekVersion::V4),
            _ => None,
        }
    }

    /// Kwargs that are aliases of one setting: when a request sets any of them,
    /// [`TitoTokenizer::clone_with_chat_template_kwargs`] drops all of them from the base
    /// kwargs first (DeepSeek: `thinking_mode`, `enable_thinking`, `thinking`).
    pub fn kwarg_aliases(self) -> &'static [&'static str] {
        match self {
            Self::DeepseekV32 | Self::DeepseekV4 => {
                &["thinking_mode", "enable_thinking", "thinking"]
            }
            _ => &[],
        }
    }

    /// Texts whose ids form `trailing_token_ids` (where the model may stop, stripped by the
    /// verifier and comparator).
    fn trailing_token_texts(self) -> &'static [&'static str] {
        match self {
            Self::Default | Self::Kimi25 | Self::Kimi26 | Self::DeepseekV32 => &[],
            Self::Glm47 => &["<|observation|>", "<|user|>"],
            Self::DeepseekV4 => &[
                deepseek::ASSISTANT_TOKEN,
                deepseek::THINK_START,
                deepseek::THINK_END,
            ],
            _ => &["\n"],
        }
    }
}

impl std::fmt::Display for TitoFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Boundary rule resolved to token ids.
#[derive(Debug, Clone, Copy)]
enum Boundary {
    Concat,
    NewlineAfter { end: u32, newline: u32 },
    Trim { observation: u32, user: u32 },
}

/// What renders a conversation: a Jinja chat template, or a DeepSeek encoder.
#[derive(Debug, Clone)]
enum Renderer {
    Jinja(ChatTemplate),
    DeepSeek(DeepSeekVersion),
}

/// A family-bound incremental tokenizer (Miles' `TITOTokenizer` subclasses).
#[derive(Debug, Clone)]
pub struct TitoTokenizer {
    family: TitoFamily,
    renderer: Renderer,
    tokenizer: Arc<Tokenizer>,
    fast: Option<Arc<FastEncoder>>,
    fast_decoder: Option<Arc<crate::FastDecoder>>,
    kwargs: Map<String, Json>,
    boundary: Boundary,
    special_ids: BTreeSet<u32>,
    trailing_ids: BTreeSet<u32>,
}

fn token_id(tokenizer: &Tokenizer, family: TitoFamily, text: &str) -> Result<u32> {
    tokenizer
        .token_to_id(text)
        .ok_or_else(|| Error::FamilyTokenizer {
            family: family.name().into(),
            reason: format!("token {text:?} is not in the vocabulary"),
        })
}

fn single_token(tokenizer: &Tokenizer, family: TitoFamily, text: &str) -> Result<u32> {
    let ids = model::encode(tokenizer, text)?;
    match ids.as_slice() {
        [id] => Ok(*id),
        _ => Err(Error::FamilyTokenizer {
            family: family.name().into(),
            reason: format!("{text:?} must encode to exactly one token, got {ids:?}"),
        }),
    }
}

fn merge_forced(family: TitoFamily, mut kwargs: Map<String, Json>) -> Result<Map<String, Json>> {
    for (key, value) in family.forced_kwargs() {
        match kwargs.get(&key) {
            Some(given) if *given != value => {
                return Err(Error::KwargConflict {
                    key,
                    value: given.to_string(),
                    family: family.name().into(),
                });
            }
            _ => {
                kwargs.insert(key, value);
            }
        }
    }
    Ok(kwargs)
}

/// Miles' message normalisation before rendering: assistant `content: null` becomes `""`,
/// and tool-call arguments given as a JSON string are parsed into an object.
pub fn miles_normalise(messages: &[Message]) -> Result<Vec<Json>> {
    messages
        .iter()
        .map(|m| {
            let mut value = m.to_template_value();
            if let Json::Object(map) = &mut value {
                if m.role == Role::Assistant && m.content.is_none() {
                    map.insert("content".into(), Json::String(String::new()));
                }
                if let Some(calls) = &m.tool_calls {
                    map.insert("tool_calls".into(), tool_calls_json(calls)?);
                }
            }
            Ok(value)
        })
        .collect()
}

/// Tool calls as Miles renders them: each call as sent, with `function.arguments` an object
/// (a JSON-string argument is parsed).
fn tool_calls_json(calls: &[miles_core::ToolCall]) -> Result<Json> {
    // Built field by field in the serialised order (`id`, `index`, `type`, `function`), the
    // same object as `serde_json::to_value(call)` with the arguments as an object.
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let args = call
            .function
            .arguments
            .to_object()
            .map_err(|e| Error::json("tool-call arguments", e))?;
        let mut function = Map::new();
        function.insert("name".into(), Json::String(call.function.name.clone()));
        function.insert("arguments".into(), Json::Object(args));
        let mut call_json = Map::new();
        if let Some(id) = &call.id {
            call_json.insert("id".into(), Json::String(id.clone()));
        }
        if let Some(index) = call.index {
            call_json.insert("index".into(), Json::from(index));
        }
        call_json.insert("type".into(), Json::String(call.kind.clone()));
        call_json.insert("function".into(), Json::Object(function));
        out.push(Json::Object(call_json));
    }
    Ok(Json::Array(out))
}

impl TitoTokenizer {
    /// Builds the family's tokenizer over a loaded model directory. The DeepSeek families
    /// render with their encoder; the others with the family's fixed template when it has
    /// one, else the directory's own — except that a directory whose `config.json`
    /// `model_type` is a DeepSeek one renders with that encoder, as in Miles. `kwargs` are
    /// the caller's chat-template kwargs, merged with the family's forced ones (a conflicting
    /// value is an error).
    pub fn new(chat: &HfChat, family: TitoFamily, kwargs: Map<String, Json>) -> Result<Self> {
        let renderer = match (family.deepseek_encoder(), chat.deepseek_version()) {
            (Some(version), Some(model)) if model != version => {
                return Err(Error::FamilyTokenizer {
                    family: family.name().into(),
                    reason: format!(
                        "the model directory's config.json model_type is {model}, the family renders {version}"
                    ),
                });
            }
            (Some(version), _) | (None, Some(version)) => Renderer::DeepSeek(version),
            (None, None) => Renderer::Jinja(match family.fixed_template() {
                Some((_, source)) => {
                    ChatTemplate::new(source)?.with_special_tokens(chat.special_tokens().clone())
                }
                None => chat.template(false)?.clone(),
            }),
        };
        Self::build(chat, renderer, family, kwargs)
    }

    /// Like [`TitoTokenizer::new`] with an explicit template (a user override). The DeepSeek
    /// families take no template (Miles forbids `--chat-template-path` with a named
    /// `--tito-model`): [`Error::InvalidInput`].
    pub fn with_template(
        chat: &HfChat,
        template: ChatTemplate,
        family: TitoFamily,
        kwargs: Map<String, Json>,
    ) -> Result<Self> {
        if let Some(version) = family.deepseek_encoder() {
            return Err(Error::InvalidInput(format!(
                "TITO family {family} renders with the {version} encoder and takes no chat template"
            )));
        }
        Self::build(chat, Renderer::Jinja(template), family, kwargs)
    }

    fn build(
        chat: &HfChat,
        renderer: Renderer,
        family: TitoFamily,
        kwargs: Map<String, Json>,
    ) -> Result<Self> {
        let tokenizer = chat.tokenizer().cloned().ok_or(Error::NoTokenizer)?;
        let kwargs = family.merge_kwargs(kwargs)?;
        let boundary = match family.boundary_rule() {
            BoundaryRule::Concat => Boundary::Concat,
            BoundaryRule::NewlineAfter(end) => Boundary::NewlineAfter {
                end: token_id(&tokenizer, family, end)?,
                newline: single_token(&tokenizer, family, "\n")?,
            },
            BoundaryRule::TrimStopOpeners => Boundary::Trim {
                observation: token_id(&tokenizer, family, "<|observation|>")?,
                user: token_id(&tokenizer, family, "<|user|>")?,
            },
        };
        let mut trailing_ids = BTreeSet::new();
        for text in family.trailing_token_texts() {
            let id = if *text == "\n" {
                single_token(&tokenizer, family, text)?
            } else if family.deepseek_encoder().is_some() {
                // Miles looks these up with convert_tokens_to_ids: a vocabulary without
                // `<think>` (pre-V3.1) just has no such trailing id.
                match tokenizer.token_to_id(text) {
                    Some(id) => id,
                    None => continue,
                }
            } else {
                token_id(&tokenizer, family, text)?
            };
            trailing_ids.insert(id);
        }
        let mut special_ids: BTreeSet<u32> = if family.deepseek_encoder().is_some() {
            [deepseek::USER_TOKEN, deepseek::ASSISTANT_TOKEN]
                .into_iter()
                .map(|text| token_id(&tokenizer, family, text))
                .collect::<Result<_>>()?
        } else {
            tokenizer
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, token)| token.special)
                .map(|(id, _)| id)
                .collect()
        };
        if matches!(family, TitoFamily::Kimi25 | TitoFamily::Kimi26)
            && let Some(id) = tokenizer.token_to_id("<|im_middle|>")
        {
            special_ids.remove(&id);
        }
        Ok(Self {
            family,
            renderer,
            tokenizer,
            fast: chat.fast_encoder().cloned(),
            fast_decoder: chat.fast_decoder().cloned(),
            kwargs,
            boundary,
            special_ids,
            trailing_ids,
        })
    }

    /// `clone_with_chat_template_kwargs`: a tokenizer of the same family whose kwargs are
    /// these merged with `request` (request wins; forced kwargs still conflict). When the
    /// request sets any kwarg of an alias group ([`TitoFamily::kwarg_aliases`]), the base
    /// kwargs of that group are dropped first.
    pub fn clone_with_chat_template_kwargs(&self, request: &Map<String, Json>) -> Result<Self> {
        let mut kwargs = self.kwargs.clone();
        let aliases = self.family.kwarg_aliases();
        if aliases.iter().any(|a| request.contains_key(*a)) {
            for alias in aliases {
                kwargs.shift_remove(*alias);
            }
        }
        for (k, v) in request {
            kwargs.insert(k.clone(), v.clone());
        }
        let kwargs = self.family.merge_kwargs(kwargs)?;
        Ok(Self {
            kwargs,
            ..self.clone()
        })
    }

    /// The family.
    pub fn family(&self) -> TitoFamily {
        self.family
    }

    /// The effective chat-template kwargs.
    pub fn kwargs(&self) -> &Map<String, Json> {
        &self.kwargs
    }

    /// The Jinja template in use (`None` for a DeepSeek encoder).
    pub fn template(&self) -> Option<&ChatTemplate> {
        match &self.renderer {
            Renderer::Jinja(template) => Some(template),
            Renderer::DeepSeek(_) => None,
        }
    }

    /// The DeepSeek encoder in use, if the tokenizer renders with one.
    pub fn deepseek_version(&self) -> Option<DeepSeekVersion> {
        match &self.renderer {
            Renderer::Jinja(_) => None,
            Renderer::DeepSeek(version) => Some(*version),
        }
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Ids the comparator treats as segment boundaries.
    pub fn special_token_ids(&self) -> &BTreeSet<u32> {
        &self.special_ids
    }

    /// Ids the model may stop on that a later prompt re-renders (stripped by the verifier).
    pub fn trailing_token_ids(&self) -> &BTreeSet<u32> {
        &self.trailing_ids
    }

    /// How many trailing stored tokens a later prompt may drop.
    pub fn max_trim_tokens(&self) -> usize {
        self.family.max_trim_tokens()
    }

    /// A comparator configured for this family (§1.10).
    pub fn comparator(&self) -> TokenSeqComparator {
        TokenSeqComparator::new(
            self.tokenizer.clone(),
            self.special_ids.clone(),
            self.trailing_ids.clone(),
            self.family.assistant_start_str().map(str::to_owned),
        )
    }

    /// Renders `messages` (normalised as Miles does) with the family's template and kwargs.
    /// When rendering with tools fails, it is retried once with only the inner `function`
    /// objects of the tools, as Miles does. A DeepSeek encoder gets the messages as sent
    /// (its bridge normalises them: [`deepseek::apply_chat_template`]).
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let messages = match &self.renderer {
            Renderer::Jinja(_) => miles_normalise(messages)?,
            Renderer::DeepSeek(_) => messages.iter().map(Message::to_template_value).collect(),
        };
        self.render_json(&messages, tools, add_generation_prompt)
    }

    fn render_json(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = match &self.renderer {
            Renderer::Jinja(template) => template,
            Renderer::DeepSeek(version) => {
                return deepseek::apply_chat_template(
                    *version,
                    messages,
                    tools,
                    add_generation_prompt,
                    &self.kwargs,
                );
            }
        };
        let tools = tools.map(|t| {
            if t.iter().all(|tool| tool.get("function").is_some()) {
                std::borrow::Cow::Borrowed(t)
            } else {
                std::borrow::Cow::Owned(canonical_tools(t))
            }
        });
        let args = crate::RenderArgs {
            messages,
            tools: tools.as_deref(),
            add_generation_prompt,
            kwargs: &self.kwargs,
        };
        match template.render(args) {
            Ok(text) => Ok(text),
            Err(first) => {
                let Some(tools) = tools.as_deref() else {
                    return Err(first);
                };
                let inner: Vec<Json> = tools
                    .iter()
                    .map(|t| t.get("function").cloned().unwrap_or_else(|| t.clone()))
                    .collect();
                template.render(crate::RenderArgs {
                    tools: Some(&inner),
                    ..args
                })
            }
        }
    }

    /// Encodes text without special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.fast {
            Some(fast) => fast.encode(text),
            None => model::encode(&self.tokenizer, text),
        }
    }

    /// Decodes ids, keeping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.fast_decoder {
            Some(fast) => Ok(fast.decode(ids)),
            None => model::decode(&self.tokenizer, ids),
        }
    }

    /// Full render + encode of a conversation (what a fresh session does).
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode(&self.render(messages, tools, add_generation_prompt)?)
    }

    /// `tokenize_additional_messages` (§1.4): validates that `new` extends `old` with allowed
    /// roles, renders the appended messages plus the generation prompt after the synthetic
    /// context `[dummy system, dummy assistant carrying old's last tool calls]`, checks the
    /// rendered text extends the context's render, and encodes the difference.
    ///
    /// DeepSeek V4 renders the real histories instead — `old` without, `new` with the
    /// generation prompt — because its encoder folds adjacent tool results and user turns;
    /// a render of `old` that is not a prefix is [`Error::RenderNotAppendOnly`].
    pub fn tokenize_additional_messages(
        &self,
        old: &[Message],
        new: &[Message],
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        assert_append_only(
            old,
            new,
            self.family.allowed_append_roles(),
            MessageMatcher::Strict,
        )?;
        if self.family == TitoFamily::DeepseekV4 {
            return self.render_diff(old, new, tools);
        }
        self.tokenize_appended(old, &new[old.len()..], tools)
    }

    /// DeepSeek V4: the ids of `render(new, gen=True)` beyond `render(old, gen=False)`.
    fn render_diff(
        &self,
        old: &[Message],
        new: &[Message],
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        let text_old = self.render(old, tools, false)?;
        let text_new = self.render(new, tools, true)?;
        match text_new.strip_prefix(&text_old) {
            Some(suffix) => self.encode(suffix),
            None => Err(Error::RenderNotAppendOnly {
                family: DeepSeekVersion::V4.model_type().into(),
            }),
        }
    }

    /// [`TitoTokenizer::tokenize_additional_messages`] for a caller that has already checked
    /// that the request extends `old` (a session server validates every request once): the
    /// ids of `appended` plus the generation prompt after `old`, without the append-only
    /// validation. DeepSeek V4 renders `old` followed by `appended` as the new history.
    pub fn tokenize_appended(
        &self,
        old: &[Message],
        appended: &[Message],
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        if self.family == TitoFamily::DeepseekV4 {
            let mut new = old.to_vec();
            new.extend_from_slice(appended);
            return self.render_diff(old, &new, tools);
        }
        let last_calls = match (
            old.last().and_then(|m| m.tool_calls.as_deref()),
            &self.renderer,
        ) {
            (Some(calls), Renderer::Jinja(_)) => tool_calls_json(calls)?,
            // The DeepSeek bridge takes the stored calls as sent.
            (Some(calls), Renderer::DeepSeek(_)) => {
                serde_json::to_value(calls).map_err(|e| Error::json("tool calls", e))?
            }
            (None, _) => json!([]),
        };
        let base = vec![
            json!({"role": "system", "content": "dummy system"}),
            json!({"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": last_calls}),
        ];
        let without = self.render_json(&base, tools, false)?;
        let mut full = base;
        match &self.renderer {
            Renderer::Jinja(_) => full.extend(miles_normalise(appended)?),
            Renderer::DeepSeek(_) => full.extend(appended.iter().map(Message::to_template_value)),
        }
        let with = self.render_json(&full, tools, true)?;
        let Some(suffix) = with.strip_prefix(&without) else {
            return Err(Error::SuffixDiff {
                roles: appended
                    .iter()
                    .map(|m| m.role.as_str().to_owned())
                    .collect(),
            });
        };
        self.encode(suffix)
    }

    /// Applies the family's boundary rule to the stored prefix (where the model stopped).
    pub fn fix_boundary(&self, prefix: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(prefix.len() + 1);
        out.extend_from_slice(prefix);
        self.fix_boundary_in_place(&mut out);
        out
    }

    fn fix_boundary_in_place(&self, out: &mut Vec<u32>) {
        match self.boundary {
            Boundary::Concat => {}
            Boundary::NewlineAfter { end, newline } => {
                if out.last() == Some(&end) {
                    out.push(newline);
                }
            }
            Boundary::Trim { observation, user } => {
                if matches!(out.last(), Some(&id) if id == observation || id == user) {
                    out.pop();
                }
            }
        }
    }

    /// `merge_tokens` (§1.4): the boundary-fixed stored prefix followed by the incremental
    /// tokens of `new` beyond `old`.
    pub fn merge_tokens(
        &self,
        old: &[Message],
        new: &[Message],
        prefix_ids: &[u32],
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        let incremental = self.tokenize_additional_messages(old, new, tools)?;
        let mut out = Vec::with_capacity(prefix_ids.len() + 1 + incremental.len());
        out.extend_from_slice(prefix_ids);
        self.fix_boundary_in_place(&mut out);
        out.extend(incremental);
        Ok(out)
    }
}

impl TitoTokenizer {
    /// The ids the model would have generated for the assistant message `messages[index]`:
    /// the text its render adds after the generation prompt of `messages[..index]`, encoded,
    /// with trailing `trailing_token_ids` (where the model stops) removed.
    pub fn assistant_output_ids(
        &self,
        messages: &[Message],
        index: usize,
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        let prompt = self.render(&messages[..index], tools, true)?;
        let full = self.render(&messages[..=index], tools, false)?;
        let Some(output) = full.strip_prefix(&prompt) else {
            return Err(Error::SuffixDiff {
                roles: vec![Role::Assistant.as_str().to_owned()],
            });
        };
        let mut ids = self.encode(output)?;
        while ids.last().is_some_and(|id| self.trailing_ids.contains(id)) {
            ids.pop();
        }
        Ok(ids)
    }

    /// Replays a conversation through a simulated session: every assistant message is taken
    /// as model output ([`TitoTokenizer::assistant_output_ids`]); the first prompt is a full
    /// render of the messages before it, each later prompt is
    /// [`TitoTokenizer::merge_tokens`] over the stored ids. Messages after the last assistant
    /// message are not used.
    pub fn replay_conversation(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
    ) -> Result<crate::TokenTrajectory> {
        let mut trajectory = crate::TokenTrajectory::new(self.max_trim_tokens());
        let mut stored_end = 0usize;
        for (index, message) in messages.iter().enumerate() {
            if message.role != Role::Assistant {
                continue;
            }
            let prompt = if trajectory.num_turns() == 0 {
                self.apply_chat_template(&messages[..index], tools, true)?
            } else {
                self.merge_tokens(
                    &messages[..stored_end],
                    &messages[..index],
                    trajectory.ids(),
                    tools,
                )?
            };
            let output = self.assistant_output_ids(messages, index, tools)?;
            trajectory.extend(&prompt, &output)?;
            stored_end = index + 1;
        }
        Ok(trajectory)
    }
}

/// Tools as full OpenAI tool objects: a bare function declaration (`{"name": …}`) is
/// wrapped into `{"type": "function", "function": …}`.
pub fn canonical_tools(tools: &[Json]) -> Vec<Json> {
    tools
        .iter()
        .map(|t| {
            if t.get("function").is_some() {
                t.clone()
            } else {
                json!({"type": "function", "function": t})
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_names_round_trip_and_unknown_is_typed() {
        for family in TitoFamily::ALL {
            assert_eq!(TitoFamily::parse(family.name()).unwrap(), family);
        }
        assert!(matches!(
            TitoFamily::parse("gpt"),
            Err(Error::UnknownFamily { .. })
        ));
    }

    #[test]
    fn forced_kwargs_conflict() {
        let mut kwargs = Map::new();
        kwargs.insert("clear_thinking".into(), Json::Bool(true));
        let err = merge_forced(TitoFamily::Qwen3, kwargs).unwrap_err();
        assert_eq!(
            err.to_string(),
            "chat template kwarg clear_thinking=true conflicts with the value registered for qwen3"
        );
        let mut kwargs = Map::new();
        kwargs.insert("clear_thinking".into(), Json::Bool(false));
        kwargs.insert("enable_thinking".into(), Json::Bool(true));
        let merged = merge_forced(TitoFamily::Qwen3, kwargs).unwrap();
        assert_eq!(merged.len(), 2);
        assert!(
            merge_forced(TitoFamily::Default, Map::new())
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn tool_calls_json_is_the_serialised_call_with_object_arguments() {
        let mut with_index = miles_core::ToolCall::function(
            "call_1",
            "f",
            serde_json::from_str(r#"{"b": 1, "a": [2]}"#).unwrap(),
        );
        with_index.index = Some(3);
        let mut string_args = with_index.clone();
        string_args.id = None;
        string_args.index = None;
        string_args.function.arguments = miles_core::ToolArguments::Json(r#"{"z": null}"#.into());
        let built = tool_calls_json(&[with_index.clone(), string_args]).unwrap();
        let expected = json!([
            {"id": "call_1", "index": 3, "type": "function",
             "function": {"name": "f", "arguments": {"b": 1, "a": [2]}}},
            {"type": "function", "function": {"name": "f", "arguments": {"z": null}}}
        ]);
        assert_eq!(built, expected);
        // Same key order as serde's form of the call.
        let serde_keys: Vec<String> = serde_json::to_value(&with_index)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let built_keys: Vec<String> = built[0].as_object().unwrap().keys().cloned().collect();
        assert_eq!(built_keys, serde_keys);
        assert_eq!(
            built[0]["function"]
                .as_object()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["name", "arguments"]
        );
    }

    #[test]
    fn miles_normalisation_parses_string_arguments() {
        let m: Message = serde_json::from_value(json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}))
        .unwrap();
        let out = miles_normalise(&[m]).unwrap();
        assert_eq!(out[0]["content"], json!(""));
        assert_eq!(
            out[0]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
    }
}
