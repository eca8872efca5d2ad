//! A small GRPO run on the addition task, assembled from the crates directly rather than
//! through the reference binary: the model directory, embedded engines (each on a rayon pool
//! of its own when asked), the rollout manager, the GRPO actor and the data. The
//! fault-injection test and the overlap benchmark use it, because they need the embedded
//! engine and the real trainer under their own control (killing an engine, pinning cores).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use miles_bridge::CausalLm;
use miles_core::{InferenceEngine, SamplingParams};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_ops::{AdvantageConfig, AdvantageEstimator};
use miles_rollout::{ChatPromptEncoder, DataSource, RolloutConfig, RolloutManager};
use miles_train::{Actor, BatchLayout, TrainConfig};

use crate::Error;
use crate::addition::{AdditionProblem, AdditionReward, AdditionSplit, AdditionTask};
use crate::toy::{ToyModelSpec, write_model_dir};
use crate::wiring::embedded_engine_with;

/// The shared pieces of a small addition-GRPO run (see the module docs).
pub struct AdditionRl {
    /// The HF model directory (built by [`AdditionRl::build`] when it has no `config.json`).
    pub model_dir: PathBuf,
    /// The policy, on the flex autodiff device.
    pub model: CausalLm,
    /// Chat-template prompt encoder of the model directory (thinking off).
    pub encoder: Arc<ChatPromptEncoder>,
    /// End-of-sequence ids of the model directory.
    pub eos_ids: Vec<u32>,
    /// Training and held-out addition problems.
    pub split: AdditionSplit,
    /// Seed of the model, the data and sampling.
    pub seed: u64,
}

impl AdditionRl {
    /// Builds (or reuses) a GLM-4-MoE of `spec` in `dir` and draws `num_train` training
    /// problems (1–2 digit addends) and 16 held-out ones.
    pub fn build(
        dir: &Path,
        spec: &ToyModelSpec,
        seed: u64,
        num_train: usize,
    ) -> Result<Self, Error> {
        let device = Device::flex();
        if !dir.join("config.json").exists() {
            write_model_dir(dir, spec, seed, &device)?;
        }
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), serde_json::Value::Bool(false));
        let encoder = Arc::new(ChatPromptEncoder::load(dir)?.with_kwargs(kwargs));
        let eos_ids = miles_engine::read_eos_ids(dir);
        let model = CausalLm::from_pretrained(dir, &device.autodiff())?;
        let split = AdditionTask {
            min_digits: 1,
            max_digits: 2,
            seed,
        }
        .split(num_train, 16)?;
        Ok(Self {
            model_dir: dir.to_path_buf(),
            model,
            encoder,
            eos_ids,
            split,
            seed,
        })
    }

    /// An embedded engine on the current model: up to `max_running_requests` sequences per
    /// decode step, on `compute_threads` threads of its own (`None`: as many as the global pool).
    pub fn engine(
        &self,
        max_running_requests: usize,
        compute_threads: Option<usize>,
    ) -> Result<Arc<EmbeddedEngine>, Error> {
        let config = EngineConfig {
            max_running_requests,
            eos_token_ids: self.eos_ids.clone(),
            seed: self.seed,
            compute_threads,
            ..EngineConfig::default()
        };
        embedded_engine_with(self.model.valid(), &self.model_dir, config)
    }

    /// `batch` prompts × `n` samples per step, up to `max_response` tokens at T = 1, routed
    /// experts recorded (R3), seeded.
    pub fn rollout_config(&self, n: usize, batch: usize, max_response: usize) -> RolloutConfig {
        RolloutConfig {
            n_samples_per_prompt: n,
            rollout_batch_size: batch,
            max_concurrency: 256,
            sampling: SamplingParams {
                temperature: 1.0,
                stop_token_ids: self.eos_ids.clone(),
                ..SamplingParams::default()
            },
            rollout_max_response_len: max_response,
            rollout_seed: Some(self.seed),
            return_routed_experts: self.model.config.has_moe(),
            ..RolloutConfig::default()
        }
    }

    /// A rollout manager over `engine` with the addition reward (partial credit).
    pub fn manager(
        &self,
        engine: Arc<dyn InferenceEngine>,
        config: RolloutConfig,
    ) -> Result<Arc<RolloutManager>, Error> {
        Ok(Arc::new(RolloutManager::new(
            config,
            engine,
            self.encoder.clone(),
            Arc::new(AdditionReward {
                partial_credit: true,
            }),
        )?))
    }

    /// The GRPO configuration of the reference binary: groups of `n`, TIS, R3 on MoE models,
    /// padded micro-batches of `micro_batch_size`.
    pub fn train_config(&self, n: usize, micro_batch_size: usize) -> TrainConfig {
        let use_r3 = self.model.config.has_moe();
        let mut config = TrainConfig {
            advantage: AdvantageConfig {
                advantage_estimator: AdvantageEstimator::Grpo,
                ..AdvantageConfig::default()
            }
            .with_n_samples_per_prompt(n),
            micro_batch_size,
            layout: BatchLayout::Padded,
            use_routing_replay: use_r3,
            ..TrainConfig::default()
        };
        config.policy_loss.use_tis = true;
        config
    }

    /// A GRPO actor on the model with [`AdditionRl::train_config`].
    pub fn actor(&self, n: usize, micro_batch_size: usize) -> Result<Actor, Error> {
        self.actor_with(self.train_config(n, micro_batch_size))
    }

    /// A GRPO actor on the model with `config`.
    pub fn actor_with(&self, config: TrainConfig) -> Result<Actor, Error> {
        Ok(Actor::new(self.model.clone(), config)?)
    }

    /// The training prompts, shuffled with the seed, `n` samples each.
    pub fn data(&self, n: usize) -> Result<DataSource, Error> {
        let prompts = self
            .split
            .train
            .iter()
            .map(AdditionProblem::prompt_record)
            .collect();
        Ok(DataSource::new(prompts, n, true, self.seed)?)
    }
}
