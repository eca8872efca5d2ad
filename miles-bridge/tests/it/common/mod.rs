//! Checks shared by the architecture tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{CausalLm, KvCache, ModelInput, ids_tensor};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::Fallthrough;
use safetensors::SafeTensors;

/// Greedy decoding with the KV cache (prefill, then one token per step, every prompt in one
/// batch) gives exactly the tokens transformers' `generate(do_sample=False)` gave, as stored
/// in the fixture's `reference_generate.json`.
pub fn assert_greedy_kv_cache_decode_equals_hf_generate(dir: &Path) {
    let HfGenerate {
        prompts,
        want,
        new_tokens,
    } = hf_generate(dir);
    let device = Device::flex();
    let model = CausalLm::from_pretrained(dir, &device).unwrap();
    let mut cache = KvCache::new();
    let mut step = prompts.clone();
    let mut got = vec![Vec::new(); prompts.len()];
    for _ in 0..new_tokens {
        let out = model
            .forward_cached(
                &ModelInput::new(ids_tensor(&step, &device).unwrap()),
                &mut cache,
                &Fallthrough,
            )
            .unwrap();
        let [b, s, vocab] = out.logits.dims();
        let last = out
            .logits
            .narrow(1, s - 1, 1)
            .reshape([b, vocab])
            .argmax(1)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        for (row, &t) in last.iter().enumerate() {
            got[row].push(t as u32);
        }
        step = last.iter().map(|&t| vec![t as u32]).collect();
    }
    assert_eq!(
        got,
        want,
        "{}: greedy decode differs from HF generate",
        dir.display()
    );
}

/// A fixture's `reference_generate.json`: transformers' greedy `generate` on its prompts.
pub struct HfGenerate {
    /// The prompts.
    pub prompts: Vec<Vec<u32>>,
    /// The generated tokens of each prompt.
    pub want: Vec<Vec<u32>>,
    /// Tokens generated per prompt.
    pub new_tokens: usize,
}

/// Reads a fixture's [`HfGenerate`].
pub fn hf_generate(dir: &Path) -> HfGenerate {
    let text = std::fs::read_to_string(dir.join("reference_generate.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    HfGenerate {
        prompts: serde_json::from_value(v["prompts"].clone()).unwrap(),
        want: serde_json::from_value(v["output_ids"].clone()).unwrap(),
        new_tokens: v["max_new_tokens"].as_u64().unwrap() as usize,
    }
}

/// A fixture directory under `fixtures/models`.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

/// A reference safetensors file of a fixture: name → (shape, values as f64).
pub fn reference(dir: &Path, file: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = BTreeMap::new();
    for (name, view) in st.iter() {
        let data = view.data();
        let values: Vec<f64> = match view.dtype() {
            safetensors::Dtype::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            safetensors::Dtype::I64 => data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
            other => panic!("unexpected dtype {other:?}"),
        };
        out.insert(name.to_string(), (view.shape().to_vec(), values));
    }
    out
}

/// The token rows of a fixture's `reference_inputs.json`.
pub fn rows_of(dir: &Path) -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(dir.join("reference_inputs.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    serde_json::from_value(v["input_ids"].clone()).unwrap()
}

/// The model of a fixture directory against its `reference_outputs.safetensors`: logits and
/// token log-probs within `tol`, the routed expert sets of every MoE layer (`moe_layers`)
/// identical, decoding through the KV cache (5-token prefill, then one token per step) within
/// `1e-5` of the full forward's log-probs, and the f32 export equal to the checkpoint file.
/// Returns the worst log-prob difference.
pub fn assert_matches_reference(dir: &Path, moe_layers: &[usize], tol: f64) -> f64 {
    use burn::tensor::Tensor;
    use miles_bridge::token_logprobs;
    use miles_core::{DType, NamedTensors};
    let name = dir.display();
    let rows = rows_of(dir);
    let device = Device::flex();
    let model = CausalLm::from_pretrained(dir, &device).unwrap();
    let ids = ids_tensor(&rows, &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let refs = reference(dir, "reference_outputs.safetensors");
    let diff = |got: Vec<f32>, want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{name}");
        got.iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).abs())
            .fold(0.0, f64::max)
    };
    let logits = out.logits.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_logits = diff(logits, &refs["logits"].1);
    let lp = token_logprobs(out.logits, ids.clone())
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let d_lp = diff(lp.clone(), &refs["token_logprobs"].1);
    println!("{name}: max |logits - ref| = {d_logits:.3e}, max |logprobs - ref| = {d_lp:.3e}");
    assert!(
        d_logits <= tol && d_lp <= tol,
        "{name}: logits {d_logits:.3e}, log-probs {d_lp:.3e} > {tol:.0e}"
    );
    let layers: Vec<usize> = out.routing.iter().map(|r| r.layer_index).collect();
    assert_eq!(layers, moe_layers, "{name}: MoE layers");
    assert_routes_match(&name.to_string(), &out.routing, &refs);
    let mut cache = KvCache::new();
    let prefill: Vec<Vec<u32>> = rows.iter().map(|r| r[..5].to_vec()).collect();
    let mut parts = Vec::new();
    let mut step = prefill;
    for t in 5..=rows[0].len() {
        let out = model
            .forward_cached(
                &ModelInput::new(ids_tensor(&step, &device).unwrap()),
                &mut cache,
                &Fallthrough,
            )
            .unwrap();
        parts.push(out.logits);
        if t < rows[0].len() {
            step = rows.iter().map(|r| vec![r[t]]).collect();
        }
    }
    let cached = token_logprobs(Tensor::cat(parts, 1), ids)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let d_cache = cached
        .iter()
        .zip(&lp)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        d_cache <= 1e-5,
        "{name}: cached decoding differs by {d_cache}"
    );
    // The export equals the checkpoint, but for the empty shared-expert tensors transformers
    // saves with `n_shared_experts = 0` (skipped on import, not written).
    let exported = model.to_hf_tensors(DType::F32).unwrap();
    let mut checkpoint = NamedTensors::read_hf_checkpoint(dir).unwrap();
    checkpoint.retain(|_, t| t.numel() > 0);
    assert_eq!(exported, checkpoint, "{name}: export = checkpoint");
    d_lp
}

/// Token log-probs of `rows` (next-token, `[rows × (seq - 1)]` flattened) through the training
/// path that never materialises the logits: `forward_hidden` and miles-ops' fused chunked
/// log-prob op against `lm_head_weight()`, in small chunks so the op really chunks tokens and
/// vocabulary. Differentiable when `device` is an autodiff device.
pub fn fused_token_logprobs(model: &CausalLm, rows: &[Vec<u32>], device: &Device) -> Tensor<1> {
    let ids = ids_tensor(rows, device).unwrap();
    let hidden = model
        .forward_hidden(&ModelInput::new(ids), &Fallthrough)
        .unwrap()
        .hidden;
    let [_, seq, h] = hidden.dims();
    let fused = FusedLogProbConfig {
        token_chunk: 4,
        vocab_chunk: 96,
        ..FusedLogProbConfig::default()
    };
    let lps = rows
        .iter()
        .enumerate()
        .map(|(b, row)| {
            let x = hidden
                .clone()
                .narrow(0, b, 1)
                .reshape([seq, h])
                .narrow(0, 0, seq - 1);
            let targets = Tensor::<1, Int>::from_data(
                TensorData::new(row[1..].iter().map(|&t| t as i32).collect(), [seq - 1]),
                device,
            );
            fused.forward(x, model.lm_head_weight(), targets).unwrap().0
        })
        .collect();
    Tensor::cat(lps, 0)
}

/// Asserts that every MoE layer's routed experts (sorted per token) equal the reference's
/// `layer{L}.topk_indices_sorted`.
pub fn assert_routes_match(
    name: &str,
    routing: &[miles_bridge::MoeRouting],
    refs: &BTreeMap<String, (Vec<usize>, Vec<f64>)>,
) {
    for routing in routing {
        let k = routing.experts.dims()[1];
        let ids = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        let got: Vec<i64> = ids
            .chunks(k)
            .flat_map(|row| {
                let mut row = row.to_vec();
                row.sort_unstable();
                row
            })
            .collect();
        let want: Vec<i64> = refs[&format!("layer{}.topk_indices_sorted", routing.layer_index)]
            .1
            .iter()
            .map(|v| *v as i64)
            .collect();
        assert_eq!(
            got, want,
            "{name}: routed experts of layer {}",
            routing.layer_index
        );
    }
}
