//! Hostile input and faults against a real session server on loopback (served by
//! `guard::serve`, the binary's accept loop): every bad request gets a typed OpenAI-shaped
//! JSON error, and the server still serves a normal turn afterwards.

#[path = "it/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{ByteChatml, ToyEngine, WeatherAgent};
use hyper::Method;
use miles_core::{Prompt, Sample, SampleStatus, SamplingParams};
use miles_session::agent::{AgentDriverConfig, generate};
use miles_session::guard::{self, ApiKey, GuardConfig};
use miles_session::http::{HttpClient, HttpResponse};
use miles_session::openai::RequestLimits;
use miles_session::server::{SessionServer, SessionServerConfig};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;

struct Harness {
    base: String,
    addr: std::net::SocketAddr,
    http: HttpClient,
    engine: Arc<ToyEngine>,
    server: SessionServer,
}

async fn start(config: SessionServerConfig) -> Harness {
    let engine = ToyEngine::new();
    let server = SessionServer::new(engine.clone(), Arc::new(ByteChatml::default()), config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = server_guard(&server);
    tokio::spawn(guard::serve(listener, server.router(), guard));
    let key = server_key(&server);
    Harness {
        base: format!("http://{addr}"),
        addr,
        http: HttpClient::new(Duration::from_secs(20)).with_api_key(key.as_ref()),
        engine,
        server,
    }
}

// The tests keep their guard settings in the server config; the accept loop uses the same.
thread_local! {
    static GUARD: std::cell::RefCell<Option<GuardConfig>> = const { std::cell::RefCell::new(None) };
}

fn server_guard(_server: &SessionServer) -> GuardConfig {
    GUARD.with(|g| g.borrow().clone()).unwrap_or_default()
}

fn server_key(_server: &SessionServer) -> Option<ApiKey> {
    GUARD.with(|g| g.borrow().as_ref().and_then(|c| c.api_key.clone()))
}

async fn start_guarded(mut config: SessionServerConfig, guard: GuardConfig) -> Harness {
    config.guard = guard.clone();
    GUARD.with(|g| *g.borrow_mut() = Some(guard));
    let h = start(config).await;
    GUARD.with(|g| *g.borrow_mut() = None);
    h
}

fn user(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": text}]})
}

impl Harness {
    async fn create(&self) -> String {
        let r = self
            .http
            .post_json(&format!("{}/sessions", self.base), &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json::<Value>().unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned()
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

    /// A fresh session, a normal turn: 200 with the toy engine's echo, recorded.
    async fn assert_alive(&self) {
        let health = self
            .http
            .get(&format!("{}/health", self.base))
            .await
            .unwrap();
        assert_eq!(health.status, 200);
        let id = self.create().await;
        let r = self.chat(&id, &user("still there?")).await;
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = r.json().unwrap();
        assert_eq!(
            v["choices"][0]["message"]["content"],
            "You said: still there?"
        );
        let s: Value = self
            .http
            .get(&format!("{}/sessions/{id}", self.base))
            .await
            .unwrap()
            .json()
            .unwrap();
        assert_eq!(s["records"].as_array().unwrap().len(), 1);
    }
}

/// Asserts an OpenAI-shaped JSON error with this status, type and code; returns the message.
#[track_caller]
fn assert_error(r: &HttpResponse, status: u16, kind: &str, code: &str) -> String {
    assert_eq!(r.status.as_u16(), status, "body: {}", r.text());
    assert!(
        r.headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json")),
        "{:?}",
        r.headers
    );
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    v["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn request_limits_reject_with_typed_json_errors() {
    let config = SessionServerConfig {
        max_context_len: Some(4096),
        max_body_bytes: 64 << 10,
        limits: RequestLimits::default().with_max_n(8),
        ..SessionServerConfig::default()
    };
    let h = start(config).await;
    let id = h.create().await;
    let with = |extra: Value| {
        let mut body = user("hi");
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"n": 9}), "limit_exceeded", "n = 9 is outside 1..=8"),
        (json!({"n": 0}), "limit_exceeded", "n = 0"),
        (json!({"n": 2}), "invalid_body", "only n=1"),
        (json!({"n": 1e30}), "invalid_body", "invalid type"),
        (json!({"max_tokens": -1}), "invalid_body", "invalid value"),
        (
            json!({"min_tokens": 10, "max_tokens": 5}),
            "limit_exceeded",
            "min_tokens = 10 is over max_tokens = 5",
        ),
        (
            json!({"min_tokens": 5000}),
            "message_validation",
            "min_tokens = 5000 can never fit",
        ),
        (
            json!({"stop": vec!["x"; 65]}),
            "limit_exceeded",
            "65 stop strings",
        ),
        (
            json!({"stop": "y".repeat(5000)}),
            "limit_exceeded",
            "stop string of 5000 bytes",
        ),
        (json!({"stop": [""]}), "limit_exceeded", "empty stop string"),
        (
            json!({"stop_token_ids": vec![1; 1025]}),
            "limit_exceeded",
            "1025 stop_token_ids",
        ),
        (
            json!({"temperature": -0.5}),
            "limit_exceeded",
            "temperature",
        ),
        (json!({"top_p": 0.0}), "limit_exceeded", "top_p"),
        (json!({"top_k": 0}), "limit_exceeded", "top_k = 0"),
        (json!({"min_p": 2.0}), "limit_exceeded", "min_p"),
        (
            json!({"presence_penalty": 3.0}),
            "limit_exceeded",
            "presence_penalty",
        ),
    ];
    for (extra, code, needle) in cases {
        let r = h.chat(&id, &with(extra.clone())).await;
        let message = assert_error(&r, 400, "invalid_request_error", code);
        assert!(message.contains(needle), "{extra}: {message}");
    }
    // A huge max_tokens is capped to the context left, without wrap-around.
    let r = h.chat(&id, &with(json!({"max_tokens": u64::MAX}))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = h.engine.last_request.lock().unwrap().clone().unwrap();
    let prompt_len = seen.input_ids.len();
    assert_eq!(seen.sampling_params.max_new_tokens, Some(4096 - prompt_len));
    // A prompt over the context is rejected up front; the engine never sees it.
    let calls = h.engine.calls.load(Ordering::SeqCst);
    let id2 = h.create().await;
    let r = h.chat(&id2, &user(&"z".repeat(5000))).await;
    let message = assert_error(&r, 400, "invalid_request_error", "message_validation");
    assert!(
        message.contains("at or over the context length 4096"),
        "{message}"
    );
    assert_eq!(h.engine.calls.load(Ordering::SeqCst), calls);
    // A body over --max-request-bytes: 413, from Content-Length, before it is read.
    let r = h.chat(&id2, &user(&"w".repeat(70 << 10))).await;
    let message = assert_error(&r, 413, "invalid_request_error", "body_too_large");
    assert!(message.contains("65536"), "{message}");
    // Nothing above was recorded.
    let s: Value = h
        .http
        .get(&format!("{}/sessions/{id2}", h.base))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(s["records"], json!([]));
    let metrics = h
        .http
        .get(&format!("{}/metrics", h.base))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("miles_session_errors_total{label=\"limit_exceeded\"} 12\n"),
        "{metrics}"
    );
    h.assert_alive().await;
}

#[tokio::test]
async fn chunked_body_over_the_limit_is_413_while_reading() {
    let config = SessionServerConfig {
        max_body_bytes: 1000,
        ..SessionServerConfig::default()
    };
    let h = start(config).await;
    let id = h.create().await;
    let mut raw = format!(
        "POST /sessions/{id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    );
    for _ in 0..4 {
        let chunk = "a".repeat(400);
        raw.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    raw.push_str("0\r\n\r\n");
    let response = exchange(h.addr, raw.into_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(
        response.contains("\"code\":\"body_too_large\""),
        "{response}"
    );
    h.assert_alive().await;
}

/// Sends raw bytes on a new connection (blocking sockets, on the blocking pool) and returns
/// what the server answers (until it closes, a whole response arrived, or 3 s passed).
async fn exchange(addr: std::net::SocketAddr, bytes: Vec<u8>) -> String {
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        let _ = stream.write_all(&bytes);
        read_response(&mut stream)
    })
    .await
    .unwrap()
}

/// Reads what the server sends until it closes, a whole response arrived, or 3 s pass.
fn read_response(stream: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf);
                // One complete JSON response is enough.
                if let Some((head, body)) = text.split_once("\r\n\r\n")
                    && let Some(len) = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_owned)
                        })
                        .and_then(|v| v.trim().parse::<usize>().ok())
                    && body.len() >= len
                {
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test]
async fn api_key_guards_every_route_but_health() {
    let key = ApiKey::new("s3cret-key").unwrap();
    let guard = GuardConfig::default().with_api_key(Some(key.clone()));
    let h = start_guarded(SessionServerConfig::default(), guard).await;
    let anon = HttpClient::new(Duration::from_secs(10));
    // /health is open.
    assert_eq!(
        anon.get(&format!("{}/health", h.base))
            .await
            .unwrap()
            .status,
        200
    );
    // Everything else needs the key.
    let id = h.create().await;
    let attempts = [
        (Method::GET, format!("{}/metrics", h.base)),
        (Method::POST, format!("{}/sessions", h.base)),
        (Method::GET, format!("{}/sessions/{id}", h.base)),
        (Method::DELETE, format!("{}/sessions/{id}", h.base)),
        (
            Method::POST,
            format!("{}/sessions/{id}/v1/chat/completions", h.base),
        ),
        (Method::POST, format!("{}/sessions/{id}/samples", h.base)),
        (Method::GET, format!("{}/no/such/route", h.base)),
    ];
    let wrong = [
        vec![],
        vec![("authorization", "Bearer wrong-key!")],
        vec![("authorization", "Bearer s3cret-ke")],
        vec![("authorization", "Bearer s3cret-keyy")],
        vec![("authorization", "Basic s3cret-key")],
        vec![("authorization", "s3cret-key")],
    ];
    for (method, url) in &attempts {
        for headers in &wrong {
            let body = (*method == Method::POST)
                .then(|| ("application/json", serde_json::to_vec(&user("hi")).unwrap()));
            let r = anon.send(method.clone(), url, headers, body).await.unwrap();
            let message = assert_error(&r, 401, "authentication_error", "unauthorized");
            assert!(message.contains("Bearer"), "{message}");
            assert_eq!(r.headers["www-authenticate"], "Bearer");
        }
    }
    // The session was neither deleted nor changed by the refused calls.
    let s: Value = h
        .http
        .get(&format!("{}/sessions/{id}", h.base))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(s["records"], json!([]));
    // The scheme is case-insensitive, as in SGLang.
    let r = anon
        .send(
            Method::GET,
            &format!("{}/sessions/{id}", h.base),
            &[("authorization", "bearer s3cret-key")],
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let metrics = h
        .http
        .get(&format!("{}/metrics", h.base))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("miles_session_errors_total{label=\"unauthorized\"} 42\n"),
        "{metrics}"
    );
    h.assert_alive().await;
}

#[tokio::test]
async fn post_bodies_must_be_json() {
    let h = start(SessionServerConfig::default()).await;
    let id = h.create().await;
    let url = format!("{}/sessions/{id}/v1/chat/completions", h.base);
    let body = serde_json::to_vec(&user("hi")).unwrap();
    for content_type in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let r = h
            .http
            .send(Method::POST, &url, &[], Some((content_type, body.clone())))
            .await
            .unwrap();
        let message = assert_error(&r, 415, "invalid_request_error", "unsupported_media_type");
        assert!(
            message.contains(content_type.split(';').next().unwrap()),
            "{message}"
        );
    }
    // A body without any content type is JSON, as FastAPI reads it (Miles' own `/samples`
    // tests send exactly that).
    let mut raw = format!(
        "POST /sessions/{id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend_from_slice(&body);
    let response = exchange(h.addr, raw).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    // `application/json; charset=utf-8` is JSON.
    let r = h
        .http
        .send(
            Method::POST,
            &url,
            &[],
            Some(("application/json; charset=utf-8", body)),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // An empty POST /sessions needs no content type.
    let r = h
        .http
        .send(Method::POST, &format!("{}/sessions", h.base), &[], None)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    h.assert_alive().await;
}

#[tokio::test]
async fn agent_driver_and_sglang_client_send_the_key() {
    let key = ApiKey::new("agent-key").unwrap();
    let guard = GuardConfig::default().with_api_key(Some(key.clone()));
    let h = start_guarded(SessionServerConfig::default(), guard).await;
    let sample = Sample::builder(Prompt::Messages(vec![miles_core::Message::user(
        "What is the weather in Lyon?",
    )]))
    .build()
    .unwrap();
    let params = SamplingParams {
        max_new_tokens: Some(200),
        ..SamplingParams::default()
    };
    let agent = WeatherAgent {
        fail_after_first_turn: false,
    };
    let anon = HttpClient::new(Duration::from_secs(10));
    let with_key = AgentDriverConfig::new(&h.base).with_api_key(Some(key.clone()));
    let out = generate(&agent, &sample, &params, &with_key, &anon).await;
    assert_eq!(out.status, SampleStatus::Completed, "{:?}", out.metadata);
    assert!(out.response_length > 0);
    let without = AgentDriverConfig::new(&h.base);
    let out = generate(&agent, &sample, &params, &without, &anon).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert_eq!(
        out.metadata["failure_kind"],
        serde_json::json!("session_create")
    );
    assert!(
        out.metadata["failure"].as_str().unwrap().contains("401"),
        "{:?}",
        out.metadata
    );
    assert_eq!(
        h.server.sessions_open(),
        0,
        "the driver deleted its session"
    );

    // The SGLang client against an engine guarded by the same module.
    use miles_core::{EngineErrorKind, InferenceEngine};
    let engine_app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/flush_cache",
            axum::routing::get(|| async { axum::Json(json!({"success": true})) }),
        );
    let engine_app = guard::harden(
        engine_app,
        &GuardConfig::default().with_api_key(Some(ApiKey::new("engine-key").unwrap())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(guard::serve(listener, engine_app, GuardConfig::default()));
    let keyed = miles_session::sglang::SglangEngine::new(
        miles_session::sglang::SglangConfig::new(&url)
            .with_api_key(Some(ApiKey::new("engine-key").unwrap())),
    );
    keyed.flush_cache().await.unwrap();
    keyed.health().await.unwrap();
    let bare =
        miles_session::sglang::SglangEngine::new(miles_session::sglang::SglangConfig::new(&url));
    bare.health().await.unwrap();
    let err = bare.flush_cache().await.unwrap_err();
    assert!(
        matches!(&err, miles_core::Error::Engine { kind: EngineErrorKind::Internal, message } if message.contains("401")),
        "{err:?}"
    );
    h.assert_alive().await;
}

#[tokio::test]
async fn session_cap_and_idle_expiry() {
    let config = SessionServerConfig {
        max_sessions: Some(3),
        session_idle_timeout: Some(Duration::from_millis(400)),
        ..SessionServerConfig::default()
    };
    let h = start(config).await;
    let ids = [h.create().await, h.create().await, h.create().await];
    let r = h
        .http
        .post_json(&format!("{}/sessions", h.base), &json!({}), &[])
        .await
        .unwrap();
    let message = assert_error(&r, 429, "invalid_request_error", "too_many_sessions");
    assert!(message.contains("limit 3"), "{message}");
    assert_eq!(r.headers["retry-after"], "1");
    // Deleting one frees a slot.
    let r = h
        .http
        .send(
            Method::DELETE,
            &format!("{}/sessions/{}", h.base, ids[0]),
            &[],
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 204);
    let fresh = h.create().await;
    // Keep `fresh` busy with requests; the others go idle and expire.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let r = h
            .http
            .get(&format!("{}/sessions/{fresh}", h.base))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    }
    for id in &ids[1..] {
        let r = h
            .http
            .get(&format!("{}/sessions/{id}", h.base))
            .await
            .unwrap();
        assert_error(&r, 404, "invalid_request_error", "session_not_found");
    }
    assert_eq!(h.server.sessions_open(), 1);
    let metrics = h
        .http
        .get(&format!("{}/metrics", h.base))
        .await
        .unwrap()
        .text();
    assert!(
        metrics.contains("miles_session_sessions_expired_total 2\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("miles_session_sessions_open 1\n"),
        "{metrics}"
    );
    h.assert_alive().await;
}

#[tokio::test]
async fn per_session_record_and_token_caps() {
    let config = SessionServerConfig {
        max_records_per_session: Some(2),
        max_tokens_per_session: Some(400),
        ..SessionServerConfig::default()
    };
    let h = start(config).await;
    let id = h.create().await;
    let mut messages = vec![json!({"role": "user", "content": "one"})];
    for turn in 0..2 {
        let r = h.chat(&id, &json!({"messages": messages})).await;
        assert_eq!(r.status, 200, "turn {turn}: {}", r.text());
        let v: Value = r.json().unwrap();
        messages.push(v["choices"][0]["message"].clone());
        messages.push(json!({"role": "user", "content": "more"}));
    }
    let r = h.chat(&id, &json!({"messages": messages})).await;
    let message = assert_error(&r, 400, "invalid_request_error", "session_limit");
    assert!(message.contains("2 records"), "{message}");
    // The token cap: a prompt of 500 byte tokens is over 400.
    let id2 = h.create().await;
    let r = h.chat(&id2, &user(&"t".repeat(500))).await;
    let message = assert_error(&r, 400, "invalid_request_error", "message_validation");
    assert!(
        message.contains("the session's token limit 400"),
        "{message}"
    );
    // Under the cap, max_new_tokens is capped to the room left.
    let r = h.chat(&id2, &user("short")).await;
    assert_eq!(r.status, 200);
    let seen = h.engine.last_request.lock().unwrap().clone().unwrap();
    assert_eq!(
        seen.sampling_params.max_new_tokens,
        Some(400 - seen.input_ids.len())
    );
    h.assert_alive().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_turns_on_one_session_are_refused_never_silently_dropped() {
    let h = Arc::new(start(SessionServerConfig::default()).await);
    *h.engine.delay.lock().unwrap() = Some(Duration::from_millis(300));
    let id = h.create().await;
    let before = h.server.metrics().turns.load(Ordering::SeqCst);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (h, id) = (h.clone(), id.clone());
        tasks.push(tokio::spawn(async move {
            let r = h.chat(&id, &user(&format!("race {i}"))).await;
            (r.status.as_u16(), r)
        }));
    }
    let (mut ok, mut busy) = (Vec::new(), 0);
    for t in tasks {
        let (status, r) = t.await.unwrap();
        match status {
            200 => ok.push(r.json::<Value>().unwrap()),
            409 => {
                let message = assert_error(&r, 409, "invalid_request_error", "session_busy");
                assert!(message.contains("one at a time"), "{message}");
                busy += 1;
            }
            other => panic!("status {other}: {}", r.text()),
        }
    }
    assert!(busy >= 1, "the turns overlapped, some must be refused");
    let m = h.server.metrics();
    // Every 200 was committed (each later one rolling the earlier first turn back), none skipped.
    assert_eq!(m.turns.load(Ordering::SeqCst) - before, ok.len() as u64);
    assert_eq!(m.turns_skipped.load(Ordering::SeqCst), 0);
    let s: Value = h
        .http
        .get(&format!("{}/sessions/{id}", h.base))
        .await
        .unwrap()
        .json()
        .unwrap();
    let records = s["records"].as_array().unwrap();
    assert_eq!(records.len(), 1);
    let recorded_id = &records[0]["response"]["id"];
    assert!(ok.iter().any(|v| &v["id"] == recorded_id));

    // A turn whose session is deleted during the engine call is answered 404, not 200.
    let id = h.create().await;
    let turn = {
        let (h, id) = (h.clone(), id.clone());
        tokio::spawn(async move { h.chat(&id, &user("doomed")).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = h
        .http
        .send(
            Method::DELETE,
            &format!("{}/sessions/{id}", h.base),
            &[],
            None,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 204);
    let r = turn.await.unwrap();
    assert_error(&r, 404, "invalid_request_error", "session_not_found");
    assert_eq!(m.turns_skipped.load(Ordering::SeqCst), 1);
    *h.engine.delay.lock().unwrap() = None;
    h.assert_alive().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_clients_cannot_starve_health() {
    let guard = GuardConfig::default()
        .with_header_read_timeout(Some(Duration::from_millis(500)))
        .with_body_timeout(Some(Duration::from_millis(500)))
        .with_max_connections(Some(8));
    let h = start_guarded(SessionServerConfig::default(), guard).await;
    // 20 clients each send half a request head and stall: more than the connection limit.
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut s = TcpStream::connect(h.addr).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .unwrap();
        slow.push(s);
    }
    let started = Instant::now();
    let fresh = HttpClient::new(Duration::from_secs(5));
    let r = fresh.get(&format!("{}/health", h.base)).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "health took {:?}",
        started.elapsed()
    );
    // The stalled connections are closed by the server, not left open.
    let closed = tokio::task::spawn_blocking(move || {
        slow.iter_mut()
            .take(8)
            .map(|s| {
                s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
                let mut buf = Vec::new();
                // EOF (Ok) or a reset; a timeout means the connection stayed open.
                match s.read_to_end(&mut buf) {
                    Ok(_) => true,
                    Err(e) => !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                }
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    assert_eq!(closed, vec![true; 8], "stalled connections must be closed");
    // A slow body: the head arrives, the body never completes → 408 JSON.
    let id = h.create().await;
    let head = format!(
        "POST /sessions/{id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"messages\""
    );
    let response = exchange(h.addr, head.into_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert!(
        response.contains("\"code\":\"request_timeout\""),
        "{response}"
    );
    h.assert_alive().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrency_limit_and_request_timeout() {
    let guard = GuardConfig::default()
        .with_max_concurrent_requests(Some(2))
        .with_request_timeout(Some(Duration::from_secs(3)));
    let h = Arc::new(start_guarded(SessionServerConfig::default(), guard).await);
    let ids = [
        h.create().await,
        h.create().await,
        h.create().await,
        h.create().await,
    ];
    *h.engine.delay.lock().unwrap() = Some(Duration::from_secs(1));
    let mut tasks = Vec::new();
    for id in ids.clone() {
        let h = h.clone();
        tasks.push(tokio::spawn(
            async move { h.chat(&id, &user("busy?")).await },
        ));
    }
    // /health is outside the limit.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let health = h.http.get(&format!("{}/health", h.base)).await.unwrap();
    assert_eq!(health.status, 200);
    let (mut ok, mut overloaded) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            200 => ok += 1,
            503 => {
                assert_error(&r, 503, "server_error", "overloaded");
                assert_eq!(r.headers["retry-after"], "1");
                overloaded += 1;
            }
            other => panic!("status {other}: {}", r.text()),
        }
    }
    assert_eq!(ok, 2);
    assert_eq!(overloaded, 2);
    // A handler slower than the request timeout: 504, and the turn is not recorded.
    *h.engine.delay.lock().unwrap() = Some(Duration::from_secs(5));
    let slow = h.create().await;
    let r = h.chat(&slow, &user("too slow")).await;
    let message = assert_error(&r, 504, "server_error", "timeout");
    assert!(message.contains("timed out after 3 s"), "{message}");
    let s: Value = h
        .http
        .get(&format!("{}/sessions/{slow}", h.base))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(s["records"], json!([]));
    *h.engine.delay.lock().unwrap() = None;
    h.assert_alive().await;
}

#[tokio::test]
async fn hostile_chat_template_is_a_typed_500_with_the_reason() {
    use miles_session::testkit::InstantEngine;
    use miles_tito::ChatTokenizer;
    let fixture =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let dir = std::env::temp_dir().join(format!("miles-session-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(file), dir.join(file)).unwrap();
    }
    let original = std::fs::read_to_string(fixture.join("chat_template.jinja")).unwrap();
    // The real template, except for a conversation whose last message is "go": then it loops.
    let hostile = format!(
        "{{% if messages[-1].content == 'go' %}}{{% for a in range(100000) %}}{{% for b in range(100000) %}}{{% endfor %}}{{% endfor %}}{{% else %}}{original}{{% endif %}}"
    );
    std::fs::write(dir.join("chat_template.jinja"), hostile).unwrap();
    let tok: Arc<dyn ChatTokenizer> =
        Arc::new(miles_tito::TitoChat::load(&dir, "default").unwrap());
    // Engine ids outside the vocabulary decode and parse without a panic.
    let hostile_ids = [4_000_000_000u32, u32::MAX, 0, 151_645];
    let _ = tok.decode(&hostile_ids);
    let _ = tok.decode_token(u32::MAX);
    let _ = tok.is_special(u32::MAX);
    let _ = tok.parse_assistant(&hostile_ids, &[]);
    let _ = tok.compare_sequences(&hostile_ids, &hostile_ids[1..]);
    let engine = InstantEngine::for_chatml(tok.as_ref()).unwrap();
    let server = SessionServer::new(engine, tok, SessionServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(guard::serve(
        listener,
        server.router(),
        GuardConfig::default(),
    ));
    let http = HttpClient::new(Duration::from_secs(60));
    let create = || async {
        let r = http
            .post_json(&format!("{base}/sessions"), &json!({}), &[])
            .await
            .unwrap();
        r.json::<Value>().unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let id = create().await;
    let url = format!("{base}/sessions/{id}/v1/chat/completions");
    let started = Instant::now();
    let r = http.post_json(&url, &user("go"), &[]).await.unwrap();
    let message = assert_error(&r, 500, "server_error", "tokenization");
    assert!(
        message.contains("chat template exceeded its fuel limit"),
        "{message}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    // The same server still serves a normal conversation with the same template.
    let id = create().await;
    let url = format!("{base}/sessions/{id}/v1/chat/completions");
    let r = http.post_json(&url, &user("hello"), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    std::fs::remove_dir_all(&dir).ok();
}

/// A raw answer: status, content type, body.
type Reply = (u16, &'static str, Vec<u8>);

/// A hostile SGLang `/generate`: answers with whatever body the test sets.
struct HostileEngine {
    /// `None`: a well-formed answer for the request.
    reply: std::sync::Mutex<Option<Reply>>,
}

async fn hostile_generate(
    axum::extract::State(fake): axum::extract::State<Arc<HostileEngine>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if let Some((status, content_type, bytes)) = fake.reply.lock().unwrap().clone() {
        return (
            axum::http::StatusCode::from_u16(status).unwrap(),
            [("content-type", content_type)],
            bytes,
        )
            .into_response();
    }
    let request: Value = serde_json::from_slice(&body).unwrap();
    let prompt = request["input_ids"].as_array().unwrap().len();
    axum::Json(json!({
        "text": "ok",
        "output_ids": [111, 107, common::IM_END],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": common::IM_END},
            "prompt_tokens": prompt,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5, 111, null], [-0.25, 107, null], [-0.125, common::IM_END, null]],
        }
    }))
    .into_response()
}

fn meta(extra: Value) -> Value {
    let mut meta = json!({
        "finish_reason": {"type": "stop"},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, 5, null], [-0.25, 6, null]],
    });
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            meta.as_object_mut().unwrap().remove(k);
        } else {
            meta[k] = v.clone();
        }
    }
    json!({"text": "", "meta_info": meta})
}

#[tokio::test]
async fn hostile_engine_answers_are_typed_engine_errors() {
    use miles_core::{EngineErrorKind, GenerateRequest, InferenceEngine};
    let fake = Arc::new(HostileEngine {
        reply: std::sync::Mutex::new(None),
    });
    let app = axum::Router::new()
        .route("/generate", axum::routing::post(hostile_generate))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let mut config = miles_session::sglang::SglangConfig::new(&url);
    config.num_layers = Some(2);
    config.max_response_bytes = 1 << 20;
    let client = miles_session::sglang::SglangEngine::new(config);
    let request = || {
        let mut r = GenerateRequest::new(
            vec![1, 2, 3],
            SamplingParams {
                max_new_tokens: Some(16),
                ..SamplingParams::default()
            },
        );
        r.return_routed_experts = true;
        r
    };
    let json_body = |v: Value| (200u16, "application/json", serde_json::to_vec(&v).unwrap());
    let raw = |s: &str| (200u16, "application/json", s.as_bytes().to_vec());
    let big = "A".repeat(200_000);
    let cases: Vec<(Reply, EngineErrorKind, &str)> = vec![
        (
            json_body(json!({"text": "x"})),
            EngineErrorKind::Protocol,
            "missing field `meta_info`",
        ),
        (
            json_body(json!({"meta_info": 5})),
            EngineErrorKind::Protocol,
            "expected struct MetaInfo",
        ),
        (
            json_body(meta(json!({"finish_reason": null}))),
            EngineErrorKind::Protocol,
            "no finish_reason",
        ),
        (
            json_body(meta(json!({"finish_reason": {"type": "explode"}}))),
            EngineErrorKind::Protocol,
            "unknown finish_reason",
        ),
        (
            json_body(meta(json!({"completion_tokens": u64::MAX}))),
            EngineErrorKind::Protocol,
            "completion_tokens = 18446744073709551615",
        ),
        (
            json_body(meta(json!({"completion_tokens": 1e300}))),
            EngineErrorKind::Protocol,
            "expected u64",
        ),
        (
            json_body(meta(json!({"completion_tokens": 17}))),
            EngineErrorKind::Protocol,
            "over the requested max_new_tokens",
        ),
        (
            json_body(meta(json!({"completion_tokens": 3}))),
            EngineErrorKind::Protocol,
            "2 output_token_logprobs for completion_tokens = 3",
        ),
        (
            json_body(meta(json!({"completion_tokens": null}))),
            EngineErrorKind::Protocol,
            "no completion_tokens",
        ),
        (
            json_body(meta(
                json!({"output_token_logprobs": [[1e308, 5, null], [-0.25, 6, null]]}),
            )),
            EngineErrorKind::Protocol,
            "not a log-probability",
        ),
        (
            json_body(meta(
                json!({"output_token_logprobs": [["NaN", 5, null], [-0.25, 6, null]]}),
            )),
            EngineErrorKind::Protocol,
            "is not [logprob, token_id, text]",
        ),
        (
            raw(
                r#"{"meta_info": {"finish_reason": "stop", "completion_tokens": 1, "output_token_logprobs": [[NaN, 5, null]]}}"#,
            ),
            EngineErrorKind::Protocol,
            "non-JSON",
        ),
        (
            json_body(meta(
                json!({"output_token_logprobs": [[-0.5, 1u64 << 40, null], [-0.25, 6, null]]}),
            )),
            EngineErrorKind::Protocol,
            "is not [logprob, token_id, text]",
        ),
        (
            json_body(meta(
                json!({"output_token_logprobs": [[-0.5, -1, null], [-0.25, 6, null]]}),
            )),
            EngineErrorKind::Protocol,
            "is not [logprob, token_id, text]",
        ),
        (
            json_body(meta(
                json!({"output_token_logprobs": [[-0.5], [-0.25, 6, null]]}),
            )),
            EngineErrorKind::Protocol,
            "is not [logprob, token_id, text]",
        ),
        (
            json_body(meta(json!({"output_token_logprobs": null}))),
            EngineErrorKind::Protocol,
            "no output_token_logprobs",
        ),
        (
            json_body(meta(json!({"prompt_tokens": u64::MAX}))),
            EngineErrorKind::Protocol,
            "prompt_tokens = 18446744073709551615 for 3 input ids",
        ),
        (
            json_body(meta(json!({"prompt_tokens": 99}))),
            EngineErrorKind::Protocol,
            "prompt_tokens = 99",
        ),
        (
            json_body(meta(json!({"cached_tokens": 1000}))),
            EngineErrorKind::Protocol,
            "cached_tokens = 1000",
        ),
        (
            json_body(meta(json!({"routed_experts": big}))),
            EngineErrorKind::Protocol,
            "more than 4 rows",
        ),
        (
            json_body(meta(json!({"routed_experts": "!!!!"}))),
            EngineErrorKind::Protocol,
            "base64",
        ),
        (
            json_body(meta(json!({"routed_experts": "AAAAAAA="}))),
            EngineErrorKind::Protocol,
            "not a whole number of int32",
        ),
        (
            json_body(meta(json!({"routed_experts": "AAAAAAAAAAAAAAAA"}))),
            EngineErrorKind::Protocol,
            "split into",
        ),
        (
            json_body(meta(json!({"weight_version": "abc"}))),
            EngineErrorKind::Protocol,
            "abc",
        ),
        (
            raw(&"[".repeat(100_000)),
            EngineErrorKind::Protocol,
            "non-JSON",
        ),
        (raw(""), EngineErrorKind::Protocol, "non-JSON"),
        (
            (200, "text/html", b"<html>gateway</html>".to_vec()),
            EngineErrorKind::Protocol,
            "non-JSON",
        ),
        (
            (200, "application/json", vec![b' '; 2 << 20]),
            EngineErrorKind::Unavailable,
            "over the limit of 1048576 bytes",
        ),
        (
            (500, "text/plain", vec![b'x'; 100_000]),
            EngineErrorKind::Internal,
            "500",
        ),
        (
            (
                503,
                "application/json",
                br#"{"error": {"message": "overloaded"}}"#.to_vec(),
            ),
            EngineErrorKind::Unavailable,
            "overloaded",
        ),
    ];
    let count = cases.len();
    for (reply, kind, needle) in cases {
        *fake.reply.lock().unwrap() = Some(reply);
        let err = client.generate(request()).await.unwrap_err();
        match &err {
            miles_core::Error::Engine { kind: k, message } => {
                assert_eq!(*k, kind, "{message}");
                assert!(message.contains(needle), "wanted {needle:?} in {message}");
                assert!(
                    message.len() < 2000,
                    "error messages stay short: {} bytes",
                    message.len()
                );
            }
            other => panic!("not an engine error: {other:?}"),
        }
    }
    assert_eq!(count, 30);
    // A well-formed answer still parses (and its routes check out).
    let routes = miles_core::RoutedExperts::new(4, 2, 1, vec![0, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    *fake.reply.lock().unwrap() = Some(json_body(meta(
        json!({"routed_experts": routes.to_base64()}),
    )));
    let out = client.generate(request()).await.unwrap();
    assert_eq!(out.output_ids, vec![5, 6]);
    assert_eq!(out.output_log_probs, vec![-0.5, -0.25]);
    assert_eq!(out.routed_experts.unwrap().rows(), 4);

    // Through the session server: a hostile engine answer is a 502 JSON error, nothing is
    // recorded, and the next normal answer is served.
    let sglang =
        miles_session::sglang::SglangEngine::new(miles_session::sglang::SglangConfig::new(&url));
    let server = SessionServer::new(
        Arc::new(sglang),
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(guard::serve(
        listener,
        server.router(),
        GuardConfig::default(),
    ));
    let http = HttpClient::new(Duration::from_secs(20));
    let r = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap();
    let id = r.json::<Value>().unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let chat_url = format!("{base}/sessions/{id}/v1/chat/completions");
    *fake.reply.lock().unwrap() = Some(json_body(meta(json!({"completion_tokens": u64::MAX}))));
    let r = http.post_json(&chat_url, &user("hi"), &[]).await.unwrap();
    let message = assert_error(&r, 502, "server_error", "upstream_response");
    assert!(message.contains("completion_tokens"), "{message}");
    // Token ids outside the vocabulary: a typed answer, never a panic.
    let out_of_vocab = json!({"text": "", "meta_info": {
        "finish_reason": {"type": "length"}, "completion_tokens": 3,
        "output_token_logprobs": [[-0.5, 4_000_000_000u32, null], [-0.5, 300, null], [-0.5, u32::MAX, null]],
    }});
    *fake.reply.lock().unwrap() = Some(json_body(out_of_vocab));
    let r = http.post_json(&chat_url, &user("hi"), &[]).await.unwrap();
    assert!(
        r.status == 200 || r.status == 502,
        "{} {}",
        r.status,
        r.text()
    );
    if r.status == 502 {
        assert_error(&r, 502, "server_error", "upstream_response");
    }
    let http = HttpClient::new(Duration::from_secs(20));
    let r = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap();
    let id = r.json::<Value>().unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let chat_url = format!("{base}/sessions/{id}/v1/chat/completions");
    *fake.reply.lock().unwrap() = None;
    let r = http.post_json(&chat_url, &user("hi"), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    let v: Value = r.json().unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "ok");
    let s: Value = http
        .get(&format!("{base}/sessions/{id}"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(s["records"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn messages_the_template_cannot_render_are_a_400() {
    use miles_session::testkit::InstantEngine;
    use miles_tito::ChatTokenizer;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let tok: Arc<dyn ChatTokenizer> = Arc::new(miles_tito::TitoChat::load(&dir, "qwen3").unwrap());
    let engine = InstantEngine::for_chatml(tok.as_ref()).unwrap();
    let server = SessionServer::new(engine, tok, SessionServerConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(guard::serve(
        listener,
        server.router(),
        GuardConfig::default(),
    ));
    let http = HttpClient::new(Duration::from_secs(20));
    let r = http
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap();
    let id = r.json::<Value>().unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let url = format!("{base}/sessions/{id}/v1/chat/completions");
    // Found by the fuzz: the Qwen3 template concatenates a system message's content as a string.
    let body =
        json!({"messages": [{"role": "system", "content": [{"type": "text", "text": "part"}]}]});
    let r = http.post_json(&url, &body, &[]).await.unwrap();
    let message = assert_error(&r, 400, "invalid_request_error", "template_rejected");
    assert!(message.contains("chat template render error"), "{message}");
    let r = http.post_json(&url, &user("hello"), &[]).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
}
