//! Property fuzz of every route of `miles serve`'s SGLang protocol on loopback, behind
//! the binary's guard: random bodies (JSON of any shape, `/generate` and chat bodies with
//! hostile field values, raw bytes, wrong content types) on every route. No answer is a 5xx
//! except the toy engine's declared failures, every 4xx carries a JSON error body, nothing
//! panics (a panic would drop the connection), and the server answers a normal request
//! afterwards. Prints how many requests were tried.

use std::sync::Arc;
use std::time::Duration;

use hyper::Method;
use miles_session::guard::{self, GuardConfig};
use miles_session::http::HttpClient;
use miles_session::sglang::{ServerInfo, sglang_router};
use miles_session::testkit::{ByteChatml, ToyEngine};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{Map, Value, json};

/// Values that break naive code: huge, negative, fractional, empty, special strings.
fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        prop::sample::select(vec![0i64, 1, -1, 2, 64, 65, 255, 256, 1024, 1025, i64::MAX])
            .prop_map(Value::from),
        prop::sample::select(vec![0.0f64, 0.5, -0.5, 1.0, 2.5, 1e308, -1e308, 1e-300])
            .prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::from),
        prop::sample::select(vec![
            "",
            "abort",
            "retract",
            "in_place",
            "<|im_end|>",
            "<|im_start|>assistant\n",
            "..",
            "/etc/passwd",
            "../../x",
            "\u{0}",
        ])
        .prop_map(Value::from),
    ]
}

/// Keys the server reads, and others.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec![
            "input_ids", "text", "sampling_params", "rid", "return_logprob", "stream",
            "return_routed_experts", "routed_experts_start_len", "return_text_in_logprobs",
            "n", "max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p",
            "stop", "stop_token_ids", "min_new_tokens", "sampling_seed", "messages", "role",
            "content", "tools", "chat_template_kwargs", "logprobs", "model", "mode",
            "abort_all", "model_path", "weight_version", "flush_cache", "abort_all_requests",
            "frequency_penalty", "presence_penalty", "no_stop_trim", "separate_reasoning",
        ])
        .prop_map(str::to_owned),
        1 => "[a-z_]{1,10}",
    ]
}

/// Any JSON value, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A `/generate` body that is mostly well-formed, with hostile values.
fn generate_body() -> impl Strategy<Value = Value> {
    let ids = prop::collection::vec(prop_oneof![0u64..600, Just(u64::from(u32::MAX) + 1)], 0..6);
    let sampling = prop::collection::vec(
        (
            prop::sample::select(vec![
                "n",
                "max_new_tokens",
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "stop",
                "stop_token_ids",
                "min_new_tokens",
                "sampling_seed",
            ]),
            prop_oneof![scalar(), json_value()],
        ),
        0..4,
    )
    .prop_map(|kv| {
        Value::Object(
            kv.into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect::<Map<_, _>>(),
        )
    });
    (ids, sampling, prop::option::of(json_value())).prop_map(|(ids, sampling, extra)| {
        let mut body = json!({"input_ids": ids, "sampling_params": sampling});
        if let Some(Value::Object(extra)) = extra {
            for (k, v) in extra {
                body[k] = v;
            }
        }
        body
    })
}

/// A chat body with hostile values.
fn chat_body() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(
            (
                prop::sample::select(vec!["user", "assistant", "system", "tool", "nobody"]),
                prop_oneof![scalar(), json_value()],
            ),
            0..3,
        ),
        prop::collection::vec(
            (
                prop::sample::select(vec![
                    "n",
                    "max_tokens",
                    "temperature",
                    "stop",
                    "logprobs",
                    "tools",
                    "stream",
                    "chat_template_kwargs",
                ]),
                scalar(),
            ),
            0..3,
        ),
    )
        .prop_map(|(messages, extra)| {
            let messages: Vec<Value> = messages
                .into_iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            let mut body = json!({"messages": messages});
            for (k, v) in extra {
                body[k] = v;
            }
            body
        })
}

const POST_ROUTES: &[&str] = &[
    "/generate",
    "/v1/chat/completions",
    "/abort_request",
    "/update_weights_from_disk",
    "/flush_cache",
    "/continue_generation",
    "/pause_generation",
    "/nowhere",
];

const GET_ROUTES: &[&str] = &[
    "/health",
    "/health_generate",
    "/v1/models",
    "/get_model_info",
    "/get_server_info",
    "/get_weight_version",
    "/flush_cache",
    "/generate",
    "/nowhere",
];

#[derive(Debug, Clone)]
enum Case {
    Post(&'static str, Value),
    Raw(&'static str, &'static str, Vec<u8>),
    Get(&'static str),
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![
        4 => generate_body().prop_map(|b| Case::Post("/generate", b)),
        3 => chat_body().prop_map(|b| Case::Post("/v1/chat/completions", b)),
        3 => (prop::sample::select(POST_ROUTES), json_value()).prop_map(|(r, b)| Case::Post(r, b)),
        1 => (
            prop::sample::select(POST_ROUTES),
            prop::sample::select(vec!["application/json", "text/plain", "application/x-www-form-urlencoded"]),
            prop::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(r, t, b)| Case::Raw(r, t, b)),
        1 => prop::sample::select(GET_ROUTES).prop_map(Case::Get),
    ]
}

/// A 5xx the toy engine declares: its scripted failure, or log-probs it drops on purpose.
fn declared_engine_failure(body: &Value) -> bool {
    let message = body["error"]["message"].as_str().unwrap_or_default();
    message.contains("scripted failure") || message.contains("the engine returned")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_requests_never_crash_the_rollout_server() {
    let root = std::env::temp_dir().join(format!("miles-rollout-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(root.join("w")).unwrap();
    let mut info = ServerInfo::new("toy")
        .with_tokenizer(Arc::new(ByteChatml::default()), "byte-chatml")
        .with_weights_root(&root);
    info.context_length = Some(256);
    info.vocab_size = Some(512);
    let guard_config = GuardConfig::default().with_max_body_bytes(info.max_body_bytes);
    let app = guard::harden(sglang_router(ToyEngine::new(), info), &guard_config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(guard::serve(listener, app, guard_config));
    let client = HttpClient::new(Duration::from_secs(30));

    let cases: usize = std::env::var("MILES_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    let mut runner = TestRunner::new(Config {
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed),
        ..Config::default()
    });
    let strategy = case();
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for i in 0..cases {
        let case = strategy.new_tree(&mut runner).unwrap().current();
        let response = match &case {
            Case::Post(route, body) => client.post_json(&format!("{base}{route}"), body, &[]).await,
            Case::Raw(route, content_type, bytes) => {
                client
                    .send(
                        Method::POST,
                        &format!("{base}{route}"),
                        &[],
                        Some((content_type, bytes.clone())),
                    )
                    .await
            }
            Case::Get(route) => client.get(&format!("{base}{route}")).await,
        };
        let response = response.unwrap_or_else(|e| panic!("case {i} {case:?}: no answer: {e}"));
        let status = response.status.as_u16();
        *statuses.entry(status).or_default() += 1;
        let body: Value = serde_json::from_slice(&response.body).unwrap_or(Value::Null);
        if matches!(
            &case,
            Case::Post("/pause_generation", _) | Case::Raw("/pause_generation", ..)
        ) {
            // A pause holds generation until it is continued (SGLang semantics).
            let resumed = client
                .post_json(&format!("{base}/continue_generation"), &json!({}), &[])
                .await
                .unwrap();
            assert_eq!(resumed.status.as_u16(), 200);
        }
        assert!(
            status < 500
                || declared_engine_failure(&body)
                // A generation health check answers 503 when the engine cannot generate (the
                // toy engine serves chat prompts only): that is its answer, not a crash.
                || (matches!(case, Case::Get("/health_generate")) && status == 503),
            "case {i} {case:?}: {status} {}",
            response.text()
        );
        if (400..500).contains(&status) {
            assert!(
                body["error"]["message"].is_string(),
                "case {i} {case:?}: {status} without a JSON error: {}",
                response.text()
            );
        }
    }
    // A fuzzed pause may have left generation paused: continue, then a normal request works.
    let resumed = client
        .post_json(&format!("{base}/continue_generation"), &json!({}), &[])
        .await
        .unwrap();
    assert_eq!(resumed.status.as_u16(), 200);
    let ok = client
        .post_json(
            &format!("{base}/generate"),
            &json!({"text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"}),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(ok.status.as_u16(), 200, "{}", ok.text());
    println!("rollout server fuzz: {cases} requests, statuses {statuses:?}");
    std::fs::remove_dir_all(&root).ok();
}
