//! Session-server load benchmark (issue 4, point 6): `miles session` in its own
//! process, serving the real Qwen3 tokenizer with the `qwen3` TITO family in front of the
//! [`miles_session::testkit::InstantEngine`] (pre-tokenized replies, no engine cost), driven
//! over loopback by the closed-loop load generator of [`miles_session::loadgen`] running in
//! this (separate) process: 8-turn tool-calling conversations at 1, 64 and 1,024 concurrent
//! sessions, and a create / delete run of 10,000 sessions checking that the server's resident
//! memory comes back within 10 % of its baseline (the run fails otherwise).
//!
//! Miles' Python server figures are constants measured on the reference machine (issue 4),
//! not re-measured here. `xtask-result:` lines put them in `cargo xtask bench`'s table:
//! `session_turns_N` is our turns/s at N sessions against Miles', `session_p50_N` the median
//! added latency per turn, `session_rss_*` resident memory. Environment: `MILES_SESSION_BENCH_MEMORY_SESSIONS` (default 10000) and
//! `MILES_SESSION_BENCH_CLIENT_THREADS` (default 1).

use std::path::Path;
use std::time::Duration;

use miles_session::loadgen::{
    LoadConfig, LoadReport, ServerProcess, cpu_time, load_average, rss_kib, run,
};

/// Miles' session server on the reference machine (issue 4): turns/s and p50 added latency at
/// 1 / 64 / 1,024 sessions, resident memory after start.
const MILES_TURNS_PER_SEC: [(usize, f64); 3] = [(1, 168.0), (64, 153.0), (1024, 98.0)];
const MILES_P50_MS: [(usize, f64); 3] = [(1, 4.7), (64, 285.0), (1024, 5100.0)];
const MILES_RSS_MIB: f64 = 936.0;
/// Targets of issue 4.
const TARGET_TURNS_PER_SEC: [(usize, f64); 2] = [(64, 5000.0), (1024, 4000.0)];
const TARGET_P50_MS_AT_1: f64 = 0.5;
const TARGET_RSS_MIB: f64 = 100.0;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn mib(kib: Option<u64>) -> f64 {
    kib.map_or(f64::NAN, |k| k as f64 / 1024.0)
}

struct Measured {
    sessions: usize,
    report: LoadReport,
    server_cpu_per_turn: Option<Duration>,
}

fn drive(
    runtime: &tokio::runtime::Runtime,
    server: &ServerProcess,
    sessions: usize,
    total_sessions: usize,
) -> Measured {
    let config = LoadConfig {
        url: server.url().to_owned(),
        sessions,
        turns: 8,
        total_sessions,
    };
    let cpu_before = cpu_time(server.pid());
    let report = runtime
        .block_on(run(&config))
        .unwrap_or_else(|e| panic!("load run with {sessions} sessions failed: {e}"));
    let server_cpu_per_turn = cpu_time(server.pid())
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before) / report.turns.max(1) as u32);
    Measured {
        sessions,
        report,
        server_cpu_per_turn,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too: keep that short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let binary = Path::new(env!("CARGO_BIN_EXE_miles"));
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let model = model.to_string_lossy();
    let server = ServerProcess::spawn(
        binary,
        &[
            "session",
            "--engine-url",
            "instant",
            "--model",
            &model,
            "--tito",
            "qwen3",
            "--port",
            "0",
        ],
    )
    .expect("start miles session");
    let pid = server.pid();
    std::thread::sleep(Duration::from_millis(200));
    let rss_start = rss_kib(pid);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env_usize("MILES_SESSION_BENCH_CLIENT_THREADS", 1).max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let load_before = load_average();

    // Memory: warm up (one round at full concurrency), take the baseline, create / drive /
    // delete N sessions, then poll (up to 10 s) until the idle server has handed memory back.
    drive(&runtime, &server, 64, 64);
    std::thread::sleep(Duration::from_millis(1500));
    let rss_baseline = rss_kib(pid);
    let memory_sessions = if quick {
        64
    } else {
        env_usize("MILES_SESSION_BENCH_MEMORY_SESSIONS", 10_000)
    };
    let memory_run = drive(&runtime, &server, 64, memory_sessions);
    let mut rss_after = rss_kib(pid);
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(250));
        rss_after = rss_kib(pid);
        if let (Some(after), Some(base)) = (rss_after, rss_baseline)
            && after as f64 <= base as f64 * 1.10
        {
            break;
        }
    }

    // Throughput and latency.
    let plan: [(usize, usize); 3] = if quick {
        [(1, 4), (64, 64), (1024, 1024)]
    } else {
        [(1, 250), (64, 1280), (1024, 3072)]
    };
    let runs: Vec<Measured> = plan
        .iter()
        .map(|&(sessions, total)| drive(&runtime, &server, sessions, total))
        .collect();
    let load_after = load_average();

    println!(
        "\nmiles-session load benchmark: Qwen3 tokenizer, qwen3 family, instant engine, 8-turn \
         tool-calling sessions, load generator in a separate process over loopback"
    );
    println!(
        "machine: {} cores, 1-min load average {:.2} before / {:.2} after",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before.unwrap_or(f64::NAN),
        load_after.unwrap_or(f64::NAN)
    );
    println!(
        "| sessions | turns | turns/s | p50 ms | p99 ms | server CPU ms/turn | Miles turns/s | Miles p50 ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for m in &runs {
        let miles_tps = MILES_TURNS_PER_SEC
            .iter()
            .find(|(s, _)| *s == m.sessions)
            .map_or(f64::NAN, |(_, v)| *v);
        let miles_p50 = MILES_P50_MS
            .iter()
            .find(|(s, _)| *s == m.sessions)
            .map_or(f64::NAN, |(_, v)| *v);
        println!(
            "| {} | {} | {:.0} | {:.3} | {:.3} | {} | {miles_tps} | {miles_p50} |",
            m.sessions,
            m.report.turns,
            m.report.turns_per_sec(),
            m.report.percentile(0.5).as_secs_f64() * 1e3,
            m.report.percentile(0.99).as_secs_f64() * 1e3,
            m.server_cpu_per_turn
                .map_or_else(|| "-".into(), |d| format!("{:.3}", d.as_secs_f64() * 1e3)),
        );
    }
    println!(
        "memory: RSS {:.1} MiB at start (target ≤ {TARGET_RSS_MIB}, Miles {MILES_RSS_MIB}), \
         {:.1} MiB baseline after warm-up, {:.1} MiB after {} sessions ({} turns) created and \
         deleted at {:.0} turns/s",
        mib(rss_start),
        mib(rss_baseline),
        mib(rss_after),
        memory_run.report.sessions,
        memory_run.report.turns,
        memory_run.report.turns_per_sec(),
    );
    println!(
        "targets: ≥ {} turns/s at 64, ≥ {} at 1,024, p50 ≤ {TARGET_P50_MS_AT_1} ms at 1 session",
        TARGET_TURNS_PER_SEC[0].1, TARGET_TURNS_PER_SEC[1].1
    );

    for m in &runs {
        let Some((_, miles_tps)) = MILES_TURNS_PER_SEC.iter().find(|(s, _)| *s == m.sessions)
        else {
            continue;
        };
        let target = TARGET_TURNS_PER_SEC
            .iter()
            .find(|(s, _)| *s == m.sessions)
            .map_or_else(
                || "-".to_string(),
                |(_, t)| format!(">={:.4}", t / miles_tps),
            );
        println!(
            "xtask-result: session_turns_{} ours={:.1}turns/s baseline={miles_tps}turns/s \
             target={target} note=baseline: Miles' session server (issue 4 constant, not \
             measured here)",
            m.sessions,
            m.report.turns_per_sec(),
        );
        if let Some((_, miles_p50)) = MILES_P50_MS.iter().find(|(s, _)| *s == m.sessions) {
            let target = if m.sessions == 1 {
                format!("<={:.4}", TARGET_P50_MS_AT_1 / miles_p50)
            } else {
                "-".to_string()
            };
            println!(
                "xtask-result: session_p50_{} ours={:.4}ms baseline={miles_p50}ms \
                 target={target} note=median added latency per turn; baseline: Miles (issue 4 \
                 constant)",
                m.sessions,
                m.report.percentile(0.5).as_secs_f64() * 1e3,
            );
        }
    }
    println!(
        "xtask-result: session_rss_start ours={:.1}MiB baseline={MILES_RSS_MIB}MiB \
         target=<={:.4} note=resident memory after start; baseline: Miles (issue 4 constant); \
         target: <= {TARGET_RSS_MIB} MiB",
        mib(rss_start),
        TARGET_RSS_MIB / MILES_RSS_MIB
    );
    if let (Some(base), Some(after)) = (rss_baseline, rss_after) {
        println!(
            "xtask-result: session_rss_after_churn ours={after}KiB baseline={base}KiB \
             target=<=1.10 note=resident memory after {} sessions created and deleted vs after \
             warm-up",
            memory_run.report.sessions
        );
    }

    if let (Some(base), Some(after)) = (rss_baseline, rss_after) {
        let ratio = after as f64 / base as f64;
        println!(
            "memory after {} sessions: {:.3}x baseline (must be ≤ 1.10)",
            memory_run.report.sessions, ratio
        );
        assert!(
            quick || ratio <= 1.10,
            "resident memory not back within 10 % of its baseline: {after} KiB vs {base} KiB"
        );
    }
}
