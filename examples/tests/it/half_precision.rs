//! Mixed precision (Miles' `--bf16` / `--fp16`) across the RL loop on flex: the embedded
//! engine serving the trainer's exported half-precision weights returns rollout log-probs
//! equal to the trainer's bit for bit (`train/train_rollout_logprob_abs_diff` = 0), and a
//! mixed-precision optimizer step keeps f32 master weights and lands close to the f32 step.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{DType, Device};
use miles_bridge::{CausalLm, Precision, score_log_probs};
use miles_core::{
    GenerateRequest, InferenceEngine, PolicyTrainer, Reward, Sample, SamplingParams, WeightVersion,
};
use miles_engine::TrainerScorer;
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_examples::fixture_path;
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, TrainConfig};

fn load(name: &str, device: &Device) -> CausalLm {
    CausalLm::from_pretrained(fixture_path(format!("models/{name}")).unwrap(), device).unwrap()
}

fn train_config(precision: Precision) -> TrainConfig {
    TrainConfig {
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(4),
        precision,
        ..TrainConfig::default()
    }
}

/// Four seeded generations of `engine` as training samples (rewards 0, 1, 0, 1).
async fn rollout(engine: &Arc<EmbeddedEngine>, vocab: u32, moe: bool) -> Vec<Sample> {
    let mut handles = Vec::new();
    for i in 0..4u32 {
        let prompt: Vec<u32> = (0..5 + i).map(|t| (t * 31 + i * 7 + 3) % vocab).collect();
        let mut req = GenerateRequest::new(
            prompt.clone(),
            SamplingParams {
                max_new_tokens: Some(6 + i as usize),
                sampling_seed: Some(u64::from(i)),
                ..SamplingParams::default()
            },
        );
        req.return_routed_experts = moe;
        let e = engine.clone();
        handles.push(tokio::spawn(async move {
            (prompt, e.generate(req).await.unwrap())
        }));
    }
    let mut samples = Vec::new();
    for (i, h) in handles.into_iter().enumerate() {
        let (prompt, out) = h.await.unwrap();
        assert_eq!(out.weight_version, WeightVersion(1));
        samples.push(Sample {
            tokens: prompt.iter().chain(&out.output_ids).copied().collect(),
            response_length: out.output_ids.len(),
            rollout_log_probs: Some(out.output_log_probs.clone()),
            reward: Some(Reward::Scalar((i % 2) as f64)),
            group_index: Some(0),
            index: Some(i as u64),
            ..Sample::default()
        });
    }
    samples
}

#[tokio::test]
async fn half_precision_engine_log_probs_equal_the_trainers_bit_for_bit() {
    for precision in [Precision::Bf16, Precision::F16] {
        for name in ["glm4moe-tiny", "qwen3-tiny"] {
            let trainer_model = load(name, &Device::flex().autodiff());
            let vocab = trainer_model.config.vocab_size as u32;
            let moe = trainer_model.config.has_moe();
            let actor = Actor::new(trainer_model.clone(), train_config(precision)).unwrap();
            // The engine starts in the precision and gets the trainer's export, written in
            // the compute dtype, as a weight update.
            let engine = EmbeddedEngine::builder(trainer_model.valid())
                .config(EngineConfig {
                    precision,
                    ..EngineConfig::default()
                })
                .scorer(Arc::new(TrainerScorer::default()))
                .build()
                .unwrap();
            assert_eq!(engine.precision(), precision);
            let weights = actor.export_weights().unwrap();
            let expected_dtype = match precision {
                Precision::Bf16 => miles_core::DType::BF16,
                _ => miles_core::DType::F16,
            };
            assert!(weights.iter().all(|(_, t)| t.dtype() == expected_dtype));
            engine
                .update_weights(&weights, WeightVersion(1))
                .await
                .unwrap();
            let engine = Arc::new(engine);
            let samples = rollout(&engine, vocab, moe).await;
            let half = trainer_model.valid().to_precision(precision);
            for (i, s) in samples.iter().enumerate() {
                let expected = score_log_probs(
                    &half,
                    &s.tokens,
                    s.response_length,
                    &Fallthrough,
                    &Default::default(),
                )
                .unwrap();
                let got: Vec<f32> = s
                    .rollout_log_probs
                    .as_ref()
                    .unwrap()
                    .iter()
                    .map(|&v| v as f32)
                    .collect();
                assert_eq!(got, expected, "{name} {precision}: sample {i}");
                // And they are not the f32 model's: the engine really computed in half.
                let f32_lp = score_log_probs(
                    &trainer_model.valid(),
                    &s.tokens,
                    s.response_length,
                    &Fallthrough,
                    &Default::default(),
                )
                .unwrap();
                assert_ne!(got, f32_lp, "{name} {precision}: sample {i}");
            }
            let mut actor = actor;
            let metrics = actor.train(0, &samples).unwrap();
            assert_eq!(
                metrics["train/train_rollout_logprob_abs_diff"], 0.0,
                "{name} {precision}"
            );
        }
    }
}

/// Every parameter's values, by name, as f64.
fn params(model: &CausalLm) -> Vec<(String, DType, Vec<f64>)> {
    let mut out = Vec::new();
    model.visit_params(&mut |name, p| {
        let data = p.to_data();
        let dtype = data.dtype();
        let values = data.convert::<f64>().try_to_vec::<f64>().unwrap();
        out.push((name.to_string(), dtype, values));
    });
    out
}

#[test]
fn mixed_precision_step_keeps_f32_masters_and_tracks_the_f32_step() {
    let device = Device::flex().autodiff();
    let model = load("qwen3-tiny", &device);
    let vocab = model.config.vocab_size as u32;
    let samples: Vec<Sample> = (0..4u32)
        .map(|i| {
            let tokens: Vec<u32> = (0..14).map(|t| (t * 37 + i * 11 + 5) % vocab).collect();
            Sample {
                tokens,
                response_length: 8,
                reward: Some(Reward::Scalar(f64::from(i % 2))),
                group_index: Some(0),
                index: Some(u64::from(i)),
                ..Sample::default()
            }
        })
        .collect();
    let before = params(&model);
    let step = |precision| {
        let mut config = train_config(precision);
        config.lr_schedule.lr = 1e-3;
        let mut actor = Actor::new(model.clone(), config).unwrap();
        actor.train(0, &samples).unwrap();
        params(actor.model())
    };
    let full = step(Precision::F32);
    let (mut dot, mut n_full, mut n_mixed) = (0.0, 0.0, 0.0);
    for precision in [Precision::Bf16, Precision::F16] {
        let mixed = step(precision);
        for (((name, dtype, b), (_, _, f)), (_, mdtype, m)) in before.iter().zip(&full).zip(&mixed)
        {
            assert_eq!(*dtype, DType::F32, "{name}");
            assert_eq!(
                *mdtype,
                DType::F32,
                "{name}: master weights stay f32 ({precision})"
            );
            for ((b, f), m) in b.iter().zip(f).zip(m) {
                let (df, dm) = (f - b, m - b);
                dot += df * dm;
                n_full += df * df;
                n_mixed += dm * dm;
            }
        }
        let cosine = dot / (n_full.sqrt() * n_mixed.sqrt());
        let ratio = (n_mixed / n_full).sqrt();
        println!("{precision}: update cosine {cosine:.4}, norm ratio {ratio:.4}");
        assert!(n_mixed > 0.0, "{precision}: the step moved the masters");
        assert!(cosine > 0.95, "{precision}: update direction {cosine}");
        assert!(
            (0.9..1.1).contains(&ratio),
            "{precision}: update size {ratio}"
        );
        (dot, n_full, n_mixed) = (0.0, 0.0, 0.0);
    }
}

/// `wgpu-cpu` (burn's wgpu runtime over Mesa lavapipe): bf16 does not exist in WGSL, so the
/// engine and the trainer refuse it with a typed error naming the device; f16 (WGSL's `f16`
/// needs the adapter's `shader-f16` feature) runs the same bitwise equality as on flex when
/// the adapter exposes it, and is refused the same way otherwise.
#[tokio::test]
async fn half_precision_on_wgpu_cpu_runs_or_is_refused() {
    const TEST: &str = "half_precision_on_wgpu_cpu_runs_or_is_refused";
    let Some(device) = miles_ops::kernels::kernel_test_device(TEST) else {
        return;
    };
    let supports = |p: Precision| device.supports_dtype(p.dtype());
    println!(
        "wgpu-cpu: bf16 {}, f16 {}",
        supports(Precision::Bf16),
        supports(Precision::F16)
    );
    assert!(!supports(Precision::Bf16), "WGSL has no bf16");
    let model = load("qwen3-tiny", &device);
    for precision in [Precision::Bf16, Precision::F16] {
        let built = EmbeddedEngine::builder(model.clone())
            .config(EngineConfig {
                precision,
                ..EngineConfig::default()
            })
            .scorer(Arc::new(TrainerScorer::default()))
            .build();
        if !supports(precision) {
            let err = built.unwrap_err().to_string();
            assert!(err.contains("does not support"), "{precision}: {err}");
            let trainer = load("qwen3-tiny", &device.clone().autodiff());
            let err = Actor::new(trainer, train_config(precision))
                .unwrap_err()
                .to_string();
            assert!(err.contains("does not support"), "{precision}: {err}");
            continue;
        }
        let engine = built.unwrap();
        let prompt: Vec<u32> = (0..6).map(|t| (t * 31 + 3) % 512).collect();
        let out = engine
            .generate(GenerateRequest::new(
                prompt.clone(),
                SamplingParams {
                    max_new_tokens: Some(5),
                    sampling_seed: Some(1),
                    ..SamplingParams::default()
                },
            ))
            .await
            .unwrap();
        let tokens: Vec<u32> = prompt.iter().chain(&out.output_ids).copied().collect();
        let expected = score_log_probs(
            &model.clone().to_precision(precision),
            &tokens,
            out.output_ids.len(),
            &Fallthrough,
            &Default::default(),
        )
        .unwrap();
        let got: Vec<f32> = out.output_log_probs.iter().map(|&v| v as f32).collect();
        assert_eq!(got, expected, "{precision} on wgpu-cpu");
    }
}
