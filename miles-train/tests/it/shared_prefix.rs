//! The shared-prefix layout (`BatchLayout::SharedPrefix`): on a GRPO batch of several groups
//! (prompts of different lengths, interleaved, responses of 1 to 6 tokens, one fully
//! loss-masked, a group of one), log-probs, entropy and every gradient equal the per-sample
//! layout's up to float rounding on GLM-4-MoE, GPT-OSS (sinks, a sliding window of 6 crossed
//! by the rows) and DeepSeek-V3 / GLM-4.7-Flash (MLA); a whole GRPO step equals the
//! per-sample step; models and flags it cannot serve are refused with a typed error. The
//! expected values are the per-sample layout's (itself checked against transformers in
//! miles-bridge's tests): the claim is the equality of the layouts.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Tensor, TensorData};
use miles_bridge::CausalLm;
use miles_bridge::nn::ParamRef;
use miles_core::{PolicyTrainer, Reward, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{
    Actor, BatchLayout, Error, LrSchedule, ScoredBatch, TrainConfig, TrainItem, score_batch,
};

fn model(name: &str) -> CausalLm {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name);
    CausalLm::from_pretrained(dir, &Device::flex().autodiff()).unwrap()
}

/// Three groups (prompts of 5, 2 and 3 tokens) interleaved, ids < 128 (the smallest
/// fixture vocabulary): group 0 has responses of 6, 4 and 3 tokens (its row, 18 tokens, puts
/// the last response 13 indices after the prompt: past GPT-OSS' window of 6 by index, within
/// it by position), group 1 responses of 1 and 5 tokens (the second one loss-masked
/// entirely), group 2 a single response of 2 tokens with a partial loss mask.
fn samples() -> Vec<Sample> {
    let mk = |prompt: &[u32], response: &[u32], mask: Option<Vec<u8>>, reward: f64, group| Sample {
        tokens: prompt.iter().chain(response).copied().collect(),
        response_length: response.len(),
        loss_mask: mask,
        reward: Some(Reward::Scalar(reward)),
        group_index: Some(group),
        ..Sample::default()
    };
    let p0: &[u32] = &[5, 17, 42, 9, 77];
    let p1: &[u32] = &[7, 8];
    let p2: &[u32] = &[3, 101, 64];
    vec![
        mk(p0, &[100, 101, 102, 103, 104, 105], None, 1.0, 0),
        mk(p1, &[30], None, 1.0, 1),
        mk(p0, &[20, 21, 22, 23], None, 0.0, 0),
        mk(p2, &[90, 91], Some(vec![1, 0]), 1.0, 2),
        mk(p1, &[40, 41, 42, 43, 44], Some(vec![0; 5]), 0.0, 1),
        mk(p0, &[60, 61, 62], None, 0.5, 0),
    ]
}

fn items() -> Vec<TrainItem> {
    samples()
        .iter()
        .enumerate()
        .map(|(i, s)| TrainItem::from_sample(i, s, None, true).unwrap())
        .collect()
}

fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// Every parameter's gradient by name.
fn grads_of(model: &CausalLm, grads: &burn::tensor::Gradients) -> BTreeMap<String, Vec<f32>> {
    let mut out = BTreeMap::new();
    model.visit_params(&mut |name, p| {
        let g = match p {
            ParamRef::R1(p) => p.val().grad(grads),
            ParamRef::R2(p) => p.val().grad(grads).map(|g| g.flatten(0, 1)),
            ParamRef::R3(p) => p.val().grad(grads).map(|g| g.flatten(0, 2)),
        };
        if let Some(g) = g {
            out.insert(name.to_string(), host(g));
        }
    });
    out
}

/// Scores `items` in `layout` and back-propagates a fixed weighting of the log-probs and the
/// entropy: `(log-probs, entropy, gradients)`.
fn scored(
    m: &CausalLm,
    items: &[TrainItem],
    layout: BatchLayout,
) -> (Vec<f32>, Vec<f32>, BTreeMap<String, Vec<f32>>) {
    let refs: Vec<&TrainItem> = items.iter().collect();
    let ScoredBatch {
        log_probs,
        entropy,
        valid,
        ..
    } = score_batch(
        m,
        &refs,
        layout,
        &mut |_| Ok(Box::new(Fallthrough)),
        &Default::default(),
    )
    .unwrap();
    let [b, w] = log_probs.dims();
    let device = log_probs.device();
    let weights: Vec<f32> = (0..b * w).map(|i| 0.3 + (i % 7) as f32 * 0.1).collect();
    let weights = Tensor::<2>::from_data(TensorData::new(weights, [b, w]), &device) * valid;
    let loss =
        (log_probs.clone() * weights.clone()).sum() + (entropy.clone() * weights).sum() * 0.5;
    let grads = loss.backward();
    (host(log_probs), host(entropy), grads_of(m, &grads))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Equal to per_sample up to float rounding: log-probs and entropy within 1e-5 (absolute),
/// every parameter's gradient within 1e-4 of its largest entry (at least 1).
#[test]
fn shared_prefix_scores_and_gradients_equal_per_sample() {
    let items = items();
    for name in [
        "glm4moe-tiny",
        "gptoss-tiny",
        "dsv3-tiny",
        "glm47flash-tiny",
    ] {
        let m = model(name);
        let (lp_a, ent_a, g_a) = scored(&m, &items, BatchLayout::PerSample);
        let (lp_b, ent_b, g_b) = scored(&m, &items, BatchLayout::SharedPrefix);
        let d_lp = max_diff(&lp_a, &lp_b);
        let d_ent = max_diff(&ent_a, &ent_b);
        assert!(d_lp < 1e-5, "{name}: log-probs differ by {d_lp}");
        assert!(d_ent < 1e-5, "{name}: entropy differs by {d_ent}");
        // The padding past each response stays 0.
        let width = lp_b.len() / items.len();
        for (row, item) in items.iter().enumerate() {
            assert!(
                lp_b[row * width + item.response_length..(row + 1) * width]
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
        assert_eq!(
            g_a.keys().collect::<Vec<_>>(),
            g_b.keys().collect::<Vec<_>>(),
            "{name}"
        );
        let mut worst = 0f32;
        for (param, a) in &g_a {
            let scale = a.iter().fold(1f32, |m, v| m.max(v.abs()));
            let d = max_diff(a, &g_b[param]) / scale;
            assert!(
                d < 1e-4,
                "{name}: {param} gradient differs by {d} (relative)"
            );
            worst = worst.max(d);
        }
        eprintln!("{name}: |Δ log-prob| {d_lp:e}, |Δ entropy| {d_ent:e}, gradients {worst:e}");
    }
}

fn grpo_config(layout: BatchLayout) -> TrainConfig {
    TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-2,
            ..LrSchedule::default()
        },
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(2),
        micro_batch_size: 6,
        layout,
        ..TrainConfig::default()
    }
}

/// One GRPO step (the old log-probs from the training forward) in shared_prefix equals the
/// per-sample step up to float rounding: the same metrics (loss, gradient norm, entropy, the
/// rollout mismatch, …), within 1e-5 (relative, or absolute below 1). (The weights after
/// AdamW's first step are not compared: it moves a weight by about `lr·sign(g)`, so a
/// gradient entry near 0 turns rounding into a visible difference.)
#[test]
fn a_grpo_step_in_shared_prefix_equals_the_per_sample_step() {
    let mut batch = samples();
    for s in &mut batch {
        // Rollout log-probs near the model's, so the mismatch metric is computed.
        s.rollout_log_probs = Some(vec![-4.0; s.response_length]);
    }
    let run = |layout| {
        let mut actor = Actor::new(model("glm4moe-tiny"), grpo_config(layout)).unwrap();
        actor.train(0, &batch).unwrap()
    };
    let ma = run(BatchLayout::PerSample);
    let mb = run(BatchLayout::SharedPrefix);
    let keys = |m: &miles_core::Metrics| {
        m.keys()
            .filter(|k| !k.starts_with("perf/"))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(keys(&ma), keys(&mb));
    for key in keys(&ma) {
        let (a, b) = (ma[&key], mb[&key]);
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(1.0),
            "{key}: {a} vs {b}"
        );
    }
    assert_eq!(ma["train/ppo_kl"], 0.0);
    assert_eq!(mb["train/ppo_kl"], 0.0);
}

#[test]
fn shared_prefix_is_refused_with_linear_attention_and_routing_replay() {
    // Qwen3.5's Gated DeltaNet layers: the recurrent state would run through every response.
    let err = Actor::new(model("qwen35-tiny"), grpo_config(BatchLayout::SharedPrefix)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config {
                field: "batch_layout",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("linear-attention"), "{err}");
    // The other layouts still build on it.
    Actor::new(model("qwen35-tiny"), grpo_config(BatchLayout::Padded)).unwrap();
    // R3: a shared prompt has one route per token, the rollout one per sample.
    let r3 = TrainConfig {
        use_routing_replay: true,
        ..grpo_config(BatchLayout::SharedPrefix)
    };
    let err = Actor::new(model("glm4moe-tiny"), r3).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config {
                field: "batch_layout",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("use_routing_replay"), "{err}");
}
