//! `miles serve` against hostile input, on a real server over loopback with the
//! embedded engine and the real tiny Qwen3 checkpoint of `fixtures/`: every bad request is a
//! 4xx with an OpenAI-shaped JSON error, and the server serves a normal request afterwards.
//! The file-system route (`update_weights_from_disk`) reads only under `--weights-root`, and a
//! checkpoint that cannot be loaded leaves the engine on its previous weights.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper::Method;
use miles_engine::serve::{ServeOptions, attach_metrics, server_info};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_session::http::HttpClient;
use miles_session::sglang::sglang_router;
use serde_json::{Value, json};

fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(path)
}

/// Starts `miles serve`'s server (its library form) with the options `set` changes.
async fn serve(set: impl FnOnce(&mut ServeOptions)) -> String {
    serve_with(set, false).await
}

/// [`serve`], optionally behind the binary's HTTP guard (`--api-key`, JSON bodies,
/// connection limit and request-head timeout), as `main` serves it.
async fn serve_with(set: impl FnOnce(&mut ServeOptions), guarded: bool) -> String {
    let dir = fixture("serve/qwen3-tiny-chat");
    let mut args = ServeOptions::new(&dir);
    set(&mut args);
    let mut info = server_info(&args).unwrap();
    let engine = EmbeddedEngine::from_pretrained(
        &dir,
        &burn::tensor::Device::flex(),
        EngineConfig::default(),
    )
    .unwrap();
    attach_metrics(&args, &engine, &mut info).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let guard = args.guard_config(&info);
    let app = sglang_router(Arc::new(engine), info);
    if guarded {
        let app = miles_session::guard::harden(app, &guard);
        tokio::spawn(async move { miles_session::guard::serve(listener, app, guard).await });
    } else {
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    }
    format!("http://{addr}")
}

fn http() -> HttpClient {
    HttpClient::new(Duration::from_secs(120))
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = http()
        .post_json(&format!("{base}{path}"), body, &[])
        .await
        .unwrap();
    let value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
    (r.status.as_u16(), value)
}

/// A normal greedy request: the server still works.
async fn still_serves(base: &str) -> Value {
    let (status, body) = post(
        base,
        "/generate",
        &json!({"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["output_ids"].as_array().unwrap().len(), 3, "{body}");
    body
}

/// The body is an OpenAI-shaped error whose message contains `needle`.
fn assert_error(status: u16, body: &Value, expected: u16, needle: &str) {
    assert_eq!(status, expected, "{body}");
    assert_eq!(body["error"]["code"], json!(expected), "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_limits_are_typed_errors_and_the_server_survives() {
    let base = serve(|o| {
        o.max_n = Some(8);
        o.max_request_bytes = Some(8192);
    })
    .await;
    let ids = json!([1, 2, 3]);
    // The crash: n = 10^12 (was an allocation abort).
    let cases = [
        (
            json!({"input_ids": ids, "sampling_params": {"n": 1_000_000_000_000u64}}),
            "--max-n",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"n": 9}}),
            "--max-n",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": u64::MAX}}),
            "context length",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 254}}),
            "context length",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"stop": vec!["x"; 65]}}),
            "65 stop strings",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"stop": ["y".repeat(4097)]}}),
            "4097 bytes",
        ),
        (
            json!({"input_ids": ids, "sampling_params": {"stop_token_ids": vec![1; 1025]}}),
            "1025 stop_token_ids",
        ),
        (json!({"input_ids": vec![1; 256]}), "context length"),
        (json!({"input_ids": [1, 2, 512]}), "out of the vocabulary"),
    ];
    for (body, needle) in &cases {
        let (status, answer) = post(&base, "/generate", body).await;
        assert_error(status, &answer, 400, needle);
    }
    // Chat: n and stop strings through the OpenAI route.
    let messages = json!([{"role": "user", "content": "hi"}]);
    for (body, needle) in [
        (json!({"messages": messages, "n": 100_000}), "--max-n"),
        (
            json!({"messages": messages, "stop": vec!["z"; 100]}),
            "100 stop strings",
        ),
        (
            json!({"messages": messages, "max_tokens": u64::MAX}),
            "context length",
        ),
    ] {
        let (status, answer) = post(&base, "/v1/chat/completions", &body).await;
        assert_error(status, &answer, 400, needle);
    }
    // A body over --max-request-bytes: 413.
    let big = json!({"input_ids": vec![1; 5000]});
    let (status, answer) = post(&base, "/generate", &big).await;
    assert_error(status, &answer, 413, "over 8192 bytes");
    // n within the limit works and is expanded into n answers.
    let (status, answer) = post(
        &base,
        "/generate",
        &json!({"input_ids": ids, "sampling_params": {"n": 8, "max_new_tokens": 2}}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer.as_array().unwrap().len(), 8);
    still_serves(&base).await;
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "miles-serve-hardening-{name}-{}",
        std::process::id()
    ));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn copy_checkpoint(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("models/qwen3-tiny").join(file), to.join(file)).unwrap();
    }
}

async fn update(base: &str, path: &Path, version: u64) -> (u16, Value) {
    post(
        base,
        "/update_weights_from_disk",
        &json!({"model_path": path, "weight_version": version.to_string()}),
    )
    .await
}

async fn version(base: &str) -> String {
    let r = http()
        .get(&format!("{base}/get_weight_version"))
        .await
        .unwrap();
    let body: Value = r.json().unwrap();
    body["weight_version"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_weights_from_disk_is_confined_and_failures_keep_the_last_version() {
    // Without --weights-root the route is disabled.
    let closed = serve(|_| {}).await;
    let (status, body) = update(&closed, &fixture("models/qwen3-tiny"), 1).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["success"], json!(false));
    assert!(body["message"].as_str().unwrap().contains("--weights-root"));
    still_serves(&closed).await;

    let root = scratch("root");
    let outside = scratch("outside");
    copy_checkpoint(&root.join("good"));
    copy_checkpoint(&outside.join("ckpt"));
    let base = serve(|o| o.weights_root = Some(root.clone())).await;

    // A good checkpoint under the root loads (absolute or relative to the root).
    let (status, body) = update(&base, &root.join("good"), 1).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["success"], json!(true));
    let (status, body) = update(&base, Path::new("good"), 2).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(version(&base).await, "2");

    // Out of the root: absolute, through `..`, through a symlink; a missing path outside is
    // 403 as well (no existence oracle).
    let escape = root
        .join("good/../../")
        .join(outside.file_name().unwrap())
        .join("ckpt");
    let mut forbidden = vec![
        outside.join("ckpt"),
        escape,
        PathBuf::from("/nonexistent/x"),
    ];
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(outside.join("ckpt"), root.join("link")).unwrap();
        forbidden.push(root.join("link"));
    }
    for path in &forbidden {
        let (status, body) = update(&base, path, 3).await;
        assert_eq!(status, 403, "{}: {body}", path.display());
        assert_eq!(body["success"], json!(false));
        assert!(
            body["message"].as_str().unwrap().contains("outside"),
            "{body}"
        );
    }

    // Broken checkpoints under the root: missing, truncated, an index pointing outside. Each
    // is `success: false` with the reason, and the engine keeps serving version 2.
    let truncated = root.join("truncated");
    copy_checkpoint(&truncated);
    let weights = std::fs::read(truncated.join("model.safetensors")).unwrap();
    std::fs::write(
        truncated.join("model.safetensors"),
        &weights[..weights.len() / 2],
    )
    .unwrap();
    let indexed = root.join("indexed");
    std::fs::create_dir_all(&indexed).unwrap();
    std::fs::copy(
        fixture("models/qwen3-tiny/config.json"),
        indexed.join("config.json"),
    )
    .unwrap();
    let outside_file = outside.join("ckpt/model.safetensors");
    std::fs::write(
        indexed.join("model.safetensors.index.json"),
        json!({"metadata": {}, "weight_map": {"model.norm.weight": outside_file}}).to_string(),
    )
    .unwrap();
    for (path, needle) in [
        (root.join("missing"), "cannot be read"),
        (truncated, "but the file has"),
        (indexed, "not a file name inside"),
    ] {
        let (status, body) = update(&base, &path, 3).await;
        assert_eq!(status, 400, "{}: {body}", path.display());
        assert_eq!(body["success"], json!(false));
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    assert_eq!(version(&base).await, "2");
    let answer = still_serves(&base).await;
    assert_eq!(answer["meta_info"]["weight_version"], "2");

    // Malformed bodies on the route: typed errors.
    for body in [
        json!({}),
        json!({"model_path": 7}),
        json!({"model_path": "good", "weight_version": "v"}),
    ] {
        let (status, answer) = post(&base, "/update_weights_from_disk", &body).await;
        assert_eq!(status, 400, "{body}: {answer}");
    }
    let raw = http()
        .send(
            Method::POST,
            &format!("{base}/update_weights_from_disk"),
            &[],
            Some(("application/json", b"{not json".to_vec())),
        )
        .await
        .unwrap();
    assert_eq!(raw.status.as_u16(), 400);
    still_serves(&base).await;
    std::fs::remove_dir_all(&root).ok();
    std::fs::remove_dir_all(&outside).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_json_bodies_and_slow_clients_on_the_rollout_server() {
    let base = serve_with(
        |o| {
            o.api_key = Some(miles_session::guard::ApiKey::new("s3cret-key").unwrap());
            o.header_read_timeout_s = Some(1.0);
            o.max_connections = Some(4);
        },
        true,
    )
    .await;
    let client = http();
    let body = serde_json::to_vec(&json!({"input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0, "max_new_tokens": 2}}))
    .unwrap();
    let call = |headers: Vec<(&'static str, &'static str)>, content_type: &'static str| {
        let client = client.clone();
        let body = body.clone();
        let url = format!("{base}/generate");
        async move {
            let r = client
                .send(Method::POST, &url, &headers, Some((content_type, body)))
                .await
                .unwrap();
            (
                r.status.as_u16(),
                serde_json::from_slice::<Value>(&r.body).unwrap_or(Value::Null),
            )
        }
    };
    // /health needs no key; everything else does.
    let health = client.get(&format!("{base}/health")).await.unwrap();
    assert_eq!(health.status.as_u16(), 200);
    for headers in [
        vec![],
        vec![("authorization", "Bearer wrong")],
        vec![("authorization", "s3cret-key")],
        vec![("authorization", "Basic s3cret-key")],
    ] {
        let (status, answer) = call(headers.clone(), "application/json").await;
        assert_eq!(status, 401, "{headers:?}: {answer}");
        assert_eq!(answer["error"]["type"], "authentication_error", "{answer}");
    }
    let info = client.get(&format!("{base}/get_model_info")).await.unwrap();
    assert_eq!(info.status.as_u16(), 401);
    // The right key, but not a JSON body: 415 (a web page's simple cross-origin POST).
    let key = vec![("authorization", "Bearer s3cret-key")];
    let (status, answer) = call(key.clone(), "text/plain").await;
    assert_eq!(status, 415, "{answer}");
    let (status, answer) = call(key.clone(), "application/json").await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["output_ids"].as_array().unwrap().len(), 2);

    // The workspace's SGLang client sends the key when configured.
    let with_key = miles_session::sglang::SglangEngine::new(
        miles_session::sglang::SglangConfig::new(base.clone()).with_api_key(Some(
            miles_session::guard::ApiKey::new("s3cret-key").unwrap(),
        )),
    );
    let without = miles_session::sglang::SglangEngine::new(
        miles_session::sglang::SglangConfig::new(base.clone()),
    );
    use miles_core::InferenceEngine;
    let request = miles_core::GenerateRequest::new(
        vec![1, 2, 3],
        miles_core::SamplingParams {
            temperature: 0.0,
            max_new_tokens: Some(2),
            ..Default::default()
        },
    );
    let output = with_key.generate(request.clone()).await.unwrap();
    assert_eq!(
        output.output_ids,
        serde_json::from_value::<Vec<u32>>(answer["output_ids"].clone()).unwrap()
    );
    assert!(without.generate(request).await.is_err());

    // Stalled clients (half a request head each, more than --max-connections) do not make
    // /health hang: their connections are closed after the head timeout.
    let addr = base.trim_start_matches("http://").to_owned();
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut stream = std::net::TcpStream::connect(&addr).unwrap();
        std::io::Write::write_all(&mut stream, b"GET /health HTTP/1.1\r\nHo").unwrap();
        stalled.push(stream);
    }
    let started = std::time::Instant::now();
    let health = HttpClient::new(Duration::from_secs(10))
        .get(&format!("{base}/health"))
        .await
        .unwrap();
    assert_eq!(health.status.as_u16(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
    drop(stalled);
}

/// The value of the sample `name{…}` (labels ignored) in a Prometheus text exposition.
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let metric = series.split('{').next()?;
            (metric == name).then(|| value.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enable_metrics_serves_sglang_engine_metrics() {
    // Off by default: 404 with a JSON error.
    let plain = serve(|_| {}).await;
    let r = http().get(&format!("{plain}/metrics")).await.unwrap();
    assert_eq!(r.status.as_u16(), 404);

    let base = serve(|o| o.enable_metrics = true).await;
    for max_new in [3, 5] {
        let (status, body) = post(
            &base,
            "/generate",
            &json!({"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0,
                    "max_new_tokens": max_new}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    // The gauges follow the scheduler's loop, which may still be finishing its iteration
    // when the answers arrive: scrape until it has published the idle state.
    let mut text = String::new();
    for _ in 0..200 {
        let r = http().get(&format!("{base}/metrics")).await.unwrap();
        assert_eq!(r.status.as_u16(), 200);
        assert!(
            r.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain; version=0.0.4")
        );
        text = r.text();
        if sample(&text, "sglang:num_running_reqs") == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let generated: f64 = sample(&text, "sglang:generation_tokens_total");
    assert!((2.0..=8.0).contains(&generated), "{generated}");
    assert_eq!(sample(&text, "sglang:prompt_tokens_total"), 8.0);
    assert_eq!(sample(&text, "sglang:num_requests_total"), 2.0);
    assert_eq!(sample(&text, "sglang:num_aborted_requests_total"), 0.0);
    // One first token per request; every later token is an inter-token interval.
    assert_eq!(
        sample(&text, "sglang:time_to_first_token_seconds_count"),
        2.0
    );
    assert_eq!(
        sample(&text, "sglang:inter_token_latency_seconds_count"),
        generated - 2.0
    );
    assert_eq!(
        sample(&text, "sglang:e2e_request_latency_seconds_count"),
        2.0
    );
    // Idle engine: nothing running or queued, no KV reserved.
    assert_eq!(sample(&text, "sglang:num_running_reqs"), 0.0);
    assert_eq!(sample(&text, "sglang:num_queue_reqs"), 0.0);
    assert_eq!(sample(&text, "sglang:token_usage"), 0.0);
    assert_eq!(sample(&text, "miles_rollout_weight_version"), 0.0);
    // Generation throughput is measured over windows of at least a second, closed by the
    // scheduler's next iteration: after a pause, a request closes the window that holds the
    // tokens of the request before it. (The first round may close a window that only just
    // started; the second cannot.)
    let mut throughput = 0.0;
    for _round in 0..3 {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (status, body) = post(
            &base,
            "/generate",
            &json!({"input_ids": [1, 2, 3, 4], "sampling_params": {"temperature": 0,
                    "max_new_tokens": 2}}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let r = http().get(&format!("{base}/metrics")).await.unwrap();
        throughput = sample(&r.text(), "sglang:gen_throughput");
        if throughput > 0.0 {
            break;
        }
    }
    assert!(throughput > 0.0 && throughput.is_finite(), "{throughput}");
    parse_with_prometheus_client(&text);
}

/// Parses `text` with the real Prometheus text-format parser (`prometheus_client`, from
/// `MILES_TORCH_PYTHON` or `.venv-ref`): every SGLang family is there with its type. With
/// `CI` set a missing parser fails the test; elsewhere it prints NOT RUN.
fn parse_with_prometheus_client(text: &str) {
    use std::io::Write;
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    let python = std::env::var_os("MILES_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv])
        .find(|p| {
            std::process::Command::new(p)
                .args(["-c", "import prometheus_client"])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    let Some(python) = python else {
        let msg = "no Python with prometheus_client (make .venv-ref as .ci/run does)";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("\n######## NOT RUN: prometheus_client parse: {msg} ########\n");
        return;
    };
    let script = "import sys, json\n\
from prometheus_client.parser import text_string_to_metric_families\n\
print(json.dumps({f.name: f.type for f in text_string_to_metric_families(sys.stdin.read())}))";
    let mut child = std::process::Command::new(python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the parser rejected:\n{text}");
    let families: Value = serde_json::from_slice(&out.stdout).unwrap();
    for (name, kind) in [
        ("sglang:num_running_reqs", "gauge"),
        ("sglang:num_queue_reqs", "gauge"),
        ("sglang:token_usage", "gauge"),
        ("sglang:generation_tokens", "counter"),
        ("sglang:prompt_tokens", "counter"),
        ("sglang:time_to_first_token_seconds", "histogram"),
        ("sglang:inter_token_latency_seconds", "histogram"),
        ("sglang:e2e_request_latency_seconds", "histogram"),
        ("miles_rollout_weight_version", "gauge"),
    ] {
        assert_eq!(families[name], kind, "{name} in {families}");
    }
}
