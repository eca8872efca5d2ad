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

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, Message,
    NamedTensors, PauseMode, RequestId, Sample, SampleStatus, TokenId, WeightVersion,
};
use miles_session::chat::ChatTokenizer;
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_session::tito_adapter::TitoChat;
use serde_json::{Value, json};

/// Qwen3 vocabulary ids (tokenizer.json): `<|im_end|>` and `"\n"`.
const IM_END: TokenId = 151645;
const NEWLINE: TokenId = 198;
const CONVERSATION: &str = "single_tool_string_args@miles";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers")
}

/// (conversation JSON, HF ids of the full conversation without a generation prompt).
fn hf_reference() -> (Value, Vec<TokenId>) {
    let text = std::fs::read_to_string(fixtures().join("hf_renders.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    let conversation = all["conversations"][CONVERSATION].clone();
    let template = all["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "qwen3_fixed")
        .unwrap();
    let case = template["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["conversation"] == CONVERSATION && c["add_generation_prompt"] == false)
        .unwrap();
    (
        conversation,
        serde_json::from_value(case["ids"].clone()).unwrap(),
    )
}

/// Serves `router` on 127.0.0.1 (ephemeral port); returns the base URL.
async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    format!("http://{addr}")
}

fn logprob(position: usize) -> f64 {
    -0.125 * (position as f64 + 1.0)
}

/// An engine whose "model" writes HF's rendering of the reference conversation.
struct HfReplayEngine {
    hf_ids: Vec<TokenId>,
    seen: Mutex<Vec<(Vec<TokenId>, Vec<TokenId>)>>,
}

#[async_trait]
impl InferenceEngine for HfReplayEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        let prompt = &request.input_ids;
        if !self.hf_ids.starts_with(prompt) {
            return Err(miles_core::Error::engine(
                EngineErrorKind::InvalidRequest,
                "prompt is not a prefix of HF's rendering",
            ));
        }
        let rest = &self.hf_ids[prompt.len()..];
        let end = rest.iter().position(|&id| id == IM_END).ok_or_else(|| {
            miles_core::Error::engine(EngineErrorKind::InvalidRequest, "nothing left to say")
        })?;
        let output = rest[..=end].to_vec();
        self.seen
            .lock()
            .unwrap()
            .push((prompt.clone(), output.clone()));
        Ok(GenerateOutput {
            request_id: request.request_id.clone(),
            output_log_probs: (0..output.len()).map(logprob).collect(),
            output_ids: output,
            routed_experts: None,
            finish_reason: FinishReason::Stop,
            matched_stop: Some(json!(IM_END)),
            weight_version: WeightVersion(3),
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(&self, _: &NamedTensors, _: WeightVersion) -> miles_core::Result<()> {
        Ok(())
    }
    async fn update_weights_from_disk(&self, _: &Path, _: WeightVersion) -> miles_core::Result<()> {
        Ok(())
    }
    async fn pause(&self, _: PauseMode) -> miles_core::Result<()> {
        Ok(())
    }
    async fn resume(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn flush_cache(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn abort(&self, _: &RequestId) -> miles_core::Result<()> {
        Ok(())
    }
    async fn abort_all(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn health(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        Ok(WeightVersion(3))
    }
}

#[tokio::test]
async fn qwen3_tool_conversation_stores_hf_exact_ids() {
    let (conversation, hf_ids) = hf_reference();
    let messages = conversation["messages"].as_array().unwrap().clone();
    let tools = conversation["tools"].clone();
    assert_eq!(hf_ids.last(), Some(&NEWLINE), "HF ends the render with \\n");

    let chat = Arc::new(TitoChat::load(&fixtures().join("qwen3"), "qwen3").unwrap());
    let engine = Arc::new(HfReplayEngine {
        hf_ids: hf_ids.clone(),
        seen: Mutex::new(Vec::new()),
    });
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
