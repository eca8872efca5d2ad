//! The router over HTTP engines: SGLang-protocol servers (our `sglang_router`) reached with
//! miles-session's SGLang client. Sticky routing keys travel as `X-SMG-Routing-Key`, load
//! spreads by outstanding requests, weight updates go through `update_weights_from_disk`,
//! a failing server leaves the rotation and comes back (caught up) through the periodic
//! health checker.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use miles_core::{
    EngineErrorKind, Error as CoreError, GenerateOutput, GenerateRequest, InferenceEngine,
    NamedTensors, PauseMode, RequestId, Result as CoreResult, SamplingParams, TensorBytes,
    WeightVersion, async_trait,
};
use miles_session::sglang::Router;
use miles_session::sglang::{ServerInfo, sglang_router};

/// The tabular engine behind a server that loads `model.safetensors` from a directory, as
/// `update_weights_from_disk` asks.
struct DiskLoaded(Arc<TabularEngine>);

#[async_trait]
impl InferenceEngine for DiskLoaded {
    async fn generate(&self, request: GenerateRequest) -> CoreResult<GenerateOutput> {
        self.0.generate(request).await
    }
    async fn update_weights(&self, w: &NamedTensors, v: WeightVersion) -> CoreResult<()> {
        self.0.update_weights(w, v).await
    }
    async fn update_weights_from_disk(&self, dir: &Path, v: WeightVersion) -> CoreResult<()> {
        let file = dir.join("model.safetensors");
        let bytes = std::fs::read(&file).map_err(|e| CoreError::io(&file, e))?;
        let weights = NamedTensors::from_safetensors_bytes(&bytes)?;
        self.0.update_weights(&weights, v).await
    }
    async fn pause(&self, mode: PauseMode) -> CoreResult<()> {
        self.0.pause(mode).await
    }
    async fn resume(&self) -> CoreResult<()> {
        self.0.resume().await
    }
    async fn flush_cache(&self) -> CoreResult<()> {
        self.0.flush_cache().await
    }
    async fn abort(&self, id: &RequestId) -> CoreResult<()> {
        self.0.abort(id).await
    }
    async fn abort_all(&self) -> CoreResult<()> {
        self.0.abort_all().await
    }
    async fn health(&self) -> CoreResult<()> {
        self.0.health().await
    }
    async fn weight_version(&self) -> CoreResult<WeightVersion> {
        self.0.weight_version().await
    }
}

async fn serve(engine: Arc<TabularEngine>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = sglang_router(
        Arc::new(DiskLoaded(engine)),
        ServerInfo::new("tabular").with_weights_root(std::env::temp_dir()),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn request(key: Option<&str>, tokens: usize) -> GenerateRequest {
    let mut request = GenerateRequest::new(
        vec![1, 2],
        SamplingParams {
            max_new_tokens: Some(tokens),
            ..SamplingParams::default()
        },
    );
    request.routing_key = key.map(str::to_owned);
    request
}

fn weights(peak: usize) -> NamedTensors {
    let mut logits = vec![0.0; VOCAB];
    logits[peak] = 9.0;
    let mut weights = NamedTensors::new();
    weights.insert(
        "logits",
        TensorBytes::from_f32(vec![VOCAB], &logits).unwrap(),
    );
    weights
}

fn generated(fleet: &[Arc<TabularEngine>]) -> Vec<usize> {
    fleet
        .iter()
        .map(|e| e.generated.load(Ordering::SeqCst))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_fleet_sticky_spread_failover_and_readmission() {
    let fleet: Vec<Arc<TabularEngine>> = (0..3)
        .map(|_| TabularEngine::new(Duration::from_millis(2)))
        .collect();
    let mut urls = Vec::new();
    for engine in &fleet {
        urls.push(serve(engine.clone()).await);
    }
    let shared = std::env::temp_dir().join(format!("miles-router-http-{}", std::process::id()));
    let dir = shared.clone();
    let router = Arc::new(Router::over_http(&urls, move |c| {
        c.shared_weights_dir = Some(dir.clone());
    }));

    // The same routing key always lands on the same server.
    for _ in 0..5 {
        router
            .generate(request(Some("session-a"), 2))
            .await
            .unwrap();
    }
    let counts = generated(&fleet);
    assert_eq!(counts.iter().filter(|&&c| c > 0).count(), 1, "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 10);
    // Concurrent unkeyed requests spread by outstanding requests: two per server.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let router = router.clone();
        tasks.spawn(async move { router.generate(request(None, 20)).await.unwrap() });
    }
    while tasks.join_next().await.is_some() {}
    let added: Vec<usize> = generated(&fleet)
        .iter()
        .zip(&counts)
        .map(|(a, b)| a - b)
        .collect();
    assert_eq!(added, [40, 40, 40]);
    assert_eq!(router.outstanding(), [0, 0, 0]);

    // Weights travel as safetensors files + /update_weights_from_disk.
    router
        .update_weights(&weights(3), WeightVersion(3))
        .await
        .unwrap();
    for engine in &fleet {
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(3));
    }
    assert_eq!(router.weight_version().await.unwrap(), WeightVersion(3));

    // A server that fails mid-request (HTTP 500): the request ends ABORTED, the server leaves
    // the rotation.
    let keyed = router.clone();
    let in_flight = tokio::spawn(async move { keyed.generate(request(Some("s"), 400)).await });
    let before = generated(&fleet);
    let victim = loop {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if let Some(i) = generated(&fleet)
            .iter()
            .zip(&before)
            .position(|(now, then)| now > then)
        {
            break i;
        }
    };
    fleet[victim].dead.store(true, Ordering::SeqCst);
    let outcome = in_flight.await.unwrap();
    assert!(
        matches!(
            outcome,
            Err(CoreError::Engine {
                kind: EngineErrorKind::Aborted,
                ..
            })
        ),
        "{outcome:?}"
    );
    assert!(!router.healthy_engines().contains(&urls[victim]));

    // Servers that refuse (HTTP 503): requests are retried on the one left.
    let survivor = (0..3).rev().find(|&i| i != victim).unwrap();
    for (i, engine) in fleet.iter().enumerate() {
        if i != victim && i != survivor {
            engine.dead.store(true, Ordering::SeqCst);
        }
    }
    for _ in 0..4 {
        let output = router.generate(request(None, 3)).await.unwrap();
        assert_eq!(output.weight_version, WeightVersion(3));
    }
    assert_eq!(router.healthy_engines(), [urls[survivor].clone()]);

    // New weights while two servers are out of rotation reach only the survivor …
    router
        .update_weights(&weights(5), WeightVersion(4))
        .await
        .unwrap();
    assert_eq!(
        fleet[victim].weight_version().await.unwrap(),
        WeightVersion(3)
    );
    // … and the others catch up when the health checker re-admits them.
    for engine in &fleet {
        engine.dead.store(false, Ordering::SeqCst);
    }
    let checker = router.spawn_health_checker(Duration::from_millis(10));
    while router.healthy_engines().len() < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    checker.abort();
    for engine in &fleet {
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(4));
    }
    let output = router.generate(request(Some("s"), 5)).await.unwrap();
    assert_eq!(output.weight_version, WeightVersion(4));
    assert!(
        output.output_ids.iter().filter(|&&t| t == 5).count() >= 4,
        "new weights in use: {:?}",
        output.output_ids
    );
    let _ = std::fs::remove_dir_all(shared);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_served_over_http_keeps_sessions_sticky() {
    // Router → sglang_router → clients: the routing header reaches the router through our
    // server, so a Miles session server in front of it keeps each session on one engine.
    let fleet: Vec<Arc<TabularEngine>> = (0..2)
        .map(|_| TabularEngine::new(Duration::from_millis(1)))
        .collect();
    let router: Arc<dyn InferenceEngine> = Arc::new(Router::new(
        fleet
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let engine: Arc<dyn InferenceEngine> = e.clone();
                (format!("engine-{i}"), engine, None)
            })
            .collect(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = sglang_router(router, ServerInfo::new("fleet"));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = miles_session::sglang::SglangEngine::new(
        miles_session::sglang::SglangConfig::new(format!("http://{addr}")),
    );
    for key in ["a", "b", "c", "d"] {
        let before = generated(&fleet);
        for _ in 0..3 {
            client.generate(request(Some(key), 2)).await.unwrap();
        }
        let added: Vec<usize> = generated(&fleet)
            .iter()
            .zip(&before)
            .map(|(a, b)| a - b)
            .collect();
        assert!(added.contains(&6) && added.contains(&0), "{key}: {added:?}");
    }
}
