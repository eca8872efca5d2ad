//! The actor on the glm4moe-tiny fixture (a real HF checkpoint): the loss falls, log-probs
//! are batch-invariant bit for bit, resume is bit-identical, bad input gives typed errors.

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{BridgeError, CausalLm, ModelConfig, score_log_probs, score_response};
use miles_core::{PolicyTrainer, Reward, Sample, SampleStatus};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{
    Actor, BatchLayout, Error, LossType, LrSchedule, TrainConfig, TrainItem, score_batch,
};

fn fixture() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny");
    assert!(
        dir.join("model.safetensors").exists(),
        "fixture missing: {}",
        dir.display()
    );
    dir
}

fn model() -> CausalLm {
    CausalLm::from_pretrained(fixture(), &Device::flex().autodiff()).unwrap()
}

/// Four responses to two prompts; ids < 512 (the fixture's vocabulary).
fn samples() -> Vec<Sample> {
    let mk = |prompt: &[u32], response: &[u32], reward: f64, group: u64| Sample {
        tokens: prompt.iter().chain(response).copied().collect(),
        response_length: response.len(),
        reward: Some(Reward::Scalar(reward)),
        group_index: Some(group),
        ..Sample::default()
    };
    vec![
        mk(&[5, 17, 42, 9], &[100, 101, 102, 103, 104], 1.0, 0),
        mk(&[5, 17, 42, 9], &[200, 201, 202], 0.0, 0),
        mk(&[7, 8], &[300, 301, 302, 303, 304, 305], 1.0, 1),
        mk(&[7, 8], &[400, 401], 0.0, 1),
    ]
}

fn config() -> TrainConfig {
    TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-2,
            ..LrSchedule::default()
        },
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(2),
        ..TrainConfig::default()
    }
}

fn items() -> Vec<TrainItem> {
    samples()
        .iter()
        .enumerate()
        .map(|(i, s)| TrainItem::from_sample(i, s, None, true).unwrap())
        .collect()
}

fn mean_logprob(model: &CausalLm, item: &TrainItem) -> f64 {
    let lp = score_log_probs(
        model,
        &item.tokens,
        item.response_length,
        &Fallthrough,
        &Default::default(),
    )
    .unwrap();
    lp.iter().map(|&v| f64::from(v)).sum::<f64>() / lp.len() as f64
}

#[test]
fn sft_loss_falls_and_grpo_moves_probability_towards_rewarded_responses() {
    // SFT on a fixed batch: the loss (−mean log-prob) falls step after step.
    let mut sft = Actor::new(
        model(),
        TrainConfig {
            loss_type: LossType::SftLoss,
            ..config()
        },
    )
    .unwrap();
    let batch = samples();
    let mut losses = Vec::new();
    for r in 0..4 {
        let m = sft.train(r, &batch).unwrap();
        losses.push(m["train/loss"]);
    }
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "SFT loss must fall: {losses:?}"
    );
    assert!(losses[3] < 0.8 * losses[0], "{losses:?}");
    assert_eq!(sft.weight_version().0, 4);
    assert_eq!(sft.step_count(), 4);

    // GRPO: rewarded responses gain log-probability, unrewarded ones lose it.
    let items = items();
    let before: Vec<f64> = {
        let m = model().valid();
        items.iter().map(|i| mean_logprob(&m, i)).collect()
    };
    let mut actor = Actor::new(model(), config()).unwrap();
    let first = actor.train(0, &batch).unwrap();
    // On-policy first step: ratio 1 everywhere (up to the last bits: the autodiff forward and
    // the scoring forward round differently), nothing clipped.
    assert!(
        first["train/ppo_kl"].abs() < 1e-6,
        "{}",
        first["train/ppo_kl"]
    );
    assert_eq!(first["train/pg_clipfrac"], 0.0);
    assert!(first["train/grad_norm"] > 0.0);
    assert_eq!(first["train/lr"], 1e-2);
    for r in 1..3 {
        actor.train(r, &batch).unwrap();
    }
    let after: Vec<f64> = {
        let m = actor.model().valid();
        items.iter().map(|i| mean_logprob(&m, i)).collect()
    };
    for (i, item) in items.iter().enumerate() {
        if item.reward > 0.0 {
            assert!(
                after[i] > before[i],
                "sample {i}: {} -> {}",
                before[i],
                after[i]
            );
        } else {
            assert!(
                after[i] < before[i],
                "sample {i}: {} -> {}",
                before[i],
                after[i]
            );
        }
    }
}

/// Every parameter's buffer start and values (flex), by HF name.
fn param_buffers(model: &CausalLm) -> Vec<(String, usize, Vec<f32>)> {
    use burn::backend::{BackendTensor, DispatchTensorKind};
    use miles_bridge::nn::ParamRef;
    fn buffer<const D: usize>(t: burn::tensor::Tensor<D>) -> (usize, Vec<f32>) {
        let t = if t.is_autodiff() { t.inner() } else { t };
        let start = match t.clone().into_dispatch().kind {
            DispatchTensorKind::Flex(BackendTensor::Float(f)) => {
                f.as_slice::<f32>().map_or(0, |s| s.as_ptr() as usize)
            }
            _ => 0,
        };
        let values = t
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap();
        (start, values)
    }
    let mut out = Vec::new();
    model.visit_params(&mut |name, p| {
        let (start, values) = match p {
            ParamRef::R1(p) => buffer(p.val()),
            ParamRef::R2(p) => buffer(p.val()),
            ParamRef::R3(p) => buffer(p.val()),
        };
        out.push((name.to_string(), start, values));
    });
    out
}

/// The optimizer writes each parameter in place: after a step, every parameter with a
/// gradient holds new values in the buffer it had before (the actor hands its model to the
/// update by value; a second handle would make AdamW write the whole model into new buffers).
#[test]
fn the_optimizer_updates_the_weights_in_place() {
    let batch = samples();
    let mut actor = Actor::new(model(), config()).unwrap();
    // The first step's parameters may be views of the loaded file's buffers (copied once).
    actor.train(0, &batch).unwrap();
    let before = param_buffers(actor.model());
    actor.train(1, &batch).unwrap();
    let after = param_buffers(actor.model());
    assert_eq!(before.len(), after.len());
    let mut updated = 0;
    for ((name, start, values), (name_after, start_after, values_after)) in
        before.iter().zip(&after)
    {
        assert_eq!(name, name_after);
        if values == values_after {
            // No gradient (e.g. `e_score_correction_bias`): not updated.
            continue;
        }
        updated += 1;
        assert!(*start != 0, "{name}: not a flex f32 buffer");
        assert_eq!(start, start_after, "{name}: updated into a new buffer");
    }
    assert!(
        updated * 10 >= before.len() * 9,
        "only {updated} of {} parameters changed",
        before.len()
    );
}

#[test]
fn log_probs_are_batch_invariant_bit_for_bit() {
    let m = model();
    let items = items();
    let alone: Vec<Vec<f32>> = items
        .iter()
        .map(|i| {
            score_log_probs(
                &m.valid(),
                &i.tokens,
                i.response_length,
                &Fallthrough,
                &Default::default(),
            )
            .unwrap()
        })
        .collect();
    let alone_autodiff: Vec<Vec<f32>> = items
        .iter()
        .map(|i| {
            let (lp, _, _) = score_response(
                &m,
                &i.tokens,
                i.response_length,
                &Fallthrough,
                &Default::default(),
            )
            .unwrap();
            lp.into_data().try_to_vec::<f32>().unwrap()
        })
        .collect();
    // The training (autodiff) forward equals the scoring forward up to the last bits.
    for (a, b) in alone.iter().zip(&alone_autodiff) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{x} vs {y}");
        }
    }
    let host = |t: burn::tensor::Tensor<2>| t.into_data().try_to_vec::<f32>().unwrap();
    // Every grouping and order of the same samples, on the scoring model and on the training
    // (autodiff) model: bit for bit what the sample gives alone.
    let orders: [&[usize]; 4] = [&[0, 1, 2, 3], &[3, 2, 1, 0], &[2], &[1, 3]];
    for (model, reference) in [(m.valid(), &alone), (m.clone(), &alone_autodiff)] {
        for order in orders {
            let refs: Vec<&TrainItem> = order.iter().map(|&i| &items[i]).collect();
            let scored = score_batch(
                &model,
                &refs,
                BatchLayout::PerSample,
                &mut |_| Ok(Box::new(Fallthrough)),
                &Default::default(),
            )
            .unwrap();
            let width = scored.log_probs.dims()[1];
            let flat = host(scored.log_probs);
            for (row, &i) in order.iter().enumerate() {
                let got = &flat[row * width..row * width + items[i].response_length];
                let want_bits: Vec<u32> = reference[i].iter().map(|v| v.to_bits()).collect();
                let got_bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got_bits, want_bits, "sample {i} in batch {order:?}");
            }
        }
    }
    // Packed and padded layouts: the same numbers up to float rounding.
    let refs: Vec<&TrainItem> = items.iter().collect();
    for layout in [BatchLayout::Packed, BatchLayout::Padded] {
        let scored = score_batch(
            &m.valid(),
            &refs,
            layout,
            &mut |_| Ok(Box::new(Fallthrough)),
            &Default::default(),
        )
        .unwrap();
        let width = scored.log_probs.dims()[1];
        let flat = host(scored.log_probs);
        let mut worst = 0f32;
        for (row, item) in items.iter().enumerate() {
            for (j, want) in alone[row].iter().enumerate() {
                worst = worst.max((flat[row * width + j] - want).abs());
            }
            assert!(
                flat[row * width + item.response_length..(row + 1) * width]
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
        assert!(worst < 1e-4, "{layout:?}: max |diff| {worst}");
    }
}

#[test]
fn rollout_log_probs_from_the_scoring_function_give_zero_mismatch() {
    // MoE (glm4moe-tiny) and dense (qwen3-tiny; qwen2-tiny with q/k/v biases and tied
    // embeddings) HF checkpoints.
    let mut models = vec![model()];
    for dense in ["../qwen3-tiny", "../qwen2-tiny"] {
        models.push(
            CausalLm::from_pretrained(fixture().join(dense), &Device::flex().autodiff()).unwrap(),
        );
    }
    for m in models {
        zero_mismatch(m);
    }
}

fn zero_mismatch(m: CausalLm) {
    let mut batch = samples();
    let vocab = m.config.vocab_size as u32;
    for s in &mut batch {
        // Fold the ids into smaller vocabularies (qwen2-tiny: 384); no-op for 512.
        s.tokens.iter_mut().for_each(|t| *t %= vocab);
        let lp = score_log_probs(
            &m.valid(),
            &s.tokens,
            s.response_length,
            &Fallthrough,
            &Default::default(),
        )
        .unwrap();
        s.rollout_log_probs = Some(lp.iter().map(|&v| f64::from(v)).collect());
    }
    let mut cfg = config();
    cfg.policy_loss.get_mismatch_metrics = true;
    let mut actor = Actor::new(m, cfg).unwrap();
    let metrics = actor.train(0, &batch).unwrap();
    assert_eq!(metrics["train/train_rollout_logprob_abs_diff"], 0.0);
}

#[test]
fn one_step_takes_the_old_log_probs_from_the_training_forward() {
    // One optimizer step per call: the old log-probs are the training forward's own
    // (detached), with no forward of their own. With the per-sample layout that forward is
    // the scoring function bit for bit, so the step equals the one that scores the old
    // log-probs first (forced here by asking for the mismatch metrics): same loss, gradient
    // norm and weights, a ratio of exactly 1, and zero train/rollout mismatch. With R3 too.
    let base = model();
    let mut batch = samples();
    for s in &mut batch {
        let lp = score_log_probs(
            &base.valid(),
            &s.tokens,
            s.response_length,
            &Fallthrough,
            &Default::default(),
        )
        .unwrap();
        s.rollout_log_probs = Some(lp.iter().map(|&v| f64::from(v)).collect());
        s.rollout_routed_experts = Some(own_routing(&base, s));
    }
    for use_routing_replay in [false, true] {
        let skip = TrainConfig {
            use_routing_replay,
            ..config()
        };
        let mut forward = skip.clone();
        forward.policy_loss.get_mismatch_metrics = true;
        let mut a = Actor::new(model(), skip).unwrap();
        let ma = a.train(0, &batch).unwrap();
        let mut b = Actor::new(model(), forward).unwrap();
        let mb = b.train(0, &batch).unwrap();
        for key in [
            "train/loss",
            "train/pg_loss",
            "train/grad_norm",
            "train/ppo_kl",
            "train/pg_clipfrac",
            "train/train_rollout_logprob_abs_diff",
        ] {
            assert_eq!(ma[key], mb[key], "{key} (R3 {use_routing_replay})");
        }
        assert_eq!(ma["train/ppo_kl"], 0.0);
        assert_eq!(ma["train/train_rollout_logprob_abs_diff"], 0.0);
        if use_routing_replay {
            assert_eq!(ma["r3/flip_rate"], mb["r3/flip_rate"]);
        }
        // The mismatch metrics come only with the forward that was asked for.
        assert!(mb.contains_key("train/tis") && !ma.contains_key("train/tis"));
        let wa = a.export(miles_core::DType::F32).unwrap();
        let wb = b.export(miles_core::DType::F32).unwrap();
        assert_eq!(wa, wb, "weights after the step (R3 {use_routing_replay})");
    }

    // use_rollout_logprobs: the rollout's log-probs are the old ones (here shifted by 0.25, so
    // ppo_kl = −0.25 on every token), and the train/rollout mismatch is 0 as in Miles.
    let mut shifted = batch.clone();
    for s in &mut shifted {
        for v in s.rollout_log_probs.as_mut().unwrap() {
            *v -= 0.25;
        }
    }
    let mut cfg = config();
    cfg.policy_loss.use_rollout_logprobs = true;
    let mut actor = Actor::new(model(), cfg).unwrap();
    let m = actor.train(0, &shifted).unwrap();
    assert_eq!(m["train/train_rollout_logprob_abs_diff"], 0.0);
    assert!((m["train/ppo_kl"] + 0.25).abs() < 1e-5, "{m:?}");
}

#[test]
fn exact_rollout_log_probs_are_needed_only_where_the_trainer_compares_per_sample() {
    // 256 samples per rollout. Per-sample layout: always (the training forward or the old
    // forward is the engine's scoring function). Padded, one step, no correction: never.
    let base = TrainConfig::default();
    assert!(base.needs_exact_rollout_log_probs(256));
    let padded = TrainConfig {
        layout: BatchLayout::Padded,
        ..TrainConfig::default()
    };
    assert!(!padded.needs_exact_rollout_log_probs(256));
    let mut tis = padded.clone();
    tis.policy_loss.use_tis = true;
    assert!(tis.needs_exact_rollout_log_probs(256));
    let mut shaped = padded.clone();
    shaped.advantage.kl_coef = 0.1;
    assert!(shaped.needs_exact_rollout_log_probs(256));
    // Two optimizer steps per rollout: the actor runs its own (per-sample) old forward.
    let two_steps = TrainConfig {
        global_batch_size: Some(128),
        ..padded.clone()
    };
    assert!(two_steps.needs_exact_rollout_log_probs(256));
    assert!(!two_steps.needs_exact_rollout_log_probs(128));
    let sft = TrainConfig {
        loss_type: LossType::SftLoss,
        ..TrainConfig::default()
    };
    assert!(!sft.needs_exact_rollout_log_probs(256));
}

#[test]
fn micro_batches_and_steps_accumulate_like_one_batch() {
    // One step over 4 samples in micro-batches of 1 equals micro-batches of 4 (same gradient
    // up to float rounding), and two steps of 2 take two optimizer steps.
    let batch = samples();
    let run = |cfg: TrainConfig| {
        let mut a = Actor::new(model(), cfg).unwrap();
        let m = a.train(0, &batch).unwrap();
        (a, m)
    };
    let (_, one) = run(TrainConfig {
        micro_batch_size: 1,
        ..config()
    });
    let (_, four) = run(TrainConfig {
        micro_batch_size: 4,
        ..config()
    });
    let (_, dynamic) = run(TrainConfig {
        use_dynamic_batch_size: true,
        max_tokens_per_gpu: Some(12),
        ..config()
    });
    for m in [&four, &dynamic] {
        let rel = (m["train/grad_norm"] - one["train/grad_norm"]).abs() / one["train/grad_norm"];
        assert!(
            rel < 1e-5,
            "{} vs {}",
            m["train/grad_norm"],
            one["train/grad_norm"]
        );
    }
    let (a, two) = run(TrainConfig {
        global_batch_size: Some(2),
        ..config()
    });
    assert_eq!(a.step_count(), 2);
    assert_eq!(two["train/steps"], 2.0);
}

#[test]
fn resume_from_checkpoint_is_bit_identical() {
    let batch = samples();
    let tmp = std::env::temp_dir().join(format!("miles-train-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let ckpt = tmp.join("iter_1");

    let mut straight = Actor::new(model(), config()).unwrap();
    straight.train(0, &batch).unwrap();
    straight.train(1, &batch).unwrap();

    let mut first = Actor::new(model(), config()).unwrap();
    first.train(0, &batch).unwrap();
    first.save_checkpoint(&ckpt).unwrap();
    // Saving again over an existing checkpoint replaces it atomically.
    first.save_checkpoint(&ckpt).unwrap();
    assert!(!tmp.join("iter_1.tmp").exists() && !tmp.join("iter_1.old").exists());
    drop(first);

    let mut resumed = Actor::new(model(), config()).unwrap();
    resumed.load_checkpoint(&ckpt).unwrap();
    assert_eq!(resumed.weight_version().0, 1);
    assert_eq!(resumed.step_count(), 1);
    resumed.train(1, &batch).unwrap();

    let a = straight.export_weights().unwrap();
    let b = resumed.export_weights().unwrap();
    assert_eq!(a.len(), b.len());
    for (name, t) in a.iter() {
        assert_eq!(
            t.data(),
            b.get(name).unwrap().data(),
            "{name} differs after resume"
        );
    }
    // The saved model is an HF checkpoint the bridge loads directly.
    let reloaded = CausalLm::from_pretrained(ckpt.join("model"), &Device::flex()).unwrap();
    assert_eq!(reloaded.num_params(), straight.model().num_params());
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn removed_samples_that_cannot_be_items_are_left_out_not_an_error() {
    // An aborted request that never got a token, and a sample whose reward function failed:
    // both flagged `remove_sample` by the rollout, as in Miles; neither can be trained on.
    let mut with_unusable = samples();
    with_unusable.insert(
        1,
        Sample {
            tokens: vec![5, 17, 42, 9],
            response_length: 0,
            group_index: Some(0),
            remove_sample: true,
            status: SampleStatus::Aborted,
            ..Sample::default()
        },
    );
    with_unusable.push(Sample {
        tokens: vec![7, 8, 50, 51],
        response_length: 2,
        group_index: Some(1),
        remove_sample: true,
        status: SampleStatus::Failed,
        ..Sample::default()
    });
    let mut plain = Actor::new(model(), config()).unwrap();
    plain.train(0, &samples()).unwrap();
    let mut actor = Actor::new(model(), config()).unwrap();
    let metrics = actor.train(0, &with_unusable).unwrap();
    assert_eq!(metrics["train/removed_samples_dropped"], 2.0);
    let (a, b) = (
        plain.export_weights().unwrap(),
        actor.export_weights().unwrap(),
    );
    for (name, t) in a.iter() {
        assert_eq!(t.data(), b.get(name).unwrap().data(), "{name}");
    }
    // The same empty sample without the flag is a malformed batch.
    with_unusable[1].remove_sample = false;
    let err = actor.train(1, &with_unusable).unwrap_err();
    assert!(err.to_string().contains("sample 1"), "{err}");
    // A batch with nothing trainable is an error, and changes nothing.
    let version = actor.weight_version();
    let err = actor.train(1, &with_unusable[1..2]).unwrap_err();
    assert!(err.to_string().contains("sample 0"), "{err}");
    let only_removed = vec![with_unusable.last().unwrap().clone()];
    let err = actor.train(1, &only_removed).unwrap_err();
    assert!(err.to_string().contains("none of the 1 samples"), "{err}");
    assert_eq!(actor.weight_version(), version);
}

#[test]
fn broken_checkpoints_and_samples_are_typed_errors_and_change_nothing() {
    let tmp = std::env::temp_dir().join(format!("miles-train-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let ckpt = tmp.join("ckpt");
    let mut actor = Actor::new(model(), config()).unwrap();
    actor.train(0, &samples()).unwrap();
    actor.save_checkpoint(&ckpt).unwrap();
    let before = actor.export_weights().unwrap();

    // Missing directory.
    let err = actor.load_checkpoint(&tmp.join("nope")).unwrap_err();
    assert!(err.to_string().contains("trainer_state.json"), "{err}");
    // Corrupt optimizer file.
    let opt = ckpt.join("optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() / 2]).unwrap();
    let err = actor.load_checkpoint(&ckpt).unwrap_err();
    assert!(err.to_string().contains("optimizer.safetensors"), "{err}");
    std::fs::write(&opt, &bytes).unwrap();
    // Corrupt state file.
    let state = ckpt.join("trainer_state.json");
    let text = std::fs::read_to_string(&state).unwrap();
    std::fs::write(&state, "{ not json").unwrap();
    let err = actor.load_checkpoint(&ckpt).unwrap_err();
    assert!(err.to_string().contains("corrupt"), "{err}");
    std::fs::write(&state, &text).unwrap();
    // A checkpoint of another model.
    let other_cfg = ModelConfig::from_file(fixture().join("config.json")).unwrap();
    let mut other_cfg_json = other_cfg.to_hf_json();
    other_cfg_json["hidden_size"] = 32.into();
    other_cfg_json["head_dim"] = 8.into();
    let small = ModelConfig::from_hf_json(&other_cfg_json.to_string()).unwrap();
    let mut other = Actor::new(
        CausalLm::init(&small, &Device::flex().autodiff()).unwrap(),
        config(),
    )
    .unwrap();
    let err = other.load_checkpoint(&ckpt).unwrap_err();
    assert!(err.to_string().contains("does not match"), "{err}");

    // Bad samples: typed error, weights and version unchanged.
    let mut bad = samples();
    bad[2].response_length = 0;
    let err = actor.train(1, &bad).unwrap_err();
    assert!(err.to_string().contains("sample 2"), "{err}");
    let mut bad = samples();
    bad[1].tokens[5] = 9_999; // outside the 512-token vocabulary
    assert!(actor.train(1, &bad).is_err());
    assert_eq!(actor.weight_version().0, 1);
    let after = actor.export_weights().unwrap();
    for (name, t) in before.iter() {
        assert_eq!(t.data(), after.get(name).unwrap().data(), "{name}");
    }
    // A model that is not on an autodiff device is refused.
    let err = Actor::new(
        CausalLm::from_pretrained(fixture(), &Device::flex()).unwrap(),
        config(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Config {
                field: "device",
                ..
            }
        ),
        "{err}"
    );
    let _: Option<BridgeError> = None;
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn ppo_trains_a_critic_first_and_its_value_loss_falls() {
    use miles_ops::AdvantageEstimator;
    let mut cfg = config();
    cfg.advantage = cfg
        .advantage
        .with_advantage_estimator(AdvantageEstimator::Ppo);
    cfg.policy_loss.advantage_estimator = AdvantageEstimator::Ppo;
    cfg.critic_lr = Some(5e-3);
    // Without a critic, ppo is a typed error and nothing is trained.
    let mut no_critic = Actor::new(model(), cfg.clone()).unwrap();
    let err = no_critic.train(0, &samples()).unwrap_err();
    assert!(err.to_string().contains("critic"), "{err}");
    assert_eq!(no_critic.step_count(), 0);

    let mut actor = Actor::new(model(), cfg)
        .unwrap()
        .with_critic(model())
        .unwrap();
    let batch = samples();
    let mut value_losses = Vec::new();
    for r in 0..5 {
        let m = actor.train(r, &batch).unwrap();
        value_losses.push(m["train/value_loss"]);
        assert!(m.contains_key("train/pg_loss"));
        assert!(m["train/critic_grad_norm"] > 0.0);
    }
    // Zero-initialised value head: the first loss is the mean squared return per sample
    // (GAE with gamma = lambda = 1 and V = 0: every return equals the sample's reward).
    let want: f64 = samples()
        .iter()
        .map(|s| match s.reward {
            Some(Reward::Scalar(r)) => r * r,
            _ => unreachable!(),
        })
        .sum::<f64>()
        / 4.0;
    assert!(
        (value_losses[0] - want).abs() < 1e-5,
        "{value_losses:?} vs {want}"
    );
    eprintln!("value losses: {value_losses:?}");
    // Adam at a constant LR overshoots a little, but every later loss is below the first and
    // the best is under half of it.
    assert!(
        value_losses[1..].iter().all(|&l| l < value_losses[0]),
        "{value_losses:?}"
    );
    let best = value_losses[1..]
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min);
    assert!(best < 0.5 * value_losses[0], "{value_losses:?}");
    assert_eq!(actor.critic().unwrap().step_count(), 5);
}

#[test]
fn frozen_parameters_do_not_move() {
    let frozen = [
        "model.embed_tokens.weight".to_string(),
        "model.layers.0.".to_string(),
    ];
    let cfg = TrainConfig {
        freeze_params: frozen.to_vec(),
        ..config()
    };
    let mut actor = Actor::new(model(), cfg).unwrap();
    let before = actor.export_weights().unwrap();
    actor.train(0, &samples()).unwrap();
    let after = actor.export_weights().unwrap();
    let mut moved = 0;
    for (name, t) in before.iter() {
        let same = t.data() == after.get(name).unwrap().data();
        if name == "model.embed_tokens.weight" || name.starts_with("model.layers.0.") {
            assert!(same, "{name} is frozen but changed");
        } else if !same {
            moved += 1;
        }
    }
    assert!(moved > 10, "only {moved} tensors moved");
}

/// The fixture's own routing of `s` as SGLang returns it: `[tokens − 1, all layers, top_k]`
/// (the dense layer 0 holds zeros, which replay skips).
fn own_routing(m: &CausalLm, s: &Sample) -> miles_core::RoutedExperts {
    use miles_bridge::{ModelInput, ids_tensor};
    let n = s.tokens.len();
    let ids = ids_tensor(std::slice::from_ref(&s.tokens), &Device::flex()).unwrap();
    let out = m
        .valid()
        .forward(&ModelInput::new(ids), &Fallthrough)
        .unwrap();
    let layers = m.config.num_hidden_layers;
    let top_k = m.config.num_experts_per_tok;
    let mut data = vec![0i32; (n - 1) * layers * top_k];
    for r in &out.routing {
        let ex: Vec<i64> = r
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .unwrap();
        for row in 0..n - 1 {
            for k in 0..top_k {
                data[(row * layers + r.layer_index) * top_k + k] = ex[row * top_k + k] as i32;
            }
        }
    }
    miles_core::RoutedExperts::new(n - 1, layers, top_k, data).unwrap()
}

#[test]
fn routing_replay_flows_from_samples_into_the_training_forward() {
    let m = model();
    let replay_cfg = TrainConfig {
        use_routing_replay: true,
        ..config()
    };
    // Replay on without recorded routing: a typed error, nothing trained.
    let mut actor = Actor::new(model(), replay_cfg.clone()).unwrap();
    let err = actor.train(0, &samples()).unwrap_err();
    assert!(
        err.to_string().contains("routing") || err.to_string().contains("rout"),
        "{err}"
    );
    assert_eq!(actor.step_count(), 0);

    // Replaying the model's own routing: no flip, and the step equals fallthrough training.
    let mut batch = samples();
    for s in &mut batch {
        s.rollout_routed_experts = Some(own_routing(&m, s));
    }
    let mut replayed = Actor::new(model(), replay_cfg.clone()).unwrap();
    let mr = replayed.train(0, &batch).unwrap();
    assert_eq!(mr["r3/flip_rate"], 0.0);
    let mut plain = Actor::new(model(), config()).unwrap();
    let mp = plain.train(0, &batch).unwrap();
    // Equal up to f32 summation order: replayed ids arrive sorted, the router's in score
    // order, so sparse dispatch adds a token's expert outputs in a different order.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-12);
    assert!(
        close(mr["train/grad_norm"], mp["train/grad_norm"]),
        "{mr:?} vs {mp:?}"
    );
    assert!(
        close(mr["train/pg_loss"], mp["train/pg_loss"]),
        "{mr:?} vs {mp:?}"
    );

    // A different recorded routing (every MoE token routed to experts {0, 1}): flips are
    // reported, and the trainer's forward follows the recorded experts.
    let mut forced = batch.clone();
    for s in &mut forced {
        let r = s.rollout_routed_experts.as_ref().unwrap();
        let [rows, layers, top_k] = r.shape();
        let mut data = Vec::with_capacity(rows * layers * top_k);
        for _ in 0..rows * layers {
            data.extend(0..top_k as i32);
        }
        s.rollout_routed_experts =
            Some(miles_core::RoutedExperts::new(rows, layers, top_k, data).unwrap());
    }
    let mut actor = Actor::new(model(), replay_cfg).unwrap();
    let mf = actor.train(0, &forced).unwrap();
    assert!(mf["r3/flip_rate"] > 0.0, "{mf:?}");
    assert_ne!(mf["train/grad_norm"], mp["train/grad_norm"]);
}

#[test]
fn per_turn_siblings_reduce_to_one_token_weighted_mean_per_rollout() {
    // One prompt group, three rollouts interleaved: rollout 7 has two per-turn samples
    // (reward 1; the second turn's prompt holds the first turn), rollouts 8 and 9 one each
    // (reward 0). Miles normalises over rollouts: rewards [1, 0, 0], mean 1/3, unbiased std
    // sqrt(1/3), a₁ = (2/3) / (sqrt(1/3) + 1e-6), a₀ = (−1/3) / (sqrt(1/3) + 1e-6). At the
    // first step the ratio is 1, so each rollout's token-weighted mean of −a·ratio is −a_r
    // and pg_loss = −(a₁ + 2a₀) / 3 = 0. Dividing by sample count instead would give
    // −(2a₁ + 2a₀) / 4 = −0.2887, each sibling by its own mask sum −(2a₁ + 2a₀) / 3 = −0.3849.
    let mk = |tokens: Vec<u32>, response_length: usize, reward: f64, rollout: u64| Sample {
        tokens,
        response_length,
        reward: Some(Reward::Scalar(reward)),
        group_index: Some(0),
        index: Some(rollout),
        rollout_id: Some(rollout),
        ..Sample::default()
    };
    let turn0 = vec![5, 17, 42, 9, 100, 101, 102];
    let mut turn1 = turn0.clone();
    turn1.extend([60, 61, 110, 111, 112, 113, 114]);
    let batch = vec![
        mk(turn0, 3, 1.0, 7),
        mk(vec![5, 17, 42, 9, 200, 201], 2, 0.0, 8),
        mk(turn1, 5, 1.0, 7),
        mk(vec![5, 17, 42, 9, 300, 301, 302, 303], 4, 0.0, 9),
    ];
    let run = |cfg: TrainConfig| {
        let mut a = Actor::new(model(), cfg).unwrap();
        let m = a.train(0, &batch).unwrap();
        (a, m)
    };
    for micro_batch_size in [1, 4] {
        let (a, m) = run(TrainConfig {
            micro_batch_size,
            ..config()
        });
        assert!(m["train/pg_loss"].abs() < 1e-4, "{m:?}");
        assert_eq!(a.step_count(), 1);
    }
    // global_batch_size counts rollouts: 3 rollouts in one step, 2 in two steps ([7, 7, 8],
    // [9]); siblings are never split.
    let (a, m) = run(TrainConfig {
        global_batch_size: Some(3),
        ..config()
    });
    assert_eq!((a.step_count(), m["train/steps"]), (1, 1.0));
    let (a, m) = run(TrainConfig {
        global_batch_size: Some(2),
        ..config()
    });
    assert_eq!((a.step_count(), m["train/steps"]), (2, 2.0));
    // Siblings with different rewards are an error (Miles: ValueError), nothing trained.
    let mut bad = batch.clone();
    bad[2].reward = Some(Reward::Scalar(0.5));
    let mut a = Actor::new(model(), config()).unwrap();
    let err = a.train(0, &bad).unwrap_err().to_string();
    assert!(err.contains("rollout 7"), "{err}");
    assert_eq!(a.step_count(), 0);
}
