//! A lean HTTP/1.1 client (hyper-util's pooled client over plain TCP) with per-request
//! timeouts, shared by the SGLang engine client, the agent driver and the tests.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};
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

/// A cloneable pooled HTTP/1.1 client (`http://` only) with a default timeout.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

impl HttpClient {
    /// A client whose requests time out after `timeout` (connect + response + body).
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(timeout));
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1024)
            .build(connector);
        Self { client, timeout }
    }

    /// The default timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends a request and reads the whole response, within the client's timeout.
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
        let mut builder = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|e| transport(e.to_string()))?;
            let value = HeaderValue::from_str(value).map_err(|e| transport(e.to_string()))?;
            builder = builder.header(name, value);
        }
        let payload = match body {
            Some((content_type, bytes)) => {
                builder = builder.header(CONTENT_TYPE, content_type);
                Bytes::from(bytes)
            }
            None => Bytes::new(),
        };
        let request = builder
            .body(Full::new(payload))
            .map_err(|e| transport(e.to_string()))?;
        let call = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| transport(format!("{e:?}")))?;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| transport(e.to_string()))?
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

    /// POSTs a JSON body.
    pub async fn post_json(
        &self,
        url: &str,
        body: &serde_json::Value,
        headers: &[(&str, &str)],
    ) -> Result<HttpResponse> {
        let bytes = serde_json::to_vec(body).map_err(|e| Error::InvalidBody {
            reason: e.to_string(),
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
