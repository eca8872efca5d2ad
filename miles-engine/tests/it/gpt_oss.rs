//! The engine on GPT-OSS (`fixtures/models/gptoss-tiny`: attention sinks on every layer, a
//! sliding window of 6 on layers 0 and 2): prompts of 3, 12 and 20 tokens decoded batched
//! from the paged KV pool past the window equal transformers' greedy `generate`
//! (`reference_engine.json`, written by `gen_gpt_oss.py`), tokens and log-probs; a follow-up
//! prompt served from the prefix cache (its prefill starting past the window) continues as
//! transformers does.

use std::sync::Arc;

use miles_core::{GenerateRequest, InferenceEngine};
use miles_engine::EmbeddedEngine;

use crate::engine::{config, fixture, load, request, run_all};

struct Reference {
    prompts: Vec<Vec<u32>>,
    want: Vec<Vec<u32>>,
    log_probs: Vec<Vec<f64>>,
    new_tokens: usize,
}

fn reference() -> Reference {
    let text = std::fs::read_to_string(fixture("gptoss-tiny").join("reference_engine.json"))
        .expect("reference_engine.json");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    Reference {
        prompts: serde_json::from_value(v["prompts"].clone()).unwrap(),
        want: serde_json::from_value(v["output_ids"].clone()).unwrap(),
        log_probs: serde_json::from_value(v["output_logprobs"].clone()).unwrap(),
        new_tokens: v["max_new_tokens"].as_u64().unwrap() as usize,
    }
}

fn greedy(prompt: Vec<u32>, new_tokens: usize) -> GenerateRequest {
    let mut r = request(prompt, new_tokens, 0);
    r.sampling_params.temperature = 0.0;
    r
}

fn worst(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max)
}

#[tokio::test]
async fn gpt_oss_batched_greedy_decode_equals_hf_generate_past_the_window() {
    let Reference {
        prompts,
        want,
        log_probs,
        new_tokens,
    } = reference();
    let window = load("gptoss-tiny").config.sliding_window.unwrap();
    assert!(prompts.iter().any(|p| p.len() > window));
    // Decode-time log-probs, and log-probs recomputed by a prefill of the whole sequence.
    for recompute in [false, true] {
        let engine = Arc::new(EmbeddedEngine::new(load("gptoss-tiny"), config(recompute)).unwrap());
        let reqs = prompts
            .iter()
            .map(|p| greedy(p.clone(), new_tokens))
            .collect();
        let outs = run_all(&engine, reqs).await;
        let got: Vec<Vec<u32>> = outs.iter().map(|o| o.output_ids.clone()).collect();
        assert_eq!(got, want, "engine greedy differs from HF generate");
        for (out, want) in outs.iter().zip(&log_probs) {
            let diff = worst(&out.output_log_probs, want);
            assert!(
                diff < 1e-4,
                "recompute {recompute}: log-probs off by {diff:.3e}"
            );
        }
        assert!(engine.stats().max_batch > 1, "{:?}", engine.stats());
    }

    // Prefix reuse: the 20-token prompt and 6 of its tokens again; the cached prefix is
    // loaded and the rest prefilled past the window. The rest of HF's continuation follows.
    let engine = Arc::new(EmbeddedEngine::new(load("gptoss-tiny"), config(false)).unwrap());
    let first = engine
        .generate(greedy(prompts[2].clone(), new_tokens))
        .await
        .unwrap();
    assert_eq!(first.output_ids, want[2]);
    let resumed: Vec<u32> = prompts[2].iter().chain(&want[2][..6]).copied().collect();
    let next = engine
        .generate(greedy(resumed, new_tokens - 6))
        .await
        .unwrap();
    assert!(
        engine.stats().cached_prompt_tokens > 0,
        "{:?}",
        engine.stats()
    );
    assert_eq!(next.output_ids, want[2][6..]);
    let diff = worst(&next.output_log_probs, &log_probs[2][6..]);
    assert!(
        diff < 1e-4,
        "after prefix reuse: log-probs off by {diff:.3e}"
    );
}
