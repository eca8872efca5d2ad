//! The session server with the miles-tito adapter on the real Qwen3 tokenizer
//! (`fixtures/tokenizers/qwen3`, family `qwen3`), driven over loopback HTTP through a two-turn
//! tool-calling conversation (user → assistant tool call → tool result → assistant).
//!
//! The reference is HF transformers: `fixtures/tokenizers/hf_renders.json` holds
//! `apply_chat_template(conversation, tools, tokenize=True)` of the conversation
//! `single_tool_string_args@miles` with Miles' `qwen3_fixed.jinja` (transformers 5.24.0). The
//! engine plays a model that writes exactly that conversation's assistant turns: it checks that
//! the prompt it gets is a prefix of HF's ids and answers with HF's ids up to the next
//! `<|im_end|>`. The session must then have stored HF's ids exactly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::common::hf_replay::{HfReplayEngine, IM_END, hf_reference, logprob, tokenizer_fixtures};
use crate::common::serve;
use miles_core::{Message, Sample, SampleStatus, TokenId, WeightVersion};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_tito::ChatTokenizer;
use miles_tito::TitoChat;
use serde_json::{Value, json};

/// Qwen3's `"\n"` (tokenizer.json).
const NEWLINE: TokenId = 198;

fn fixtures() -> PathBuf {
    tokenizer_fixtures()
}

#[tokio::test]
async fn qwen3_tool_conversation_stores_hf_exact_ids() {
    let (conversation, hf_ids) = hf_reference();
    let messages = conversation["messages"].as_array().unwrap().clone();
    let tools = conversation["tools"].clone();
    assert_eq!(hf_ids.last(), Some(&NEWLINE), "HF ends the render with \\n");

    let chat = Arc::new(TitoChat::load(&fixtures().join("qwen3"), "qwen3").unwrap());
    let engine = Arc::new(HfReplayEngine::new(hf_ids.clone(), WeightVersion(3)));
    let server = SessionServer::new(engine.clone(), chat.clone(), SessionServerConfig::default());
    let base = serve(server.router()).await;
    let http = HttpClient::new(Duration::from_secs(30));
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
    let completions = format!("{session}/v1/chat/completions");

    // Turn 1: system + user → the assistant calls get_weather.
    let mut sent: Vec<Value> = messages[..2].to_vec();
    let r1 = http
        .post_json(
            &completions,
            &json!({"messages": sent, "tools": tools}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r1.status, 200, "{}", r1.text());
    let v1: Value = r1.json().unwrap();
    let choice = &v1["choices"][0];
    assert_eq!(choice["finish_reason"], json!("tool_calls"));
    assert_eq!(choice["message"]["content"], json!(""));
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], json!("get_weather"));
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    // The reference conversation's call: {"city": "Paris", "days": 2}.
    assert_eq!(arguments, json!({"city": "Paris", "days": 2}));
    assert_eq!(choice["message"]["tool_calls"].as_array().unwrap().len(), 1);

    // Turn 2: the agent echoes the assistant message and appends the tool result.
    sent.push(choice["message"].clone());
    let mut tool = messages[3].clone();
    tool["tool_call_id"] = call["id"].clone();
    sent.push(tool);
    let r2 = http
        .post_json(
            &completions,
            &json!({"messages": sent, "tools": tools}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r2.status, 200, "{}", r2.text());
    let v2: Value = r2.json().unwrap();
    assert_eq!(v2["choices"][0]["finish_reason"], json!("stop"));
    assert_eq!(
        v2["choices"][0]["message"]["content"],
        messages[4]["content"]
    );
    assert!(v2["choices"][0]["message"]["tool_calls"].is_null());
    sent.push(v2["choices"][0]["message"].clone());

    // The stored ids are HF's ids of the whole conversation (the model stopped at
    // <|im_end|>, before the template's final "\n").
    let s: Value = http.get(&session).await.unwrap().json().unwrap();
    let accumulated: Vec<TokenId> =
        serde_json::from_value(s["metadata"]["accumulated_token_ids"].clone()).unwrap();
    assert_eq!(accumulated, hf_ids[..hf_ids.len() - 1]);
    assert_eq!(s["metadata"]["tito_session_mismatch"], json!([]));
    assert_eq!(s["metadata"]["max_trim_tokens"], json!(0));

    // miles-tito's renderer of the conversation as the agent holds it agrees with HF too.
    let held: Vec<Message> = serde_json::from_value(Value::Array(sent)).unwrap();
    let tool_values = tools.as_array().unwrap().clone();
    let rendered = chat
        .tito()
        .apply_chat_template(&held, Some(&tool_values), false)
        .unwrap();
    assert_eq!(rendered, hf_ids);
    let specs: Vec<miles_core::ToolSpec> = serde_json::from_value(tools.clone()).unwrap();
    let mut forced = serde_json::Map::new();
    forced.insert("clear_thinking".into(), json!(false));
    assert_eq!(chat.render(&held, &specs, false, &forced).unwrap(), hf_ids);

    // The engine saw prompt 2 = prompt 1 ⊕ output 1 ⊕ "\n" ⊕ tool block (TITO).
    let seen = engine.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let (prompt1, out1) = &seen[0];
    let (prompt2, out2) = &seen[1];
    assert_eq!(out1.last(), Some(&IM_END));
    assert_eq!(&prompt2[..prompt1.len()], &prompt1[..]);
    assert_eq!(
        &prompt2[prompt1.len()..prompt1.len() + out1.len()],
        &out1[..]
    );
    let observation = &prompt2[prompt1.len() + out1.len()..];
    assert_eq!(
        chat.decode(observation),
        "\n<|im_start|>user\n<tool_response>\n{\"temp\": 21.5}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );

    // One merged sample: loss mask 1 on model tokens, 0 on the tool tokens.
    let r = http
        .post_json(
            &format!("{session}/samples"),
            &json!({}),
            &[("accept", "application/json")],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let payload: Value = r.json().unwrap();
    let samples = payload["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 1);
    let sample: Sample = serde_json::from_value(samples[0].clone()).unwrap();
    assert_eq!(sample.status, SampleStatus::Completed);
    assert_eq!(sample.tokens, accumulated);
    assert_eq!(
        sample.response_length,
        out1.len() + observation.len() + out2.len()
    );
    assert_eq!(sample.tokens.len() - sample.response_length, prompt1.len());
    let mut mask = vec![1u8; out1.len()];
    mask.extend(vec![0u8; observation.len()]);
    mask.extend(vec![1u8; out2.len()]);
    assert_eq!(sample.loss_mask, Some(mask));
    let mut log_probs: Vec<f64> = (0..out1.len()).map(logprob).collect();
    log_probs.extend(vec![0.0; observation.len()]);
    log_probs.extend((0..out2.len()).map(logprob));
    assert_eq!(sample.rollout_log_probs, Some(log_probs));
}
