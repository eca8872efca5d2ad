//! The session server with the miles-tito adapter on the real Qwen3 tokenizer
//! (`fixtures/tokenizers/qwen3`, family `qwen3`), driven over loopback HTTP through a two-turn
//! tool-calling conversation (user → assistant tool call → tool result → assistant).
//!
//! The reference is Miles' session server's render of the conversation
//! `single_tool_string_args@miles` (`fixtures/session/miles_tool_renders.json`: the tools
//! dumped by SGLang 0.5.16's protocol models as Miles' `extract_tool_dicts` does, then HF
//! transformers 5.24.0's `apply_chat_template` with Miles' `qwen3_fixed.jinja`). The engine
//! plays a model that writes exactly that conversation's assistant turns: it checks that the
//! prompt it gets is a prefix of those ids and answers with them up to the next `<|im_end|>`.
//! The session must then have stored those ids exactly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::common::hf_replay::{
    HfReplayEngine, IM_END, hf_reference, logprob, miles_reference, tokenizer_fixtures,
};
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
    // The server renders the tools as SGLang's protocol models dump them (Miles' render).
    let (conversation, hf_ids) = miles_reference();
    let (_, hf_as_sent_ids) = hf_reference();
    assert_ne!(hf_ids, hf_as_sent_ids, "the dump changes the tools' text");
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
    // (miles-tito's renderer takes the tools JSON as given, as HF does.)
    assert_eq!(rendered, hf_as_sent_ids);
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

/// Every request of `fixtures/session/miles_tool_renders.json` (tools in the shapes clients
/// send them, `developer` messages): the prompt ids the session server and the SGLang-compatible
/// chat route hand the engine are the ids of Miles' render (tools dumped by SGLang 0.5.16's
/// protocol models, then HF's `apply_chat_template`); the tools SGLang's validation refuses are
/// a 400.
#[tokio::test]
async fn requests_with_tools_and_developer_messages_render_as_miles_does() {
    use miles_session::sglang::{ServerInfo, sglang_router};
    let names = [
        "as_sent",
        "bare_function",
        "name_only",
        "strict_and_unknown_keys",
        "defer_loading",
        "other_type",
        "developer_first",
        "system_then_developer",
        "bad_strict",
        "bad_description",
        "no_name",
    ];
    let chat = Arc::new(TitoChat::load(&fixtures().join("qwen3"), "qwen3").unwrap());
    let http = HttpClient::new(Duration::from_secs(30));
    for name in names {
        let case = crate::common::hf_replay::miles_render(name);
        let mut body = json!({"messages": case["messages"]});
        if !case["tools"].is_null() {
            body["tools"] = case["tools"].clone();
        }
        // The engine answers `<|im_end|>` to exactly Miles' prompt, and fails any other.
        let mut expected: Vec<TokenId> = match case.get("ids") {
            Some(ids) => serde_json::from_value(ids.clone()).unwrap(),
            None => Vec::new(),
        };
        let prompt_len = expected.len();
        expected.push(IM_END);

        let engine = Arc::new(HfReplayEngine::new(expected.clone(), WeightVersion(1)));
        let server =
            SessionServer::new(engine.clone(), chat.clone(), SessionServerConfig::default());
        let base = serve(server.router()).await;
        let created: Value = http
            .post_json(&format!("{base}/sessions"), &json!({}), &[])
            .await
            .unwrap()
            .json()
            .unwrap();
        let url = format!(
            "{base}/sessions/{}/v1/chat/completions",
            created["session_id"].as_str().unwrap()
        );
        let r = http.post_json(&url, &body, &[]).await.unwrap();

        let sglang_engine = Arc::new(HfReplayEngine::new(expected.clone(), WeightVersion(1)));
        let info = ServerInfo::new("qwen3").with_tokenizer(chat.clone(), "qwen3");
        let sglang_base = serve(sglang_router(sglang_engine.clone(), info)).await;
        let s = http
            .post_json(&format!("{sglang_base}/v1/chat/completions"), &body, &[])
            .await
            .unwrap();

        if case.get("error").is_some() {
            assert_eq!(r.status, 400, "{name}: {}", r.text());
            assert_eq!(s.status, 400, "{name}: {}", s.text());
            assert!(engine.seen.lock().unwrap().is_empty(), "{name}");
            continue;
        }
        assert_eq!(r.status, 200, "{name}: {}", r.text());
        assert_eq!(s.status, 200, "{name}: {}", s.text());
        for (server, seen) in [("session", &engine.seen), ("sglang", &sglang_engine.seen)] {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 1, "{name} ({server})");
            assert_eq!(seen[0].0, expected[..prompt_len], "{name} ({server})");
        }
        assert_eq!(
            chat.decode(&expected[..prompt_len]),
            case["text"].as_str().unwrap(),
            "{name}"
        );
    }
}
