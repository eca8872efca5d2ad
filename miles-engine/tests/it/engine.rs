//! The embedded engine on the real tiny HF checkpoints (`fixtures/models/`): log-probs and
//! routing against a full forward of the same model, continuous batching against one-at-a-time
//! generation, versioned weight updates under load, the KV budget, prefix reuse, abort / pause,
//! stop conditions and bad input.

use std::path::PathBuf;
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{CausalLm, ModelInput, token_logprobs};
use miles_core::{
    DType, EngineErrorKind, Error as CoreError, FinishReason, GenerateOutput, GenerateRequest,
    InferenceEngine, NamedTensors, PauseMode, RequestId, SamplingParams, TensorBytes,
    WeightVersion,
};
use miles_engine::{Detokenizer, EmbeddedEngine, EngineConfig, PrefillScorer, RolloutKvNeed};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::Fallthrough;

pub(crate) fn fixture(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name);
    assert!(
        dir.join("config.json").exists(),
        "fixture {} missing",
        dir.display()
    );
    dir
}

pub(crate) fn load(name: &str) -> CausalLm {
    CausalLm::from_pretrained(fixture(name), &Device::flex()).expect("fixture loads")
}

pub(crate) fn config(recompute: bool) -> EngineConfig {
    EngineConfig {
        recompute_logprobs_via_prefill: recompute,
        ..EngineConfig::default()
    }
}

/// An engine that runs one sequence at a time (the reference of continuous batching).
fn one_at_a_time(model: CausalLm) -> Arc<EmbeddedEngine> {
    Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                max_running_requests: 1,
                ..config(true)
            },
        )
        .unwrap(),
    )
}

pub(crate) fn request(prompt: Vec<u32>, max_new: usize, seed: u64) -> GenerateRequest {
    let mut r = GenerateRequest::new(
        prompt,
        SamplingParams {
            max_new_tokens: Some(max_new),
            sampling_seed: Some(seed),
            ..SamplingParams::default()
        },
    );
    r.return_routed_experts = true;
    r
}

pub(crate) fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 37 + salt * 101 + 5) % vocab)
        .collect()
}

/// Log-probs of the response under a plain full forward (miles-bridge), and the routing rows.
pub(crate) fn full_forward(
    model: &CausalLm,
    tokens: &[u32],
    response: usize,
) -> (Vec<f32>, Vec<Vec<i32>>) {
    let device = Device::flex();
    let n = tokens.len();
    let ids = Tensor::<2, Int>::from_data(
        TensorData::new(tokens.iter().map(|&t| t as i32).collect(), [1, n]),
        &device,
    );
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let lp: Vec<f32> = token_logprobs(out.logits, ids)
        .into_data()
        .convert::<f32>()
        .try_to_vec()
        .unwrap();
    let routing = out
        .routing
        .iter()
        .map(|r| {
            r.experts
                .clone()
                .into_data()
                .convert::<i32>()
                .try_to_vec()
                .unwrap()
        })
        .collect();
    (lp[n - 1 - response..].to_vec(), routing)
}

pub(crate) fn max_diff(a: &[f64], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, &y)| (x - y as f64).abs())
        .fold(0.0, f64::max)
}

pub(crate) async fn run_all(
    engine: &Arc<EmbeddedEngine>,
    reqs: Vec<GenerateRequest>,
) -> Vec<GenerateOutput> {
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let e = engine.clone();
            tokio::spawn(async move { e.generate(r).await })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap().unwrap());
    }
    out
}

#[tokio::test]
async fn decode_log_probs_and_routing_match_a_full_forward_moe_and_dense() {
    for name in [
        "glm4moe-tiny",
        "qwen3-tiny",
        "qwen2-tiny",
        "qwen2-untied",
        "dsv3-tiny",
        "dsv3-noq",
        "glm47flash-tiny",
    ] {
        let model = load(name);
        let vocab = model.config.vocab_size as u32;
        let moe = model.config.has_moe();
        let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(false)).unwrap());
        let reqs = (0..3)
            .map(|i| request(prompt(7 + 3 * i, i as u32, vocab), 20, i as u64))
            .collect();
        let outs = run_all(&engine, reqs).await;
        for (i, out) in outs.iter().enumerate() {
            assert_eq!(out.finish_reason, FinishReason::Length, "{name}");
            assert_eq!(out.output_ids.len(), 20);
            assert_eq!(out.output_log_probs.len(), 20);
            let p = prompt(7 + 3 * i, i as u32, vocab);
            let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
            let (reference, routing) = full_forward(&model, &tokens, 20);
            let diff = max_diff(&out.output_log_probs, &reference);
            assert!(diff < 2e-4, "{name}: decode log-probs differ by {diff}");
            if moe {
                let re = out.routed_experts.as_ref().expect("routed experts");
                let k = model.config.num_experts_per_tok;
                let moe_layers: Vec<usize> = (0..model.config.num_hidden_layers)
                    .filter(|&l| model.config.is_moe_layer(l))
                    .collect();
                assert_eq!(re.rows(), tokens.len() - 1);
                // SGLang's form: every layer, dense layers zero.
                assert_eq!(re.layers(), model.config.num_hidden_layers);
                assert_eq!(moe_layers.len(), routing.len());
                for row in 0..re.rows() {
                    for l in 0..re.layers() {
                        if !moe_layers.contains(&l) {
                            assert_eq!(re.get(row, l).unwrap(), vec![0; k].as_slice());
                        }
                    }
                }
                let mut same = 0;
                let mut total = 0;
                for row in 0..re.rows() {
                    for (&l, layer) in moe_layers.iter().zip(&routing) {
                        let mut a = re.get(row, l).unwrap().to_vec();
                        let mut b = layer[row * k..(row + 1) * k].to_vec();
                        a.sort_unstable();
                        b.sort_unstable();
                        total += 1;
                        same += usize::from(a == b);
                    }
                }
                assert!(
                    same * 100 >= total * 98,
                    "{name}: routing agrees on {same}/{total}"
                );
            } else {
                assert!(out.routed_experts.is_none());
            }
        }
        // With recompute and the plain `PrefillScorer`, log-probs come from one forward over
        // the sequence and equal the full forward bit for bit.
        let engine = Arc::new(
            EmbeddedEngine::builder(model.clone())
                .config(config(true))
                .scorer(Arc::new(PrefillScorer))
                .build()
                .unwrap(),
        );
        let p = prompt(9, 3, vocab);
        let out = engine.generate(request(p.clone(), 16, 9)).await.unwrap();
        let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
        let (reference, _) = full_forward(&model, &tokens, 16);
        let got: Vec<f32> = out.output_log_probs.iter().map(|&x| x as f32).collect();
        assert_eq!(got, reference, "{name}: recomputed log-probs");
        // The default scorer is the trainer's: its log-probs equal miles-bridge's sequence
        // scoring (what miles-train's actor scores with) bit for bit, and the full forward to
        // float rounding.
        let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(true)).unwrap());
        let out = engine.generate(request(p.clone(), 16, 9)).await.unwrap();
        let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
        let trainer = miles_bridge::score_log_probs(
            &model,
            &tokens,
            16,
            &Fallthrough,
            &FusedLogProbConfig::default(),
        )
        .unwrap();
        let got: Vec<f32> = out.output_log_probs.iter().map(|&x| x as f32).collect();
        assert_eq!(got, trainer, "{name}: default (trainer) scorer");
        let (reference, _) = full_forward(&model, &tokens, 16);
        let diff = max_diff(&out.output_log_probs, &reference);
        assert!(
            diff < 1e-4,
            "{name}: trainer scorer vs full forward differ by {diff}"
        );
    }
}

#[tokio::test]
async fn continuous_batching_gives_the_same_tokens_as_one_at_a_time() {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let reqs: Vec<GenerateRequest> = (0..8)
        .map(|i| {
            let mut r = request(prompt(4 + 2 * i, i as u32, vocab), 12 + i, 100 + i as u64);
            r.sampling_params.temperature = 0.8;
            r.sampling_params.top_k = 40;
            r
        })
        .collect();
    let batched = Arc::new(EmbeddedEngine::new(model.clone(), config(true)).unwrap());
    let single = one_at_a_time(model);
    let a = run_all(&batched, reqs.clone()).await;
    let b = run_all(&single, reqs).await;
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.output_ids, y.output_ids);
        assert_eq!(x.output_log_probs, y.output_log_probs);
    }
    assert!(batched.stats().max_batch > 1, "{:?}", batched.stats());
    assert_eq!(single.stats().max_batch, 1);
}

pub(crate) fn scaled_weights(model: &CausalLm, factor: f32) -> NamedTensors {
    let mut out = NamedTensors::new();
    for (name, t) in model.to_hf_tensors(DType::F32).unwrap() {
        let values: Vec<f32> = t.to_f32().unwrap().iter().map(|v| v * factor).collect();
        out.insert(
            name,
            TensorBytes::from_f32(t.shape().to_vec(), &values).unwrap(),
        );
    }
    out
}

#[tokio::test]
async fn a_weight_update_under_load_never_mixes_versions() {
    update_under_load(false).await;
    // With the recompute, sequences that finished before the swap are scored after it, on the
    // weights (and with the version) that generated them.
    update_under_load(true).await;
}

async fn update_under_load(recompute: bool) {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let new_weights = scaled_weights(&model, 1.05);
    let updated =
        CausalLm::from_hf_tensors(&model.config, new_weights.clone(), &Device::flex()).unwrap();
    let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(recompute)).unwrap());
    let mut handles = Vec::new();
    for i in 0..16u32 {
        let e = engine.clone();
        let p = prompt(5 + (i as usize % 5), i, vocab);
        handles.push(tokio::spawn(async move {
            let out = e
                .generate(request(p.clone(), 10 + (i as usize % 7), i as u64))
                .await;
            (p, out.unwrap())
        }));
        if i == 6 {
            // The update must find requests 0-6 started (else all of them would rightly run
            // on the new weights) and reach the engine before requests 7-15 (which then wait
            // for it): let the engine prefill, send the update, give it time to be queued.
            while engine.stats().prefill_tokens == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            let e = engine.clone();
            let w = new_weights.clone();
            handles.push(tokio::spawn(async move {
                e.update_weights(&w, WeightVersion(1)).await.unwrap();
                (
                    Vec::new(),
                    GenerateOutput {
                        request_id: None,
                        output_ids: Vec::new(),
                        output_log_probs: Vec::new(),
                        routed_experts: None,
                        finish_reason: FinishReason::Abort,
                        matched_stop: None,
                        weight_version: WeightVersion(99),
                        prompt_tokens: 0,
                        cached_tokens: 0,
                    },
                )
            }));
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let mut seen = [0usize; 2];
    for h in handles {
        let (p, out) = h.await.unwrap();
        if out.weight_version == WeightVersion(99) {
            continue;
        }
        let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
        let r = out.output_ids.len();
        let (old, _) = full_forward(&model, &tokens, r);
        let (new, _) = full_forward(&updated, &tokens, r);
        let (d_old, d_new) = (
            max_diff(&out.output_log_probs, &old),
            max_diff(&out.output_log_probs, &new),
        );
        match out.weight_version.0 {
            0 => assert!(d_old < 2e-4 && d_new > 1e-2, "v0 output: {d_old} / {d_new}"),
            1 => assert!(d_new < 2e-4 && d_old > 1e-2, "v1 output: {d_old} / {d_new}"),
            v => panic!("unexpected version {v}"),
        }
        seen[out.weight_version.0 as usize] += 1;
    }
    assert!(seen[0] > 0 && seen[1] > 0, "{seen:?}");
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(1));

    if recompute {
        // Sequences finishing in the same step are answered one per scheduler step, and an
        // update waiting for them swaps after the first answer: the others are scored after
        // the swap, still on the weights and with the version that generated them.
        engine.pause(PauseMode::InPlace).await.unwrap();
        let together: Vec<_> = (0..4u32)
            .map(|i| {
                let e = engine.clone();
                let p = prompt(5, 30 + i, vocab);
                tokio::spawn(async move { (p.clone(), e.generate(request(p, 12, 7)).await) })
            })
            .collect();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let before = engine.stats().generated_tokens;
        engine.resume().await.unwrap();
        while engine.stats().generated_tokens < before + 8 {
            tokio::task::yield_now().await;
        }
        engine
            .update_weights(&scaled_weights(&model, 1.0), WeightVersion(2))
            .await
            .unwrap();
        for h in together {
            let (p, out) = h.await.unwrap();
            let out = out.unwrap();
            assert_eq!(out.output_ids.len(), 12);
            assert_eq!(out.weight_version, WeightVersion(1));
            let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
            let (v1, _) = full_forward(&updated, &tokens, 12);
            let (v2, _) = full_forward(&model, &tokens, 12);
            let (d1, d2) = (
                max_diff(&out.output_log_probs, &v1),
                max_diff(&out.output_log_probs, &v2),
            );
            assert!(d1 < 2e-4 && d2 > 1e-2, "{d1} / {d2}");
        }
        assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(2));
        return;
    }

    // A broken update is a typed error; the engine keeps serving the old weights.
    let mut broken = new_weights.clone();
    broken.remove("lm_head.weight");
    let err = engine
        .update_weights(&broken, WeightVersion(2))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Engine {
                kind: EngineErrorKind::WeightUpdate,
                ..
            }
        ),
        "{err}"
    );
    let mut wrong = NamedTensors::new();
    wrong.insert(
        "x",
        TensorBytes::new(DType::I32, vec![1], vec![0; 4]).unwrap(),
    );
    assert!(
        engine
            .update_weights(&wrong, WeightVersion(2))
            .await
            .is_err()
    );
    assert_eq!(engine.weight_version().await.unwrap(), WeightVersion(1));
    let out = engine
        .generate(request(prompt(4, 1, vocab), 3, 1))
        .await
        .unwrap();
    assert_eq!(out.weight_version, WeightVersion(1));
}

#[tokio::test]
async fn the_kv_budget_makes_requests_wait_and_rejects_what_can_never_fit() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let engine = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                kv_token_budget: 70,
                ..config(true)
            },
        )
        .unwrap(),
    );
    let reqs = (0..6)
        .map(|i| request(prompt(8, i, vocab), 24, i as u64))
        .collect();
    let outs = run_all(&engine, reqs).await;
    assert!(
        outs.iter()
            .all(|o| o.output_ids.len() == 24 && o.finish_reason == FinishReason::Length)
    );
    let stats = engine.stats();
    assert!(stats.max_batch <= 2, "{stats:?}");
    assert!(stats.budget_waits >= 1, "{stats:?}");
    let err = engine
        .generate(request(prompt(40, 1, vocab), 40, 1))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Engine {
                kind: EngineErrorKind::InvalidRequest,
                ..
            }
        ),
        "{err}"
    );
}

/// A pool sized by [`RolloutKvNeed`] (what `miles train` chooses by default) for 6 sequences
/// of an 8-token prompt and 24 new tokens runs them all without waiting for budget; a longer
/// prompt than it was sized for still runs (it waits for room), and one that could never fit
/// the pool is rejected at once with a typed error: an exhausted pool never hangs a request.
#[tokio::test]
async fn a_rollout_sized_pool_runs_the_rollout_and_rejects_what_can_never_fit() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let need = RolloutKvNeed {
        requests: 6,
        max_running_requests: 32,
        sequence_tokens: 8 + 24,
        state_tokens_per_slot: 0,
    };
    assert_eq!(need.tokens(), 192);
    let engine = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                kv_token_budget: need.tokens(),
                ..config(false)
            },
        )
        .unwrap(),
    );
    let mut reqs: Vec<_> = (0..6)
        .map(|i| request(prompt(8, i, vocab), 24, i as u64))
        .collect();
    let outs = run_all(&engine, reqs.clone()).await;
    assert!(outs.iter().all(|o| o.output_ids.len() == 24));
    assert_eq!(engine.stats().budget_waits, 0, "{:?}", engine.stats());
    // The rollout again beside a 100-token prompt (100 + 24 > 32, < 192): all finish.
    reqs.push(request(prompt(100, 9, vocab), 24, 9));
    let outs = tokio::time::timeout(std::time::Duration::from_secs(60), run_all(&engine, reqs))
        .await
        .expect("a prompt longer than the pool was sized for waits for room, then runs");
    assert!(outs.iter().all(|o| o.output_ids.len() == 24));
    // 100 + 100 > 192: never admissible, rejected without waiting.
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        engine.generate(request(prompt(100, 9, vocab), 100, 9)),
    )
    .await
    .expect("rejected at once")
    .unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Engine {
                kind: EngineErrorKind::InvalidRequest,
                ..
            }
        ) && err
            .to_string()
            .contains("exceeds the KV budget of 192 tokens"),
        "{err}"
    );
}

/// Many short requests: the token budget (64) admits 16 of them at once (2 prompt + 2 new
/// tokens each), but each takes a 16-position block of the KV pool, which holds 64 / 16 = 4
/// blocks plus at most 4 spare ones (one per running sequence, at most as many as the budget
/// takes): 8 blocks. The others wait for blocks rather than failing, and every request
/// finishes with the tokens and log-probs it gets alone.
#[tokio::test]
async fn short_requests_wait_for_kv_pool_blocks_and_finish_as_alone() {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let reqs: Vec<GenerateRequest> = (0..12)
        .map(|i| request(prompt(2, 7 + i as u32, vocab), 2, 300 + i as u64))
        .collect();
    let engine = Arc::new(
        EmbeddedEngine::new(
            model.clone(),
            EngineConfig {
                kv_token_budget: 64,
                max_running_requests: 16,
                ..config(true)
            },
        )
        .unwrap(),
    );
    let single = one_at_a_time(model);
    let a = run_all(&engine, reqs.clone()).await;
    let b = run_all(&single, reqs).await;
    assert_eq!(a.len(), 12);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.output_ids.len(), 2);
        assert_eq!(x.output_ids, y.output_ids);
        assert_eq!(x.output_log_probs, y.output_log_probs);
    }
    let stats = engine.stats();
    assert!(stats.max_batch <= 8, "{stats:?}");
}

#[tokio::test]
async fn prefixes_are_reused_within_a_session_and_across_a_group() {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let engine = EmbeddedEngine::new(model.clone(), config(false)).unwrap();
    let p = prompt(12, 4, vocab);
    let first = engine.generate(request(p.clone(), 8, 1)).await.unwrap();
    assert_eq!(first.cached_tokens, 0);
    // Same prompt again (a GRPO group): all but the last prompt token come from the cache.
    let again = engine.generate(request(p.clone(), 8, 2)).await.unwrap();
    assert_eq!(again.cached_tokens, p.len() - 1);
    // Next turn of the session: prompt + reply + new user tokens.
    let mut turn2: Vec<u32> = p.iter().chain(&first.output_ids).copied().collect();
    turn2.extend(prompt(5, 9, vocab));
    let second = engine.generate(request(turn2.clone(), 8, 3)).await.unwrap();
    assert_eq!(second.cached_tokens, p.len() + first.output_ids.len() - 1);
    let tokens: Vec<u32> = turn2.iter().chain(&second.output_ids).copied().collect();
    let (reference, routing) = full_forward(&model, &tokens, 8);
    assert!(max_diff(&second.output_log_probs, &reference) < 2e-4);
    // Routed experts cover the reused prefix too.
    let re = second.routed_experts.unwrap();
    assert_eq!(re.rows(), tokens.len() - 1);
    let k = model.config.num_experts_per_tok;
    let first_moe = (0..model.config.num_hidden_layers)
        .find(|&l| model.config.is_moe_layer(l))
        .unwrap();
    let mut a = re.get(0, first_moe).unwrap().to_vec();
    let mut b = routing[0][..k].to_vec();
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b);
    // After a flush nothing is reused.
    engine.flush_cache().await.unwrap();
    let cold = engine.generate(request(p, 4, 4)).await.unwrap();
    assert_eq!(cold.cached_tokens, 0);
}

#[tokio::test]
async fn abort_pause_and_resume() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let engine = Arc::new(EmbeddedEngine::new(model, config(true)).unwrap());

    // Abort by request id returns the partial output.
    let mut long = request(prompt(6, 1, vocab), 200, 1);
    long.request_id = Some(RequestId::new("long"));
    let e = engine.clone();
    let h = tokio::spawn(async move { e.generate(long).await });
    while engine.stats().generated_tokens < 3 {
        tokio::task::yield_now().await;
    }
    engine.abort(&RequestId::new("long")).await.unwrap();
    let out = h.await.unwrap().unwrap();
    assert_eq!(out.finish_reason, FinishReason::Abort);
    assert!(out.output_ids.len() < 200);
    assert_eq!(out.output_log_probs.len(), out.output_ids.len());

    // In-place pause holds the sequence; after resume it completes. (A long request, so the
    // pause lands while it is still generating even when this test thread is descheduled.)
    let reference = engine
        .generate(request(prompt(6, 2, vocab), 200, 5))
        .await
        .unwrap();
    for mode in [PauseMode::InPlace, PauseMode::Retract] {
        let e = engine.clone();
        let before = engine.stats().generated_tokens;
        let h = tokio::spawn(async move { e.generate(request(prompt(6, 2, vocab), 200, 5)).await });
        while engine.stats().generated_tokens < before + 5 {
            tokio::task::yield_now().await;
        }
        engine.pause(mode).await.unwrap();
        // A request sent while paused waits.
        let e = engine.clone();
        let queued =
            tokio::spawn(async move { e.generate(request(prompt(3, 7, vocab), 4, 1)).await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!queued.is_finished() && !h.is_finished());
        engine.resume().await.unwrap();
        let out = h.await.unwrap().unwrap();
        assert_eq!(out.finish_reason, FinishReason::Length, "{mode:?}");
        assert_eq!(out.output_ids, reference.output_ids, "{mode:?}");
        assert_eq!(queued.await.unwrap().unwrap().output_ids.len(), 4);
    }

    // Pause with abort ends in-flight requests.
    let e = engine.clone();
    let before = engine.stats().generated_tokens;
    let h = tokio::spawn(async move { e.generate(request(prompt(6, 3, vocab), 300, 1)).await });
    while engine.stats().generated_tokens < before + 2 {
        tokio::task::yield_now().await;
    }
    engine.pause(PauseMode::Abort).await.unwrap();
    assert_eq!(h.await.unwrap().unwrap().finish_reason, FinishReason::Abort);
    engine.resume().await.unwrap();
}

/// An MoE request aborted while it waits (no row prefilled) ends ABORTED with no routed
/// rows; one aborted mid-decode reports the rows it ran. Shutting the engine down ends what
/// is in flight ABORTED, then it refuses work as unavailable, as a dead engine does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aborted_moe_requests_and_shutdown() {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let layers = model.config.num_hidden_layers;
    let engine = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                compute_threads: Some(1),
                ..config(true)
            },
        )
        .unwrap(),
    );

    engine.pause(PauseMode::InPlace).await.unwrap();
    let mut queued = request(prompt(5, 4, vocab), 20, 1);
    queued.request_id = Some(RequestId::new("queued"));
    let e = engine.clone();
    let h = tokio::spawn(async move { e.generate(queued).await });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    engine.abort(&RequestId::new("queued")).await.unwrap();
    let out = h.await.unwrap().unwrap();
    assert_eq!(out.finish_reason, FinishReason::Abort);
    assert!(out.output_ids.is_empty());
    assert_eq!(out.routed_experts.map(|r| r.rows()), Some(0));
    engine.resume().await.unwrap();
    engine.health().await.unwrap();

    let e = engine.clone();
    let h = tokio::spawn(async move { e.generate(request(prompt(5, 5, vocab), 400, 2)).await });
    while engine.stats().generated_tokens < 3 {
        tokio::task::yield_now().await;
    }
    let e = engine.clone();
    tokio::task::spawn_blocking(move || e.shutdown())
        .await
        .unwrap();
    let out = h.await.unwrap().unwrap();
    assert_eq!(out.finish_reason, FinishReason::Abort);
    assert!(!out.output_ids.is_empty() && out.output_ids.len() < 400);
    let routes = out.routed_experts.expect("routes of the rows it ran");
    assert_eq!(routes.layers(), layers);
    assert_eq!(routes.rows(), 5 + out.output_ids.len() - 1);
    let err = engine
        .generate(request(prompt(5, 6, vocab), 4, 3))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Engine {
                kind: EngineErrorKind::Unavailable,
                ..
            }
        ),
        "{err}"
    );
    assert!(engine.health().await.is_err());
    engine.shutdown(); // idempotent
}

struct IdText;

impl Detokenizer for IdText {
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|i| format!("<{i}>")).collect()
    }
}

#[tokio::test]
async fn stop_tokens_stop_strings_min_new_tokens_and_eos() {
    let model = load("glm4moe-tiny");
    let vocab = model.config.vocab_size as u32;
    let engine = EmbeddedEngine::builder(model.clone())
        .config(config(true))
        .detokenizer(Arc::new(IdText))
        .build()
        .unwrap();
    let p = prompt(5, 6, vocab);
    let mut greedy = request(p.clone(), 12, 0);
    greedy.sampling_params.temperature = 0.0;
    let full = engine.generate(greedy.clone()).await.unwrap();
    assert_eq!(full.output_ids.len(), 12);
    let third = full.output_ids[2];
    let first_pos = full.output_ids.iter().position(|&t| t == third).unwrap();

    let mut stop_tok = greedy.clone();
    stop_tok.sampling_params.stop_token_ids = vec![third];
    let out = engine.generate(stop_tok.clone()).await.unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.output_ids, full.output_ids[..=first_pos].to_vec());
    assert_eq!(out.matched_stop, Some(serde_json::json!(third)));

    let mut stop_str = greedy.clone();
    stop_str.sampling_params.stop = vec![format!("<{third}>")];
    let out = engine.generate(stop_str).await.unwrap();
    assert_eq!(out.finish_reason, FinishReason::Stop);
    assert_eq!(out.output_ids, full.output_ids[..=first_pos].to_vec());
    assert_eq!(
        out.matched_stop,
        Some(serde_json::json!(format!("<{third}>")))
    );

    // min_new_tokens holds stops back.
    let mut min_new = stop_tok;
    min_new.sampling_params.min_new_tokens = first_pos + 2;
    let out = engine.generate(min_new).await.unwrap();
    assert!(out.output_ids.len() > first_pos + 1);

    // The model's EOS (from generation_config.json) ends generation when loaded from disk.
    // Two copies of the checkpoint that differ only in that file: one whose EOS is the third
    // greedy token stops there, one whose EOS the model never emits runs to the length limit.
    let mut eos = greedy;
    eos.sampling_params.stop_token_ids.clear();
    eos.input_ids = p;
    let never = (0..vocab).find(|t| !full.output_ids.contains(t)).unwrap();
    for (eos_id, expected_len, reason) in [
        (third, first_pos + 1, FinishReason::Stop),
        (never, 12, FinishReason::Length),
    ] {
        let dir =
            std::env::temp_dir().join(format!("miles-engine-eos-{eos_id}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture("glm4moe-tiny").join(file), dir.join(file)).unwrap();
        }
        std::fs::write(
            dir.join("generation_config.json"),
            serde_json::json!({"eos_token_id": eos_id}).to_string(),
        )
        .unwrap();
        let disk = EmbeddedEngine::from_pretrained(&dir, &Device::flex(), config(true)).unwrap();
        let out = disk.generate(eos.clone()).await.unwrap();
        assert_eq!(out.finish_reason, reason, "eos {eos_id}");
        assert_eq!(out.output_ids, full.output_ids[..expected_len].to_vec());
        if reason == FinishReason::Stop {
            assert_eq!(out.matched_stop, Some(serde_json::json!(eos_id)));
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[tokio::test]
async fn bad_requests_are_typed_errors() {
    let model = load("qwen3-tiny");
    let vocab = model.config.vocab_size as u32;
    let engine = EmbeddedEngine::new(model, config(true)).unwrap();
    let mut cases = vec![request(Vec::new(), 4, 1), request(vec![vocab + 3], 4, 1)];
    let mut n2 = request(prompt(3, 1, vocab), 4, 1);
    n2.sampling_params.n = 2;
    cases.push(n2);
    let mut stop = request(prompt(3, 1, vocab), 4, 1);
    stop.sampling_params.stop = vec!["x".into()];
    cases.push(stop);
    let mut temp = request(prompt(3, 1, vocab), 4, 1);
    temp.sampling_params.temperature = -1.0;
    cases.push(temp);
    for case in cases {
        let err = engine.generate(case).await.unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::Engine {
                    kind: EngineErrorKind::InvalidRequest,
                    ..
                }
            ),
            "{err}"
        );
    }
    // Still healthy and serving.
    engine.health().await.unwrap();
    assert_eq!(
        engine
            .generate(request(prompt(3, 1, vocab), 2, 1))
            .await
            .unwrap()
            .output_ids
            .len(),
        2
    );
}

/// Greedy decoding by the embedded engine (KV cache, continuous batching of both prompts)
/// gives exactly the tokens of transformers' `generate(do_sample=False)` on the Qwen2
/// fixtures (`fixtures/models/gen_qwen2.py`: tied + GQA and untied + MHA).
///
/// The same on the DeepSeek-V3 fixtures (`gen_deepseek_v3.py`: MLA with and without
/// `q_lora_rank`, YaRN RoPE), whose cache holds the compressed latent and rope key, and the
/// GLM-4.7-Flash ones (`gen_glm4_moe_lite.py`: the same latent attention, GLM's router,
/// `mlp_layer_types`).
#[tokio::test]
async fn qwen2_and_latent_attention_greedy_decode_equals_hf_generate() {
    for name in [
        "qwen2-tiny",
        "qwen2-untied",
        "dsv3-tiny",
        "dsv3-noq",
        "glm47flash-tiny",
        "glm47flash-legacy",
    ] {
        let dir = fixture(name);
        let text = std::fs::read_to_string(dir.join("reference_generate.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let prompts: Vec<Vec<u32>> = serde_json::from_value(v["prompts"].clone()).unwrap();
        let want: Vec<Vec<u32>> = serde_json::from_value(v["output_ids"].clone()).unwrap();
        let new_tokens = v["max_new_tokens"].as_u64().unwrap() as usize;
        for recompute in [false, true] {
            let engine = Arc::new(EmbeddedEngine::new(load(name), config(recompute)).unwrap());
            let reqs = prompts
                .iter()
                .map(|p| {
                    let mut r = request(p.clone(), new_tokens, 0);
                    r.sampling_params.temperature = 0.0;
                    r
                })
                .collect();
            let outs = run_all(&engine, reqs).await;
            let got: Vec<Vec<u32>> = outs.into_iter().map(|o| o.output_ids).collect();
            assert_eq!(got, want, "{name} (recompute {recompute})");
        }
    }
}

/// Runs greedy requests for `prompts` on an engine paused while they arrive (so that one
/// admission round prefills them together) and on a one-at-a-time engine: the tokens must be
/// equal and the decode log-probs equal to float rounding. The most prompts the first engine
/// prefilled in one forward.
pub(crate) async fn prefilled_together_and_alone(
    model: CausalLm,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> usize {
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .map(|p| {
            let mut r = request(p.clone(), new_tokens, 0);
            r.sampling_params.temperature = 0.0;
            r
        })
        .collect();
    let together = Arc::new(EmbeddedEngine::new(model.clone(), config(false)).unwrap());
    together.pause(PauseMode::InPlace).await.unwrap();
    let handles: Vec<_> = reqs
        .iter()
        .cloned()
        .map(|r| {
            let e = together.clone();
            tokio::spawn(async move { e.generate(r).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    together.resume().await.unwrap();
    let mut a = Vec::new();
    for h in handles {
        a.push(h.await.unwrap().unwrap());
    }
    let alone = Arc::new(
        EmbeddedEngine::new(
            model,
            EngineConfig {
                max_running_requests: 1,
                ..config(false)
            },
        )
        .unwrap(),
    );
    let b = run_all(&alone, reqs).await;
    assert_eq!(alone.stats().max_prefill_batch, 0);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.output_ids, y.output_ids);
        let ys: Vec<f32> = y.output_log_probs.iter().map(|&v| v as f32).collect();
        let diff = max_diff(&x.output_log_probs, &ys);
        assert!(diff < 1e-5, "batched prefill log-probs differ by {diff}");
    }
    together.stats().max_prefill_batch
}

/// Prompts of different lengths admitted together are prefilled in one right-padded forward
/// (MoE routing, latent attention, plain grouped attention) and decode as when prefilled
/// alone.
#[tokio::test]
async fn ragged_prompts_prefilled_together_decode_as_alone() {
    for name in ["glm4moe-tiny", "dsv3-tiny", "qwen3-tiny"] {
        let model = load(name);
        let vocab = model.config.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [14, 12, 11, 9]
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(n, i as u32, vocab))
            .collect();
        let batched = prefilled_together_and_alone(model, &prompts, 8).await;
        assert_eq!(batched, 4, "{name}");
    }
}
