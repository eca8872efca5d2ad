//! The session layer honours the selected message matcher (Miles' `--session-message-matcher`,
//! the v1 contracts of Miles' tests/fast/router/test_session_message_matcher.py): a replay whose
//! tool-call arguments are the same JSON written differently rolls back under `strict` and
//! keeps the checkpoint under `loose_tool_call`; the tokenizer and the committed history keep
//! the stored spelling; `role_content_only` ignores reasoning and tool calls.

use miles_core::{Message, TokenId};
use miles_session::testkit::ByteChatml;
use miles_session::trajectory::{LinearTrajectory, PreparedTurn};

use crate::common::empty_record;
use miles_tito::{ChatTokenizer, MessageMatcher};
use serde_json::{Map, Value, json};

fn message(value: Value) -> Message {
    serde_json::from_value(value).expect("an OpenAI message")
}

fn user() -> Message {
    message(json!({"role": "user", "content": "q"}))
}

/// The assistant turn as the session recorded it.
fn stored_assistant() -> Message {
    message(json!({
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call-A", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"city\":\"Paris\",\"units\":\"metric\"}"}}]
    }))
}

/// The same call replayed by the agent, re-serialised (key order, spacing).
fn replayed_assistant() -> Message {
    message(json!({
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call-A", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"units\": \"metric\", \"city\": \"Paris\"}"}}]
    }))
}

fn tool_result() -> Message {
    message(json!({"role": "tool", "content": "ok", "tool_call_id": "call-A"}))
}

struct Setup {
    tok: ByteChatml,
    kwargs: Map<String, Value>,
    trajectory: LinearTrajectory,
}

impl Setup {
    /// A session with one generated checkpoint: [user] → the stored assistant tool call.
    fn one_checkpoint() -> Self {
        let tok = ByteChatml::default();
        let kwargs = tok.resolve_kwargs(&Map::new()).unwrap();
        let mut trajectory = LinearTrajectory::new();
        let request = [user()];
        let prepared = trajectory
            .prepare(&request, &[], &kwargs, &tok, MessageMatcher::Strict)
            .unwrap();
        let completion: Vec<TokenId> = tok.encode("<tool_call>lookup</tool_call><|im_end|>");
        trajectory
            .commit(
                &prepared,
                &request,
                &completion,
                stored_assistant(),
                empty_record(),
                0,
            )
            .unwrap();
        Self {
            tok,
            kwargs,
            trajectory,
        }
    }

    fn prepare(&self, request: &[Message], matcher: MessageMatcher) -> PreparedTurn {
        self.trajectory
            .prepare(request, &[], &self.kwargs, &self.tok, matcher)
            .unwrap()
    }
}

#[test]
fn strict_rolls_back_on_reserialized_arguments() {
    let s = Setup::one_checkpoint();
    let request = [user(), replayed_assistant(), tool_result()];
    let prepared = s.prepare(&request, MessageMatcher::Strict);
    assert_eq!(prepared.keep_checkpoints, 0);
    // Rolled back to the empty checkpoint: the request is rendered from scratch.
    assert_eq!(
        prepared.prompt_ids,
        s.tok.render(&request, &[], true, &s.kwargs).unwrap()
    );
}

#[test]
fn loose_tool_call_keeps_the_checkpoint_and_the_stored_tokens() {
    let s = Setup::one_checkpoint();
    let request = [user(), replayed_assistant(), tool_result()];
    let prepared = s.prepare(&request, MessageMatcher::LooseToolCall);
    assert_eq!(prepared.keep_checkpoints, 1);
    let stored_ids = s.trajectory.token_ids();
    assert!(stored_ids.len() > 1);
    assert_eq!(&prepared.prompt_ids[..stored_ids.len()], stored_ids);
    // The prompt is what the stored history plus the raw tail gives: the same ids as a
    // request that replays the stored spelling verbatim.
    let verbatim = [user(), stored_assistant(), tool_result()];
    assert_eq!(
        prepared.prompt_ids,
        s.prepare(&verbatim, MessageMatcher::Strict).prompt_ids
    );
}

#[test]
fn a_commit_after_a_loose_accept_keeps_the_stored_spelling() {
    let mut s = Setup::one_checkpoint();
    let request = [user(), replayed_assistant(), tool_result()];
    let prepared = s.prepare(&request, MessageMatcher::LooseToolCall);
    let next = message(json!({"role": "assistant", "content": "done"}));
    let completion: Vec<TokenId> = s.tok.encode("done<|im_end|>");
    s.trajectory
        .commit(
            &prepared,
            &request,
            &completion,
            next.clone(),
            empty_record(),
            0,
        )
        .unwrap();
    assert_eq!(
        s.trajectory.messages(),
        &[user(), stored_assistant(), tool_result(), next.clone()][..]
    );
    // The canonical (stored) replay still matches strictly after the loose commit.
    let canonical = [
        user(),
        stored_assistant(),
        tool_result(),
        next,
        message(json!({"role": "user", "content": "again"})),
    ];
    assert_eq!(
        s.prepare(&canonical, MessageMatcher::Strict)
            .keep_checkpoints,
        2
    );
}

#[test]
fn role_content_only_ignores_reasoning_and_tool_calls() {
    let s = Setup::one_checkpoint();
    let replayed = message(json!({"role": "assistant", "content": "", "reasoning_content": null}));
    let request = [user(), replayed, tool_result()];
    assert_eq!(
        s.prepare(&request, MessageMatcher::RoleContentOnly)
            .keep_checkpoints,
        1
    );
    assert_eq!(
        s.prepare(&request, MessageMatcher::LooseToolCall)
            .keep_checkpoints,
        0
    );
}

#[test]
fn loose_tool_call_still_compares_call_ids_and_names() {
    let s = Setup::one_checkpoint();
    for (id, name) in [("call-B", "lookup"), ("call-A", "search")] {
        let replayed = message(json!({
            "role": "assistant", "content": "",
            "tool_calls": [{"id": id, "type": "function",
                "function": {"name": name, "arguments": "{\"units\": \"metric\", \"city\": \"Paris\"}"}}]
        }));
        let request = [user(), replayed, tool_result()];
        assert_eq!(
            s.prepare(&request, MessageMatcher::LooseToolCall)
                .keep_checkpoints,
            0,
            "{id} {name}"
        );
    }
}
