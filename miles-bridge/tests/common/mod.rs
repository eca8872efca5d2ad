//! Checks shared by the architecture tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use miles_bridge::{CausalLm, KvCache, ModelInput, ids_tensor};
use miles_r3::Fallthrough;
use safetensors::SafeTensors;

/// Greedy decoding with the KV cache (prefill, then one token per step, every prompt in one
/// batch) gives exactly the tokens transformers' `generate(do_sample=False)` gave, as stored
/// in the fixture's `reference_generate.json`.
pub fn assert_greedy_kv_cache_decode_equals_hf_generate(dir: &Path) {
    let text = std::fs::read_to_string(dir.join("reference_generate.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_value(v["prompts"].clone()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(v["output_ids"].clone()).unwrap();
    let new_tokens = v["max_new_tokens"].as_u64().unwrap() as usize;
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
