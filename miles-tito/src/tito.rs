//! Incremental (token-in-token-out) tokenization of one TITO family.
//!
//! A [`TitoTokenizer`] pins what the family's row of the table ([`crate::FamilySpec`]) says:
//! one chat template (the family's fixed template, or the model's own), the kwargs the family
//! forces, the roles that may be appended to a session, and the family's boundary rule. [`TitoTokenizer::tokenize_additional_messages`] renders only the
//! appended messages (plus the next generation prompt) against a two-message synthetic
//! context, and [`TitoTokenizer::merge_tokens`] joins them to the stored token prefix after
//! fixing the boundary where the model stopped.
//!
//! The DeepSeek V3.2 / V4 families render with the DeepSeek encoders ([`DeepSeekVersion`])
//! instead of a Jinja template; V4 diffs the renders of the real histories instead of the
//! synthetic context, because its encoder folds adjacent tool results and user turns.

use std::collections::BTreeSet;
use std::sync::Arc;

use miles_core::{Message, Role};
use serde_json::{Map, Value as Json, json};
use tokenizers::Tokenizer;

use crate::args::RenderArgs;
use crate::comparator::TokenSeqComparator;
use crate::deepseek::DeepSeekVersion;
use crate::error::{Error, Result};
use crate::family::{BoundaryRule, Incremental, SpecialIds, TitoFamily};
use crate::fastdec::FastDecoder;
use crate::fastenc::FastEncoder;
use crate::hf;
use crate::matcher::{MessageMatcher, assert_append_only};
use crate::model::HfChat;
use crate::template::ChatTemplate;
use crate::trajectory::TokenTrajectory;

/// Boundary rule resolved to token ids.
#[derive(Debug, Clone)]
enum Boundary {
    Concat,
    NewlineAfter { end: u32, newline: u32 },
    Trim(Vec<u32>),
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
    fast_decoder: Option<Arc<FastDecoder>>,
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
    let ids = hf::encode(tokenizer, text)?;
    match ids.as_slice() {
        [id] => Ok(*id),
        _ => Err(Error::FamilyTokenizer {
            family: family.name().into(),
            reason: format!("{text:?} must encode to exactly one token, got {ids:?}"),
        }),
    }
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
        let spec = family.spec();
        let boundary = match spec.boundary {
            BoundaryRule::Concat => Boundary::Concat,
            BoundaryRule::NewlineAfter(end) => Boundary::NewlineAfter {
                end: token_id(&tokenizer, family, end)?,
                newline: single_token(&tokenizer, family, "\n")?,
            },
            BoundaryRule::TrimStopOpeners(openers) => Boundary::Trim(
                openers
                    .iter()
                    .map(|text| token_id(&tokenizer, family, text))
                    .collect::<Result<_>>()?,
            ),
        };
        let mut trailing_ids = BTreeSet::new();
        for text in spec.trailing_tokens {
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
        let special_ids: BTreeSet<u32> = match spec.special_ids {
            SpecialIds::Exactly(texts) => texts
                .iter()
                .map(|text| token_id(&tokenizer, family, text))
                .collect::<Result<_>>()?,
            SpecialIds::Added { except } => {
                let except: Vec<u32> = except
                    .iter()
                    .filter_map(|text| tokenizer.token_to_id(text))
                    .collect();
                tokenizer
                    .get_added_tokens_decoder()
                    .into_iter()
                    .filter(|(id, token)| token.special && !except.contains(id))
                    .map(|(id, _)| id)
                    .collect()
            }
        };
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

    /// A comparator configured for this family.
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
    /// (its bridge normalises them: [`DeepSeekVersion::apply_chat_template`]).
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
                return version.apply_chat_template(
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
        let args = RenderArgs {
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
                template.render(RenderArgs {
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
            None => hf::encode(&self.tokenizer, text),
        }
    }

    /// Decodes ids, leaving special tokens out when `skip_special_tokens` (the response text
    /// as SGLang gives it).
    pub fn decode_text(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if skip_special_tokens {
            hf::decode_text(&self.tokenizer, ids, true)
        } else {
            self.decode(ids)
        }
    }

    /// Decodes ids, keeping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.fast_decoder {
            Some(fast) => Ok(fast.decode(ids)),
            None => hf::decode(&self.tokenizer, ids),
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

    /// `tokenize_additional_messages`: validates that `new` extends `old` with allowed
    /// roles, renders the appended messages plus the generation prompt after the synthetic
    /// context `[dummy system, dummy assistant carrying old's last tool calls]` (GPT-OSS, when
    /// `old` does not end with tool calls: `[dummy system, dummy user]`), checks the rendered
    /// text extends the context's render, and encodes the difference.
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
        if self.family.spec().incremental == Incremental::RealHistories {
            return self.render_diff(old, new, tools);
        }
        self.tokenize_appended(old, &new[old.len()..], tools)
    }

    /// Real-history families (DeepSeek V4): the ids of `render(new, gen=True)` beyond
    /// `render(old, gen=False)`.
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
                family: self
                    .deepseek_version()
                    .map_or(self.family.name(), DeepSeekVersion::model_type)
                    .into(),
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
        if self.family.spec().incremental == Incremental::RealHistories {
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
        let user_context = self.family.spec().incremental == Incremental::SyntheticUserContext
            && last_calls.as_array().is_none_or(Vec::is_empty);
        let base = if user_context {
            synthetic_user_context()
        } else {
            vec![
                json!({"role": "system", "content": "dummy system"}),
                json!({"role": "assistant", "content": "", "reasoning_content": " ", "tool_calls": last_calls}),
            ]
        };
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
        match &self.boundary {
            Boundary::Concat => {}
            Boundary::NewlineAfter { end, newline } => {
                if out.last() == Some(end) {
                    out.push(*newline);
                }
            }
            Boundary::Trim(openers) => {
                if out.last().is_some_and(|id| openers.contains(id)) {
                    out.pop();
                }
            }
        }
    }

    /// `merge_tokens`: the boundary-fixed stored prefix followed by the incremental
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
    /// with trailing `trailing_token_ids` (where the model stops) removed. GPT-OSS: the text
    /// the message renders to as the last one after the dummy user context.
    pub fn assistant_output_ids(
        &self,
        messages: &[Message],
        index: usize,
        tools: Option<&[Json]>,
    ) -> Result<Vec<u32>> {
        let (prompt, full) = if self.family.spec().incremental == Incremental::SyntheticUserContext
        {
            // GPT-OSS renders earlier turns differently once an answer follows (analysis
            // dropped): the message is rendered last, after the dummy user context.
            let base = synthetic_user_context();
            let mut with = base.clone();
            with.extend(miles_normalise(&messages[index..=index])?);
            (
                self.render_json(&base, tools, true)?,
                self.render_json(&with, tools, false)?,
            )
        } else {
            (
                self.render(&messages[..index], tools, true)?,
                self.render(&messages[..=index], tools, false)?,
            )
        };
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
    ) -> Result<TokenTrajectory> {
        let mut trajectory = TokenTrajectory::new(self.max_trim_tokens());
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

/// The synthetic context of [`Incremental::SyntheticUserContext`] families.
fn synthetic_user_context() -> Vec<Json> {
    vec![
        json!({"role": "system", "content": "dummy system"}),
        json!({"role": "user", "content": "dummy user"}),
    ]
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
