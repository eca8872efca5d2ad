//! Tree sessions end to end: Miles' `test_session_v1_v2_parity.py` (`parity_*`: an agent that
//! retries turns trains the same sample on v1 and v2, bit for bit), `test_session_pretokenized_e2e.py`
//! on a v2 server (`pretokenized_e2e_*`, the real Qwen3 tokenizer), and a random branching test
//! of ours. The case table is in `tree_sessions.rs`.

use std::sync::Arc;
use std::time::Duration;

use miles_core::{Sample, TokenId};
use miles_session::codec::{SamplesWire, decode_samples_as};
use miles_session::server::{SessionServerConfig, SessionVersion};
use miles_session::tree_samples::KeepAllLeaves;
use serde_json::{Map, Value, json};

use crate::miles_contracts::{Env, router_env_with};
use crate::tree_sessions::{
    collect, hooks, records, t1, t1_diff, tree, turn, u1, v2_env, v2_env_with,
};

// ---------------------------------------------------------------------------------------------
// test_session_v1_v2_parity.py: an agent that retries turns trains the same sample on v1
// (rollback) and v2 (branch, then `drop_retries`), bit for bit.

/// The agent's script against one server: two one-step retries (a regenerated turn and a
/// divergent tool result), then a final turn. Returns the session id.
async fn retrying_script(env: &Env) -> String {
    let sid = env.create_session().await;
    let a1 = turn(env, &sid, json!([u1()])).await;
    turn(env, &sid, json!([u1(), a1, t1()])).await;
    // Retry the same turn (pure drop), then diverge (a different tool result).
    let a2 = turn(env, &sid, json!([u1(), a1, t1()])).await;
    let _ = a2;
    let a2b = turn(env, &sid, json!([u1(), a1, t1_diff()])).await;
    let t2 = json!({"role": "tool", "content": "tool-result-2", "tool_call_id": "t1"});
    turn(env, &sid, json!([u1(), a1, t1_diff(), a2b, t2])).await;
    sid
}

/// Every float compared by its bits (−0.0 ≠ 0.0), every other field by value.
fn assert_bits_equal(a: &Value, b: &Value, path: &str) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => assert_eq!(
            x.as_f64().map(f64::to_bits),
            y.as_f64().map(f64::to_bits),
            "{path}"
        ),
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{path}");
            for (i, (x, y)) in x.iter().zip(y).enumerate() {
                assert_bits_equal(x, y, &format!("{path}[{i}]"));
            }
        }
        (Value::Object(x), Value::Object(y)) => {
            // Python's dict equality: the same keys, in any order.
            let keys = |m: &Map<String, Value>| {
                let mut k: Vec<String> = m.keys().cloned().collect();
                k.sort();
                k
            };
            assert_eq!(keys(x), keys(y), "{path}");
            for (k, v) in x {
                assert_bits_equal(v, &y[k], &format!("{path}.{k}"));
            }
        }
        _ => assert_eq!(a, b, "{path}"),
    }
}

/// Miles' `_training_metadata_projection` of the sample the driver hands the trainer (v1: the
/// session metadata merged into the sample's, as `agentic_tool_call.generate` does): `leaf`
/// and `max_trim_tokens` dropped, and the run-time lifecycle stamps (each server records its
/// own clock).
fn training_metadata(sample: &Sample, session_metadata: Option<&Map<String, Value>>) -> Value {
    let mut m = sample.metadata.clone();
    if let Some(session) = session_metadata {
        m.extend(session.clone());
    }
    m.remove("leaf");
    m.remove("max_trim_tokens");
    if let Some(Value::Array(segments)) = m.get_mut("lifecycle") {
        for seg in segments {
            if let Value::Object(seg) = seg {
                seg.retain(|k, _| !["t0", "t1", "req_ts", "prev_t1"].contains(&k.as_str()));
            }
        }
    }
    Value::Object(m)
}

#[tokio::test]
async fn parity_agentic_v2_drop_retries_matches_v1_training_payload_bitwise() {
    let v1 = router_env_with(SessionServerConfig::default()).await;
    let v2 = v2_env().await;
    let (s1, s2) = (retrying_script(&v1).await, retrying_script(&v2).await);
    assert_eq!(records(&v1, &s1).await.len(), 3);
    assert_eq!(records(&v2, &s2).await.len(), 3);
    let tree = tree(&v2, &s2).await;
    let edges: Vec<(Value, Value)> = tree["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].clone(), n["parent"].clone()))
        .collect();
    assert_eq!(
        edges,
        vec![
            (json!(0), Value::Null),
            (json!(1), json!(0)),
            (json!(2), json!(0)),
            (json!(3), json!(0)),
            (json!(4), json!(3)),
        ]
    );
    let r = v1.samples(&s1, &json!({})).await;
    let p1 = miles_session::codec::decode_samples(&r.body, &Sample::default()).unwrap();
    let p2 = collect(&v2, &s2).await;
    let ([a], [b]) = (&p1.samples[..], &p2.samples[..]) else {
        panic!("{} / {} samples", p1.samples.len(), p2.samples.len())
    };
    assert_eq!(b.metadata["leaf"]["path_node_ids"], json!([0, 3, 4]));
    let mut a_wire = serde_json::to_value(a).unwrap();
    let mut b_wire = serde_json::to_value(b).unwrap();
    a_wire["metadata"] = training_metadata(a, Some(&p1.session_metadata));
    b_wire["metadata"] = training_metadata(b, None);
    assert_bits_equal(&a_wire, &b_wire, "sample");
    // The session metadata of v1 is v2's without `tree`.
    let mut linear = p2.session_metadata.clone();
    linear.remove("tree");
    assert_bits_equal(
        &Value::Object(p1.session_metadata),
        &Value::Object(linear),
        "session_metadata",
    );
}

#[test]
fn parity_bitwise_comparator_distinguishes_signed_zero() {
    let result = std::panic::catch_unwind(|| {
        assert_bits_equal(&json!({"reward": 0.0}), &json!({"reward": -0.0}), "sample")
    });
    assert!(result.is_err());
}

// ---------------------------------------------------------------------------------------------
// test_session_pretokenized_e2e.py on a v2 server: the Qwen3 tool conversation keeps HF's ids
// turn by turn, one node per turn, no mismatch.

#[tokio::test]
async fn pretokenized_e2e_qwen3_fixed_template_on_v2() {
    use crate::common::hf_replay::{HfReplayEngine, miles_reference, tokenizer_fixtures};
    use miles_session::server::SessionServer;
    let (conversation, hf_ids) = miles_reference();
    let messages = conversation["messages"].as_array().unwrap().clone();
    let tools = conversation["tools"].clone();
    let chat =
        Arc::new(miles_tito::TitoChat::load(&tokenizer_fixtures().join("qwen3"), "qwen3").unwrap());
    let engine = Arc::new(HfReplayEngine::new(
        hf_ids.clone(),
        miles_core::WeightVersion(3),
    ));
    let server = SessionServer::new(
        engine,
        chat,
        SessionServerConfig {
            session_version: SessionVersion::V2,
            ..SessionServerConfig::default()
        },
    );
    let base = crate::common::serve(server.router()).await;
    let http = miles_session::http::HttpClient::new(Duration::from_secs(30));
    let created: Value = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let session = format!(
        "{base}/sessions/{}",
        created["session_id"].as_str().unwrap()
    );
    let mut sent: Vec<Value> = messages[..2].to_vec();
    for turn_idx in 0..2 {
        let r = http
            .post_json(
                &format!("{session}/v1/chat/completions"),
                &json!({"messages": sent, "tools": tools}),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let body: Value = r.json().unwrap();
        let answer = body["choices"][0]["message"].clone();
        let s: Value = http.get(&session).await.unwrap().json().unwrap();
        assert_eq!(
            s["metadata"]["tree"]["nodes"].as_array().unwrap().len(),
            turn_idx + 1
        );
        assert_eq!(s["metadata"]["tito_session_mismatch"], json!([]));
        sent.push(answer.clone());
        if turn_idx == 0 {
            let mut tool = messages[3].clone();
            tool["tool_call_id"] = answer["tool_calls"][0]["id"].clone();
            sent.push(tool);
        }
    }
    let s: Value = http.get(&session).await.unwrap().json().unwrap();
    let records = s["records"].as_array().unwrap();
    assert_eq!(records.len(), 2);
    assert!(
        records
            .iter()
            .all(|r| r["status_code"] == json!(200) && r["path"] == json!("/v1/chat/completions"))
    );
    let accumulated: Vec<TokenId> =
        serde_json::from_value(s["metadata"]["accumulated_token_ids"].clone()).unwrap();
    assert_eq!(accumulated, hf_ids[..hf_ids.len() - 1]);
}

// ---------------------------------------------------------------------------------------------
// Random branching conversations: never a 5xx, and every completion trained exactly once.

/// SplitMix64: a fixed-seed generator (no dependency).
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[tokio::test]
async fn v2_random_branching_never_fails_and_trains_each_completion_once() {
    let env = v2_env_with(SessionServerConfig {
        sample_hooks: hooks(Arc::new(KeepAllLeaves)),
        ..SessionServerConfig::default()
    })
    .await;
    let mut rng = Mix(44);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut leaves_seen = 0;
    for _session in 0..3 {
        let sid = env.create_session().await;
        let mut histories: Vec<Vec<Value>> = vec![Vec::new()];
        for step in 0..25 {
            let base = &histories[rng.below(histories.len())];
            let mut messages: Vec<Value> = base[..rng.below(base.len() + 1)].to_vec();
            for _ in 0..1 + rng.below(2) {
                let role =
                    ["user", "tool", "system", "developer", "assistant", "user"][rng.below(6)];
                let mut m = json!({"role": role, "content": format!("m{step}-{}", rng.below(3))});
                if role == "tool" {
                    m["tool_call_id"] = json!("t0");
                }
                messages.push(m);
            }
            let mut body = json!({ "messages": messages });
            if rng.below(6) == 0 {
                body["max_tokens"] = json!(2);
            }
            let r = env.post_chat(&sid, &body).await;
            let status = r.status.as_u16();
            *statuses.entry(status).or_default() += 1;
            assert!(
                [200, 400, 409].contains(&status),
                "{status}: {} for {body}",
                r.text()
            );
            if status == 200 {
                let answer = r.json::<Value>().unwrap()["choices"][0]["message"].clone();
                messages.push(answer);
                histories.push(messages);
            }
        }
        assert_eq!(env.get(&sid).await.status, 200);
        let tree = tree(&env, &sid).await;
        let nodes = tree["nodes"].as_array().unwrap().clone();
        let r = env.samples(&sid, &json!({})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let p = decode_samples_as(&r.body, &Sample::default(), SamplesWire::V2).unwrap();
        if nodes.is_empty() {
            continue;
        }
        assert_eq!(p.samples.len(), tree["leaves"].as_array().unwrap().len());
        leaves_seen += p.samples.len();
        for node in &nodes {
            let id = node["id"].clone();
            let (start, end) = (
                node["completion_span"][0].as_u64().unwrap() as usize,
                node["completion_span"][1].as_u64().unwrap() as usize,
            );
            let owners = p
                .samples
                .iter()
                .filter(|s| {
                    s.metadata["leaf"]["path_node_ids"]
                        .as_array()
                        .unwrap()
                        .contains(&id)
                })
                .filter(|s| {
                    let rs = s.tokens.len() - s.response_length;
                    let mask = s.loss_mask.as_ref().unwrap();
                    (start.max(rs)..end.min(s.tokens.len())).any(|i| mask[i - rs] == 1)
                })
                .count();
            assert_eq!(owners, 1, "node {id} trained {owners} times");
        }
    }
    // The script exercised branching, refusals and truncation.
    assert!(
        statuses.get(&200).copied().unwrap_or(0) >= 20,
        "{statuses:?}"
    );
    assert!(statuses.keys().any(|&s| s != 200), "{statuses:?}");
    assert!(leaves_seen >= 6, "{leaves_seen} leaves");
}
