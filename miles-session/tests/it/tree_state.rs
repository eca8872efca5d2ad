//! Miles' `tests/fast/router/test_session_state.py` (radixark/miles @ 31f1ca961a94; the v2
//! session state: positioning, pretokenized prompts, commits, append roles), ported onto
//! [`TreeTrajectory`] with Miles' mock TITO tokenizer (first turns render as `[0]`,
//! `merge_tokens` returns the stored ids unchanged, the append roles configurable). Tests are
//! named `state_<class>_<case>`.
//!
//! | Miles case | here |
//! |---|---|
//! | `TestSessionCRUD` create / get / not found / remove / missing session (5) | hold over HTTP: the registry is the server's, shared by v1 and v2 (`miles_contracts::sessions_*`) |
//! | `TestSessionCRUD::test_committed_generation_carries_its_record` | holds |
//! | `TestSingleUserTurnPretokenized` (8) | 7 hold; `test_session_not_found_raises` is the registry's (above) |
//! | `TestAppendRoleToolOnly` / `ToolSystem` / `ToolUser` (11) | hold (`state_append_roles_*`, Miles' texts) |
//! | `TestCarriedAssistant` (2) | hold |
//! | `TestRollback` (8) | hold |
//! | `TestJudgmentCountingMatrix` (9) | hold |
//! | `TestUpdatePretokenizedStateMissingSession` | the registry's (above) |
//! | `TestComputeSessionMismatch` (6) | `returns_none_for_empty_token_ids` and `returns_empty_list_when_no_mismatch` hold over HTTP (`state_mismatch_over_http`); `uses_tools_from_last_record` holds there too (the tools of the viewed path's last record are rendered); `returns_mismatch_dicts` is the comparator's (miles-tito, its own tests); `raises_for_missing_session` is the registry's; `raises_tokenization_error_on_exception`: deliberate difference, a render failure leaves the key out (logged), as our v1 does |

use miles_core::{Message, Role, TokenId, ToolSpec};
use miles_session::Error;
use miles_session::trajectory::SessionRecord;
use miles_session::tree::{CommitTurn, NodeId, TreeTrajectory};
use miles_tito::{ChatTokenizer, MessageMatcher, ParsedAssistant};
use serde_json::{Map, Value, json};

/// Miles' `_MockTITOTokenizer`.
struct MockTito {
    allowed: Vec<Role>,
}

impl MockTito {
    fn new(allowed: &[Role]) -> Self {
        Self {
            allowed: allowed.to_vec(),
        }
    }
}

impl ChatTokenizer for MockTito {
    fn family(&self) -> &str {
        "mock"
    }
    fn render(
        &self,
        _: &[Message],
        _: &[ToolSpec],
        _: bool,
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        Ok(vec![0])
    }
    fn tokenize_additional(
        &self,
        _: &[Message],
        _: &[Message],
        _: &[ToolSpec],
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        Ok(Vec::new())
    }
    fn merge_tokens(
        &self,
        _: &[Message],
        _: &[Message],
        pretokenized: &[TokenId],
        _: &[ToolSpec],
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        Ok(pretokenized.to_vec())
    }
    fn parse_assistant(
        &self,
        _: &[TokenId],
        _: &[ToolSpec],
    ) -> miles_tito::Result<ParsedAssistant> {
        Err(miles_tito::Error::InvalidInput("not used".into()))
    }
    fn decode(&self, _: &[TokenId]) -> String {
        String::new()
    }
    fn is_special(&self, _: TokenId) -> bool {
        false
    }
    fn allowed_append_roles(&self) -> &[Role] {
        &self.allowed
    }
}

fn msg(v: Value) -> Message {
    serde_json::from_value(v).unwrap()
}

fn sys() -> Message {
    msg(json!({"role": "system", "content": "You are a helpful assistant."}))
}
fn user() -> Message {
    msg(json!({"role": "user", "content": "What's the weather in Beijing?"}))
}
fn a1() -> Message {
    msg(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Beijing\"}"}}]}))
}
fn tool1() -> Message {
    msg(json!({"role": "tool", "content": "{\"temperature\": 25}", "tool_call_id": "call_1"}))
}
fn a2() -> Message {
    msg(
        json!({"role": "assistant", "content": "It's 25°C in Beijing. Let me also check Shanghai.", "tool_calls": [
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Shanghai\"}"}}]}),
    )
}
fn tool2() -> Message {
    msg(json!({"role": "tool", "content": "{\"temperature\": 30}", "tool_call_id": "call_2"}))
}
fn final_msg() -> Message {
    msg(json!({"role": "assistant", "content": "Beijing is 25°C and Shanghai is 30°C."}))
}
fn retry_sys() -> Message {
    msg(json!({"role": "system", "content": "Please try using the tools to answer."}))
}
fn tool(content: &str, id: &str) -> Message {
    msg(json!({"role": "tool", "content": content, "tool_call_id": id}))
}

const TOOL_ONLY: &[Role] = &[Role::Tool];
const TOOL_SYSTEM: &[Role] = &[Role::Tool, Role::System];
const TOOL_USER: &[Role] = &[Role::Tool, Role::User];

/// Miles' `_commit`: one generation under the current view, a stub record.
fn commit(
    s: &mut TreeTrajectory,
    request: &[Message],
    assistant: Message,
    prompt: &[TokenId],
    completion: &[TokenId],
) -> Result<NodeId, Error> {
    let n = s.tree().nodes().len();
    let record = SessionRecord {
        timestamp: n as f64,
        request_timestamp: None,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        request: json!({"messages": request}),
        input_ids: None,
        response: json!({}),
        status_code: 200,
    };
    s.commit(
        s.active_leaf(),
        CommitTurn {
            request,
            assistant,
            prompt_ids: prompt,
            completion_ids: completion,
            max_trim_tokens: 0,
            record,
            response_id: format!("resp-{n}"),
            finish_reason: "stop".into(),
        },
    )
}

fn prepare(s: &TreeTrajectory, tok: &MockTito, request: &[Message]) -> Result<Vec<TokenId>, Error> {
    s.prepare(request, &[], &Map::new(), tok)
}

fn position(s: &mut TreeTrajectory, request: &[Message]) {
    s.position(request, MessageMatcher::Strict).unwrap();
}

fn path_len(s: &TreeTrajectory) -> usize {
    s.active_records().len()
}

#[test]
fn state_crud_committed_generation_carries_its_record() {
    let mut s = TreeTrajectory::default();
    let node = commit(
        &mut s,
        &[msg(json!({"role": "user", "content": "hello"}))],
        a1(),
        &[1, 2],
        &[10],
    )
    .unwrap();
    let records = s.active_records();
    assert_eq!(records.len(), 1);
    assert_eq!(*records[0], s.tree().nodes()[node].record);
    assert_eq!(records[0].path, "/v1/chat/completions");
}

#[test]
fn state_single_user_turn_first_turn_renders_from_scratch() {
    let s = TreeTrajectory::default();
    assert_eq!(
        prepare(&s, &MockTito::new(TOOL_ONLY), &[sys(), user()]).unwrap(),
        vec![0]
    );
}

#[test]
fn state_single_user_turn_two_and_three_turn_trajectories() {
    let tok = MockTito::new(TOOL_ONLY);
    let mut s = TreeTrajectory::default();
    commit(
        &mut s,
        &[sys(), user()],
        a1(),
        &[1, 2, 3, 4, 5],
        &[10, 11, 12],
    )
    .unwrap();
    assert_eq!(s.active_messages(), vec![sys(), user(), a1()]);
    assert_eq!(s.active_token_ids(), &[1, 2, 3, 4, 5, 10, 11, 12]);
    let t2 = [sys(), user(), a1(), tool1()];
    assert_eq!(
        prepare(&s, &tok, &t2).unwrap(),
        vec![1, 2, 3, 4, 5, 10, 11, 12]
    );
    commit(
        &mut s,
        &t2,
        a2(),
        &[1, 2, 3, 4, 5, 10, 11, 12, 20, 21],
        &[30, 31, 32],
    )
    .unwrap();
    assert_eq!(
        s.active_messages(),
        vec![sys(), user(), a1(), tool1(), a2()]
    );
    let t3 = [sys(), user(), a1(), tool1(), a2(), tool2()];
    assert_eq!(
        prepare(&s, &tok, &t3).unwrap(),
        vec![1, 2, 3, 4, 5, 10, 11, 12, 20, 21, 30, 31, 32]
    );
    commit(
        &mut s,
        &t3,
        final_msg(),
        &[1, 2, 3, 4, 5, 10, 11, 12, 20, 21, 30, 31, 32, 40],
        &[50, 51],
    )
    .unwrap();
    assert_eq!(s.active_messages().len(), 7);
    assert_eq!(
        s.active_token_ids(),
        &[1, 2, 3, 4, 5, 10, 11, 12, 20, 21, 30, 31, 32, 40, 50, 51]
    );
}

#[test]
fn state_single_user_turn_prefix_mismatch_raises() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10, 11]).unwrap();
    let err = commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        final_msg(),
        &[9, 9, 9, 20, 21],
        &[30],
    )
    .unwrap_err();
    assert!(matches!(err, Error::Tokenization { .. }), "{err}");
    assert!(
        err.to_string().contains("pretokenized prefix mismatch"),
        "{err}"
    );
    assert_eq!(s.tree().nodes().len(), 1, "a failed commit appends nothing");
}

#[test]
fn state_single_user_turn_disallowed_env_role_in_suffix_raises() {
    let tok = MockTito::new(TOOL_ONLY);
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10]).unwrap();
    let bad = [
        sys(),
        user(),
        a1(),
        msg(json!({"role": "user", "content": "not allowed here"})),
    ];
    position(&mut s, &bad);
    let err = prepare(&s, &tok, &bad).unwrap_err();
    assert_eq!(err.status(), 400);
    assert!(
        err.to_string()
            .starts_with("appended message role='user' not allowed (allowed=['tool'])"),
        "{err}"
    );
}

#[test]
fn state_single_user_turn_no_system_and_multiple_systems() {
    let tok = MockTito::new(TOOL_ONLY);
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[user()], a1(), &[1, 2], &[10]).unwrap();
    assert_eq!(
        prepare(&s, &tok, &[user(), a1(), tool1()]).unwrap(),
        vec![1, 2, 10]
    );

    let extra = msg(json!({"role": "system", "content": "Extra instructions."}));
    let mut s = TreeTrajectory::default();
    let first = [sys(), extra.clone(), user()];
    assert_eq!(prepare(&s, &tok, &first).unwrap(), vec![0]);
    commit(&mut s, &first, a1(), &[1, 2, 3, 4], &[10, 11]).unwrap();
    assert_eq!(
        s.active_messages(),
        vec![sys(), extra.clone(), user(), a1()]
    );
    assert_eq!(
        prepare(&s, &tok, &[sys(), extra, user(), a1(), tool1()]).unwrap(),
        vec![1, 2, 3, 4, 10, 11]
    );
}

#[test]
fn state_append_roles_follow_the_family() {
    // (allowed roles, appended messages, Ok(prompt) or the refused role)
    type Case = (
        &'static [Role],
        Vec<Message>,
        Result<Vec<TokenId>, &'static str>,
    );
    let cases: Vec<Case> = vec![
        (TOOL_ONLY, vec![tool1()], Ok(vec![1, 2, 3, 10, 11])),
        (TOOL_ONLY, vec![tool1(), retry_sys()], Err("system")),
        (
            TOOL_ONLY,
            vec![tool1(), msg(json!({"role": "user", "content": "extra"}))],
            Err("user"),
        ),
        (TOOL_SYSTEM, vec![tool1()], Ok(vec![1, 2, 3, 10, 11])),
        (
            TOOL_SYSTEM,
            vec![tool1(), retry_sys()],
            Ok(vec![1, 2, 3, 10, 11]),
        ),
        (
            TOOL_SYSTEM,
            vec![tool1(), msg(json!({"role": "user", "content": "extra"}))],
            Err("user"),
        ),
        (TOOL_USER, vec![tool1()], Ok(vec![1, 2, 3, 10, 11])),
        (
            TOOL_USER,
            vec![msg(json!({"role": "user", "content": "follow-up"}))],
            Ok(vec![1, 2, 3, 10, 11]),
        ),
        (TOOL_USER, vec![tool1(), retry_sys()], Err("system")),
    ];
    for (allowed, appended, expected) in cases {
        let tok = MockTito::new(allowed);
        let mut s = TreeTrajectory::default();
        commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10, 11]).unwrap();
        let mut request = vec![sys(), user(), a1()];
        request.extend(appended);
        match (prepare(&s, &tok, &request), expected) {
            (Ok(ids), Ok(want)) => assert_eq!(ids, want),
            (Err(e), Err(role)) => {
                let text = e.to_string();
                assert!(
                    text.starts_with(&format!(
                        "appended message role='{role}' not allowed (allowed=["
                    )),
                    "{text}"
                );
            }
            (got, want) => panic!("{allowed:?}: got {got:?}, want {want:?}"),
        }
    }
}

#[test]
fn state_append_roles_system_then_assistant_and_user_then_assistant_trajectories() {
    for (allowed, inserted) in [
        (TOOL_SYSTEM, retry_sys()),
        (
            TOOL_USER,
            msg(json!({"role": "user", "content": "Also check Shanghai."})),
        ),
    ] {
        let tok = MockTito::new(allowed);
        let mut s = TreeTrajectory::default();
        commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10, 11]).unwrap();
        let t2 = [sys(), user(), a1(), tool1(), inserted.clone()];
        assert!(prepare(&s, &tok, &t2).is_ok());
        commit(&mut s, &t2, a2(), &[1, 2, 3, 10, 11, 20, 21], &[30, 31]).unwrap();
        assert_eq!(
            s.active_messages(),
            vec![sys(), user(), a1(), tool1(), inserted.clone(), a2()]
        );
        let t3 = [sys(), user(), a1(), tool1(), inserted, a2(), tool2()];
        assert!(prepare(&s, &tok, &t3).is_ok());
    }
}

#[test]
fn state_carried_assistant_before_user_allowed_and_refused_without_support() {
    let all = MockTito::new(&[Role::Tool, Role::User, Role::System, Role::Assistant]);
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[user()], a1(), &[1, 2, 3], &[10]).unwrap();
    let carried = msg(json!({"role": "assistant", "content": "summary so far"}));
    let request = [
        user(),
        a1(),
        tool1(),
        carried,
        msg(json!({"role": "user", "content": "continue"})),
    ];
    position(&mut s, &request);
    assert_eq!(prepare(&s, &all, &request).unwrap(), vec![1, 2, 3, 10]);
    assert_eq!(s.active_leaf(), Some(0));
    let err = prepare(&s, &MockTito::new(TOOL_USER), &request).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("appended message role='assistant' not allowed"),
        "{err}"
    );
}

/// `[sys, user] → a1`, `[.., tool1] → a2` (tokens `[1, 2, 3 | 10, 11]`, `[.., 20, 21 | 30, 31]`).
fn two_generations() -> TreeTrajectory {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10, 11]).unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        a2(),
        &[1, 2, 3, 10, 11, 20, 21],
        &[30, 31],
    )
    .unwrap();
    s
}

#[test]
fn state_rollback_to_first_assistant() {
    let tok = MockTito::new(TOOL_ONLY);
    let mut s = two_generations();
    assert_eq!(path_len(&s), 2);
    let retry = [sys(), user(), a1(), tool("{\"temperature\": 99}", "call_1")];
    position(&mut s, &retry);
    assert_eq!(s.active_leaf(), Some(0));
    assert!(prepare(&s, &tok, &retry).is_ok());
    assert_eq!(s.tree().nodes().len(), 2);
    assert_eq!(path_len(&s), 1);
    assert_eq!(s.active_token_ids(), &[1, 2, 3, 10, 11]);
    assert_eq!(s.active_messages(), vec![sys(), user(), a1()]);
}

#[test]
fn state_rollback_multi_step_positions_at_the_deep_anchor_and_destroys_nothing() {
    let mut s = two_generations();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1(), a2(), tool2()],
        final_msg(),
        &[1, 2, 3, 10, 11, 20, 21, 30, 31, 40],
        &[50, 51],
    )
    .unwrap();
    let before = s.tree().clone();
    let messages = s.active_messages();
    position(
        &mut s,
        &[sys(), user(), a1(), tool("{\"alt\": true}", "call_1")],
    );
    assert_eq!(s.active_leaf(), Some(0));
    assert_eq!(s.tree(), &before);
    assert_eq!(s.tree().path_messages(2), messages);
}

#[test]
fn state_rollback_then_continue_full_trajectory() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2, 3], &[10, 11]).unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        a2(),
        &[1, 2, 3, 10, 11, 20],
        &[30],
    )
    .unwrap();
    let retry_tool = tool("{\"retry\": true}", "call_1");
    let retry = [sys(), user(), a1(), retry_tool.clone()];
    position(&mut s, &retry);
    assert!(prepare(&s, &MockTito::new(TOOL_ONLY), &retry).is_ok());
    commit(
        &mut s,
        &retry,
        final_msg(),
        &[1, 2, 3, 10, 11, 40, 41],
        &[50, 51],
    )
    .unwrap();
    assert_eq!(path_len(&s), 2);
    assert_eq!(s.active_token_ids(), &[1, 2, 3, 10, 11, 40, 41, 50, 51]);
    assert_eq!(
        s.active_messages(),
        vec![sys(), user(), a1(), retry_tool, final_msg()]
    );
}

#[test]
fn state_rollback_fewer_messages_than_stored() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        a2(),
        &[1, 2, 10, 20],
        &[30],
    )
    .unwrap();
    let retry = [sys(), user(), a1(), retry_sys()];
    position(&mut s, &retry);
    assert!(prepare(&s, &MockTito::new(TOOL_SYSTEM), &retry).is_ok());
    assert_eq!(path_len(&s), 1);
    assert_eq!(s.active_messages(), vec![sys(), user(), a1()]);
}

#[test]
fn state_rollback_to_second_assistant() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        a2(),
        &[1, 2, 10, 20],
        &[30],
    )
    .unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1(), a2(), tool2()],
        final_msg(),
        &[1, 2, 10, 20, 30, 40],
        &[50],
    )
    .unwrap();
    let retry = [
        sys(),
        user(),
        a1(),
        tool1(),
        a2(),
        tool("{\"alt\": 1}", "call_2"),
    ];
    position(&mut s, &retry);
    assert_eq!(s.active_leaf(), Some(1));
    assert!(prepare(&s, &MockTito::new(TOOL_ONLY), &retry).is_ok());
    assert_eq!(path_len(&s), 2);
    assert_eq!(s.active_token_ids(), &[1, 2, 10, 20, 30]);
    assert_eq!(
        s.active_messages(),
        vec![sys(), user(), a1(), tool1(), a2()]
    );
}

#[test]
fn state_rollback_none_when_append_only() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    let t2 = [sys(), user(), a1(), tool1()];
    position(&mut s, &t2);
    assert_eq!(s.active_leaf(), Some(0));
    assert!(prepare(&s, &MockTito::new(TOOL_ONLY), &t2).is_ok());
    assert_eq!(s.active_token_ids(), &[1, 2, 10]);
}

#[test]
fn state_rollback_no_assistant_in_prefix_opens_a_new_root() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    position(
        &mut s,
        &[
            sys(),
            msg(json!({"role": "user", "content": "different question"})),
        ],
    );
    assert_eq!(s.active_leaf(), None);
    assert_eq!(s.tree().nodes().len(), 1);
}

#[test]
fn state_rollback_shrinks_record_view_in_sync() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1()],
        a2(),
        &[1, 2, 10, 20],
        &[30],
    )
    .unwrap();
    assert_eq!(s.active_records().len(), 2);
    position(
        &mut s,
        &[sys(), user(), a1(), tool("{\"alt\": 1}", "call_1")],
    );
    assert_eq!(s.active_records().len(), 1);
    assert_eq!(*s.active_records()[0], s.tree().nodes()[0].record);
}

#[test]
fn state_judgment_matrix() {
    // test_empty_view_extends_anything
    let mut s = TreeTrajectory::default();
    position(&mut s, &[user()]);
    assert_eq!(s.active_leaf(), None);
    // strict extension, degenerate equal history, pure drop, divergent one generation
    for (request, anchor) in [
        (vec![sys(), user(), a1(), tool1(), a2(), tool2()], Some(1)),
        (vec![sys(), user(), a1(), tool1(), a2()], Some(1)),
        (vec![sys(), user(), a1(), tool1()], Some(0)),
        (
            vec![sys(), user(), a1(), tool("{\"alt\": 1}", "call_1")],
            Some(0),
        ),
    ] {
        let mut s = two_generations();
        position(&mut s, &request);
        assert_eq!(s.active_leaf(), anchor, "{request:?}");
    }
    let mut s = two_generations();
    position(
        &mut s,
        &[sys(), user(), a1(), tool("{\"alt\": 1}", "call_1")],
    );
    assert_eq!(s.active_messages(), vec![sys(), user(), a1()]);
    // deep divergence: the deep anchor, nothing destroyed
    let mut s = two_generations();
    commit(
        &mut s,
        &[sys(), user(), a1(), tool1(), a2(), tool2()],
        final_msg(),
        &[1, 2, 3, 10, 11, 20, 21, 30, 31, 40],
        &[50],
    )
    .unwrap();
    position(
        &mut s,
        &[sys(), user(), a1(), tool("{\"alt\": 1}", "call_1")],
    );
    assert_eq!(s.active_leaf(), Some(0));
    assert_eq!(s.tree().nodes().len(), 3);
    // no anchor
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[sys(), user()], a1(), &[1, 2], &[10]).unwrap();
    position(
        &mut s,
        &[sys(), msg(json!({"role": "user", "content": "different"}))],
    );
    assert_eq!(s.active_leaf(), None);
    assert_eq!(s.tree().nodes().len(), 1);
}

#[test]
fn state_judgment_prompt_assistants_are_not_anchors() {
    let fs_user2 = msg(json!({"role": "user", "content": "the real question"}));
    let few_shot = vec![user(), a1(), fs_user2];
    let mut s = TreeTrajectory::default();
    commit(&mut s, &few_shot, a2(), &[1, 2], &[10]).unwrap();
    let mut t2 = few_shot.clone();
    t2.extend([a2(), tool2()]);
    commit(&mut s, &t2, final_msg(), &[1, 2, 10, 20], &[30]).unwrap();
    let mut retry = few_shot.clone();
    retry.extend([a2(), tool("{\"alt\": 1}", "call_2")]);
    position(&mut s, &retry);
    assert_eq!(s.active_leaf(), Some(0));
    let mut view = few_shot.clone();
    view.push(a2());
    assert_eq!(s.active_messages(), view);
    // test_prefix_with_only_prompt_assistants_has_no_anchor
    let mut s = TreeTrajectory::default();
    commit(&mut s, &few_shot, a2(), &[1, 2], &[10]).unwrap();
    position(
        &mut s,
        &[
            user(),
            a1(),
            msg(json!({"role": "user", "content": "changed"})),
        ],
    );
    assert_eq!(s.active_leaf(), None);
}

#[test]
fn state_truncated_node_closes_its_path_and_the_view_stays() {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[user()], a1(), &[1, 2], &[10]).unwrap();
    let record = s.tree().nodes()[0].record.clone();
    let prompt = [1, 2, 10, 20];
    let turn = CommitTurn {
        request: &[user(), a1(), tool1()],
        assistant: a2(),
        prompt_ids: &prompt,
        completion_ids: &[30],
        max_trim_tokens: 0,
        record,
        response_id: "cut".into(),
        finish_reason: "length".into(),
    };
    s.commit(Some(0), turn).unwrap();
    let err = s
        .position(
            &[user(), a1(), tool1(), a2(), tool2()],
            MessageMatcher::Strict,
        )
        .unwrap_err();
    assert_eq!(err.status(), 409);
    assert_eq!(s.active_leaf(), Some(1));
    // Before the cut is fine.
    position(&mut s, &[user(), a1(), tool2()]);
    assert_eq!(s.active_leaf(), Some(0));
}

#[tokio::test]
async fn state_mismatch_over_http() {
    use miles_session::server::{SessionServerConfig, SessionVersion};
    let env = crate::miles_contracts::router_env_with(SessionServerConfig {
        session_version: SessionVersion::V2,
        ..SessionServerConfig::default()
    })
    .await;
    let sid = env.create_session().await;
    let meta = &env.session(&sid).await["metadata"];
    assert!(meta.get("tito_session_mismatch").is_none());
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let meta = &env.session(&sid).await["metadata"];
    assert_eq!(meta["tito_session_mismatch"], json!([]));
}

// ---------------------------------------------------------------------------------------------
// test_session_message_matcher.py :: TestV2ReplayMatching

/// Miles' `_RecordingTITOTokenizer`: records what `merge_tokens` gets, answers stored + [99].
struct RecordingTito {
    calls: std::sync::Mutex<Vec<(Vec<Message>, Vec<Message>)>>,
}

impl ChatTokenizer for RecordingTito {
    fn family(&self) -> &str {
        "recording"
    }
    fn render(
        &self,
        _: &[Message],
        _: &[ToolSpec],
        _: bool,
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        Ok(vec![0])
    }
    fn tokenize_additional(
        &self,
        _: &[Message],
        _: &[Message],
        _: &[ToolSpec],
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        Ok(Vec::new())
    }
    fn merge_tokens(
        &self,
        old: &[Message],
        new: &[Message],
        pretokenized: &[TokenId],
        _: &[ToolSpec],
        _: &Map<String, Value>,
    ) -> miles_tito::Result<Vec<TokenId>> {
        self.calls
            .lock()
            .unwrap()
            .push((old.to_vec(), new.to_vec()));
        let mut ids = pretokenized.to_vec();
        ids.push(99);
        Ok(ids)
    }
    fn parse_assistant(
        &self,
        _: &[TokenId],
        _: &[ToolSpec],
    ) -> miles_tito::Result<ParsedAssistant> {
        Err(miles_tito::Error::InvalidInput("not used".into()))
    }
    fn decode(&self, _: &[TokenId]) -> String {
        String::new()
    }
    fn is_special(&self, _: TokenId) -> bool {
        false
    }
}

fn matcher_user() -> Message {
    msg(json!({"role": "user", "content": "q"}))
}
fn stored_assistant() -> Message {
    msg(
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call-A", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"city\":\"Paris\",\"units\":\"metric\"}"}}]}),
    )
}
fn replayed_assistant() -> Message {
    msg(
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call-A", "type": "function",
        "function": {"name": "lookup", "arguments": "{\"units\": \"metric\", \"city\": \"Paris\"}"}}]}),
    )
}
fn tool_result() -> Message {
    msg(json!({"role": "tool", "content": "ok", "tool_call_id": "call-A"}))
}

/// Miles' `_state_with_one_node`: `[USER, STORED_ASSISTANT]`, ids `[0, 1]`.
fn state_with_one_node() -> TreeTrajectory {
    let mut s = TreeTrajectory::default();
    commit(&mut s, &[matcher_user()], stored_assistant(), &[0], &[1]).unwrap();
    s
}

#[test]
fn matcher_v2_strict_default_starts_a_new_root_on_reserialized_arguments() {
    let mut s = state_with_one_node();
    position(
        &mut s,
        &[matcher_user(), replayed_assistant(), tool_result()],
    );
    assert_eq!(s.active_leaf(), None);
}

#[test]
fn matcher_v2_loose_matcher_attaches_at_the_stored_node() {
    let mut s = state_with_one_node();
    s.position(
        &[matcher_user(), replayed_assistant(), tool_result()],
        MessageMatcher::LooseToolCall,
    )
    .unwrap();
    assert_eq!(s.active_leaf(), Some(0));
}

#[test]
fn matcher_v2_tito_receives_the_stored_path_verbatim_plus_the_raw_replay_suffix() {
    let mut s = state_with_one_node();
    let tito = RecordingTito {
        calls: Default::default(),
    };
    let replay = [matcher_user(), replayed_assistant(), tool_result()];
    s.position(&replay, MessageMatcher::LooseToolCall).unwrap();
    let ids = s.prepare(&replay, &[], &Map::new(), &tito).unwrap();
    let calls = tito.calls.lock().unwrap();
    let [(old, new)] = &calls[..] else { panic!() };
    assert_eq!(old, &vec![matcher_user(), stored_assistant()]);
    assert_eq!(new[1], stored_assistant());
    assert_eq!(new[2], tool_result());
    assert_eq!(ids, vec![0, 1, 99]);
}
