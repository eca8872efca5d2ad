//! The engine's specialised forward path (fused q / k / v and gate / up projections and
//! packed routed experts over weights stacked per version, small matmuls split over both
//! cores, flex: sparse experts at every step; last-position logits at prefill, rows sampled
//! in parallel) against the generic path every other device runs, on every architecture
//! fixture in `fixtures/models/` (DeepSeek-V3 MLA included); and weight updates reaching the
//! specialised path (a swapped version never decodes with the previous version's weights or
//! their stacked copies). On a CPU with AVX-512F the specialised path runs twice, its dense
//! weights packed into panels (the default) and read in place (`DecodeWeights::InPlace`, what
//! `miles train` asks for); elsewhere the two are the same path.

use std::path::PathBuf;
use std::sync::Arc;

use burn::tensor::Device;
use miles_bridge::{CausalLm, DecodeWeights};
use miles_core::{
    DType, EngineErrorKind, GenerateOutput, GenerateRequest, InProcessWeights, InferenceEngine,
    InputLogprobRequest, MemoryTag, NamedTensors, SamplingParams, TensorBytes, WeightVersion,
};
use miles_engine::{EmbeddedEngine, EngineConfig};

const ARCHITECTURES: [&str; 11] = [
    "dsv3-noq",
    "dsv3-tiny",
    "glm47flash-tiny",
    "glm4moe-tiny",
    "gptoss-tiny",
    "llama-tiny",
    "qwen2-tiny",
    "qwen2-untied",
    "qwen3-tiny",
    "qwen3moe-tiny",
    "qwen35moe-tiny",
];

fn load(name: &str) -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name);
    CausalLm::from_pretrained(&dir, &Device::flex()).expect("fixture loads")
}

/// An engine on the specialised path with `decode` weights, or on the generic path (`None`).
fn engine(model: CausalLm, specialised: Option<DecodeWeights>) -> Arc<EmbeddedEngine> {
    Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                recompute_logprobs_via_prefill: false,
                prefix_cache_tokens: 0,
                specialised_path: specialised.is_some(),
                decode_weights: specialised.unwrap_or_default(),
                ..EngineConfig::default()
            },
        )
        .expect("engine"),
    )
}

/// Greedy requests of different prompt lengths, so rows join and leave the running batch.
fn requests(vocab: u32) -> Vec<GenerateRequest> {
    (0..6u32)
        .map(|i| {
            let prompt = (0..3 + 3 * i)
                .map(|t| (t * 53 + i * 211 + 3) % vocab)
                .collect();
            let mut r = GenerateRequest::new(
                prompt,
                SamplingParams {
                    temperature: 0.0,
                    max_new_tokens: Some(10 + i as usize),
                    ..SamplingParams::default()
                },
            );
            r.return_logprob = true;
            r.return_routed_experts = true;
            r
        })
        .collect()
}

async fn run_all(engine: &Arc<EmbeddedEngine>, reqs: Vec<GenerateRequest>) -> Vec<GenerateOutput> {
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let e = engine.clone();
            tokio::spawn(async move { e.generate(r).await })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("task").expect("generate"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_specialised_path_equals_the_generic_one_on_every_architecture() {
    let mut layouts = vec![DecodeWeights::Packed];
    if miles_ops::packed::supported() && miles_ops::rows::supported() {
        layouts.push(DecodeWeights::InPlace);
    }
    for (name, decode) in ARCHITECTURES
        .iter()
        .flat_map(|name| layouts.iter().map(move |d| (*name, *d)))
    {
        let model = load(name);
        let vocab = model.config.vocab_size as u32;
        let fast = run_all(&engine(model.clone(), Some(decode)), requests(vocab)).await;
        let generic = run_all(&engine(model, None), requests(vocab)).await;
        let name = format!("{name} ({decode:?})");
        for (i, (a, b)) in fast.iter().zip(&generic).enumerate() {
            assert_eq!(a.output_ids, b.output_ids, "{name}: request {i} tokens");
            assert_eq!(a.output_ids.len(), 10 + i, "{name}: request {i} length");
            let worst = a
                .output_log_probs
                .iter()
                .zip(&b.output_log_probs)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-4,
                "{name}: request {i}: log-probs differ by {worst}"
            );
            assert_eq!(
                a.routed_experts, b.routed_experts,
                "{name}: request {i} routed experts"
            );
        }
    }
}

fn scaled_weights(model: &CausalLm, factor: f32) -> NamedTensors {
    let mut out = NamedTensors::new();
    for (name, t) in model.to_hf_tensors(DType::F32).expect("export") {
        let values: Vec<f32> = t.to_f32().unwrap().iter().map(|v| v * factor).collect();
        out.insert(
            name,
            TensorBytes::from_f32(t.shape().to_vec(), &values).expect("tensor"),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_update_reaches_the_specialised_path() {
    for (name, decode) in [
        ("glm4moe-tiny", DecodeWeights::Packed),
        ("qwen3-tiny", DecodeWeights::Packed),
        ("qwen3-tiny", DecodeWeights::InPlace),
        ("dsv3-tiny", DecodeWeights::Packed),
    ] {
        let model = load(name);
        let vocab = model.config.vocab_size as u32;
        let live = engine(model.clone(), Some(decode));
        let before = run_all(&live, requests(vocab)).await;
        let weights = scaled_weights(&model, 1.7);
        live.update_weights(&weights, WeightVersion(1))
            .await
            .expect("update");
        let after = run_all(&live, requests(vocab)).await;
        // A fresh engine built on the new weights is what the updated one must produce.
        let new_model = CausalLm::from_hf_tensors(
            &model.config,
            model
                .to_hf_tensors(DType::F32)
                .expect("export")
                .into_iter()
                .map(|(n, t)| {
                    let v: Vec<f32> = t.to_f32().unwrap().iter().map(|v| v * 1.7).collect();
                    (n, TensorBytes::from_f32(t.shape().to_vec(), &v).unwrap())
                })
                .collect(),
            &Device::flex(),
        )
        .expect("new model");
        let fresh = run_all(&engine(new_model, Some(decode)), requests(vocab)).await;
        assert!(
            before
                .iter()
                .zip(&after)
                .any(|(a, b)| a.output_ids != b.output_ids),
            "{name}: the update changed nothing, so the test could not tell stale weights"
        );
        // Rows may join the running batch at different steps in the two engines, so the
        // log-probs agree to float rounding; stale weights (scaled by 1 / 1.7) would be far off.
        for (i, (a, b)) in after.iter().zip(&fresh).enumerate() {
            assert_eq!(a.weight_version, WeightVersion(1));
            assert_eq!(
                a.output_ids, b.output_ids,
                "{name}: request {i} after the update"
            );
            let worst = a
                .output_log_probs
                .iter()
                .zip(&b.output_log_probs)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(
                worst < 1e-4,
                "{name}: request {i}: log-probs after the update differ by {worst}"
            );
        }
    }
}

/// Miles' `--offload-rollout` on the embedded engine: released weights and KV cache refuse
/// scoring and hold generation until the weights come back with an update (in process, as
/// the sync loop pushes them) and the KV cache with its resume; the engine then serves the
/// pushed version as an engine that never released does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_memory_comes_back_with_the_next_update() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let live = engine(model.clone(), Some(DecodeWeights::Packed));
    let before = run_all(&live, requests(vocab)).await;
    let both = [MemoryTag::KvCache, MemoryTag::Weights];
    assert!(
        live.release_memory_occupation(&both)
            .await
            .expect("release")
    );
    assert_eq!(
        live.released_memory(),
        vec![MemoryTag::Weights, MemoryTag::KvCache]
    );
    let scoring = live
        .input_logprobs(InputLogprobRequest {
            input_ids: vec![1, 2, 3],
            ..InputLogprobRequest::default()
        })
        .await;
    assert!(
        matches!(
            &scoring,
            Err(miles_core::Error::Engine {
                kind: EngineErrorKind::Unavailable,
                ..
            })
        ),
        "{scoring:?}"
    );
    // Sent while released: it waits for the weights and the pool.
    let waiting = {
        let (e, r) = (live.clone(), requests(vocab).remove(0));
        tokio::spawn(async move { e.generate(r).await })
    };
    // The pool comes back after the weights only.
    assert!(live.resume_memory_occupation(&both).await.is_err());
    assert!(
        live.update_weights_in_process(&InProcessWeights::new(model.clone()), WeightVersion(1))
            .await
            .expect("update")
    );
    assert_eq!(live.released_memory(), vec![MemoryTag::KvCache]);
    assert!(live.resume_memory_occupation(&both).await.expect("resume"));
    assert!(live.released_memory().is_empty());
    let waited = waiting.await.expect("task").expect("generate");
    assert_eq!(waited.weight_version, WeightVersion(1));
    assert_eq!(waited.output_ids, before[0].output_ids);
    let after = run_all(&live, requests(vocab)).await;
    for (i, (a, b)) in before.iter().zip(&after).enumerate() {
        assert_eq!(b.weight_version, WeightVersion(1));
        assert_eq!(a.output_ids, b.output_ids, "request {i}");
        let worst = a
            .output_log_probs
            .iter()
            .zip(&b.output_log_probs)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(worst < 1e-4, "request {i}: log-probs differ by {worst}");
    }
}

/// A release sent while sequences still decode (what `train-async` does at its end: its
/// generation worker is gone, the engine still finishes the requests it had) waits for them,
/// then releases and answers: the engine must not go idle with the release unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_sent_while_sequences_decode_is_answered_once_they_finish() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let live = engine(model, Some(DecodeWeights::InPlace));
    const NEW: usize = 240;
    let running: Vec<_> = (0..8u32)
        .map(|i| {
            let mut r = GenerateRequest::new(
                (0..4).map(|t| (t * 31 + i * 97 + 5) % vocab).collect(),
                SamplingParams {
                    temperature: 0.0,
                    max_new_tokens: Some(NEW),
                    min_new_tokens: NEW,
                    ..SamplingParams::default()
                },
            );
            r.return_logprob = true;
            let e = live.clone();
            tokio::spawn(async move { e.generate(r).await })
        })
        .collect();
    // Bounded wait until all 8 decode together: a request that reaches the engine after the
    // release is held until a resume (as `miles train` wants), which this test never sends,
    // so releasing before the last task's request arrived would leave it waiting.
    for _ in 0..30_000 {
        if live.stats().max_batch == 8 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let stats = live.stats();
    assert_eq!(stats.max_batch, 8, "the 8 sequences never decoded together");
    let generated = stats.generated_tokens;
    assert!(
        generated > 0 && generated < 8 * NEW as u64,
        "the release must be sent mid-decode ({generated} tokens generated)"
    );
    let both = [MemoryTag::KvCache, MemoryTag::Weights];
    let released = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        live.release_memory_occupation(&both),
    )
    .await
    .expect("the release is answered once the running sequences finish")
    .expect("release");
    assert!(released);
    assert_eq!(
        live.released_memory(),
        vec![MemoryTag::Weights, MemoryTag::KvCache]
    );
    for handle in running {
        let out = tokio::time::timeout(std::time::Duration::from_secs(120), handle)
            .await
            .expect("a sequence running at the release finishes")
            .expect("task")
            .expect("generate");
        assert_eq!(out.output_ids.len(), NEW);
        assert_eq!(out.output_log_probs.len(), NEW);
    }
}
