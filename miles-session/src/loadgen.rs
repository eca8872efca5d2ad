//! A closed-loop load generator for a running session server, and a handle on a server
//! process, shared by `examples/session_loadgen.rs`, `benches/session_load.rs` and the memory
//! test (the load always comes from another process than the server's).
//!
//! Each of [`LoadConfig::sessions`] workers repeatedly opens a session, runs
//! [`LoadConfig::turns`] tool-calling turns (user asks for the weather → the model calls
//! `get_weather` → the tool answers → the model answers → next question …) sending the whole
//! history each turn as an OpenAI client does, then deletes the session, until
//! [`LoadConfig::total_sessions`] sessions are done.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::http::HttpClient;

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Server base URL (`http://127.0.0.1:PORT`).
    pub url: String,
    /// Concurrent closed-loop sessions (workers).
    pub sessions: usize,
    /// Chat turns per session.
    pub turns: usize,
    /// Sessions to run in all (created, driven and deleted).
    pub total_sessions: usize,
}

/// What a run measured (client side).
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Chat turns completed.
    pub turns: usize,
    /// Sessions created and deleted.
    pub sessions: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Client-observed latency of every turn, sorted.
    pub latencies: Vec<Duration>,
}

impl LoadReport {
    /// Turns per second over the run.
    pub fn turns_per_sec(&self) -> f64 {
        self.turns as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The `p`-quantile (0..=1) of the turn latencies (nearest rank; zero when empty).
    pub fn percentile(&self, p: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() as f64 - 1.0) * p.clamp(0.0, 1.0)).round() as usize;
        self.latencies[i]
    }
}

const CITIES: [&str; 8] = [
    "Paris", "Lyon", "Oslo", "Rome", "Kyoto", "Lima", "Accra", "Perth",
];

/// The tool every request declares, as JSON text.
const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

/// The part of a chat completion the client reads: the first choice's message. The rest of
/// the response (`meta_info` with its per-token log-probs, `logprobs`, `usage`) is skipped
/// while parsing, without building values for it, as a lean OpenAI client would.
#[derive(serde::Deserialize)]
struct Completion {
    choices: Vec<Choice>,
}

#[derive(serde::Deserialize)]
struct Choice {
    message: Value,
}

/// The chat-completions body from the history kept as JSON text, one entry per message (each
/// message is serialised once, when it joins the history).
fn chat_body(history: &[String]) -> Vec<u8> {
    let size = history.iter().map(|m| m.len() + 1).sum::<usize>() + TOOLS.len() + 64;
    let mut body = String::with_capacity(size);
    body.push_str(r#"{"model":"m","messages":["#);
    for (i, message) in history.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(message);
    }
    body.push_str(r#"],"tools":"#);
    body.push_str(TOOLS);
    body.push_str(r#","max_tokens":256}"#);
    body.into_bytes()
}

fn fail(reason: String) -> Error {
    Error::UpstreamResponse { reason }
}

/// One session: create, `turns` tool-calling turns, delete. Latencies are appended.
pub async fn run_session(
    http: &HttpClient,
    url: &str,
    turns: usize,
    seed: usize,
    latencies: &mut Vec<Duration>,
) -> Result<()> {
    let created: Value = http
        .post_json(&format!("{url}/sessions"), &json!({}), &[])
        .await?
        .json()?;
    let id = created["session_id"]
        .as_str()
        .ok_or_else(|| fail(format!("no session id in {created}")))?
        .to_owned();
    let chat = format!("{url}/sessions/{id}/v1/chat/completions");
    let mut history = vec![
        json!({"role": "system", "content": "You are a helpful assistant with tools."}).to_string(),
    ];
    let mut pending_tool: Option<Value> = None;
    for t in 0..turns {
        let next = match pending_tool.take() {
            Some(call_id) => {
                json!({"role": "tool", "tool_call_id": call_id, "content": format!("sunny and {} degrees", 10 + t)})
            }
            None => {
                json!({"role": "user", "content": format!("What is the weather in {}?", CITIES[(seed + t) % CITIES.len()])})
            }
        };
        history.push(next.to_string());
        let body = chat_body(&history);
        let started = Instant::now();
        let response = http
            .send(
                hyper::Method::POST,
                &chat,
                &[],
                Some(("application/json", body)),
            )
            .await?;
        latencies.push(started.elapsed());
        if response.status != 200 {
            return Err(fail(format!(
                "turn {t}: {} {}",
                response.status,
                response.text()
            )));
        }
        let completion: Completion = response.json()?;
        let message = completion
            .choices
            .into_iter()
            .next()
            .ok_or_else(|| fail(format!("turn {t}: no choice")))?
            .message;
        if let Some(call) = message["tool_calls"].get(0) {
            pending_tool = Some(call["id"].clone());
        }
        history.push(message.to_string());
    }
    let response = http
        .send(
            hyper::Method::DELETE,
            &format!("{url}/sessions/{id}"),
            &[],
            None,
        )
        .await?;
    if response.status != 204 {
        return Err(fail(format!("delete: {}", response.status)));
    }
    Ok(())
}

/// Runs the closed loop; the first failing session stops the run with its error.
pub async fn run(config: &LoadConfig) -> Result<LoadReport> {
    let http = HttpClient::new(Duration::from_secs(300));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..config.sessions.max(1) {
        let (http, next, config) = (http.clone(), next.clone(), config.clone());
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut done = 0;
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= config.total_sessions {
                    break;
                }
                run_session(&http, &config.url, config.turns, worker + n, &mut latencies).await?;
                done += 1;
            }
            Ok::<_, Error>((latencies, done))
        });
    }
    let mut latencies = Vec::new();
    let mut sessions = 0;
    while let Some(joined) = workers.join_next().await {
        let (lat, done) = joined.map_err(|e| fail(format!("worker panicked: {e}")))??;
        latencies.extend(lat);
        sessions += done;
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    Ok(LoadReport {
        turns: latencies.len(),
        sessions,
        elapsed,
        latencies,
    })
}

/// Resident memory of a process in KiB (`VmRSS`; Linux `/proc`, `None` elsewhere).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// CPU time (user + system) a process used so far (Linux `/proc`, 100 ticks a second).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// The 1-minute load average (`/proc/loadavg`), to report beside measurements.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// A `miles-session` server running as a child process (killed on drop).
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    url: String,
}

impl ServerProcess {
    /// Starts `binary` with `args` (which should include `--port 0`) and waits for its
    /// `listening on http://ADDR` line.
    pub fn spawn(binary: &std::path::Path, args: &[&str]) -> Result<Self> {
        let mut child = Command::new(binary)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Config("no stdout from the server".into()))?;
        let mut lines = BufReader::new(stdout).lines();
        let url = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        break rest
                            .split_whitespace()
                            .next()
                            .unwrap_or_default()
                            .to_owned();
                    }
                }
                Some(Err(e)) => {
                    let _ = child.kill();
                    return Err(e.into());
                }
                None => {
                    let status = child.wait()?;
                    return Err(Error::Config(format!("server exited early ({status})")));
                }
            }
        };
        Ok(Self { child, url })
    }

    /// The server's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
