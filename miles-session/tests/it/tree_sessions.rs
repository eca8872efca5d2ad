//! Tree sessions (Miles' session server v2, `--use-session-server v2`), checked against Miles:
//! the samples op on the outputs of Miles' own v2 functions (`fixtures/session/tree_v2/`,
//! made by `gen_tree_v2_fixture.py`: `build_leaf_material`, `drop_retries`,
//! `default_postprocess`, `encode_samples(fields=COMPUTED_FIELDS_V2)`; our blobs must equal
//! Miles' byte for byte), and the contracts of Miles' v2 tests (radixark/miles @ 31f1ca961a94)
//! ported: `tests/fast/router/test_sessions_v2.py` (`v2_*`, over HTTP on loopback, the mock
//! SGLang chat server replaced by `miles_contracts::Scripted`, an engine at the token level)
//! and `test_session_samples_op_v2.py` (`samples_op_v2_*`, the tree built node by node as
//! Miles' tests do, then our samples op). `test_session_v1_v2_parity.py` (`parity_*`) and
//! `test_session_pretokenized_e2e.py` (`pretokenized_e2e_*`) are in `tree_flows.rs`,
//! `test_session_state.py` and the v2 cases of `test_session_message_matcher.py` in
//! `tree_state.rs`; this table covers them all.
//!
//! | Miles case | here |
//! |---|---|
//! | `TestRequestChatTemplateKwargs::test_override_reaches_render_and_backend` | holds (`v2_chat_template_kwargs_override_reaches_render_and_backend`) |
//! | `test_lora_adapter_reaches_backend` | n/a: the session server has no LoRA adapter name to forward (engines serve one model) |
//! | `test_concurrent_requests_from_same_parent_commit_siblings` | holds |
//! | `TestRollbackPins` × 9 | hold (`v2_pins_*`); `disallowed_append_role`: 400 with Miles' text and the view moved, as Miles; our error body is OpenAI-shaped (the text is `error.message`) |
//! | `TestTruncationAndCompaction` × 2 | hold (`v2_extending_truncated_generation_is_409`, `v2_compaction_branch_with_carried_assistant`) |
//! | `TestAdditionR3RequestOffsetV2` × 2 | n/a: no `--pause-generation-mode in_place` (addition R3); routes are always asked in full (as for v1) |
//! | samples op: golden merged, truncation golden, no records, all truncated, broken chain, superseded retry, deep abandoned × 2, two roots, picker order, custom picker keep-all, reorder, longer superseded warns, wall-clock warns | hold, byte for byte (`samples_op_v2_fixture_*`) |
//! | `test_session_metadata_matches_get_session` | holds |
//! | `test_addition_*` × 3 | n/a: addition R3 (see above) |
//! | `test_hook_exception_maps_to_422_with_identity`, `test_duplicate_picker_maps_to_422` | hold (422 naming both hooks) |
//! | `test_impure_picker_maps_to_422` | deliberate difference: a picker returns indices, so it cannot return a rewritten sample; an out-of-range index is the 422 instead |
//! | `test_agent_cannot_fill_missing_server_metadata` | holds |
//! | `test_async_hook_rejected_at_load` | n/a: hooks are a synchronous Rust trait |
//! | `test_missing_session_returns_404`, `test_samples_route_registered_before_catch_all_proxy` | hold |
//! | `test_session_v1_v2_parity.py::test_agentic_v2_drop_retries_matches_v1_training_payload_bitwise` | holds (`parity_*`: our engine double instead of Miles' scripted weather agent; an agent with two one-step retries trains the same sample on v1 and v2, floats compared by bits, metadata projected as Miles projects it) |
//! | `test_session_v1_v2_parity.py::test_sample_bitwise_comparator_distinguishes_signed_zero` | holds (our comparator) |
//! | `test_session_pretokenized_e2e.py` (4 fixed templates, v2 server) | `qwen3-fixed` holds (`pretokenized_e2e_qwen3_fixed_template_on_v2`, HF's ids, one node per turn, no mismatch); `qwen3.5-fixed`, `qwen3-thinking2507-fixed`, `qwen3-next-thinking-fixed`: n/a here (those tokenizers are not in `fixtures/tokenizers/`; their templates are checked in miles-tito) |
//! | `test_session_message_matcher.py::TestV2ReplayMatching` (3) | hold (`tree_state::matcher_v2_*`) |
//! | (ours) | `v2_random_branching_never_fails_and_trains_each_completion_once`: 75 random branching requests over 3 sessions, never a 5xx, every node's completion trained by exactly one sample; `v2_node_cap_is_a_400_and_the_tree_stays`; `v2_agent_driver_*` (the driver under v2) |

use std::sync::Arc;
use std::time::Duration;

use miles_core::{Sample, SampleStatus, TokenId};
use miles_session::Error;
use miles_session::codec::{SamplesWire, decode_samples_as, encode_samples_as};
use miles_session::server::{SessionServerConfig, SessionVersion};
use miles_session::trajectory::SessionRecord;
use miles_session::tree::{NewNode, SessionTree, TreeTrajectory};
use miles_session::tree_samples::{
    DefaultPostprocess, DropRetries, KeepAllLeaves, LeafAssembly, SampleHooks, SamplePicker,
    build_leaf_material, collect_tree_samples, session_metadata,
};
use serde_json::{Map, Value, json};

use crate::miles_contracts::{Env, error_text, router_env_with};

fn fixture_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/session/tree_v2")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(fixture_dir().join("cases.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all["cases"].as_array().unwrap().clone()
}

fn case(name: &str) -> Value {
    cases()
        .into_iter()
        .find(|c| c["name"] == json!(name))
        .unwrap_or_else(|| panic!("no fixture case {name}"))
}

/// The stand-in tokenizer of the fixture script: `<id>` per token.
fn decode(ids: &[TokenId]) -> String {
    ids.iter().map(|i| format!("<{i}>")).collect()
}

/// A custom picker, as a library user writes one (Miles' tests' `_reverse_picker`).
#[derive(Debug)]
struct Reverse;

impl SamplePicker for Reverse {
    fn name(&self) -> &str {
        "test_hooks.reverse"
    }
    fn pick(&self, s: &[Sample], _: &Map<String, Value>) -> Result<Vec<usize>, String> {
        Ok((0..s.len()).rev().collect())
    }
}

#[derive(Debug)]
struct Exploding;

impl SamplePicker for Exploding {
    fn name(&self) -> &str {
        "test_hooks.exploding"
    }
    fn pick(&self, _: &[Sample], _: &Map<String, Value>) -> Result<Vec<usize>, String> {
        Err("policy bug".into())
    }
}

#[derive(Debug)]
struct Duplicate;

impl SamplePicker for Duplicate {
    fn name(&self) -> &str {
        "test_hooks.duplicate"
    }
    fn pick(&self, _: &[Sample], _: &Map<String, Value>) -> Result<Vec<usize>, String> {
        Ok(vec![0, 0])
    }
}

#[derive(Debug)]
struct OutOfRange;

impl SamplePicker for OutOfRange {
    fn name(&self) -> &str {
        "test_hooks.out_of_range"
    }
    fn pick(&self, s: &[Sample], _: &Map<String, Value>) -> Result<Vec<usize>, String> {
        Ok(vec![s.len()])
    }
}

pub(crate) fn hooks(picker: Arc<dyn SamplePicker>) -> SampleHooks {
    SampleHooks {
        picker,
        postprocessor: Arc::new(DefaultPostprocess),
    }
}

fn picker_named(name: &str) -> Arc<dyn SamplePicker> {
    match name {
        "drop_retries" => Arc::new(DropRetries),
        "keep_all" => Arc::new(KeepAllLeaves),
        "reverse" => Arc::new(Reverse),
        other => panic!("unknown picker {other}"),
    }
}

/// The fixture case's tree, built node by node as Miles' tests fabricate it.
fn tree_of(case: &Value) -> TreeTrajectory {
    let mut tree = SessionTree::new();
    for node in case["nodes"].as_array().unwrap() {
        let record: SessionRecord = serde_json::from_value(node["record"].clone()).unwrap();
        let span = node["completion_span"].as_array().unwrap();
        tree.create_node(
            node["parent"].as_u64().map(|p| p as usize),
            NewNode {
                delta_messages: Vec::new(),
                token_ids: serde_json::from_value(node["token_ids"].clone()).unwrap(),
                completion_span: (
                    span[0].as_u64().unwrap() as usize,
                    span[1].as_u64().unwrap() as usize,
                ),
                committed_at: node["committed_at"].as_f64().unwrap(),
                response_id: node["response_id"].as_str().unwrap().to_owned(),
                record,
                finish_reason: node["finish_reason"].as_str().unwrap().to_owned(),
            },
        )
        .unwrap();
    }
    TreeTrajectory::from_tree(tree, case["active_leaf"].as_u64().map(|a| a as usize))
}

/// Our samples op on a fixture case with `hooks`.
fn run_with(case: &Value, hooks: &SampleHooks) -> miles_session::Result<Vec<u8>> {
    let trajectory = tree_of(case);
    let max_trim = case["max_trim_tokens"].as_u64().unwrap() as usize;
    let no_mismatch = |_| None;
    let assembly = LeafAssembly {
        max_seq_len: case["max_seq_len"].as_u64().map(|m| m as usize),
        max_trim_tokens: max_trim,
        decode: &decode,
        mismatch: &no_mismatch,
        save_debug_trajectory_data: case["save_debug_trajectory_data"].as_bool().unwrap(),
    };
    let agent = Some(case["agent_metadata"].clone()).filter(|a| !a.is_null());
    let payload = collect_tree_samples(
        trajectory.tree(),
        session_metadata(&trajectory, max_trim, None),
        agent,
        &assembly,
        hooks,
    )?;
    encode_samples_as(&payload, SamplesWire::V2)
}

fn run(case: &Value) -> miles_session::Result<Vec<u8>> {
    run_with(case, &hooks(picker_named(case["picker"].as_str().unwrap())))
}

/// Our blob for `name` equals Miles' byte for byte; returns it decoded (v2 fields).
fn assert_fixture(name: &str) -> miles_session::codec::SamplesPayload {
    let case = case(name);
    let ours = run(&case).unwrap_or_else(|e| panic!("{name}: {e}"));
    let miles = std::fs::read(fixture_dir().join(case["blob"].as_str().unwrap())).unwrap();
    if ours != miles {
        let meta = |b: &[u8]| {
            let t = miles_core::NamedTensors::from_safetensors_bytes(b).unwrap();
            String::from_utf8(t.get("_samples_meta").unwrap().data().to_vec()).unwrap()
        };
        panic!(
            "{name}: blob differs from Miles'\nours:  {}\nmiles: {}",
            meta(&ours),
            meta(&miles)
        );
    }
    decode_samples_as(&ours, &Sample::default(), SamplesWire::V2).unwrap()
}

#[test]
fn samples_op_v2_fixture_every_case_is_byte_identical() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        match case["status"].as_u64().unwrap() {
            200 => {
                assert_fixture(name);
            }
            _ => {
                let err = run(&case).unwrap_err();
                assert_eq!(err.status(), 422, "{name}");
                assert!(matches!(err, Error::Assembly { .. }), "{name}: {err}");
            }
        }
    }
}

#[test]
fn samples_op_v2_fixture_golden_merged() {
    // Miles' test_assembled_samples_golden_merged, on our side of the wire.
    let p = assert_fixture("two_turn_merged");
    let [m] = &p.samples[..] else { panic!() };
    assert_eq!(m.tokens, vec![1, 2, 3, 10, 11, 20, 21, 30, 31]);
    assert_eq!(m.response, "<10><11><20><21><30><31>");
    assert_eq!(m.response_length, 6);
    assert_eq!(m.loss_mask, Some(vec![1, 1, 0, 0, 1, 1]));
    assert_eq!(
        m.rollout_log_probs,
        Some(vec![-0.125, -0.25, 0.0, 0.0, -0.5, -1.0])
    );
    assert_eq!(m.status, SampleStatus::Completed);
    assert_eq!(m.weight_versions, vec!["w1", "w2"]);
    let r3 = m.rollout_routed_experts.as_ref().unwrap();
    assert_eq!(r3.shape(), [8, 3, 2]);
    assert_eq!(r3.as_slice(), &(100..148).collect::<Vec<i32>>()[..]);
    assert_eq!(m.prefix_cache_info.cached_tokens, 5);
    assert_eq!(m.prefix_cache_info.total_prompt_tokens, 10);
    // The agent's layer over the sample's; the server's keys last.
    assert_eq!(m.metadata["shared_key"], json!("from-agent"));
    assert_eq!(m.metadata["agent_only"], json!(1));
    assert_eq!(
        m.metadata["accumulated_token_ids"],
        json!([1, 2, 3, 10, 11, 20, 21, 30, 31])
    );
    assert_eq!(
        p.session_metadata["agent"]["shared_key"],
        json!("from-agent")
    );
}

#[test]
fn samples_op_v2_fixture_truncation_golden() {
    let p = assert_fixture("two_turn_truncated");
    let [last] = &p.samples[..] else { panic!() };
    assert_eq!(last.status, SampleStatus::Truncated);
    assert_eq!(last.tokens, vec![1, 2, 3, 10, 11, 20, 21, 30]);
    assert_eq!(last.loss_mask, Some(vec![1, 1, 0, 0, 1]));
    assert_eq!(last.rollout_routed_experts.as_ref().unwrap().rows(), 7);
}

#[test]
fn samples_op_v2_fixture_empty_replies_and_broken_chain() {
    use miles_session::codec::EmptyReason;
    assert_eq!(
        assert_fixture("no_records").empty_reason,
        Some(EmptyReason::NoRecords)
    );
    assert_eq!(
        assert_fixture("all_truncated").empty_reason,
        Some(EmptyReason::AllTruncated)
    );
    let err = run(&case("broken_chain")).unwrap_err();
    assert_eq!(err.status(), 422);
    assert!(err.to_string().contains("cursor"), "{err}");
}

#[test]
fn samples_op_v2_fixture_tree_data_plane() {
    // Superseded retry trimmed: one sample, the retry's.
    let p = assert_fixture("retry_trimmed");
    assert_eq!(p.samples.len(), 1);
    assert_eq!(p.samples[0].tokens, vec![1, 2, 3, 10, 11, 21, 31]);
    // Deep abandoned branch: two samples, the shared root completion trained once.
    for reward in [1.0, 0.0] {
        let p = assert_fixture(&format!("deep_abandoned_reward_{}", reward as u8));
        let [early, late] = &p.samples[..] else {
            panic!()
        };
        assert_eq!(early.tokens, vec![1, 2, 3, 10, 11, 20, 30, 40, 50]);
        assert_eq!(late.tokens, vec![1, 2, 3, 10, 11, 21, 31]);
        assert_eq!(early.loss_mask.as_ref().unwrap()[..2], [1, 1]);
        assert_eq!(late.loss_mask.as_ref().unwrap()[..2], [0, 0]);
        assert_eq!(late.loss_mask.as_ref().unwrap().last(), Some(&1));
        for s in [early, late] {
            assert_eq!(s.reward, Some(miles_core::Reward::Scalar(reward)));
            assert_eq!(s.metadata["reward"], json!(reward));
        }
    }
    // Two roots: latest-first order, no reward.
    let p = assert_fixture("two_roots");
    assert_eq!(p.samples[0].tokens, vec![7, 8, 70, 71]);
    assert_eq!(p.samples[1].tokens, vec![1, 2, 3, 10, 11]);
    assert_eq!(
        p.session_metadata["tree"]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["parent"].clone())
            .collect::<Vec<_>>(),
        vec![Value::Null, Value::Null]
    );
    assert!(p.samples.iter().all(|s| s.reward.is_none()));
    // Picker order: path length, then commit order, descending.
    let p = assert_fixture("picker_order");
    let order: Vec<Value> = p
        .samples
        .iter()
        .map(|s| s.metadata["leaf"]["node_id"].clone())
        .collect();
    assert_eq!(order, vec![json!(1), json!(3), json!(2)]);
    // Custom pickers: keep-all makes the abandoned (earlier) leaf the owner; reordering
    // does not change the owner.
    for (name, abandoned_first) in [("keep_all_retry", true), ("reverse_retry", false)] {
        let p = assert_fixture(name);
        let (abandoned, retry) = if abandoned_first {
            (&p.samples[0], &p.samples[1])
        } else {
            (&p.samples[1], &p.samples[0])
        };
        assert_eq!(abandoned.tokens, vec![1, 2, 3, 10, 11, 20, 30]);
        assert_eq!(abandoned.loss_mask.as_ref().unwrap()[..2], [1, 1]);
        assert_eq!(retry.loss_mask.as_ref().unwrap()[..2], [0, 0]);
    }
}

#[test]
fn samples_op_v2_fixture_picker_warnings_are_miles() {
    for name in ["longer_superseded_warns", "wall_clock_rollback_warns"] {
        let case = case(name);
        assert_fixture(name);
        let trajectory = tree_of(&case);
        let no_mismatch = |_| None;
        let assembly = LeafAssembly {
            max_seq_len: None,
            max_trim_tokens: 0,
            decode: &decode,
            mismatch: &no_mismatch,
            save_debug_trajectory_data: false,
        };
        let material = build_leaf_material(trajectory.tree(), &assembly).unwrap();
        let meta = session_metadata(&trajectory, 0, None);
        let (kept, warnings) = DropRetries.pick_with_warnings(&material, &meta).unwrap();
        assert_eq!(kept.len(), 1, "{name}");
        assert_eq!(json!(warnings), case["warnings"], "{name}");
    }
}

#[test]
fn samples_op_v2_hook_failures_are_422_naming_both_hooks() {
    let retry = case("keep_all_retry");
    for (picker, needle) in [
        (Arc::new(Exploding) as Arc<dyn SamplePicker>, "policy bug"),
        (Arc::new(Duplicate), "without duplicates"),
        (Arc::new(OutOfRange), "subset"),
    ] {
        let name = picker.name().to_owned();
        let err = run_with(&retry, &hooks(picker)).unwrap_err();
        assert_eq!(err.status(), 422);
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "session sample hook failed (picker={name}, postprocessor=default_postprocess): "
            )),
            "{text}"
        );
        assert!(text.contains(needle), "{text}");
    }
}

#[test]
fn samples_op_v2_agent_cannot_fill_missing_server_metadata() {
    // The server computed no mismatch: the agent's `tito_session_mismatch` does not appear.
    let p = assert_fixture("shared_masks_agent_layering");
    for s in &p.samples {
        assert!(!s.metadata.contains_key("tito_session_mismatch"));
        assert_eq!(s.metadata["leaf"]["node_id"], s.metadata["leaf"]["node_id"]);
        assert!(s.metadata["leaf"].is_object());
        assert_eq!(s.metadata["note"], json!("from agent"));
    }
    assert_fixture("shared_masks_truncated");
    assert_fixture("truncated_leaf_debug_trim");
}

// ---------------------------------------------------------------------------------------------
// test_sessions_v2.py, over HTTP

pub(crate) async fn v2_env() -> Env {
    v2_env_with(SessionServerConfig::default()).await
}

pub(crate) async fn v2_env_with(config: SessionServerConfig) -> Env {
    router_env_with(SessionServerConfig {
        session_version: SessionVersion::V2,
        ..config
    })
    .await
}

pub(crate) fn u1() -> Value {
    json!({"role": "user", "content": "What is 1+2?"})
}

pub(crate) fn t1() -> Value {
    json!({"role": "tool", "content": "tool-result-1", "tool_call_id": "t0"})
}

pub(crate) fn t1_diff() -> Value {
    json!({"role": "tool", "content": "tool-result-DIFFERENT", "tool_call_id": "t0"})
}

pub(crate) async fn turn(env: &Env, sid: &str, messages: Value) -> Value {
    let r = env.post_chat(sid, &json!({ "messages": messages })).await;
    assert_eq!(r.status, 200, "{}", r.text());
    r.json::<Value>().unwrap()["choices"][0]["message"].clone()
}

pub(crate) async fn records(env: &Env, sid: &str) -> Vec<Value> {
    env.session(sid).await["records"]
        .as_array()
        .unwrap()
        .clone()
}

pub(crate) async fn tree(env: &Env, sid: &str) -> Value {
    env.session(sid).await["metadata"]["tree"].clone()
}

/// `[U1, a1, T1, a2]`, two records.
async fn two_turn_session(env: &Env) -> (String, Value, Value) {
    let sid = env.create_session().await;
    let a1 = turn(env, &sid, json!([u1()])).await;
    let a2 = turn(env, &sid, json!([u1(), a1, t1()])).await;
    assert_eq!(records(env, &sid).await.len(), 2);
    (sid, a1, a2)
}

pub(crate) async fn collect(env: &Env, sid: &str) -> miles_session::codec::SamplesPayload {
    let r = env.samples(sid, &json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    decode_samples_as(&r.body, &Sample::default(), SamplesWire::V2).unwrap()
}

#[tokio::test]
async fn v2_chat_template_kwargs_override_reaches_render_and_backend() {
    let mut kwargs = Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let env = v2_env_with(SessionServerConfig {
        chat_template_kwargs: kwargs,
        ..SessionServerConfig::default()
    })
    .await;
    let a = env.create_session().await;
    turn(&env, &a, json!([{"role": "user", "content": "hi"}])).await;
    let default_ids = env.backend.last().input_ids;
    let rec = &records(&env, &a).await[0];
    assert_eq!(
        rec["request"]["chat_template_kwargs"]["enable_thinking"],
        json!(false)
    );
    let b = env.create_session().await;
    let r = env
        .post_chat(
            &b,
            &json!({"messages": [{"role": "user", "content": "hi"}],
                    "chat_template_kwargs": {"enable_thinking": true}}),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_ne!(env.backend.last().input_ids, default_ids);
}

#[tokio::test]
async fn v2_concurrent_requests_from_same_parent_commit_siblings() {
    let env = v2_env_with(SessionServerConfig {
        sample_hooks: hooks(Arc::new(KeepAllLeaves)),
        ..SessionServerConfig::default()
    })
    .await;
    let sid = env.create_session().await;
    let a = turn(&env, &sid, json!([{"role": "user", "content": "start"}])).await;
    let payload = json!({"messages": [{"role": "user", "content": "start"}, a,
                                      {"role": "user", "content": "branch"}]});
    env.backend.set_delay(Duration::from_millis(300));
    let (r1, r2) = tokio::join!(env.post_chat(&sid, &payload), env.post_chat(&sid, &payload));
    assert_eq!(
        (r1.status.as_u16(), r2.status.as_u16()),
        (200, 200),
        "{} {}",
        r1.text(),
        r2.text()
    );
    let ids: std::collections::BTreeSet<String> = [&r1, &r2]
        .iter()
        .map(|r| {
            r.json::<Value>().unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids.len(), 2);
    let tree = tree(&env, &sid).await;
    let nodes = tree["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3);
    assert!(nodes[1..].iter().all(|n| n["parent"] == nodes[0]["id"]));
    let children: std::collections::BTreeSet<String> = nodes[1..]
        .iter()
        .map(|n| n["response_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(children, ids);
    let p = collect(&env, &sid).await;
    let leaves: std::collections::BTreeSet<String> = p
        .samples
        .iter()
        .map(|s| {
            s.metadata["leaf"]["response_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(leaves, ids);
}

#[tokio::test]
async fn v2_pins_pure_drop_retry_rolls_back_and_regenerates() {
    let env = v2_env().await;
    let (sid, a1, _) = two_turn_session(&env).await;
    turn(&env, &sid, json!([u1(), a1, t1()])).await;
    let recs = records(&env, &sid).await;
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[1]["request"]["messages"][2], t1());
}

#[tokio::test]
async fn v2_pins_divergent_retry_rolls_back_and_continues() {
    let env = v2_env().await;
    let (sid, a1, _) = two_turn_session(&env).await;
    turn(&env, &sid, json!([u1(), a1, t1_diff()])).await;
    let recs = records(&env, &sid).await;
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[1]["request"]["messages"][2], t1_diff());
}

#[tokio::test]
async fn v2_pins_deep_divergence_branches_and_keeps_both_lines() {
    let env = v2_env().await;
    let (sid, a1, a2) = two_turn_session(&env).await;
    let t2 = json!({"role": "tool", "content": "tool-result-2", "tool_call_id": "t1"});
    turn(&env, &sid, json!([u1(), a1, t1(), a2, t2])).await;
    assert_eq!(records(&env, &sid).await.len(), 3);
    turn(&env, &sid, json!([u1(), a1, t1_diff()])).await;
    assert_eq!(records(&env, &sid).await.len(), 2);
    let tree = tree(&env, &sid).await;
    assert_eq!(tree["nodes"].as_array().unwrap().len(), 4);
    let mut depths: Vec<usize> = tree["leaves"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["path_node_ids"].as_array().unwrap().len())
        .collect();
    depths.sort_unstable();
    assert_eq!(depths, vec![2, 3]);
    let p = collect(&env, &sid).await;
    assert_eq!(p.samples.len(), 2);
    for s in &p.samples {
        let segments = s.metadata["lifecycle"].as_array().unwrap();
        assert!(!segments.is_empty());
        assert!(segments.iter().all(|seg| seg["req_ts"].is_f64()));
    }
}

#[tokio::test]
async fn v2_pins_root_divergence_opens_new_root() {
    let env = v2_env().await;
    let sid = env.create_session().await;
    turn(&env, &sid, json!([u1()])).await;
    turn(
        &env,
        &sid,
        json!([{"role": "user", "content": "a different opening"}]),
    )
    .await;
    assert_eq!(records(&env, &sid).await.len(), 1);
    let parents: Vec<Value> = tree(&env, &sid).await["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["parent"].clone())
        .collect();
    assert_eq!(parents, vec![Value::Null, Value::Null]);
    assert_eq!(collect(&env, &sid).await.samples.len(), 2);
}

#[tokio::test]
async fn v2_pins_failed_first_turn_then_different_first_request_accepted() {
    let env = v2_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(|_| {
        Err(miles_core::Error::Engine {
            kind: miles_core::EngineErrorKind::InvalidRequest,
            message: "context too long".into(),
        })
    }));
    let r = env.post_chat(&sid, &json!({"messages": [u1()]})).await;
    assert_eq!(r.status, 400);
    assert!(records(&env, &sid).await.is_empty());
    env.backend.set_reply(Arc::new(|_| Ok("fine".into())));
    let other = json!({"role": "user", "content": "a completely different opening"});
    turn(&env, &sid, json!([other])).await;
    let recs = records(&env, &sid).await;
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0]["request"]["messages"], json!([other]));
}

#[tokio::test]
async fn v2_pins_degenerate_extension_resend_exact_history() {
    let env = v2_env().await;
    let sid = env.create_session().await;
    let a1 = turn(&env, &sid, json!([u1()])).await;
    turn(&env, &sid, json!([u1(), a1])).await;
    assert_eq!(records(&env, &sid).await.len(), 2);
}

#[tokio::test]
async fn v2_pins_disallowed_append_role_400_with_rollback_side_effect() {
    let env = v2_env().await;
    let (sid, a1, _) = two_turn_session(&env).await;
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": [u1(), a1, {"role": "developer", "content": "another"}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    let text = error_text(&r);
    assert!(
        text.ends_with("; the selected TITO fixed template does not support appending this role"),
        "{text}"
    );
    assert!(text.starts_with("appended message role='developer' not allowed (allowed=['assistant', 'system', 'tool', 'user'])"), "{text}");
    // As in Miles: the view moved to the attach point before the role check refused.
    assert_eq!(records(&env, &sid).await.len(), 1);
}

#[tokio::test]
async fn v2_pins_collect_samples_after_rollback_single_sample() {
    let env = v2_env().await;
    let (sid, a1, _) = two_turn_session(&env).await;
    turn(&env, &sid, json!([u1(), a1, t1()])).await;
    let p = collect(&env, &sid).await;
    assert_eq!(p.empty_reason, None);
    let [s] = &p.samples[..] else {
        panic!("{} samples", p.samples.len())
    };
    assert!(s.response_length > 0);
    assert_eq!(s.loss_mask.as_ref().unwrap().len(), s.response_length);
}

#[tokio::test]
async fn v2_pins_few_shot_first_request_divergent_retry_rolls_back_cleanly() {
    let env = v2_env().await;
    let few_shot = vec![
        json!({"role": "user", "content": "Q-few-shot"}),
        json!({"role": "assistant", "content": "A-few-shot"}),
        json!({"role": "user", "content": "Q-real"}),
    ];
    let sid = env.create_session().await;
    let a1 = turn(&env, &sid, json!(few_shot)).await;
    let mut t2 = few_shot.clone();
    t2.extend([a1.clone(), t1()]);
    turn(&env, &sid, json!(t2)).await;
    assert_eq!(records(&env, &sid).await.len(), 2);
    let mut retry = few_shot.clone();
    retry.extend([a1, t1_diff()]);
    turn(&env, &sid, json!(retry)).await;
    assert_eq!(records(&env, &sid).await.len(), 2);
}

#[tokio::test]
async fn v2_extending_truncated_generation_is_409() {
    let env = v2_env().await;
    let sid = env.create_session().await;
    let r = env
        .post_chat(&sid, &json!({"messages": [u1()], "max_tokens": 3}))
        .await;
    assert_eq!(r.status, 200);
    let body: Value = r.json().unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], json!("length"));
    let a1 = body["choices"][0]["message"].clone();
    let r = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1()]}))
        .await;
    assert_eq!(r.status, 409);
    assert!(error_text(&r).contains("truncated generation cannot be extended"));
    turn(&env, &sid, json!([{"role": "user", "content": "fresh"}])).await;
}

#[tokio::test]
async fn v2_compaction_branch_with_carried_assistant() {
    let env = v2_env().await;
    let sid = env.create_session().await;
    let a1 = turn(&env, &sid, json!([u1()])).await;
    let carried = json!({"role": "assistant", "content": "compacted summary of earlier work"});
    let go = json!({"role": "tool", "content": "go", "tool_call_id": "t1"});
    turn(&env, &sid, json!([u1(), a1, t1(), carried, go])).await;
    let tree = tree(&env, &sid).await;
    let nodes = tree["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    assert_eq!(nodes[1]["parent"], nodes[0]["id"]);
    // The carried assistant is prompt: only the generated completions train.
    let p = collect(&env, &sid).await;
    let s = &p.samples[0];
    let mask = s.loss_mask.as_ref().unwrap();
    let first = nodes[0]["completion_span"][1].as_u64().unwrap() as usize
        - nodes[0]["completion_span"][0].as_u64().unwrap() as usize;
    let second = nodes[1]["completion_span"][1].as_u64().unwrap() as usize
        - nodes[1]["completion_span"][0].as_u64().unwrap() as usize;
    assert_eq!(
        mask.iter().map(|&m| m as usize).sum::<usize>(),
        first + second
    );
}

#[tokio::test]
async fn samples_op_v2_session_metadata_matches_get_session() {
    let env = v2_env().await;
    let (sid, _, _) = two_turn_session(&env).await;
    let p = collect(&env, &sid).await;
    let got = env.session(&sid).await["metadata"].clone();
    assert_eq!(Value::Object(p.session_metadata.clone()), got);
    assert_eq!(
        p.samples[0].metadata["accumulated_token_ids"],
        got["accumulated_token_ids"]
    );
}

#[tokio::test]
async fn samples_op_v2_missing_session_404_and_fresh_session_no_records() {
    let env = v2_env().await;
    let r = env.samples("0123abcd", &json!({"max_seq_len": null})).await;
    assert_eq!(r.status, 404);
    assert!(error_text(&r).contains("not found"));
    let sid = env.create_session().await;
    let r = env.samples(&sid, &json!({"max_seq_len": null})).await;
    assert_eq!(r.status, 200);
    let p = decode_samples_as(&r.body, &Sample::default(), SamplesWire::V2).unwrap();
    assert_eq!(
        p.empty_reason,
        Some(miles_session::codec::EmptyReason::NoRecords)
    );
}

#[tokio::test]
async fn v2_agent_metadata_and_reward_reach_the_samples() {
    let env = v2_env().await;
    let (sid, _, _) = two_turn_session(&env).await;
    let r = env
        .samples(
            &sid,
            &json!({"metadata": {"reward": 0.75, "leaf": "plant", "k": "v"}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let input = Sample {
        reward: Some(miles_core::Reward::Scalar(-1.0)),
        ..Sample::default()
    };
    let p = decode_samples_as(&r.body, &input, SamplesWire::V2).unwrap();
    let s = &p.samples[0];
    assert_eq!(s.reward, Some(miles_core::Reward::Scalar(0.75)));
    assert_eq!(s.metadata["k"], json!("v"));
    assert!(s.metadata["leaf"].is_object());
    // Bad inputs are typed 4xx.
    for body in [
        json!({"metadata": [1, 2]}),
        json!({"generate_multi_samples": true}),
    ] {
        let r = env.samples(&sid, &body).await;
        assert_eq!(r.status, 400, "{body}");
    }
    let r = env
        .samples(&sid, &json!({"metadata": {"reward": "high"}}))
        .await;
    assert_eq!(r.status, 422);
    assert!(error_text(&r).contains("agent reward must be a number or an object"));
}

#[tokio::test]
async fn v2_node_cap_is_a_400_and_the_tree_stays() {
    let env = v2_env_with(SessionServerConfig {
        max_tree_nodes: 2,
        ..SessionServerConfig::default()
    })
    .await;
    let sid = env.create_session().await;
    turn(&env, &sid, json!([u1()])).await;
    turn(&env, &sid, json!([{"role": "user", "content": "other"}])).await;
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": [{"role": "user", "content": "third"}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert!(
        error_text(&r).contains("node cap reached (2)"),
        "{}",
        error_text(&r)
    );
    assert_eq!(tree(&env, &sid).await["nodes"].as_array().unwrap().len(), 2);
    assert_eq!(collect(&env, &sid).await.samples.len(), 2);
}

#[test]
fn session_version_parses_miles_values() {
    for (text, version) in [
        ("v1", SessionVersion::V1),
        ("true", SessionVersion::V1),
        ("", SessionVersion::V1),
        ("v2", SessionVersion::V2),
    ] {
        assert_eq!(text.parse::<SessionVersion>().unwrap(), version);
    }
    let err = "v3".parse::<SessionVersion>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid configuration: --use-session-server=\"v3\" is not a known session server \
         version; pass it bare (or 'v1') for the append-only linear server, or 'v2' for tree \
         serving."
    );
    assert_eq!(
        SessionServerConfig::default().session_version,
        SessionVersion::V1
    );
}

/// An agent that answers, then retries its second turn with a different tool result, then
/// reports a reward: the tree keeps both attempts, `drop_retries` keeps the retry.
struct RetryingAgent;

#[async_trait::async_trait]
impl miles_session::agent::Agent for RetryingAgent {
    async fn run(
        &self,
        ctx: miles_session::agent::AgentContext,
    ) -> Result<Map<String, Value>, String> {
        let http = miles_session::http::HttpClient::new(Duration::from_secs(10));
        let url = format!("{}/v1/chat/completions", ctx.base_url);
        let mut messages = json!(ctx.prompt);
        let chat = async |messages: &Value| -> Result<Value, String> {
            let r = http
                .post_json(&url, &json!({"messages": messages}), &[])
                .await
                .map_err(|e| e.to_string())?;
            let v: Value = r.json().map_err(|e| e.to_string())?;
            Ok(v["choices"][0]["message"].clone())
        };
        let a1 = chat(&messages).await?;
        messages.as_array_mut().unwrap().push(a1);
        let mut first = messages.clone();
        first.as_array_mut().unwrap().push(t1());
        chat(&first).await?;
        messages.as_array_mut().unwrap().push(t1_diff());
        chat(&messages).await?;
        let mut out = Map::new();
        out.insert(miles_session::agent::AGENT_REWARD_KEY.into(), json!(0.5));
        out.insert("agent_note".into(), json!("retried"));
        Ok(out)
    }
}

#[tokio::test]
async fn v2_agent_driver_sends_reward_and_metadata_and_gets_the_kept_leaves() {
    use miles_session::agent::{AgentDriverConfig, generate_samples};
    let keep_all = v2_env_with(SessionServerConfig {
        sample_hooks: hooks(Arc::new(KeepAllLeaves)),
        ..SessionServerConfig::default()
    })
    .await;
    let default = v2_env().await;
    let input = Sample {
        prompt: miles_core::Prompt::Messages(vec![miles_core::Message::user("What is 1+2?")]),
        index: Some(7),
        ..Sample::default()
    };
    let http = miles_session::http::HttpClient::new(Duration::from_secs(10));
    let params = miles_core::SamplingParams::default();
    for (env, leaves) in [(&default, 1), (&keep_all, 2)] {
        let config = AgentDriverConfig::new(&env.url).with_session_version(SessionVersion::V2);
        let out = generate_samples(&RetryingAgent, &input, &params, &config, &http).await;
        assert_eq!(out.len(), leaves, "{:?}", out[0].metadata.get("failure"));
        for s in &out {
            assert_eq!(s.status, SampleStatus::Completed);
            assert_eq!(s.reward, Some(miles_core::Reward::Scalar(0.5)));
            assert_eq!(s.metadata["agent_note"], json!("retried"));
            assert_eq!(s.metadata["reward"], json!(0.5));
            assert!(s.metadata["leaf"].is_object());
            assert_eq!(s.rollout_id, if leaves > 1 { Some(7) } else { None });
        }
    }
}
