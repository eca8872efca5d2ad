//! A lean HTTP/1.1 client (hyper-util's pooled client over TCP, and over TLS for `https://`
//! URLs with the `tls` feature) with per-request timeouts, shared by the SGLang engine client,
//! the remote reward model, the agent driver and the tests.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::error::{Error, Result};

/// A response read to the end.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    /// Status code.
    pub status: StatusCode,
    /// Response headers.
    pub headers: hyper::HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl HttpResponse {
    /// The body parsed as JSON.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_slice(&self.body).map_err(|e| {
            Error::upstream(format!(
                "response is not the expected JSON ({e}): {}",
                String::from_utf8_lossy(&self.body[..self.body.len().min(200)])
            ))
        })
    }

    /// The body as (lossy) UTF-8 text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A cloneable pooled HTTP/1.1 client with a default timeout, and optionally a bearer key sent
/// with every request ([`HttpClient::with_api_key`]). `https://` URLs need the crate's `tls`
/// feature (OpenSSL; certificates checked against the system's trust store, which
/// `SSL_CERT_FILE` / `SSL_CERT_DIR` override, plus [`HttpClient::with_root_certificate`]);
/// without it they are a [`Error::Transport`] naming the feature.
#[derive(Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    /// The pool for `https://` URLs, or why there is none (no TLS context could be made).
    #[cfg(feature = "tls")]
    tls: std::result::Result<Client<TlsConnector, Full<Bytes>>, std::sync::Arc<str>>,
    timeout: Duration,
    authorization: Option<HeaderValue>,
    max_response_bytes: usize,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("timeout", &self.timeout)
            .field(
                "api_key",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// Idle pooled connections are dropped after this long: shorter than the servers'
/// request-head timeout ([`crate::guard::GuardConfig::header_read_timeout`], 10 s by
/// default), so the client does not reuse a connection the server is closing.
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Default bound on a response body read by [`HttpClient`] (1 GiB).
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1 << 30;

impl HttpClient {
    /// A client whose requests time out after `timeout` (connect + response + body).
    pub fn new(timeout: Duration) -> Self {
        Self {
            client: pool(tcp(timeout)),
            #[cfg(feature = "tls")]
            tls: tls_pool(timeout, native_tls::TlsConnector::new()),
            timeout,
            authorization: None,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
        }
    }

    /// This client also trusting the PEM certificate `pem` (a private CA or a self-signed
    /// server) for `https://` URLs, beside the system's trust store.
    #[cfg(feature = "tls")]
    pub fn with_root_certificate(mut self, pem: &[u8]) -> Result<Self> {
        let invalid = |e: native_tls::Error| Error::InvalidBody {
            reason: format!("root certificate: {e}"),
        };
        let certificate = native_tls::Certificate::from_pem(pem).map_err(invalid)?;
        let tls = native_tls::TlsConnector::builder()
            .add_root_certificate(certificate)
            .build();
        self.tls = Ok(
            tls_pool(self.timeout, tls).map_err(|reason| Error::InvalidBody {
                reason: format!("root certificate: {reason}"),
            })?,
        );
        Ok(self)
    }

    /// This client refusing response bodies over `bytes` (a transport error).
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// This client sending `Authorization: Bearer <key>` with every request that does not set
    /// its own `Authorization` (`None`: no header).
    pub fn with_api_key(mut self, key: Option<&crate::api_key::ApiKey>) -> Self {
        self.authorization = key.and_then(|k| {
            let mut v = HeaderValue::from_str(&k.bearer()).ok()?;
            v.set_sensitive(true);
            Some(v)
        });
        self
    }

    /// The default timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends a request and reads the whole response, within the client's timeout. `body`
    /// is `(content type, bytes)`; an empty content type sends the body without one.
    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<(&str, Vec<u8>)>,
    ) -> Result<HttpResponse> {
        self.send_with_timeout(method, url, headers, body, self.timeout)
            .await
    }

    /// [`HttpClient::send`] with an explicit timeout.
    pub async fn send_with_timeout(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<(&str, Vec<u8>)>,
        timeout: Duration,
    ) -> Result<HttpResponse> {
        let transport = |reason: String| Error::Transport {
            url: url.to_owned(),
            reason,
        };
        let https = url
            .get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"));
        #[cfg(not(feature = "tls"))]
        if https {
            return Err(transport(
                "https:// needs miles-session's `tls` feature (built into the `miles` binary)"
                    .into(),
            ));
        }
        let mut builder = Request::builder().method(method).uri(url);
        if let Some(auth) = &self.authorization
            && !headers
                .iter()
                .any(|(n, _)| n.eq_ignore_ascii_case("authorization"))
        {
            builder = builder.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        for (name, value) in headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|e| transport(e.to_string()))?;
            let value = HeaderValue::from_str(value).map_err(|e| transport(e.to_string()))?;
            builder = builder.header(name, value);
        }
        let payload = match body {
            Some((content_type, bytes)) => {
                // An empty content type sends none (a body as python-requests' `data=` sends it).
                if !content_type.is_empty() {
                    builder = builder.header(CONTENT_TYPE, content_type);
                }
                Bytes::from(bytes)
            }
            None => Bytes::new(),
        };
        let request = builder
            .body(Full::new(payload))
            .map_err(|e| transport(e.to_string()))?;
        let call = async {
            let response = self.dispatch(https, request).await.map_err(transport)?;
            let (parts, body) = response.into_parts();
            let limit = self.max_response_bytes;
            let too_large = |n: u64| {
                transport(format!(
                    "response body of {n} bytes or more, over the limit of {limit} bytes"
                ))
            };
            if let Some(n) = parts
                .headers
                .get(CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&n| n > limit as u64)
            {
                return Err(too_large(n));
            }
            let body = http_body_util::Limited::new(body, limit)
                .collect()
                .await
                .map_err(|e| {
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        too_large(limit as u64 + 1)
                    } else {
                        transport(e.to_string())
                    }
                })?
                .to_bytes();
            Ok(HttpResponse {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(Error::Timeout {
                url: url.to_owned(),
                seconds: timeout.as_secs_f64(),
            }),
        }
    }

    /// One request on the pool of its scheme (`https://` was refused earlier without `tls`).
    async fn dispatch(
        &self,
        https: bool,
        request: Request<Full<Bytes>>,
    ) -> std::result::Result<hyper::Response<hyper::body::Incoming>, String> {
        #[cfg(feature = "tls")]
        if https {
            return match &self.tls {
                Ok(client) => client.request(request).await.map_err(|e| format!("{e:?}")),
                Err(reason) => Err(format!("no TLS context: {reason}")),
            };
        }
        let _ = https;
        self.client
            .request(request)
            .await
            .map_err(|e| format!("{e:?}"))
    }

    /// POSTs a JSON body.
    pub async fn post_json(
        &self,
        url: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> Result<HttpResponse> {
        let bytes = serde_json::to_vec(body).map_err(|e| Error::InvalidBody {
            reason: format!("cannot serialise the request body: {e}"),
        })?;
        self.send(
            Method::POST,
            url,
            headers,
            Some(("application/json", bytes)),
        )
        .await
    }

    /// GETs a URL.
    pub async fn get(&self, url: &str) -> Result<HttpResponse> {
        self.send(Method::GET, url, &[], None).await
    }
}

/// The TCP connector: no Nagle delay, connects within `timeout`.
fn tcp(timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout));
    connector
}

fn pool<C>(connector: C) -> Client<C, Full<Bytes>>
where
    C: hyper_util::client::legacy::connect::Connect + Clone,
{
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_timer(hyper_util::rt::TokioTimer::new())
        .build(connector)
}

/// The connector of `https://` URLs: TLS over [`tcp`], for `https://` only.
#[cfg(feature = "tls")]
type TlsConnector = hyper_tls::HttpsConnector<HttpConnector>;

/// The `https://` pool over `tls` (or the reason there is no TLS context).
#[cfg(feature = "tls")]
fn tls_pool(
    timeout: Duration,
    tls: std::result::Result<native_tls::TlsConnector, native_tls::Error>,
) -> std::result::Result<Client<TlsConnector, Full<Bytes>>, std::sync::Arc<str>> {
    let tls = tls.map_err(|e| std::sync::Arc::<str>::from(e.to_string()))?;
    let mut tcp = tcp(timeout);
    tcp.enforce_http(false);
    let mut connector = TlsConnector::from((tcp, tls.into()));
    connector.https_only(true);
    Ok(pool(connector))
}
