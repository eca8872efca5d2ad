//! `miles session` as a process: its key from the environment, slow clients dropped, the
//! warning a library crate emits reaching stderr through the log subscriber, and a clean stop
//! on SIGTERM that lets a request in flight finish.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use miles_session::guard::ApiKey;
use miles_session::http::{HttpClient, HttpResponse};
use serde_json::{Value, json};

use crate::process::{send_signal, wait_exit};

fn user(text: &str) -> Value {
    json!({"messages": [{"role": "user", "content": text}]})
}

fn assert_error(r: &HttpResponse, status: u16, kind: &str, code: &str) -> String {
    assert_eq!(r.status.as_u16(), status, "body: {}", r.text());
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    v["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn miles_session_takes_its_key_from_the_environment_and_drops_slow_clients() {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_miles"))
        .args([
            "session",
            "--engine-url",
            "toy",
            "--tito",
            "byte_chatml",
            "--port",
            "0",
            "--header-read-timeout-s",
            "0.5",
        ])
        .env("MILES_API_KEY", "from-the-env")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .next()
            .unwrap()
            .unwrap()
    })
    .await
    .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    assert!(line.contains("api key required"), "{line}");
    let base = line
        .split("listening on ")
        .nth(1)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_owned();
    assert!(
        base.starts_with("http://127.0.0.1:"),
        "loopback by default: {base}"
    );
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    let anon = HttpClient::new(Duration::from_secs(10));
    assert_eq!(
        anon.get(&format!("{base}/health")).await.unwrap().status,
        200
    );
    let r = anon
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap();
    assert_error(&r, 401, "authentication_error", "unauthorized");
    let keyed = HttpClient::new(Duration::from_secs(10))
        .with_api_key(Some(&ApiKey::new("from-the-env").unwrap()));
    let r = keyed
        .post_json(&format!("{base}/sessions"), &json!({}), &[])
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let id = r.json::<Value>().unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = keyed
        .post_json(
            &format!("{base}/sessions/{id}/v1/chat/completions"),
            &user("hello binary"),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // A client that sends half a request head is disconnected after the head timeout.
    let started = Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = Vec::new();
        match s.read_to_end(&mut buf) {
            Ok(_) => true,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    })
    .await
    .unwrap();
    assert!(closed, "the stalled connection stayed open");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
}

/// Starts `miles session` over the toy engine with `extra` flags; returns the child and the
/// base URL from its `listening on` line (stderr piped for the caller).
fn start(extra: &[&str]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args([
            "session",
            "--engine-url",
            "toy",
            "--tito",
            "byte_chatml",
            "--port",
            "0",
        ])
        .args(extra)
        .env_remove("MILES_API_KEY")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .split("listening on ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .to_owned();
    (child, url)
}

#[test]
fn a_library_warning_reaches_stderr_and_sigterm_stops_with_status_0() {
    // miles-session warns (tracing::warn!) when it serves beyond loopback without a key.
    let (mut child, url) = start(&["--host", "0.0.0.0"]);
    assert!(url.starts_with("http://0.0.0.0:"), "{url}");
    send_signal(&child, libc::SIGTERM);
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "a clean stop exits 0");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let warning = stderr
        .lines()
        .find(|l| l.contains("without --api-key"))
        .unwrap_or_else(|| panic!("no warning on stderr:\n{stderr}"));
    assert!(warning.contains("WARN"), "{warning}");
    assert!(
        warning.contains("miles_session"),
        "the library's target: {warning}"
    );
    // The same warning as one JSON object a line for log collectors.
    let (mut child, _) = start(&["--host", "0.0.0.0", "--log-format", "json"]);
    send_signal(&child, libc::SIGINT);
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(60)).code(),
        Some(0)
    );
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let line = stderr
        .lines()
        .find(|l| l.contains("without --api-key"))
        .unwrap_or_else(|| panic!("no warning on stderr:\n{stderr}"));
    let event: Value = serde_json::from_str(line).unwrap();
    assert_eq!(event["level"], "WARN", "{event}");
    assert_eq!(event["target"], "miles_session::cli", "{event}");
    // --log-level error silences it.
    let (mut child, _) = start(&["--host", "0.0.0.0", "--log-level", "error"]);
    send_signal(&child, libc::SIGTERM);
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(60)).code(),
        Some(0)
    );
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(!stderr.contains("without --api-key"), "{stderr}");
}

#[test]
fn sigterm_lets_the_request_in_flight_finish() {
    let (mut child, base) = start(&["--shutdown-timeout-s", "30"]);
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    // A request whose body is still arriving when the signal comes: it is in flight.
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .write_all(
            b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 2\r\nConnection: close\r\n\r\n{",
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    send_signal(&child, libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "exited with a request in flight"
    );
    stream.write_all(b"}").unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("session_id"), "{answer}");
    assert_eq!(
        wait_exit(&mut child, Duration::from_secs(60)).code(),
        Some(0)
    );
    // Stopped: nothing listens any more.
    assert!(
        TcpStream::connect(addr).is_err(),
        "still accepting after the stop"
    );
}

/// `miles session --use-session-server v2`: a request that diverges from the history branches
/// instead of rolling back, and the samples route answers one sample per leaf in Miles' v2
/// wire; v1 (the bare flag, the default) refuses a rollback past one assistant turn and keeps
/// its one path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_session_server_v2_keeps_both_branches() {
    use miles_session::codec::{SamplesWire, decode_samples_as};
    let http = HttpClient::new(Duration::from_secs(30));
    let mut leaves = Vec::new();
    for (flags, wire) in [
        (&["--use-session-server", "v2"][..], SamplesWire::V2),
        (&["--use-session-server"][..], SamplesWire::V1),
    ] {
        let (mut child, base) = start(flags);
        let id = http
            .post_json(&format!("{base}/sessions"), &json!({}), &[])
            .await
            .unwrap()
            .json::<Value>()
            .unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let chat = format!("{base}/sessions/{id}/v1/chat/completions");
        let first = http.post_json(&chat, &user("first"), &[]).await.unwrap();
        assert_eq!(first.status, 200, "{}", first.text());
        let answer = first.json::<Value>().unwrap()["choices"][0]["message"].clone();
        let second = json!({"messages": [
            {"role": "user", "content": "first"}, answer, {"role": "user", "content": "second"}]});
        assert_eq!(
            http.post_json(&chat, &second, &[]).await.unwrap().status,
            200
        );
        // An edited first message: v2 opens a new branch; v1 refuses (a rollback of two
        // assistant turns, past its one-step limit) and keeps its one path.
        let edited = http.post_json(&chat, &user("edited"), &[]).await.unwrap();
        match wire {
            SamplesWire::V2 => assert_eq!(edited.status, 200, "{}", edited.text()),
            SamplesWire::V1 => {
                assert_error(&edited, 400, "invalid_request_error", "message_validation");
            }
        }
        let r = http
            .post_json(&format!("{base}/sessions/{id}/samples"), &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let payload = decode_samples_as(&r.body, &miles_core::Sample::default(), wire).unwrap();
        leaves.push(payload.samples.len());
        send_signal(&child, libc::SIGTERM);
        assert_eq!(
            wait_exit(&mut child, Duration::from_secs(60)).code(),
            Some(0)
        );
    }
    assert_eq!(
        leaves,
        [2, 1],
        "v2: both branches; v1: the path after the rollback"
    );
}
