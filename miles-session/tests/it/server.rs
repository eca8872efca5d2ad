//! The session server on loopback, driven over real HTTP, with the byte-level ChatML tokenizer
//! and the deterministic token-id engine of `common`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::{ByteChatml, IM_END, ToyEngine, serve, toy_expert, toy_logprob, weather_tool};
use hyper::Method;
use miles_core::{Role, Sample, SampleStatus, TokenId};
use miles_session::codec::decode_samples;
use miles_session::http::{HttpClient, HttpResponse};
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_tito::ChatTokenizer;
use serde_json::{Value, json};

struct Harness {
    base: String,
    http: HttpClient,
    engine: Arc<ToyEngine>,
    server: SessionServer,
    tok: ByteChatml,
}

async fn harness_with(config: SessionServerConfig, tok: ByteChatml) -> Harness {
    let engine = ToyEngine::new();
    let server = SessionServer::new(engine.clone(), Arc::new(tok.clone()), config);
    let base = serve(server.router()).await;
    Harness {
        base,
        http: HttpClient::new(Duration::from_secs(30)),
        engine,
        server,
        tok,
    }
}

async fn harness() -> Harness {
    harness_with(SessionServerConfig::default(), ByteChatml::default()).await
}

impl Harness {
    async fn create(&self) -> String {
        let r = self
            .http
            .post_json(&format!("{}/sessions", self.base), &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        let id = r.json::<Value>().unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(id.len(), 32);
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
        id
    }

    async fn chat(&self, id: &str, body: &Value) -> HttpResponse {
        self.http
            .post_json(
                &format!("{}/sessions/{id}/v1/chat/completions", self.base),
                body,
                &[],
            )
            .await
            .unwrap()
    }

    async fn raw_chat(&self, id: &str, bytes: &[u8]) -> HttpResponse {
        self.http
            .send(
                Method::POST,
                &format!("{}/sessions/{id}/v1/chat/completions", self.base),
                &[],
                Some(("application/json", bytes.to_vec())),
            )
            .await
            .unwrap()
    }

    async fn session(&self, id: &str) -> HttpResponse {
        self.http
            .get(&format!("{}/sessions/{id}", self.base))
            .await
            .unwrap()
    }

    async fn delete(&self, id: &str) -> HttpResponse {
        self.http
            .send(
                Method::DELETE,
                &format!("{}/sessions/{id}", self.base),
                &[],
                None,
            )
            .await
            .unwrap()
    }

    async fn samples_json(&self, id: &str, body: &Value) -> HttpResponse {
        self.http
            .post_json(
                &format!("{}/sessions/{id}/samples", self.base),
                body,
                &[("accept", "application/json")],
            )
            .await
            .unwrap()
    }
}

fn error_code(r: &HttpResponse) -> String {
    let v: Value = r.json().unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    v["error"]["code"].as_str().unwrap().to_owned()
}

fn turn1_messages() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are helpful."}),
        json!({"role": "user", "content": "What is the weather in Paris?"}),
    ]
}

const OUT1: &str = "<think>\nI should call the weather tool.\n</think>\n\n<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call><|im_end|>";
const OUT2: &str = "<think>\nThe tool answered.\n</think>\n\nThe weather is sunny.<|im_end|>";
const TOOL_BLOCK: &str =
    "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n";

fn prompt1_text() -> String {
    format!(
        "<|im_start|>system\nYou are helpful.\n\n# Tools\n<tools>\n{}\n</tools><|im_end|>\n<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n",
        serde_json::to_string(&weather_tool()).unwrap()
    )
}

/// Runs the two-turn tool conversation; returns (session id, turn-2 request body).
async fn two_turns(h: &Harness) -> (String, Value) {
    let id = h.create().await;
    let body1 = json!({"model": "toy", "messages": turn1_messages(), "tools": [weather_tool()], "temperature": 0.7});
    let r1 = h.chat(&id, &body1).await;
    assert_eq!(r1.status, 200, "{}", r1.text());
    let v1: Value = r1.json().unwrap();
    let msg = v1["choices"][0]["message"].clone();
    let mut messages = turn1_messages();
    messages.push(msg);
    let call_id = v1["choices"][0]["message"]["tool_calls"][0]["id"].clone();
    messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": "sunny"}));
    let body2 = json!({"model": "toy", "messages": messages, "tools": [weather_tool()]});
    let r2 = h.chat(&id, &body2).await;
    assert_eq!(r2.status, 200, "{}", r2.text());
    (id, body2)
}

#[tokio::test]
async fn tool_calling_conversation_records_exact_tokens() {
    let h = harness().await;
    let id = h.create().await;
    let body1 = json!({"model": "toy", "messages": turn1_messages(), "tools": [weather_tool()], "temperature": 0.7, "max_tokens": 500});
    let r1 = h.chat(&id, &body1).await;
    assert_eq!(r1.status, 200, "{}", r1.text());
    let v1: Value = r1.json().unwrap();
    let choice = &v1["choices"][0];
    assert_eq!(v1["object"], json!("chat.completion"));
    assert_eq!(v1["model"], json!("toy"));
    assert_eq!(choice["finish_reason"], json!("tool_calls"));
    assert_eq!(choice["message"]["content"], json!(""));
    assert_eq!(
        choice["message"]["reasoning_content"],
        json!("I should call the weather tool.")
    );
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], json!("function"));
    assert_eq!(call["index"], json!(0));
    assert_eq!(call["function"]["name"], json!("get_weather"));
    assert_eq!(call["function"]["arguments"], json!("{\"city\":\"Paris\"}"));
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    // The engine saw exactly the rendered prompt, the family's stop id, the routing key.
    let seen = h.engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(h.tok.decode(&seen.input_ids), prompt1_text());
    assert_eq!(seen.input_ids, h.tok.encode(&prompt1_text()));
    assert_eq!(seen.sampling_params.temperature, 0.7);
    assert_eq!(seen.sampling_params.max_new_tokens, Some(500));
    assert_eq!(seen.sampling_params.stop_token_ids, vec![IM_END]);
    assert_eq!(seen.routing_key.as_deref(), Some(id.as_str()));
    let meta = &choice["meta_info"];
    let out1 = h.tok.encode(OUT1);
    assert_eq!(meta["completion_tokens"], json!(out1.len()));
    assert_eq!(meta["weight_version"], json!("7"));
    assert_eq!(
        meta["output_token_logprobs"][0],
        json!([toy_logprob(out1[0], 0), out1[0], null])
    );
    assert_eq!(v1["usage"]["prompt_tokens"], json!(seen.input_ids.len()));
    let first = &choice["logprobs"]["content"][0];
    assert_eq!(first["token"], json!("<think>"));
    assert_eq!(first["logprob"], json!(toy_logprob(out1[0], 0)));
    assert_eq!(
        choice["logprobs"]["content"].as_array().unwrap().len(),
        out1.len()
    );

    // Turn 2: the agent echoes the assistant message and appends the tool result.
    let mut messages = turn1_messages();
    messages.push(choice["message"].clone());
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny"}));
    let r2 = h
        .chat(
            &id,
            &json!({"messages": messages, "tools": [weather_tool()]}),
        )
        .await;
    assert_eq!(r2.status, 200, "{}", r2.text());
    let v2: Value = r2.json().unwrap();
    assert_eq!(v2["choices"][0]["finish_reason"], json!("stop"));
    assert_eq!(
        v2["choices"][0]["message"]["content"],
        json!("The weather is sunny.")
    );
    assert_eq!(v2["model"], json!("miles"));

    // Turn-2 prompt = turn-1 prompt ⊕ turn-1 output ⊕ "\n" ⊕ tool block + generation prompt.
    let seen2 = h.engine.last_request.lock().unwrap().clone().unwrap();
    let expected_prompt2 = format!("{}{OUT1}\n{TOOL_BLOCK}", prompt1_text());
    assert_eq!(h.tok.decode(&seen2.input_ids), expected_prompt2);
    let mut expected_ids2 = seen.input_ids.clone();
    expected_ids2.extend(&out1);
    expected_ids2.push(10);
    expected_ids2.extend(h.tok.encode(TOOL_BLOCK));
    assert_eq!(
        seen2.input_ids, expected_ids2,
        "prefix ids reused exactly (TITO)"
    );

    let s: Value = h.session(&id).await.json().unwrap();
    assert_eq!(s["session_id"], json!(id));
    let records = s["records"].as_array().unwrap();
    assert_eq!(records.len(), 2);
    assert_eq!(records[1]["request"]["input_ids"], json!(expected_ids2));
    assert_eq!(records[0]["request"]["logprobs"], json!(true));
    assert_eq!(records[0]["request"]["return_meta_info"], json!(true));
    assert_eq!(
        records[0]["request"]["chat_template_kwargs"],
        json!({"clear_thinking": false})
    );
    assert_eq!(records[0]["path"], json!("/v1/chat/completions"));
    assert_eq!(records[0]["status_code"], json!(200));
    assert!(
        records[0]["response"]["choices"][0]
            .get("logprobs")
            .is_none(),
        "records keep output_token_logprobs only"
    );
    let acc: Vec<TokenId> =
        serde_json::from_value(s["metadata"]["accumulated_token_ids"].clone()).unwrap();
    assert_eq!(h.tok.decode(&acc), format!("{expected_prompt2}{OUT2}"));
    assert_eq!(s["metadata"]["max_trim_tokens"], json!(0));
    assert_eq!(
        s["metadata"]["tito_session_mismatch"],
        json!([]),
        "canonical render equals the session ids"
    );

    // Samples (JSON): one merged sample, observation tokens masked.
    let r = h.samples_json(&id, &json!({"max_seq_len": null})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let payload: Value = r.json().unwrap();
    assert_eq!(payload["empty_reason"], Value::Null);
    let sample: Sample = serde_json::from_value(payload["samples"][0].clone()).unwrap();
    let out2 = h.tok.encode(OUT2);
    let obs = 1 + h.tok.encode(TOOL_BLOCK).len();
    assert_eq!(sample.tokens, acc);
    assert_eq!(sample.response_length, out1.len() + obs + out2.len());
    let mut mask = vec![1u8; out1.len()];
    mask.extend(vec![0u8; obs]);
    mask.extend(vec![1u8; out2.len()]);
    assert_eq!(sample.loss_mask, Some(mask));
    let mut lps: Vec<f64> = out1
        .iter()
        .enumerate()
        .map(|(p, id)| toy_logprob(*id, p))
        .collect();
    lps.extend(vec![0.0; obs]);
    lps.extend(out2.iter().enumerate().map(|(p, id)| toy_logprob(*id, p)));
    assert_eq!(sample.rollout_log_probs, Some(lps));
    assert_eq!(sample.status, SampleStatus::Completed);
    assert_eq!(sample.weight_versions, vec!["7", "7"]);
    // The text as SGLang decodes it: the turn markers (special tokens) skipped; the tokens
    // keep them.
    assert_eq!(
        sample.response,
        format!("{OUT1}\n{TOOL_BLOCK}{OUT2}")
            .replace("<|im_end|>", "")
            .replace("<|im_start|>", "")
    );
    assert_eq!(
        sample.prefix_cache_info.total_prompt_tokens as usize,
        seen.input_ids.len() + seen2.input_ids.len()
    );

    // Samples (safetensors): the same sample through Miles' codec.
    let r = h
        .http
        .post_json(
            &format!("{}/sessions/{id}/samples", h.base),
            &json!({}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], "application/octet-stream");
    let decoded = decode_samples(&r.body, &Sample::default()).unwrap();
    assert_eq!(decoded.samples, vec![sample]);
    assert_eq!(
        decoded.session_metadata["accumulated_token_ids"],
        json!(acc)
    );

    // Truncation to max_seq_len cuts the merged response; all-truncated is an empty result.
    let cut = acc.len() - 3;
    let payload: Value = h
        .samples_json(&id, &json!({"max_seq_len": cut}))
        .await
        .json()
        .unwrap();
    let truncated: Sample = serde_json::from_value(payload["samples"][0].clone()).unwrap();
    assert_eq!(truncated.tokens, acc[..cut].to_vec());
    assert_eq!(truncated.status, SampleStatus::Truncated);
    let payload: Value = h
        .samples_json(&id, &json!({"max_seq_len": 5}))
        .await
        .json()
        .unwrap();
    assert_eq!(payload["empty_reason"], json!("all_truncated"));
    assert_eq!(payload["samples"], json!([]));

    // Per turn (`generate_multi_samples`): one sample per request, unmerged, each training
    // on exactly its own output; the conversation's messages on the last one.
    let payload: Value = h
        .samples_json(&id, &json!({"generate_multi_samples": true}))
        .await
        .json()
        .unwrap();
    let turns: Vec<Sample> = serde_json::from_value(payload["samples"].clone()).unwrap();
    assert_eq!(turns.len(), 2);
    for (turn, (seen, out)) in turns.iter().zip([(&seen, &out1), (&seen2, &out2)]) {
        let mut tokens = seen.input_ids.clone();
        tokens.extend(out.iter());
        assert_eq!(turn.tokens, tokens);
        assert_eq!(turn.response_length, out.len());
        assert_eq!(turn.loss_mask, Some(vec![1u8; out.len()]));
        let lps: Vec<f64> = out
            .iter()
            .enumerate()
            .map(|(p, id)| toy_logprob(*id, p))
            .collect();
        assert_eq!(turn.rollout_log_probs, Some(lps));
        assert_eq!(turn.weight_versions, vec!["7"]);
        assert_eq!(turn.status, SampleStatus::Completed);
    }
    assert_eq!(turns[1].tokens, acc);
    // The messages only with `save_debug_trajectory_data` (Miles' flag); a lifecycle segment
    // per turn, the second knowing when the first ended.
    assert!(!turns[0].metadata.contains_key("messages"));
    assert!(!turns[1].metadata.contains_key("messages"));
    assert_eq!(turns[1].metadata["lifecycle"]["turn"], json!(2));
    assert_eq!(
        turns[1].metadata["lifecycle"]["prev_t1"],
        turns[0].metadata["lifecycle"]["t1"]
    );
    // Through Miles' codec too.
    let r = h
        .http
        .post_json(
            &format!("{}/sessions/{id}/samples", h.base),
            &json!({"generate_multi_samples": true}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(
        decode_samples(&r.body, &Sample::default()).unwrap().samples,
        turns
    );

    assert_eq!(h.delete(&id).await.status, 204);
    assert_eq!(h.delete(&id).await.status, 404);
    assert_eq!(h.server.sessions_open(), 0);
}

#[tokio::test]
async fn retry_rolls_back_one_turn_and_rejects_deeper_rollbacks() {
    let h = harness().await;
    let (id, body2) = two_turns(&h).await;
    let before: Value = h.session(&id).await.json().unwrap();
    // Retrying turn 2 (same request) discards the last turn and records the new one.
    let r = h.chat(&id, &body2).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let after: Value = h.session(&id).await.json().unwrap();
    assert_eq!(after["records"].as_array().unwrap().len(), 2);
    assert_eq!(after["records"][0], before["records"][0]);
    assert_eq!(
        after["records"][1]["request"]["input_ids"],
        before["records"][1]["request"]["input_ids"]
    );
    assert_eq!(
        after["metadata"]["accumulated_token_ids"],
        before["metadata"]["accumulated_token_ids"]
    );

    // Going back to turn 1 would discard two turns: 400, nothing changes.
    let body1 = json!({"messages": turn1_messages(), "tools": [weather_tool()]});
    let r = h.chat(&id, &body1).await;
    assert_eq!(r.status, 400);
    assert_eq!(error_code(&r), "message_validation");
    assert!(
        r.text().contains("rollback failed: discard_count=2"),
        "{}",
        r.text()
    );
    let unchanged: Value = h.session(&id).await.json().unwrap();
    assert_eq!(unchanged["records"], after["records"]);

    // A fresh session retried at turn 1 rolls back to empty and re-renders from scratch.
    let id2 = h.create().await;
    assert_eq!(h.chat(&id2, &body1).await.status, 200);
    let mut other = turn1_messages();
    other[1] = json!({"role": "user", "content": "Say hi"});
    let r = h.chat(&id2, &json!({"messages": other})).await;
    assert_eq!(r.status, 200);
    let s: Value = h.session(&id2).await.json().unwrap();
    assert_eq!(s["records"].as_array().unwrap().len(), 1);
    let acc: Vec<TokenId> =
        serde_json::from_value(s["metadata"]["accumulated_token_ids"].clone()).unwrap();
    assert_eq!(
        h.tok.decode(&acc),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n<think>\nEchoing.\n</think>\n\nYou said: Say hi<|im_end|>"
    );
}

#[tokio::test]
async fn bad_input_gets_typed_errors_and_changes_nothing() {
    let config = SessionServerConfig {
        max_body_bytes: 4096,
        ..SessionServerConfig::default()
    };
    let tok = ByteChatml {
        allowed: vec![Role::Tool, Role::User],
    };
    let h = harness_with(config, tok).await;
    let (id, body2) = two_turns(&h).await;
    let snapshot: Value = h.session(&id).await.json().unwrap();

    let r = h.raw_chat(&id, b"{not json").await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "invalid_body")
    );
    let r = h.chat(&id, &json!({"messages": "hello"})).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "invalid_body")
    );
    let r = h
        .chat(
            &id,
            &json!({"messages": [{"role": "robot", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    let r = h.chat(&id, &json!([1, 2])).await;
    assert_eq!(r.status, 400);
    let r = h.chat(&id, &json!({"messages": []})).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "message_validation")
    );
    let r = h
        .chat(
            &id,
            &json!({"messages": turn1_messages(), "temperature": "hot"}),
        )
        .await;
    assert_eq!(r.status, 400);
    let r = h
        .chat(
            &id,
            &json!({"messages": turn1_messages(), "chat_template_kwargs": 5}),
        )
        .await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "invalid_body")
    );
    let mut b = body2.clone();
    b["chat_template_kwargs"] = json!({"clear_thinking": true});
    let r = h.chat(&id, &b).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "kwarg_conflict")
    );
    // A system message appended mid-session is a role this family cannot append.
    let mut b = body2.clone();
    let mut msgs = b["messages"].as_array().unwrap().clone();
    msgs.push(json!({"role": "assistant", "content": "The weather is sunny.", "reasoning_content": "The tool answered."}));
    msgs.push(json!({"role": "system", "content": "Be brief."}));
    b["messages"] = json!(msgs);
    let r = h.chat(&id, &b).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (400, "message_validation")
    );
    assert!(r.text().contains("has role=system"), "{}", r.text());
    // Oversized body.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]});
    let r = h.chat(&id, &big).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (413, "body_too_large")
    );
    // Engine failure and malformed engine output.
    let mut b = body2.clone();
    let mut msgs = b["messages"].as_array().unwrap().clone();
    msgs.push(json!({"role": "assistant", "content": "The weather is sunny.", "reasoning_content": "The tool answered."}));
    msgs.push(json!({"role": "user", "content": "FAIL now"}));
    b["messages"] = json!(msgs.clone());
    let r = h.chat(&id, &b).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (502, "engine_error")
    );
    msgs.last_mut().unwrap()["content"] = json!("GARBAGE please");
    b["messages"] = json!(msgs);
    let r = h.chat(&id, &b).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (502, "upstream_response")
    );
    // Unknown session, unknown route.
    let r = h.chat("0123", &body2).await;
    assert_eq!(
        (r.status.as_u16(), error_code(&r).as_str()),
        (404, "session_not_found")
    );
    assert_eq!(h.session("nope").await.status, 404);
    assert_eq!(
        h.http
            .get(&format!("{}/nowhere", h.base))
            .await
            .unwrap()
            .status,
        404
    );

    let after: Value = h.session(&id).await.json().unwrap();
    assert_eq!(after["records"], snapshot["records"]);
    assert_eq!(after["metadata"], snapshot["metadata"]);

    let metrics = h
        .http
        .get(&format!("{}/metrics", h.base))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("miles_session_errors_total{label=\"invalid_body\"} 6\n"),
        "{metrics}"
    );
    assert!(metrics.contains("miles_session_errors_total{label=\"kwarg_conflict\"} 1\n"));
    assert!(metrics.contains("miles_session_errors_total{label=\"session_not_found\"} 2\n"));
    assert!(metrics.contains("miles_session_turns_total 2\n"));
    assert!(metrics.contains("miles_session_sessions_open 1\n"));
    assert!(metrics.contains("# TYPE miles_session_turn_latency_seconds histogram"));
}

#[tokio::test]
async fn stream_is_one_chunk_then_done() {
    let h = harness().await;
    let id = h.create().await;
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "stream": true, "stream_options": {"include_usage": true}});
    let r = h.chat(&id, &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["content-type"],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(r.headers["cache-control"], "no-cache");
    assert_eq!(r.headers["x-accel-buffering"], "no");
    let text = r.text();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{text}");
    assert_eq!(events[1], "data: [DONE]");
    let chunk: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(chunk["object"], json!("chat.completion.chunk"));
    let choice = &chunk["choices"][0];
    assert_eq!(choice["delta"]["role"], json!("assistant"));
    assert_eq!(choice["delta"]["content"], json!("You said: hello"));
    assert_eq!(choice["delta"]["reasoning_content"], json!("Echoing."));
    assert_eq!(choice["finish_reason"], json!("stop"));
    assert!(choice.get("meta_info").is_none());
    let s: Value = h.session(&id).await.json().unwrap();
    assert_eq!(s["records"].as_array().unwrap().len(), 1);
    assert!(s["records"][0]["request"].get("stream").is_none());
    assert!(s["records"][0]["request"].get("stream_options").is_none());
}

#[tokio::test]
async fn routed_experts_are_recorded_not_returned() {
    let config = SessionServerConfig {
        return_routed_experts: true,
        ..SessionServerConfig::default()
    };
    let h = harness_with(config, ByteChatml::default()).await;
    let (id, _) = two_turns(&h).await;
    let seen = h.engine.last_request.lock().unwrap().clone().unwrap();
    assert!(seen.return_routed_experts);
    let s: Value = h.session(&id).await.json().unwrap();
    assert!(s["records"][1]["response"]["choices"][0]["meta_info"]["routed_experts"].is_string());
    let payload: Value = h.samples_json(&id, &json!({})).await.json().unwrap();
    let sample: Sample = serde_json::from_value(payload["samples"][0].clone()).unwrap();
    let table = sample.rollout_routed_experts.expect("routed experts kept");
    assert_eq!(table.shape(), [sample.tokens.len() - 1, 2, 2]);
    for row in [0, 17, sample.tokens.len() - 2] {
        assert_eq!(
            table.get(row, 1).unwrap(),
            &[toy_expert(row, 1, 0), toy_expert(row, 1, 1)]
        );
    }
    // The client response has no routed experts.
    let r = h
        .chat(
            &h.create().await,
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let v: Value = r.json().unwrap();
    assert!(v["choices"][0]["meta_info"].get("routed_experts").is_none());
    assert!(v["choices"][0]["meta_info"]["output_token_logprobs"].is_array());
}

#[tokio::test]
async fn length_finish_is_truncated_and_max_context_is_enforced() {
    let config = SessionServerConfig {
        max_context_len: Some(60),
        ..SessionServerConfig::default()
    };
    let h = harness_with(config, ByteChatml::default()).await;
    let id = h.create().await;
    let r = h
        .chat(
            &id,
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        )
        .await;
    let v: Value = r.json().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], json!("length"));
    assert_eq!(v["usage"]["completion_tokens"], json!(4));
    let payload: Value = h.samples_json(&id, &json!({})).await.json().unwrap();
    assert_eq!(payload["samples"][0]["status"], json!("truncated"));
    // Prompt alone beyond the context: 400 before reaching the engine.
    let calls = h.engine.calls.load(Ordering::SeqCst);
    let id2 = h.create().await;
    let r = h
        .chat(
            &id2,
            &json!({"messages": [{"role": "user", "content": "y".repeat(80)}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(h.engine.calls.load(Ordering::SeqCst), calls);
    // The context cap bounds max_new_tokens.
    let id3 = h.create().await;
    h.chat(
        &id3,
        &json!({"messages": [{"role": "user", "content": "abc"}]}),
    )
    .await;
    let seen = h.engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(
        seen.sampling_params.max_new_tokens,
        Some(60 - seen.input_ids.len())
    );
    // An empty session assembles to no sample.
    let id4 = h.create().await;
    let payload: Value = h.samples_json(&id4, &json!({})).await.json().unwrap();
    assert_eq!(payload["empty_reason"], json!("no_records"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_and_deletes_lose_nothing_and_leak_nothing() {
    let h = Arc::new(harness().await);
    *h.engine.delay.lock().unwrap() = Some(Duration::from_millis(20));
    // Overlapping identical first turns on one session: one turn at a time is accepted, the
    // overlapping ones are refused with 409; every 200 was committed, exactly one record left.
    let id = h.create().await;
    let body = json!({"messages": [{"role": "user", "content": "race"}]});
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (h, id, body) = (h.clone(), id.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            h.chat(&id, &body).await.status.as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    assert!(
        statuses.iter().all(|s| *s == 200 || *s == 409),
        "{statuses:?}"
    );
    let answered = statuses.iter().filter(|s| **s == 200).count() as u64;
    assert!((1..8).contains(&answered), "{statuses:?}");
    let s: Value = h.session(&id).await.json().unwrap();
    assert_eq!(s["records"].as_array().unwrap().len(), 1);
    let m = h.server.metrics();
    assert_eq!(m.turns.load(Ordering::SeqCst), answered);
    assert_eq!(m.turns_skipped.load(Ordering::SeqCst), 0);

    // Many sessions, each with turns in flight while it is deleted.
    let mut tasks = Vec::new();
    for i in 0..32 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            let id = h.create().await;
            let body = json!({"messages": [{"role": "user", "content": format!("hello {i}")}]});
            let turn = {
                let (h, id, body) = (h.clone(), id.clone(), body.clone());
                tokio::spawn(async move { h.chat(&id, &body).await.status.as_u16() })
            };
            tokio::time::sleep(Duration::from_millis(5)).await;
            let deleted = h.delete(&id).await.status.as_u16();
            let turn_status = turn.await.unwrap();
            (deleted, turn_status, h.session(&id).await.status.as_u16())
        }));
    }
    for t in tasks {
        let (deleted, turn, after) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("no deadlock")
            .unwrap();
        assert_eq!(deleted, 204);
        assert!(turn == 200 || turn == 404, "turn status {turn}");
        assert_eq!(after, 404);
    }
    assert_eq!(h.delete(&id).await.status, 204);
    assert_eq!(h.server.sessions_open(), 0);
    let metrics = h
        .http
        .get(&format!("{}/metrics", h.base))
        .await
        .unwrap()
        .text();
    assert!(metrics.contains("miles_session_sessions_open 0\n"));
    assert!(metrics.contains("miles_session_sessions_deleted_total 33\n"));
}

#[tokio::test]
async fn health_reports_ok() {
    let config = SessionServerConfig {
        instance_id: Some("inst-1".into()),
        ..SessionServerConfig::default()
    };
    let h = harness_with(config, ByteChatml::default()).await;
    let v: Value = h
        .http
        .get(&format!("{}/health", h.base))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        v,
        json!({"status": "ok", "session_server_instance_id": "inst-1"})
    );
}
