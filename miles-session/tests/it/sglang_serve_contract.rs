//! Contract tests of the SGLang-protocol server: the JSON it answers against the shapes in
//! SGLang's documentation (`docs/basic_usage/native_api`: `/generate` →
//! `{"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "length", "length": N}
//! | {"type": "stop", "matched": …}, "prompt_tokens", "weight_version": "default", "completion_tokens",
//! "cached_tokens", …}}`, `/model_info` key set, `update_weights_from_disk` →
//! `{"success": true, "message": "Succeeded to update model weights."}`) and SGLang's HTTP API,
//! miles-session's SGLang client against it on loopback, and the session server on top of it.
//!
//! The engine here is miles-session's deterministic toy engine with its byte-level ChatML
//! tokenizer, so every expected id and log-prob is computed by hand from its documented rules
//! (`ToyEngine::reply_for`, `toy_logprob`, `toy_expert`). `serve_embedded.rs` runs the same
//! protocol over the embedded burn engine and a real checkpoint.

use std::sync::Arc;
use std::time::Duration;

use miles_core::{
    FinishReason, GenerateRequest, InferenceEngine, PauseMode, RequestId, RoutedExperts, Sample,
    SampleStatus, SamplingParams, TokenId, WeightVersion,
};
use miles_session::http::{HttpClient, HttpResponse};
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_session::sglang::{ServerInfo, sglang_router};
use miles_session::sglang::{SglangConfig, SglangEngine};
use miles_session::testkit::{ByteChatml, IM_END, ToyEngine, toy_expert, toy_logprob};
use miles_tito::ChatTokenizer;
use serde_json::{Value, json};

async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

/// The weights root of the toy servers, holding one checkpoint folder `new-weights`.
fn weights_root() -> std::path::PathBuf {
    let root = std::env::temp_dir().join(format!("miles-serve-contract-{}", std::process::id()));
    std::fs::create_dir_all(root.join("new-weights")).unwrap();
    root
}

fn new_weights() -> String {
    weights_root()
        .join("new-weights")
        .to_string_lossy()
        .into_owned()
}

fn info_with_tokenizer() -> ServerInfo {
    ServerInfo::new("toy-model")
        .with_tokenizer(Arc::new(ByteChatml::default()), "byte-chatml")
        .with_weights_root(weights_root())
}

async fn toy_server(info: ServerInfo) -> (Arc<ToyEngine>, String) {
    let engine = ToyEngine::new();
    let base = serve(sglang_router(engine.clone(), info)).await;
    (engine, base)
}

fn http() -> HttpClient {
    HttpClient::new(Duration::from_secs(30))
}

async fn post(base: &str, path: &str, body: &Value) -> HttpResponse {
    http()
        .post_json(&format!("{base}{path}"), body, &[])
        .await
        .unwrap()
}

const PROMPT: &str = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";

fn prompt_ids() -> Vec<TokenId> {
    ByteChatml::default().encode(PROMPT)
}

/// The toy engine's answer to [`PROMPT`], by its documented rule.
fn expected_reply() -> Vec<TokenId> {
    let text = ToyEngine::reply_for(PROMPT).unwrap();
    assert_eq!(
        text,
        "<think>\nEchoing.\n</think>\n\nYou said: hi<|im_end|>"
    );
    ByteChatml::default().encode(&text)
}

fn keys(v: &Value) -> Vec<String> {
    let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    k.sort();
    k
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_answers_in_sglang_shapes() {
    let (engine, base) = toy_server(info_with_tokenizer()).await;
    let ids = prompt_ids();
    let reply = expected_reply();
    let r = post(
        &base,
        "/generate",
        &json!({"input_ids": ids, "rid": "req-1", "return_logprob": true,
                "sampling_params": {"temperature": 0, "max_new_tokens": 64}}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body: Value = r.json().unwrap();
    assert_eq!(keys(&body), ["meta_info", "output_ids", "text"]);
    assert_eq!(body["output_ids"], json!(reply));
    // SGLang's text: the matched stop (`<|im_end|>`) trimmed; `output_ids` keep it.
    assert_eq!(body["text"], "<think>\nEchoing.\n</think>\n\nYou said: hi");
    let meta = &body["meta_info"];
    for key in [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "completion_tokens",
        "cached_tokens",
        "output_token_logprobs",
        "e2e_latency",
    ] {
        assert!(meta.get(key).is_some(), "meta_info lacks {key}: {meta}");
    }
    assert_eq!(meta["id"], "req-1");
    // Stopped on <|im_end|>: SGLang reports the matched stop token id.
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "stop", "matched": IM_END})
    );
    assert_eq!(meta["prompt_tokens"], json!(ids.len()));
    assert_eq!(meta["completion_tokens"], json!(reply.len()));
    assert_eq!(meta["cached_tokens"], json!(0));
    // The weight version is a string on the wire (SGLang: "default" before any update).
    assert_eq!(meta["weight_version"], json!("7"));
    let entries = meta["output_token_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), reply.len());
    for (pos, (entry, &id)) in entries.iter().zip(&reply).enumerate() {
        // [logprob, token_id, token_text] with the text null unless return_text_in_logprobs.
        assert_eq!(
            entry,
            &json!([toy_logprob(id, pos), id, null]),
            "entry {pos}"
        );
    }
    // Defaults as SGLang sends them on to the engine: max_new_tokens and the id.
    let seen = engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen.request_id, Some(RequestId::new("req-1")));
    assert_eq!(seen.sampling_params.max_new_tokens, Some(64));
    assert_eq!(seen.sampling_params.temperature, 0.0);

    // Hitting max_new_tokens: {"type": "length", "length": N}; no log-probs unless asked.
    let r = post(
        &base,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 5}}),
    )
    .await;
    let body: Value = r.json().unwrap();
    assert_eq!(
        body["meta_info"]["finish_reason"],
        json!({"type": "length", "length": 5})
    );
    assert_eq!(body["output_ids"], json!(reply[..5]));
    assert!(body["meta_info"].get("output_token_logprobs").is_none());
    assert!(
        body["meta_info"]["id"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );

    // No max_new_tokens: SGLang's default of 128 reaches the engine.
    post(&base, "/generate", &json!({"input_ids": ids})).await;
    let seen = engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen.sampling_params.max_new_tokens, Some(128));

    // A text prompt is tokenized with the server's tokenizer; return_text_in_logprobs fills the
    // third element.
    let r = post(
        &base,
        "/generate",
        &json!({"text": PROMPT, "return_logprob": true, "return_text_in_logprobs": true,
                "sampling_params": {"max_new_tokens": 3}}),
    )
    .await;
    let body: Value = r.json().unwrap();
    assert_eq!(body["output_ids"], json!(reply[..3]));
    assert_eq!(
        body["meta_info"]["output_token_logprobs"][0],
        json!([toy_logprob(reply[0], 0), reply[0], "<think>"])
    );

    // A batch of prompts and n > 1 both answer with a list, in order.
    let r = post(
        &base,
        "/generate",
        &json!({"input_ids": [ids, ids], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}),
    )
    .await;
    let body: Value = r.json().unwrap();
    let list = body.as_array().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list[0]["meta_info"]["id"], "a");
    assert_eq!(list[1]["meta_info"]["id"], "b");
    let r = post(
        &base,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "n": 3}}),
    )
    .await;
    let body: Value = r.json().unwrap();
    assert_eq!(body.as_array().unwrap().len(), 3);
    assert!(
        body.as_array()
            .unwrap()
            .iter()
            .all(|o| o["output_ids"] == json!(reply[..2]))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_experts_are_base64_int32_rows_of_all_forwarded_positions() {
    let (_engine, base) = toy_server(info_with_tokenizer()).await;
    let ids = prompt_ids();
    let reply = expected_reply();
    let r = post(
        &base,
        "/generate",
        &json!({"input_ids": ids, "return_logprob": true, "return_routed_experts": true}),
    )
    .await;
    let body: Value = r.json().unwrap();
    let b64 = body["meta_info"]["routed_experts"].as_str().unwrap();
    // SGLang's routed-experts layout: little-endian int32 [prompt + output − 1, layers, top_k], base64.
    let rows = ids.len() + reply.len() - 1;
    let table = RoutedExperts::from_base64(b64, rows, 2).unwrap();
    assert_eq!(table.shape(), [rows, 2, 2]);
    for row in [0, rows / 2, rows - 1] {
        for layer in 0..2 {
            for k in 0..2 {
                assert_eq!(
                    table.as_slice()[(row * 2 + layer) * 2 + k],
                    toy_expert(row, layer, k)
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_routes_answer_as_sglang_documents() {
    let (engine, base) = toy_server(info_with_tokenizer()).await;
    let client = http();
    let r = client.get(&format!("{base}/health")).await.unwrap();
    assert_eq!(r.status, 200);
    // The heartbeat generates one token from `[0]`; the toy engine refuses prompts without a
    // chat generation prompt, so it reports unhealthy (the embedded engine passes it).
    let r = client
        .get(&format!("{base}/health_generate"))
        .await
        .unwrap();
    assert_eq!(r.status, 503);
    assert!(r.json::<Value>().unwrap()["error"]["message"].is_string());
    let info: Value = client
        .get(&format!("{base}/model_info"))
        .await
        .unwrap()
        .json()
        .unwrap();
    // The exact key set SGLang's docs assert for /model_info.
    assert_eq!(
        keys(&info),
        [
            "architectures",
            "has_audio_understanding",
            "has_image_understanding",
            "is_generation",
            "model_path",
            "model_type",
            "preferred_sampling_params",
            "tokenizer_path",
            "weight_version",
        ]
    );
    assert_eq!(info["is_generation"], json!(true));
    assert_eq!(info["model_path"], "toy-model");
    assert_eq!(info["weight_version"], "7");
    let server: Value = client
        .get(&format!("{base}/get_server_info"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(server["model_path"], "toy-model");
    // SGLang clients write weight updates in the dtype the server names.
    assert_eq!(server["dtype"], "float32");
    let r = client.get(&format!("{base}/flush_cache")).await.unwrap();
    assert_eq!(r.status, 200);
    let r = post(&base, "/pause_generation", &json!({"mode": "in_place"})).await;
    assert_eq!(r.status, 200);
    let r = post(&base, "/continue_generation", &json!({})).await;
    assert_eq!(r.status, 200);
    let r = post(&base, "/abort_request", &json!({"rid": "x"})).await;
    assert_eq!(r.status, 200);
    let r = post(&base, "/abort_request", &json!({"abort_all": true})).await;
    assert_eq!(r.status, 200);
    let r = post(
        &base,
        "/update_weights_from_disk",
        &json!({"model_path": new_weights(), "weight_version": "12"}),
    )
    .await;
    assert_eq!(r.status, 200);
    let body: Value = r.json().unwrap();
    assert_eq!(body["success"], json!(true));
    assert_eq!(body["message"], "Succeeded to update model weights.");
    let version: Value = client
        .get(&format!("{base}/get_weight_version"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(version, json!({"weight_version": "12"}));
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(12));
    // Without a version the update bumps it (ours are numeric).
    post(
        &base,
        "/update_weights_from_disk",
        &json!({"model_path": new_weights()}),
    )
    .await;
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(13));
    let models: Value = client
        .get(&format!("{base}/v1/models"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "toy-model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_4xx_with_a_json_error_never_a_panic() {
    let mut info = info_with_tokenizer();
    info.vocab_size = Some(264);
    info.context_length = Some(200);
    let (_engine, base) = toy_server(info).await;
    let ids = prompt_ids();
    let cases: Vec<(&str, Value, u16)> = vec![
        ("/generate", json!({}), 400),
        ("/generate", json!({"input_ids": ids, "text": "x"}), 400),
        ("/generate", json!({"input_ids": "abc"}), 400),
        ("/generate", json!({"input_ids": [1, -2]}), 400),
        ("/generate", json!({"input_ids": []}), 400),
        ("/generate", json!({"input_ids": [1, 999]}), 400),
        ("/generate", json!({"input_ids": vec![1; 250]}), 400),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 500}}),
            400,
        ),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"temperature": -1}}),
            400,
        ),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"top_k": 0}}),
            400,
        ),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"top_p": 1.5}}),
            400,
        ),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": "many"}}),
            400,
        ),
        (
            "/generate",
            json!({"input_ids": ids, "sampling_params": [1]}),
            400,
        ),
        ("/generate", json!({"input_ids": ids, "stream": true}), 400),
        ("/generate", json!({"input_ids": ids, "rid": 5}), 400),
        (
            "/generate",
            json!({"input_ids": ids, "return_logprob": "yes"}),
            400,
        ),
        ("/generate", json!([1, 2]), 400),
        ("/v1/chat/completions", json!({"messages": "hi"}), 400),
        ("/v1/chat/completions", json!({"messages": []}), 400),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": 3}),
            400,
        ),
        ("/update_weights_from_disk", json!({}), 400),
        (
            "/update_weights_from_disk",
            json!({"model_path": "/x", "weight_version": "v-abc"}),
            400,
        ),
        ("/abort_request", json!({}), 400),
        ("/pause_generation", json!({"mode": "sideways"}), 400),
        ("/no_such_route", json!({}), 404),
    ];
    for (path, body, status) in cases {
        let r = post(&base, path, &body).await;
        assert_eq!(r.status.as_u16(), status, "{path} {body}: {}", r.text());
        let error: Value = r.json().unwrap();
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{path} {body}: {error}"
        );
    }
    // Not JSON at all.
    let r = http()
        .send(
            hyper::Method::POST,
            &format!("{base}/generate"),
            &[],
            Some(("application/json", b"{not json".to_vec())),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    // The server is still up.
    let r = post(&base, "/generate", &json!({"input_ids": ids})).await;
    assert_eq!(r.status, 200);

    // Without a tokenizer text prompts and chat are refused, ids still work.
    let (_engine, base) = toy_server(ServerInfo::new("ids-only")).await;
    let r = post(&base, "/generate", &json!({"text": "hello"})).await;
    assert_eq!(r.status, 400);
    let r = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status, 400);
    let r = post(&base, "/generate", &json!({"input_ids": ids})).await;
    assert_eq!(r.status, 200);
    assert!(r.json::<Value>().unwrap().get("text").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_answer_in_openai_shape() {
    let (engine, base) = toy_server(info_with_tokenizer()).await;
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let r = post(
        &base,
        "/v1/chat/completions",
        &json!({"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}],
                "tools": [tool], "logprobs": true, "return_meta_info": true, "seed": 3}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let body: Value = r.json().unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "m");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "tool_calls");
    let message = &choice["message"];
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["content"], "");
    assert_eq!(
        message["reasoning_content"],
        "I should call the weather tool."
    );
    let call = &message["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["index"], 0);
    assert!(call["id"].as_str().is_some_and(|s| !s.is_empty()));
    assert_eq!(call["function"]["name"], "get_weather");
    let arguments: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    // The prompt the engine saw is the chat template's rendering of the request.
    let tok = ByteChatml::default();
    let seen = engine.last_request.lock().unwrap().clone().unwrap();
    let rendered = tok
        .render(
            &[miles_core::Message::user("weather in Paris?")],
            &[serde_json::from_value(tool.clone()).unwrap()],
            true,
            &Default::default(),
        )
        .unwrap();
    assert_eq!(seen.input_ids, rendered);
    assert_eq!(seen.sampling_params.sampling_seed, Some(3));
    assert_eq!(seen.sampling_params.stop_token_ids, vec![IM_END]);
    let reply = tok.encode(&ToyEngine::reply_for(&tok.decode(&rendered)).unwrap());
    let content = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), reply.len());
    assert_eq!(content[0]["token"], "<think>");
    assert_eq!(content[0]["logprob"], json!(toy_logprob(reply[0], 0)));
    let meta = &choice["meta_info"];
    assert_eq!(meta["completion_tokens"], json!(reply.len()));
    assert_eq!(
        meta["output_token_logprobs"][1],
        json!([toy_logprob(reply[1], 1), reply[1], null])
    );
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": rendered.len(), "completion_tokens": reply.len(),
               "total_tokens": rendered.len() + reply.len()})
    );

    // Miles' session server sends the prompt as input_ids: used as is, not rendered again.
    let ids = prompt_ids();
    let r = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "ignored"}], "input_ids": ids}),
    )
    .await;
    let body: Value = r.json().unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "You said: hi");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["choices"][0]["logprobs"].is_null());
    assert!(body["choices"][0].get("meta_info").is_none());

    // stream: one chunk with the whole message, then [DONE].
    let r = post(
        &base,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
    )
    .await;
    assert_eq!(
        r.headers["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let text = r.text();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.len(), 2);
    assert_eq!(events[1], "[DONE]");
    let chunk: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(chunk["object"], "chat.completion.chunk");
    assert_eq!(chunk["choices"][0]["delta"]["content"], "You said: hi");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sglang_client_drives_our_server() {
    let (engine, base) = toy_server(info_with_tokenizer()).await;
    let mut config = SglangConfig::new(&base);
    config.num_layers = Some(2);
    let client = SglangEngine::new(config);
    let ids = prompt_ids();
    let reply = expected_reply();
    let mut request = GenerateRequest::new(
        ids.clone(),
        SamplingParams {
            max_new_tokens: Some(64),
            ..SamplingParams::default()
        },
    );
    request.request_id = Some(RequestId::new("c-1"));
    request.routing_key = Some("session-9".into());
    request.return_routed_experts = true;
    let output = client.generate(request).await.unwrap();
    assert_eq!(output.output_ids, reply);
    let expected_lps: Vec<f64> = reply
        .iter()
        .enumerate()
        .map(|(p, &id)| toy_logprob(id, p))
        .collect();
    assert_eq!(output.output_log_probs, expected_lps);
    assert_eq!(output.finish_reason, FinishReason::Stop);
    assert_eq!(output.matched_stop, Some(json!(IM_END)));
    assert_eq!(output.weight_version, WeightVersion(7));
    assert_eq!(output.prompt_tokens, ids.len());
    let routed = output.routed_experts.unwrap();
    assert_eq!(routed.shape(), [ids.len() + reply.len() - 1, 2, 2]);
    assert_eq!(routed.as_slice()[5], toy_expert(1, 0, 1));
    // The routing key travelled as the X-SMG-Routing-Key header.
    let seen = engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(seen.routing_key.as_deref(), Some("session-9"));
    assert_eq!(seen.request_id, Some(RequestId::new("c-1")));

    client
        .update_weights_from_disk(std::path::Path::new(&new_weights()), WeightVersion(8))
        .await
        .unwrap();
    assert_eq!(client.weight_version().await.unwrap(), WeightVersion(8));
    client.pause(PauseMode::Retract).await.unwrap();
    client.resume().await.unwrap();
    client.flush_cache().await.unwrap();
    client.abort(&RequestId::new("c-1")).await.unwrap();
    client.abort_all().await.unwrap();
    client.health().await.unwrap();
    // An invalid request comes back as InvalidRequest (HTTP 400), not a transport failure.
    let bad = GenerateRequest::new(
        ids,
        SamplingParams {
            temperature: -3.0,
            ..SamplingParams::default()
        },
    );
    assert!(matches!(
        client.generate(bad).await,
        Err(miles_core::Error::Engine {
            kind: miles_core::EngineErrorKind::InvalidRequest,
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_server_runs_on_our_server() {
    let (_engine, base) = toy_server(info_with_tokenizer()).await;
    let backend: Arc<dyn InferenceEngine> = Arc::new(SglangEngine::new(SglangConfig::new(&base)));
    let sessions = SessionServer::new(
        backend,
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    let front = serve(sessions.router()).await;
    let client = http();
    let created: Value = client
        .post_json(&format!("{front}/sessions"), &json!({}), &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let session = format!(
        "{front}/sessions/{}",
        created["session_id"].as_str().unwrap()
    );
    let first = json!({"messages": [{"role": "user", "content": "weather in Oslo"}]});
    let r: Value = client
        .post_json(&format!("{session}/v1/chat/completions"), &first, &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    let call = r["choices"][0]["message"]["tool_calls"][0].clone();
    assert_eq!(call["function"]["name"], "get_weather");
    let second = json!({"messages": [
        {"role": "user", "content": "weather in Oslo"},
        r["choices"][0]["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]});
    let r: Value = client
        .post_json(&format!("{session}/v1/chat/completions"), &second, &[])
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(
        r["choices"][0]["message"]["content"],
        "The weather is sunny."
    );
    let payload: Value = client
        .post_json(
            &format!("{session}/samples"),
            &json!({}),
            &[("accept", "application/json")],
        )
        .await
        .unwrap()
        .json()
        .unwrap();
    let sample: Sample = serde_json::from_value(payload["samples"][0].clone()).unwrap();
    assert_eq!(sample.status, SampleStatus::Completed);
    assert_eq!(sample.weight_versions, vec!["7".to_owned(), "7".to_owned()]);
    // Both assistant turns were generated by our server; their ids and log-probs are the toy
    // engine's, recorded exactly.
    let tok = ByteChatml::default();
    let log_probs = sample.rollout_log_probs.clone().unwrap();
    let mask = sample.loss_mask.clone().unwrap();
    let response = &sample.tokens[sample.tokens.len() - sample.response_length..];
    let generated: Vec<(TokenId, f64)> = response
        .iter()
        .zip(&log_probs)
        .zip(&mask)
        .filter(|(_, m)| **m == 1)
        .map(|((id, lp), _)| (*id, *lp))
        .collect();
    let first_reply = tok.encode(
        &ToyEngine::reply_for(
            "<|im_start|>user\nweather in Oslo<|im_end|>\n<|im_start|>assistant\n",
        )
        .unwrap(),
    );
    for (pos, &id) in first_reply.iter().enumerate() {
        assert_eq!(generated[pos], (id, toy_logprob(id, pos)));
    }
    let second_reply =
        tok.encode("<think>\nThe tool answered.\n</think>\n\nThe weather is sunny.<|im_end|>");
    assert_eq!(generated.len(), first_reply.len() + second_reply.len());
    let tail: Vec<TokenId> = generated[first_reply.len()..].iter().map(|g| g.0).collect();
    assert_eq!(tail, second_reply);
}
