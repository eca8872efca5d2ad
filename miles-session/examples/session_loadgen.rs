//! Closed-loop load generator for a running `miles-session` server (a separate process).
//!
//! Each of `--sessions` workers repeatedly opens a session, runs `--turns` tool-calling turns
//! (user asks for the weather → tool call → tool result → answer → next question …), then
//! deletes it, until `--total-sessions` sessions are done. Prints turns/s and client-observed
//! per-turn latency percentiles; with `--server-pid` also the server's resident memory before
//! and after.
//!
//! ```text
//! miles-session --engine-url toy --tito byte_chatml --port 30010 &
//! cargo run --release -p miles-session --example session_loadgen -- \
//!     --url http://127.0.0.1:30010 --sessions 64 --turns 8 --total-sessions 640 --server-pid $!
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use miles_session::http::HttpClient;
use serde_json::{Value, json};

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// utime + stime of a process, in clock ticks (100 per second on Linux).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_owned())
}

async fn session(
    http: &HttpClient,
    url: &str,
    turns: usize,
    worker: usize,
    latencies: &mut Vec<Duration>,
) -> Result<(), String> {
    let created: Value = http
        .post_json(&format!("{url}/sessions"), &json!({}), &[])
        .await
        .map_err(|e| e.to_string())?
        .json()
        .map_err(|e| e.to_string())?;
    let id = created["session_id"]
        .as_str()
        .ok_or("no session id")?
        .to_owned();
    let chat = format!("{url}/sessions/{id}/v1/chat/completions");
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut messages =
        vec![json!({"role": "system", "content": "You are a helpful assistant with tools."})];
    let cities = [
        "Paris", "Lyon", "Oslo", "Rome", "Kyoto", "Lima", "Accra", "Perth",
    ];
    let mut pending_tool: Option<Value> = None;
    for t in 0..turns {
        match pending_tool.take() {
            Some(call_id) => messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": format!("sunny and {} degrees", 10 + t)})),
            None => messages.push(json!({"role": "user", "content": format!("What is the weather in {}?", cities[(worker + t) % cities.len()])})),
        }
        let body = json!({"model": "m", "messages": messages, "tools": tools, "max_tokens": 256});
        let started = Instant::now();
        let r = http
            .post_json(&chat, &body, &[])
            .await
            .map_err(|e| e.to_string())?;
        latencies.push(started.elapsed());
        if r.status != 200 {
            return Err(format!("turn {t}: {} {}", r.status, r.text()));
        }
        let v: Value = r.json().map_err(|e| e.to_string())?;
        let message = v["choices"][0]["message"].clone();
        if let Some(call) = message["tool_calls"].get(0) {
            pending_tool = Some(call["id"].clone());
        }
        messages.push(message);
    }
    let r = http
        .send(
            hyper::Method::DELETE,
            &format!("{url}/sessions/{id}"),
            &[],
            None,
        )
        .await
        .map_err(|e| e.to_string())?;
    if r.status != 204 {
        return Err(format!("delete: {}", r.status));
    }
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--url", "http://127.0.0.1:30010");
    let workers: usize = arg(&args, "--sessions", "1").parse().expect("--sessions");
    let turns: usize = arg(&args, "--turns", "8").parse().expect("--turns");
    let total: usize = arg(&args, "--total-sessions", &workers.to_string())
        .parse()
        .expect("--total-sessions");
    let pid: Option<u32> = args
        .iter()
        .position(|a| a == "--server-pid")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok());
    let http = HttpClient::new(Duration::from_secs(120));
    let rss_before = pid.and_then(rss_kib);
    let cpu_before = pid.and_then(cpu_ticks);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut handles = Vec::new();
    for w in 0..workers {
        let (http, url, next) = (http.clone(), url.clone(), next.clone());
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                if let Err(e) = session(&http, &url, turns, w, &mut lat).await {
                    eprintln!("worker {w}: {e}");
                    break;
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.expect("worker"));
    }
    let elapsed = started.elapsed().as_secs_f64();
    all.sort();
    println!(
        "sessions={workers} turns/session={turns} total_sessions={total} turns={} elapsed={elapsed:.2}s turns/s={:.0} p50={:.3}ms p99={:.3}ms",
        all.len(),
        all.len() as f64 / elapsed,
        percentile(&all, 0.5),
        percentile(&all, 0.99)
    );
    if let Some(pid) = pid {
        let cpu = cpu_ticks(pid)
            .unwrap_or(0)
            .saturating_sub(cpu_before.unwrap_or(0));
        println!(
            "server rss before={} KiB after={} KiB; server cpu {:.3} ms/turn",
            rss_before.unwrap_or(0),
            rss_kib(pid).unwrap_or(0),
            cpu as f64 * 10.0 / all.len().max(1) as f64
        );
    }
}
