//! Miles' own session-server contracts, ported: the requests of Miles' v1 session tests
//! (radixark/miles @ 31f1ca961a94: `tests/fast/router/test_sessions.py`,
//! `test_sessions_v1_pins.py`, `test_session_race_conditions.py`, `test_session_samples_op.py`)
//! sent to our session server on loopback, and what those tests assert checked on our answers.
//! Each test is named after the Miles test it ports: `sessions_*` (test_sessions.py),
//! `v1_pins_*`, `race_*` (test_session_race_conditions.py), `samples_op_*`.
//!
//! Miles' tests put a mock SGLang *chat* server behind the session server; ours calls an engine
//! at the token level, so the mock becomes [`Scripted`] (a byte-level engine whose reply is a
//! function of the prompt text) and "the backend's request log" becomes the `GenerateRequest`s
//! the engine saw. Where our answer differs on purpose (OpenAI-shaped error bodies, 409 for a
//! second turn while one is in flight) the test asserts our documented behaviour and says so;
//! COMPATIBILITY.md ("session server: Miles' own contracts") has the table.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, NamedTensors,
    PauseMode, RequestId, Sample, SampleStatus, TokenId, WeightVersion,
};
use miles_session::assembly::{
    compute_samples_from_records, merge_samples, truncate_samples_by_total_tokens,
};
use miles_session::codec::{EmptyReason, decode_samples};
use miles_session::http::{HttpClient, HttpResponse};
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_session::trajectory::SessionRecord;
use miles_tito::ChatTokenizer;
use serde_json::{Value, json};

use crate::common::{ByteChatml, IM_END, serve};

type Reply = dyn Fn(&str) -> Result<String, miles_core::Error> + Send + Sync;

/// The mock backend: replies `reply(prompt text)` (ByteChatml tokens, `<|im_end|>` appended),
/// after `delay`, logging every request and the most requests it held at once.
pub(crate) struct Scripted {
    tok: ByteChatml,
    reply: Mutex<Arc<Reply>>,
    delay: Mutex<Option<Duration>>,
    log: Mutex<Vec<GenerateRequest>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Answers one log-prob short of the tokens (an upstream protocol break).
    pub(crate) short_log_probs: AtomicBool,
}

impl Scripted {
    /// Miles' fixture `process_fn`: `echo: {prompt}` (here the last message's text).
    pub(crate) fn echo() -> Arc<Self> {
        Self::new(Arc::new(|prompt: &str| {
            let body = prompt
                .strip_suffix("<|im_start|>assistant\n")
                .unwrap_or(prompt);
            let last = body.rsplit("<|im_start|>").next().unwrap_or("");
            let content = last.split_once('\n').map_or("", |(_, c)| c);
            let content = content.strip_suffix("<|im_end|>\n").unwrap_or(content);
            Ok(format!("echo: {content}"))
        }))
    }

    fn new(reply: Arc<Reply>) -> Arc<Self> {
        Arc::new(Self {
            tok: ByteChatml::default(),
            reply: Mutex::new(reply),
            delay: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            short_log_probs: AtomicBool::new(false),
        })
    }

    pub(crate) fn set_reply(&self, reply: Arc<Reply>) {
        *self.reply.lock().unwrap() = reply;
    }

    pub(crate) fn set_delay(&self, delay: Duration) {
        *self.delay.lock().unwrap() = Some(delay);
    }

    pub(crate) fn requests(&self) -> usize {
        self.log.lock().unwrap().len()
    }

    pub(crate) fn last(&self) -> GenerateRequest {
        self.log.lock().unwrap().last().unwrap().clone()
    }

    fn reset_stats(&self) {
        self.log.lock().unwrap().clear();
        self.max_in_flight.store(0, Ordering::SeqCst);
    }
}

#[async_trait]
impl InferenceEngine for Scripted {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        self.log.lock().unwrap().push(request.clone());
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let delay = *self.delay.lock().unwrap();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let prompt = self.tok.decode(&request.input_ids);
        let reply = self.reply.lock().unwrap().clone();
        let text = reply(&prompt)?;
        let mut ids = self.tok.encode(&text);
        ids.push(IM_END);
        let mut finish = FinishReason::Stop;
        let mut matched = Some(json!(IM_END));
        if let Some(max) = request.sampling_params.max_new_tokens
            && ids.len() > max
        {
            ids.truncate(max);
            finish = FinishReason::Length;
            matched = None;
        }
        let mut log_probs: Vec<f64> = (0..ids.len()).map(|i| -0.125 * (i as f64 + 1.0)).collect();
        if self.short_log_probs.load(Ordering::SeqCst) {
            log_probs.pop();
        }
        Ok(GenerateOutput {
            request_id: request.request_id.clone(),
            output_log_probs: log_probs,
            output_ids: ids,
            routed_experts: None,
            finish_reason: finish,
            matched_stop: matched,
            weight_version: WeightVersion(1),
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }
    async fn update_weights(&self, _: &NamedTensors, _: WeightVersion) -> miles_core::Result<()> {
        Ok(())
    }
    async fn update_weights_from_disk(
        &self,
        _: &std::path::Path,
        _: WeightVersion,
    ) -> miles_core::Result<()> {
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
        Ok(WeightVersion(1))
    }
}

/// Miles' `router_env`: a session server over the mock backend.
pub(crate) struct Env {
    pub(crate) url: String,
    pub(crate) http: HttpClient,
    pub(crate) backend: Arc<Scripted>,
}

const INSTANCE_ID: &str = "0123456789abcdef0123456789abcdef";

async fn router_env() -> Env {
    router_env_with(SessionServerConfig {
        instance_id: Some(INSTANCE_ID.into()),
        ..SessionServerConfig::default()
    })
    .await
}

pub(crate) async fn router_env_with(config: SessionServerConfig) -> Env {
    let backend = Scripted::echo();
    let server = SessionServer::new(backend.clone(), Arc::new(ByteChatml::default()), config);
    Env {
        url: serve(server.router()).await,
        http: HttpClient::new(Duration::from_secs(30)),
        backend,
    }
}

impl Env {
    pub(crate) async fn create_session(&self) -> String {
        let r = self
            .http
            .post_json(&format!("{}/sessions", self.url), &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200);
        r.json::<Value>().unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub(crate) async fn post_chat(&self, sid: &str, payload: &Value) -> HttpResponse {
        self.http
            .post_json(
                &format!("{}/sessions/{sid}/v1/chat/completions", self.url),
                payload,
                &[],
            )
            .await
            .unwrap()
    }

    pub(crate) async fn get(&self, sid: &str) -> HttpResponse {
        self.http
            .get(&format!("{}/sessions/{sid}", self.url))
            .await
            .unwrap()
    }

    pub(crate) async fn session(&self, sid: &str) -> Value {
        let r = self.get(sid).await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json().unwrap()
    }

    pub(crate) async fn delete(&self, sid: &str) -> HttpResponse {
        self.http
            .send(
                hyper::Method::DELETE,
                &format!("{}/sessions/{sid}", self.url),
                &[],
                None,
            )
            .await
            .unwrap()
    }

    pub(crate) async fn samples(&self, sid: &str, body: &Value) -> HttpResponse {
        self.http
            .post_json(&format!("{}/sessions/{sid}/samples", self.url), body, &[])
            .await
            .unwrap()
    }
}

/// Our error bodies are OpenAI-shaped (`{"error": {"message", "type", "code"}}`, deliberate);
/// Miles' `{"error": TEXT}` text is our `error.message`.
pub(crate) fn error_text(r: &HttpResponse) -> String {
    let body: Value = r.json().unwrap();
    body["error"]["message"].as_str().unwrap().to_owned()
}

/// Miles' `_parse_sse`: the data payload of each event, in order.
fn parse_sse(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|block| block.strip_prefix("data: "))
        .map(str::to_owned)
        .collect()
}

/// Miles' `openai_stream_client.accumulate_chat_chunks`: the OpenAI delta semantics (content
/// concatenates, tool calls merge by `index`, which the rebuilt calls drop).
fn accumulate(body: &str) -> Value {
    let events = parse_sse(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut message = json!({"role": "assistant", "content": null});
    let mut calls: std::collections::BTreeMap<u64, Value> = Default::default();
    let mut finish = Value::Null;
    let mut first: Option<Value> = None;
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        assert_eq!(chunk["object"], json!("chat.completion.chunk"));
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        if let Some(role) = delta.get("role").filter(|r| !r.is_null()) {
            message["role"] = role.clone();
        }
        if let Some(Value::String(c)) = delta.get("content") {
            let before = message["content"].as_str().unwrap_or("").to_owned();
            message["content"] = json!(before + c);
        }
        if let Some(Value::String(r)) = delta.get("reasoning_content") {
            let before = message["reasoning_content"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            message["reasoning_content"] = json!(before + r);
        }
        for fragment in delta["tool_calls"].as_array().into_iter().flatten() {
            let entry = calls
                .entry(fragment["index"].as_u64().unwrap())
                .or_insert_with(|| json!({"function": {}}));
            for (key, value) in fragment.as_object().unwrap() {
                if key == "index" || key == "function" || value.is_null() {
                    continue;
                }
                entry[key] = value.clone();
            }
            let function = &fragment["function"];
            if let Some(name) = function.get("name").filter(|n| !n.is_null()) {
                entry["function"]["name"] = name.clone();
            }
            if let Some(Value::String(args)) = function.get("arguments") {
                let before = entry["function"]["arguments"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned();
                entry["function"]["arguments"] = json!(before + args);
            }
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
        first.get_or_insert(chunk.clone());
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls.into_values().collect());
    }
    let first = first.expect("no chunk before [DONE]");
    json!({"id": first["id"], "object": "chat.completion", "model": first["model"],
           "choices": [{"index": 0, "message": message, "finish_reason": finish}]})
}

const USER: &str = "What is 1+2?";

fn messages() -> Value {
    json!([{"role": "user", "content": USER}])
}

fn two_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time",
          "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}},
    ])
}

fn two_calls(_: &str) -> Result<String, miles_core::Error> {
    Ok("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Beijing\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"UTC\"}}\n</tool_call>".into())
}

// ---------------------------------------------------------------------------------------------
// test_sessions.py :: TestSessionRoutes

#[tokio::test]
async fn sessions_health_reports_stable_instance_id() {
    let env = router_env().await;
    let first = env.http.get(&format!("{}/health", env.url)).await.unwrap();
    let second = env.http.get(&format!("{}/health", env.url)).await.unwrap();
    assert_eq!(first.status, 200);
    assert_eq!(second.status, 200);
    let (a, b): (Value, Value) = (first.json().unwrap(), second.json().unwrap());
    assert_eq!(a["status"], json!("ok"));
    assert_eq!(b["status"], json!("ok"));
    let id = a["session_server_instance_id"].as_str().unwrap();
    assert!(id.len() == 32 && id.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')));
    assert_eq!(
        b["session_server_instance_id"],
        a["session_server_instance_id"]
    );
}

#[tokio::test]
async fn sessions_create_session() {
    let env = router_env().await;
    let r = env
        .http
        .post_json(&format!("{}/sessions", env.url), &json!({}), &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let data: Value = r.json().unwrap();
    assert_eq!(data["session_id"].as_str().unwrap().len(), 32);
}

#[tokio::test]
async fn sessions_get_session_initial_state() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let data = env.session(&sid).await;
    assert_eq!(data["session_id"], json!(sid));
    assert_eq!(data["records"], json!([]));
}

#[tokio::test]
async fn sessions_get_session_not_found() {
    let env = router_env().await;
    let r = env.get("nonexistent").await;
    assert_eq!(r.status, 404);
    assert_eq!(error_text(&r), "session not found: session_id=nonexistent");
}

#[tokio::test]
async fn sessions_delete_session() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env.delete(&sid).await;
    assert_eq!(r.status, 204);
    assert_eq!(r.text(), "");
    assert_eq!(env.delete(&sid).await.status, 404);
}

#[tokio::test]
async fn sessions_delete_session_not_found() {
    let env = router_env().await;
    let r = env.delete("nonexistent").await;
    assert_eq!(r.status, 404);
    assert_eq!(error_text(&r), "session not found: session_id=nonexistent");
}

// ---------------------------------------------------------------------------------------------
// test_sessions.py :: TestSessionProxy

#[tokio::test]
async fn sessions_proxy_chat_appends_record() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": messages(), "return_logprob": true}),
        )
        .await;
    assert_eq!(r.status, 200);
    let body: Value = r.json().unwrap();
    assert!(!body["choices"].as_array().unwrap().is_empty());
    let records = env.session(&sid).await["records"].clone();
    assert_eq!(records.as_array().unwrap().len(), 1);
    assert_eq!(records[0]["path"], json!("/v1/chat/completions"));
    assert_eq!(records[0]["status_code"], json!(200));
}

#[tokio::test]
async fn sessions_proxy_chat_response_has_no_duplicate_server_or_date_header() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = router_env().await;
    let sid = env.create_session().await;
    let hostport = env.url.strip_prefix("http://").unwrap().to_owned();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "return_logprob": true})
        .to_string();
    let request = format!(
        "POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut sock = tokio::net::TcpStream::connect(&hostport).await.unwrap();
    sock.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw);
    let head = raw.split("\r\n\r\n").next().unwrap();
    assert!(head.lines().next().unwrap().ends_with("200 OK"), "{head}");
    let names: Vec<String> = head
        .lines()
        .skip(1)
        .map(|l| l.split(':').next().unwrap().to_lowercase())
        .collect();
    // Miles: exactly one of each (uvicorn writes both). We write `date` and no `server`
    // header: never two (the contract's point: aiohttp refuses duplicates).
    assert_eq!(names.iter().filter(|n| *n == "date").count(), 1);
    assert!(names.iter().filter(|n| *n == "server").count() <= 1);
}

#[tokio::test]
async fn sessions_chat_malformed_json_body_returns_400() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env
        .http
        .send(
            hyper::Method::POST,
            &format!("{}/sessions/{sid}/v1/chat/completions", env.url),
            &[],
            Some(("application/json", b"{not json".to_vec())),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 400);
    assert!(
        error_text(&r).starts_with("invalid JSON body:"),
        "{}",
        r.text()
    );
}

#[tokio::test]
async fn sessions_chat_template_kwargs_override_reaches_render_and_backend() {
    // Miles launches with `--apply-chat-template-kwargs '{"enable_thinking": false}'` on
    // Qwen3; the request's `{"enable_thinking": true}` wins in the rendered ids and in the
    // recorded request. (The byte-level template here reads `enable_thinking` as Qwen3's does.)
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let env = router_env_with(SessionServerConfig {
        chat_template_kwargs: kwargs,
        ..SessionServerConfig::default()
    })
    .await;
    let default_session = env.create_session().await;
    let r = env
        .post_chat(
            &default_session,
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let default_ids = env.backend.last().input_ids;
    let record = &env.session(&default_session).await["records"][0];
    // (Ours records the family's forced kwargs beside them, as Miles' TITO tokenizer
    // kwargs do for a family that forces any; Miles' test family forces none.)
    assert_eq!(
        record["request"]["chat_template_kwargs"]["enable_thinking"],
        json!(false)
    );

    let override_session = env.create_session().await;
    let r = env
        .post_chat(
            &override_session,
            &json!({"messages": [{"role": "user", "content": "hi"}],
                    "chat_template_kwargs": {"enable_thinking": true}}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let override_ids = env.backend.last().input_ids;
    let record = &env.session(&override_session).await["records"][0];
    assert_eq!(
        record["request"]["chat_template_kwargs"]["enable_thinking"],
        json!(true)
    );
    assert_ne!(override_ids, default_ids);
}

#[tokio::test]
async fn sessions_chat_upstream_null_message_returns_502() {
    // Miles' mock answers `message: null`; our engine answers token ids, so the upstream
    // protocol break here is an answer whose log-probs do not cover its tokens (Miles'
    // `len(output_token_logprobs) != completion_tokens` check, the same 502).
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(|_| Ok("GARBAGE".into())));
    env.backend.short_log_probs.store(true, Ordering::SeqCst);
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status, 502, "{}", r.text());
}

#[tokio::test]
async fn sessions_chat_response_strips_replay_payloads_but_record_keeps_them() {
    // Covered with an engine that returns routed experts in `server.rs`
    // (`routed_experts_stay_in_the_record_and_leave_the_answer`); here: the client's
    // meta_info keeps everything but the replay payloads.
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env
        .post_chat(&sid, &json!({"messages": [{"role": "user", "content": "What is 2+2?"}], "return_logprob": true}))
        .await;
    assert_eq!(r.status, 200);
    let client_meta = r.json::<Value>().unwrap()["choices"][0]["meta_info"].clone();
    assert!(client_meta.get("routed_experts").is_none());
    assert!(client_meta.get("indexer_topk").is_none());
    assert!(client_meta.get("output_token_logprobs").is_some());
    let record = &env.session(&sid).await["records"][0];
    assert!(
        record["response"]["choices"][0]["meta_info"]
            .get("output_token_logprobs")
            .is_some()
    );
}

// ---------------------------------------------------------------------------------------------
// test_sessions.py :: TestChatFakeStreaming

#[tokio::test]
async fn sessions_stream_single_chunk_matches_non_stream() {
    let env = router_env().await;
    let non_stream_sid = env.create_session().await;
    let stream_sid = env.create_session().await;
    let non_stream: Value = env
        .post_chat(&non_stream_sid, &json!({"messages": messages()}))
        .await
        .json()
        .unwrap();
    let r = env
        .post_chat(
            &stream_sid,
            &json!({"messages": messages(), "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(r.status, 200);
    let content_type = r.headers["content-type"].to_str().unwrap();
    assert!(content_type.starts_with("text/event-stream"));
    let text = r.text();
    let events = parse_sse(&text);
    assert_eq!(events.len(), 2);
    assert_eq!(events[1], "[DONE]");
    let chunk: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(chunk["object"], json!("chat.completion.chunk"));
    assert_eq!(chunk["model"], non_stream["model"]);
    let choices = chunk["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    let expected = &non_stream["choices"][0];
    assert_eq!(choices[0]["delta"]["role"], json!("assistant"));
    assert_eq!(
        choices[0]["delta"]["content"],
        expected["message"]["content"]
    );
    assert_eq!(choices[0]["finish_reason"], expected["finish_reason"]);
    assert_eq!(choices[0]["finish_reason"], json!("stop"));
    assert!(choices[0].get("meta_info").is_none());
    assert!(!text.contains("routed_experts"));
    assert!(!text.contains("indexer_topk"));
    // Neither the engine nor the record sees the stream flags.
    let stream_record = env.session(&stream_sid).await["records"][0].clone();
    let non_stream_record = env.session(&non_stream_sid).await["records"][0].clone();
    assert!(stream_record["request"].get("stream").is_none());
    assert!(stream_record["request"].get("stream_options").is_none());
    assert_eq!(stream_record["request"], non_stream_record["request"]);
    assert_eq!(
        stream_record["response"]["choices"][0]["message"],
        non_stream_record["response"]["choices"][0]["message"]
    );
    let meta = |r: &Value| {
        let mut m = r["response"]["choices"][0]["meta_info"].clone();
        // Request ids and timings differ between any two calls.
        for key in ["id", "e2e_latency"] {
            m.as_object_mut().unwrap().remove(key);
        }
        m
    };
    assert_eq!(meta(&stream_record), meta(&non_stream_record));
}

#[tokio::test]
async fn sessions_stream_tool_calls_single_chunk_with_index() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(two_calls));
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": messages(), "tools": two_tools(), "stream": true}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let chunk: Value = serde_json::from_str(&parse_sse(&r.text())[0]).unwrap();
    let choice = &chunk["choices"][0];
    assert_eq!(choice["finish_reason"], json!("tool_calls"));
    let calls = choice["delta"]["tool_calls"].as_array().unwrap();
    let indices: Vec<u64> = calls.iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, [0, 1]);
    let names: Vec<&str> = calls
        .iter()
        .map(|c| c["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    for call in calls {
        serde_json::from_str::<Value>(call["function"]["arguments"].as_str().unwrap()).unwrap();
    }
}

#[tokio::test]
async fn sessions_stream_passes_through_usage_and_length_finish_reason() {
    // Miles patches the mock's answer to finish `length` with a usage; here the engine stops
    // at `max_tokens` and the chunk carries the answer's usage.
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": messages(), "stream": true, "max_tokens": 7}),
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let chunk: Value = serde_json::from_str(&parse_sse(&r.text())[0]).unwrap();
    assert_eq!(chunk["choices"][0]["finish_reason"], json!("length"));
    let prompt = env.backend.last().input_ids.len();
    assert_eq!(
        chunk["usage"],
        json!({"prompt_tokens": prompt, "completion_tokens": 7, "total_tokens": prompt + 7})
    );
}

#[tokio::test]
async fn sessions_stream_backend_error_passes_through_json() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(|_| {
        Err(miles_core::Error::engine(
            EngineErrorKind::InvalidRequest,
            "context too long",
        ))
    }));
    let r = env
        .post_chat(&sid, &json!({"messages": messages(), "stream": true}))
        .await;
    assert_eq!(r.status, 400);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    assert!(error_text(&r).contains("context too long"), "{}", r.text());
    assert_eq!(env.session(&sid).await["records"], json!([]));
}

#[tokio::test]
async fn sessions_stream_false_keeps_json_response() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env
        .post_chat(&sid, &json!({"messages": messages(), "stream": false}))
        .await;
    assert_eq!(r.status, 200);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let body: Value = r.json().unwrap();
    assert!(
        !body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
}

async fn stream_chat(env: &Env, sid: &str, payload: &Value) -> Value {
    let mut payload = payload.clone();
    payload["stream"] = json!(true);
    let r = env.post_chat(sid, &payload).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    accumulate(&r.text())
}

#[tokio::test]
async fn sessions_streaming_client_multi_turn_passes_prefix_check() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let first = stream_chat(&env, &sid, &json!({"messages": messages()})).await;
    let turn2 = json!([messages()[0], first["choices"][0]["message"],
                       {"role": "tool", "content": "ok", "tool_call_id": "t0"}]);
    let second = stream_chat(&env, &sid, &json!({"messages": turn2})).await;
    assert!(
        !first["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    assert!(
        !second["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty()
    );
    let records = env.session(&sid).await["records"].clone();
    assert_eq!(records.as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn sessions_streaming_client_rebuilt_tool_calls_match_stored() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(two_calls));
    let response = stream_chat(
        &env,
        &sid,
        &json!({"messages": messages(), "tools": two_tools()}),
    )
    .await;
    let rebuilt = response["choices"][0]["message"].clone();
    let record = env.session(&sid).await["records"][0].clone();
    let stored = record["response"]["choices"][0]["message"].clone();
    let stored_calls = stored["tool_calls"].as_array().unwrap();
    let rebuilt_calls = rebuilt["tool_calls"].as_array().unwrap();
    assert!(stored_calls.iter().all(|c| c.get("index").is_some()));
    assert!(rebuilt_calls.iter().all(|c| c.get("index").is_none()));
    let stored_message: miles_core::Message = serde_json::from_value(stored.clone()).unwrap();
    let rebuilt_message: miles_core::Message = serde_json::from_value(rebuilt.clone()).unwrap();
    assert!(miles_tito::MessageMatcher::Strict.matches(&stored_message, &rebuilt_message));
    let functions = |calls: &[Value]| {
        calls
            .iter()
            .map(|c| c["function"].clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(functions(rebuilt_calls), functions(stored_calls));
    let ids = |calls: &[Value]| calls.iter().map(|c| c["id"].clone()).collect::<Vec<_>>();
    assert_eq!(ids(rebuilt_calls), ids(stored_calls));
}

#[tokio::test]
async fn sessions_streaming_client_tool_call_turn_then_tool_result_continues() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(|prompt: &str| {
        Ok(if prompt.contains("TOOL_SENTINEL_42") {
            "Final answer after tool.".into()
        } else {
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Beijing\"}}\n</tool_call>".into()
        })
    }));
    let tools = json!([two_tools()[0]]);
    let first = stream_chat(&env, &sid, &json!({"messages": messages(), "tools": tools})).await;
    let assistant = first["choices"][0]["message"].clone();
    let turn2 = json!([messages()[0], assistant, {"role": "tool", "content": "TOOL_SENTINEL_42",
                       "tool_call_id": assistant["tool_calls"][0]["id"]}]);
    let second = stream_chat(&env, &sid, &json!({"messages": turn2, "tools": tools})).await;
    assert_eq!(first["choices"][0]["finish_reason"], json!("tool_calls"));
    assert_eq!(
        second["choices"][0]["message"]["content"],
        json!("Final answer after tool.")
    );
    let records = env.session(&sid).await["records"].clone();
    assert_eq!(records.as_array().unwrap().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// test_sessions_v1_pins.py :: TestRollbackPins

fn u1() -> Value {
    json!({"role": "user", "content": USER})
}
fn t1() -> Value {
    json!({"role": "tool", "content": "tool-result-1", "tool_call_id": "t0"})
}
fn t1_diff() -> Value {
    json!({"role": "tool", "content": "tool-result-DIFFERENT", "tool_call_id": "t0"})
}

impl Env {
    async fn turn(&self, sid: &str, messages: Value) -> Value {
        let r = self.post_chat(sid, &json!({"messages": messages})).await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.json::<Value>().unwrap()["choices"][0]["message"].clone()
    }

    async fn records(&self, sid: &str) -> Vec<Value> {
        self.session(sid).await["records"]
            .as_array()
            .unwrap()
            .clone()
    }

    /// Stored history after this: [U1, a1, T1, a2] with 2 records.
    async fn two_turn_session(&self) -> (String, Value, Value) {
        let sid = self.create_session().await;
        let a1 = self.turn(&sid, json!([u1()])).await;
        let a2 = self.turn(&sid, json!([u1(), a1, t1()])).await;
        assert_eq!(self.records(&sid).await.len(), 2);
        (sid, a1, a2)
    }
}

#[tokio::test]
async fn v1_pins_pure_drop_retry_rolls_back_and_regenerates() {
    let env = router_env().await;
    let (sid, a1, _) = env.two_turn_session().await;
    let retry = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1()]}))
        .await;
    assert_eq!(retry.status, 200);
    let records = env.records(&sid).await;
    assert_eq!(records.len(), 2);
    assert_eq!(records[1]["request"]["messages"][2], t1());
}

#[tokio::test]
async fn v1_pins_divergent_retry_rolls_back_and_continues() {
    let env = router_env().await;
    let (sid, a1, _) = env.two_turn_session().await;
    let retry = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1_diff()]}))
        .await;
    assert_eq!(retry.status, 200);
    let records = env.records(&sid).await;
    assert_eq!(records.len(), 2);
    assert_eq!(records[1]["request"]["messages"][2], t1_diff());
}

#[tokio::test]
async fn v1_pins_deep_rollback_400_byte_exact_and_state_unchanged() {
    let env = router_env().await;
    let (sid, a1, a2) = env.two_turn_session().await;
    let t2 = json!({"role": "tool", "content": "tool-result-2", "tool_call_id": "t1"});
    let a3 = env.turn(&sid, json!([u1(), a1, t1(), a2, t2])).await;
    let before = env.session(&sid).await;
    assert_eq!(before["records"].as_array().unwrap().len(), 3);

    let r = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1_diff()]}))
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        error_text(&r),
        "rollback failed: discard_count=2 exceeds max_assistant_rollback_steps=1 \
         (stored has 6 messages, request has 3 messages)"
    );
    let after = env.session(&sid).await;
    assert_eq!(after["records"], before["records"]);
    assert_eq!(
        after["metadata"]["accumulated_token_ids"],
        before["metadata"]["accumulated_token_ids"]
    );
    let t3 = json!({"role": "tool", "content": "tool-result-3", "tool_call_id": "t2"});
    let extend = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1(), a2, t2, a3, t3]}))
        .await;
    assert_eq!(extend.status, 200);
}

#[tokio::test]
async fn v1_pins_first_turn_retry_rolls_back_to_empty_and_regenerates() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.turn(&sid, json!([u1()])).await;
    let r = env.post_chat(&sid, &json!({"messages": [u1()]})).await;
    assert_eq!(r.status, 200);
    let regenerated = r.json::<Value>().unwrap()["choices"][0]["message"].clone();
    let records = env.records(&sid).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["request"]["messages"], json!([u1()]));
    let extend = env
        .post_chat(&sid, &json!({"messages": [u1(), regenerated, t1()]}))
        .await;
    assert_eq!(extend.status, 200);
}

#[tokio::test]
async fn v1_pins_failed_first_turn_then_different_first_request_accepted() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.backend.set_reply(Arc::new(|_| {
        Err(miles_core::Error::engine(
            EngineErrorKind::InvalidRequest,
            "context too long",
        ))
    }));
    let failed = env.post_chat(&sid, &json!({"messages": [u1()]})).await;
    assert_eq!(failed.status, 400);
    assert!(env.records(&sid).await.is_empty());
    env.backend
        .set_reply(Scripted::echo().reply.lock().unwrap().clone());
    let other_first = json!({"role": "user", "content": "a completely different opening"});
    let r = env
        .post_chat(&sid, &json!({"messages": [other_first]}))
        .await;
    assert_eq!(r.status, 200);
    let records = env.records(&sid).await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0]["request"]["messages"], json!([other_first]));
}

#[tokio::test]
async fn v1_pins_degenerate_extension_resend_exact_history() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let a1 = env.turn(&sid, json!([u1()])).await;
    let resend = env.post_chat(&sid, &json!({"messages": [u1(), a1]})).await;
    assert_eq!(resend.status, 200);
    assert_eq!(env.records(&sid).await.len(), 2);
}

#[tokio::test]
async fn v1_pins_disallowed_append_role_400_with_rollback_side_effect() {
    let env = router_env().await;
    let (sid, a1, _) = env.two_turn_session().await;
    let r = env
        .post_chat(
            &sid,
            &json!({"messages": [u1(), a1, {"role": "developer", "content": "another"}]}),
        )
        .await;
    assert_eq!(r.status, 400);
    let error = error_text(&r);
    assert!(
        error.ends_with("; the selected TITO fixed template does not support appending this role"),
        "{error}"
    );
    // Miles' characterization: its rollback happens before the append check rejects, and
    // the 400 leaves 1 record. Deliberate difference (COMPATIBILITY.md "session rollback"):
    // ours applies a rollback only at commit, so a refused retry changes nothing recorded.
    assert_eq!(env.records(&sid).await.len(), 2);
}

#[tokio::test]
async fn v1_pins_collect_samples_after_rollback_single_sample() {
    let env = router_env().await;
    let (sid, a1, _) = env.two_turn_session().await;
    let retry = env
        .post_chat(&sid, &json!({"messages": [u1(), a1, t1()]}))
        .await;
    assert_eq!(retry.status, 200);
    let r = env.samples(&sid, &json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reply = decode_samples(&r.body, &Sample::default()).unwrap();
    assert_eq!(reply.empty_reason, None);
    assert_eq!(reply.samples.len(), 1);
    let sample = &reply.samples[0];
    assert!(sample.response_length > 0);
    assert_eq!(
        sample.loss_mask.as_ref().unwrap().len(),
        sample.response_length
    );
}

#[tokio::test]
async fn v1_pins_few_shot_first_request_divergent_retry_uses_generated_checkpoint() {
    let env = router_env().await;
    let few_shot = json!([
        {"role": "user", "content": "Q-few-shot"},
        {"role": "assistant", "content": "A-few-shot"},
        {"role": "user", "content": "Q-real"},
    ]);
    let with = |tail: &[Value]| {
        let mut m = few_shot.as_array().unwrap().clone();
        m.extend_from_slice(tail);
        Value::Array(m)
    };
    let sid = env.create_session().await;
    let a1 = env.turn(&sid, few_shot.clone()).await;
    env.turn(&sid, with(&[a1.clone(), t1()])).await;
    assert_eq!(env.records(&sid).await.len(), 2);
    let retry = env
        .post_chat(&sid, &json!({"messages": with(&[a1, t1_diff()])}))
        .await;
    assert_eq!(retry.status, 200);
    let records = env.records(&sid).await;
    assert_eq!(records.len(), 2);
    assert_eq!(records[1]["request"]["messages"][4], t1_diff());
}

// ---------------------------------------------------------------------------------------------
// test_session_race_conditions.py

async fn wait_for_backend(env: &Env) {
    for _ in 0..500 {
        if env.backend.requests() > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("in-flight request did not reach backend in time");
}

#[tokio::test]
async fn race_same_session_concurrent_requests_reach_backend() {
    // Deliberate difference: a second turn on a session while one is in flight is 409
    // (`session_busy`) here; Miles lets all four reach the backend and keeps one.
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(200));
    let sid = env.create_session().await;
    let warmup = json!({"messages": [{"role": "user", "content": "warmup"}]});
    let assistant = env.turn(&sid, warmup["messages"].clone()).await;
    let retry = json!({"messages": [{"role": "user", "content": "warmup"}, assistant,
                      {"role": "system", "content": "retry-from-assistant-checkpoint"}]});
    env.backend.reset_stats();
    let mut handles = Vec::new();
    for _ in 0..4 {
        let (env, sid, retry) = (env.clone(), sid.clone(), retry.clone());
        handles.push(tokio::spawn(async move {
            env.post_chat(&sid, &retry).await.status
        }));
    }
    let mut codes = Vec::new();
    for h in handles {
        codes.push(h.await.unwrap().as_u16());
    }
    codes.sort();
    assert!(codes.iter().all(|c| *c == 200 || *c == 409), "{codes:?}");
    assert!(codes.contains(&200), "{codes:?}");
    assert!(!codes.iter().any(|c| *c >= 500));
    assert_eq!(
        env.backend.requests(),
        codes.iter().filter(|c| **c == 200).count()
    );
}

#[tokio::test]
async fn race_different_sessions_can_run_in_parallel() {
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(200));
    let mut sids = Vec::new();
    for _ in 0..6 {
        sids.push(env.create_session().await);
    }
    env.backend.reset_stats();
    let mut handles = Vec::new();
    for (i, sid) in sids.into_iter().enumerate() {
        let env = env.clone();
        handles.push(tokio::spawn(async move {
            env.post_chat(
                &sid,
                &json!({"messages": [{"role": "user", "content": format!("parallel-{i}")}]}),
            )
            .await
            .status
        }));
    }
    for h in handles {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert_eq!(env.backend.requests(), 6);
    assert!(env.backend.max_in_flight.load(Ordering::SeqCst) >= 3);
}

#[tokio::test]
async fn race_e2e_pressure_serial_per_session_parallel_globally() {
    let (sessions, turns) = (8, 3);
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(80));
    let mut sids = Vec::new();
    for _ in 0..sessions {
        sids.push(env.create_session().await);
    }
    env.backend.reset_stats();
    let mut handles = Vec::new();
    for (idx, sid) in sids.into_iter().enumerate() {
        let env = env.clone();
        handles.push(tokio::spawn(async move {
            let mut messages = vec![json!({"role": "user", "content": format!("session-{idx}-turn-0")})];
            for turn in 0..turns {
                let assistant = env.turn(&sid, Value::Array(messages.clone())).await;
                if turn < turns - 1 {
                    messages.push(assistant);
                    messages.push(json!({"role": "system", "content": format!("session-{idx}-continue-{turn}")}));
                }
            }
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
    assert_eq!(env.backend.requests(), sessions * turns);
    assert!(env.backend.max_in_flight.load(Ordering::SeqCst) >= 4);
}

#[tokio::test]
async fn race_delete_can_proceed_while_chat_is_mid_proxy() {
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(350));
    let sid = env.create_session().await;
    let payload = json!({"messages": [{"role": "user", "content": "slow-turn-0"}]});
    let inflight = {
        let (env, sid, payload) = (env.clone(), sid.clone(), payload.clone());
        tokio::spawn(async move { env.post_chat(&sid, &payload).await.status })
    };
    wait_for_backend(&env).await;
    let delete = env.delete(&sid).await;
    // Miles answers the in-flight chat 200 (unrecorded). Deliberate difference
    // (COMPATIBILITY.md "session concurrent turns"): a turn whose session is deleted during
    // the engine call is 404 here, so a 200 always means the turn was recorded.
    assert_eq!(inflight.await.unwrap(), 404);
    assert_eq!(delete.status, 204);
    assert_eq!(env.post_chat(&sid, &payload).await.status, 404);
}

#[tokio::test]
async fn race_chat_during_delete_returns_404() {
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(500));
    let sid = env.create_session().await;
    let payload = json!({"messages": [{"role": "user", "content": "slow-chat"}]});
    let chat_a = {
        let (env, sid, payload) = (env.clone(), sid.clone(), payload.clone());
        tokio::spawn(async move { env.post_chat(&sid, &payload).await.status })
    };
    wait_for_backend(&env).await;
    let delete = {
        let (env, sid) = (env.clone(), sid.clone());
        tokio::spawn(async move { env.delete(&sid).await.status })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let chat_b = env.post_chat(&sid, &payload).await;
    assert_eq!(chat_b.status, 404, "{}", chat_b.text());
    // Miles answers the in-flight chat 200 (unrecorded). Deliberate difference
    // (COMPATIBILITY.md "session concurrent turns"): a turn whose session is deleted during
    // the engine call is 404 here, so a 200 always means the turn was recorded.
    assert_eq!(chat_a.await.unwrap(), 404);
    assert_eq!(delete.await.unwrap(), 204);
}

#[tokio::test]
async fn race_double_delete_second_returns_404() {
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(300));
    let sid = env.create_session().await;
    let payload = json!({"messages": [{"role": "user", "content": "hold-lock"}]});
    let chat = {
        let (env, sid, payload) = (env.clone(), sid.clone(), payload.clone());
        tokio::spawn(async move { env.post_chat(&sid, &payload).await.status })
    };
    wait_for_backend(&env).await;
    let d1 = {
        let (env, sid) = (env.clone(), sid.clone());
        tokio::spawn(async move { env.delete(&sid).await.status })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let d2 = {
        let (env, sid) = (env.clone(), sid.clone());
        tokio::spawn(async move { env.delete(&sid).await.status })
    };
    // Miles answers the in-flight chat 200 (unrecorded). Deliberate difference
    // (COMPATIBILITY.md "session concurrent turns"): a turn whose session is deleted during
    // the engine call is 404 here, so a 200 always means the turn was recorded.
    assert_eq!(chat.await.unwrap(), 404);
    let mut codes = [d1.await.unwrap().as_u16(), d2.await.unwrap().as_u16()];
    codes.sort();
    assert_eq!(codes, [204, 404]);
}

#[tokio::test]
async fn race_chat_after_delete_returns_404() {
    let env = router_env().await;
    let sid = env.create_session().await;
    assert_eq!(env.delete(&sid).await.status, 204);
    let payload = json!({"messages": [{"role": "user", "content": "hello"}]});
    assert_eq!(env.post_chat(&sid, &payload).await.status, 404);
    assert_eq!(env.get(&sid).await.status, 404);
}

#[tokio::test]
async fn race_multiple_chats_queued_then_delete() {
    let env = Arc::new(router_env().await);
    env.backend.set_delay(Duration::from_millis(300));
    let sid = env.create_session().await;
    let payload = json!({"messages": [{"role": "user", "content": "queued"}]});
    let mut chats = Vec::new();
    for _ in 0..3 {
        let (env, sid, payload) = (env.clone(), sid.clone(), payload.clone());
        chats.push(tokio::spawn(async move {
            env.post_chat(&sid, &payload).await.status
        }));
    }
    wait_for_backend(&env).await;
    let delete = env.delete(&sid).await;
    let mut codes = Vec::new();
    for c in chats {
        codes.push(c.await.unwrap().as_u16());
    }
    assert_eq!(delete.status, 204);
    assert!(
        codes.iter().all(|c| [200, 404, 409].contains(c)),
        "{codes:?}"
    );
    // Miles: one of them is 200 (the one in flight). Here that one is 404 (deleted during
    // its engine call) and the others 409 (one turn at a time per session): deliberate,
    // COMPATIBILITY.md "session concurrent turns".
    assert_eq!(codes.iter().filter(|c| **c == 404).count(), 1, "{codes:?}");
}

#[tokio::test]
async fn race_rapid_create_chat_delete_cycles() {
    let env = Arc::new(router_env().await);
    let mut handles = Vec::new();
    for idx in 0..20 {
        let env = env.clone();
        handles.push(tokio::spawn(async move {
            let sid = env.create_session().await;
            let r = env
                .post_chat(
                    &sid,
                    &json!({"messages": [{"role": "user", "content": format!("cycle-{idx}")}]}),
                )
                .await;
            assert_eq!(r.status, 200);
            assert_eq!(env.delete(&sid).await.status, 204);
            assert_eq!(env.get(&sid).await.status, 404);
        }));
    }
    for h in handles {
        h.await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// test_session_samples_op.py: Miles plants records in its registry and runs the samples op;
// here the same records go through our assembly (what `/samples` runs), and the HTTP cases run
// over the server.

/// Miles' `NUM_LAYERS`, `TOPK`.
const NUM_LAYERS: usize = 3;
const TOPK: usize = 2;

/// Miles' `_r3_b64`: `np.arange(seed, seed + tokens·layers·topk, dtype=int32)`, base64.
fn r3_b64(num_tokens: usize, seed: i32) -> String {
    let data: Vec<i32> = (0..(num_tokens * NUM_LAYERS * TOPK) as i32)
        .map(|i| seed + i)
        .collect();
    miles_core::RoutedExperts::new(num_tokens, NUM_LAYERS, TOPK, data)
        .unwrap()
        .to_base64()
}

/// Miles' `_expected_r3`.
fn expected_r3(seed: i32, num_tokens: usize) -> Vec<i32> {
    (0..(num_tokens * NUM_LAYERS * TOPK) as i32)
        .map(|i| seed + i)
        .collect()
}

/// Miles' `_make_record` (the fields assembly reads; our records carry
/// `routed_experts_num_layers` beside the routes, COMPATIBILITY.md "session records").
fn make_record(
    prompt: &[TokenId],
    output: &[TokenId],
    log_probs: &[f64],
    cached_tokens: u64,
    weight_version: &str,
    routed_experts: String,
) -> SessionRecord {
    let logprobs: Vec<Value> = output
        .iter()
        .zip(log_probs)
        .map(|(id, lp)| json!([lp, id]))
        .collect();
    SessionRecord {
        timestamp: 0.0,
        request_timestamp: None,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        request: json!({"input_ids": prompt, "messages": [{"role": "user", "content": "hi"}]}),
        input_ids: None,
        response: json!({"choices": [{"message": {"role": "assistant", "content": "x"},
            "finish_reason": "stop", "meta_info": {"output_token_logprobs": logprobs,
            "completion_tokens": output.len(), "cached_tokens": cached_tokens,
            "prompt_tokens": prompt.len(), "weight_version": weight_version,
            "routed_experts": routed_experts, "routed_experts_num_layers": NUM_LAYERS}}]}),
        status_code: 200,
    }
}

fn two_turn_records() -> Vec<SessionRecord> {
    vec![
        make_record(
            &[1, 2, 3],
            &[10, 11],
            &[-0.125, -0.25],
            0,
            "w1",
            r3_b64(4, 0),
        ),
        make_record(
            &[1, 2, 3, 10, 11, 20, 21],
            &[30, 31],
            &[-0.5, -1.0],
            5,
            "w2",
            r3_b64(8, 100),
        ),
    ]
}

const ACCUMULATED: [TokenId; 9] = [1, 2, 3, 10, 11, 20, 21, 30, 31];

fn byte_decode(ids: &[TokenId]) -> String {
    ByteChatml::default().decode(ids)
}

#[test]
fn samples_op_assembled_sample_golden() {
    let samples = compute_samples_from_records(
        &Sample::default(),
        &two_turn_records(),
        Some(&ACCUMULATED),
        0,
        &byte_decode,
    )
    .unwrap();
    let m = merge_samples(samples, &byte_decode).unwrap();
    assert_eq!(m.tokens, ACCUMULATED);
    assert_eq!(
        m.response,
        byte_decode(&[10, 11]) + &byte_decode(&[20, 21]) + &byte_decode(&[30, 31])
    );
    assert_eq!(m.response_length, 6);
    assert_eq!(m.loss_mask, Some(vec![1, 1, 0, 0, 1, 1]));
    assert_eq!(
        m.rollout_log_probs,
        Some(vec![-0.125, -0.25, 0.0, 0.0, -0.5, -1.0])
    );
    assert_eq!(m.status, SampleStatus::Completed);
    assert_eq!(m.weight_versions, ["w1", "w2"]);
    assert_eq!(
        serde_json::to_value(m.prefix_cache_info).unwrap(),
        json!({"cached_tokens": 5, "total_prompt_tokens": 10})
    );
    let routes = m.rollout_routed_experts.as_ref().unwrap();
    assert_eq!(routes.shape(), [8, NUM_LAYERS, TOPK]);
    assert_eq!(routes.as_slice(), expected_r3(100, 8));
    assert_eq!(
        m.metadata["lifecycle"],
        json!([{"t0": null, "t1": 0.0, "turn": 1},
               {"t0": null, "t1": 0.0, "turn": 2, "prev_t1": 0.0}])
    );
}

#[test]
fn samples_op_truncation_golden() {
    let samples = compute_samples_from_records(
        &Sample::default(),
        &two_turn_records(),
        Some(&ACCUMULATED),
        0,
        &byte_decode,
    )
    .unwrap();
    let samples = truncate_samples_by_total_tokens(samples, 8, &byte_decode).unwrap();
    let last = samples.last().unwrap().clone();
    assert_eq!(last.status, SampleStatus::Truncated);
    let merged = merge_samples(samples, &byte_decode).unwrap();
    assert_eq!(merged.status, SampleStatus::Truncated);
    assert_eq!(merged.tokens, ACCUMULATED[..8]);
    assert_eq!(merged.loss_mask, Some(vec![1, 1, 0, 0, 1]));
    assert_eq!(
        merged.rollout_log_probs,
        Some(vec![-0.125, -0.25, 0.0, 0.0, -0.5])
    );
    let routes = merged.rollout_routed_experts.as_ref().unwrap();
    assert_eq!(routes.shape(), [7, NUM_LAYERS, TOPK]);
    assert_eq!(
        routes.as_slice(),
        &expected_r3(100, 8)[..7 * NUM_LAYERS * TOPK]
    );
    let turns: Vec<Value> = merged.metadata["lifecycle"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["turn"].clone())
        .collect();
    assert_eq!(turns, [json!(1), json!(2)]);
}

#[tokio::test]
async fn samples_op_debug_messages_cross_samples_wire() {
    // Miles sets `save_debug_trajectory_data`; the merged sample's `metadata.messages` is
    // the last record's request messages plus its answer.
    let env = router_env_with(SessionServerConfig {
        save_debug_trajectory_data: true,
        ..SessionServerConfig::default()
    })
    .await;
    let (sid, a1, a2) = env.two_turn_session().await;
    let r = env.samples(&sid, &json!({})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reply = decode_samples(&r.body, &Sample::default()).unwrap();
    let sample = &reply.samples[0];
    assert_eq!(sample.metadata["messages"], json!([u1(), a1, t1(), a2]));
}

#[tokio::test]
async fn samples_op_session_metadata_matches_get_session() {
    let env = router_env().await;
    let (sid, _, _) = env.two_turn_session().await;
    let r = env.samples(&sid, &json!({})).await;
    assert_eq!(r.status, 200);
    let reply = decode_samples(&r.body, &Sample::default()).unwrap();
    let session = env.session(&sid).await;
    assert_eq!(
        Value::Object(reply.session_metadata.clone()),
        session["metadata"]
    );
    assert!(
        !session["metadata"]["accumulated_token_ids"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn samples_op_no_records_reply() {
    let env = router_env().await;
    let sid = env.create_session().await;
    let r = env.samples(&sid, &json!({})).await;
    assert_eq!(r.status, 200);
    let reply = decode_samples(&r.body, &Sample::default()).unwrap();
    assert!(reply.samples.is_empty());
    assert_eq!(reply.empty_reason, Some(EmptyReason::NoRecords));
}

#[tokio::test]
async fn samples_op_all_truncated_reply() {
    let env = router_env().await;
    let sid = env.create_session().await;
    env.turn(&sid, json!([u1()])).await;
    let prompt_len = env.backend.last().input_ids.len();
    let r = env.samples(&sid, &json!({"max_seq_len": prompt_len})).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reply = decode_samples(&r.body, &Sample::default()).unwrap();
    assert!(reply.samples.is_empty());
    assert_eq!(reply.empty_reason, Some(EmptyReason::AllTruncated));
}

#[test]
fn samples_op_broken_chain_returns_422_and_server_survives() {
    // The records' outputs do not continue the accumulated ids: Miles' cursor assertion
    // (422 over HTTP; the assembly error here, mapped to 422 by `Error::status`).
    let broken: Vec<TokenId> = vec![1, 2, 3, 10, 99, 20, 21, 30, 31];
    let err = compute_samples_from_records(
        &Sample::default(),
        &two_turn_records(),
        Some(&broken),
        0,
        &byte_decode,
    )
    .unwrap_err();
    assert_eq!(err.status(), 422, "{err}");
}

#[tokio::test]
async fn samples_op_missing_session_returns_404() {
    let env = router_env().await;
    let r = env.samples("nonexistent", &json!({})).await;
    assert_eq!(r.status, 404);
}

// ---------------------------------------------------------------------------------------------
// test_session_message_matcher.py: the v1 cases not already in `message_matcher.rs`
// (TestV1ReplayMatching's other six are there), and TestRegistryOwnership.

#[test]
fn matcher_loose_matcher_does_not_bypass_appended_role_validation() {
    use miles_core::{Message, Role};
    use miles_session::trajectory::LinearTrajectory;
    use miles_tito::MessageMatcher;
    let message = |v: Value| -> Message { serde_json::from_value(v).unwrap() };
    let user = message(json!({"role": "user", "content": "q"}));
    let stored = message(
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call-A",
        "type": "function", "function": {"name": "lookup", "arguments": "{\"city\":\"Paris\",\"units\":\"metric\"}"}}]}),
    );
    let replayed = message(
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call-A",
        "type": "function", "function": {"name": "lookup", "arguments": "{\"units\": \"metric\", \"city\": \"Paris\"}"}}]}),
    );
    let tool = message(json!({"role": "tool", "content": "ok", "tool_call_id": "call-A"}));
    // Miles' `_ToolOnlyRecordingTITOTokenizer`: only `tool` may be appended.
    let tok = ByteChatml {
        allowed: vec![Role::Tool],
    };
    let kwargs = tok.resolve_kwargs(&Default::default()).unwrap();
    let mut trajectory = LinearTrajectory::new();
    let first = [user.clone()];
    let prepared = trajectory
        .prepare(&first, &[], &kwargs, &tok, MessageMatcher::Strict)
        .unwrap();
    let completion = tok.encode("<tool_call>lookup</tool_call><|im_end|>");
    trajectory
        .commit(
            &prepared,
            &first,
            &completion,
            stored,
            crate::common::empty_record(),
            0,
        )
        .unwrap();
    let request = [
        user,
        replayed,
        tool,
        message(json!({"role": "user", "content": "next"})),
    ];
    let err = trajectory
        .prepare(&request, &[], &kwargs, &tok, MessageMatcher::LooseToolCall)
        .unwrap_err();
    assert_eq!(err.status(), 400);
    assert!(
        err.to_string().contains("appended message at index 3"),
        "{err}"
    );
}

#[test]
fn matcher_registry_defaults_to_the_strict_matcher() {
    assert_eq!(
        SessionServerConfig::default().message_matcher,
        miles_tito::MessageMatcher::Strict
    );
}

#[tokio::test]
async fn matcher_registry_holds_the_injected_matcher() {
    // The configured matcher is the one the server's rollback detection uses: a replay with
    // re-serialised tool-call arguments keeps the checkpoint under `loose_tool_call` (2
    // records) and rolls back under `strict` (1 record).
    for (matcher, records) in [
        (miles_tito::MessageMatcher::LooseToolCall, 2),
        (miles_tito::MessageMatcher::Strict, 1),
    ] {
        let env = router_env_with(SessionServerConfig {
            message_matcher: matcher,
            ..SessionServerConfig::default()
        })
        .await;
        env.backend.set_reply(Arc::new(|prompt: &str| {
            Ok(if prompt.contains("<tool_response>") {
                "done".into()
            } else {
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"units\": \"metric\"}}\n</tool_call>".into()
            })
        }));
        let sid = env.create_session().await;
        let tools = json!([two_tools()[0]]);
        let a1 = env.turn(&sid, json!([u1()])).await;
        let mut replayed = a1.clone();
        replayed["tool_calls"][0]["function"]["arguments"] =
            json!("{\"units\": \"metric\", \"city\": \"Paris\"}");
        let tool =
            json!({"role": "tool", "content": "ok", "tool_call_id": a1["tool_calls"][0]["id"]});
        let r = env
            .post_chat(
                &sid,
                &json!({"messages": [u1(), replayed, tool], "tools": tools}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(env.records(&sid).await.len(), records, "{matcher:?}");
    }
}
