//! The model in half precision (`Precision::Bf16` / `F16`, Miles' `--bf16` / `--fp16`) on
//! flex: weights, fused copies and KV cache in the compute dtype, and log-probs close to the
//! f32 forward and to transformers' own half-precision forward
//! (`fixtures/models/*/reference_half.safetensors`, made by `gen_bf16_reference.py`).

use burn::tensor::{DType, Device, FloatDType, Tensor};
use miles_bridge::nn::FeedForward;
use miles_bridge::{CausalLm, KvCache, ModelInput, Precision, ids_tensor, token_logprobs};
use miles_r3::Fallthrough;

use crate::common::{fixture, reference, rows_of};

fn values(t: Tensor<2>) -> Vec<f64> {
    t.into_data().convert::<f64>().try_to_vec::<f64>().unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn half_precision_forward_is_close_to_f32_and_to_transformers() {
    let device = Device::flex();
    for name in ["glm4moe-tiny", "qwen3-tiny"] {
        let dir = fixture(name);
        let rows = rows_of(&dir);
        let ids = ids_tensor(&rows, &device).unwrap();
        let refs = reference(&dir, "reference_half.safetensors");
        let f32_model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let lp = |m: &CausalLm| {
            let out = m
                .forward(&ModelInput::new(ids.clone()), &Fallthrough)
                .unwrap();
            values(token_logprobs(out.logits, ids.clone()))
        };
        let ours_f32 = lp(&f32_model);
        let hf_f32 = &refs["f32.token_logprobs"].1;
        for (precision, tag, dtype) in [
            (Precision::Bf16, "bf16", DType::BF16),
            (Precision::F16, "f16", DType::F16),
        ] {
            // Loading casts once, straight into the compute dtype; casting an f32 model
            // gives the same weights bit for bit.
            let model = CausalLm::from_pretrained_in(&dir, &device, precision).unwrap();
            assert_eq!(model.precision(), Some(precision), "{name} {tag}");
            assert_eq!(model.lm_head_weight().dtype(), dtype);
            for layer in &model.model.layers {
                if let FeedForward::Moe(moe) = &layer.mlp {
                    assert_eq!(moe.gate.weight.val().dtype(), dtype);
                    let bias = moe.gate.e_score_correction_bias.as_ref().unwrap();
                    assert_eq!(bias.val().dtype(), DType::F32, "the bias stays f32");
                }
            }
            let ours = lp(&model);
            assert_eq!(ours, lp(&f32_model.clone().to_precision(precision)));
            let hf = &refs[&format!("{tag}.token_logprobs")].1;
            // The error budget is transformers' own: how far its half-precision forward
            // lands from its f32 one (bf16 keeps 8 mantissa bits, f16 11).
            let budget = max_diff(hf, hf_f32);
            let to_f32 = max_diff(&ours, &ours_f32);
            let to_hf = max_diff(&ours, hf);
            println!(
                "{name} {tag}: |ours - ours f32| {to_f32:.2e}, |ours - HF {tag}| {to_hf:.2e}, HF budget {budget:.2e}"
            );
            assert!(
                to_f32 > 0.0,
                "{name} {tag}: the half forward must differ from f32"
            );
            assert!(
                to_f32 <= 2.0 * budget,
                "{name} {tag}: {to_f32} vs budget {budget}"
            );
            assert!(
                to_hf <= 2.0 * budget,
                "{name} {tag}: {to_hf} vs budget {budget}"
            );
        }
    }
}

#[test]
fn half_precision_kv_cache_decode_matches_the_full_forward() {
    let device = Device::flex();
    let dir = fixture("qwen3-tiny");
    let rows = rows_of(&dir);
    let model = CausalLm::from_pretrained_in(&dir, &device, Precision::Bf16).unwrap();
    let mut fused = model.clone();
    fused.fuse_projections();
    let ids = ids_tensor(&rows, &device).unwrap();
    let full = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let [b, seq, vocab] = full.logits.dims();
    let full = values(
        full.logits
            .narrow(1, seq - 1, 1)
            .reshape([b, vocab])
            .cast(FloatDType::F32),
    );
    // Prefill all but the last token, then one decode step, on the fused model.
    let mut cache = KvCache::new();
    let head: Vec<Vec<u32>> = rows.iter().map(|r| r[..seq - 1].to_vec()).collect();
    let tail: Vec<Vec<u32>> = rows.iter().map(|r| vec![r[seq - 1]]).collect();
    fused
        .forward_cached(
            &ModelInput::new(ids_tensor(&head, &device).unwrap()),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    let keys = cache.layer(0).unwrap().keys;
    assert_eq!(keys.dtype(), DType::BF16, "the KV cache is bf16");
    let step = fused
        .forward_cached(
            &ModelInput::new(ids_tensor(&tail, &device).unwrap()),
            &mut cache,
            &Fallthrough,
        )
        .unwrap();
    assert_eq!(step.logits.dtype(), DType::BF16);
    let step = values(step.logits.reshape([b, vocab]).cast(FloatDType::F32));
    // Same bf16 weights, a different association of the same sums: within a few bf16 ulps
    // of logits of magnitude ~ 1.
    let d = max_diff(&full, &step);
    assert!(d < 0.1, "cached decode vs full forward: {d}");
}
