//! Weight sync to a fleet: export an 88 M GLM-4-MoE's weights and push them to 4
//! `miles serve`-equivalent servers on loopback (SGLang's `update_weights_from_disk`),
//! as the RL loops do after each step.
//!
//! * baseline (before): each engine writes its own copy of the version and the engines are
//!   updated one after the other (what `SglangEngine`s with only `shared_weights_dir` and a
//!   sequential loop over them do);
//! * ours (after): one `WeightPublisher` shared by the fleet writes the version once, and the
//!   `Router` sends `update_weights_from_disk` to every engine at once. The servers say they
//!   serve `float32` (`/get_server_info`), so the version is written in f32;
//! * ours, bf16 (`weight_sync_4_servers_bf16`): the same fleet with the weights written in
//!   bf16, the dtype SGLang serves LLM checkpoints in (`WeightDtype::Cast(BF16)`; the embedded
//!   servers widen it back to f32 on load), so half the bytes go through the disk.
//!
//! Both include the export (model → HF-named f32 tensors). Median of 3 rounds each, spread in
//! the note. `cargo xtask bench --only weight_sync`.

mod common;

use std::sync::Arc;

use common::glm_moe_88m;
use std::time::Instant;

use burn::tensor::Device;
use miles_bridge::CausalLm;
use miles_core::{DType, InferenceEngine, NamedTensors, WeightVersion};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_session::sglang::{
    Router, ServerInfo, SglangConfig, SglangEngine, WeightDtype, WeightPublisher, sglang_router,
};

const SERVERS: usize = 4;
const ROUNDS: usize = 3;

/// The trainer's export: HF names, f32.
fn export(model: &CausalLm) -> NamedTensors {
    model.to_hf_tensors(DType::F32).expect("export")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let root = std::env::temp_dir().join(format!("miles-weight-sync-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("bench dir");
    let model = CausalLm::init(&glm_moe_88m(), &Device::flex()).expect("model");
    let mut urls = Vec::new();
    for _ in 0..SERVERS {
        let engine = EmbeddedEngine::builder(model.clone())
            .config(EngineConfig::default())
            .build()
            .expect("engine");
        let mut info = ServerInfo::new("glm-moe-88m");
        info.weights_root = Some(root.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        urls.push(format!("http://{}", listener.local_addr().expect("addr")));
        let app = sglang_router(Arc::new(engine), info);
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    let mut version = 0u64;
    let bytes = export(&model).to_safetensors_bytes().len();

    // Before: a copy per engine, one engine after the other.
    let mut before = Vec::new();
    for _ in 0..ROUNDS {
        let engines: Vec<SglangEngine> = urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                let mut c = SglangConfig::new(url.clone());
                c.shared_weights_dir = Some(root.join(format!("own-{i}")));
                SglangEngine::new(c)
            })
            .collect();
        version += 1;
        let started = Instant::now();
        let weights = export(&model);
        for engine in &engines {
            engine
                .update_weights(&weights, WeightVersion(version))
                .await
                .expect("update");
        }
        before.push(started.elapsed().as_secs_f64());
        for i in 0..SERVERS {
            let _ = std::fs::remove_dir_all(root.join(format!("own-{i}")));
        }
    }

    // After: one write for the fleet, every engine at once; in the dtype the servers serve
    // (f32), then in bf16.
    let mut after = Vec::new();
    let mut writes = Vec::new();
    for (name, dtype) in [
        ("shared", WeightDtype::Served),
        ("shared-bf16", WeightDtype::Cast(DType::BF16)),
    ] {
        let publisher = Arc::new(WeightPublisher::new(root.join(name)).with_keep(2));
        let router = Router::new(
            urls.iter()
                .enumerate()
                .map(|(i, url)| {
                    let config = SglangConfig::new(url.clone())
                        .with_publisher(publisher.clone())
                        .with_weight_dtype(dtype);
                    let engine: Arc<dyn InferenceEngine> = Arc::new(SglangEngine::new(config));
                    (format!("engine-{i}"), engine, None)
                })
                .collect(),
        );
        let mut times = Vec::new();
        for _ in 0..ROUNDS {
            version += 1;
            let started = Instant::now();
            let weights = export(&model);
            router
                .update_weights(&weights, WeightVersion(version))
                .await
                .expect("update");
            times.push(started.elapsed().as_secs_f64());
        }
        after.push(times);
        writes.push(publisher.writes());
    }
    let _ = std::fs::remove_dir_all(&root);
    let spread = |v: &[f64]| {
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(0.0, f64::max);
        format!("{min:.2}-{max:.2} s")
    };
    println!(
        "xtask-result: weight_sync_4_servers ours={:.3}s baseline={:.3}s target=<=0.5 note=export + push of an 88 M GLM-4-MoE ({} MB f32) to {SERVERS} loopback servers; ours: one WeightPublisher write in the dtype the servers serve (f32; {} writes for {ROUNDS} versions) and concurrent update_weights_from_disk through the Router (spread {}); baseline: a copy per engine, engines one after the other (spread {}); median of {ROUNDS} rounds",
        median(after[0].clone()),
        median(before.clone()),
        bytes >> 20,
        writes[0],
        spread(&after[0]),
        spread(&before),
    );
    println!(
        "xtask-result: weight_sync_4_servers_bf16 ours={:.3}s baseline={:.3}s target=<=0.5 note=as weight_sync_4_servers with the version written once in bf16 ({} MB; {} writes for {ROUNDS} versions), the servers widening it to f32 on load (spread {}); baseline: the same f32 copy-per-engine run as weight_sync_4_servers (spread {}); median of {ROUNDS} rounds",
        median(after[1].clone()),
        median(before.clone()),
        bytes >> 21,
        writes[1],
        spread(&after[1]),
        spread(&before),
    );
}
