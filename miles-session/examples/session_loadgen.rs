//! Closed-loop load generator for a running `miles-session` server (a separate process):
//! [`miles_session::loadgen`] with a command line.
//!
//! Prints turns/s and client-observed per-turn latency percentiles; with `--server-pid` also
//! the server's resident memory before and after and its CPU time per turn.
//!
//! ```text
//! miles session --engine-url instant --model fixtures/tokenizers/qwen3 --tito qwen3 --port 30010 &
//! cargo run --release -p miles-session --example session_loadgen -- \
//!     --url http://127.0.0.1:30010 --sessions 64 --turns 8 --total-sessions 640 --server-pid $!
//! ```

use miles_session::loadgen::{LoadConfig, cpu_time, load_average, rss_kib, run};

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

fn number(args: &[String], name: &str, default: usize) -> usize {
    let value = arg(args, name, &default.to_string());
    value.parse().unwrap_or_else(|_| {
        eprintln!("{name} expects a number, got {value:?}");
        std::process::exit(2)
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sessions = number(&args, "--sessions", 1);
    let config = LoadConfig {
        url: arg(&args, "--url", "http://127.0.0.1:30010"),
        sessions,
        turns: number(&args, "--turns", 8),
        total_sessions: number(&args, "--total-sessions", sessions),
    };
    let threads = number(&args, "--threads", 1);
    let pid: Option<u32> = args
        .iter()
        .position(|a| a == "--server-pid")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let rss_before = pid.and_then(rss_kib);
    let cpu_before = pid.and_then(cpu_time);
    let report = match runtime.block_on(run(&config)) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("session_loadgen: {e}");
            std::process::exit(1)
        }
    };
    println!(
        "sessions={} turns/session={} total_sessions={} turns={} elapsed={:.2}s turns/s={:.0} p50={:.3}ms p99={:.3}ms load={:.2}",
        config.sessions,
        config.turns,
        report.sessions,
        report.turns,
        report.elapsed.as_secs_f64(),
        report.turns_per_sec(),
        report.percentile(0.5).as_secs_f64() * 1e3,
        report.percentile(0.99).as_secs_f64() * 1e3,
        load_average().unwrap_or(f64::NAN),
    );
    if let Some(pid) = pid {
        let cpu = cpu_time(pid)
            .zip(cpu_before)
            .map(|(after, before)| after.saturating_sub(before))
            .unwrap_or_default();
        println!(
            "server rss before={} KiB after={} KiB; server cpu {:.3} ms/turn",
            rss_before.unwrap_or(0),
            rss_kib(pid).unwrap_or(0),
            cpu.as_secs_f64() * 1e3 / report.turns.max(1) as f64
        );
    }
}
