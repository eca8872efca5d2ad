//! Bounded loopback load test of `miles session` (issue 4, point 6): the server runs
//! in its own process with the real Qwen3 tokenizer (`qwen3` family) and the instant engine,
//! this test drives 1,000 sessions of 8 tool-calling turns each through it (64 at a time,
//! every session created, driven and deleted) and checks that every turn succeeded, that no
//! session is left open and that the server's resident memory is back within 10 % of its
//! baseline after warm-up. `benches/session_load.rs` runs the same check with 10,000 sessions
//! in release.

use std::path::Path;
use std::time::Duration;

use miles_session::http::HttpClient;
use miles_session::loadgen::{LoadConfig, ServerProcess, rss_kib, run};

fn server() -> ServerProcess {
    let binary = Path::new(env!("CARGO_BIN_EXE_miles"));
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    ServerProcess::spawn(
        binary,
        &[
            "session",
            "--engine-url",
            "instant",
            "--model",
            &model.to_string_lossy(),
            "--tito",
            "qwen3",
            "--port",
            "0",
        ],
    )
    .expect("start miles session")
}

fn open_sessions(rt: &tokio::runtime::Runtime, url: &str) -> u64 {
    let text = rt
        .block_on(HttpClient::new(Duration::from_secs(30)).get(&format!("{url}/metrics")))
        .expect("metrics")
        .text();
    text.lines()
        .find(|l| l.starts_with("miles_session_sessions_open "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .expect("sessions_open gauge") as u64
}

#[test]
fn thousand_sessions_leave_memory_at_its_baseline() {
    let server = server();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let config = |sessions, total_sessions| LoadConfig {
        url: server.url().to_owned(),
        sessions,
        turns: 8,
        total_sessions,
    };
    // Warm-up: a few rounds at full concurrency (caches, connection buffers, allocator pages).
    let warm = rt.block_on(run(&config(64, 192))).expect("warm-up");
    assert_eq!(warm.turns, 192 * 8);
    std::thread::sleep(Duration::from_millis(1500));
    let baseline = rss_kib(server.pid());

    let report = rt.block_on(run(&config(64, 1000))).expect("load run");
    assert_eq!(report.sessions, 1000);
    assert_eq!(report.turns, 8000, "every turn answered");
    assert_eq!(open_sessions(&rt, server.url()), 0, "no session leaked");

    // The server hands freed memory back when its workers go idle: poll for up to 10 s.
    let Some(base) = baseline else {
        eprintln!("no /proc: resident memory not checked");
        return;
    };
    let limit = base as f64 * 1.10;
    let mut after = u64::MAX;
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(250));
        after = rss_kib(server.pid()).unwrap_or(u64::MAX);
        if after as f64 <= limit {
            break;
        }
    }
    eprintln!("server RSS: {base} KiB baseline, {after} KiB after 1,000 sessions");
    assert!(
        after as f64 <= limit,
        "resident memory not back within 10 % of its baseline: {after} KiB vs {base} KiB"
    );
}
