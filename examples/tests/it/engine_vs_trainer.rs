//! The embedded engine with `recompute_logprobs_via_prefill` and the trainer's scoring function
//! returns rollout log-probs equal to miles-train's bit for bit, on the dense and the MoE
//! fixture: the trainer then reports `train/train_rollout_logprob_abs_diff` = 0 on the
//! engine's own samples. The fault-injection test of the RL loop on the embedded engine and
//! the real trainer (`fleet/fault_injection.rs`) is built into this test binary too, to link
//! one binary fewer.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::{
    GenerateRequest, InferenceEngine, PolicyTrainer, Reward, Sample, SamplingParams, WeightVersion,
};
use miles_engine::TrainerScorer;
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_examples::fixture_path;
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, TrainConfig};

#[path = "fleet/fault_injection.rs"]
mod fault_injection;

fn load(name: &str, device: &Device) -> CausalLm {
    CausalLm::from_pretrained(fixture_path(format!("models/{name}")).unwrap(), device).unwrap()
}

#[tokio::test]
async fn engine_log_probs_equal_the_trainers_bit_for_bit() {
    for name in ["glm4moe-tiny", "qwen3-tiny"] {
        let trainer_model = load(name, &Device::flex().autodiff());
        let engine = EmbeddedEngine::builder(trainer_model.valid())
            .config(EngineConfig::default())
            .scorer(Arc::new(TrainerScorer::default()))
            .build()
            .unwrap();
        let engine = Arc::new(engine);
        let vocab = trainer_model.config.vocab_size as u32;
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
            req.return_routed_experts = trainer_model.config.has_moe();
            let e = engine.clone();
            handles.push(tokio::spawn(async move {
                (prompt, e.generate(req).await.unwrap())
            }));
        }
        let mut samples = Vec::new();
        for (i, h) in handles.into_iter().enumerate() {
            let (prompt, out) = h.await.unwrap();
            let tokens: Vec<u32> = prompt.iter().chain(&out.output_ids).copied().collect();
            let expected = score_log_probs(
                &trainer_model.valid(),
                &tokens,
                out.output_ids.len(),
                &Fallthrough,
                &Default::default(),
            )
            .unwrap();
            let got: Vec<f32> = out.output_log_probs.iter().map(|&v| v as f32).collect();
            assert_eq!(got, expected, "{name}: sample {i}");
            assert_eq!(out.weight_version, WeightVersion(0));
            samples.push(Sample {
                tokens,
                response_length: out.output_ids.len(),
                rollout_log_probs: Some(out.output_log_probs.clone()),
                reward: Some(Reward::Scalar((i % 2) as f64)),
                group_index: Some(0),
                index: Some(i as u64),
                ..Sample::default()
            });
        }
        let mut actor = Actor::new(
            trainer_model,
            TrainConfig {
                advantage: AdvantageConfig::default().with_n_samples_per_prompt(4),
                ..TrainConfig::default()
            },
        )
        .unwrap();
        let metrics = actor.train(0, &samples).unwrap();
        assert_eq!(
            metrics["train/train_rollout_logprob_abs_diff"], 0.0,
            "{name}"
        );
    }
}
