//! Property fuzz of every route of the session server on loopback: random request sequences
//! (JSON of any shape, chat bodies with hostile field values, raw bytes, wrong content types,
//! unknown sessions and paths). No answer is a 5xx (the toy engine never fails), every error
//! is an OpenAI-shaped JSON body, nothing panics (a panic would drop the connection), and the
//! server serves a normal turn afterwards. Prints how many requests were tried.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::common::{ByteChatml, ToyEngine};
use hyper::Method;
use miles_session::guard::{self, GuardConfig};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Map, Value, json};

/// Numbers, strings and containers that break naive code: huge, negative, fractional, empty.
fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(-1),
            Just(2),
            Just(64),
            Just(65),
            Just(4096),
            Just(i64::MAX),
            Just(i64::MIN),
        ]
        .prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        prop_oneof![
            Just(0.5f64),
            Just(-0.5),
            Just(1e308),
            Just(-1e308),
            Just(1e-300)
        ]
        .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::from),
        prop_oneof![
            Just(""),
            Just("user"),
            Just("assistant"),
            Just("<|im_end|>"),
            Just("<|im_start|>assistant\n"),
            Just("\u{0}"),
            Just("{{ raise_exception('x') }}"),
        ]
        .prop_map(Value::from),
    ]
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Keys the server reads, and others.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "messages",
            "role",
            "content",
            "tools",
            "tool_calls",
            "tool_call_id",
            "name",
            "function",
            "arguments",
            "type",
            "n",
            "max_tokens",
            "max_completion_tokens",
            "min_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "stream",
            "chat_template_kwargs",
            "enable_thinking",
            "max_seq_len",
            "input_ids",
            "reasoning_content",
        ])
        .prop_map(str::to_owned),
        "[a-z_]{1,8}",
    ]
}

/// A message: mostly well-formed, with hostile roles and contents mixed in.
fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        4 => prop::sample::select(vec!["user", "assistant", "system", "tool"]).prop_map(Value::from),
        1 => scalar(),
    ];
    let content = prop_oneof![
        4 => "\\PC{0,40}".prop_map(Value::from),
        1 => json_value(),
        1 => Just(json!([{"type": "text", "text": "part"}])),
    ];
    (role, content, prop::option::of(json_value())).prop_map(|(role, content, extra)| {
        let mut m = json!({"role": role, "content": content});
        if let Some(Value::Object(extra)) = extra {
            for (k, v) in extra {
                m[k] = v;
            }
        }
        m
    })
}

/// A plausible chat body (user turns, sampling fields in range or just outside), so turns
/// reach the engine and the records.
fn plausible_chat() -> impl Strategy<Value = Value> {
    let field = prop_oneof![
        (1u64..300).prop_map(|v| ("max_tokens", json!(v))),
        (0u64..5).prop_map(|v| ("min_tokens", json!(v))),
        (0.0f64..2.0).prop_map(|v| ("temperature", json!(v))),
        (0.05f64..1.0).prop_map(|v| ("top_p", json!(v))),
        prop_oneof![Just(-1i64), 1i64..50].prop_map(|v| ("top_k", json!(v))),
        "\\PC{1,6}".prop_map(|v| ("stop", json!([v]))),
        prop::collection::vec(0u32..300, 0..4).prop_map(|v| ("stop_token_ids", json!(v))),
        any::<bool>().prop_map(|v| ("stream", json!(v))),
        any::<u64>().prop_map(|v| ("seed", json!(v))),
        Just(("n", json!(1))),
        Just(("chat_template_kwargs", json!({"enable_thinking": false}))),
    ];
    (
        prop::collection::vec("\\PC{0,30}", 1..3),
        prop::collection::vec(field, 0..4),
    )
        .prop_map(|(texts, fields)| {
            let messages: Vec<Value> = texts
                .into_iter()
                .map(|t| json!({"role": "user", "content": t}))
                .collect();
            let mut body = json!({"messages": messages});
            for (k, v) in fields {
                body[k] = v;
            }
            body
        })
}

/// A chat body: messages plus request fields with any values.
fn hostile_chat() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(message(), 0..5),
        prop::collection::vec((key(), json_value()), 0..5),
    )
        .prop_map(|(messages, fields)| {
            let mut body = json!({"messages": messages});
            for (k, v) in fields {
                if k != "messages" {
                    body[k] = v;
                }
            }
            body
        })
}

#[derive(Debug, Clone)]
enum Body {
    None,
    Json(Value),
    Raw(&'static str, Vec<u8>),
}

#[derive(Debug, Clone)]
enum Op {
    Create,
    Get(usize),
    Delete(usize),
    Chat(usize, Body),
    Samples(usize, Body, bool),
    Health,
    Metrics,
    Other(Method, String, Body),
}

fn body() -> impl Strategy<Value = Body> {
    prop_oneof![
        1 => Just(Body::None),
        3 => plausible_chat().prop_map(Body::Json),
        2 => hostile_chat().prop_map(Body::Json),
        2 => json_value().prop_map(Body::Json),
        1 => (
            prop::sample::select(vec!["application/json", "text/plain", "application/x-ndjson"]),
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(ct, bytes)| Body::Raw(ct, bytes)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    // Session slot 0..3 refers to a session created earlier in the case; 3 is an unknown id.
    let slot = 0usize..4;
    prop_oneof![
        2 => Just(Op::Create),
        1 => slot.clone().prop_map(Op::Get),
        1 => slot.clone().prop_map(Op::Delete),
        6 => (slot.clone(), body()).prop_map(|(s, b)| Op::Chat(s, b)),
        2 => (slot, body(), any::<bool>()).prop_map(|(s, b, j)| Op::Samples(s, b, j)),
        1 => Just(Op::Health),
        1 => Just(Op::Metrics),
        1 => (
            prop::sample::select(vec![Method::GET, Method::POST, Method::PUT, Method::PATCH, Method::DELETE]),
            prop_oneof![
                Just("/sessions/%00/v1/chat/completions".to_owned()),
                Just("/sessions//samples".to_owned()),
                Just("/v1/chat/completions".to_owned()),
                Just("/sessions/../health".to_owned()),
                "/[a-z/]{0,20}",
            ],
            body(),
        )
            .prop_map(|(m, p, b)| Op::Other(m, p, b)),
    ]
}

struct Target {
    base: String,
    http: HttpClient,
    requests: AtomicU64,
    /// Answers by status, and chat turns answered 200.
    statuses: std::sync::Mutex<std::collections::BTreeMap<u16, u64>>,
    turns_ok: AtomicU64,
}

impl Target {
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: &Body,
        accept_json: bool,
    ) -> Result<(), String> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let url = format!("{}{path}", self.base);
        let payload = match body {
            Body::None => None,
            Body::Json(v) => Some(("application/json", serde_json::to_vec(v).unwrap())),
            Body::Raw(ct, bytes) => Some((*ct, bytes.clone())),
        };
        let headers: &[(&str, &str)] = if accept_json {
            &[("accept", "application/json")]
        } else {
            &[]
        };
        let r = self
            .http
            .send(method.clone(), &url, headers, payload)
            .await
            .map_err(|e| {
                format!("{method} {path}: no answer ({e}): the server dropped the connection")
            })?;
        let status = r.status.as_u16();
        *self.statuses.lock().unwrap().entry(status).or_default() += 1;
        if status == 200 && path.ends_with("/chat/completions") {
            self.turns_ok.fetch_add(1, Ordering::Relaxed);
        }
        if status >= 500 {
            return Err(format!("{method} {path} {body:?}: {status} {}", r.text()));
        }
        if status >= 400 {
            let v: Value = r.json().map_err(|_| {
                format!(
                    "{method} {path}: {status} without a JSON body: {}",
                    r.text()
                )
            })?;
            let ok = v["error"]["message"].is_string()
                && v["error"]["type"].is_string()
                && v["error"]["code"].is_string();
            if !ok {
                return Err(format!("{method} {path}: {status} error body {v}"));
            }
        }
        Ok(())
    }

    async fn create(&self) -> Option<String> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let r = self
            .http
            .post_json(&format!("{}/sessions", self.base), &json!({}), &[])
            .await
            .ok()?;
        (r.status == 200).then(|| r.json::<Value>().ok())??["session_id"]
            .as_str()
            .map(str::to_owned)
    }

    async fn run(&self, ops: &[Op]) -> Result<(), String> {
        // Slots 0 and 1 exist from the start; `Create` adds slot 2; slot 3 never exists.
        let mut sessions: Vec<String> = Vec::new();
        for _ in 0..2 {
            sessions.push(self.create().await.ok_or("POST /sessions failed")?);
        }
        let id = |sessions: &Vec<String>, slot: usize| {
            sessions
                .get(slot)
                .cloned()
                .unwrap_or_else(|| "0123456789abcdef0123456789abcdef".to_owned())
        };
        for op in ops {
            match op {
                Op::Create => {
                    let created = self.create().await.ok_or("POST /sessions failed")?;
                    sessions.push(created);
                }
                Op::Get(s) => {
                    self.send(
                        Method::GET,
                        &format!("/sessions/{}", id(&sessions, *s)),
                        &Body::None,
                        false,
                    )
                    .await?
                }
                Op::Delete(s) => {
                    self.send(
                        Method::DELETE,
                        &format!("/sessions/{}", id(&sessions, *s)),
                        &Body::None,
                        false,
                    )
                    .await?
                }
                Op::Chat(s, b) => {
                    let path = format!("/sessions/{}/v1/chat/completions", id(&sessions, *s));
                    self.send(Method::POST, &path, b, false).await?
                }
                Op::Samples(s, b, j) => {
                    let path = format!("/sessions/{}/samples", id(&sessions, *s));
                    self.send(Method::POST, &path, b, *j).await?
                }
                Op::Health => {
                    self.send(Method::GET, "/health", &Body::None, false)
                        .await?
                }
                Op::Metrics => {
                    self.send(Method::GET, "/metrics", &Body::None, false)
                        .await?
                }
                Op::Other(m, p, b) => self.send(m.clone(), p, b, false).await?,
            }
        }
        // Clean up so the session cap never fills.
        for s in sessions {
            let _ = self
                .http
                .send(
                    Method::DELETE,
                    &format!("{}/sessions/{s}", self.base),
                    &[],
                    None,
                )
                .await;
        }
        Ok(())
    }
}

#[test]
fn every_route_survives_random_requests() {
    fuzz(
        ToyEngine::new(),
        Arc::new(ByteChatml::default()),
        "MILES_FUZZ_CASES",
        1000,
        "You said: after the storm",
    );
}

/// The same over the real Qwen3 tokenizer and template (miles-tito's TITO path), with the
/// instant engine answering in Qwen3 tokens.
#[test]
fn every_route_survives_random_requests_on_qwen3() {
    use miles_tito::ChatTokenizer;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let tok: Arc<dyn ChatTokenizer> = Arc::new(miles_tito::TitoChat::load(&dir, "qwen3").unwrap());
    let engine = miles_session::testkit::InstantEngine::for_chatml(tok.as_ref()).unwrap();
    fuzz(engine, tok, "MILES_FUZZ_CASES_QWEN3", 300, "");
}

fn fuzz(
    engine: Arc<dyn miles_core::InferenceEngine>,
    tok: Arc<dyn miles_tito::ChatTokenizer>,
    cases_var: &str,
    default_cases: u32,
    echo: &str,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let target = runtime.block_on(async {
        let config = SessionServerConfig {
            max_context_len: Some(2048),
            max_body_bytes: 1 << 20,
            ..SessionServerConfig::default()
        };
        let server = SessionServer::new(engine, tok, config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(guard::serve(
            listener,
            server.router(),
            GuardConfig::default(),
        ));
        Target {
            base,
            http: HttpClient::new(Duration::from_secs(20)),
            requests: AtomicU64::new(0),
            statuses: Default::default(),
            turns_ok: AtomicU64::new(0),
        }
    });
    let cases: u32 = std::env::var(cases_var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(op(), 1..8), |ops| {
        runtime
            .block_on(target.run(&ops))
            .map_err(TestCaseError::fail)
    });
    let tried = target.requests.load(Ordering::Relaxed);
    let turns_ok = target.turns_ok.load(Ordering::Relaxed);
    println!(
        "fuzz: {cases} cases, {tried} requests, {turns_ok} chat turns answered 200, by status {:?}",
        target.statuses.lock().unwrap()
    );
    if let Err(e) = result {
        panic!("{e}");
    }
    // The bodies reach the engine, not only the validators.
    assert!(
        turns_ok * 50 >= u64::from(cases),
        "only {turns_ok} turns answered 200"
    );
    assert!(
        tried >= u64::from(cases),
        "{tried} requests for {cases} cases"
    );
    // Alive afterwards: a normal turn.
    runtime.block_on(async {
        let id = target.create().await.unwrap();
        let r = target
            .http
            .post_json(
                &format!("{}/sessions/{id}/v1/chat/completions", target.base),
                &json!({"messages": [{"role": "user", "content": "after the storm"}]}),
                &[],
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = r.json().unwrap();
        if !echo.is_empty() {
            assert_eq!(v["choices"][0]["message"]["content"], echo);
        }
    });
}
