//! Trains the glm4moe-tiny fixture (a real HF GLM-4-MoE checkpoint) on a fixed batch and
//! prints the loss per step: first SFT (the loss falls), then GRPO (rewarded responses gain
//! log-probability).
//!
//! `cargo run --release -p miles-train --example train_fixture [-- MODEL_DIR]`

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::{PolicyTrainer, Reward, Sample};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, LossType, LrSchedule, TrainConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny"),
        PathBuf::from,
    );
    let device = Device::flex().autodiff();
    let mk = |prompt: &[u32], response: &[u32], reward: f64, group: u64| Sample {
        tokens: prompt.iter().chain(response).copied().collect(),
        response_length: response.len(),
        reward: Some(Reward::Scalar(reward)),
        group_index: Some(group),
        ..Sample::default()
    };
    let batch = vec![
        mk(&[5, 17, 42, 9], &[100, 101, 102, 103, 104], 1.0, 0),
        mk(&[5, 17, 42, 9], &[200, 201, 202], 0.0, 0),
        mk(&[7, 8], &[300, 301, 302, 303, 304, 305], 1.0, 1),
        mk(&[7, 8], &[400, 401], 0.0, 1),
    ];
    let config = TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-2,
            ..LrSchedule::default()
        },
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(2),
        ..TrainConfig::default()
    };

    let model = CausalLm::from_pretrained(&dir, &device)?;
    println!("{} ({} parameters)", dir.display(), model.num_params());
    let mut sft = Actor::new(
        model,
        TrainConfig {
            loss_type: LossType::SftLoss,
            ..config.clone()
        },
    )?;
    for step in 0..8 {
        let m = sft.train(step, &batch)?;
        println!(
            "sft  step {step}: loss {:.4}  grad_norm {:.3}",
            m["train/loss"], m["train/grad_norm"]
        );
    }

    let mean_lp = |m: &CausalLm, s: &Sample| -> Result<f64, miles_train::Error> {
        let lp = score_log_probs(
            m,
            &s.tokens,
            s.response_length,
            &Fallthrough,
            &Default::default(),
        )?;
        Ok(lp.iter().map(|&v| f64::from(v)).sum::<f64>() / lp.len() as f64)
    };
    let mut grpo = Actor::new(CausalLm::from_pretrained(&dir, &device)?, config)?;
    let before: Vec<f64> = batch
        .iter()
        .map(|s| mean_lp(&grpo.model().valid(), s))
        .collect::<Result<_, _>>()?;
    for step in 0..4 {
        let m = grpo.train(step, &batch)?;
        println!(
            "grpo step {step}: pg_loss {:+.4}  ppo_kl {:+.2e}  clipfrac {:.3}  grad_norm {:.3}",
            m["train/pg_loss"], m["train/ppo_kl"], m["train/pg_clipfrac"], m["train/grad_norm"]
        );
    }
    for (s, b) in batch.iter().zip(before) {
        let a = mean_lp(&grpo.model().valid(), s)?;
        println!(
            "reward {:.0}: mean log-prob {b:+.4} -> {a:+.4}",
            s.scalar_reward(None).unwrap_or_default()
        );
    }
    Ok(())
}
