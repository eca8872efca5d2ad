//! Session-server load benchmark (issue 4, point 6; issue 46, point 6): `miles session` and
//! Miles' own Python session server, each in its own process, in front of **one
//! SGLang-compatible backend** over real HTTP on 127.0.0.1, driven by the closed-loop load
//! generator of [`miles_session::loadgen`] running in this (separate) process: 8-turn
//! tool-calling conversations at 1, 64 and 1,024 concurrent sessions, the same load on both
//! servers and on the backend alone (the floor). Then a create / delete run of 10,000
//! sessions on ours checks that its resident memory comes back within 10 % of its baseline
//! (the run fails otherwise).
//!
//! The backend is this bench binary started again with `--session-load-backend`: miles-session's
//! SGLang server ([`miles_session::sglang::sglang_router`], the routes `miles serve` serves)
//! over the [`miles_session::testkit::InstantEngine`] (pre-tokenized tool-call / answer replies
//! in the real Qwen3 tokenizer's ids, no model cost), so what is measured is each session
//! server's own cost plus one HTTP hop. Ours reaches it through `/generate`
//! (`miles session --engine-url URL --model fixtures/tokenizers/qwen3 --tito qwen3`), Miles'
//! through `/v1/chat/completions` with `input_ids`, `logprobs` and `return_meta_info`, as each
//! does against SGLang. The backend-alone rows (the floor) send each turn's prompt as token
//! ids (rendered once at start with the Qwen3 template) straight to its `/generate`, what a
//! session server sends once it has tokenized the turn; "added latency" is the p50 through a
//! session server minus that floor's p50 at the same concurrency.
//!
//! At 1,024 sessions the load generator's hyper pool holds a few more than 1,024 connections
//! (it keeps the connection it started when an idle one was handed to the request first);
//! `miles session` accepts 1,024 at once (`--max-connections`), so one waits for a slot, which
//! the next response frees (`Connection: close`, `miles_session::guard::serve`). Before that,
//! the waiting connection — the pool's newest, reused next — stayed in the listen backlog
//! until an idle connection timed out: one 10.0 s turn in the table's `max ms` column. The
//! servers listen with a backlog of 4,096 (`guard::bind`; tokio's default of 1,024 overflowed
//! when 1,024 sessions connected at once, and a dropped SYN is retried only after a second).
//!
//! **Miles' server** is `miles.rollout.session.server.run_session_server` (the process Miles
//! starts for `--use-session-server`: FastAPI + uvicorn, an httpx client, its TITO with the
//! `qwen3` fixed template), run by `benches/miles_session_server.py` when
//! `MILES_SESSION_PYTHONPATH` names a Miles source tree and its Python dependencies (joined as
//! a `PYTHONPATH`), with the Python of `MILES_TORCH_PYTHON` or the workspace's `.venv-ref`. How
//! to make that install is in miles-session's README ("Load test and benchmark"). Without it,
//! or when it fails to start, Miles' figures are issue 4's constants (measured on the reference
//! machine against a mock backend) and every row says so.
//!
//! `xtask-result:` lines put the comparison in `cargo xtask bench`'s table: `session_turns_N`
//! is ours' turns/s at N sessions against Miles', `session_p50_N` the median added latency per
//! turn (p50 through the server minus p50 of the backend alone at the same concurrency),
//! `session_floor_turns_N` ours' turns/s against the backend alone, `session_rss_*` and
//! `session_peak_rss` resident memory. The machine line and the notes name the CPU model.
//!
//! Environment: `MILES_SESSION_BENCH_MEMORY_SESSIONS` (default 10000),
//! `MILES_SESSION_BENCH_CLIENT_THREADS` (default 1), `MILES_SESSION_PYTHONPATH`,
//! `MILES_TORCH_PYTHON`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::Method;
use miles_core::{Message, ToolSpec};
use miles_session::guard::GuardConfig;
use miles_session::http::HttpClient;
use miles_session::loadgen::{
    LoadConfig, LoadReport, ServerProcess, cpu_time, load_average, rss_kib, run,
};
use miles_session::sglang::{ServerInfo, load_chat_tokenizer, serve, sglang_router};
use miles_session::testkit::InstantEngine;
use serde_json::{Value, json};

/// Miles' session server on the reference machine (issue 4, against a mock backend): turns/s
/// and p50 added latency at 1 / 64 / 1,024 sessions, resident memory after start. Used only
/// when Miles cannot be measured in the run.
const MILES_TURNS_PER_SEC: [(usize, f64); 3] = [(1, 168.0), (64, 153.0), (1024, 98.0)];
const MILES_P50_MS: [(usize, f64); 3] = [(1, 4.7), (64, 285.0), (1024, 5100.0)];
const MILES_RSS_MIB: f64 = 936.0;
/// Targets of issue 4 (absolute; set for the server alone, here it also pays the hop to the
/// backend, which shares the machine).
const TARGET_TURNS_PER_SEC: [(usize, f64); 2] = [(64, 5000.0), (1024, 4000.0)];
const TARGET_P50_MS_AT_1: f64 = 0.5;
const TARGET_RSS_MIB: f64 = 100.0;
/// The argument that makes this binary the backend.
const BACKEND_ARG: &str = "--session-load-backend";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn mib(kib: Option<u64>) -> f64 {
    kib.map_or(f64::NAN, |k| k as f64 / 1024.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Peak resident memory of a process in KiB (`VmHWM`; Linux `/proc`, `None` elsewhere).
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The CPU model (`/proc/cpuinfo`), to name beside the figures.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn qwen3_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3")
}

/// The backend process: SGLang's routes over the instant engine, Qwen3 tokenizer.
fn serve_backend() {
    let dir = qwen3_dir();
    let tokenizer = load_chat_tokenizer(&dir, Some("qwen3"), None)
        .expect("load the Qwen3 tokenizer")
        .expect("fixtures/tokenizers/qwen3 has a tokenizer.json");
    let engine = InstantEngine::for_chatml(tokenizer.as_ref()).expect("instant engine");
    let info = ServerInfo::new("qwen3").with_tokenizer(tokenizer, dir.to_string_lossy());
    // Both session servers may hold a connection per concurrent session.
    let guard = GuardConfig::default()
        .with_max_connections(Some(16_384))
        .with_max_concurrent_requests(Some(16_384));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime
        .block_on(serve(sglang_router(engine, info), "127.0.0.1", 0, guard))
        .expect("serve the backend");
}

/// The tool the conversations declare (as `loadgen`'s).
fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
}

const CITIES: [&str; 8] = [
    "Paris", "Lyon", "Oslo", "Rome", "Kyoto", "Lima", "Accra", "Perth",
];

/// One conversation of `loadgen`'s shape through the backend's own chat route (messages in,
/// no session), returning the message list of each turn's request: used once per city to
/// learn the prompts the floor then sends as token ids.
async fn chat_conversation(
    http: &HttpClient,
    url: &str,
    turns: usize,
    seed: usize,
) -> Result<Vec<Vec<Value>>, String> {
    let chat = format!("{url}/v1/chat/completions");
    let mut messages =
        vec![json!({"role": "system", "content": "You are a helpful assistant with tools."})];
    let mut requests = Vec::new();
    let mut pending_tool: Option<Value> = None;
    for t in 0..turns {
        messages.push(match pending_tool.take() {
            Some(id) => {
                json!({"role": "tool", "tool_call_id": id, "content": format!("sunny and {} degrees", 10 + t)})
            }
            None => {
                json!({"role": "user", "content": format!("What is the weather in {}?", CITIES[(seed + t) % CITIES.len()])})
            }
        });
        requests.push(messages.clone());
        let body = json!({"model": "m", "messages": messages, "tools": tools(), "max_tokens": 256});
        let response = http
            .post_json(&chat, &body, &[])
            .await
            .map_err(|e| e.to_string())?;
        if response.status != 200 {
            return Err(format!("turn {t}: {} {}", response.status, response.text()));
        }
        let answer: Value = response.json().map_err(|e| e.to_string())?;
        let message = answer["choices"][0]["message"].clone();
        if let Some(call) = message["tool_calls"].get(0) {
            pending_tool = Some(call["id"].clone());
        }
        messages.push(message);
    }
    Ok(requests)
}

/// The floor's requests: for each city (`loadgen`'s conversations differ only by it) and
/// turn, the `/generate` body a session server sends for that turn (the prompt as token
/// ids, rendered once here with the Qwen3 chat template).
fn floor_bodies(
    runtime: &tokio::runtime::Runtime,
    backend: &str,
    turns: usize,
) -> Vec<Vec<Vec<u8>>> {
    let tokenizer = load_chat_tokenizer(&qwen3_dir(), Some("qwen3"), None)
        .expect("load the Qwen3 tokenizer")
        .expect("fixtures/tokenizers/qwen3 has a tokenizer.json");
    let tools: Vec<ToolSpec> = serde_json::from_value(tools()).expect("tool specs");
    let http = HttpClient::new(Duration::from_secs(60));
    (0..CITIES.len())
        .map(|seed| {
            let requests = runtime
                .block_on(chat_conversation(&http, backend, turns, seed))
                .unwrap_or_else(|e| panic!("conversation on the backend failed: {e}"));
            requests
                .iter()
                .map(|messages| {
                    let messages: Vec<Message> =
                        serde_json::from_value(Value::Array(messages.clone())).expect("messages");
                    let ids = tokenizer
                        .render(&messages, &tools, true, &tokenizer.forced_kwargs())
                        .expect("render the prompt");
                    serde_json::to_vec(&json!({"input_ids": ids,
                        "sampling_params": {"max_new_tokens": 256}, "return_logprob": true}))
                    .expect("body")
                })
                .collect()
        })
        .collect()
}

/// The closed loop of [`run`] on the backend alone: each "session" sends its turns' prompts
/// as token ids to `/generate`, as a session server does once it has tokenized them.
async fn run_floor(
    config: &LoadConfig,
    bodies: Arc<Vec<Vec<Vec<u8>>>>,
) -> Result<LoadReport, String> {
    let http = HttpClient::new(Duration::from_secs(300));
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..config.sessions.max(1) {
        let (http, next, config, bodies) =
            (http.clone(), next.clone(), config.clone(), bodies.clone());
        workers.spawn(async move {
            let generate = format!("{}/generate", config.url);
            let mut latencies = Vec::new();
            let mut done = 0;
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= config.total_sessions {
                    break;
                }
                for body in bodies[(worker + n) % bodies.len()]
                    .iter()
                    .take(config.turns)
                {
                    let started = Instant::now();
                    let response = http
                        .send(
                            Method::POST,
                            &generate,
                            &[],
                            Some(("application/json", body.clone())),
                        )
                        .await
                        .map_err(|e| e.to_string())?;
                    latencies.push(started.elapsed());
                    if response.status != 200 {
                        return Err(format!(
                            "/generate: {} {}",
                            response.status,
                            response.text()
                        ));
                    }
                    let _: Value = response.json().map_err(|e| e.to_string())?;
                }
                done += 1;
            }
            Ok::<_, String>((latencies, done))
        });
    }
    let mut latencies = Vec::new();
    let mut sessions = 0;
    while let Some(joined) = workers.join_next().await {
        let (lat, done) = joined.map_err(|e| format!("worker panicked: {e}"))??;
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

struct Measured {
    sessions: usize,
    report: LoadReport,
    server_cpu_per_turn: Option<Duration>,
}

impl Measured {
    fn p50_ms(&self) -> f64 {
        ms(self.report.percentile(0.5))
    }
}

/// Drives `server` with `sessions` concurrent sessions, `total_sessions` in all; with `floor`
/// bodies, `server` is the backend and gets them straight ([`run_floor`]).
fn drive(
    runtime: &tokio::runtime::Runtime,
    server: &ServerProcess,
    sessions: usize,
    total_sessions: usize,
    floor: Option<&Arc<Vec<Vec<Vec<u8>>>>>,
) -> Measured {
    let config = LoadConfig {
        url: server.url().to_owned(),
        sessions,
        turns: 8,
        total_sessions,
    };
    let cpu_before = cpu_time(server.pid());
    let report = if let Some(bodies) = floor {
        runtime.block_on(run_floor(&config, bodies.clone()))
    } else {
        runtime.block_on(run(&config)).map_err(|e| e.to_string())
    }
    .unwrap_or_else(|e| {
        panic!(
            "load run on {} with {sessions} sessions failed: {e}",
            config.url
        )
    });
    let server_cpu_per_turn = cpu_time(server.pid())
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before) / report.turns.max(1) as u32);
    Measured {
        sessions,
        report,
        server_cpu_per_turn,
    }
}

/// One server's runs, its resident memory after start and at the end.
struct ServerRuns {
    name: &'static str,
    runs: Vec<Measured>,
    rss_start: Option<u64>,
    peak_rss: Option<u64>,
}

impl ServerRuns {
    fn at(&self, sessions: usize) -> Option<&Measured> {
        self.runs.iter().find(|m| m.sessions == sessions)
    }
}

/// Warms `server` up, then runs `plan`.
fn measure(
    name: &'static str,
    runtime: &tokio::runtime::Runtime,
    server: &ServerProcess,
    plan: &[(usize, usize)],
    floor: Option<&Arc<Vec<Vec<Vec<u8>>>>>,
) -> ServerRuns {
    let rss_start = rss_kib(server.pid());
    drive(runtime, server, 64, 64, floor);
    let runs = plan
        .iter()
        .map(|&(sessions, total)| drive(runtime, server, sessions, total, floor))
        .collect();
    ServerRuns {
        name,
        runs,
        rss_start,
        peak_rss: peak_rss_kib(server.pid()),
    }
}

/// Starts Miles' Python session server in front of `backend` (see the module docs); `None`
/// (and why, on stderr) when it is not set up or does not start.
fn start_miles(backend: &str) -> Option<(ServerProcess, PathBuf)> {
    let Some(pythonpath) = std::env::var_os("MILES_SESSION_PYTHONPATH") else {
        eprintln!(
            "session_load: Miles' session server not measured: MILES_SESSION_PYTHONPATH (a Miles \
             source tree and its Python dependencies) is not set"
        );
        return None;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var_os("MILES_TORCH_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../.venv-ref/bin/python"));
    let log = std::env::temp_dir().join(format!("miles_session_server_{}.log", std::process::id()));
    let script = root.join("benches/miles_session_server.py");
    // `env` execs the Python in place: the process is the server itself.
    let mut pythonpath_arg = std::ffi::OsString::from("PYTHONPATH=");
    pythonpath_arg.push(&pythonpath);
    let args = [
        pythonpath_arg,
        python.clone().into(),
        script.into(),
        backend.into(),
        qwen3_dir().into(),
        log.clone().into(),
    ];
    let args: Vec<&str> = args.iter().filter_map(|a| a.to_str()).collect();
    match ServerProcess::spawn(Path::new("/usr/bin/env"), &args) {
        Ok(server) => Some((server, log)),
        Err(e) => {
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let last = tail.lines().rev().find(|l| !l.trim().is_empty());
            eprintln!(
                "session_load: Miles' session server not measured: {} did not start ({e}): {}",
                python.display(),
                last.unwrap_or("no log")
            );
            None
        }
    }
}

fn constant(table: &[(usize, f64)], sessions: usize) -> Option<f64> {
    table.iter().find(|(s, _)| *s == sessions).map(|(_, v)| *v)
}

fn main() {
    if std::env::args().any(|a| a == BACKEND_ARG) {
        serve_backend();
        return;
    }
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too: keep that short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let cpu = cpu_model();
    let model = qwen3_dir();
    let model = model.to_string_lossy();
    let backend = ServerProcess::spawn(
        &std::env::current_exe().expect("this bench's path"),
        &[BACKEND_ARG],
    )
    .expect("start the backend");
    let ours = ServerProcess::spawn(
        Path::new(env!("CARGO_BIN_EXE_miles")),
        &[
            "session",
            "--engine-url",
            backend.url(),
            "--model",
            &model,
            "--tito",
            "qwen3",
            "--port",
            "0",
        ],
    )
    .expect("start miles session");
    let miles = start_miles(backend.url());
    std::thread::sleep(Duration::from_millis(200));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(env_usize("MILES_SESSION_BENCH_CLIENT_THREADS", 1).max(1))
        .enable_all()
        .build()
        .expect("tokio runtime");
    let load_before = load_average();

    // Throughput and latency: the same plan on the backend alone, ours and Miles'. Miles'
    // server is ~50x slower: fewer sessions in all, the same concurrency.
    let plan: [(usize, usize); 3] = if quick {
        [(1, 4), (64, 64), (1024, 1024)]
    } else {
        [(1, 250), (64, 1280), (1024, 3072)]
    };
    let miles_plan: [(usize, usize); 3] = if quick {
        [(1, 4), (64, 64), (1024, 1024)]
    } else {
        [(1, 50), (64, 320), (1024, 1024)]
    };
    let bodies = Arc::new(floor_bodies(&runtime, backend.url(), 8));
    let floor = measure("backend alone", &runtime, &backend, &plan, Some(&bodies));
    let ours_runs = measure("miles session", &runtime, &ours, &plan, None);
    let miles_runs = miles
        .as_ref()
        .map(|(server, _)| measure("Miles (Python)", &runtime, server, &miles_plan, None));
    if let Some((_, log)) = &miles {
        let _ = std::fs::remove_file(log);
    }
    drop(miles);

    // Memory: after the runs above, take ours' baseline, create / drive / delete N sessions,
    // then poll (up to 10 s) until the idle server has handed memory back.
    let pid = ours.pid();
    std::thread::sleep(Duration::from_millis(1500));
    let rss_baseline = rss_kib(pid);
    let memory_sessions = if quick {
        64
    } else {
        env_usize("MILES_SESSION_BENCH_MEMORY_SESSIONS", 10_000)
    };
    let memory_run = drive(&runtime, &ours, 64, memory_sessions, None);
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
    let load_after = load_average();

    let how = if miles_runs.is_some() {
        "Miles' Python session server measured in this run over the same backend"
    } else {
        "Miles' session server: issue 4 constant (reference machine, mock backend), not measured \
         here"
    };
    println!(
        "\nmiles-session load benchmark: Qwen3 tokenizer, qwen3 family, 8-turn tool-calling \
         sessions; both session servers in front of one SGLang-compatible backend (instant \
         engine) over HTTP on 127.0.0.1; load generator in a separate process"
    );
    println!(
        "machine: {cpu}, {} cores, 1-min load average {:.2} before / {:.2} after",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before.unwrap_or(f64::NAN),
        load_after.unwrap_or(f64::NAN)
    );
    println!("baseline: {how}");
    println!(
        "| server | sessions | turns | turns/s | p50 ms | p99 ms | max ms | added p50 ms | server CPU ms/turn |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut all = vec![&floor, &ours_runs];
    all.extend(miles_runs.as_ref());
    for server in &all {
        for m in &server.runs {
            let added = floor
                .at(m.sessions)
                .filter(|_| server.name != floor.name)
                .map_or_else(
                    || "-".to_string(),
                    |f| format!("{:.3}", m.p50_ms() - f.p50_ms()),
                );
            println!(
                "| {} | {} | {} | {:.0} | {:.3} | {:.3} | {:.1} | {added} | {} |",
                server.name,
                m.sessions,
                m.report.turns,
                m.report.turns_per_sec(),
                m.p50_ms(),
                ms(m.report.percentile(0.99)),
                ms(m.report.percentile(1.0)),
                m.server_cpu_per_turn
                    .map_or_else(|| "-".into(), |d| format!("{:.3}", ms(d))),
            );
        }
    }
    for server in &all {
        println!(
            "memory ({}): RSS {:.1} MiB after start, peak {:.1} MiB",
            server.name,
            mib(server.rss_start),
            mib(server.peak_rss)
        );
    }
    println!(
        "memory (miles session): {:.1} MiB baseline after the runs, {:.1} MiB after {} sessions \
         ({} turns) created and deleted at {:.0} turns/s",
        mib(rss_baseline),
        mib(rss_after),
        memory_run.report.sessions,
        memory_run.report.turns,
        memory_run.report.turns_per_sec(),
    );
    println!(
        "targets (issue 4, absolute): ≥ {} turns/s at 64, ≥ {} at 1,024, added p50 ≤ \
         {TARGET_P50_MS_AT_1} ms at 1 session, RSS ≤ {TARGET_RSS_MIB} MiB after start",
        TARGET_TURNS_PER_SEC[0].1, TARGET_TURNS_PER_SEC[1].1
    );

    for m in &ours_runs.runs {
        let n = m.sessions;
        let Some(f) = floor.at(n) else { continue };
        let miles_at = miles_runs.as_ref().and_then(|r| r.at(n));
        let Some((miles_tps, miles_p50)) = miles_at
            .map(|mm| (mm.report.turns_per_sec(), mm.p50_ms() - f.p50_ms()))
            .or_else(|| {
                Some((
                    constant(&MILES_TURNS_PER_SEC, n)?,
                    constant(&MILES_P50_MS, n)?,
                ))
            })
        else {
            continue;
        };
        let target = constant(&TARGET_TURNS_PER_SEC, n)
            .map_or_else(|| "-".to_string(), |t| format!(">={:.4}", t / miles_tps));
        println!(
            "xtask-result: session_turns_{n} ours={:.1}turns/s baseline={miles_tps:.1}turns/s \
             target={target} note=baseline: {how}; backend alone {:.0} turns/s; {cpu}",
            m.report.turns_per_sec(),
            f.report.turns_per_sec(),
        );
        // Added latency: p50 through the server minus the backend's own p50 at this
        // concurrency (floored at a microsecond: the difference of two medians).
        let ours_added = (m.p50_ms() - f.p50_ms()).max(0.001);
        let miles_added = miles_p50.max(0.001);
        let target = if n == 1 {
            format!("<={:.4}", TARGET_P50_MS_AT_1 / miles_added)
        } else {
            "-".to_string()
        };
        println!(
            "xtask-result: session_p50_{n} ours={ours_added:.4}ms baseline={miles_added:.4}ms \
             target={target} note=median added latency per turn over the backend alone (p50 \
             {:.3} ms through ours, {:.3} ms alone); baseline: {how}",
            m.p50_ms(),
            f.p50_ms(),
        );
        println!(
            "xtask-result: session_floor_turns_{n} ours={:.1}turns/s baseline={:.1}turns/s \
             note=ours against the backend alone (the floor: 1 would be no cost at all){}",
            m.report.turns_per_sec(),
            f.report.turns_per_sec(),
            miles_at.map_or_else(String::new, |mm| format!(
                "; Miles {:.1} turns/s",
                mm.report.turns_per_sec()
            )),
        );
    }
    let (miles_rss, miles_peak) = match &miles_runs {
        Some(r) => (mib(r.rss_start), Some(mib(r.peak_rss))),
        None => (MILES_RSS_MIB, None),
    };
    println!(
        "xtask-result: session_rss_start ours={:.1}MiB baseline={miles_rss:.1}MiB \
         target=<={:.4} note=resident memory after start; baseline: {how}; target: <= \
         {TARGET_RSS_MIB} MiB",
        mib(ours_runs.rss_start),
        TARGET_RSS_MIB / miles_rss
    );
    if let Some(miles_peak) = miles_peak {
        println!(
            "xtask-result: session_peak_rss ours={:.1}MiB baseline={miles_peak:.1}MiB note=peak \
             resident memory (VmHWM) over the runs at 1, 64 and 1,024 sessions; baseline: {how}",
            mib(ours_runs.peak_rss),
        );
    }
    if let (Some(base), Some(after)) = (rss_baseline, rss_after) {
        println!(
            "xtask-result: session_rss_after_churn ours={after}KiB baseline={base}KiB \
             target=<=1.10 note=resident memory after {} sessions created and deleted vs after \
             the runs",
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
