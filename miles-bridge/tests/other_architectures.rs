//! `qwen3`, `qwen3_moe` and `llama` against HF transformers on tiny random checkpoints made by
//! `fixtures/models/gen_reference.py`: logits and token log-probs within 1e-4, routed experts
//! identical (Qwen3-MoE), gradients of `-mean(token_logprobs)` within
//! 1e-4 · max(1, max|ref|) per tensor, and KV-cache decoding equal to the full forward.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use miles_bridge::{
    Architecture, CausalLm, HostTensor, KvCache, ModelInput, TensorMap, ids_tensor,
    names::internal_to_hf, token_logprobs,
};
use miles_r3::Fallthrough;
use safetensors::SafeTensors;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

fn reference(dir: &Path, file: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
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

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

fn check(name: &str, architecture: Architecture, moe_layers: &[usize]) {
    let dir = fixture(name);
    let text = std::fs::read_to_string(dir.join("reference_inputs.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(v["input_ids"].clone()).unwrap();

    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    assert_eq!(model.architecture(), architecture);
    let ids = ids_tensor(&rows, &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let refs = reference(&dir, "reference_outputs.safetensors");
    let logits = out.logits.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_logits = max_abs_diff(&logits, &refs["logits"].1);
    let lp = token_logprobs(out.logits, ids);
    let lp_host = lp.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_lp = max_abs_diff(&lp_host, &refs["token_logprobs"].1);
    println!("{name}: max |logits - ref| = {d_logits:.3e}, max |logprobs - ref| = {d_lp:.3e}");
    assert!(
        d_logits <= 1e-4 && d_lp <= 1e-4,
        "{name}: {d_logits} / {d_lp}"
    );

    let layers: Vec<usize> = out.routing.iter().map(|r| r.layer_index).collect();
    assert_eq!(layers, moe_layers);
    for routing in &out.routing {
        let k = routing.experts.dims()[1];
        let mut got: Vec<i64> = Vec::new();
        let ids = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        for row in ids.chunks(k) {
            let mut row = row.to_vec();
            row.sort_unstable();
            got.extend(row);
        }
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

    let grads = lp.mean().neg().backward();
    let mut ours = TensorMap::new();
    model.visit_params(&mut |pname, p| {
        if let Some(g) = p.grad(&grads) {
            let values = g.try_to_vec::<f32>().unwrap();
            ours.insert(
                pname.to_string(),
                HostTensor::from_f32(g.shape().to_vec(), &values),
            );
        }
    });
    let ours = internal_to_hf(ours);
    let ref_grads = reference(&dir, "reference_grads.safetensors");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        ref_grads.keys().collect::<Vec<_>>()
    );
    let mut worst = 0.0f64;
    for (pname, (shape, want)) in &ref_grads {
        let got = &ours[pname];
        assert_eq!(&got.shape, shape, "{pname}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&got.to_f32(), want);
        assert!(
            diff <= bound,
            "{name}: grad of {pname}: {diff:.3e} > {bound:.3e}"
        );
        worst = worst.max(diff / bound);
    }
    println!("{name}: worst gradient diff / bound = {worst:.3}");

    // KV cache: prefill 5 tokens, decode the rest one at a time.
    let device = Device::flex();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let mut cache = KvCache::new();
    let prefill: Vec<Vec<u32>> = rows.iter().map(|r| r[..5].to_vec()).collect();
    let first = model
        .forward_cached(
            &ModelInput::new(ids_tensor(&prefill, &device).unwrap()),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    let mut parts = vec![first.logits];
    for t in 5..rows[0].len() {
        let step: Vec<Vec<u32>> = rows.iter().map(|r| vec![r[t]]).collect();
        let out = model
            .forward_cached(
                &ModelInput::new(ids_tensor(&step, &device).unwrap()),
                &mut cache,
                &Fallthrough,
            )
            .unwrap();
        parts.push(out.logits);
    }
    let cached = burn::tensor::Tensor::cat(parts, 1);
    let ids = ids_tensor(&rows, &device).unwrap();
    let cached_lp = token_logprobs(cached, ids)
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let diff = cached_lp
        .iter()
        .zip(&lp_host)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!("{name}: max |cached - full| log-prob = {diff:.3e}");
    assert!(diff <= 1e-5, "{name}: cached decoding differs by {diff}");
}

#[test]
fn qwen3_matches_transformers() {
    check("qwen3-tiny", Architecture::Qwen3, &[]);
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3moe-tiny", Architecture::Qwen3Moe, &[1, 2]);
}

#[test]
fn llama_matches_transformers() {
    check("llama-tiny", Architecture::Llama, &[]);
}
