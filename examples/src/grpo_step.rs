//! One synchronous GRPO step, end to end, on one device: embedded-engine rollout (greedy,
//! routed experts recorded, log-probs recomputed with the trainer's scoring function), the
//! trainer's own scoring of the same samples, one [`Actor`] step with rollout routing replay
//! (R3) and TIS, and the in-place weight update of the engine with the new version.
//!
//! The integration test that compares this step on flex and on `wgpu-cpu`
//! (`tests/it/wgpu_step.rs`) and the `wgpu_step` bench share it.

use std::sync::Arc;

use burn::module::Module;
use miles_bridge::{CausalLm, score_log_probs};
use miles_core::{
    GenerateOutput, GenerateRequest, InferenceEngine, Metrics, NamedTensors, PolicyTrainer, Reward,
    Sample, SamplingParams, WeightVersion,
};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_ops::AdvantageConfig;
use miles_r3::Fallthrough;
use miles_train::{Actor, BatchLayout, LrSchedule, TrainConfig};

use crate::Error;
use miles_engine::TrainerScorer;

/// What one step rolls out and how it trains.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// One greedy request per prompt; all of them form one GRPO group.
    pub prompts: Vec<Vec<u32>>,
    /// Response length limit of every request.
    pub max_new_tokens: usize,
    /// The trainer's settings.
    pub train: TrainConfig,
}

impl StepPlan {
    /// `n` prompts of `prompt_len` tokens below `vocab` (a fixed formula, different for every
    /// prompt), `max_new_tokens` each, trained with [`grpo_train_config`].
    pub fn new(vocab: usize, n: usize, prompt_len: usize, max_new_tokens: usize) -> Self {
        let vocab = vocab.max(1);
        let prompts = (0..n)
            .map(|i| {
                (0..prompt_len)
                    .map(|t| ((t * 31 + i * 7 + 3) % vocab) as u32)
                    .collect()
            })
            .collect();
        Self {
            prompts,
            max_new_tokens,
            train: grpo_train_config(n),
        }
    }
}

/// GRPO over one group of `n` samples: TIS on (clip 2), rollout routing replay on, AdamW at
/// learning rate 1e-3 without warm-up (large enough that the update shows in every weight),
/// the whole batch as one padded micro-batch and one optimizer step.
pub fn grpo_train_config(n: usize) -> TrainConfig {
    let mut config = TrainConfig {
        lr_schedule: LrSchedule {
            lr: 1e-3,
            lr_warmup_iters: 0,
            ..LrSchedule::default()
        },
        advantage: AdvantageConfig::default().with_n_samples_per_prompt(n.max(1)),
        micro_batch_size: n.max(1),
        layout: BatchLayout::Padded,
        use_routing_replay: true,
        ..TrainConfig::default()
    };
    config.policy_loss.use_tis = true;
    config.policy_loss.tis_clip = 2.0;
    config
}

/// The reward of sample `i`: alternately 1 and 0, so the group's advantages are not all zero
/// and the step has a gradient whatever the tokens are.
pub fn reward_of(i: usize) -> f64 {
    if i.is_multiple_of(2) { 1.0 } else { 0.0 }
}

/// An embedded engine over `model` (an inference copy on any device) that recomputes rollout
/// log-probs with the trainer's scoring function, for up to `max_running` sequences at once.
pub fn step_engine(model: CausalLm, max_running: usize) -> Result<Arc<EmbeddedEngine>, Error> {
    let engine = EmbeddedEngine::builder(model)
        .config(EngineConfig {
            max_running_requests: max_running.max(1),
            ..EngineConfig::default()
        })
        .scorer(Arc::new(TrainerScorer::default()))
        .build()?;
    Ok(Arc::new(engine))
}

/// Greedy generation of every prompt of `plan` at once on `engine`, routed experts recorded
/// when `moe`; returns the outputs in prompt order.
pub async fn generate_all(
    engine: &Arc<EmbeddedEngine>,
    plan: &StepPlan,
    moe: bool,
) -> Result<Vec<GenerateOutput>, Error> {
    let mut handles = Vec::with_capacity(plan.prompts.len());
    for prompt in &plan.prompts {
        let mut request = GenerateRequest::new(
            prompt.clone(),
            SamplingParams {
                temperature: 0.0,
                max_new_tokens: Some(plan.max_new_tokens),
                ..SamplingParams::default()
            },
        );
        request.return_routed_experts = moe;
        let engine = Arc::clone(engine);
        handles.push(tokio::spawn(async move { engine.generate(request).await }));
    }
    let mut outputs = Vec::with_capacity(handles.len());
    for handle in handles {
        let output = handle.await.map_err(|e| Error::Invalid {
            what: "generation task",
            reason: e.to_string(),
        })??;
        outputs.push(output);
    }
    Ok(outputs)
}

/// The GRPO samples of `outputs` (prompt `i` of `plan` → output `i`): one group, rewards
/// [`reward_of`], rollout log-probs and routed experts as the engine returned them.
pub fn samples_of(plan: &StepPlan, outputs: &[GenerateOutput]) -> Vec<Sample> {
    plan.prompts
        .iter()
        .zip(outputs)
        .enumerate()
        .map(|(i, (prompt, out))| Sample {
            tokens: prompt.iter().chain(&out.output_ids).copied().collect(),
            response_length: out.output_ids.len(),
            rollout_log_probs: Some(out.output_log_probs.clone()),
            rollout_routed_experts: out.routed_experts.clone(),
            reward: Some(Reward::Scalar(reward_of(i))),
            group_index: Some(0),
            index: Some(i as u64),
            ..Sample::default()
        })
        .collect()
}

/// Everything one step produced.
#[derive(Debug)]
pub struct StepOutcome {
    /// The engine's outputs at weight version 0, in prompt order.
    pub outputs: Vec<GenerateOutput>,
    /// The trainer's scoring ([`score_log_probs`], the model's own routing) of each sample's
    /// response before the step.
    pub trainer_log_probs: Vec<Vec<f32>>,
    /// The trainer's metrics of the step.
    pub metrics: Metrics,
    /// The weights before the step (HF names, f32).
    pub weights_before: NamedTensors,
    /// The weights after the step, as pushed to the engine.
    pub weights_after: NamedTensors,
    /// The engine's version after the update.
    pub engine_version: WeightVersion,
    /// The first prompt generated again on the updated engine.
    pub after_update: GenerateOutput,
}

/// One synchronous GRPO step of `plan` for `model` (on an autodiff device): rollout on an
/// embedded engine holding an inference copy, trainer scoring, one [`Actor::train`], export,
/// `update_weights` of the engine to the actor's new version, one more generation.
pub async fn synchronous_grpo_step(model: CausalLm, plan: &StepPlan) -> Result<StepOutcome, Error> {
    let moe = model.config.has_moe();
    let engine = step_engine(model.valid(), plan.prompts.len())?;
    let outputs = generate_all(&engine, plan, moe).await?;
    let samples = samples_of(plan, &outputs);
    let scorer = model.valid();
    let trainer_log_probs = samples
        .iter()
        .map(|s| {
            score_log_probs(
                &scorer,
                &s.tokens,
                s.response_length,
                &Fallthrough,
                &plan.train.fused,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut actor = Actor::new(model, plan.train.clone())?;
    let weights_before = actor.export_weights()?;
    let metrics = actor.train(0, &samples)?;
    let weights_after = actor.export_weights()?;
    engine
        .update_weights(&weights_after, actor.weight_version())
        .await?;
    let engine_version = engine.weight_version().await?;
    let first = StepPlan {
        prompts: plan.prompts[..1].to_vec(),
        ..plan.clone()
    };
    let after_update = generate_all(&engine, &first, moe)
        .await?
        .pop()
        .ok_or_else(|| Error::Invalid {
            what: "generation",
            reason: "no output after the update".into(),
        })?;
    engine.shutdown();
    Ok(StepOutcome {
        outputs,
        trainer_log_probs,
        metrics,
        weights_before,
        weights_after,
        engine_version,
        after_update,
    })
}
