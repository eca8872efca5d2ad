//! The engine on hybrid models (Qwen3.5's Gated DeltaNet linear-attention layers beside gated
//! full attention: `fixtures/models/qwen35-tiny`, `qwen35moe-tiny`): per-sequence conv and
//! recurrent states in state slots beside the paged KV pool. Greedy decode of prompts batched
//! together equals transformers' `generate` (`reference_engine.json`, written by
//! `gen_qwen3_5.py`: prompts of 3, 21 and 70 tokens, the last past a 64-token delta-rule
//! chunk); decode log-probs equal miles-bridge's full forward; an abort returns the slot; a
//! weight update never mixes versions; the states' share of the budget makes requests wait;
//! prefixes are reused whole only; prompts of different lengths are prefilled together; a
//! GRPO group's copies of a prompt start from a copy of the first copy's states.

use std::sync::Arc;

use burn::tensor::Device;
use miles_bridge::CausalLm;
use miles_core::{
    EngineErrorKind, Error as CoreError, FinishReason, GenerateRequest, InferenceEngine, PauseMode,
    RequestId, WeightVersion,
};
use miles_engine::{EmbeddedEngine, EngineConfig, Error};

use crate::engine::{
    config, fixture, full_forward, load, max_diff, request, run_all, scaled_weights,
};

struct Reference {
    prompts: Vec<Vec<u32>>,
    want: Vec<Vec<u32>>,
    new_tokens: usize,
}

fn reference(name: &str) -> Reference {
    let text = std::fs::read_to_string(fixture(name).join("reference_engine.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    Reference {
        prompts: serde_json::from_value(v["prompts"].clone()).unwrap(),
        want: serde_json::from_value(v["output_ids"].clone()).unwrap(),
        new_tokens: v["max_new_tokens"].as_u64().unwrap() as usize,
    }
}

fn greedy(prompt: Vec<u32>, new_tokens: usize) -> GenerateRequest {
    let mut r = request(prompt, new_tokens, 0);
    r.sampling_params.temperature = 0.0;
    r
}

/// Waits (a bounded number of scheduler iterations) until the engine reports `free` free
/// state slots.
async fn free_slots_become(engine: &EmbeddedEngine, free: usize) {
    for _ in 0..2_000 {
        if engine.stats().free_state_slots == free {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    panic!("free state slots stay at {:?}", engine.stats());
}

#[tokio::test]
async fn hybrid_batched_greedy_decode_equals_hf_generate() {
    for name in ["qwen35-tiny", "qwen35moe-tiny"] {
        let model = load(name);
        let Reference {
            prompts,
            want,
            new_tokens,
        } = reference(name);
        let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(false)).unwrap());
        let reqs = prompts
            .iter()
            .map(|p| greedy(p.clone(), new_tokens))
            .collect();
        let outs = run_all(&engine, reqs).await;
        let got: Vec<Vec<u32>> = outs.iter().map(|o| o.output_ids.clone()).collect();
        assert_eq!(got, want, "{name}: engine greedy differs from HF generate");
        let stats = engine.stats();
        assert!(stats.max_batch > 1, "{name}: {stats:?}");
        assert_eq!(stats.state_slots, 32, "{name}: {stats:?}");
        // Every slot back once the answers are out (the stats follow a scheduler step later).
        free_slots_become(&engine, 32).await;
        // Decode-time log-probs (no recompute) against the bridge's full forward.
        for (p, out) in prompts.iter().zip(&outs) {
            let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
            let (full, _) = full_forward(&model, &tokens, new_tokens);
            let diff = max_diff(&out.output_log_probs, &full);
            assert!(diff < 2e-4, "{name}: decode log-probs differ by {diff}");
            if model.config.has_moe() {
                let routes = out.routed_experts.as_ref().expect("routed experts");
                assert_eq!(routes.rows(), tokens.len() - 1, "{name}");
            }
        }
    }
}

/// One state slot (`max_running_requests` 1): a sequence aborted mid-decode while held by an
/// in-place pause returns its slot, and the next request is served from it exactly.
#[tokio::test]
async fn an_aborted_hybrid_sequence_returns_its_state_slot() {
    let name = "qwen35-tiny";
    let Reference {
        prompts,
        want,
        new_tokens,
    } = reference(name);
    let engine = Arc::new(
        EmbeddedEngine::new(
            load(name),
            EngineConfig {
                max_running_requests: 1,
                ..config(true)
            },
        )
        .unwrap(),
    );
    assert_eq!(engine.stats().state_slots, 1);
    let mut long = request(prompts[1].clone(), 400, 1);
    long.request_id = Some(RequestId::new("long"));
    let e = engine.clone();
    let h = tokio::spawn(async move { e.generate(long).await });
    while engine.stats().generated_tokens < 3 {
        tokio::task::yield_now().await;
    }
    engine.pause(PauseMode::InPlace).await.unwrap();
    free_slots_become(&engine, 0).await;
    engine.abort(&RequestId::new("long")).await.unwrap();
    let out = h.await.unwrap().unwrap();
    assert_eq!(out.finish_reason, FinishReason::Abort);
    assert!(out.output_ids.len() < 400);
    free_slots_become(&engine, 1).await;
    engine.resume().await.unwrap();
    let next = engine
        .generate(greedy(prompts[0].clone(), new_tokens))
        .await
        .unwrap();
    assert_eq!(next.output_ids, want[0]);
    free_slots_become(&engine, 1).await;
}

/// The states take their share of the KV budget: 80 tokens pay for one 21-token slot from
/// their half (qwen35-tiny: 5,376 state bytes per sequence, 256 bytes per cached position),
/// so requests that fit the remaining 59 tokens together still run one at a time, each as
/// HF's `generate`; one beyond those 59 tokens is refused, and a budget without room for a
/// slot is a configuration error.
#[tokio::test]
async fn hybrid_states_count_against_the_kv_budget() {
    let name = "qwen35-tiny";
    let Reference {
        prompts,
        want,
        new_tokens,
    } = reference(name);
    let budget = |tokens| EngineConfig {
        kv_token_budget: tokens,
        kv_memory_fraction: None,
        ..config(true)
    };
    let engine = Arc::new(EmbeddedEngine::new(load(name), budget(80)).unwrap());
    assert_eq!(engine.stats().state_slots, 1);
    engine.pause(PauseMode::InPlace).await.unwrap();
    let reqs: Vec<GenerateRequest> = prompts[..2]
        .iter()
        .map(|p| greedy(p.clone(), new_tokens))
        .collect();
    let e = engine.clone();
    let all = tokio::spawn(async move { run_all(&e, reqs).await });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    engine.resume().await.unwrap();
    let outs = all.await.unwrap();
    let got: Vec<Vec<u32>> = outs.into_iter().map(|o| o.output_ids).collect();
    assert_eq!(got, want[..2].to_vec());
    let stats = engine.stats();
    assert_eq!(stats.max_batch, 1, "{stats:?}");
    assert!(stats.budget_waits >= 1, "{stats:?}");
    let err = engine
        .generate(greedy(prompts[2][..50].to_vec(), 10))
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
    let err = EmbeddedEngine::new(load(name), budget(41)).unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("linear-attention state")),
        "{err}"
    );
}

/// A weight update waits for the sequence in flight (its tokens all come from the old
/// weights), and the request queued behind it runs on the new ones.
#[tokio::test]
async fn a_hybrid_weight_update_never_mixes_versions() {
    let name = "qwen35moe-tiny";
    let model = load(name);
    let Reference { prompts, .. } = reference(name);
    let new_weights = scaled_weights(&model, 1.05);
    let updated =
        CausalLm::from_hf_tensors(&model.config, new_weights.clone(), &Device::flex()).unwrap();
    let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(false)).unwrap());
    let e = engine.clone();
    let first = prompts[2].clone();
    let a = tokio::spawn(async move { e.generate(request(first, 12, 1)).await });
    while engine.stats().prefill_tokens == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let e = engine.clone();
    let w = new_weights.clone();
    let update = tokio::spawn(async move { e.update_weights(&w, WeightVersion(1)).await });
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    let e = engine.clone();
    let second = prompts[1].clone();
    let b = tokio::spawn(async move { e.generate(request(second, 12, 2)).await });
    let outs = [a.await.unwrap().unwrap(), b.await.unwrap().unwrap()];
    update.await.unwrap().unwrap();
    for (p, out, version) in [(&prompts[2], &outs[0], 0), (&prompts[1], &outs[1], 1)] {
        assert_eq!(out.weight_version, WeightVersion(version));
        assert_eq!(out.output_ids.len(), 12);
        let tokens: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
        let (old, _) = full_forward(&model, &tokens, 12);
        let (new, _) = full_forward(&updated, &tokens, 12);
        let (d_old, d_new) = (
            max_diff(&out.output_log_probs, &old),
            max_diff(&out.output_log_probs, &new),
        );
        let (same, other) = if version == 0 {
            (d_old, d_new)
        } else {
            (d_new, d_old)
        };
        assert!(same < 2e-4 && other > 1e-2, "v{version}: {d_old} / {d_new}");
    }
}

/// A finished turn's states are a snapshot the next turn of the session continues from; a
/// shorter prefix of a cached sequence cannot be cut from its states, but the same prompt
/// again reuses its prefill's snapshot (all of the prompt but its last token) whole.
#[tokio::test]
async fn hybrid_prefixes_are_reused_whole_only() {
    let name = "qwen35-tiny";
    let model = load(name);
    let Reference { prompts, .. } = reference(name);
    let engine = EmbeddedEngine::new(model.clone(), config(false)).unwrap();
    let p = prompts[1].clone();
    let first = engine.generate(request(p.clone(), 8, 1)).await.unwrap();
    assert_eq!(first.cached_tokens, 0);
    // The same prompt again: the prefill's entry (all of the prompt but its last token, with
    // the states after it) is reused whole; the last token is the first decode step's.
    let again = engine.generate(request(p.clone(), 8, 2)).await.unwrap();
    assert_eq!(again.cached_tokens, p.len() - 1);
    let tokens: Vec<u32> = p.iter().chain(&again.output_ids).copied().collect();
    let (full, _) = full_forward(&model, &tokens, 8);
    let diff = max_diff(&again.output_log_probs, &full);
    assert!(
        diff < 2e-4,
        "log-probs from a reused prompt differ by {diff}"
    );
    let mut turn2: Vec<u32> = p.iter().chain(&first.output_ids).copied().collect();
    turn2.extend(&prompts[0]);
    let second = engine.generate(request(turn2.clone(), 8, 3)).await.unwrap();
    assert_eq!(second.cached_tokens, p.len() + first.output_ids.len() - 1);
    let tokens: Vec<u32> = turn2.iter().chain(&second.output_ids).copied().collect();
    let (full, _) = full_forward(&model, &tokens, 8);
    let diff = max_diff(&second.output_log_probs, &full);
    assert!(
        diff < 2e-4,
        "log-probs after a reused prefix differ by {diff}"
    );
}

/// Prompts admitted together are prefilled in one right-padded forward, of equal or
/// different lengths (each row's conv and delta rule run over its own real tokens, so its
/// states are its own): the greedy tokens equal those of the same prompts prefilled one at a
/// time, and the decode log-probs equal them to float rounding.
#[tokio::test]
async fn hybrid_prompts_prefilled_together_decode_as_alone() {
    let name = "qwen35moe-tiny";
    let model = load(name);
    let Reference { prompts, .. } = reference(name);
    let vocab = model.config.vocab_size as u32;
    // Two distinct prompts of 21 tokens (and one of 70, alone in its group).
    let mut batch: Vec<Vec<u32>> = (0..2u32)
        .map(|i| prompts[1].iter().map(|&t| (t + 7 * i) % vocab).collect())
        .collect();
    batch.push(prompts[2].clone());
    // Prompts of 19, 16 and 2 tokens (the shortest a one-token row of the prefill).
    for (i, n) in [19usize, 16, 2].into_iter().enumerate() {
        let i = i as u32 + 2;
        batch.push(
            prompts[1][..n]
                .iter()
                .map(|&t| (t + 7 * i) % vocab)
                .collect(),
        );
    }
    let batched = crate::engine::prefilled_together_and_alone(model.clone(), &batch, 8).await;
    assert!(batched >= 4, "prefilled {batched} prompts together");
}

/// A GRPO group's copies of one prompt admitted together: the first copy is prefilled (all of
/// its prompt but the last token), the others start from a copy of its cached conv and
/// recurrent states (no prefill of their own) and feed the last token to the same decode
/// step: greedy tokens, routing and log-probs equal the first copy's, and the log-probs equal
/// a full forward's to float rounding.
#[tokio::test]
async fn hybrid_group_copies_start_from_the_cached_states() {
    let name = "qwen35moe-tiny";
    let model = load(name);
    let Reference { prompts, .. } = reference(name);
    let p = prompts[1].clone();
    let engine = Arc::new(EmbeddedEngine::new(model.clone(), config(false)).unwrap());
    engine.pause(PauseMode::InPlace).await.unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let e = engine.clone();
            let r = greedy(p.clone(), 8);
            tokio::spawn(async move { e.generate(r).await })
        })
        .collect();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    engine.resume().await.unwrap();
    let mut outs = Vec::new();
    for h in handles {
        outs.push(h.await.unwrap().unwrap());
    }
    let mut cached: Vec<usize> = outs.iter().map(|o| o.cached_tokens).collect();
    cached.sort_unstable();
    assert_eq!(cached, [0, p.len() - 1, p.len() - 1, p.len() - 1]);
    // One prefill of the prompt but its last token, none for the copies.
    assert_eq!(engine.stats().prefill_tokens, (p.len() - 1) as u64);
    let first = &outs[0];
    let tokens: Vec<u32> = p.iter().chain(&first.output_ids).copied().collect();
    let (full, _) = full_forward(&model, &tokens, 8);
    for o in &outs {
        assert_eq!(o.output_ids, first.output_ids);
        assert_eq!(o.routed_experts, first.routed_experts);
        let diff = max_diff(&o.output_log_probs, &full);
        assert!(
            diff < 2e-4,
            "a copy's log-probs differ from a full forward by {diff}"
        );
    }
}
