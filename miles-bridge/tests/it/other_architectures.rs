//! `qwen3`, `qwen3_moe`, `llama` and `qwen2` against HF transformers on tiny random checkpoints
//! made by `fixtures/models/gen_reference.py` and `gen_qwen2.py`: logits and token log-probs
//! within 1e-4, routed experts identical (Qwen3-MoE), gradients of `-mean(token_logprobs)`
//! within 1e-4 · max(1, max|ref|) per tensor (Qwen2 also through miles-ops' fused log-prob
//! op), KV-cache decoding equal to the full forward, greedy KV-cache decoding equal to HF
//! `generate` (Qwen2) and bit-identical export (Qwen2).

use crate::common::{fixture, reference, rows_of};

use burn::tensor::Device;
use miles_bridge::{
    Architecture, CausalLm, KvCache, ModelConfig, ModelInput, ids_tensor, names::internal_to_hf,
    token_logprobs,
};
use miles_core::{DType, NamedTensors, TensorBytes};
use miles_r3::Fallthrough;

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
    let mut ours = NamedTensors::new();
    model.visit_params(&mut |pname, p| {
        if let Some(g) = p.grad(&grads) {
            let values = g.try_to_vec::<f32>().unwrap();
            ours.insert(
                pname.to_string(),
                TensorBytes::from_f32(g.shape().to_vec(), &values).unwrap(),
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
        assert_eq!(got.shape(), &shape[..], "{pname}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&got.to_f32().unwrap(), want);
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

#[test]
fn qwen2_tied_gqa_matches_transformers() {
    check("qwen2-tiny", Architecture::Qwen2, &[]);
}

#[test]
fn qwen2_untied_matches_transformers() {
    check("qwen2-untied", Architecture::Qwen2, &[]);
}

/// The training path that never materialises the logits: `forward_hidden` + miles-ops' fused
/// chunked log-prob op against `lm_head_weight()` (the embedding matrix when tied), with
/// gradients of `-mean(token_logprobs)` against transformers'.
#[test]
fn qwen2_fused_log_prob_path_matches_transformers() {
    for name in ["qwen2-tiny", "qwen2-untied"] {
        let dir = fixture(name);
        let rows = rows_of(&dir);
        let device = Device::flex().autodiff();
        let model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let lp = crate::common::fused_token_logprobs(&model, &rows, &device);
        let (batch, seq) = (rows.len(), rows[0].len());
        let refs = reference(&dir, "reference_outputs.safetensors");
        let host = lp.clone().into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(host.len(), batch * (seq - 1));
        let d_lp = max_abs_diff(&host, &refs["token_logprobs"].1);
        assert!(d_lp <= 1e-4, "{name}: fused log-probs differ by {d_lp}");
        let grads = lp.mean().neg().backward();
        let ref_grads = reference(&dir, "reference_grads.safetensors");
        let mut seen = 0;
        let mut worst = 0.0f64;
        model.visit_params(&mut |pname, p| {
            let g = p.grad(&grads).expect("parameter without gradient");
            let (shape, want) = &ref_grads[pname];
            assert_eq!(g.shape().to_vec(), *shape, "{pname}");
            let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            let diff = max_abs_diff(&g.try_to_vec::<f32>().unwrap(), want);
            assert!(diff <= bound, "{name}: fused grad of {pname}: {diff:.3e}");
            worst = worst.max(diff / bound);
            seen += 1;
        });
        assert_eq!(seen, ref_grads.len(), "{name}");
        println!(
            "{name}: fused path: max |lp - ref| = {d_lp:.3e}, worst grad / bound = {worst:.3}"
        );
    }
}

/// Greedy decoding with the KV cache (prefill, then one token per step, both prompts in one
/// batch) gives exactly the tokens transformers' `generate(do_sample=False)` gave.
#[test]
fn qwen2_greedy_kv_cache_decode_equals_hf_generate() {
    for name in ["qwen2-tiny", "qwen2-untied"] {
        crate::common::assert_greedy_kv_cache_decode_equals_hf_generate(&fixture(name));
    }
}

/// HF names in and out: the f32 export equals the checkpoint byte for byte (tied: no
/// `lm_head.weight` in either), a bf16 save reloads to the same bf16 tensors, and the saved
/// `config.json` reads back as the same config.
#[test]
fn qwen2_export_round_trip_is_bit_identical() {
    for name in ["qwen2-tiny", "qwen2-untied"] {
        let dir = fixture(name);
        let device = Device::flex();
        let model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let original = NamedTensors::read_hf_checkpoint(&dir).unwrap();
        let exported = model.to_hf_tensors(DType::F32).unwrap();
        assert_eq!(
            exported.contains_key("lm_head.weight"),
            !model.config.tie_word_embeddings
        );
        assert!(exported.contains_key("model.layers.0.self_attn.k_proj.bias"));
        assert_eq!(exported, original, "{name}");
        let out = std::env::temp_dir().join(format!("miles-bridge-{name}-{}", std::process::id()));
        model.save_pretrained(&out, DType::BF16, None).unwrap();
        let back = CausalLm::from_pretrained(&out, &device).unwrap();
        assert_eq!(back.config, model.config);
        assert_eq!(
            ModelConfig::from_file(out.join("config.json")).unwrap(),
            model.config
        );
        let saved = NamedTensors::read_hf_checkpoint(&out).unwrap();
        assert_eq!(back.to_hf_tensors(DType::BF16).unwrap(), saved);
        std::fs::remove_dir_all(&out).ok();
    }
}

/// Qwen2 with `use_sliding_window: true` whose window reaches no layer (`max_window_layers` =
/// `num_hidden_layers`: transformers computes full attention everywhere), one KV head for five
/// query heads, untied (`fixtures/models/variants/qwen2-window-off`, made by
/// `gen_variants.py`): logits / log-probs within 1e-4, cached decoding, export and greedy
/// decoding equal to HF `generate`. Lowering `max_window_layers` makes a layer sliding-window,
/// which is refused naming the field.
#[test]
fn qwen2_window_on_but_unused_matches_transformers() {
    let dir = fixture("variants/qwen2-window-off");
    crate::common::assert_matches_reference(&dir, &[], 1e-4);
    crate::common::assert_greedy_kv_cache_decode_equals_hf_generate(&dir);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json.as_object_mut().unwrap().remove("layer_types");
    json["max_window_layers"] = 1.into();
    match ModelConfig::from_hf_json(&json.to_string()) {
        Err(miles_bridge::BridgeError::Config { field, .. }) => {
            assert_eq!(field, "use_sliding_window")
        }
        other => panic!("a sliding-window layer loaded: {other:?}"),
    }
}

/// The engine's decode layouts on flex in f32 with the in-place kernels (AVX-512F or AVX2):
/// with `DecodeWeights::InPlace` (what `miles train` asks for), and with the default on a CPU
/// without AVX-512F, q / k / v, gate / up, o, down and the tied `lm_head` are the layers' own
/// buffers, and the model counts no decode copies; an MoE model copies its routed experts
/// only. The default with AVX-512F packs panels (every parameter counted), as every parameter
/// is counted off these kernels.
#[test]
fn fused_projections_read_dense_weights_in_place() {
    use miles_bridge::DecodeWeights;
    use miles_bridge::nn::{FeedForward, FusedWeight, SelfAttention};
    let device = Device::flex();
    let loaded = CausalLm::from_pretrained(fixture("qwen3-tiny"), &device).unwrap();
    let before = loaded.num_params();
    if !miles_ops::rows::supported() || !miles_ops::fused_ops_enabled() {
        assert!(
            std::env::var_os("MILES_REQUIRE_KERNEL_TESTS").is_none(),
            "MILES_REQUIRE_KERNEL_TESTS is set but this CPU has neither AVX-512F nor AVX2"
        );
        assert_eq!(loaded.decode_copy_params(DecodeWeights::InPlace), before);
        return;
    }
    let first_qkv = |model: &CausalLm| {
        let SelfAttention::Grouped(a) = &model.model.layers[0].self_attn else {
            panic!("qwen3 attention")
        };
        a.fused_qkv.as_ref().unwrap().weight.clone()
    };
    let mut default = loaded.clone();
    default.fuse_projections();
    if miles_ops::packed::supported() {
        // AVX-512F, the default: packed panels, one more copy.
        assert!(matches!(first_qkv(&default), FusedWeight::Packed(_)));
        assert_eq!(default.decode_copy_params(DecodeWeights::Packed), before);
    } else {
        // AVX2 only: in place whatever is asked.
        assert!(matches!(first_qkv(&default), FusedWeight::Rows(_)));
        assert_eq!(default.decode_copy_params(DecodeWeights::Packed), 0);
    }
    let mut model = loaded;
    model.fuse_projections_with(DecodeWeights::InPlace);
    assert_eq!(model.decode_copy_params(DecodeWeights::InPlace), 0);
    let reads =
        |fused: &Option<miles_bridge::nn::FusedLinear>, w: &burn::tensor::Tensor<2>| match &fused
            .as_ref()
            .expect("fused")
            .weight
        {
            FusedWeight::Rows(rows) => rows.reads(w),
            other => panic!("expected weights read in place, got {other:?}"),
        };
    for layer in &model.model.layers {
        let SelfAttention::Grouped(a) = &layer.self_attn else {
            panic!("qwen3 attention")
        };
        for w in [&a.q_proj, &a.k_proj, &a.v_proj] {
            assert!(reads(&a.fused_qkv, &w.weight.val()));
        }
        assert!(reads(&a.packed_o, &a.o_proj.weight.val()));
        let FeedForward::Dense(mlp) = &layer.mlp else {
            panic!("qwen3 mlp")
        };
        assert!(mlp.fused_gate_up.as_ref().unwrap().is_glu());
        assert!(reads(&mlp.fused_gate_up, &mlp.gate_proj.weight.val()));
        assert!(reads(&mlp.fused_gate_up, &mlp.up_proj.weight.val()));
        assert!(reads(&mlp.packed_down, &mlp.down_proj.weight.val()));
    }
    assert!(reads(&model.packed_lm_head, &model.lm_head_weight()));

    // Qwen3-MoE: the routed experts of its MoE layers are the copies.
    let moe = CausalLm::from_pretrained(fixture("qwen3moe-tiny"), &device).unwrap();
    let c = &moe.config;
    let moe_layers = moe
        .model
        .layers
        .iter()
        .filter(|l| matches!(l.mlp, FeedForward::Moe(_)))
        .count();
    assert!(moe_layers > 0);
    assert_eq!(
        moe.decode_copy_params(DecodeWeights::InPlace),
        moe_layers * c.n_routed_experts * 3 * c.moe_intermediate_size * c.hidden_size
    );
}
