//! `https://` through [`HttpClient`] (the `tls` feature): a real TLS server on loopback with
//! the test CA's certificate for `127.0.0.1` and `localhost` (fixtures/tls, made by its
//! `gen.sh`). The client trusts it only once told to, answers come back as over plain HTTP,
//! and a certificate that does not verify is a transport error naming the reason.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use miles_session::Error;
use miles_session::http::HttpClient;
use tokio::net::TcpListener;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/tls")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A TLS server on an ephemeral loopback port answering every request with
/// `{"method", "path", "body"}` (the request echoed).
async fn tls_server() -> u16 {
    let identity =
        native_tls::Identity::from_pkcs8(&fixture("server.pem"), &fixture("server.key")).unwrap();
    let acceptor: tokio_native_tls::TlsAcceptor =
        native_tls::TlsAcceptor::new(identity).unwrap().into();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that refuses our certificate ends the handshake: nothing to serve.
                let Ok(stream) = acceptor.accept(stream).await else {
                    return;
                };
                let echo = service_fn(|request: Request<hyper::body::Incoming>| async move {
                    let method = request.method().to_string();
                    let path = request.uri().path().to_owned();
                    let body = request.into_body().collect().await?.to_bytes();
                    let answer = serde_json::json!({
                        "method": method,
                        "path": path,
                        "body": String::from_utf8_lossy(&body),
                    });
                    Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from(answer.to_string()))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), echo)
                    .await;
            });
        }
    });
    port
}

#[tokio::test]
async fn https_answers_once_the_certificate_is_trusted_and_fails_loudly_before() {
    let port = tls_server().await;
    let untrusted = HttpClient::new(Duration::from_secs(10));
    let url = format!("https://127.0.0.1:{port}/score");
    match untrusted.get(&url).await {
        Err(Error::Transport {
            url: failed,
            reason,
        }) => {
            assert_eq!(failed, url);
            assert!(
                reason.contains("certificate verify failed"),
                "the reason names the certificate: {reason}"
            );
        }
        other => panic!("an untrusted certificate must fail: {other:?}"),
    }

    let client = HttpClient::new(Duration::from_secs(10))
        .with_root_certificate(&fixture("ca.pem"))
        .unwrap();
    for host in ["127.0.0.1", "localhost"] {
        let url = format!("https://{host}:{port}/score");
        let body = serde_json::json!({"prompt": "1+1", "response": "2", "label": "2"});
        let response = client.post_json(&url, &body, &[]).await.unwrap();
        assert_eq!(response.status, 200);
        let echoed: serde_json::Value = response.json().unwrap();
        assert_eq!(echoed["method"], "POST");
        assert_eq!(echoed["path"], "/score");
        let sent: serde_json::Value =
            serde_json::from_str(echoed["body"].as_str().unwrap()).unwrap();
        assert_eq!(sent, body);
    }
    // The same client still speaks plain HTTP to a plain server (here: refused, not TLS'd).
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain = format!("http://{}/x", closed.local_addr().unwrap());
    drop(closed);
    assert!(matches!(
        client.get(&plain).await,
        Err(Error::Transport { .. })
    ));
}

#[test]
fn a_root_certificate_that_is_not_pem_is_a_typed_error() {
    let err = HttpClient::new(Duration::from_secs(1))
        .with_root_certificate(b"not a certificate")
        .unwrap_err();
    assert!(err.to_string().contains("root certificate"), "{err}");
}
