//! Killing a `miles serve` process under load loses no request silently: the router
//! (over miles-session's SGLang client) re-runs every request the dead server held on the
//! other one, or reports it ABORTED; the dead server leaves the rotation and is re-admitted
//! once it is restarted.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use miles_core::{
    EngineErrorKind, Error as CoreError, FinishReason, GenerateRequest, InferenceEngine,
    SamplingParams,
};
use miles_session::sglang::Router;

use crate::process::{Server, send_signal, start_serve, tiny_chat_checkpoint, wait_exit};

fn model_dir() -> PathBuf {
    tiny_chat_checkpoint()
}

/// Starts `miles serve` on `port` (0: any) and waits for its `listening on` line.
fn start(port: u16) -> Server {
    start_with(port, &[]).unwrap_or_else(|line| panic!("unexpected first line {line:?}"))
}

/// [`start`] with extra flags; `Err(first line)` when the server did not come up.
fn start_with(port: u16, extra: &[&str]) -> Result<Server, String> {
    let extra: Vec<&OsStr> = extra.iter().map(OsStr::new).collect();
    start_serve(&model_dir(), port, &extra, Stdio::inherit())
}

/// `miles serve --device wgpu-cpu` (burn's wgpu runtime on the CPU adapter) answers
/// greedy requests with the tokens `--device flex` gives, and log-probs equal to float
/// rounding. Needs a Vulkan adapter (lavapipe in CI, where `MILES_REQUIRE_KERNEL_TESTS=1`
/// makes its absence a failure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_on_wgpu_cpu_decodes_as_on_flex() {
    let flex = tokio::task::spawn_blocking(|| start(0)).await.unwrap();
    let wgpu = tokio::task::spawn_blocking(|| start_with(0, &["--device", "wgpu-cpu"]))
        .await
        .unwrap();
    let wgpu = match wgpu {
        Ok(server) => server,
        Err(line) => {
            let msg = format!("no wgpu CPU adapter (the server said {line:?})");
            let required = std::env::var("MILES_REQUIRE_KERNEL_TESTS")
                .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes"));
            assert!(!required, "{msg}");
            eprintln!("!!! KERNEL TEST serving_on_wgpu_cpu NOT RUN: {msg}");
            return;
        }
    };
    let engine = |url: &str| {
        miles_session::sglang::SglangEngine::new(miles_session::sglang::SglangConfig::new(
            url.to_owned(),
        ))
    };
    let (on_flex, on_wgpu) = (engine(&flex.url), engine(&wgpu.url));
    for seed in 0..3 {
        let mut req = request(seed, 12);
        req.sampling_params.temperature = 0.0;
        let a = on_flex.generate(req.clone()).await.unwrap();
        let b = on_wgpu.generate(req).await.unwrap();
        assert_eq!(a.output_ids, b.output_ids, "greedy tokens differ");
        assert_eq!(a.output_log_probs.len(), b.output_log_probs.len());
        for (x, y) in a.output_log_probs.iter().zip(&b.output_log_probs) {
            assert!((x - y).abs() < 1e-4, "log-probs {x} vs {y}");
        }
    }
    // A device that is not built in is a clear error at start-up, not a fallback.
    let bad = tokio::task::spawn_blocking(|| start_with(0, &["--device", "tpu"]))
        .await
        .unwrap();
    assert!(bad.is_err());
}

fn request(seed: u64, tokens: usize) -> GenerateRequest {
    GenerateRequest::new(
        vec![381, 280, 12, 490, 64, 40, 314, 490],
        SamplingParams {
            max_new_tokens: Some(tokens),
            sampling_seed: Some(seed),
            ..SamplingParams::default()
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_server_under_load_loses_no_request() {
    let servers = tokio::task::spawn_blocking(|| [start(0), start(0)])
        .await
        .unwrap();
    let [mut a, b] = servers;
    let urls = vec![a.url.clone(), b.url.clone()];
    let router = Arc::new(Router::over_http(&urls, |_| {}));
    for url in &urls {
        assert!(router.healthy_engines().contains(url));
    }
    router.health().await.unwrap();

    const REQUESTS: usize = 16;
    const TOKENS: usize = 96;
    let mut tasks = tokio::task::JoinSet::new();
    for seed in 0..REQUESTS as u64 {
        let router = router.clone();
        tasks.spawn(async move { router.generate(request(seed, TOKENS)).await });
    }
    // Kill server A while it holds requests (SIGKILL: no goodbye, connections just drop).
    while router.outstanding()[0] == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let held_by_a = router.outstanding()[0];
    a.child.kill().unwrap();
    a.child.wait().unwrap();

    let (mut completed, mut aborted) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            Ok(output) => {
                assert_eq!(output.finish_reason, FinishReason::Length);
                assert_eq!(output.output_ids.len(), TOKENS);
                assert_eq!(output.output_log_probs.len(), TOKENS);
                completed += 1;
            }
            Err(CoreError::Engine {
                kind: EngineErrorKind::Aborted,
                ..
            }) => aborted += 1,
            Err(other) => panic!("a request was lost with {other:?}"),
        }
    }
    assert!(held_by_a > 0);
    assert_eq!(
        completed + aborted,
        REQUESTS,
        "every request is accounted for"
    );
    assert_eq!(router.healthy_engines(), std::slice::from_ref(&b.url));
    assert_eq!(router.outstanding(), [0, 0]);

    // Restarted on its port, A passes the health check and rejoins.
    let port: u16 = a.url.rsplit(':').next().unwrap().parse().unwrap();
    let restarted = tokio::task::spawn_blocking(move || start(port))
        .await
        .unwrap();
    assert_eq!(restarted.url, a.url);
    assert_eq!(router.check_health().await.len(), 2);
    let output = router.generate(request(99, 4)).await.unwrap();
    assert_eq!(output.output_ids.len(), 4);
    drop(restarted);
    drop(b);
}

/// `miles router` on its own, over two `miles serve` processes: it answers as the servers do
/// (text and ids), lists its workers, keeps answering when one server is SIGKILLed, and
/// stops with status 0 on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miles_router_serves_over_two_servers_and_routes_around_a_dead_one() {
    let [mut a, b] = tokio::task::spawn_blocking(|| [start(0), start(0)])
        .await
        .unwrap();
    let mut router = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(["router", "--engine-url", &a.url, "--engine-url", &b.url])
        .arg("--model")
        .arg(model_dir())
        .args(["--port", "0", "--rollout-health-check-interval", "0.2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start miles router");
    let mut line = String::new();
    BufReader::new(router.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .to_owned();
    assert!(line.contains("routing over 2 engine(s)"), "{line}");

    let client = miles_session::http::HttpClient::new(Duration::from_secs(60));
    let workers: serde_json::Value = client
        .get(&format!("{url}/list_workers"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(workers["urls"], serde_json::json!([a.url, b.url]));

    // Greedy answers through the router equal the server's own, for text and for ids.
    let bodies = [
        serde_json::json!({"text": "The weather in Paris",
            "sampling_params": {"temperature": 0, "max_new_tokens": 6}}),
        serde_json::json!({"input_ids": [381, 280, 12, 490, 64],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6}, "return_logprob": true}),
    ];
    let mut direct = Vec::new();
    for body in &bodies {
        let answer = client
            .post_json(&format!("{}/generate", b.url), body, &[])
            .await
            .unwrap();
        assert_eq!(answer.status, 200, "{}", answer.text());
        direct.push(answer.json::<serde_json::Value>().unwrap());
    }
    let through = |body: serde_json::Value| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let answer = client
                .post_json(&format!("{url}/generate"), &body, &[])
                .await
                .unwrap();
            assert_eq!(answer.status, 200, "{}", answer.text());
            answer.json::<serde_json::Value>().unwrap()
        }
    };
    for (body, expected) in bodies.iter().zip(&direct) {
        let got = through(body.clone()).await;
        assert_eq!(got["text"], expected["text"]);
        assert_eq!(
            got["meta_info"]["completion_tokens"],
            expected["meta_info"]["completion_tokens"]
        );
        assert_eq!(
            got["meta_info"]["output_token_logprobs"],
            expected["meta_info"]["output_token_logprobs"]
        );
    }

    // SIGKILL one server: every later request is answered by the other.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    for _ in 0..4 {
        let got = through(bodies[1].clone()).await;
        assert_eq!(got["text"], direct[1]["text"]);
    }
    let workers: serde_json::Value = client
        .get(&format!("{url}/list_workers"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(workers["healthy"], serde_json::json!([b.url]));

    send_signal(&router, libc::SIGTERM);
    let status = wait_exit(&mut router, Duration::from_secs(30));
    assert_eq!(status.code(), Some(0));
    drop(b);
}

/// SIGTERM to `miles serve` with a request in flight (its body still arriving): the server
/// stops accepting, answers that request in full and exits 0.
#[test]
fn miles_serve_drains_the_request_in_flight_on_sigterm() {
    use std::io::{Read, Write};
    let mut server = start_with(0, &["--shutdown-timeout-s", "60"]).unwrap();
    let addr: std::net::SocketAddr = server.url.trim_start_matches("http://").parse().unwrap();
    let body = br#"{"input_ids": [381, 280, 12, 490], "sampling_params": {"temperature": 0, "max_new_tokens": 16}}"#;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&body[..10]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    send_signal(&server.child, libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        server.child.try_wait().unwrap().is_none(),
        "exited with a request in flight"
    );
    stream.write_all(&body[10..]).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let json: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or(""))
            .unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert_eq!(json["meta_info"]["completion_tokens"], 16, "{json}");
    let status = wait_exit(&mut server.child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(0));
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "still accepting after the stop"
    );
}

/// `miles serve` on a hybrid checkpoint (Qwen3.5: Gated DeltaNet state slots beside the
/// paged KV pool; no tokenizer, so ids only): `/generate` answers a greedy request of 70
/// prompt tokens (past a 64-token delta-rule chunk) with transformers' `generate` tokens
/// (`fixtures/models/qwen35-tiny/reference_engine.json`).
#[test]
fn miles_serve_decodes_a_hybrid_model_as_transformers() {
    let (reference, json) = serve_reference_prompt("qwen35-tiny", 2, &[]).unwrap();
    assert_eq!(json["output_ids"], reference["output_ids"][2], "{json}");
}

/// `miles serve` on GPT-OSS (attention sinks, a sliding window of 6 on alternate layers,
/// decoded from the paged KV pool; ids only): a greedy request of 20 prompt tokens gets
/// transformers' `generate` tokens and their log-probs within 1e-4
/// (`fixtures/models/gptoss-tiny/reference_engine.json`), on flex and on `--device wgpu-cpu`
/// (lavapipe in CI, where `MILES_REQUIRE_KERNEL_TESTS=1` makes its absence a failure).
#[test]
fn miles_serve_decodes_gpt_oss_past_its_window_as_transformers() {
    for device in ["flex", "wgpu-cpu"] {
        let Some((reference, json)) =
            serve_reference_prompt("gptoss-tiny", 2, &["--device", device])
        else {
            assert_ne!(device, "flex", "miles serve did not start on flex");
            let required = std::env::var("MILES_REQUIRE_KERNEL_TESTS")
                .is_ok_and(|v| matches!(v.trim(), "1" | "true" | "yes"));
            assert!(!required, "no {device} adapter");
            eprintln!("!!! KERNEL TEST gpt_oss on {device} NOT RUN: no adapter");
            continue;
        };
        assert_gpt_oss_answer(&reference, &json);
    }
}

fn assert_gpt_oss_answer(reference: &serde_json::Value, json: &serde_json::Value) {
    assert_eq!(json["output_ids"], reference["output_ids"][2], "{json}");
    let entries = json["meta_info"]["output_token_logprobs"]
        .as_array()
        .unwrap_or_else(|| panic!("{json}"));
    let want = reference["output_logprobs"][2].as_array().unwrap();
    assert_eq!(entries.len(), want.len(), "{json}");
    for (i, (entry, want)) in entries.iter().zip(want).enumerate() {
        assert_eq!(entry[1], reference["output_ids"][2][i], "{json}");
        let diff = (entry[0].as_f64().unwrap() - want.as_f64().unwrap()).abs();
        assert!(diff < 1e-4, "token {i}: log-prob off by {diff:.3e}");
    }
}

/// Starts `miles serve` on `fixtures/models/<fixture>` with `extra` flags and sends `/generate`
/// the greedy request of prompt `row` of its `reference_engine.json` (with log-probs); the
/// reference and the answer (`None` when the server did not come up).
fn serve_reference_prompt(
    fixture: &str,
    row: usize,
    extra: &[&str],
) -> Option<(serde_json::Value, serde_json::Value)> {
    use std::io::{Read, Write};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(fixture);
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference_engine.json")).unwrap())
            .unwrap();
    let extra: Vec<&OsStr> = extra.iter().map(OsStr::new).collect();
    let server = start_serve(&dir, 0, &extra, Stdio::inherit()).ok()?;
    let body = serde_json::json!({
        "input_ids": reference["prompts"][row],
        "sampling_params": {"temperature": 0, "max_new_tokens": reference["max_new_tokens"]},
        "return_logprob": true,
    })
    .to_string();
    let addr = server.url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let json: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or(""))
            .unwrap_or_else(|e| panic!("{e}: {answer}"));
    Some((reference, json))
}
