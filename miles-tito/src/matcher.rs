//! Message matching and append-only validation (Miles' `message_matcher_hub`).
//!
//! Only the template-relevant keys are compared: `role`, `content`, `reasoning_content` and
//! `tool_calls`. `null`, `""` and `[]` compare equal (falsy collapse); anything else,
//! whitespace included, must be identical. Inside `tool_calls` the wire-only key `index` is
//! ignored.

use miles_core::{Content, Message, Role, ToolArguments, ToolCall};
use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};
use crate::loose_json::normalized_arguments;

/// Template-relevant keys compared by the matchers.
pub const TEMPLATE_KEYS: [&str; 4] = ["role", "content", "reasoning_content", "tool_calls"];

/// How a stored message is compared with its replayed counterpart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageMatcher {
    /// Normalised equality of the four template keys (Miles' default).
    #[default]
    Strict,
    /// Only `role` and `content` (high risk: reasoning and tool calls may silently change).
    RoleContentOnly,
    /// What `Strict` accepts, plus tool-call arguments that are the same JSON object written
    /// differently (key order, whitespace, `1` / `1.0`, an object or its JSON text, `""` /
    /// `{}`); call ids, types, names, order, `content` and `reasoning_content` still compared
    /// (Miles' `loose_tool_call`).
    LooseToolCall,
}

impl MessageMatcher {
    /// Parses Miles' `--session-message-matcher` names (`strict`, `loose_tool_call`,
    /// `role_content_only`).
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "strict" => Ok(Self::Strict),
            "loose_tool_call" => Ok(Self::LooseToolCall),
            "role_content_only" => Ok(Self::RoleContentOnly),
            other => Err(Error::InvalidInput(format!(
                "unknown message matcher {other:?} (supported: strict, loose_tool_call, \
                 role_content_only)"
            ))),
        }
    }

    fn keys(self) -> &'static [&'static str] {
        match self {
            Self::Strict | Self::LooseToolCall => &TEMPLATE_KEYS,
            Self::RoleContentOnly => &TEMPLATE_KEYS[..2],
        }
    }

    /// Whether `stored` and `replayed` match. Compares the typed fields directly (the same
    /// relation as comparing the normalised JSON of [`MessageMatcher::diffs`], without
    /// serialising), so validating a long history stays cheap.
    pub fn matches(self, stored: &Message, replayed: &Message) -> bool {
        if stored.role != replayed.role || !content_eq(&stored.content, &replayed.content) {
            return false;
        }
        match self {
            Self::RoleContentOnly => true,
            Self::Strict => {
                str_eq(&stored.reasoning_content, &replayed.reasoning_content)
                    && calls_eq(&stored.tool_calls, &replayed.tool_calls, false)
            }
            Self::LooseToolCall => {
                str_eq(&stored.reasoning_content, &replayed.reasoning_content)
                    && calls_eq(&stored.tool_calls, &replayed.tool_calls, true)
            }
        }
    }

    /// The differing keys with their normalised stored and replayed values (for
    /// `LooseToolCall`, `tool_calls` only when the loose comparison rejects them).
    pub fn diffs(self, stored: &Message, replayed: &Message) -> Vec<(&'static str, Json, Json)> {
        let a = stored.to_template_value();
        let b = replayed.to_template_value();
        let loose_calls_match =
            self == Self::LooseToolCall && calls_eq(&stored.tool_calls, &replayed.tool_calls, true);
        self.keys()
            .iter()
            .filter(|key| !(loose_calls_match && **key == "tool_calls"))
            .filter_map(|key| {
                let x = normalise(key, a.get(*key));
                let y = normalise(key, b.get(*key));
                (x != y).then_some((*key, x, y))
            })
            .collect()
    }
}

fn content_eq(a: &Option<Content>, b: &Option<Content>) -> bool {
    let falsy = |c: &Option<Content>| match c {
        None => true,
        Some(Content::Text(t)) => t.is_empty(),
        Some(Content::Parts(p)) => p.is_empty(),
    };
    match (falsy(a), falsy(b)) {
        (true, true) => true,
        (false, false) => a == b,
        _ => false,
    }
}

fn str_eq(a: &Option<String>, b: &Option<String>) -> bool {
    a.as_deref().unwrap_or_default() == b.as_deref().unwrap_or_default()
}

/// Tool calls compared pairwise in order; `loose`: arguments that are the same JSON object
/// match (see `loose_json`), and arguments that are not one fall back to the raw comparison.
fn calls_eq(a: &Option<Vec<ToolCall>>, b: &Option<Vec<ToolCall>>, loose: bool) -> bool {
    let a = a.as_deref().unwrap_or_default();
    let b = b.as_deref().unwrap_or_default();
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            // `index` is wire-only and ignored.
            x.id == y.id
                && x.kind == y.kind
                && x.function.name == y.function.name
                && (raw_arguments_eq(&x.function.arguments, &y.function.arguments)
                    || loose && loose_arguments_eq(&x.function.arguments, &y.function.arguments))
        })
}

fn raw_arguments_eq(a: &ToolArguments, b: &ToolArguments) -> bool {
    match (a, b) {
        (ToolArguments::Object(p), ToolArguments::Object(q)) => map_eq(p, q),
        (ToolArguments::Json(p), ToolArguments::Json(q)) => p == q,
        _ => false,
    }
}

fn loose_arguments_eq(a: &ToolArguments, b: &ToolArguments) -> bool {
    match (normalized_arguments(a), normalized_arguments(b)) {
        (Some(x), Some(y)) => x == y,
        // Not a JSON object on one side: the raw values decide (already compared).
        _ => false,
    }
}

/// `a == b` for JSON values (objects compare as unordered maps, as serde_json's `==` does),
/// deciding the common case — the same keys in the same order — without hashing a key.
pub(crate) fn json_eq(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Object(x), Json::Object(y)) => map_eq(x, y),
        (Json::Array(x), Json::Array(y)) => slice_eq(x, y),
        _ => a == b,
    }
}

/// [`json_eq`] over two lists.
pub(crate) fn slice_eq(a: &[Json], b: &[Json]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| json_eq(x, y))
}

/// [`json_eq`] of two objects.
pub(crate) fn map_eq(a: &Map<String, Json>, b: &Map<String, Json>) -> bool {
    if a.len() != b.len() {
        return false;
    }
    // Same order: equal exactly when every pair is; otherwise the unordered comparison
    // decides (keys in another order, or a differing value).
    a.iter()
        .zip(b)
        .all(|((ka, va), (kb, vb))| ka == kb && json_eq(va, vb))
        || a == b
}

fn is_falsy(value: Option<&Json>) -> bool {
    match value {
        None | Some(Json::Null) => true,
        Some(Json::String(s)) => s.is_empty(),
        Some(Json::Array(a)) => a.is_empty(),
        _ => false,
    }
}

fn normalise(key: &str, value: Option<&Json>) -> Json {
    if is_falsy(value) {
        return Json::Null;
    }
    let value = value.cloned().unwrap_or(Json::Null);
    if key == "tool_calls"
        && let Json::Array(calls) = value
    {
        return Json::Array(
            calls
                .into_iter()
                .map(|call| match call {
                    Json::Object(mut map) => {
                        map.shift_remove("index");
                        Json::Object(map)
                    }
                    other => other,
                })
                .collect(),
        );
    }
    value
}

fn short_repr(value: &Json) -> String {
    let text = value.to_string();
    text.chars().take(200).collect()
}

/// `assert_messages_append_only_with_allowed_role`: `new` must start with (matching copies
/// of) every `stored` message, and every appended message's role must be in `allowed`.
pub fn assert_append_only(
    stored: &[Message],
    new: &[Message],
    allowed: &[Role],
    matcher: MessageMatcher,
) -> Result<()> {
    if stored.is_empty() {
        return Ok(());
    }
    if new.len() < stored.len() {
        return Err(Error::MessageValidation {
            index: Some(new.len()),
            reason: format!(
                "new messages ({}) are fewer than stored messages ({})",
                new.len(),
                stored.len()
            ),
        });
    }
    for (i, (s, n)) in stored.iter().zip(new).enumerate() {
        if matcher.matches(s, n) {
            continue;
        }
        let diffs = matcher.diffs(s, n);
        {
            let detail: Vec<String> = diffs
                .iter()
                .map(|(k, a, b)| {
                    format!("{k}: {{stored: {}, new: {}}}", short_repr(a), short_repr(b))
                })
                .collect();
            return Err(Error::MessageValidation {
                index: Some(i),
                reason: format!(
                    "message mismatch at index {i} (role: stored={}, new={}). Diffs: {{{}}}",
                    s.role.as_str(),
                    n.role.as_str(),
                    detail.join(", ")
                ),
            });
        }
    }
    check_roles(stored.len(), &new[stored.len()..], allowed)
}

fn check_roles(offset: usize, appended: &[Message], allowed: &[Role]) -> Result<()> {
    for (k, m) in appended.iter().enumerate() {
        if !allowed.contains(&m.role) {
            let names: Vec<&str> = allowed.iter().map(|r| r.as_str()).collect();
            return Err(Error::MessageValidation {
                index: Some(offset + k),
                reason: format!(
                    "appended message at index {} has role={}, allowed={names:?}",
                    offset + k,
                    m.role.as_str()
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msg(v: Json) -> Message {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn falsy_collapse_and_index_ignored() {
        let a = msg(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c", "type": "function", "index": 0, "function": {"name": "f", "arguments": "{}"}}]}));
        let b = msg(json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}));
        assert!(MessageMatcher::Strict.matches(&a, &b));
        let c = msg(json!({"role": "assistant", "content": " ", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}));
        assert!(!MessageMatcher::Strict.matches(&a, &c));
        let d = Message::assistant("").with_reasoning("r");
        let e = Message::assistant("");
        assert!(!MessageMatcher::Strict.matches(&d, &e));
        assert!(MessageMatcher::RoleContentOnly.matches(&d, &e));
        let f = Message::assistant("").with_tool_calls(vec![]);
        assert!(MessageMatcher::Strict.matches(&e, &f));
        let g = Message::assistant("").with_tool_calls(vec![ToolCall::function(
            "x",
            "f",
            Default::default(),
        )]);
        assert!(!MessageMatcher::Strict.matches(&e, &g));
    }

    #[test]
    fn falsy_values_collapse_and_index_is_ignored() {
        let messages_match = |a: &Message, b: &Message| MessageMatcher::Strict.matches(a, b);
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
    fn typed_match_equals_json_diff() {
        let variants = [
            json!({"role": "assistant"}),
            json!({"role": "assistant", "content": ""}),
            json!({"role": "assistant", "content": []}),
            json!({"role": "assistant", "content": " "}),
            json!({"role": "assistant", "content": [{"type": "text", "text": " "}]}),
            json!({"role": "user", "content": " "}),
            json!({"role": "assistant", "reasoning_content": ""}),
            json!({"role": "assistant", "reasoning_content": "r"}),
            json!({"role": "assistant", "tool_calls": []}),
            json!({"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {}}}]}),
            json!({"role": "assistant", "tool_calls": [{"id": "a", "index": 3, "type": "function", "function": {"name": "f", "arguments": {}}}]}),
            json!({"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            json!({"role": "assistant", "tool_calls": [{"id": "b", "type": "function", "function": {"name": "f", "arguments": {}}}]}),
        ];
        let messages: Vec<Message> = variants.iter().cloned().map(msg).collect();
        for matcher in [MessageMatcher::Strict, MessageMatcher::RoleContentOnly] {
            for a in &messages {
                for b in &messages {
                    assert_eq!(
                        matcher.matches(a, b),
                        matcher.diffs(a, b).is_empty(),
                        "{a:?} {b:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn append_only_errors() {
        let stored = vec![Message::user("a"), Message::assistant("b")];
        let all = [Role::Tool, Role::User, Role::System, Role::Assistant];
        assert!(
            assert_append_only(
                &stored,
                &[stored.clone(), vec![Message::user("c")]].concat(),
                &all,
                MessageMatcher::Strict
            )
            .is_ok()
        );
        let err =
            assert_append_only(&stored, &stored[..1], &all, MessageMatcher::Strict).unwrap_err();
        assert!(matches!(
            err,
            Error::MessageValidation { index: Some(1), .. }
        ));
        let changed = vec![Message::user("a"), Message::assistant("B")];
        let err = assert_append_only(&stored, &changed, &all, MessageMatcher::Strict).unwrap_err();
        assert!(
            err.to_string()
                .contains("message mismatch at index 1 (role: stored=assistant, new=assistant)"),
            "{err}"
        );
        let sys = [stored.clone(), vec![Message::system("s")]].concat();
        let err = assert_append_only(
            &stored,
            &sys,
            &[Role::Tool, Role::User],
            MessageMatcher::Strict,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("appended message at index 2 has role=system"),
            "{err}"
        );
        assert!(assert_append_only(&[], &sys, &all, MessageMatcher::Strict).is_ok());
    }
}
