//! LoRA training on the glm4moe-tiny fixture: only adapters move (and only they have optimizer
//! state), the loss falls, the exported merged HF weights reproduce the LoRA policy's
//! log-probs bit for bit (so the rollout engine is exactly on-policy), the reference model is
//! the adapter-free base, and checkpoints round-trip bit for bit.

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::lora::LoraForward;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::{DType, NamedTensors, PolicyTrainer, Reward, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, Error, LossType, LrSchedule, TrainConfig};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny")
}

fn model() -> CausalLm {
    CausalLm::from_pretrained(fixture(), &Device::flex().autodiff()).unwrap()
}

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
        lora_rank: 4,
        lora_alpha: 8.0,
        ..TrainConfig::default()
    }
}

fn logprobs(m: &CausalLm, s: &Sample) -> Vec<f32> {
    score_log_probs(
        m,
        &s.tokens,
        s.response_length,
        &Fallthrough,
        &Default::default(),
    )
    .unwrap()
}

fn mean(v: &[f32]) -> f64 {
    v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64
}

fn base_tensors(a: &Actor) -> NamedTensors {
    a.model().to_hf_tensors(DType::F32).unwrap()
}

fn engine(weights: &NamedTensors, like: &CausalLm) -> CausalLm {
    CausalLm::from_hf_tensors(&like.config, weights.clone(), &Device::flex()).unwrap()
}

#[test]
fn sft_and_grpo_with_lora_move_only_the_adapters() {
    let batch = samples();
    let initial = model().to_hf_tensors(DType::F32).unwrap();

    // SFT on a fixed batch: the loss falls; the base weights stay bit-identical.
    let mut sft = Actor::new(
        model(),
        TrainConfig {
            loss_type: LossType::SftLoss,
            ..config()
        },
    )
    .unwrap();
    let lora = sft.model().lora_config().unwrap();
    assert_eq!((lora.r, lora.scaling()), (4, 2.0));
    // all-linear on GLM-4-MoE: attention, dense MLP, shared and routed experts.
    assert_eq!(sft.model().lora_modules().len(), 27);
    let mut losses = Vec::new();
    for r in 0..5 {
        losses.push(sft.train(r, &batch).unwrap()["train/loss"]);
    }
    assert!(
        losses.windows(2).all(|w| w[1] < w[0]),
        "SFT loss must fall: {losses:?}"
    );
    assert!(losses[4] < 0.9 * losses[0], "{losses:?}");
    eprintln!("SFT with LoRA, loss per step: {losses:?}");
    assert_eq!(base_tensors(&sft), initial, "base weights moved");
    let mut moved = 0;
    sft.model().visit_lora_params(&mut |name, p| {
        if name.contains("lora_B") {
            let v = p.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
            moved += usize::from(v.iter().any(|x| *x != 0.0));
        }
    });
    assert_eq!(moved, 27, "every lora_B left zero");

    // GRPO: rewarded responses gain log-probability, unrewarded ones lose it.
    let before: Vec<f64> = batch
        .iter()
        .map(|s| mean(&logprobs(&model().valid(), s)))
        .collect();
    let mut actor = Actor::new(model(), config()).unwrap();
    let first = actor.train(0, &batch).unwrap();
    assert!(first["train/grad_norm"] > 0.0);
    for r in 1..3 {
        actor.train(r, &batch).unwrap();
    }
    assert_eq!(base_tensors(&actor), initial, "base weights moved");
    let policy = actor.model().valid();
    for (i, s) in batch.iter().enumerate() {
        let after = mean(&logprobs(&policy, s));
        let reward = matches!(s.reward, Some(Reward::Scalar(r)) if r > 0.0);
        assert_eq!(
            after > before[i],
            reward,
            "sample {i}: {} -> {after}",
            before[i]
        );
    }

    // Optimizer state exists for the adapters only.
    let dir = std::env::temp_dir().join(format!("miles-lora-state-{}", std::process::id()));
    actor.save_checkpoint(&dir).unwrap();
    let state = NamedTensors::from_safetensors_file(&dir.join("optimizer.safetensors")).unwrap();
    assert_eq!(
        state.len(),
        27 * 2 * 2,
        "exp_avg + exp_avg_sq per adapter tensor"
    );
    assert!(
        state
            .keys()
            .all(|k| k.contains(".lora_A.") || k.contains(".lora_B."))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn exported_merged_weights_reproduce_the_lora_policy() {
    let batch = samples();
    for mode in [LoraForward::Merged, LoraForward::Factored] {
        let mut cfg = TrainConfig {
            lora_forward: mode,
            ..config()
        };
        let merged = mode == LoraForward::Merged;
        cfg.policy_loss.get_mismatch_metrics = merged;
        let mut actor = Actor::new(model(), cfg).unwrap();
        // The rollout engine knows only the base model's HF names: it loads the merged
        // export, generates and scores with it (version 0: fresh adapters).
        let mut rollout = batch.clone();
        for version in 0..2 {
            let weights = actor.export_weights().unwrap();
            let names: Vec<&str> = weights.iter().map(|(n, _)| n).collect();
            let base = model().to_hf_tensors(DType::F32).unwrap();
            assert_eq!(names, base.keys().collect::<Vec<_>>());
            let engine = engine(&weights, actor.model());
            let policy = actor.model().valid();
            for s in &mut rollout {
                let (ours, theirs) = (logprobs(&policy, s), logprobs(&engine, s));
                if merged {
                    assert_eq!(ours, theirs, "version {version}: bit for bit");
                } else {
                    for (a, b) in ours.iter().zip(&theirs) {
                        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
                    }
                }
                s.rollout_log_probs = Some(theirs.iter().map(|&v| f64::from(v)).collect());
            }
            let m = actor.train(version, &rollout).unwrap();
            if merged {
                // The trainer sees exactly the engine's log-probs: zero mismatch.
                assert_eq!(m["train/train_rollout_logprob_abs_diff"], 0.0);
            }
        }
        // The PEFT export names every adapter tensor.
        let (tensors, json) = actor.export_lora_adapter(DType::F32).unwrap().unwrap();
        assert_eq!(json["r"], 4);
        assert!(
            tensors
                .get("base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight")
                .is_some()
        );
    }
}

#[test]
fn reference_model_is_the_base_without_adapters() {
    let batch = samples();
    let mut cfg = config();
    cfg.policy_loss.use_kl_loss = true;
    let mut actor = Actor::new(model(), cfg).unwrap();
    let reference = actor.reference().expect("kl needs a reference");
    assert!(reference.lora_config().is_none());
    let base = model().valid();
    for s in &batch {
        assert_eq!(logprobs(reference, s), logprobs(&base, s));
        // Fresh adapters (B = 0): the policy starts at the reference.
        assert_eq!(logprobs(&actor.model().valid(), s), logprobs(&base, s));
    }
    let m = actor.train(0, &batch).unwrap();
    // Policy = reference on the first step (up to the autodiff forward's last bits).
    assert!(m["train/kl_loss"].abs() < 1e-6, "{}", m["train/kl_loss"]);
    actor.train(1, &batch).unwrap();
    let m = actor.train(2, &batch).unwrap();
    // (k1 by default: mean log-ratio, either sign.)
    assert!(m["train/kl_loss"].abs() > 1e-3, "{}", m["train/kl_loss"]);
    let reference = actor.reference().unwrap();
    let policy = actor.model().valid();
    let mut moved = 0.0f32;
    for s in &batch {
        // The reference stays the base while the policy moves away from it.
        assert_eq!(logprobs(reference, s), logprobs(&base, s));
        for (a, b) in logprobs(&policy, s).iter().zip(logprobs(&base, s)) {
            moved = moved.max((a - b).abs());
        }
    }
    assert!(moved > 1e-3, "policy log-probs moved by {moved}");
}

#[test]
fn lora_checkpoint_resume_is_bit_identical() {
    let batch = samples();
    let tmp = std::env::temp_dir().join(format!("miles-lora-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let ckpt = tmp.join("iter_1");

    let mut straight = Actor::new(model(), config()).unwrap();
    straight.train(0, &batch).unwrap();
    straight.train(1, &batch).unwrap();

    let mut first = Actor::new(model(), config()).unwrap();
    first.train(0, &batch).unwrap();
    first.save_checkpoint(&ckpt).unwrap();
    let saved_adapter = first.export_lora_adapter(DType::F32).unwrap().unwrap().0;
    drop(first);
    // The adapter directory is a PEFT adapter the bridge (and PEFT) loads.
    let peft = CausalLm::from_pretrained(ckpt.join("model"), &Device::flex())
        .unwrap()
        .load_lora_adapter(ckpt.join("adapter"), LoraForward::Merged)
        .unwrap();
    assert_eq!(peft.lora_modules().len(), 27);

    let mut resumed = Actor::new(model(), config()).unwrap();
    resumed.load_checkpoint(&ckpt).unwrap();
    assert_eq!(resumed.step_count(), 1);
    assert_eq!(
        resumed.export_lora_adapter(DType::F32).unwrap().unwrap().0,
        saved_adapter,
        "adapters restored bit for bit"
    );
    resumed.train(1, &batch).unwrap();
    let a = straight.export_lora_adapter(DType::F32).unwrap().unwrap().0;
    let b = resumed.export_lora_adapter(DType::F32).unwrap().unwrap().0;
    assert_eq!(a, b, "adapters differ after resume");
    assert_eq!(
        straight.export_weights().unwrap(),
        resumed.export_weights().unwrap(),
        "merged weights differ after resume"
    );

    // A LoRA checkpoint does not load into a full fine-tuning actor, nor a different rank.
    let mut full = Actor::new(
        model(),
        TrainConfig {
            lora_rank: 0,
            ..config()
        },
    )
    .unwrap();
    let err = full.load_checkpoint(&ckpt).unwrap_err().to_string();
    assert!(err.contains("LoRA"), "{err}");
    let mut other = Actor::new(
        model(),
        TrainConfig {
            lora_rank: 2,
            ..config()
        },
    )
    .unwrap();
    let err = other.load_checkpoint(&ckpt).unwrap_err().to_string();
    assert!(err.contains("r = 4"), "{err}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn lora_flags_are_validated_and_adapters_load_from_a_path() {
    let bad = Actor::new(
        model(),
        TrainConfig {
            lora_dropout: 0.05,
            ..config()
        },
    );
    assert!(matches!(bad, Err(Error::Config { field: "lora", .. })));
    let none = Actor::new(
        model(),
        TrainConfig {
            target_modules: Some("c_attn".into()),
            ..config()
        },
    );
    assert!(matches!(none, Err(Error::Bridge(_))));

    // --lora-adapter-path: the PEFT adapter saved by PEFT on this fixture (r = 4).
    let path = fixture().join("../../lora/glm4moe-tiny");
    let actor = Actor::new(
        model(),
        TrainConfig {
            lora_adapter_path: Some(path.clone()),
            ..config()
        },
    )
    .unwrap();
    assert_eq!(actor.model().lora_modules().len(), 12, "attention only");
    let wrong = Actor::new(
        model(),
        TrainConfig {
            lora_adapter_path: Some(path),
            lora_rank: 8,
            ..config()
        },
    );
    assert!(matches!(
        wrong,
        Err(Error::Config {
            field: "lora_rank",
            ..
        })
    ));
    // TrainConfig reads Miles' flag names.
    let cfg: TrainConfig = serde_json::from_str(
        r#"{"lora_rank": 16, "lora_alpha": 32, "target_modules": "linear_qkv,linear_proj"}"#,
    )
    .unwrap();
    let lora = cfg.lora_config().unwrap();
    assert_eq!((lora.r, lora.scaling()), (16, 2.0));
    assert!(lora.targets("model.layers.0.self_attn.v_proj"));
    assert!(!lora.targets("model.layers.0.mlp.gate_proj"));
}

/// `miles train --lora-rank 4 --target-modules gate_proj,up_proj,down_proj` on GPT-OSS (what
/// Miles' `run-gpt-oss-20B-megatron-moe-lora.sh` passes): the adapters sit on the fused
/// experts (PEFT's `target_parameters` layout), GRPO moves only them, the merged export
/// reproduces the LoRA policy bit for bit, and the PEFT export names them as PEFT does.
#[test]
fn gpt_oss_expert_lora_from_miles_flags() {
    let gpt_oss = || {
        CausalLm::from_pretrained(fixture().join("../gptoss-tiny"), &Device::flex().autodiff())
            .unwrap()
    };
    let mk = |prompt: &[u32], response: &[u32], reward: f64, group: u64| Sample {
        tokens: prompt.iter().chain(response).copied().collect(),
        response_length: response.len(),
        reward: Some(Reward::Scalar(reward)),
        group_index: Some(group),
        ..Sample::default()
    };
    let batch = vec![
        mk(
            &[5, 17, 42, 9],
            &[100, 101, 102, 103, 104, 105, 106],
            1.0,
            0,
        ),
        mk(&[5, 17, 42, 9], &[20, 21, 22], 0.0, 0),
    ];
    let initial = gpt_oss().to_hf_tensors(DType::F32).unwrap();
    let mut actor = Actor::new(
        gpt_oss(),
        TrainConfig {
            target_modules: Some("gate_proj,up_proj,down_proj".into()),
            ..config()
        },
    )
    .unwrap();
    let experts: Vec<String> = (0..3)
        .flat_map(|l| {
            ["gate_up_proj", "down_proj"].map(|p| format!("model.layers.{l}.mlp.experts.{p}"))
        })
        .collect();
    assert_eq!(actor.model().lora_modules(), experts);
    let mut rollout = batch;
    for version in 0..2 {
        let weights = actor.export_weights().unwrap();
        let engine = engine(&weights, actor.model());
        let policy = actor.model().valid();
        for s in &mut rollout {
            let (ours, theirs) = (logprobs(&policy, s), logprobs(&engine, s));
            assert_eq!(ours, theirs, "version {version}: bit for bit");
            s.rollout_log_probs = Some(theirs.iter().map(|&v| f64::from(v)).collect());
        }
        actor.train(version, &rollout).unwrap();
    }
    assert_eq!(base_tensors(&actor), initial, "base weights never move");
    let merged = actor.export_weights().unwrap();
    let moved = merged
        .iter()
        .filter(|(n, t)| *t != &initial[*n])
        .map(|(n, _)| n.to_string())
        .collect::<Vec<_>>();
    assert_eq!(
        moved,
        (0..3)
            .flat_map(|l| {
                ["down_proj", "gate_up_proj"].map(|p| format!("model.layers.{l}.mlp.experts.{p}"))
            })
            .collect::<Vec<_>>(),
        "only the adapted expert parameters change in the merged export"
    );
    let (tensors, json) = actor.export_lora_adapter(DType::F32).unwrap().unwrap();
    assert_eq!(
        json["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    assert_eq!(
        tensors["base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"].shape(),
        &[16, 32]
    );
    assert_eq!(
        tensors["base_model.model.model.layers.2.mlp.experts.lora_B.weight"].shape(),
        &[32, 16]
    );
}
