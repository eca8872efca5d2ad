//! The paged KV cache ([`PagedKvCache`], [`CausalLm::forward_paged`]): greedy decoding from
//! the pool equals transformers' `generate`; a batch of sequences of different lengths
//! decoded from the pool equals each sequence decoded alone through the contiguous cache;
//! blocks are reserved and returned exactly; bad steps are typed errors that write nothing;
//! a hybrid model's (Qwen3.5) linear-attention state slots are reserved, copied and returned
//! exactly beside the blocks, and a ragged batch of its prompts prefilled together equals each
//! prompt prefilled alone; GPT-OSS (attention sinks, a sliding window on alternate layers)
//! decodes from the pool past its window as transformers does, tokens and log-probs.

use std::path::Path;

use burn::tensor::{DType, Device, Int, Tensor};
use miles_bridge::{CausalLm, KvCache, ModelInput, MoeDispatch, PagedKvCache, RowId, ids_tensor};
use miles_r3::Fallthrough;

use crate::common::{HfGenerate, fixture, hf_generate};

/// The model an inference engine steps on flex: fused projections (packed on AVX-512F),
/// sparse experts.
fn step_model(dir: &Path, device: &Device) -> CausalLm {
    let mut model = CausalLm::from_pretrained(dir, device).unwrap();
    model.fuse_projections();
    model.set_moe_dispatch(MoeDispatch::Sparse);
    model
}

fn ids(rows: &[Vec<u32>], device: &Device) -> Tensor<2, Int> {
    ids_tensor(rows, device).unwrap()
}

fn rows_of(logits: Tensor<3>) -> Vec<Vec<f32>> {
    let [b, s, v] = logits.dims();
    let flat = logits
        .narrow(1, s - 1, 1)
        .reshape([b * v])
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap();
    flat.chunks(v).map(<[f32]>::to_vec).collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A one-row prefill through the contiguous cache.
fn prefill(model: &CausalLm, prompt: &[u32], device: &Device) -> (KvCache, Vec<f32>) {
    let mut cache = KvCache::new();
    let out = model
        .forward_cached(
            &ModelInput::new(ids(&[prompt.to_vec()], device)),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    (cache, rows_of(out.logits).remove(0))
}

/// Greedy decoding of the fixture's prompts from the pool: odd rows prefilled through the
/// contiguous cache and loaded, even rows prefilled by `forward_paged` itself (several tokens
/// per row: the gather path); then every row decoded in one batch. The tokens equal
/// transformers' `generate(do_sample=False)` (`reference_generate.json`).
fn assert_paged_greedy_equals_hf_generate(dir: &Path) {
    let HfGenerate {
        prompts,
        want,
        new_tokens,
    } = hf_generate(dir);
    let device = Device::flex();
    let model = step_model(dir, &device);
    let budget: usize = prompts.iter().map(|p| p.len() + new_tokens).sum();
    let mut pool = PagedKvCache::new(&model, budget, prompts.len()).unwrap();
    let mut rows = Vec::new();
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for (i, prompt) in prompts.iter().enumerate() {
        let row = pool.reserve(prompt.len() + new_tokens).unwrap();
        let last = if i % 2 == 1 {
            let (cache, last) = prefill(&model, prompt, &device);
            pool.load(row, &cache).unwrap();
            last
        } else {
            let out = model
                .forward_paged(
                    ids(std::slice::from_ref(prompt), &device),
                    &mut pool,
                    &[row],
                    &Fallthrough,
                )
                .unwrap();
            rows_of(out.logits).remove(0)
        };
        assert_eq!(pool.len(row), prompt.len());
        got[i].push(argmax(&last));
        rows.push(row);
    }
    for _ in 1..new_tokens {
        let step: Vec<Vec<u32>> = got.iter().map(|g| vec![*g.last().unwrap()]).collect();
        let out = model
            .forward_paged(ids(&step, &device), &mut pool, &rows, &Fallthrough)
            .unwrap();
        for (g, logits) in got.iter_mut().zip(rows_of(out.logits)) {
            g.push(argmax(&logits));
        }
    }
    assert_eq!(
        got,
        want,
        "{}: paged greedy decode differs from HF",
        dir.display()
    );
}

#[test]
fn paged_greedy_decode_equals_hf_generate() {
    // Grouped-query attention (qwen2, tied and untied), DeepSeek-V3's latent attention and
    // Qwen3.5's hybrid of Gated DeltaNet state slots and gated full attention (a prefill
    // through `forward_paged` runs the chunked form from a zeroed slot, decode the recurrent
    // form over the batch's slots).
    for name in [
        "qwen2-tiny",
        "qwen2-untied",
        "dsv3-tiny",
        "dsv3-noq",
        "qwen35-tiny",
        "qwen35moe-tiny",
        "gptoss-tiny",
    ] {
        assert_paged_greedy_equals_hf_generate(&fixture(name));
    }
}

/// Sequences of different lengths decoded together from the pool against each decoded
/// alone through the contiguous cache, on the same step model: the same logits at every
/// step — bit for bit where the paged decode kernel runs (flex, f32, AVX-512F; the packed
/// matmuls are row-invariant there too), within float rounding elsewhere.
fn assert_batch_equals_alone(name: &str, lens: &[usize], steps: usize) {
    let dir = fixture(name);
    let device = Device::flex();
    let model = step_model(&dir, &device);
    let c = &model.config;
    let exact = miles_ops::paged::applies(&device, DType::F32, c.head_dim);
    let vocab = c.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..n as u32)
                .map(|t| (7 + 31 * t + 13 * r as u32) % vocab)
                .collect()
        })
        .collect();
    // Alone: prefill, then `steps` greedy tokens through the contiguous cache.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for prompt in &prompts {
        let (mut cache, mut last) = prefill(&model, prompt, &device);
        let mut per_step = vec![last.clone()];
        for _ in 0..steps {
            let out = model
                .forward_cached(
                    &ModelInput::new(ids(&[vec![argmax(&last)]], &device)),
                    &mut cache,
                    &Fallthrough,
                )
                .unwrap();
            last = rows_of(out.logits).remove(0);
            per_step.push(last.clone());
        }
        alone.push(per_step);
    }
    // Together from the pool (a pool with room for more than these rows, so blocks are
    // spread over it; one row released and reserved again first, so ids are reused).
    let budget = 4 * lens.iter().map(|n| n + steps).sum::<usize>();
    let mut pool = PagedKvCache::new(&model, budget, 2 * lens.len()).unwrap();
    let spare = pool.reserve(40).unwrap();
    let mut rows: Vec<RowId> = Vec::new();
    let mut last = Vec::new();
    for prompt in &prompts {
        let row = pool.reserve(prompt.len() + steps).unwrap();
        let (cache, l) = prefill(&model, prompt, &device);
        pool.load(row, &cache).unwrap();
        rows.push(row);
        last.push(l);
    }
    pool.release(spare);
    for step in 0..steps {
        let input: Vec<Vec<u32>> = last.iter().map(|l| vec![argmax(l)]).collect();
        let out = model
            .forward_paged(ids(&input, &device), &mut pool, &rows, &Fallthrough)
            .unwrap();
        last = rows_of(out.logits);
        for (r, got) in last.iter().enumerate() {
            let want = &alone[r][step + 1];
            if exact {
                assert_eq!(got, want, "{name}: row {r}, step {step}: not bit-equal");
            } else {
                let worst = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(worst < 1e-4, "{name}: row {r}, step {step}: {worst}");
            }
        }
    }
    for (row, &n) in rows.iter().zip(lens) {
        assert_eq!(pool.len(*row), n + steps);
    }
}

#[test]
fn paged_batch_decode_equals_each_sequence_alone() {
    // GLM-4-MoE (sparse experts, head 16), Qwen3 (qk norm), DeepSeek-V3 (latent attention);
    // lengths across block boundaries (blocks of 16).
    assert_batch_equals_alone("glm4moe-tiny", &[1, 15, 16, 17, 40], 20);
    assert_batch_equals_alone("qwen3-tiny", &[3, 16, 33], 18);
    assert_batch_equals_alone("dsv3-tiny", &[2, 17], 6);
    // GPT-OSS: sinks, and a window of 6 on layers 0 and 2, crossed by every row.
    assert_batch_equals_alone("gptoss-tiny", &[1, 6, 7, 17], 12);
}

fn log_softmax_at(row: &[f32], token: u32) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row[token as usize] as f64 - max - sum.ln()
}

/// GPT-OSS from the pool against transformers (`gptoss-tiny/reference_engine.json`: prompts of
/// 3, 12 and 20 tokens, 12 greedy tokens each, past the window of 6): the first two prefilled
/// by `forward_paged` itself (several queries per row, the second crossing the window in the
/// step), the third through the contiguous cache and loaded; then decoded in one batch. The
/// tokens equal `generate`'s and every token's log-prob is within 1e-4 of its scores'.
#[test]
fn gpt_oss_paged_decode_matches_transformers_past_the_window() {
    let dir = fixture("gptoss-tiny");
    let text = std::fs::read_to_string(dir.join("reference_engine.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(v["prompts"].clone()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    let want_lp: Vec<Vec<f64>> = serde_json::from_value(v["output_logprobs"].clone()).unwrap();
    let new_tokens = v["max_new_tokens"].as_u64().unwrap() as usize;
    assert!(model_window(&dir) < prompts[1].len());
    let device = Device::flex();
    let model = step_model(&dir, &device);
    let budget: usize = prompts.iter().map(|p| p.len() + new_tokens).sum();
    let mut pool = PagedKvCache::new(&model, budget, prompts.len()).unwrap();
    let mut rows = Vec::new();
    let mut last = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let row = pool.reserve(prompt.len() + new_tokens).unwrap();
        last.push(if i < 2 {
            let out = model
                .forward_paged(
                    ids(std::slice::from_ref(prompt), &device),
                    &mut pool,
                    &[row],
                    &Fallthrough,
                )
                .unwrap();
            rows_of(out.logits).remove(0)
        } else {
            let (cache, last) = prefill(&model, prompt, &device);
            pool.load(row, &cache).unwrap();
            last
        });
        rows.push(row);
    }
    let mut got: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut worst = 0.0f64;
    for step in 0..new_tokens {
        for (r, logits) in last.iter().enumerate() {
            let token = argmax(logits);
            got[r].push(token);
            let diff = (log_softmax_at(logits, want[r][step]) - want_lp[r][step]).abs();
            assert!(
                diff < 1e-4,
                "row {r}, token {step}: log-prob off by {diff:.3e}"
            );
            worst = worst.max(diff);
        }
        if step + 1 < new_tokens {
            let input: Vec<Vec<u32>> = got.iter().map(|g| vec![*g.last().unwrap()]).collect();
            let out = model
                .forward_paged(ids(&input, &device), &mut pool, &rows, &Fallthrough)
                .unwrap();
            last = rows_of(out.logits);
        }
    }
    assert_eq!(got, want, "paged greedy decode differs from HF generate");
    println!("gptoss-tiny paged decode: worst log-prob difference {worst:.3e}");
}

fn model_window(dir: &Path) -> usize {
    miles_bridge::ModelConfig::from_file(dir.join("config.json"))
        .unwrap()
        .sliding_window
        .unwrap()
}

#[test]
fn pool_blocks_are_reserved_returned_and_copied_exactly() {
    let device = Device::flex();
    let model = step_model(&fixture("glm4moe-tiny"), &device);
    let block = PagedKvCache::BLOCK;
    let mut pool = PagedKvCache::new(&model, 5 * block, 2).unwrap();
    // 5 blocks for the budget and one spare per row.
    assert_eq!(pool.capacity(), 7 * block);
    // The fixture's 3 layers × keys and values × 2 KV heads × head 16, f32, per slot.
    assert_eq!(pool.bytes(), 3 * 2 * 2 * 16 * 4 * 7 * block);
    assert_eq!(pool.free_tokens(), 7 * block);
    let a = pool.reserve(3 * block + 1).unwrap();
    assert_eq!(pool.row_capacity(a), 4 * block);
    assert_eq!(pool.free_tokens(), 3 * block);
    let err = pool.reserve(3 * block + 1).unwrap_err().to_string();
    assert!(err.contains("free"), "{err}");
    assert_eq!(
        pool.free_tokens(),
        3 * block,
        "a refused reservation takes nothing"
    );
    let b = pool.reserve(3 * block).unwrap();
    assert_eq!(pool.free_tokens(), 0);
    assert_eq!(pool.active_rows(), 2);

    // load, then export: the same keys and values, bit for bit.
    let prompt: Vec<u32> = (0..37).map(|t| (t * 11 + 5) % 512).collect();
    let (cache, _) = prefill(&model, &prompt, &device);
    pool.load(a, &cache).unwrap();
    assert_eq!(pool.len(a), 37);
    let back = pool.export(a).unwrap();
    assert_eq!(back.len(), 37);
    assert_eq!(back.valid_lens(), vec![37]);
    for l in 0..model.model.layers.len() {
        let (x, y) = (cache.layer(l).unwrap(), back.layer(l).unwrap());
        let host = |t: Tensor<4>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        assert_eq!(host(x.keys), host(y.keys), "layer {l} keys");
        assert_eq!(
            host(x.values.unwrap()),
            host(y.values.unwrap()),
            "layer {l} values"
        );
    }
    // A cache longer than the row's blocks is refused.
    let long: Vec<u32> = (0..3 * block as u32 + 1).collect();
    let (cache_long, _) = prefill(&model, &long, &device);
    assert!(pool.load(b, &cache_long).is_err());
    assert_eq!(pool.len(b), 0);

    // Steps that cannot run are errors and write nothing.
    let one = |t: u32| ids(&[vec![t]], &device);
    let two = ids(&[vec![1], vec![2]], &device);
    assert!(
        model
            .forward_paged(two.clone(), &mut pool, &[a, a], &Fallthrough)
            .is_err()
    );
    assert!(
        model
            .forward_paged(two, &mut pool, &[a], &Fallthrough)
            .is_err()
    );
    pool.release(b);
    assert!(
        model
            .forward_paged(one(3), &mut pool, &[b], &Fallthrough)
            .is_err()
    );
    assert_eq!(pool.len(a), 37);
    // Fill row a to its 4 blocks, then one more token is refused.
    let rest = 4 * block - 37;
    let fill: Vec<u32> = (0..rest as u32).collect();
    model
        .forward_paged(ids(&[fill], &device), &mut pool, &[a], &Fallthrough)
        .unwrap();
    assert_eq!(pool.len(a), 4 * block);
    let err = model
        .forward_paged(one(4), &mut pool, &[a], &Fallthrough)
        .unwrap_err()
        .to_string();
    assert!(err.contains("full"), "{err}");
    // A pool built for another model is refused.
    let other = step_model(&fixture("dsv3-tiny"), &device);
    let mut foreign = PagedKvCache::new(&other, block, 1).unwrap();
    let row = foreign.reserve(4).unwrap();
    assert!(
        model
            .forward_paged(one(1), &mut foreign, &[row], &Fallthrough)
            .is_err()
    );
    // Releasing returns every block.
    pool.release(a);
    pool.clear();
    assert_eq!(pool.free_tokens(), pool.capacity());
    assert_eq!(pool.active_rows(), 0);
    assert!(PagedKvCache::new(&model, 0, 1).is_err());
    assert!(PagedKvCache::new(&model, usize::MAX, 1).is_err());
}

/// Qwen3.5's pool: the full layer's blocks plus one state slot per row for each Gated
/// DeltaNet layer; a slot is taken with the blocks (none free: the reservation is refused and
/// takes nothing), copied in and out bit for bit with the keys, and returned on release; a
/// decode step from the pool equals one through the contiguous cache.
#[test]
fn hybrid_state_slots_are_reserved_copied_and_returned_exactly() {
    let device = Device::flex();
    let model = step_model(&fixture("qwen35-tiny"), &device);
    let block = PagedKvCache::BLOCK;
    // qwen35-tiny: 3 linear layers × (conv window 3 × 64 + state 4 × 8 × 8) f32 per row, and
    // one full layer's keys and values of 2 KV heads × 16, f32, per position.
    assert_eq!(
        PagedKvCache::state_bytes_per_row(&model),
        3 * (3 * 64 + 4 * 8 * 8) * 4
    );
    assert_eq!(PagedKvCache::bytes_per_token(&model), 2 * 2 * 16 * 4);
    let mut pool = PagedKvCache::new(&model, 6 * block, 2).unwrap();
    assert_eq!((pool.state_slots(), pool.free_state_slots()), (2, 2));
    assert_eq!(
        pool.bytes(),
        pool.capacity() * 2 * 2 * 16 * 4 + 2 * 3 * (3 * 64 + 4 * 8 * 8) * 4
    );
    let a = pool.reserve(80).unwrap();
    let b = pool.reserve(4).unwrap();
    assert_eq!(pool.free_state_slots(), 0);
    let free = pool.free_tokens();
    assert!(free >= 4 && !pool.can_reserve(4));
    let err = pool.reserve(4).unwrap_err().to_string();
    assert!(err.contains("state slots"), "{err}");
    assert_eq!(
        pool.free_tokens(),
        free,
        "a refused reservation takes nothing"
    );

    // A 70-token prefill (two delta-rule chunks) in and out: keys, values and states equal.
    let prompt: Vec<u32> = (0..70).map(|t| (t * 11 + 5) % 128).collect();
    let (mut cache, _) = prefill(&model, &prompt, &device);
    pool.load(a, &cache).unwrap();
    let back = pool.export(a).unwrap();
    assert_eq!(back.len(), 70);
    let host3 = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let host4 = |t: Tensor<4>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    for l in 0..model.model.layers.len() {
        match (cache.linear_state(l), back.linear_state(l)) {
            (Some(x), Some(y)) => {
                assert_eq!(
                    host3(x.conv.clone()),
                    host3(y.conv.clone()),
                    "layer {l} conv"
                );
                assert_eq!(
                    host4(x.recurrent.clone()),
                    host4(y.recurrent.clone()),
                    "layer {l} state"
                );
            }
            (None, None) => {
                let (x, y) = (cache.layer(l).unwrap(), back.layer(l).unwrap());
                assert_eq!(host4(x.keys), host4(y.keys), "layer {l} keys");
            }
            _ => panic!("layer {l}: a state on one side only"),
        }
    }
    // One decode step from the pool (rows a and b: b from a zeroed slot) against the
    // contiguous cache and a fresh one-token prefill.
    let out = model
        .forward_paged(
            ids(&[vec![9], vec![3]], &device),
            &mut pool,
            &[a, b],
            &Fallthrough,
        )
        .unwrap();
    let got = rows_of(out.logits);
    let step = model
        .forward_cached(
            &ModelInput::new(ids(&[vec![9]], &device)),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    let (_, alone) = prefill(&model, &[3], &device);
    for (got, want) in got.iter().zip([rows_of(step.logits).remove(0), alone]) {
        let worst = got
            .iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "paged hybrid step differs by {worst}");
    }
    assert_eq!((pool.len(a), pool.len(b)), (71, 1));
    // Released rows return their slots.
    pool.release(b);
    assert_eq!(pool.free_state_slots(), 1);
    assert!(pool.can_reserve(4));
    pool.clear();
    assert_eq!(pool.free_state_slots(), 2);
    assert_eq!(pool.free_tokens(), pool.capacity());
}

/// A right-padded batch of hybrid prompts of different lengths (70 tokens: two delta-rule
/// chunks; 21; 5; one token) prefilled in one `forward_paged_hidden` with their real lengths:
/// each row's conv window and delta-rule state in its slot, and the logits of its last real
/// position, equal the row's own prefill through the contiguous cache (to the rounding of
/// projections over more rows); a decode step from the pool then equals one from each row's
/// own cache.
#[test]
fn hybrid_ragged_paged_prefill_equals_each_prompt_alone() {
    let device = Device::flex();
    let model = step_model(&fixture("qwen35moe-tiny"), &device);
    let lens = [70usize, 21, 5, 1];
    let prompts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            (0..n as u32)
                .map(|t| (t * 13 + 7 * r as u32 + 3) % 128)
                .collect()
        })
        .collect();
    let width = lens[0];
    let mut pool = PagedKvCache::new(&model, 8 * PagedKvCache::BLOCK * lens.len(), 4).unwrap();
    let rows: Vec<RowId> = lens
        .iter()
        .map(|_| pool.reserve(width + 4).unwrap())
        .collect();
    let padded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut p = p.clone();
            p.resize(width, 0);
            p
        })
        .collect();
    let out = model
        .forward_paged_hidden(
            ids(&padded, &device),
            &mut pool,
            &rows,
            Some(&lens),
            &Fallthrough,
        )
        .unwrap();
    let hidden = model.config.hidden_size;
    let host3 = |t: Tensor<3>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let host4 = |t: Tensor<4>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let worst = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let mut caches = Vec::new();
    for (r, (&n, &row)) in lens.iter().zip(&rows).enumerate() {
        assert_eq!(pool.len(row), n);
        let (cache, want) = prefill(&model, &prompts[r], &device);
        let last = out.hidden.clone().narrow(0, r, 1).narrow(1, n - 1, 1);
        let got = model.logits(last.reshape([1, hidden]));
        let got = host3(got.unsqueeze_dim::<3>(0));
        assert!(worst(&got, &want) < 1e-4, "row {r}: last logits");
        let back = pool.export(row).unwrap();
        for l in 0..model.model.layers.len() {
            if let (Some(x), Some(y)) = (cache.linear_state(l), back.linear_state(l)) {
                let conv = worst(&host3(x.conv.clone()), &host3(y.conv.clone()));
                let state = worst(&host4(x.recurrent.clone()), &host4(y.recurrent.clone()));
                assert!(
                    conv < 1e-5 && state < 1e-5,
                    "row {r} layer {l}: {conv} {state}"
                );
            }
        }
        caches.push(cache);
    }
    // One decode step of every row from the pool against each row's own cache.
    let next: Vec<Vec<u32>> = (0..lens.len() as u32).map(|r| vec![11 + r]).collect();
    let step = model
        .forward_paged(ids(&next, &device), &mut pool, &rows, &Fallthrough)
        .unwrap();
    let got = rows_of(step.logits);
    for (r, cache) in caches.iter_mut().enumerate() {
        let want = model
            .forward_cached(
                &ModelInput::new(ids(&next[r..r + 1], &device)),
                cache,
                &Fallthrough,
            )
            .unwrap();
        let want = rows_of(want.logits).remove(0);
        assert!(
            worst(&got[r], &want) < 1e-4,
            "row {r}: decode step after the prefill"
        );
    }
}
