//! Guards for an HTTP server exposed to untrusted clients, as a small reusable piece: the
//! session server applies it, and so can any other axum server of the workspace (miles-rollout's
//! SGLang-compatible `serve`).
//!
//! Two halves:
//!
//! * [`harden`] wraps an [`axum::Router`] in one middleware that, per request and in this
//!   order: lets the [`GuardConfig::open_paths`] (`/health`) through untouched; checks
//!   `Authorization: Bearer <key>` against [`GuardConfig::api_key`] in constant time (401);
//!   bounds the requests in progress (503 + `Retry-After`); rejects a body sent with an
//!   explicit non-JSON `Content-Type` (415; a body without one is read as JSON, as FastAPI —
//!   Miles' and SGLang's servers — does), larger than [`GuardConfig::max_body_bytes`] (413, from
//!   `Content-Length` before reading, or while reading) or slower than
//!   [`GuardConfig::body_timeout`] (408); then bounds the handler by
//!   [`GuardConfig::request_timeout`] (504). The body reaches the handler fully buffered.
//!   Every rejection is an OpenAI-shaped JSON error (`{"error": {"message", "type", "code"}}`,
//!   [`crate::error::error_body`]).
//! * [`serve`] is the accept loop to use instead of `axum::serve`: at most
//!   [`GuardConfig::max_connections`] connections at once (at the limit, a new connection
//!   waits for the next response, which carries `Connection: close` to free its slot; further
//!   clients wait in the listen backlog), and a connection that does not deliver a complete
//!   request head within
//!   [`GuardConfig::header_read_timeout`] (slowloris, or an idle keep-alive) is closed, so slow
//!   clients cannot starve `/health`. HTTP/1.1 only. [`serve_with_shutdown`] stops
//!   accepting when a future completes.
//!
//! Like SGLang, the key comes from `--api-key` or the `MILES_API_KEY` environment variable
//! ([`ApiKey::from_env`]), `/health` stays open, and servers bind 127.0.0.1 unless told
//! otherwise.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::{get, post}};
//! use miles_session::guard::{self, ApiKey, GuardConfig};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! let app = Router::new()
//!     .route("/health", get(|| async { "ok" }))
//!     .route("/generate", post(|body: String| async move { body }));
//! let config = GuardConfig::default()
//!     .with_api_key(Some(ApiKey::new("s3cret")?))
//!     .with_max_body_bytes(1 << 20)
//!     .with_header_read_timeout(Some(Duration::from_secs(5)));
//! let app = guard::harden(app, &config);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let base = format!("http://{}", listener.local_addr()?);
//! tokio::spawn(guard::serve(listener, app, config.clone()));
//!
//! let http = miles_session::http::HttpClient::new(Duration::from_secs(10));
//! assert_eq!(http.get(&format!("{base}/health")).await?.status, 200);
//! let body = serde_json::json!({"text": "hi"});
//! let denied = http.post_json(&format!("{base}/generate"), &body, &[]).await?;
//! assert_eq!(denied.status, 401);
//! let allowed = http.post_json(&format!("{base}/generate"), &body, &[("authorization", "Bearer s3cret")]).await?;
//! assert_eq!(allowed.status, 200);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::{Error, Result, error_body};

pub use crate::api_key::{API_KEY_ENV, ApiKey, constant_time_eq};

/// Called with the error label (e.g. `unauthorized`) of every request the guard rejects, so
/// the server can count them in its metrics.
pub type RejectHook = Arc<dyn Fn(&'static str) + Send + Sync>;

/// What the guard enforces. Defaults: no key, `/health` open, JSON bodies only, 16 MiB bodies
/// read within 30 s, no request timeout, 4096 requests and 1024 connections at once, 10 s to
/// send a request head.
#[derive(Clone)]
#[non_exhaustive]
pub struct GuardConfig {
    /// Required bearer key (`None`: no authentication, as SGLang without `--api-key`).
    pub api_key: Option<ApiKey>,
    /// Paths served without authentication, concurrency limit or body checks (exact match).
    pub open_paths: Vec<String>,
    /// A body sent with a `Content-Type` must be `application/json` (or `…+json`); a body
    /// without one is taken as JSON (as FastAPI does).
    pub require_json: bool,
    /// Largest request body (413 above it).
    pub max_body_bytes: usize,
    /// Time allowed to receive the whole body once the head arrived (408 after it).
    pub body_timeout: Option<Duration>,
    /// Time allowed to the handler (504 after it; the handler is cancelled).
    pub request_timeout: Option<Duration>,
    /// Requests in progress at once, open paths excluded (503 above it).
    pub max_concurrent_requests: Option<usize>,
    /// [`serve`]: connections at once; at the limit a new connection takes the slot of the
    /// next connection to answer a request (see [`serve_with_shutdown`]).
    pub max_connections: Option<usize>,
    /// [`serve`]: time to receive a complete request head, on a new or an idle keep-alive
    /// connection (the connection is closed after it).
    pub header_read_timeout: Option<Duration>,
    /// Told about every rejection.
    pub on_reject: Option<RejectHook>,
}

impl std::fmt::Debug for GuardConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuardConfig")
            .field("api_key", &self.api_key)
            .field("open_paths", &self.open_paths)
            .field("require_json", &self.require_json)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("body_timeout", &self.body_timeout)
            .field("request_timeout", &self.request_timeout)
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("max_connections", &self.max_connections)
            .field("header_read_timeout", &self.header_read_timeout)
            .field("on_reject", &self.on_reject.as_ref().map(|_| "<hook>"))
            .finish()
    }
}

impl Default for GuardConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            open_paths: vec!["/health".to_owned()],
            require_json: true,
            max_body_bytes: 16 << 20,
            body_timeout: Some(Duration::from_secs(30)),
            request_timeout: None,
            max_concurrent_requests: Some(4096),
            max_connections: Some(1024),
            header_read_timeout: Some(Duration::from_secs(10)),
            on_reject: None,
        }
    }
}

impl GuardConfig {
    /// Sets [`GuardConfig::api_key`].
    pub fn with_api_key(mut self, key: Option<ApiKey>) -> Self {
        self.api_key = key;
        self
    }
    /// Sets [`GuardConfig::open_paths`].
    pub fn with_open_paths<I: IntoIterator<Item = S>, S: Into<String>>(mut self, paths: I) -> Self {
        self.open_paths = paths.into_iter().map(Into::into).collect();
        self
    }
    /// Sets [`GuardConfig::require_json`].
    pub fn with_require_json(mut self, on: bool) -> Self {
        self.require_json = on;
        self
    }
    /// Sets [`GuardConfig::max_body_bytes`].
    pub fn with_max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }
    /// Sets [`GuardConfig::body_timeout`].
    pub fn with_body_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.body_timeout = timeout;
        self
    }
    /// Sets [`GuardConfig::request_timeout`].
    pub fn with_request_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.request_timeout = timeout;
        self
    }
    /// Sets [`GuardConfig::max_concurrent_requests`].
    pub fn with_max_concurrent_requests(mut self, limit: Option<usize>) -> Self {
        self.max_concurrent_requests = limit;
        self
    }
    /// Sets [`GuardConfig::max_connections`].
    pub fn with_max_connections(mut self, limit: Option<usize>) -> Self {
        self.max_connections = limit;
        self
    }
    /// Sets [`GuardConfig::header_read_timeout`].
    pub fn with_header_read_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.header_read_timeout = timeout;
        self
    }
    /// Sets [`GuardConfig::on_reject`].
    pub fn with_on_reject(mut self, hook: Option<RejectHook>) -> Self {
        self.on_reject = hook;
        self
    }

    /// Checks the limits are usable (non-zero).
    pub fn validate(&self) -> Result<()> {
        let zero_duration = [
            self.body_timeout,
            self.request_timeout,
            self.header_read_timeout,
        ]
        .into_iter()
        .flatten()
        .any(|d| d.is_zero());
        if zero_duration {
            return Err(Error::Config("guard timeouts must be positive".into()));
        }
        if self.max_body_bytes == 0
            || self.max_concurrent_requests == Some(0)
            || self.max_connections == Some(0)
        {
            return Err(Error::Config("guard limits must be at least 1".into()));
        }
        Ok(())
    }
}

struct GuardState {
    config: GuardConfig,
    requests: Option<Arc<Semaphore>>,
}

impl GuardState {
    fn reject(&self, error: Error) -> Response {
        if let Some(hook) = &self.config.on_reject {
            hook(error.label());
        }
        rejection(&error)
    }
}

/// The JSON error response of `error` (status from [`Error::status`]).
pub fn rejection(error: &Error) -> Response {
    let status = StatusCode::from_u16(error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, axum::Json(error_body(error))).into_response();
    match error {
        Error::Unauthorized => {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        Error::Overloaded { .. } | Error::TooManySessions { .. } => {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        _ => {}
    }
    response
}

/// Wraps `router` in the request guards of `config` (see the module docs). Apply it last, so
/// it runs first.
pub fn harden(router: Router, config: &GuardConfig) -> Router {
    let state = Arc::new(GuardState {
        requests: config
            .max_concurrent_requests
            .map(|n| Arc::new(Semaphore::new(n.clamp(1, Semaphore::MAX_PERMITS)))),
        config: config.clone(),
    });
    router.layer(axum::middleware::from_fn_with_state(state, guard))
}

fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

async fn guard(State(state): State<Arc<GuardState>>, request: Request, next: Next) -> Response {
    let config = &state.config;
    if config.open_paths.iter().any(|p| p == request.uri().path()) {
        return next.run(request).await;
    }
    if let Some(key) = &config.api_key {
        let ok = request
            .headers()
            .get(header::AUTHORIZATION)
            .is_some_and(|v| key.matches_authorization(v.as_bytes()));
        if !ok {
            return state.reject(Error::Unauthorized);
        }
    }
    let _permit = match &state.requests {
        Some(semaphore) => match semaphore.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                return state.reject(Error::Overloaded {
                    limit: config.max_concurrent_requests.unwrap_or(0),
                });
            }
        },
        None => None,
    };
    let (parts, body) = request.into_parts();
    let limit = config.max_body_bytes;
    if content_length(&parts.headers).is_some_and(|n| n > limit as u64) {
        return state.reject(Error::BodyTooLarge { limit });
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if config.require_json
        && let Some(ct) = &content_type
        && !is_json(ct)
    {
        return state.reject(Error::UnsupportedMediaType {
            content_type: ct.chars().take(100).collect(),
        });
    }
    let bytes = if matches!(parts.method, Method::GET | Method::HEAD | Method::DELETE)
        && content_length(&parts.headers).is_none_or(|n| n == 0)
        && !parts.headers.contains_key(header::TRANSFER_ENCODING)
    {
        axum::body::Bytes::new()
    } else {
        let read = Limited::new(body, limit).collect();
        let collected = match config.body_timeout {
            Some(t) => match tokio::time::timeout(t, read).await {
                Ok(r) => r,
                Err(_) => {
                    return state.reject(Error::RequestTimeout {
                        seconds: t.as_secs_f64(),
                    });
                }
            },
            None => read.await,
        };
        match collected {
            Ok(c) => c.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
                return state.reject(Error::BodyTooLarge { limit });
            }
            Err(e) => {
                return state.reject(Error::InvalidBody {
                    reason: format!("cannot read the body: {e}"),
                });
            }
        }
    };
    let request = Request::from_parts(parts, Body::from(bytes));
    let path = request.uri().path().to_owned();
    match config.request_timeout {
        Some(t) => match tokio::time::timeout(t, next.run(request)).await {
            Ok(response) => response,
            Err(_) => state.reject(Error::Timeout {
                url: path,
                seconds: t.as_secs_f64(),
            }),
        },
        None => next.run(request).await,
    }
}

/// The listen backlog of [`bind`]: how many finished handshakes wait for `accept`. tokio's
/// `TcpListener::bind` asks for 1,024; a thousand agents connecting at once overflow that,
/// and a dropped handshake is retried by the client only after a second or more (seen as
/// multi-second stalls at 1,024 concurrent sessions). The kernel caps it at
/// `net.core.somaxconn`.
pub const LISTEN_BACKLOG: u32 = 4096;

/// Binds `host:port` (a name is resolved; the first address that binds wins) with
/// `SO_REUSEADDR` and a listen backlog of [`LISTEN_BACKLOG`]: what every server of the
/// workspace binds with. The error names the address.
pub async fn bind(host: &str, port: u16) -> std::io::Result<TcpListener> {
    let mut last = None;
    for addr in tokio::net::lookup_host((host, port)).await? {
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        #[cfg(unix)]
        socket.set_reuseaddr(true)?;
        match socket
            .bind(addr)
            .and_then(|()| socket.listen(LISTEN_BACKLOG))
        {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::AddrNotAvailable,
            format!("{host}:{port} resolves to no address"),
        )
    }))
}

/// Serves `router` on `listener` over HTTP/1.1 with the connection limit and the request-head
/// timeout of `config` (see the module docs); runs until the process ends. Accept errors (a
/// full file table, a reset during the handshake) are logged and retried.
pub async fn serve(listener: TcpListener, router: Router, config: GuardConfig) -> Result<()> {
    serve_with_shutdown(listener, router, config, std::future::pending()).await
}

/// Takes one of the pending requests for a free connection slot, if any.
fn take_slot_request(pending: &AtomicUsize) -> bool {
    pending
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
        .is_ok()
}

/// [`serve`] until `shutdown` completes: then it stops accepting and returns; connections
/// already accepted finish their requests on their own tasks.
///
/// At the connection limit a new connection is accepted and waits for a slot, and the next
/// response any connection sends carries `Connection: close`, so that connection closes
/// after it and the waiting one takes its slot (a client never reuses a connection that
/// answered so: no request is lost, unlike closing an idle keep-alive connection, which races
/// with the client's next request on it). Otherwise a client pool holding more connections
/// than the limit — hyper's pool keeps the connection it started when an idle one was handed
/// to the request first, so 1,024 closed-loop clients hold a few more than 1,024 — leaves its
/// newest connection, the next one it reuses, unaccepted in the listen backlog until an idle
/// connection times out ([`GuardConfig::header_read_timeout`], 10 s by default). When every
/// connection is idle, the new one still waits for that timeout (or the client's own pool
/// timeout).
pub async fn serve_with_shutdown(
    listener: TcpListener,
    router: Router,
    config: GuardConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    config.validate()?;
    let slots = config
        .max_connections
        .map(|n| Arc::new(Semaphore::new(n.clamp(1, Semaphore::MAX_PERMITS))));
    // Connections waiting for a slot that no response has yet been marked to free.
    let pending = Arc::new(AtomicUsize::new(0));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::debug!(%error, "accept failed");
                // EMFILE and friends: give the process a moment to close descriptors.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let permit = match &slots {
            None => None,
            Some(slots) => match slots.clone().try_acquire_owned() {
                Ok(permit) => Some(permit),
                Err(_) => {
                    pending.fetch_add(1, Ordering::AcqRel);
                    let permit = tokio::select! {
                        () = &mut shutdown => return Ok(()),
                        permit = slots.clone().acquire_owned() => permit.ok(),
                    };
                    // A slot freed otherwise (a client closed): no connection needs closing.
                    take_slot_request(&pending);
                    permit
                }
            },
        };
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
        let inner = TowerToHyperService::new(router.clone());
        let pending = pending.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let response = hyper::service::Service::call(&inner, request);
            let pending = pending.clone();
            async move {
                let mut response = response.await?;
                if take_slot_request(&pending) {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_read_timeout)
            .keep_alive(true);
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(error) = builder
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_in_full_and_never_print() {
        let key = ApiKey::new("abc123").unwrap();
        assert!(key.matches_authorization(b"Bearer abc123"));
        assert!(key.matches_authorization(b"bearer abc123"));
        assert!(key.matches_authorization(b"BEARER abc123"));
        for wrong in [
            &b""[..],
            b"Bearer",
            b"Bearer ",
            b"Bearer abc12",
            b"Bearer abc1234",
            b"Bearer abd123",
            b"Basic abc123",
            b"abc123",
            b"Bearer  abc123",
        ] {
            assert!(!key.matches_authorization(wrong), "{wrong:?}");
        }
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b""));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"xyz", b"xyz"));
        assert!(!constant_time_eq(b"xyz", b"xyw"));
        assert_eq!(format!("{key:?}"), "ApiKey(<redacted>)");
        let config = GuardConfig::default().with_api_key(Some(key.clone()));
        assert!(!format!("{config:?}").contains("abc123"));
        assert_eq!(key.bearer(), "Bearer abc123");
        for bad in ["", "has space", "tab\t", "é"] {
            assert!(matches!(ApiKey::new(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }

    #[test]
    fn json_content_types() {
        for ok in [
            "application/json",
            "Application/JSON",
            "application/json; charset=utf-8",
            "application/vnd.api+json",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/jsonx",
            "",
            "json",
            "text/json+xml",
        ] {
            assert!(!is_json(bad), "{bad}");
        }
    }

    #[tokio::test]
    async fn serve_stops_at_shutdown() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(serve_with_shutdown(
            listener,
            app,
            GuardConfig::default(),
            async {
                let _ = rx.await;
            },
        ));
        let http = crate::http::HttpClient::new(Duration::from_secs(5));
        let r = http.get(&format!("http://{addr}/health")).await.unwrap();
        assert_eq!(r.text(), "ok");
        tx.send(()).unwrap();
        let result = tokio::time::timeout(Duration::from_secs(5), served).await;
        assert!(matches!(result, Ok(Ok(Ok(())))), "{result:?}");
        let zero = GuardConfig::default().with_max_body_bytes(0);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app = Router::new();
        assert!(matches!(
            serve(listener, app, zero).await,
            Err(Error::Config(_))
        ));
    }

    /// Sends `GET {path}` on `stream` (not waiting for the answer).
    async fn send_get(stream: &mut tokio::net::TcpStream, path: &str) {
        use tokio::io::AsyncWriteExt;
        let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
    }

    /// Reads one response (head and `Content-Length` body) from `stream`.
    async fn read_response(stream: &mut tokio::net::TcpStream) -> String {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        loop {
            let text = String::from_utf8_lossy(&buf).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (name, value) = l.split_once(':')?;
                        name.eq_ignore_ascii_case("content-length")
                            .then(|| value.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return text;
                }
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "connection closed mid-response: {text:?}");
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// `GET {path}` on `stream` and its response, within 60 s (a connection left waiting for
    /// a slot fails the test instead of hanging it).
    async fn get_on(stream: &mut tokio::net::TcpStream, path: &str) -> String {
        send_get(stream, path).await;
        tokio::time::timeout(Duration::from_secs(60), read_response(stream))
            .await
            .expect("answered, not left waiting for a connection slot")
    }

    /// Whether the server closed `stream` (EOF or a reset) without sending anything more.
    async fn closed(stream: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(60), stream.read(&mut byte)).await;
        matches!(read, Ok(Ok(0) | Err(_)))
    }

    /// At the connection limit a new connection is not left in the listen backlog until an
    /// idle connection times out (here there is no request-head timeout: before, it waited
    /// for ever): the next response on a busy connection carries `Connection: close`, that
    /// connection closes after it (the response arrives whole), and the new connection is
    /// served in its slot; the idle connection is never cut.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_over_the_limit_takes_the_slot_of_the_next_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let config = GuardConfig::default()
            .with_max_connections(Some(2))
            .with_header_read_timeout(None);
        tokio::spawn(serve(listener, app, config));
        let connect = || tokio::net::TcpStream::connect(addr);

        let mut idle = connect().await.unwrap();
        assert!(get_on(&mut idle, "/health").await.ends_with("ok"));
        let mut busy = connect().await.unwrap();
        assert!(get_on(&mut busy, "/health").await.ends_with("ok"));
        // The limit is reached: a third connection waits for a slot; `busy` keeps asking
        // until an answer tells it to close (once the server has accepted the third).
        let mut third = connect().await.unwrap();
        send_get(&mut third, "/health").await;
        let mut told = false;
        for _ in 0..10_000 {
            let answer = get_on(&mut busy, "/health").await;
            assert!(answer.ends_with("ok"), "{answer}");
            if answer.to_ascii_lowercase().contains("connection: close") {
                told = true;
                break;
            }
        }
        assert!(told, "no answer freed a slot");
        assert!(closed(&mut busy).await, "closed after its answer");
        let answer = tokio::time::timeout(Duration::from_secs(60), read_response(&mut third))
            .await
            .expect("served in the freed slot");
        assert!(answer.ends_with("ok"));
        // The idle connection was left alone and still answers.
        assert!(get_on(&mut idle, "/health").await.ends_with("ok"));
    }

    #[tokio::test]
    async fn bind_resolves_names_and_refuses_a_port_in_use() {
        let listener = bind("localhost", 0).await.unwrap();
        let addr = listener.local_addr().unwrap();
        assert!(addr.ip().is_loopback(), "{addr}");
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        assert_eq!(client.unwrap().local_addr().unwrap(), accepted.unwrap().1);
        let again = bind(&addr.ip().to_string(), addr.port()).await;
        assert_eq!(
            again.map(|_| ()).unwrap_err().kind(),
            std::io::ErrorKind::AddrInUse
        );
        assert!(bind("no-such-host.invalid", 0).await.is_err());
    }

    #[test]
    fn config_validation_rejects_zero_limits() {
        assert!(GuardConfig::default().validate().is_ok());
        let zero = GuardConfig::default().with_max_body_bytes(0);
        assert!(matches!(zero.validate(), Err(Error::Config(_))));
        let zero = GuardConfig::default().with_max_connections(Some(0));
        assert!(matches!(zero.validate(), Err(Error::Config(_))));
        let zero = GuardConfig::default().with_header_read_timeout(Some(Duration::ZERO));
        assert!(matches!(zero.validate(), Err(Error::Config(_))));
    }
}
