//! `RemoteReward` (Miles' `remote_rm`) against a reward model on loopback: Miles' request body,
//! retries of 5xx answers and transport errors, typed failures.

use std::sync::Arc;
use std::time::Duration;

use miles_core::{Reward, RewardFn, Sample};
use miles_reward::RemoteReward;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_reward_model_over_http_with_retries_and_typed_failures() {
    use axum::Json;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    use serde_json::{Value, json};
    use std::sync::atomic::{AtomicUsize, Ordering};

    // A reward model on loopback: 1 for the label, 0 otherwise; the first call for a response
    // "flaky" answers 503; "BAD" gets a 400; "WEIRD" a string; "PARTS" named components.
    let calls = Arc::new(AtomicUsize::new(0));
    let flaky = Arc::new(AtomicUsize::new(0));
    let (c, f) = (calls.clone(), flaky.clone());
    let app = axum::Router::new().route(
        "/reward",
        axum::routing::post(move |Json(body): Json<Value>| {
            let (c, f) = (c.clone(), f.clone());
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                let response = body["response"].as_str().unwrap_or("").to_owned();
                let first = || f.fetch_add(1, Ordering::SeqCst) == 0;
                match response.as_str() {
                    "flaky" if first() => {
                        (StatusCode::SERVICE_UNAVAILABLE, Json(json!("busy"))).into_response()
                    }
                    // Rate-limited once, with the wait it asks for.
                    "limited" if first() => (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after", "0.3")],
                        Json(json!("slow down")),
                    )
                        .into_response(),
                    // Garbage once (an HTML error page from a proxy).
                    "garbage" if first() => (StatusCode::OK, "<html>oops</html>").into_response(),
                    // Slower than the client's timeout once.
                    "slow" if first() => {
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        (StatusCode::OK, Json(json!(1.0))).into_response()
                    }
                    "BAD" => {
                        (StatusCode::BAD_REQUEST, Json(json!({"error": "bad"}))).into_response()
                    }
                    "WEIRD" => (StatusCode::OK, Json(json!("high"))).into_response(),
                    "PARTS" => {
                        (StatusCode::OK, Json(json!({"acc": 1.0, "fmt": 0.5}))).into_response()
                    }
                    _ => {
                        let hit = Some(response.as_str()) == body["label"].as_str();
                        assert_eq!(body["prompt"], json!("q0"));
                        // Miles' remote_rm body: exactly prompt, response and label.
                        let mut keys: Vec<&String> = body.as_object().unwrap().keys().collect();
                        keys.sort();
                        assert_eq!(keys, ["label", "prompt", "response"]);
                        (StatusCode::OK, Json(json!(f64::from(u8::from(hit))))).into_response()
                    }
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/reward", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let rm = RemoteReward::new(url.clone(), Duration::from_secs(5));
    let sample = |response: &str| {
        let mut s = Sample {
            prompt: miles_core::Prompt::Text("q0".into()),
            response: response.into(),
            label: Some("3".into()),
            ..Sample::default()
        };
        s.metadata.insert("k".into(), json!(1));
        s
    };
    assert_eq!(rm.reward(&sample("3")).await.unwrap(), Reward::Scalar(1.0));
    assert_eq!(rm.reward(&sample("4")).await.unwrap(), Reward::Scalar(0.0));
    // A 503 is retried.
    assert_eq!(
        rm.reward(&sample("flaky")).await.unwrap(),
        Reward::Scalar(0.0)
    );
    assert_eq!(flaky.load(Ordering::SeqCst), 2);
    let parts = rm.reward(&sample("PARTS")).await.unwrap();
    assert_eq!(parts.scalar(Some("fmt")), Some(0.5));
    // A 429 (its Retry-After honoured: see the unit test of the backoff), garbage and a timeout
    // are retried.
    for (case, rm) in [
        ("limited", rm.clone()),
        ("garbage", rm.clone()),
        (
            "slow",
            RemoteReward::new(url.clone(), Duration::from_millis(500)),
        ),
    ] {
        flaky.store(0, Ordering::SeqCst);
        assert_eq!(
            rm.reward(&sample(case)).await.unwrap(),
            Reward::Scalar(0.0),
            "{case}"
        );
        assert_eq!(flaky.load(Ordering::SeqCst), 2, "{case}: one retry");
    }
    // A 400 is not retried; an answer that never becomes a number fails after the retries, as
    // does a dead server.
    let before = calls.load(Ordering::SeqCst);
    let e = rm.reward(&sample("BAD")).await.unwrap_err().to_string();
    assert!(e.contains("400"), "{e}");
    assert_eq!(calls.load(Ordering::SeqCst), before + 1);
    let before = calls.load(Ordering::SeqCst);
    let e = rm.reward(&sample("WEIRD")).await.unwrap_err().to_string();
    assert!(
        e.contains("expected a number or an object") && e.contains("after 4 attempts"),
        "{e}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), before + 4);
    let dead =
        RemoteReward::new("http://127.0.0.1:9/reward", Duration::from_secs(1)).with_retries(1);
    let e = dead.reward(&sample("3")).await.unwrap_err().to_string();
    assert!(e.contains("after 2 attempts"), "{e}");
}
