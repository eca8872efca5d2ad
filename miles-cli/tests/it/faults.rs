//! The fault-injection suite of issue 45, against real processes: `miles train` on the tiny
//! Qwen3 chat checkpoint with a reward model over HTTPS that fails, is slow or is down; with
//! `miles serve` engines that die mid-run (one of two, then all); with a checkpoint folder
//! that cannot be written. Each case ends within a bound (a hang fails the test), with the exit
//! status and message a user reads, the failures counted, and nothing trained twice or lost.
//! (Agents that crash, hang or print garbage: `agent_failures.rs`.)

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::{
    Server, python, repo, scratch, start_serve, sum_prompts, tiny_chat_checkpoint, wait_exit,
};

/// `miles train` over the prompts: `rollouts` rollouts of 4 prompts × 2 samples, one step each.
fn train(dir: &Path, rollouts: usize) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_miles"));
    cmd.arg("train")
        .arg("--hf-checkpoint")
        .arg(tiny_chat_checkpoint())
        .arg("--prompt-data")
        .arg(sum_prompts(dir))
        .args(["--label-key", "label"])
        .args(["--num-rollout", &rollouts.to_string()])
        .args([
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "8",
            "--rollout-max-response-len",
            "4",
        ])
        .arg("--output-dir")
        .arg(dir.join("run"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// Runs `cmd` to its end within `limit` (a hang fails the test) and returns its output.
fn finish(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd.spawn().expect("miles starts");
    // Drain the pipes in threads so a chatty child never blocks on a full pipe.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut text);
            }
            text
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let status = wait_exit(&mut child, limit);
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

fn metric_sum(dir: &Path, key: &str) -> f64 {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|row| row[key].as_f64())
        .sum()
}

fn summary(dir: &Path) -> Value {
    let path = dir.join("run/summary.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!("{}: {e}", path.display());
    }))
    .unwrap()
}

/// A reward model over HTTPS (Python's `http.server` with the test CA's loopback certificate,
/// fixtures/tls). Modes: `flaky` answers the first call for each (prompt, response) with 500,
/// the second with 429 and `Retry-After: 1`, every later one with the reward 0.5 after 0.2 s;
/// `slow` sleeps 5 s before answering. Each call is logged as `status<TAB>key` to `log`.
const REWARD_SERVER: &str = r#"
import json, ssl, sys, threading, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
mode, log_path, cert, key = sys.argv[1:5]
seen, lock = {}, threading.Lock()
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def answer(self, status, body, headers=()):
        data = json.dumps(body).encode()
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = json.dumps([body["prompt"], body["response"], body["label"]])
        with lock:
            n = seen.get(key, 0)
            seen[key] = n + 1
        if mode == "slow":
            time.sleep(5)
        status = 200 if mode == "slow" or n >= 2 else (500, 429)[n]
        with lock, open(log_path, "a") as log:
            log.write("%d\t%s\n" % (status, key))
        if status == 500:
            self.answer(500, {"error": "injected"})
        elif status == 429:
            self.answer(429, {"error": "busy"}, [("Retry-After", "1")])
        else:
            time.sleep(0.2)
            self.answer(200, 0.5)
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;

/// A running reward server; killed on drop.
struct RewardServer {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for RewardServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn reward_server(dir: &Path, mode: &str) -> RewardServer {
    let script = dir.join("reward_server.py");
    std::fs::write(&script, REWARD_SERVER).unwrap();
    let log = dir.join(format!("reward-{mode}.log"));
    let mut child = Command::new(python())
        .arg(&script)
        .arg(mode)
        .arg(&log)
        .arg(repo("fixtures/tls/server.pem"))
        .arg(repo("fixtures/tls/server.key"))
        .stdout(Stdio::piped())
        // A client that gave up (timeout) makes the server print a traceback: not ours to see.
        .stderr(Stdio::null())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().expect("the server prints its port");
    RewardServer {
        child,
        url: format!("https://127.0.0.1:{port}/reward"),
        log,
    }
}

/// A `miles train` over a reward server: trusts the test CA through `SSL_CERT_FILE`, as a
/// user's private CA would be trusted.
fn train_with_reward(dir: &Path, url: &str, extra: &[&str]) -> Command {
    let mut cmd = train(dir, 2);
    cmd.args(["--rm-type", "remote_rm", "--rm-url", url])
        .args(extra)
        .env("SSL_CERT_FILE", repo("fixtures/tls/ca.pem"));
    cmd
}

#[test]
fn a_flaky_reward_model_over_https_is_retried_and_every_sample_scored_once() {
    let dir = scratch("faults-rm-flaky");
    let server = reward_server(&dir, "flaky");
    let out = finish(
        train_with_reward(&dir, &server.url, &[]),
        Duration::from_secs(300),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr:\n{stderr}");
    // Every sample's reward is the server's (0.5), though each (prompt, response) first got a
    // 500 and a 429.
    assert_eq!(summary(&dir)["weight_version"], 2);
    let raw: Vec<f64> = std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|row| row["rollout/raw_reward"].as_f64())
        .collect();
    assert_eq!(raw, vec![0.5, 0.5], "one mean reward per rollout");
    // Calls per (prompt, response): a 500, a 429, then one 200 per sample that has it —
    // 2 rollouts × 4 prompts × 2 samples = 16 answered calls in all: none scored twice or lost.
    let mut calls: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for line in std::fs::read_to_string(&server.log).unwrap().lines() {
        let (status, key) = line.split_once('\t').unwrap();
        calls
            .entry(key.to_owned())
            .or_default()
            .push(status.parse().unwrap());
    }
    let answered: usize = calls
        .values()
        .map(|s| s.iter().filter(|&&c| c == 200).count())
        .sum();
    assert_eq!(answered, 16, "{calls:?}");
    for statuses in calls.values() {
        assert_eq!(statuses[..2], [500, 429], "{calls:?}");
        assert!(statuses[2..].iter().all(|&c| c == 200), "{calls:?}");
    }
    assert_eq!(metric_sum(&dir, "rollout/failed_samples/reward"), 0.0);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_reward_model_that_is_down_or_too_slow_stops_the_run_naming_it() {
    for mode in ["down", "slow"] {
        let dir = scratch(&format!("faults-rm-{mode}"));
        let server = (mode == "slow").then(|| reward_server(&dir, "slow"));
        let url = match &server {
            Some(server) => server.url.clone(),
            None => {
                // A port that was just free: nothing listens there.
                let listener = TcpListener::bind("127.0.0.1:0").unwrap();
                let port = listener.local_addr().unwrap().port();
                drop(listener);
                format!("https://127.0.0.1:{port}/reward")
            }
        };
        let started = Instant::now();
        let out = finish(
            train_with_reward(
                &dir,
                &url,
                &["--rm-timeout-s", "0.5", "--max-consecutive-failures", "8"],
            ),
            Duration::from_secs(300),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{mode}: stderr:\n{stderr}");
        assert!(
            stderr.contains("8 samples in a row failed") && stderr.contains(&url),
            "{mode}: the message names the failures and the reward model: {stderr}"
        );
        let reason = if mode == "down" {
            "refused"
        } else {
            "timed out"
        };
        assert!(stderr.contains(reason), "{mode}: {stderr}");
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{mode}: bounded, took {:?}",
            started.elapsed()
        );
        assert!(
            !dir.join("run/summary.json").exists() || summary(&dir)["weight_version"] == 0,
            "{mode}: nothing trained on failed rewards"
        );
        drop(server);
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Starts `miles serve` on the checkpoint, reading weight updates under `root`, on `port`
/// (0: any); a port just freed by a killed server may take a moment to bind again: retried
/// for 30 s.
fn serve(port: u16, root: &Path) -> Server {
    let until = Instant::now() + Duration::from_secs(30);
    let extra = [std::ffi::OsStr::new("--weights-root"), root.as_os_str()];
    loop {
        match start_serve(&tiny_chat_checkpoint(), port, &extra, Stdio::null()) {
            Ok(server) => return server,
            Err(line) => assert!(
                Instant::now() < until,
                "miles serve did not start: {line:?}"
            ),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn port_of(url: &str) -> u16 {
    url.rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .parse()
        .unwrap()
}

/// The last training step `metrics.jsonl` holds so far (0 also when none).
fn steps_done(dir: &Path) -> u64 {
    steps(dir).into_iter().max().unwrap_or(0)
}

/// Polls `done` every 50 ms until it holds; fails the test after `limit` or when `child`
/// ends first.
fn wait_for(child: &mut Child, limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + limit;
    while !done() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before {what}");
        }
        assert!(Instant::now() < until, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The run's stderr so far (it writes to a file, read while it runs).
fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default()
}

/// `miles train` over `engines` (`--engine-url` each, health-checked every 0.2 s), its
/// stderr to `dir/stderr.log`.
fn train_on(dir: &Path, rollouts: usize, engines: &[&Server], extra: &[&str]) -> Child {
    let mut cmd = train(dir, rollouts);
    cmd.args([
        "--rm-type",
        "exact_match",
        "--rollout-health-check-interval",
        "0.2",
    ]);
    for engine in engines {
        cmd.args(["--engine-url", &engine.url]);
    }
    cmd.args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr.log")).unwrap());
    cmd.spawn().expect("miles starts")
}

fn weight_version_of(engine: &Server) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = miles_session::http::HttpClient::new(Duration::from_secs(10));
    let answer = rt
        .block_on(client.get(&format!("{}/get_weight_version", engine.url)))
        .unwrap();
    let body: Value = answer.json().unwrap();
    body["weight_version"].as_str().unwrap().parse().unwrap()
}

/// Every step `metrics.jsonl` holds, in order.
fn steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("run/metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|row| row.get("train/pg_loss").is_some())
        .filter_map(|row| row["step"].as_u64())
        .collect()
}

#[test]
fn an_engine_killed_mid_run_is_routed_around_and_readmitted_with_the_current_weights() {
    let dir = scratch("faults-engine-one");
    let mut a = serve(0, &dir);
    let b = serve(0, &dir);
    // Long enough to outlast the kill and the restart; stopped with SIGTERM below.
    let mut run = train_on(&dir, 10_000, &[&a, &b], &[]);
    let limit = Duration::from_secs(300);
    wait_for(&mut run, limit, "a first step", || steps_done(&dir) >= 1);
    // SIGKILL engine-0 mid-run; the run goes on over engine-1.
    let port = port_of(&a.url);
    let _ = a.child.kill();
    let _ = a.child.wait();
    wait_for(&mut run, limit, "engine-0 out of rotation", || {
        log(&dir).contains("engine removed from rotation")
    });
    let after_kill = steps_done(&dir);
    wait_for(&mut run, limit, "a step without engine-0", || {
        steps_done(&dir) > after_kill
    });
    // Restarted on its port (its own, initial weights), it is brought to the fleet's
    // weights and re-admitted, then takes every later update with engine-1.
    a = serve(port, &dir);
    wait_for(&mut run, limit, "engine-0 re-admitted", || {
        log(&dir).contains("engine re-admitted")
    });
    let readmitted_at = steps_done(&dir);
    wait_for(&mut run, limit, "two steps with engine-0 back", || {
        steps_done(&dir) >= readmitted_at + 2
    });
    crate::process::send_signal(&run, libc::SIGTERM);
    let status = wait_exit(&mut run, limit);
    let stderr = log(&dir);
    assert_eq!(status.code(), Some(143), "stderr:\n{stderr}");
    assert!(
        stderr.contains("engine-0") && !stderr.contains("samples in a row failed"),
        "{stderr}"
    );
    // No step lost or trained twice: 0, 1, …, n - 1, each once.
    let steps = steps(&dir);
    let n = steps.len() as u64;
    assert_eq!(steps, (0..n).collect::<Vec<_>>());
    // Both engines end on the same, newest weights.
    let (va, vb) = (weight_version_of(&a), weight_version_of(&b));
    assert_eq!(va, vb, "{stderr}");
    assert!(
        va > readmitted_at,
        "engine-0 took updates after re-admission: {va}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Checkpoint folders (each with its manifest) under `save`.
fn checkpoints(save: &Path) -> usize {
    std::fs::read_dir(save)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().join("manifest.json").exists())
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn all_engines_down_stops_the_run_after_a_bounded_wait_and_load_resumes_it() {
    let dir = scratch("faults-engine-all");
    let save = dir.join("ckpt");
    let save_flags = ["--save", save.to_str().unwrap(), "--save-interval", "1"];
    let engine = serve(0, &dir);
    let rollouts = 16;
    let mut flags = vec!["--engine-wait-s", "2", "--max-consecutive-failures", "4"];
    flags.extend(save_flags);
    let mut run = train_on(&dir, rollouts, &[&engine], &flags);
    let limit = Duration::from_secs(300);
    wait_for(&mut run, limit, "a first checkpoint", || {
        checkpoints(&save) >= 1
    });
    drop(engine);
    let stopped = Instant::now();
    let status = wait_exit(&mut run, limit);
    let stderr = log(&dir);
    assert_eq!(status.code(), Some(1), "stderr:\n{stderr}");
    assert!(
        stderr.contains("no engine in rotation after waiting 2.0 s"),
        "the message says what happened: {stderr}"
    );
    assert!(
        stopped.elapsed() < Duration::from_secs(120),
        "bounded: {:?}",
        stopped.elapsed()
    );
    let done = steps_done(&dir);
    assert!(done < rollouts as u64, "it stopped mid-run at {done}");
    assert!(checkpoints(&save) >= 1, "the checkpoints are intact");
    // With an engine back, `--load` resumes after the last checkpoint and ends the run: every
    // step once (the steps after the last checkpoint are redone, none is skipped).
    let engine = serve(0, &dir);
    let mut cmd = train(&dir, rollouts);
    cmd.args(["--rm-type", "exact_match", "--engine-url", &engine.url])
        .args(save_flags)
        .arg("--load")
        .arg(&save);
    let out = finish(cmd, limit);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("resumed at step"), "{stdout}");
    assert_eq!(summary(&dir)["weight_version"], rollouts);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_that_cannot_be_written_stops_the_run_naming_the_path() {
    let dir = scratch("faults-ckpt-write");
    // A regular file where the checkpoint folder's parent should be (root ignores read-only
    // permissions; a file in the path fails for everyone).
    let blocker = dir.join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let save = blocker.join("ckpt");
    let mut cmd = train(&dir, 4);
    cmd.args(["--rm-type", "exact_match", "--save-interval", "1", "--save"])
        .arg(&save);
    let out = finish(cmd, Duration::from_secs(300));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(
        stderr.contains(&blocker.display().to_string()),
        "the message names the path: {stderr}"
    );
    assert!(steps_done(&dir) <= 1, "it stopped at the first checkpoint");
    std::fs::remove_dir_all(&dir).ok();
}
