//! Qwen3.5 (`qwen3_5`, `qwen3_5_moe`: Gated DeltaNet linear-attention layers between gated
//! full-attention layers) against HF transformers 5.24 on the tiny random checkpoints made by
//! `fixtures/models/gen_qwen3_5.py`: `qwen35-tiny` (`Qwen3_5ForConditionalGeneration`, the
//! released layout with a vision tower), `qwen35moe-tiny`
//! (`Qwen3_5MoeForConditionalGeneration`, 8 experts top-2 plus the gated shared expert,
//! every expert reached) and `qwen35-text` (`Qwen3_5ForCausalLM`, tied embeddings, conv
//! kernel 3). Rows of 150 tokens: three of transformers' 64-token delta-rule chunks. Token
//! log-probs within 1e-4, routed expert sets identical, gradients of `-mean(token_logprobs)`
//! within 1e-4 · max(1, max|ref|) per tensor, recurrent decode (a 5-token prefill, then one
//! token per step) equal to the full forward, greedy decoding equal to HF `generate`, packed
//! sequences equal to separate ones, and the export equal to the checkpoint byte for byte,
//! vision tower included.

use crate::common::{
    assert_greedy_kv_cache_decode_equals_hf_generate, assert_routes_match, fixture, reference,
    rows_of,
};

use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{
    Architecture, BridgeError, CausalLm, KvCache, LayerType, ModelConfig, ModelInput, ids_tensor,
    names::internal_to_hf, token_logprobs,
};
use miles_core::{DType, NamedTensors, TensorBytes};
use miles_r3::Fallthrough;

const FIXTURES: [(&str, Architecture, &[usize]); 3] = [
    ("qwen35-tiny", Architecture::Qwen3_5, &[]),
    ("qwen35moe-tiny", Architecture::Qwen3_5Moe, &[0, 1, 2, 3]),
    ("qwen35-text", Architecture::Qwen3_5, &[]),
];

fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - y).abs())
        .fold(0.0, f64::max)
}

fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// Our parameter names as the checkpoint spells them.
fn checkpoint_name(model: &CausalLm, name: &str) -> String {
    match (&model.config.multimodal, name.strip_prefix("model.")) {
        (Some(_), Some(rest)) => format!("model.language_model.{rest}"),
        _ => name.to_string(),
    }
}

fn check_grads(name: &str, model: &CausalLm, grads: &burn::tensor::Gradients) -> f64 {
    let mut ours = NamedTensors::new();
    model.visit_params(&mut |pname, p| {
        if let Some(g) = p.grad(grads) {
            let shape = g.shape().to_vec();
            let values = g.convert::<f32>().try_to_vec::<f32>().unwrap();
            ours.insert(
                pname.to_string(),
                TensorBytes::from_f32(shape, &values).unwrap(),
            );
        }
    });
    let ours: NamedTensors = internal_to_hf(ours)
        .into_iter()
        .map(|(n, t)| (checkpoint_name(model, &n), t))
        .collect();
    let ref_grads = reference(&fixture(name), "reference_grads.safetensors");
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        ref_grads.keys().collect::<Vec<_>>(),
        "{name}: parameters with gradients"
    );
    let mut worst = 0.0f64;
    let mut worst_abs = 0.0f64;
    for (pname, (shape, want)) in &ref_grads {
        let got = ours.get(pname).unwrap();
        assert_eq!(got.shape(), &shape[..], "{pname}");
        let bound = 1e-4 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let diff = max_abs_diff(&got.to_f32().unwrap(), want);
        assert!(
            diff <= bound,
            "{name}: grad of {pname}: {diff:.3e} > {bound:.3e}"
        );
        worst = worst.max(diff / bound);
        worst_abs = worst_abs.max(diff);
    }
    println!("{name}: worst gradient diff {worst_abs:.3e} (diff / bound = {worst:.3})");
    worst_abs
}

/// Log-probs, routes and gradients against transformers; then the recurrent decode against
/// the full forward.
fn check(name: &str, architecture: Architecture, moe_layers: &[usize]) {
    let dir = fixture(name);
    let rows = rows_of(&dir);
    let device = Device::flex().autodiff();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    assert_eq!(model.architecture(), architecture);
    let ids = ids_tensor(&rows, &device).unwrap();
    let out = model
        .forward(&ModelInput::new(ids.clone()), &Fallthrough)
        .unwrap();
    let refs = reference(&dir, "reference_outputs.safetensors");
    let lp = token_logprobs(out.logits, ids);
    let d_lp = max_abs_diff(&host(lp.clone()), &refs["token_logprobs"].1);
    println!("{name}: max |logprobs - ref| = {d_lp:.3e}");
    assert!(d_lp <= 1e-4, "{name}: {d_lp}");
    let layers: Vec<usize> = out.routing.iter().map(|r| r.layer_index).collect();
    assert_eq!(layers, moe_layers);
    assert_routes_match(name, &out.routing, &refs);
    let grads = lp.mean().neg().backward();
    check_grads(name, &model, &grads);

    // Recurrent decode: a 5-token prefill (chunked form), then one token per step (recurrent
    // form) from the conv and recurrent states, equal to the full forward.
    let device = Device::flex();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let full = model
        .forward(
            &ModelInput::new(ids_tensor(&rows, &device).unwrap()),
            &Fallthrough,
        )
        .unwrap()
        .logits;
    let mut cache = KvCache::new();
    let prefill: Vec<Vec<u32>> = rows.iter().map(|r| r[..5].to_vec()).collect();
    let mut parts = vec![
        model
            .forward_cached(
                &ModelInput::new(ids_tensor(&prefill, &device).unwrap()),
                &mut cache,
                &Fallthrough,
            )
            .unwrap()
            .logits,
    ];
    for t in 5..rows[0].len() {
        let step: Vec<Vec<u32>> = rows.iter().map(|r| vec![r[t]]).collect();
        parts.push(
            model
                .forward_cached(
                    &ModelInput::new(ids_tensor(&step, &device).unwrap()),
                    &mut cache,
                    &Fallthrough,
                )
                .unwrap()
                .logits,
        );
    }
    let c = &model.config;
    let lin = c.linear_attention.unwrap();
    for l in 0..c.num_hidden_layers {
        match c.layer_types[l] {
            LayerType::LinearAttention => {
                assert!(
                    cache.layer(l).is_none(),
                    "{name}: keys cached for linear layer {l}"
                );
                let state = cache.linear_state(l).unwrap();
                assert_eq!(
                    state.conv.dims(),
                    [rows.len(), lin.conv_kernel_dim - 1, lin.conv_dim()]
                );
                assert_eq!(
                    state.recurrent.dims(),
                    [
                        rows.len(),
                        lin.num_value_heads,
                        lin.key_head_dim,
                        lin.value_head_dim
                    ]
                );
            }
            LayerType::FullAttention => {
                assert!(cache.linear_state(l).is_none());
                assert_eq!(cache.layer(l).unwrap().keys.dims()[2], rows[0].len());
            }
        }
    }
    let decoded = Tensor::cat(parts, 1);
    let diff = host(
        (decoded - full)
            .abs()
            .max_dim(2)
            .reshape([rows.len(), rows[0].len()]),
    )
    .into_iter()
    .fold(0f32, f32::max);
    println!("{name}: max |recurrent decode logits - full forward| = {diff:.3e}");
    assert!(diff < 1e-4, "{name}: recurrent decode differs by {diff}");
}

#[test]
fn qwen3_5_matches_transformers() {
    for (name, arch, moe) in FIXTURES {
        check(name, arch, moe);
    }
}

#[test]
fn qwen3_5_greedy_recurrent_decode_equals_hf_generate() {
    for (name, _, _) in FIXTURES {
        assert_greedy_kv_cache_decode_equals_hf_generate(&fixture(name));
    }
}

/// Packed rows (segment ids, positions restarting) give each sequence what it gets alone:
/// the conv and the delta rule restart at every segment.
#[test]
fn qwen3_5_packed_segments_equal_separate_sequences() {
    let dir = fixture("qwen35moe-tiny");
    let device = Device::flex();
    let model = CausalLm::from_pretrained(&dir, &device).unwrap();
    let rows = rows_of(&dir);
    let (a, b) = (&rows[0][..70], &rows[1][..41]);
    let alone: Vec<f32> = [a, b]
        .iter()
        .flat_map(|r| {
            let ids = ids_tensor(&[r.to_vec()], &device).unwrap();
            let out = model
                .forward(&ModelInput::new(ids.clone()), &Fallthrough)
                .unwrap();
            host(token_logprobs(out.logits, ids))
        })
        .collect();
    let n = a.len() + b.len();
    let ints = |v: Vec<i32>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device);
    let packed_ids: Vec<i32> = a.iter().chain(b).map(|&t| t as i32).collect();
    let mut input = ModelInput::new(ints(packed_ids));
    input.segment_ids = Some(ints((0..n).map(|i| i32::from(i >= a.len())).collect()));
    input.position_ids = Some(ints(
        (0..a.len()).chain(0..b.len()).map(|p| p as i32).collect(),
    ));
    let logits = model.forward(&input, &Fallthrough).unwrap().logits;
    let [_, _, vocab] = logits.dims();
    let lp = burn::tensor::activation::log_softmax(logits.reshape([n, vocab]), 1);
    let lp = host(lp);
    let mut packed = Vec::new();
    for (start, len) in [(0, a.len()), (a.len(), b.len())] {
        for t in start..start + len - 1 {
            let next = if t + 1 < a.len() {
                a[t + 1]
            } else {
                b[t + 1 - a.len()]
            };
            packed.push(lp[t * vocab + next as usize]);
        }
    }
    let diff = packed
        .iter()
        .zip(&alone)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert_eq!(packed.len(), alone.len());
    assert!(diff < 1e-5, "packed vs separate: {diff}");
}

/// HF names in and out: the f32 export equals the checkpoint byte for byte (the vision
/// tower of the vision-language layout included, carried through untouched), and the saved
/// directory loads back as the same model and config.
#[test]
fn qwen3_5_export_round_trip_is_bit_identical() {
    for (name, _, _) in FIXTURES {
        let dir = fixture(name);
        let device = Device::flex();
        let model = CausalLm::from_pretrained(&dir, &device).unwrap();
        let original = NamedTensors::read_hf_checkpoint(&dir).unwrap();
        let visual = original
            .keys()
            .filter(|k| k.starts_with("model.visual."))
            .count();
        assert_eq!(model.passthrough.len(), visual, "{name}");
        assert_eq!(visual > 0, model.config.multimodal.is_some(), "{name}");
        let exported = model.to_hf_tensors(DType::F32).unwrap();
        assert_eq!(exported, original, "{name}");
        // In bf16 the text model is rounded; the vision tower keeps its bytes.
        let half = model.to_hf_tensors(DType::BF16).unwrap();
        for key in original.keys().filter(|k| k.starts_with("model.visual.")) {
            assert_eq!(half.get(key), original.get(key), "{name}: {key}");
        }
        let out = std::env::temp_dir().join(format!("miles-bridge-{name}-{}", std::process::id()));
        model.save_pretrained(&out, DType::F32, None).unwrap();
        let back = CausalLm::from_pretrained(&out, &device).unwrap();
        assert_eq!(back.config, model.config, "{name}");
        assert_eq!(back.to_hf_tensors(DType::F32).unwrap(), original, "{name}");
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let source: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["model_type"], source["model_type"], "{name}");
        assert_eq!(written["architectures"], source["architectures"], "{name}");
        assert_eq!(written["vision_config"], source["vision_config"], "{name}");
        // Every field of the source text config comes back with its value (transformers'
        // own `text_config` fields, the ones this crate does not read included).
        if let Some(text) = source["text_config"].as_object() {
            for (key, value) in text.iter().filter(|(k, _)| k.as_str() != "dtype") {
                assert_eq!(
                    &written["text_config"][key], value,
                    "{name}: text_config.{key}"
                );
            }
        }
        std::fs::remove_dir_all(&out).ok();
    }
}

#[test]
fn qwen3_5_config_is_read_as_transformers_reads_it() {
    let tiny = ModelConfig::from_file(fixture("qwen35-tiny").join("config.json")).unwrap();
    use LayerType::{FullAttention as F, LinearAttention as L};
    assert_eq!(tiny.architecture, Architecture::Qwen3_5);
    assert_eq!(tiny.layer_types, [L, L, L, F]);
    assert_eq!((tiny.head_dim, tiny.rotary_dim()), (16, 4));
    assert!(tiny.multimodal.is_some() && !tiny.tie_word_embeddings);
    let moe = ModelConfig::from_file(fixture("qwen35moe-tiny").join("config.json")).unwrap();
    assert_eq!(moe.layer_types, [L, F, L, F]);
    assert_eq!(
        (
            moe.n_routed_experts,
            moe.num_experts_per_tok,
            moe.shared_expert_intermediate_size
        ),
        (8, 2, 12)
    );
    assert!(moe.norm_topk_prob && (0..4).all(|l| moe.is_moe_layer(l)));
    let text = ModelConfig::from_file(fixture("qwen35-text").join("config.json")).unwrap();
    assert!(text.multimodal.is_none() && text.tie_word_embeddings);
    assert_eq!(text.linear_attention.unwrap().conv_kernel_dim, 3);
    assert_eq!((text.rope_theta, text.rms_norm_eps), (1e6, 1e-5));
    // Without `layer_types`: every `full_attention_interval`-th layer (default 4) is full;
    // absent shapes take transformers' defaults; `qwen3_5_moe_text` is the MoE text layout.
    let bare = ModelConfig::from_hf_json(
        r#"{"model_type":"qwen3_5_moe_text","vocab_size":64,"hidden_size":32,
            "intermediate_size":48,"moe_intermediate_size":8,"num_hidden_layers":6,
            "num_attention_heads":2,"num_key_value_heads":1,"head_dim":16,
            "shared_expert_intermediate_size":8,"full_attention_interval":3}"#,
    )
    .unwrap();
    assert_eq!(bare.layer_types, [L, L, F, L, L, F]);
    assert_eq!((bare.n_routed_experts, bare.num_experts_per_tok), (256, 8));
    let lin = bare.linear_attention.unwrap();
    assert_eq!(
        (
            lin.conv_kernel_dim,
            lin.key_head_dim,
            lin.num_key_heads,
            lin.num_value_heads
        ),
        (4, 128, 16, 32)
    );
    assert_eq!(bare.partial_rotary_factor, 0.25);
    // A release-style `rope_parameters` (M-RoPE sections, unused for text) and fields this
    // crate does not read are written back unchanged.
    let mut release: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen35-tiny").join("config.json")).unwrap(),
    )
    .unwrap();
    release["text_config"]["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
    release["text_config"]["rope_parameters"]["mrope_interleaved"] = true.into();
    release["text_config"]["mtp_num_hidden_layers"] = 1.into();
    let release = ModelConfig::from_hf_json(&release.to_string()).unwrap();
    let out = release.to_hf_json();
    assert_eq!(
        out["text_config"]["rope_parameters"]["mrope_section"],
        serde_json::json!([11, 11, 10])
    );
    assert_eq!(
        out["text_config"]["rope_parameters"]["partial_rotary_factor"],
        0.25
    );
    assert_eq!(out["text_config"]["mtp_num_hidden_layers"], 1);
    for c in [tiny, moe, text, bare, release] {
        let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back, c);
    }
}

/// Bad layer types and a wrapper without its text config are typed errors naming the field.
#[test]
fn qwen3_5_bad_configs_are_typed_errors() {
    let text = std::fs::read_to_string(fixture("qwen35-tiny").join("config.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let field_of = |json: serde_json::Value| match ModelConfig::from_hf_json(&json.to_string()) {
        Err(BridgeError::Config { field, .. }) => field,
        other => panic!("expected a config error, got {other:?}"),
    };
    let mut short = base.clone();
    short["text_config"]["layer_types"] = serde_json::json!(["linear_attention"]);
    assert_eq!(field_of(short), "layer_types");
    let mut odd = base.clone();
    odd["text_config"]["layer_types"][0] = "sliding_attention".into();
    assert_eq!(field_of(odd), "layer_types");
    let mut heads = base.clone();
    heads["text_config"]["linear_num_value_heads"] = 3.into();
    assert_eq!(field_of(heads), "linear_num_value_heads");
    let mut bare = base.clone();
    bare.as_object_mut().unwrap().remove("text_config");
    assert_eq!(field_of(bare), "text_config");
}
