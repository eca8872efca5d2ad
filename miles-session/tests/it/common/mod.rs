//! Test helpers: the testkit seams plus a loopback server helper.
#![allow(dead_code)]

#[allow(unused_imports)]
pub use miles_session::testkit::*;

pub mod hf_replay;

/// Serves `router` on 127.0.0.1 (ephemeral port); returns the base URL.
pub async fn serve(router: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    format!("http://{addr}")
}

/// A session record with nothing in it (trajectory tests that do not read records).
pub fn empty_record() -> miles_session::trajectory::SessionRecord {
    miles_session::trajectory::SessionRecord {
        timestamp: 0.0,
        request_timestamp: None,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        request: serde_json::json!({}),
        input_ids: None,
        response: serde_json::json!({}),
        status_code: 200,
    }
}
