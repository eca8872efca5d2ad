//! Activation recomputation (`--recompute-granularity full`): the loss and every gradient
//! equal the plain path's bit for bit (one forward pass per loss, f32), the recomputed MoE
//! layers route as in the forward, only the planned hidden states are kept, and the trainer's
//! step with recomputation equals the plain step.

use std::collections::BTreeMap;
use std::path::PathBuf;

use burn::tensor::{Device, Gradients, Tensor};
use miles_bridge::nn::ParamRef;
use miles_bridge::{
    CausalLm, ModelInput, Precision, RecomputeConfig, RecomputeGranularity, RecomputeMethod,
    RecomputePlan, RecomputedForward, ids_tensor, score_hidden_rows,
};
use miles_core::{PolicyTrainer, Reward, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, LrSchedule, TrainConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/models")
        .join(name)
}

fn model(name: &str) -> CausalLm {
    CausalLm::from_pretrained(fixture(name), &Device::flex().autodiff()).unwrap()
}

fn full(method: RecomputeMethod, n: usize) -> RecomputeConfig {
    RecomputeConfig {
        granularity: Some(RecomputeGranularity::Full),
        method: Some(method),
        num_layers: Some(n),
    }
}

/// Token rows (ids < 512, every fixture's vocabulary is at least that).
fn rows() -> Vec<Vec<u32>> {
    vec![
        vec![5, 17, 42, 9, 100, 101, 102, 103, 104],
        vec![7, 8, 300, 301, 302],
        vec![11, 12, 13, 400, 401, 402, 403],
    ]
}

type Grads = BTreeMap<String, Vec<f32>>;

/// Every parameter's gradient, summed over `stages` in order.
fn collect(model: &CausalLm, stages: &[Gradients]) -> Grads {
    let mut out: BTreeMap<String, Tensor<1>> = BTreeMap::new();
    for grads in stages {
        model.visit_params(&mut |name, p| {
            let g = match p {
                ParamRef::R1(p) => p.val().grad(grads),
                ParamRef::R2(p) => p.val().grad(grads).map(|g| g.flatten(0, 1)),
                ParamRef::R3(p) => p.val().grad(grads).map(|g| g.flatten(0, 2)),
            };
            if let Some(g) = g {
                let g = match out.remove(name) {
                    Some(acc) => acc + g,
                    None => g,
                };
                out.insert(name.to_string(), g);
            }
        });
    }
    out.into_iter()
        .map(|(k, v)| {
            (
                k,
                v.into_data().convert::<f32>().try_to_vec::<f32>().unwrap(),
            )
        })
        .collect()
}

/// Negative sum of next-token log-probs over `rows` (one forward pass each) and the
/// gradients, plain (`plan = None`) or recomputed; with the number of kept hidden states.
fn loss_and_grads(
    model: &CausalLm,
    precision: Precision,
    plan: Option<RecomputePlan>,
    rows: &[Vec<u32>],
) -> (f32, Grads, usize) {
    let device = model.lm_head_weight().device();
    let score = |head: &CausalLm, hidden: Tensor<3>, row: &[u32]| {
        let [_, n, h] = hidden.dims();
        let lp = score_hidden_rows(
            head,
            hidden.reshape([n, h]).narrow(0, 0, n - 1),
            &row[1..],
            &Default::default(),
        )
        .unwrap()
        .0;
        lp.sum().neg()
    };
    let input =
        |row: &Vec<u32>| ModelInput::new(ids_tensor(std::slice::from_ref(row), &device).unwrap());
    match plan {
        None => {
            let compute = model.clone().to_precision(precision);
            let loss = rows
                .iter()
                .map(|r| {
                    score(
                        &compute,
                        compute
                            .forward_hidden(&input(r), &Fallthrough)
                            .unwrap()
                            .hidden,
                        r,
                    )
                })
                .reduce(|a, b| a + b)
                .unwrap();
            let value = loss.clone().into_scalar::<f32>();
            let grads = loss.backward();
            (value, collect(model, &[grads]), 0)
        }
        Some(plan) => {
            let mut fwd = RecomputedForward::new(model, precision, plan);
            let head = fwd.head().clone();
            let mut loss = None;
            for r in rows {
                let out = fwd.forward_hidden(&input(r), &Fallthrough).unwrap();
                let term = score(&head, out.hidden, r);
                loss = Some(match loss {
                    Some(l) => l + term,
                    None => term,
                });
            }
            let loss = loss.unwrap();
            let value = loss.clone().into_scalar::<f32>();
            let kept = fwd.kept_hidden_states();
            let stages = fwd.backward(loss).unwrap();
            (value, collect(model, &stages), kept)
        }
    }
}

fn max_rel_diff(a: &Grads, b: &Grads) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst = 0.0f32;
    for (name, x) in a {
        let y = &b[name];
        let scale = x.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs() / scale);
        }
    }
    worst
}

#[test]
fn megatron_plans_and_rules() {
    let plan = |c: RecomputeConfig, layers| c.plan(layers).unwrap();
    // uniform: groups of N (the last one shorter), every layer recomputed.
    assert_eq!(
        plan(full(RecomputeMethod::Uniform, 2), 5),
        RecomputePlan {
            groups: vec![0..2, 2..4, 4..5],
            kept: 5..5
        }
    );
    // block: the first N layers one by one, the rest kept.
    assert_eq!(
        plan(full(RecomputeMethod::Block, 2), 5),
        RecomputePlan {
            groups: vec![0..1, 1..2],
            kept: 2..5
        }
    );
    let selective = RecomputeConfig {
        granularity: Some(RecomputeGranularity::Selective),
        ..RecomputeConfig::default()
    };
    assert!(selective.validate(4).is_ok());
    assert_eq!(selective.plan(4), None);
    assert_eq!(RecomputeConfig::default().plan(4), None);
    for bad in [
        RecomputeConfig {
            method: None,
            ..full(RecomputeMethod::Uniform, 1)
        },
        RecomputeConfig {
            num_layers: None,
            ..full(RecomputeMethod::Uniform, 1)
        },
        full(RecomputeMethod::Block, 5),
        full(RecomputeMethod::Uniform, 0),
        RecomputeConfig {
            num_layers: Some(1),
            ..selective
        },
        RecomputeConfig {
            method: Some(RecomputeMethod::Uniform),
            ..selective
        },
        RecomputeConfig {
            method: Some(RecomputeMethod::Block),
            ..RecomputeConfig::default()
        },
    ] {
        assert!(bad.validate(4).is_err(), "{bad:?} must be refused");
    }
    assert_eq!(
        "full".parse::<RecomputeGranularity>().unwrap(),
        RecomputeGranularity::Full
    );
    assert_eq!(
        "block".parse::<RecomputeMethod>().unwrap(),
        RecomputeMethod::Block
    );
    assert!("all".parse::<RecomputeGranularity>().is_err());
}

#[test]
fn recomputed_gradients_equal_the_plain_path_bit_for_bit() {
    // GLM-4-MoE tiny: a dense layer then two MoE layers (the recomputed ones route with the
    // forward's experts); untied embeddings. One forward pass per loss.
    let m = model("glm4moe-tiny");
    let one = &rows()[..1];
    let (loss, grads, _) = loss_and_grads(&m, Precision::F32, None, one);
    assert!(loss.is_finite() && loss > 0.0);
    let mut names = Vec::new();
    m.visit_params(&mut |name, _| names.push(name.to_string()));
    // Every parameter but the routers' correction biases (buffers) has a gradient.
    let buffers = names
        .iter()
        .filter(|n| n.ends_with("e_score_correction_bias"))
        .count();
    assert_eq!(grads.len(), names.len() - buffers);
    for (config, kept) in [
        (full(RecomputeMethod::Uniform, 1), 4),
        (full(RecomputeMethod::Uniform, 2), 3),
        (full(RecomputeMethod::Block, 1), 2),
        (full(RecomputeMethod::Block, 3), 4),
    ] {
        let plan = config.plan(3).unwrap();
        let (l, g, k) = loss_and_grads(&m, Precision::F32, Some(plan), one);
        assert_eq!(l.to_bits(), loss.to_bits(), "{config:?}");
        assert_eq!(g, grads, "{config:?}");
        // One input per recomputed group plus the leaf: the activations kept between the
        // forward and the backward (`[batch, seq, hidden]` each).
        assert_eq!(k, kept, "{config:?}");
    }
    // bf16 compute on the f32 masters: each layer is cast where it runs, as the whole model
    // is cast on the plain path.
    let (loss, grads, _) = loss_and_grads(&m, Precision::Bf16, None, one);
    let plan = full(RecomputeMethod::Uniform, 1).plan(3).unwrap();
    let (l, g, _) = loss_and_grads(&m, Precision::Bf16, Some(plan), one);
    assert_eq!(l.to_bits(), loss.to_bits());
    assert_eq!(g, grads);
    // Several forward passes per loss (per-sample layout): each parameter's per-pass terms
    // are summed per stage, equal up to the summation order's rounding.
    let (loss, grads, _) = loss_and_grads(&m, Precision::F32, None, &rows());
    let plan = full(RecomputeMethod::Uniform, 1).plan(3).unwrap();
    let (l, g, k) = loss_and_grads(&m, Precision::F32, Some(plan), &rows());
    assert_eq!(l.to_bits(), loss.to_bits());
    assert_eq!(k, 3 * 4);
    let diff = max_rel_diff(&g, &grads);
    assert!(diff < 1e-5, "{diff}");
}

#[test]
fn recompute_covers_tied_embeddings_hybrid_layers_and_bf16() {
    // Qwen3.5 tiny: Gated DeltaNet linear-attention layers beside full attention.
    let m = model("qwen35-tiny");
    let layers = m.config.num_hidden_layers;
    let one = &rows()[..1];
    let (loss, grads, _) = loss_and_grads(&m, Precision::F32, None, one);
    let plan = full(RecomputeMethod::Uniform, 2).plan(layers).unwrap();
    let (l, g, _) = loss_and_grads(&m, Precision::F32, Some(plan), one);
    assert_eq!(l.to_bits(), loss.to_bits());
    assert_eq!(g, grads);
    // Qwen3 tiny (tied embeddings) in bf16: the layers are cast from the f32 masters where
    // they run; the tied embedding's two gradient terms are summed in f32 after the cast
    // rather than in bf16 before it.
    let m = model("qwen3-tiny");
    let layers = m.config.num_hidden_layers;
    let (loss, grads, _) = loss_and_grads(&m, Precision::Bf16, None, one);
    let plan = full(RecomputeMethod::Block, 1).plan(layers).unwrap();
    let (l, g, _) = loss_and_grads(&m, Precision::Bf16, Some(plan), one);
    assert_eq!(l.to_bits(), loss.to_bits());
    let diff = max_rel_diff(&g, &grads);
    assert!(diff < 1e-2, "{diff}");
}

fn samples() -> Vec<Sample> {
    rows()
        .into_iter()
        .chain([vec![7, 8, 9, 10, 410, 411]])
        .enumerate()
        .map(|(i, tokens)| Sample {
            response_length: 3,
            tokens,
            reward: Some(Reward::Scalar((i % 2) as f64)),
            group_index: Some((i / 2) as u64),
            ..Sample::default()
        })
        .collect()
}

#[test]
fn the_actor_step_with_recomputation_equals_the_plain_step() {
    let config = |recompute| TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-2,
            ..LrSchedule::default()
        },
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(2),
        recompute,
        ..TrainConfig::default()
    };
    let mut plain = Actor::new(model("glm4moe-tiny"), config(RecomputeConfig::default())).unwrap();
    let mut recomputed = Actor::new(
        model("glm4moe-tiny"),
        config(full(RecomputeMethod::Uniform, 1)),
    )
    .unwrap();
    for step in 0..2 {
        let a = plain.train(step, &samples()).unwrap();
        let b = recomputed.train(step, &samples()).unwrap();
        for key in ["train/loss", "train/pg_loss", "train/grad_norm"] {
            assert_eq!(a[key].to_bits(), b[key].to_bits(), "{key} at step {step}");
        }
    }
    let (a, b) = (
        plain.export_weights().unwrap(),
        recomputed.export_weights().unwrap(),
    );
    assert_eq!(a, b);
    // Refused combinations: as Megatron's checks, against the model's 3 layers.
    let err = Actor::new(
        model("glm4moe-tiny"),
        config(full(RecomputeMethod::Block, 4)),
    );
    assert!(err.is_err());
}
