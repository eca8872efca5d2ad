//! One session's linear trajectory (as Miles keeps it) and its records.

use miles_core::{Message, Role, TokenId, ToolSpec};
use miles_tito::{ChatTokenizer, MessageMatcher, assert_append_only};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Miles' `MAX_ASSISTANT_ROLLBACK_STEPS`: a retry may discard at most one generated turn.
pub const MAX_ASSISTANT_ROLLBACK_STEPS: usize = 1;

/// One committed chat-completion call, as Miles records it (`SessionRecord`).
///
/// `request` is the final body sent on (with the server-set `logprobs`, `return_meta_info`, …);
/// its `input_ids` are kept typed in [`SessionRecord::input_ids`] (4 bytes a token instead of
/// a JSON tree) and written back into `request` when the record is serialised, so the wire
/// form is Miles'. `response` is the full completion JSON including `meta_info` with
/// `output_token_logprobs` and, when asked, `routed_experts`.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionRecord {
    /// Commit time, seconds since the Unix epoch.
    pub timestamp: f64,
    /// When the request arrived, seconds since the Unix epoch.
    pub request_timestamp: Option<f64>,
    /// HTTP method (`POST`).
    pub method: String,
    /// `/v1/chat/completions`.
    pub path: String,
    /// The request body as sent to the engine side (without `input_ids` when
    /// [`SessionRecord::input_ids`] is set).
    pub request: Value,
    /// The prompt ids sent to the engine (`request.input_ids` on the wire).
    pub input_ids: Option<Vec<TokenId>>,
    /// The full response body.
    pub response: Value,
    /// HTTP status of the response.
    pub status_code: u16,
}

struct RequestWire<'a> {
    body: &'a Value,
    input_ids: Option<&'a [TokenId]>,
}

impl Serialize for RequestWire<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match (self.body, self.input_ids) {
            (Value::Object(map), Some(ids)) => {
                let mut out = serializer.serialize_map(Some(map.len() + 1))?;
                for (k, v) in map.iter().filter(|(k, _)| k.as_str() != "input_ids") {
                    out.serialize_entry(k, v)?;
                }
                out.serialize_entry("input_ids", ids)?;
                out.end()
            }
            (body, _) => body.serialize(serializer),
        }
    }
}

#[derive(Serialize)]
struct RecordOut<'a> {
    timestamp: f64,
    request_timestamp: Option<f64>,
    method: &'a str,
    path: &'a str,
    request: RequestWire<'a>,
    response: &'a Value,
    status_code: u16,
}

#[derive(Deserialize)]
struct RecordIn {
    timestamp: f64,
    #[serde(default)]
    request_timestamp: Option<f64>,
    method: String,
    path: String,
    request: Value,
    response: Value,
    status_code: u16,
}

impl Serialize for SessionRecord {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        RecordOut {
            timestamp: self.timestamp,
            request_timestamp: self.request_timestamp,
            method: &self.method,
            path: &self.path,
            request: RequestWire {
                body: &self.request,
                input_ids: self.input_ids.as_deref(),
            },
            response: &self.response,
            status_code: self.status_code,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for SessionRecord {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut wire = RecordIn::deserialize(deserializer)?;
        let input_ids = match wire.request.get("input_ids") {
            Some(v) => Some(Vec::<TokenId>::deserialize(v).map_err(serde::de::Error::custom)?),
            None => None,
        };
        if input_ids.is_some()
            && let Value::Object(map) = &mut wire.request
        {
            map.remove("input_ids");
        }
        Ok(Self {
            timestamp: wire.timestamp,
            request_timestamp: wire.request_timestamp,
            method: wire.method,
            path: wire.path,
            request: wire.request,
            input_ids,
            response: wire.response,
            status_code: wire.status_code,
        })
    }
}

/// What phase 1 of a turn computed: the prompt ids and the rollback to apply at commit.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedTurn {
    /// The prompt ids to send to the engine.
    pub prompt_ids: Vec<TokenId>,
    /// Generated turns kept (all of them unless the request is a retry).
    pub keep_checkpoints: usize,
    /// The trajectory's commit counter when prepared (phase 3 commits only if unchanged).
    pub generation: u64,
}

/// The state of one linear session: messages, one token checkpoint per generated assistant
/// turn, and the records.
///
/// The only mutators are [`LinearTrajectory::commit`] (rollback + append, atomically) and
/// nothing else: a request that fails anywhere leaves the trajectory untouched.
#[derive(Debug, Clone, Default)]
pub struct LinearTrajectory {
    messages: Vec<Message>,
    records: Vec<SessionRecord>,
    checkpoints: Vec<Vec<TokenId>>,
    checkpoint_message_ends: Vec<usize>,
    generation: u64,
}

impl LinearTrajectory {
    /// An empty trajectory.
    pub fn new() -> Self {
        Self::default()
    }

    /// The stored messages (history + generated assistant turns).
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The committed records, one per generated turn.
    pub fn records(&self) -> &[SessionRecord] {
        &self.records
    }

    /// Number of generated assistant turns.
    pub fn num_assistant(&self) -> usize {
        self.checkpoints.len()
    }

    /// The accumulated token ids (last checkpoint, or empty).
    pub fn token_ids(&self) -> &[TokenId] {
        self.checkpoints.last().map(Vec::as_slice).unwrap_or(&[])
    }

    /// Commit counter: bumped by every commit.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The tools of the last record's request (what the mismatch metric renders with).
    pub fn last_tools(&self) -> Vec<ToolSpec> {
        self.records
            .last()
            .and_then(|r| r.request.get("tools"))
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .unwrap_or_default()
    }

    /// Rollback detection: how many checkpoints survive for this request (Miles' linear
    /// trajectory), comparing stored and requested messages with `matcher`.
    fn checkpoints_to_keep(&self, request: &[Message], matcher: MessageMatcher) -> Result<usize> {
        let stored = &self.messages;
        if stored.is_empty() {
            return Ok(0);
        }
        let match_len = stored
            .iter()
            .zip(request)
            .take_while(|(a, b)| matcher.matches(a, b))
            .count();
        if match_len >= stored.len() {
            return Ok(self.num_assistant());
        }
        let keep = self
            .checkpoint_message_ends
            .iter()
            .rposition(|&end| end <= match_len)
            .map_or(0, |idx| idx + 1);
        let discard = self.num_assistant() - keep;
        if discard > MAX_ASSISTANT_ROLLBACK_STEPS {
            return Err(Error::validation(format!(
                "rollback failed: discard_count={discard} exceeds \
                 max_assistant_rollback_steps={MAX_ASSISTANT_ROLLBACK_STEPS} \
                 (stored has {} messages, request has {} messages)",
                stored.len(),
                request.len()
            )));
        }
        Ok(keep)
    }

    fn kept_messages(&self, keep: usize) -> &[Message] {
        if keep == self.num_assistant() {
            &self.messages
        } else if keep == 0 {
            &[]
        } else {
            &self.messages[..self.checkpoint_message_ends[keep - 1]]
        }
    }

    /// Phase 1: computes the prompt ids for `request` (rollback detection and append-only
    /// validation under `matcher` — Miles' `--session-message-matcher` — with the family's
    /// roles, then incremental tokenization). Changes nothing.
    ///
    /// The tokenizer sees the effective history, as Miles builds it: the stored messages
    /// verbatim for the matched prefix (a replay a loose matcher accepted is not re-rendered)
    /// and the request's messages after it.
    pub fn prepare(
        &self,
        request: &[Message],
        tools: &[ToolSpec],
        kwargs: &Map<String, Value>,
        tokenizer: &dyn ChatTokenizer,
        matcher: MessageMatcher,
    ) -> Result<PreparedTurn> {
        if request.is_empty() {
            return Err(Error::validation("messages must not be empty"));
        }
        let keep = self.checkpoints_to_keep(request, matcher)?;
        let prompt_ids = if keep == 0 {
            tokenizer.render(request, tools, true, kwargs)?
        } else {
            let stored = self.kept_messages(keep);
            validate_append(stored, request, tokenizer.allowed_append_roles(), matcher)?;
            let mut effective = stored.to_vec();
            effective.extend_from_slice(&request[stored.len()..]);
            tokenizer.merge_tokens(
                stored,
                &effective,
                &self.checkpoints[keep - 1],
                tools,
                kwargs,
            )?
        };
        Ok(PreparedTurn {
            prompt_ids,
            keep_checkpoints: keep,
            generation: self.generation,
        })
    }

    /// Phase 3: applies the prepared rollback, checks that `prompt ⊕ completion` extends the
    /// kept prefix (all but `max_trim_tokens` of it; Miles' TITO trailing-token trim), then appends the
    /// assistant turn, its checkpoint and its record. On error nothing changes.
    pub fn commit(
        &mut self,
        prepared: &PreparedTurn,
        request: &[Message],
        completion_ids: &[TokenId],
        assistant: Message,
        record: SessionRecord,
        max_trim_tokens: usize,
    ) -> Result<()> {
        if prepared.generation != self.generation {
            return Err(Error::validation(
                "session changed since the turn was prepared",
            ));
        }
        let keep = prepared.keep_checkpoints;
        let prev: &[TokenId] = if keep == 0 {
            &[]
        } else {
            &self.checkpoints[keep - 1]
        };
        let mut new_ids = prepared.prompt_ids.clone();
        new_ids.extend_from_slice(completion_ids);
        check_pretokenized_prefix(
            prev,
            &new_ids,
            max_trim_tokens,
            self.kept_messages(keep).len(),
            request.len(),
        )?;
        let kept_len = self.kept_messages(keep).len();
        self.messages.truncate(kept_len);
        self.checkpoints.truncate(keep);
        self.checkpoint_message_ends.truncate(keep);
        self.records.truncate(keep);
        self.messages
            .extend_from_slice(&request[kept_len.min(request.len())..]);
        self.messages.push(assistant);
        self.checkpoints.push(new_ids);
        self.checkpoint_message_ends.push(request.len() + 1);
        self.records.push(record);
        self.generation += 1;
        Ok(())
    }
}

/// Miles' `assert_pretokenized_prefix` (shared by the linear commit and the tree commit): the
/// stored ids `prev`, all but their last `max_trim_tokens`, must be a prefix of `new_ids`
/// (prompt ⊕ completion); otherwise a tokenization error naming the first difference.
pub(crate) fn check_pretokenized_prefix(
    prev: &[TokenId],
    new_ids: &[TokenId],
    max_trim_tokens: usize,
    stored_messages: usize,
    request_messages: usize,
) -> Result<()> {
    let check_len = prev.len().saturating_sub(max_trim_tokens);
    if check_len > 0 && new_ids.get(..check_len) != Some(&prev[..check_len]) {
        let at = prev
            .iter()
            .zip(new_ids)
            .position(|(a, b)| a != b)
            .unwrap_or(new_ids.len().min(check_len));
        return Err(Error::tokenization(format!(
            "pretokenized prefix mismatch at index {at}: stored {} tokens, new {} tokens \
             (checked {check_len}); {stored_messages} stored messages, {request_messages} request messages",
            prev.len(),
            new_ids.len(),
        )));
    }
    Ok(())
}

/// miles-tito's append-only validation of `request` against the `stored` history under
/// `matcher` with the family's appendable roles; a failure is this crate's 400 with Miles'
/// session wording.
fn validate_append(
    stored: &[Message],
    request: &[Message],
    allowed: &[Role],
    matcher: MessageMatcher,
) -> Result<()> {
    assert_append_only(stored, request, allowed, matcher).map_err(|e| match e {
        miles_tito::Error::MessageValidation { reason, .. } => Error::validation(format!(
            "{reason}; the selected TITO fixed template does not support appending this role"
        )),
        other => Error::from(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn append_only_errors_name_index_and_role() {
        let assert_append_only = |s: &[Message], r: &[Message], a: &[Role]| {
            validate_append(s, r, a, MessageMatcher::Strict)
        };
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
