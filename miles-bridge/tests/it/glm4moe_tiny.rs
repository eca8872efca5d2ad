//! GLM-4-MoE against HF transformers on the `glm4moe-tiny` fixture: logits, token log-probs,
//! routed experts, gradients, both config layouts, export round trips, KV-cache decoding and
//! typed import errors. Reference values come from transformers 5.24.0 (see
//! `fixtures/models/SOURCES.md`).

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use miles_bridge::{
    BridgeError, CausalLm, KvCache, ModelConfig, ModelInput, MoeDispatch, ids_tensor,
    names::internal_to_hf, token_logprobs,
};
use miles_core::{DType, NamedTensors, TensorBytes};
use miles_r3::{Fallthrough, MoeLayerInfo, R3Error, RouterHook};
use safetensors::SafeTensors;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny")
}

fn inputs() -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(fixture().join("reference_inputs.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    serde_json::from_value(v["input_ids"].clone()).unwrap()
}

/// Reference tensors of any dtype as f64 values + shape.
fn reference(file: &str) -> BTreeMap<String, (Vec<usize>, Vec<f64>)> {
    let bytes = std::fs::read(fixture().join(file)).unwrap();
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

fn load(device: &Device) -> CausalLm {
    CausalLm::from_pretrained(fixture(), device).unwrap()
}

#[test]
fn logits_logprobs_routing_and_gradients_match_transformers_sparse_dispatch() {
    check_against_transformers(MoeDispatch::Sparse);
}

#[test]
fn logits_logprobs_routing_and_gradients_match_transformers_dense_dispatch() {
    check_against_transformers(MoeDispatch::Dense);
}

#[test]
fn auto_dispatch_is_sparse_on_flex_for_large_batches() {
    let many = MoeDispatch::AUTO_SPARSE_MIN_TOKENS;
    for device in [Device::flex(), Device::flex().autodiff()] {
        assert_eq!(
            MoeDispatch::Auto.resolve(&device, many),
            MoeDispatch::Sparse
        );
        assert_eq!(
            MoeDispatch::Auto.resolve(&device, many - 1),
            MoeDispatch::Dense
        );
    }
    assert_eq!(
        MoeDispatch::Dense.resolve(&Device::flex(), many),
        MoeDispatch::Dense
    );
    assert_eq!(
        MoeDispatch::Sparse.resolve(&Device::flex(), 1),
        MoeDispatch::Sparse
    );
    assert_eq!(MoeDispatch::default(), MoeDispatch::Auto);
}

fn check_against_transformers(dispatch: MoeDispatch) {
    check_against_transformers_on(&Device::flex(), dispatch);
}

/// The whole model against transformers on the kernel device (wgpu over lavapipe) with the
/// default dispatch, which is the device-side sparse one there.
#[test]
fn logits_routing_and_gradients_match_transformers_on_wgpu_auto_dispatch() {
    let Some(device) = miles_ops::kernels::kernel_test_device(
        "logits_routing_and_gradients_match_transformers_on_wgpu_auto_dispatch",
    ) else {
        return;
    };
    for tokens in [1, 7, 10_000] {
        assert_eq!(
            MoeDispatch::Auto.resolve(&device, tokens),
            MoeDispatch::Sparse
        );
        assert_eq!(
            MoeDispatch::Auto.resolve(&device.clone().autodiff(), tokens),
            MoeDispatch::Sparse
        );
    }
    check_against_transformers_on(&device, MoeDispatch::Auto);
}

/// One MoE block (layer 1 of the fixture) on wgpu: device-sparse (`Sparse` and `Auto`) against
/// `Dense` on the same device and against flex — outputs, input and parameter gradients —
/// with identical routing; and the packed inference experts the same.
#[test]
fn moe_block_device_sparse_matches_dense_and_flex() {
    let Some(wgpu) =
        miles_ops::kernels::kernel_test_device("moe_block_device_sparse_matches_dense_and_flex")
    else {
        return;
    };
    // Tokens: one (a decode step), an odd batch, and enough that every expert gets rows.
    for tokens in [1usize, 13, 300] {
        let flex_sparse = moe_block_run(&Device::flex(), MoeDispatch::Sparse, tokens);
        let flex_dense = moe_block_run(&Device::flex(), MoeDispatch::Dense, tokens);
        let dense = moe_block_run(&wgpu, MoeDispatch::Dense, tokens);
        for dispatch in [MoeDispatch::Sparse, MoeDispatch::Auto] {
            let got = moe_block_run(&wgpu, dispatch, tokens);
            assert_eq!(
                got.routing, dense.routing,
                "routing, {dispatch:?} {tokens} tokens"
            );
            assert_eq!(
                got.routing, flex_sparse.routing,
                "routing vs flex, {tokens} tokens"
            );
            for (i, what) in MOE_RUN_PARTS.iter().enumerate() {
                let what = format!("{what}, {dispatch:?} vs Dense on wgpu, {tokens} tokens");
                assert_close(&what, &got.values[i], &dense.values[i], 1e-5);
                let what = format!("{} vs flex Sparse", what);
                assert_close(&what, &got.values[i], &flex_sparse.values[i], 1e-5);
            }
        }
        for (i, what) in MOE_RUN_PARTS.iter().enumerate() {
            let what = format!("{what}, flex Sparse vs Dense, {tokens} tokens");
            assert_close(&what, &flex_sparse.values[i], &flex_dense.values[i], 1e-5);
        }
        // On flex with AVX-512F the packed experts are kernel panels, gate / up computing the
        // SwiGLU itself.
        let packed_flex = moe_block_packed_forward(&Device::flex(), tokens);
        assert_close(
            &format!("flex packed forward vs flex Dense, {tokens} tokens"),
            &packed_flex,
            &flex_dense.values[0],
            1e-5,
        );
        // Inference over the packed experts (the engine's step model), no autodiff.
        let packed = moe_block_packed_forward(&wgpu, tokens);
        assert_close(
            &format!("packed forward vs Dense, {tokens} tokens"),
            &packed,
            &dense.values[0],
            1e-5,
        );
    }
}

const MOE_RUN_PARTS: [&str; 6] = [
    "output",
    "input gradient",
    "router gradient",
    "gate_proj gradient",
    "up_proj gradient",
    "down_proj gradient",
];

struct MoeRun {
    routing: Vec<i64>,
    values: Vec<Vec<f32>>,
}

fn moe_block_input(tokens: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let n = tokens * 64;
    let wave = |seed: f32| -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 1.3)
            .collect()
    };
    let x = Tensor::<1>::from_floats(wave(0.1).as_slice(), device).reshape([tokens, 64]);
    let c = Tensor::<1>::from_floats(wave(2.0).as_slice(), device).reshape([tokens, 64]);
    (x, c)
}

fn moe_block(model: &CausalLm) -> &miles_bridge::nn::MoeBlock {
    match &model.model.layers[1].mlp {
        miles_bridge::nn::FeedForward::Moe(block) => block,
        _ => panic!("layer 1 of glm4moe-tiny is an MoE layer"),
    }
}

fn moe_block_run(device: &Device, dispatch: MoeDispatch, tokens: usize) -> MoeRun {
    let device = device.clone().autodiff();
    let mut model = load(&device);
    model.set_moe_dispatch(dispatch);
    let block = moe_block(&model);
    let (x, c) = moe_block_input(tokens, &device);
    let x = x.require_grad();
    let (out, routing) = block.forward(x.clone(), &Fallthrough).unwrap();
    let grads = (out.clone() * c).sum().backward();
    let flat = |t: Tensor<3>| {
        let n = t.shape().num_elements();
        t.reshape([n])
    };
    let v1 = |t: Tensor<1>| t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    let v2 = |t: Tensor<2>| {
        let n = t.shape().num_elements();
        v1(t.reshape([n]))
    };
    let e = &block.experts;
    MoeRun {
        routing: routing
            .experts
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap(),
        values: vec![
            v2(out.detach()),
            v2(x.grad(&grads).unwrap()),
            v2(block.gate.weight.val().grad(&grads).unwrap()),
            v1(flat(e.gate_proj.val().grad(&grads).unwrap())),
            v1(flat(e.up_proj.val().grad(&grads).unwrap())),
            v1(flat(e.down_proj.val().grad(&grads).unwrap())),
        ],
    }
}

fn moe_block_packed_forward(device: &Device, tokens: usize) -> Vec<f32> {
    let mut model = load(device);
    model.fuse_projections();
    // As the engine's step model: sparse at every batch size (flex's `Auto` is dense below
    // 256 tokens).
    model.set_moe_dispatch(if miles_ops::device::is_flex(device) {
        MoeDispatch::Sparse
    } else {
        MoeDispatch::Auto
    });
    let block = moe_block(&model);
    let packed = block.packed.as_ref().expect("packed experts");
    assert_eq!(
        packed.gate_up.is_glu(),
        miles_ops::device::is_flex(device) && miles_ops::packed::supported(),
        "the fused SwiGLU panels exactly on flex with AVX-512F"
    );
    let (x, _) = moe_block_input(tokens, device);
    let (out, _) = block.forward(x, &Fallthrough).unwrap();
    let n = out.shape().num_elements();
    out.reshape([n])
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap()
}

/// max |a − b| ≤ tol · max(1, max |b|).
fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    let err = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        err <= tol * scale,
        "{what}: max abs err {err} > {tol} × {scale}"
    );
}

fn check_against_transformers_on(device: &Device, dispatch: MoeDispatch) {
    let device = device.clone().autodiff();
    let mut model = load(&device);
    model.set_moe_dispatch(dispatch);
    let ids = ids_tensor(&inputs(), &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let reference_out = reference("reference_outputs.safetensors");

    let logits = out.logits.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_logits = max_abs_diff(&logits, &reference_out["logits"].1);
    let lp = token_logprobs(out.logits, ids);
    let lp_values = lp.clone().into_data().try_to_vec::<f32>().unwrap();
    let d_lp = max_abs_diff(&lp_values, &reference_out["token_logprobs"].1);
    println!("max |logits - ref| = {d_logits:.3e}, max |logprobs - ref| = {d_lp:.3e}");
    assert!(d_logits <= 1e-4, "logits differ by {d_logits}");
    assert!(d_lp <= 1e-4, "log-probs differ by {d_lp}");

    assert_eq!(out.routing.len(), 2);
    for routing in &out.routing {
        let l = routing.layer_index;
        let mut got: Vec<Vec<i64>> = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap()
            .chunks(2)
            .map(|c| c.to_vec())
            .collect();
        for row in &mut got {
            row.sort_unstable();
        }
        let want: Vec<Vec<i64>> = reference_out[&format!("layer{l}.topk_indices_sorted")]
            .1
            .chunks(2)
            .map(|c| c.iter().map(|v| *v as i64).collect())
            .collect();
        assert_eq!(got, want, "routed experts of layer {l}");
        // Gate weights per (token, expert), whatever order each side's top-k used.
        let weights = routing
            .weights
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let ours_idx = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        let ref_idx = &reference_out[&format!("layer{l}.topk_indices")].1;
        let ref_w = &reference_out[&format!("layer{l}.topk_weights")].1;
        let mut d_w = 0.0f64;
        for (i, (e, w)) in ours_idx.iter().zip(&weights).enumerate() {
            let row = i / 2;
            let j = (0..2).find(|&j| ref_idx[row * 2 + j] as i64 == *e).unwrap();
            d_w = d_w.max((*w as f64 - ref_w[row * 2 + j]).abs());
        }
        assert!(d_w <= 1e-4, "layer {l} gate weights differ by {d_w}");
    }

    let loss = lp.mean().neg();
    let grads = loss.backward();
    let mut ours = NamedTensors::new();
    model.visit_params(&mut |name, p| {
        if let Some(g) = p.grad(&grads) {
            let values = g.try_to_vec::<f32>().unwrap();
            ours.insert(
                name.to_string(),
                TensorBytes::from_f32(g.shape().to_vec(), &values).unwrap(),
            );
        }
    });
    let ours = internal_to_hf(ours);
    let reference_grads = reference("reference_grads.safetensors");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        reference_grads.keys().collect::<Vec<_>>(),
        "gradient set (e_score_correction_bias is a buffer and gets none)"
    );
    let mut worst = (0.0f64, String::new());
    for (name, (shape, want)) in &reference_grads {
        let got = &ours[name];
        assert_eq!(got.shape(), &shape[..], "{name}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&got.to_f32().unwrap(), want);
        assert!(
            diff <= bound,
            "grad of {name}: max diff {diff:.3e} > {bound:.3e}"
        );
        if diff / bound > worst.0 {
            worst = (diff / bound, name.clone());
        }
    }
    println!(
        "{dispatch:?}: worst gradient diff / bound = {:.3} ({})",
        worst.0, worst.1
    );
}

#[test]
fn both_config_layouts_load_the_same_model() {
    let new = ModelConfig::from_file(fixture().join("config.json")).unwrap();
    let old = ModelConfig::from_file(fixture().join("config.v4style.json")).unwrap();
    assert_eq!(new, old);
    assert_eq!(new.rotary_dim(), 8);
    let device = Device::flex();
    let a = CausalLm::from_hf_tensors(
        &new,
        NamedTensors::read_hf_checkpoint(&fixture()).unwrap(),
        &device,
    )
    .unwrap();
    let b = CausalLm::from_hf_tensors(
        &old,
        NamedTensors::read_hf_checkpoint(&fixture()).unwrap(),
        &device,
    )
    .unwrap();
    assert_eq!(
        a.to_hf_tensors(DType::F32).unwrap(),
        b.to_hf_tensors(DType::F32).unwrap()
    );
    let ids = ids_tensor(&inputs(), &device).unwrap();
    let la = a
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap()
        .logits;
    let lb = b
        .forward(&ModelInput::new(ids), &Fallthrough)
        .unwrap()
        .logits;
    assert_eq!(la.into_data(), lb.into_data());
}

#[test]
fn export_round_trip_is_bit_identical() {
    let device = Device::flex();
    let model = load(&device);
    let original = NamedTensors::read_hf_checkpoint(&fixture()).unwrap();
    let exported = model.to_hf_tensors(DType::F32).unwrap();
    assert_eq!(exported, original);
    // The serialised file equals the fixture byte for byte.
    let bytes = exported.to_safetensors_bytes();
    let fixture_bytes = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let (a, b) = (
        SafeTensors::deserialize(&bytes).unwrap(),
        SafeTensors::deserialize(&fixture_bytes).unwrap(),
    );
    for (name, view) in b.iter() {
        assert_eq!(a.tensor(name).unwrap().data(), view.data(), "{name}");
    }

    // bf16 / f16 exports re-import and re-export identically (sharded on disk).
    for dtype in [DType::BF16, DType::F16] {
        let dir = std::env::temp_dir().join(format!("miles-bridge-{dtype}-{}", std::process::id()));
        model.save_pretrained(&dir, dtype, Some(300_000)).unwrap();
        assert!(dir.join("model.safetensors.index.json").is_file());
        let back = CausalLm::from_pretrained(&dir, &device).unwrap();
        let first = NamedTensors::read_hf_checkpoint(&dir).unwrap();
        assert!(first.values().all(|t| t.dtype() == dtype));
        assert_eq!(back.to_hf_tensors(dtype).unwrap(), first);
        std::fs::remove_dir_all(&dir).ok();
    }
}

#[test]
fn kv_cache_decoding_matches_full_forward() {
    let device = Device::flex();
    let model = load(&device);
    let rows = inputs();
    let ids = ids_tensor(&rows, &device).unwrap();
    let full = token_logprobs(
        model
            .forward(&ModelInput::new(ids.clone()), &Fallthrough)
            .unwrap()
            .logits,
        ids,
    )
    .into_data()
    .try_to_vec::<f32>()
    .unwrap();

    // Row 0 keeps all 12 tokens; row 1 is 9 tokens, right-padded in the prefill.
    let lens = [12usize, 9];
    let prefill = 7;
    let mut cache = KvCache::new();
    let mut prefill_rows = Vec::new();
    let mut mask = Vec::new();
    for (r, row) in rows.iter().enumerate() {
        prefill_rows.push(row[..prefill].to_vec());
        mask.extend((0..prefill).map(|t| t < lens[r]));
    }
    let mut input = ModelInput::new(ids_tensor(&prefill_rows, &device).unwrap());
    input.attention_mask = Some(Tensor::<2, Bool>::from_data(
        TensorData::new(mask, [2, prefill]),
        &device,
    ));
    let mut logits: Vec<Vec<Tensor<1>>> = vec![Vec::new(), Vec::new()];
    let out = model
        .forward_cached(&input, &mut cache, &Fallthrough)
        .unwrap();
    for (r, per_row) in logits.iter_mut().enumerate() {
        for t in 0..prefill {
            per_row.push(
                out.logits
                    .clone()
                    .narrow(0, r, 1)
                    .narrow(1, t, 1)
                    .reshape([512]),
            );
        }
    }
    for t in prefill..12 {
        let step: Vec<Vec<u32>> = rows.iter().map(|row| vec![row[t]]).collect();
        let mut input = ModelInput::new(ids_tensor(&step, &device).unwrap());
        let valid: Vec<bool> = lens.iter().map(|&len| t < len).collect();
        input.attention_mask = Some(Tensor::<2, Bool>::from_data(
            TensorData::new(valid, [2, 1]),
            &device,
        ));
        let out = model
            .forward_cached(&input, &mut cache, &Fallthrough)
            .unwrap();
        for (r, per_row) in logits.iter_mut().enumerate() {
            per_row.push(out.logits.clone().narrow(0, r, 1).reshape([512]));
        }
    }
    assert_eq!(cache.len(), 12);
    let mut worst = 0.0f64;
    for (r, row) in rows.iter().enumerate() {
        for t in 0..lens[r] - 1 {
            let lp = burn::tensor::activation::log_softmax(logits[r][t].clone(), 0);
            let got = lp.into_data().try_to_vec::<f32>().unwrap()[row[t + 1] as usize];
            worst = worst.max((got - full[r * 11 + t]).abs() as f64);
        }
    }
    println!("max |cached - full| log-prob = {worst:.3e}");
    assert!(worst <= 1e-5, "cached decoding differs by {worst}");
}

#[test]
fn packed_rows_equal_separate_rows() {
    let device = Device::flex();
    let model = load(&device);
    let rows = inputs();
    // Pack the first 5 tokens of row 0 and the first 7 of row 1 into one row of 12.
    let packed: Vec<u32> = rows[0][..5].iter().chain(&rows[1][..7]).copied().collect();
    let mut input = ModelInput::new(ids_tensor(&[packed], &device).unwrap());
    let positions: Vec<i32> = (0..5).chain(0..7).collect();
    let segments: Vec<i32> = [0; 5].into_iter().chain([1; 7]).collect();
    input.position_ids = Some(Tensor::<2, Int>::from_data(
        TensorData::new(positions, [1, 12]),
        &device,
    ));
    input.segment_ids = Some(Tensor::<2, Int>::from_data(
        TensorData::new(segments, [1, 12]),
        &device,
    ));
    let packed_logits = model.forward(&input, &Fallthrough).unwrap().logits;
    for (r, (start, len)) in [(0usize, 5usize), (5, 7)].into_iter().enumerate() {
        let ids = ids_tensor(&[rows[r][..len].to_vec()], &device).unwrap();
        let alone = model
            .forward(&ModelInput::new(ids), &Fallthrough)
            .unwrap()
            .logits;
        let part = packed_logits.clone().narrow(1, start, len);
        let diff = (part - alone).abs().max().into_scalar::<f32>();
        assert!(diff <= 1e-5, "segment {r} differs by {diff}");
    }
}

#[test]
fn import_errors_name_the_tensor() {
    let device = Device::flex();
    let config = ModelConfig::from_file(fixture().join("config.json")).unwrap();
    let full = NamedTensors::read_hf_checkpoint(&fixture()).unwrap();

    let mut missing = full.clone();
    missing.remove("model.layers.2.mlp.experts.5.down_proj.weight");
    match CausalLm::from_hf_tensors(&config, missing, &device) {
        Err(BridgeError::MissingTensor { name }) => {
            assert_eq!(name, "model.layers.2.mlp.experts.5.down_proj.weight")
        }
        other => panic!("{:?}", other.err()),
    }
    let mut missing = full.clone();
    missing.remove("model.layers.0.self_attn.q_proj.bias");
    assert!(matches!(
        CausalLm::from_hf_tensors(&config, missing, &device),
        Err(BridgeError::MissingTensor { name }) if name == "model.layers.0.self_attn.q_proj.bias"
    ));

    let mut extra = full.clone();
    extra.insert(
        "model.layers.0.mlp.bogus.weight",
        TensorBytes::from_f32(vec![1], &[0.0]).unwrap(),
    );
    assert!(matches!(
        CausalLm::from_hf_tensors(&config, extra, &device),
        Err(BridgeError::UnexpectedTensor { name }) if name == "model.layers.0.mlp.bogus.weight"
    ));

    let mut wrong = full;
    wrong.insert(
        "model.norm.weight",
        TensorBytes::from_f32(vec![63], &[1.0; 63]).unwrap(),
    );
    assert!(matches!(
        CausalLm::from_hf_tensors(&config, wrong, &device),
        Err(BridgeError::ShapeMismatch { name, expected, got })
            if name == "model.norm.weight" && expected == vec![64] && got == vec![63]
    ));
}

/// A hook that routes every token to experts 6 and 1, whatever the scores say.
struct Forced;

impl RouterHook for Forced {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        let tokens = scores.dims()[0];
        let ids: Vec<i32> = (0..tokens).flat_map(|_| [6, 1]).collect();
        assert_eq!(layer.top_k, 2);
        Ok(Tensor::from_data(
            TensorData::new(ids, [tokens, 2]),
            &scores.device(),
        ))
    }
}

#[test]
fn hook_chooses_experts_and_weights_come_from_router_scores() {
    let device = Device::flex();
    let model = load(&device);
    let ids = ids_tensor(&inputs(), &device).unwrap();
    let out = model.forward(&ModelInput::new(ids), &Forced).unwrap();
    let reference_out = reference("reference_outputs.safetensors");
    // Layer 1 is the first MoE layer, so its router input (and logits) do not depend on the hook.
    let routing = &out.routing[0];
    assert_eq!(routing.layer_index, 1);
    let experts = routing
        .experts
        .clone()
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap();
    assert!(experts.chunks(2).all(|r| r == [6, 1]));
    let weights = routing
        .weights
        .clone()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let logits = &reference_out["layer1.router_logits"].1;
    for (t, w) in weights.chunks(2).enumerate() {
        let s = |e: usize| 1.0 / (1.0 + (-logits[t * 8 + e]).exp());
        let (s6, s1) = (s(6), s(1));
        let want = [2.5 * s6 / (s6 + s1), 2.5 * s1 / (s6 + s1)];
        for (g, w) in w.iter().zip(want) {
            assert!((*g as f64 - w).abs() <= 1e-5, "token {t}: {g} vs {w}");
        }
    }
}
