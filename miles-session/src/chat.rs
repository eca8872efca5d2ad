//! The seam between the session server and a chat template + tokenizer.
//!
//! [`ChatTokenizer`] is everything the server needs from a TITO tokenizer (MILES_SPEC §1): render
//! a conversation to prompt ids, tokenize appended messages incrementally against the stored
//! prefix, parse the model's output ids back into an assistant message, decode, and classify
//! special tokens for the mismatch metric. `miles-tito` implements it through an adapter; the
//! server depends only on this trait.
//!
//! The module also holds the pieces of TITO logic the server owns: strict message matching
//! and append-only validation (§1.6) and the token-sequence comparator (§1.10), written
//! against the trait so that any implementation gets them.

use miles_core::{Message, Role, TokenId, ToolCall, ToolSpec};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

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
    /// incrementally (MILES_SPEC §1.4 `tokenize_additional_messages`). `new` is already
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

    /// Decodes one id (the `token` of OpenAI `logprobs.content`); implementations may cache.
    fn decode_token(&self, id: TokenId) -> std::sync::Arc<str> {
        self.decode(&[id]).into()
    }

    /// Encodes text to ids, special tokens recognised (used to script test and benchmark
    /// engines such as [`crate::testkit::InstantEngine`]). Default: not supported.
    fn encode(&self, text: &str) -> Result<Vec<TokenId>> {
        Err(Error::Tokenization {
            reason: format!(
                "family {} cannot encode text ({} bytes)",
                self.family(),
                text.len()
            ),
        })
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
    /// are appended (MILES_SPEC §1.4): e.g. Qwen3 appends `\n` after a final `<|im_end|>`, GLM
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

    /// Compares the canonical tokenization `expected` with the session's `actual` ids
    /// (MILES_SPEC §1.10).
    fn compare_sequences(&self, expected: &[TokenId], actual: &[TokenId]) -> Vec<Mismatch> {
        compare_sequences(self, expected, actual)
    }
}

/// The kind of a token-sequence mismatch (Miles' comparator types; also the metric suffixes of
/// `tito_session_mismatch_rate/…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MismatchType {
    /// Different number or pattern of special / content segments.
    SpecialTokenCount,
    /// Aligned special tokens differ.
    SpecialTokenType,
    /// Text outside assistant turns differs.
    NonAssistantText,
    /// Text inside an assistant turn differs (tolerated: inherited tokens may differ from the
    /// canonical tokenization).
    AssistantText,
}

impl MismatchType {
    /// All kinds, in Miles' order.
    pub const ALL: [MismatchType; 4] = [
        Self::SpecialTokenCount,
        Self::SpecialTokenType,
        Self::NonAssistantText,
        Self::AssistantText,
    ];

    /// The snake-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SpecialTokenCount => "special_token_count",
            Self::SpecialTokenType => "special_token_type",
            Self::NonAssistantText => "non_assistant_text",
            Self::AssistantText => "assistant_text",
        }
    }
}

/// One mismatch between the canonical and the session token sequence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Mismatch {
    /// The kind.
    #[serde(rename = "type")]
    pub kind: MismatchType,
    /// Index of the aligned segment, −1 for a structural mismatch.
    pub segment_index: i64,
    /// The canonical text (or structure).
    pub expected_text: String,
    /// The session's text (or structure).
    pub actual_text: String,
    /// A human-readable explanation.
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Segment<'a> {
    Special(TokenId),
    Content(&'a [TokenId]),
}

fn segments<'a, T: ChatTokenizer + ?Sized>(tok: &T, ids: &'a [TokenId]) -> Vec<Segment<'a>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &id) in ids.iter().enumerate() {
        if tok.is_special(id) {
            if start < i {
                out.push(Segment::Content(&ids[start..i]));
            }
            out.push(Segment::Special(id));
            start = i + 1;
        }
    }
    if start < ids.len() {
        out.push(Segment::Content(&ids[start..]));
    }
    out
}

fn describe<T: ChatTokenizer + ?Sized>(tok: &T, segs: &[Segment<'_>]) -> String {
    segs.iter()
        .map(|s| match s {
            Segment::Special(id) => format!("[{}]", tok.decode(&[*id])),
            Segment::Content(ids) => format!("({} tokens)", ids.len()),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn is_assistant_content<T: ChatTokenizer + ?Sized>(
    tok: &T,
    segs: &[Segment<'_>],
    i: usize,
) -> bool {
    let (Some(start), Some(Segment::Special(prev)), Segment::Content(ids)) = (
        tok.assistant_start_str(),
        i.checked_sub(1).map(|p| segs[p]),
        segs[i],
    ) else {
        return false;
    };
    let head = &ids[..ids.len().min(20)];
    let text = tok.decode(&[prev]) + &tok.decode(head);
    text.starts_with(start)
}

fn strip_trailing<'a>(mut ids: &'a [TokenId], trailing: &[TokenId]) -> &'a [TokenId] {
    while let Some((last, rest)) = ids.split_last() {
        if trailing.contains(last) {
            ids = rest;
        } else {
            break;
        }
    }
    ids
}

/// The comparator of MILES_SPEC §1.10, generic over any [`ChatTokenizer`].
pub fn compare_sequences<T: ChatTokenizer + ?Sized>(
    tok: &T,
    expected: &[TokenId],
    actual: &[TokenId],
) -> Vec<Mismatch> {
    let trailing = tok.trailing_token_ids();
    let (expected, actual) = (
        strip_trailing(expected, trailing),
        strip_trailing(actual, trailing),
    );
    let exp = segments(tok, expected);
    let act = segments(tok, actual);
    let same_pattern = exp.len() == act.len()
        && exp
            .iter()
            .zip(&act)
            .all(|(a, b)| matches!(a, Segment::Special(_)) == matches!(b, Segment::Special(_)));
    if !same_pattern {
        return vec![Mismatch {
            kind: MismatchType::SpecialTokenCount,
            segment_index: -1,
            expected_text: describe(tok, &exp),
            actual_text: describe(tok, &act),
            detail: format!("expected {} segments, got {}", exp.len(), act.len()),
        }];
    }
    let mut out = Vec::new();
    for (i, (e, a)) in exp.iter().zip(&act).enumerate() {
        match (e, a) {
            (Segment::Special(x), Segment::Special(y)) if x != y => out.push(Mismatch {
                kind: MismatchType::SpecialTokenType,
                segment_index: i as i64,
                expected_text: tok.decode(&[*x]),
                actual_text: tok.decode(&[*y]),
                detail: format!("special token {x} != {y}"),
            }),
            (Segment::Content(x), Segment::Content(y)) => {
                let (tx, ty) = (tok.decode(x), tok.decode(y));
                if tx != ty {
                    let assistant =
                        is_assistant_content(tok, &exp, i) && is_assistant_content(tok, &act, i);
                    out.push(Mismatch {
                        kind: if assistant {
                            MismatchType::AssistantText
                        } else {
                            MismatchType::NonAssistantText
                        },
                        segment_index: i as i64,
                        detail: format!("text differs ({} vs {} tokens)", x.len(), y.len()),
                        expected_text: tx,
                        actual_text: ty,
                    });
                }
            }
            _ => {}
        }
    }
    out
}

/// The template-relevant keys of a message, normalised for strict matching (MILES_SPEC §1.6):
/// `None`, `""` and `[]` collapse to `null`; `index` is dropped from tool calls.
fn normalised_keys(message: &Message) -> [Value; 4] {
    let value = serde_json::to_value(message).unwrap_or(Value::Null);
    let get = |key: &str| -> Value {
        let mut v = value.get(key).cloned().unwrap_or(Value::Null);
        if key == "tool_calls"
            && let Value::Array(calls) = &mut v
        {
            for call in calls.iter_mut() {
                if let Value::Object(map) = call {
                    map.remove("index");
                }
            }
        }
        match &v {
            Value::String(s) if s.is_empty() => Value::Null,
            Value::Array(a) if a.is_empty() => Value::Null,
            _ => v,
        }
    };
    [
        get("role"),
        get("content"),
        get("reasoning_content"),
        get("tool_calls"),
    ]
}

const KEYS: [&str; 4] = ["role", "content", "reasoning_content", "tool_calls"];

/// Strict matching of two messages on role, content, reasoning_content and tool_calls
/// (`None`, `""` and `[]` equal; tool-call `index` ignored), without serialising them.
pub fn messages_match(stored: &Message, new: &Message) -> bool {
    fn content_empty(c: &Option<miles_core::Content>) -> bool {
        match c {
            None => true,
            Some(miles_core::Content::Text(t)) => t.is_empty(),
            Some(miles_core::Content::Parts(p)) => p.is_empty(),
        }
    }
    fn calls(m: &Message) -> &[ToolCall] {
        m.tool_calls.as_deref().unwrap_or(&[])
    }
    fn reasoning(m: &Message) -> Option<&str> {
        m.reasoning_content.as_deref().filter(|r| !r.is_empty())
    }
    stored.role == new.role
        && (if content_empty(&stored.content) {
            content_empty(&new.content)
        } else {
            stored.content == new.content
        })
        && reasoning(stored) == reasoning(new)
        && calls(stored).len() == calls(new).len()
        && calls(stored)
            .iter()
            .zip(calls(new))
            .all(|(a, b)| a.id == b.id && a.kind == b.kind && a.function == b.function)
}

fn short_repr(v: &Value) -> String {
    let s = v.to_string();
    s.chars().take(200).collect()
}

/// Checks that `new` extends `stored` (strict matcher) and that each appended message's role is
/// in `allowed` (MILES_SPEC §1.6). Errors are [`Error::MessageValidation`].
pub fn assert_append_only(stored: &[Message], new: &[Message], allowed: &[Role]) -> Result<()> {
    if stored.is_empty() {
        return Ok(());
    }
    if new.len() < stored.len() {
        return Err(Error::validation(format!(
            "request has {} messages, fewer than the {} stored",
            new.len(),
            stored.len()
        )));
    }
    for (i, (s, n)) in stored.iter().zip(new).enumerate() {
        if messages_match(s, n) {
            continue;
        }
        let (a, b) = (normalised_keys(s), normalised_keys(n));
        if a != b {
            let diffs: Vec<String> = KEYS
                .iter()
                .zip(a.iter().zip(&b))
                .filter(|(_, (x, y))| x != y)
                .map(|(k, (x, y))| {
                    format!("{k}: {{stored: {}, new: {}}}", short_repr(x), short_repr(y))
                })
                .collect();
            return Err(Error::validation(format!(
                "message mismatch at index {i} (role: stored={}, new={}). Diffs: {{{}}}",
                s.role.as_str(),
                n.role.as_str(),
                diffs.join(", ")
            )));
        }
    }
    for (k, message) in new.iter().enumerate().skip(stored.len()) {
        if !allowed.contains(&message.role) {
            let names: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
            return Err(Error::validation(format!(
                "appended message at index {k} has role={}, allowed={names:?}; the selected TITO fixed template does not support appending this role",
                message.role.as_str()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::ToolCall;
    use serde_json::json;

    #[test]
    fn falsy_values_collapse_and_index_is_ignored() {
        let mut a = Message::assistant("");
        a.tool_calls = Some(vec![]);
        let mut b = Message::assistant("x");
        b.content = None;
        assert!(messages_match(&a, &b));
        let mut call = ToolCall::function("c1", "f", Map::new());
        let with_index = {
            let mut c = call.clone();
            c.index = Some(0);
            c
        };
        let x = Message::assistant("").with_tool_calls(vec![with_index]);
        call.index = None;
        let y = Message::assistant("").with_tool_calls(vec![call]);
        assert!(messages_match(&x, &y));
        // Whitespace is significant.
        assert!(!messages_match(&Message::user(" "), &Message::user("")));
    }

    #[test]
    fn append_only_errors_name_index_and_role() {
        let stored = vec![
            Message::system("s"),
            Message::user("u"),
            Message::assistant("a"),
        ];
        let mut changed = stored.clone();
        changed[1] = Message::user("v");
        let err = assert_append_only(&stored, &changed, &[Role::Tool]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("message mismatch at index 1"), "{text}");
        assert!(
            text.contains("content: {stored: \"u\", new: \"v\"}"),
            "{text}"
        );
        let mut appended = stored.clone();
        appended.push(Message::user("again"));
        let err = assert_append_only(&stored, &appended, &[Role::Tool]).unwrap_err();
        assert!(err.to_string().contains("index 3 has role=user"));
        assert!(assert_append_only(&stored, &stored[..2], &[Role::Tool]).is_err());
        assert!(assert_append_only(&stored, &appended, &[Role::User]).is_ok());
        assert_eq!(json!(err.status()), json!(400));
    }
}
