//! Soak test of the session server on loopback (issue 23, point 10): concurrent agent sessions
//! against a real server (served by `guard::serve`, the binary's accept loop) over an engine
//! slow enough that requests are in flight, with a third of the clients closing the TCP
//! connection in the middle of one chat turn and then retrying that turn.
//!
//! What the server guarantees when a client goes away mid-turn (`server.rs`): a turn is
//! recorded only in phase 3 (under the session lock, after the engine call). If the handler is
//! cancelled before that, nothing is recorded and the busy flag is cleared; if it already
//! committed, the turn stays recorded. Either way, a retry of the same turn with the same
//! messages rolls the session back to before that turn (the stored history ends with the
//! assistant reply the client never saw, so the request matches one checkpoint fewer) and
//! regenerates it, replacing its record. So after every interleaving each finished session has
//! exactly one record per turn, in order, append-only, and no turn twice. A retry that arrives
//! while the cancelled request still holds the turn gets 409 (`session_busy`) and is sent
//! again.

#[path = "it/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{ByteChatml, ToyEngine};
use miles_session::guard::{self, GuardConfig};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use serde_json::{Value, json};

const SESSIONS: usize = 32;
const TURNS: usize = 6;
/// Engine delay: long enough that a dropped request is usually still in the engine call.
const ENGINE_DELAY: Duration = Duration::from_millis(25);
/// Sessions created then deleted in the leak guard.
const FLOOD_SESSIONS: usize = 5_000;

struct Soak {
    base: String,
    addr: std::net::SocketAddr,
    http: HttpClient,
}

/// What the clients saw.
#[derive(Default)]
struct Tally {
    /// Requests whose connection was closed before the response arrived.
    drops: AtomicU64,
    /// Dropped-at requests that answered before the client gave up (then retried anyway).
    answered_before_drop: AtomicU64,
    /// 409 answers to a retry while the abandoned request still held the turn.
    busy: AtomicU64,
    /// Responses with a 5xx status.
    server_errors: AtomicU64,
}

fn process_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn user_text(session: usize, turn: usize) -> String {
    format!("session {session} turn {turn}")
}

impl Soak {
    async fn create(&self) -> String {
        let r = self
            .http
            .post_json(&format!("{}/sessions", self.base), &json!({}), &[])
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        r.json::<Value>().unwrap()["session_id"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn delete(&self, id: &str) {
        let r = self
            .http
            .send(
                hyper::Method::DELETE,
                &format!("{}/sessions/{id}", self.base),
                &[],
                None,
            )
            .await
            .unwrap();
        assert_eq!(r.status, 204, "{}", r.text());
    }

    /// Sends the chat request over a fresh TCP connection and closes it after `patience`
    /// (the request future is dropped while the server works on it).
    async fn abandoned_chat(&self, id: &str, body: &Value, patience: Duration, tally: &Tally) {
        let payload = serde_json::to_vec(body).unwrap();
        let head = format!(
            "POST /sessions/{id}/v1/chat/completions HTTP/1.1\r\nHost: {}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            payload.len()
        );
        let addr = self.addr;
        // A blocking socket with a read timeout (the crate's Tokio has no `io-util`): the
        // client waits `patience` for the answer, then closes the connection.
        let (answered, response) = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            stream.write_all(head.as_bytes()).unwrap();
            stream.write_all(&payload).unwrap();
            stream.set_read_timeout(Some(patience)).unwrap();
            let mut response = Vec::new();
            let answered = match stream.read_to_end(&mut response) {
                Ok(_) => true,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    false
                }
                Err(e) => panic!("abandoned request: {e}"),
            };
            // Dropping the stream closes the TCP connection while the server works.
            drop(stream);
            (answered, response)
        })
        .await
        .unwrap();
        if !answered {
            tally.drops.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let status = String::from_utf8_lossy(&response)
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if status >= 500 {
            tally.server_errors.fetch_add(1, Ordering::Relaxed);
        }
        assert!(
            status == 200 || status == 409,
            "abandoned request answered {status}: {}",
            String::from_utf8_lossy(&response)
        );
        tally.answered_before_drop.fetch_add(1, Ordering::Relaxed);
    }

    /// Sends the chat request with the pooled client inside `tokio::time::timeout`: when the
    /// timeout fires the request future is dropped, and with it the in-flight connection.
    async fn abandoned_pooled_chat(
        &self,
        id: &str,
        body: &Value,
        patience: Duration,
        tally: &Tally,
    ) {
        let url = format!("{}/sessions/{id}/v1/chat/completions", self.base);
        match tokio::time::timeout(patience, self.http.post_json(&url, body, &[])).await {
            Err(_) => {
                tally.drops.fetch_add(1, Ordering::Relaxed);
            }
            Ok(r) => {
                let r = r.unwrap();
                if r.status.is_server_error() {
                    tally.server_errors.fetch_add(1, Ordering::Relaxed);
                }
                assert!(
                    r.status == 200 || r.status == 409,
                    "abandoned request answered {}: {}",
                    r.status,
                    r.text()
                );
                tally.answered_before_drop.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Sends a chat turn until it is answered 200 (409 while an abandoned request still holds
    /// the session's turn); returns the assistant's message.
    async fn chat(&self, id: &str, body: &Value, tally: &Tally) -> Value {
        let url = format!("{}/sessions/{id}/v1/chat/completions", self.base);
        for _ in 0..2_000 {
            let r = self.http.post_json(&url, body, &[]).await.unwrap();
            if r.status.is_server_error() {
                tally.server_errors.fetch_add(1, Ordering::Relaxed);
            }
            match r.status.as_u16() {
                200 => {
                    let v: Value = r.json().unwrap();
                    return v["choices"][0]["message"].clone();
                }
                409 => {
                    tally.busy.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                other => panic!("chat turn answered {other}: {}", r.text()),
            }
        }
        panic!("session {id} stayed busy");
    }

    async fn records(&self, id: &str) -> Vec<Value> {
        let r = self
            .http
            .get(&format!("{}/sessions/{id}", self.base))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        let v: Value = r.json().unwrap();
        v["records"].as_array().unwrap().clone()
    }
}

/// One agent: `TURNS` turns, each sending the whole history; a dropping agent abandons one
/// turn (after a patience that depends on the session: before, around or after the engine
/// delay; over a raw socket or the pooled client) and retries it with the same messages.
async fn agent(soak: Arc<Soak>, tally: Arc<Tally>, session: usize) -> (String, Vec<String>) {
    let id = soak.create().await;
    let drop_turn = session.is_multiple_of(3).then_some(session % TURNS);
    let patience = Duration::from_millis([2, 10, 40][session % 9 / 3]);
    let mut messages: Vec<Value> = Vec::new();
    let mut replies = Vec::new();
    for turn in 0..TURNS {
        messages.push(json!({"role": "user", "content": user_text(session, turn)}));
        let body = json!({"messages": messages});
        if drop_turn == Some(turn) {
            if session.is_multiple_of(2) {
                soak.abandoned_chat(&id, &body, patience, &tally).await;
            } else {
                soak.abandoned_pooled_chat(&id, &body, patience, &tally)
                    .await;
            }
        }
        // The assistant message goes back as returned (with its reasoning), as an agent does:
        // the server matches the stored history against it.
        let reply = soak.chat(&id, &body, &tally).await;
        replies.push(reply["content"].as_str().unwrap().to_owned());
        messages.push(reply);
    }
    (id, replies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_with_dropped_requests_keep_complete_records() {
    let started = Instant::now();
    let engine = ToyEngine::new();
    *engine.delay.lock().unwrap() = Some(ENGINE_DELAY);
    let server = SessionServer::new(
        engine.clone(),
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(guard::serve(
        listener,
        server.router(),
        GuardConfig::default(),
    ));
    let soak = Arc::new(Soak {
        base: format!("http://{addr}"),
        addr,
        http: HttpClient::new(Duration::from_secs(30)),
    });
    let tally = Arc::new(Tally::default());

    let agents: Vec<_> = (0..SESSIONS)
        .map(|s| tokio::spawn(agent(soak.clone(), tally.clone(), s)))
        .collect();
    let mut finished = Vec::new();
    for a in agents {
        finished.push(a.await.unwrap());
    }

    // Every session finished all its turns: one record per turn, in order, append-only.
    let (mut losses, mut duplicates) = (0usize, 0usize);
    for (session, (id, replies)) in finished.iter().enumerate() {
        let records = soak.records(id).await;
        losses += TURNS.saturating_sub(records.len());
        duplicates += records.len().saturating_sub(TURNS);
        assert_eq!(records.len(), TURNS, "session {session}: {records:?}");
        let mut previous: Vec<u64> = Vec::new();
        for (turn, record) in records.iter().enumerate() {
            assert_eq!(record["status_code"], 200);
            let messages = record["request"]["messages"].as_array().unwrap();
            assert_eq!(
                messages.len(),
                2 * turn + 1,
                "session {session} turn {turn}"
            );
            assert_eq!(
                messages.last().unwrap()["content"],
                user_text(session, turn),
                "session {session}: record {turn} is not turn {turn}"
            );
            assert_eq!(
                record["response"]["choices"][0]["message"]["content"],
                replies[turn].as_str(),
                "session {session} turn {turn}"
            );
            assert_eq!(
                replies[turn],
                format!("You said: {}", user_text(session, turn))
            );
            let ids: Vec<u64> = record["request"]["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect();
            assert!(
                ids.len() > previous.len() && ids.starts_with(&previous),
                "session {session}: record {turn}'s prompt does not extend record {}'s",
                turn.wrapping_sub(1)
            );
            previous = ids;
        }
    }
    assert_eq!((losses, duplicates), (0, 0));
    let droppers = (0..SESSIONS).filter(|s| s.is_multiple_of(3)).count() as u64;
    let drops = tally.drops.load(Ordering::Relaxed);
    let answered = tally.answered_before_drop.load(Ordering::Relaxed);
    assert_eq!(
        drops + answered,
        droppers,
        "every dropping agent abandoned one turn"
    );
    assert_eq!(tally.server_errors.load(Ordering::Relaxed), 0, "no 5xx");
    // Committed turns: every finished one, plus abandoned ones committed before the retry
    // rolled them back.
    let committed = server.metrics().turns.load(Ordering::Relaxed) as usize;
    assert!(
        (SESSIONS * TURNS..=SESSIONS * TURNS + droppers as usize).contains(&committed),
        "{committed} turns committed"
    );
    eprintln!(
        "soak: {SESSIONS} sessions x {TURNS} turns = {} turns; {drops} connections dropped \
         mid-request ({answered} answered first), {} busy retries, losses={losses}, \
         duplicates={duplicates}, 5xx=0; {} engine calls, {committed} turns committed, {} \
         not committed, {:.1?}",
        SESSIONS * TURNS,
        tally.busy.load(Ordering::Relaxed),
        engine.calls.load(Ordering::Relaxed),
        server.metrics().turns_skipped.load(Ordering::Relaxed),
        started.elapsed()
    );

    for (id, _) in &finished {
        soak.delete(id).await;
    }
    assert_eq!(server.sessions_open(), 0);

    // Leak guard, not a speed test: thousands of created-then-deleted sessions must not leave
    // the process's resident memory (server and clients together) much larger.
    *engine.delay.lock().unwrap() = None;
    let rss_before = process_rss_kib();
    let workers: Vec<_> = (0..16)
        .map(|w| {
            let soak = soak.clone();
            tokio::spawn(async move {
                for _ in (w..FLOOD_SESSIONS).step_by(16) {
                    let id = soak.create().await;
                    soak.delete(&id).await;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let rss_after = process_rss_kib();
    assert_eq!(server.sessions_open(), 0, "no session left after the flood");
    assert_eq!(
        server.metrics().sessions_created.load(Ordering::Relaxed) as usize,
        SESSIONS + FLOOD_SESSIONS
    );
    eprintln!(
        "leak guard: RSS {rss_before} KiB before, {rss_after} KiB after {FLOOD_SESSIONS} \
         created-then-deleted sessions (+{} KiB)",
        rss_after.saturating_sub(rss_before)
    );
    assert!(
        rss_after.saturating_sub(rss_before) < 200 * 1024,
        "RSS grew by more than 200 MiB: {rss_before} KiB -> {rss_after} KiB"
    );

    // Still healthy: /health and a normal turn, recorded.
    let health = soak
        .http
        .get(&format!("{}/health", soak.base))
        .await
        .unwrap();
    assert_eq!(health.status, 200);
    let id = soak.create().await;
    let reply = soak
        .chat(
            &id,
            &json!({"messages": [{"role": "user", "content": "still there?"}]}),
            &tally,
        )
        .await;
    assert_eq!(reply["content"], "You said: still there?");
    assert_eq!(soak.records(&id).await.len(), 1);
    assert_eq!(tally.server_errors.load(Ordering::Relaxed), 0, "no 5xx");
}
