//! The actor: [`PolicyTrainer`] on a miles-bridge model.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Int;
use burn::tensor::{Device, Tensor};
use miles_bridge::{
    CausalLm, RecomputeConfig, RecomputeGranularity, RecomputedForward, score_log_probs,
};
use miles_core::{DType, Metrics, MetricsSink, NamedTensors, PolicyTrainer, Sample, WeightVersion};
use miles_ops::shaping_kl;
use miles_ops::{AdvantageCalculator, AdvantageSample, Grouping, whiten_advantages};
use miles_ops::{PolicyLoss, PolicyLossInput};
use miles_r3::{
    Fallthrough, FlipStats, MoeLayerInfo, MoeModel, R3Error, ReplayStage, RouterHook, RoutingReplay,
};

use crate::batch::{
    BatchLayout, TrainItem, has_siblings, pad_rows, plan_rollout_steps, plan_steps,
    rollout_mask_sums, rollouts_of, step_normalizer,
};
use crate::checkpoint;
use crate::config::{LossType, TrainConfig};
use crate::critic::Critic;
use crate::opd;
use crate::optim::{AdamW, GradAccumulator, ModelSlot};
use crate::scoring::{HookFn, sample_error, score_batch, score_batch_with};
use crate::{Error, LrSchedule, Result};

/// Per-sample advantages and returns over the response tokens, and the OPD reverse KL (with
/// `use_opd`).
type AdvantagesAndReturns = (Vec<Vec<f32>>, Vec<Vec<f32>>, Option<Vec<Vec<f32>>>);

/// Where a [`Actor::train_items`] call takes the old-policy log-probs of its policy loss from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OldLogProbs {
    /// Not needed (SFT loss).
    Zeros,
    /// A forward pass of its own over every sample before training (the general case).
    Forward,
    /// The rollout's log-probs (`use_rollout_logprobs` without mismatch metrics).
    Rollout,
    /// The training forward's own log-probs, detached (one optimizer step on the trainer's
    /// weights: they are the old policy's).
    TrainingForward,
}

/// Seconds spent in each phase of the optimizer steps of one call.
#[derive(Debug, Clone, Copy, Default)]
struct PhaseTimes {
    forward: f64,
    backward: f64,
    optimizer: f64,
}

/// What one optimizer step reported.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// Optimizer step (1-based, over the actor's lifetime).
    pub step: u64,
    /// `train/…` metrics of the step.
    pub metrics: Metrics,
}

/// The policy trainer: a miles-bridge model on an autodiff device, AdamW, the configured loss
/// and advantage estimator, and an optional frozen reference model.
///
/// # Old-policy log-probs
///
/// The policy loss compares the trained log-probs with the old policy's (the weights before a
/// [`Actor::train_items`] call). They come from, first match wins (Miles' rules, its
/// `--use-rollout-logprobs` and `--skip-actor-forward-only`, the latter taken whenever it
/// applies):
///
/// 1. **A forward of their own** over every sample before training (per sample, batch-invariant,
///    the function the embedded engine re-scores with) when a metric or correction compares
///    them with the rollout's (`get_mismatch_metrics`, `use_tis`; then
///    `train/train_rollout_logprob_abs_diff` is that forward against the rollout) or KL reward
///    shaping (`kl_coef ≠ 0`) or on-policy distillation's sampled-token reverse KL (`use_opd`
///    without a precomputed top-k KL) needs them before training.
/// 2. **The rollout's** with `use_rollout_logprobs` (every sample carrying them): no forward;
///    `train_rollout_logprob_abs_diff` and `train_rollout_kl` are then 0, as in Miles.
/// 3. **The training forward's own, detached**, when the call takes one optimizer step: the
///    weights of that forward are the old policy's, so no second forward is needed (TRL's
///    `GRPOTrainer` does the same). The importance ratio is exactly 1, `ppo_kl` and
///    `pg_clipfrac` exactly 0, and `train_rollout_logprob_abs_diff` compares the training
///    forward with the rollout: with the default [`BatchLayout::PerSample`] the training
///    forward is the engine's scoring function, so against an embedded engine's re-scored
///    log-probs it stays 0 bit for bit on flex (whose autodiff and inference forwards agree
///    bit for bit; tested); with `padded` / `packed` / `shared_prefix` it shows their float
///    rounding.
/// 4. Otherwise (several optimizer steps per call): a forward of their own, as in 1.
///
/// `perf/log_probs_time` is that forward's time (0 when skipped); `perf/actor_forward_time`,
/// `perf/actor_backward_time` and `perf/optimizer_time` split the optimizer steps.
pub struct Actor {
    config: TrainConfig,
    model: ModelSlot<CausalLm>,
    reference: Option<CausalLm>,
    teacher: Option<CausalLm>,
    critic: Option<Critic>,
    moe: Option<MoeModel>,
    optimizer: AdamW,
    schedule: LrSchedule,
    loss: PolicyLoss,
    advantages: AdvantageCalculator,
    version: WeightVersion,
    rollouts_trained: u64,
    sink: Option<Arc<dyn MetricsSink>>,
    history: Vec<StepReport>,
}

impl std::fmt::Debug for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Actor")
            .field("architecture", &self.model.config.architecture)
            .field("step", &self.optimizer.step_count())
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// A shared [`RoutingReplay`] handed to the model as its router hook, so its flip statistics
/// can be read after the forward.
struct SharedReplay(Arc<RoutingReplay>);

impl RouterHook for SharedReplay {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        selection_scores: Tensor<2>,
    ) -> std::result::Result<Tensor<2, Int>, R3Error> {
        self.0.select_experts(layer, selection_scores)
    }
}

/// The replay of one forward pass over `items` in `layout`: every sample's
/// `rollout_routed_experts` mapped onto the batch and the model's MoE layers, in
/// `replay_forward` stage.
fn replay_for(
    moe: &MoeModel,
    items: &[&TrainItem],
    layout: BatchLayout,
) -> Result<Arc<RoutingReplay>> {
    let samples: Vec<Sample> = items
        .iter()
        .map(|i| Sample {
            tokens: i.tokens.clone(),
            response_length: i.response_length,
            rollout_routed_experts: i.routed_experts.clone(),
            ..Sample::default()
        })
        .collect();
    let n = samples.len();
    let r3_layout = match layout {
        BatchLayout::Packed => miles_r3::BatchLayout::packed(
            vec![(0..n).collect()],
            items.iter().map(|i| i.len()).sum(),
        ),
        BatchLayout::PerSample | BatchLayout::Padded => {
            miles_r3::BatchLayout::padded(n, items.iter().map(|i| i.len()).max().unwrap_or(0))
        }
        // Refused by `TrainConfig::validate`: a shared prompt has one route per token, the
        // rollout recorded one per sample.
        BatchLayout::SharedPrefix => {
            return Err(crate::config::shared_prefix_with_routing_replay());
        }
    };
    let replay = RoutingReplay::new(moe.clone());
    replay.push_samples(&samples, &r3_layout)?;
    replay.set_stage(ReplayStage::ReplayForward)?;
    Ok(Arc::new(replay))
}

/// The router hook of one forward pass over `items` (in `layout`): fallthrough routing, or
/// the rollout's routing when `use_routing_replay` is on and the model has MoE layers.
fn hook_for(
    config: &TrainConfig,
    moe: Option<&MoeModel>,
    items: &[&TrainItem],
    layout: BatchLayout,
) -> Result<Box<dyn RouterHook>> {
    match moe {
        Some(moe) if config.use_routing_replay => {
            Ok(Box::new(SharedReplay(replay_for(moe, items, layout)?)))
        }
        _ => Ok(Box::new(Fallthrough)),
    }
}

/// Checks `--recompute-*` against `model` (Megatron's rules, see [`RecomputeConfig`]); with
/// `selective`, that every attention core is the fused op, whose backward recomputes the
/// probabilities from the forward's log-sum-exp instead of keeping them.
fn check_recompute(config: &RecomputeConfig, model: &CausalLm) -> Result<()> {
    config.validate(model.config.num_hidden_layers)?;
    if config.granularity != Some(RecomputeGranularity::Selective) {
        return Ok(());
    }
    let bad = |reason| {
        Err(Error::Config {
            field: "recompute_granularity",
            value: "selective".into(),
            reason,
        })
    };
    if !miles_ops::runs_fused(&model.lm_head_weight().device()) {
        return bad(
            "selective recomputation is the fused attention op's, which does not run on this \
             device or with MILES_FUSED_OPS=0: use --recompute-granularity full",
        );
    }
    if model.config.architecture.spec().attention_sinks {
        return bad(
            "attention with sinks (GPT-OSS) is computed with tensor ops that keep the \
             probabilities: use --recompute-granularity full",
        );
    }
    Ok(())
}

impl Actor {
    /// Builds the actor. `model` must live on an autodiff device (`Device::flex().autodiff()`);
    /// the reference model (when the config needs one) is a frozen copy of it.
    ///
    /// With `lora_rank > 0` the adapters are attached here (fresh, or read from
    /// `lora_adapter_path`) and every base weight is frozen; the reference model is then the
    /// base model **without** adapters — equal to the initial policy, since fresh adapters
    /// start with `B = 0`. A `model` that already carries adapters is trained as it is.
    pub fn new(model: CausalLm, config: TrainConfig) -> Result<Self> {
        config.validate()?;
        if !model.lm_head_weight().is_autodiff() {
            return Err(Error::Config {
                field: "device",
                value: format!("{:?}", model.lm_head_weight().device()),
                reason: "the actor's model must live on an autodiff device (Device::autodiff())",
            });
        }
        if model.precision() != Some(miles_bridge::Precision::F32) {
            return Err(Error::Config {
                field: "precision",
                value: format!("{:?}", model.lm_head_weight().dtype()),
                reason: "the actor's parameters are its f32 master weights: load the model in                          f32 and set TrainConfig::precision (--bf16 / --fp16) for the compute                          dtype",
            });
        }
        config
            .precision
            .check_device(&model.lm_head_weight().device())?;
        check_recompute(&config.recompute, &model)?;
        if config.layout == BatchLayout::SharedPrefix && model.config.linear_attention.is_some() {
            return Err(Error::Config {
                field: "batch_layout",
                value: "shared_prefix".into(),
                reason: "the model has linear-attention layers (Gated DeltaNet), whose recurrent \
                         state runs along the row through every response: a prompt cannot be \
                         shared; use padded or packed",
            });
        }
        if config
            .recompute
            .plan(model.config.num_hidden_layers)
            .is_some()
        {
            crate::optim::keep_gradient_buffers(model.num_params());
        }
        let reference = config.needs_ref().then(|| model.valid());
        let model = match config.lora_config() {
            Some(_) if model.lora_config().is_some() => {
                return Err(Error::Config {
                    field: "lora_rank",
                    value: config.lora_rank.to_string(),
                    reason: "the model already carries LoRA adapters; set lora_rank = 0 to \
                             train them as they are",
                });
            }
            Some(lora) => match &config.lora_adapter_path {
                Some(path) => {
                    let model = model.load_lora_adapter(path, config.lora_forward)?;
                    let r = model.lora_config().map_or(0, |c| c.r);
                    if r != config.lora_rank {
                        return Err(Error::Config {
                            field: "lora_rank",
                            value: config.lora_rank.to_string(),
                            reason: "differs from the rank of lora_adapter_path's adapter",
                        });
                    }
                    model
                }
                None => model.with_lora(&lora)?,
            },
            None => model,
        };
        let moe = model.config.moe_model()?;
        Ok(Self {
            optimizer: AdamW::new(config.optimizer),
            schedule: config.lr_schedule.validate()?,
            loss: config.policy_loss.clone().init()?,
            advantages: config.advantage.clone().init()?,
            config,
            model: ModelSlot::new(model),
            reference,
            teacher: None,
            critic: None,
            moe,
            version: WeightVersion(0),
            rollouts_trained: 0,
            sink: None,
            history: Vec::new(),
        })
    }

    /// Also sends every step's metrics to `sink`.
    pub fn with_metrics_sink(mut self, sink: Arc<dyn MetricsSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Adds the critic `ppo` needs, initialised from `lm` (an autodiff-device copy of the
    /// starting checkpoint).
    pub fn with_critic(mut self, lm: CausalLm) -> Result<Self> {
        self.critic = Some(Critic::new(lm, &self.config)?);
        Ok(self)
    }

    /// The critic, if any.
    pub fn critic(&self) -> Option<&Critic> {
        self.critic.as_ref()
    }

    /// The current model (autodiff device).
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The configuration.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Reports of every optimizer step so far.
    pub fn history(&self) -> &[StepReport] {
        &self.history
    }

    fn device(&self) -> Device {
        self.model.lm_head_weight().device()
    }

    /// Trains on already converted items (see [`TrainItem::from_sample`]). Returns the mean of
    /// every step's metrics plus `perf/…` figures.
    ///
    /// Items sharing a rollout id (per-turn siblings, Miles' `--generate-multi-samples`) are
    /// trained as one rollout each: siblings are moved next to each other, a step takes whole
    /// rollouts (`global_batch_size` counts rollouts), every sibling's loss is divided by its
    /// rollout's loss-mask total (Miles' `rollout_mask_sums`) and a step's loss by its number
    /// of rollouts, so each rollout contributes one token-weighted mean.
    pub fn train_items(&mut self, items: &[TrainItem]) -> Result<Metrics> {
        let started = Instant::now();
        let siblings = has_siblings(items);
        let regrouped: Vec<TrainItem>;
        let items = if siblings {
            regrouped = rollouts_of(items)
                .into_iter()
                .flatten()
                .map(|i| items[i].clone())
                .collect();
            &regrouped[..]
        } else {
            items
        };
        let mask_sums = (siblings && self.config.loss_type == LossType::PolicyLoss)
            .then(|| rollout_mask_sums(items));
        let n = items.len();
        let mut out = Metrics::new();
        if n == 0 {
            return Ok(out);
        }
        let fused = self.config.fused;
        let policy = self.config.loss_type == LossType::PolicyLoss;

        let steps = if siblings {
            plan_rollout_steps(
                items,
                self.config.global_batch_size,
                self.config.num_steps_per_rollout,
            )?
        } else {
            plan_steps(
                n,
                self.config.global_batch_size,
                self.config.num_steps_per_rollout,
            )
        };
        let old_source = if policy {
            self.old_log_prob_source(items, steps.len())
        } else {
            OldLogProbs::Zeros
        };

        // Old (trainer-scored) and reference log-probs, with the weights before this call, in
        // the compute precision (the engine's recompute scores the same way).
        let precision = self.config.precision;
        let reference = self
            .reference
            .as_ref()
            .filter(|_| policy)
            .map(|r| r.clone().to_precision(precision));
        let teacher = self
            .teacher
            .as_ref()
            .filter(|_| policy)
            .map(|t| t.clone().to_precision(precision));
        let mut old = Vec::with_capacity(n);
        let mut refs = Vec::new();
        let mut teacher_lps = Vec::new();
        let mut flips = FlipStats::new();
        let old_started = Instant::now();
        match old_source {
            OldLogProbs::Zeros | OldLogProbs::TrainingForward => {
                old.extend(items.iter().map(|i| vec![0.0; i.response_length]));
            }
            OldLogProbs::Rollout => old.extend(
                items
                    .iter()
                    .map(|i| i.rollout_log_probs.clone().unwrap_or_default()),
            ),
            OldLogProbs::Forward => {
                let scorer = self.model.valid().to_precision(precision);
                for (index, item) in items.iter().enumerate() {
                    let replay = match &self.moe {
                        Some(moe) if self.config.use_routing_replay => {
                            let replay = replay_for(moe, &[item], BatchLayout::PerSample)?;
                            replay.set_compare(true)?;
                            Some(replay)
                        }
                        _ => None,
                    };
                    let hook: Box<dyn RouterHook> = match &replay {
                        Some(r) => Box::new(SharedReplay(Arc::clone(r))),
                        None => Box::new(Fallthrough),
                    };
                    old.push(
                        score_log_probs(
                            &scorer,
                            &item.tokens,
                            item.response_length,
                            &*hook,
                            &fused,
                        )
                        .map_err(|e| sample_error(index, e))?,
                    );
                    if let Some(replay) = &replay {
                        flips.merge(&replay.take_flip_stats()?);
                    }
                }
            }
        }
        let old_secs = old_started.elapsed().as_secs_f64();
        let ref_started = Instant::now();
        if let Some(reference) = &reference {
            for (index, item) in items.iter().enumerate() {
                // The reference policy routes on its own (Miles: fallthrough stage).
                refs.push(
                    score_log_probs(
                        reference,
                        &item.tokens,
                        item.response_length,
                        &Fallthrough,
                        &fused,
                    )
                    .map_err(|e| sample_error(index, e))?,
                );
            }
        }
        if let Some(teacher) = &teacher {
            for (index, item) in items.iter().enumerate() {
                // OPD's local teacher (Miles' `--opd-type megatron`) routes on its own.
                teacher_lps.push(
                    score_log_probs(
                        teacher,
                        &item.tokens,
                        item.response_length,
                        &Fallthrough,
                        &fused,
                    )
                    .map_err(|e| sample_error(index, e))?,
                );
            }
        }
        let ref_secs = ref_started.elapsed().as_secs_f64();

        // Critic values (ppo), then rewards → advantages, as Miles' actor computes them.
        let config = &self.config;
        let moe = self.moe.as_ref();
        let item_hook = |item: &TrainItem| hook_for(config, moe, &[item], BatchLayout::PerSample);
        let values = match &self.critic {
            Some(critic) if policy && config.needs_critic() => {
                Some(critic.values(items, &item_hook)?)
            }
            None if policy && config.needs_critic() => {
                return Err(Error::Config {
                    field: "advantage_estimator",
                    value: "ppo".into(),
                    reason: "ppo needs a critic: build the actor with Actor::with_critic",
                });
            }
            _ => None,
        };
        let (advantages, returns, opd_kl) = if policy {
            self.compute_advantages(items, &old, &refs, &teacher_lps, values.as_deref())?
        } else {
            let zeros: Vec<Vec<f32>> = items.iter().map(|i| vec![0.0; i.response_length]).collect();
            (zeros.clone(), zeros, None)
        };

        let scoring_secs = started.elapsed().as_secs_f64();
        let device = self.device();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut tokens_trained = 0usize;
        let mut times = PhaseTimes::default();
        for step in &steps {
            let critic_metrics = match (&mut self.critic, &values) {
                (Some(critic), Some(values)) => {
                    let config = &self.config;
                    let moe = self.moe.as_ref();
                    critic.train_step(
                        items,
                        step.clone(),
                        values,
                        &returns,
                        config,
                        &|item: &TrainItem| hook_for(config, moe, &[item], BatchLayout::PerSample),
                        &device,
                    )?
                }
                _ => BTreeMap::new(),
            };
            let mut report = self.train_step(
                items,
                step.clone(),
                &old,
                old_source == OldLogProbs::TrainingForward,
                &refs,
                &advantages,
                mask_sums.as_deref(),
                &device,
                (&mut times, &mut flips),
            )?;
            report.metrics.extend(critic_metrics);
            if let Some(kl) = &opd_kl {
                let per_token = self.config.policy_loss.calculate_per_token_loss;
                let value =
                    opd::step_reverse_kl(items, kl, step.clone(), per_token, mask_sums.as_deref());
                report.metrics.insert("train/opd_reverse_kl".into(), value);
            }
            tokens_trained += items[step.clone()]
                .iter()
                .map(TrainItem::len)
                .sum::<usize>();
            for (k, v) in &report.metrics {
                *sums.entry(k.clone()).or_default() += v;
            }
            if let Some(sink) = &self.sink {
                sink.log(report.step, &report.metrics)?;
            }
            tracing::info!(step = report.step, metrics = ?report.metrics, "train step");
            self.history.push(report);
        }
        for (k, v) in sums {
            out.insert(k, v / steps.len() as f64);
        }
        // Rollout-vs-trainer routing flips, measured on the pass that scores the old log-probs
        // (R3): their own forward, or the training forward when it gives them.
        out.extend(flips.to_metrics());
        if let Some(kl) = &opd_kl {
            out.extend(opd::rollout_metrics(items, kl, &teacher_lps));
        }
        self.rollouts_trained += 1;
        self.version = self.version.next();
        if let Some(k) = self.config.ref_update_interval
            && self.reference.is_some()
            && self.rollouts_trained.is_multiple_of(k)
        {
            self.reference = Some(self.model.valid());
        }
        let secs = started.elapsed().as_secs_f64();
        out.insert("perf/train_time".into(), secs);
        out.insert("perf/log_probs_time".into(), old_secs);
        if reference.is_some() {
            out.insert("perf/ref_log_probs_time".into(), ref_secs);
        }
        out.insert(
            "perf/advantages_time".into(),
            scoring_secs - old_secs - ref_secs,
        );
        out.insert("perf/actor_forward_time".into(), times.forward);
        out.insert("perf/actor_backward_time".into(), times.backward);
        out.insert("perf/optimizer_time".into(), times.optimizer);
        out.insert(
            "perf/step_time".into(),
            (secs - scoring_secs) / steps.len() as f64,
        );
        out.insert(
            "perf/tokens_per_s".into(),
            tokens_trained as f64 / secs.max(1e-9),
        );
        out.insert("train/steps".into(), steps.len() as f64);
        Ok(out)
    }

    /// Where this call's old log-probs come from (see the type-level docs of [`Actor`]):
    /// the rollout's with `use_rollout_logprobs`, the training forward's with one optimizer
    /// step, else a forward of their own. A metric or correction that compares the trainer's
    /// old log-probs with the rollout's (`get_mismatch_metrics`, `use_tis`) or a KL reward
    /// shaping (`kl_coef`, which needs them before training) keeps the forward.
    fn old_log_prob_source(&self, items: &[TrainItem], steps: usize) -> OldLogProbs {
        let p = &self.config.policy_loss;
        // OPD's sampled-token reverse KL reads the student's old log-probs before training
        // (the rollout's with use_rollout_logprobs, below); a precomputed top-k KL does not.
        let opd_reads_old = self.config.opd.use_opd
            && !p.use_rollout_logprobs
            && items.iter().any(|i| i.opd_reverse_kl.is_none());
        if p.get_mismatch_metrics
            || p.use_tis
            || self.config.advantage.kl_coef != 0.0
            || opd_reads_old
        {
            return OldLogProbs::Forward;
        }
        if p.use_rollout_logprobs {
            if items.iter().all(|i| i.rollout_log_probs.is_some()) {
                return OldLogProbs::Rollout;
            }
            return OldLogProbs::Forward;
        }
        if steps == 1 {
            return OldLogProbs::TrainingForward;
        }
        OldLogProbs::Forward
    }

    fn compute_advantages(
        &self,
        items: &[TrainItem],
        old: &[Vec<f32>],
        refs: &[Vec<f32>],
        teacher: &[Vec<f32>],
        values: Option<&[Vec<f32>]>,
    ) -> Result<AdvantagesAndReturns> {
        let rewards: Vec<f32> = items.iter().map(|i| i.reward).collect();
        let groups: Option<Vec<u64>> = items.iter().map(|i| i.group_index).collect();
        let n_per_prompt = self.advantages.config().n_samples_per_prompt;
        let grouping = match &groups {
            Some(g) => Grouping::GroupIndex(g),
            None if n_per_prompt > 1 => Grouping::FanOut,
            None => Grouping::Whole,
        };
        let rollout_ids: Option<Vec<u64>> = items.iter().map(|i| i.rollout_id).collect();
        let normalized =
            self.advantages
                .normalize_rewards(&rewards, grouping, rollout_ids.as_deref())?;
        let kl_coef = self.config.advantage.kl_coef;
        let mut kls = Vec::new();
        if kl_coef != 0.0 {
            for (i, item) in items.iter().enumerate() {
                let lp = match (
                    &item.rollout_log_probs,
                    self.config.policy_loss.use_rollout_logprobs,
                ) {
                    (Some(r), true) => r.as_slice(),
                    _ => old[i].as_slice(),
                };
                kls.push(shaping_kl(
                    lp,
                    &refs[i],
                    self.config.policy_loss.kl_loss_type,
                )?);
            }
        }
        let inputs: Vec<AdvantageSample<'_>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let mut s = AdvantageSample::new(normalized[i], &item.loss_mask);
                if let Some(kl) = kls.get(i) {
                    s = s.with_kl(kl);
                }
                if let Some(v) = values.and_then(|v| v.get(i)) {
                    s = s.with_values(v);
                }
                s
            })
            .collect();
        let mut outputs = self.advantages.compute(&inputs)?;
        // On-policy distillation, on top of any estimator, before whitening (Miles).
        let opd_kl = opd::apply_to_outputs(
            &self.config.opd,
            self.config.policy_loss.use_rollout_logprobs,
            items,
            old,
            teacher,
            &mut outputs,
        )?;
        if self.config.advantage.normalize_advantages {
            let masks: Vec<&[f32]> = items.iter().map(|i| i.loss_mask.as_slice()).collect();
            whiten_advantages(&mut outputs, &masks)?;
        }
        let (advantages, returns) = outputs
            .into_iter()
            .map(|o| (o.advantages, o.returns))
            .unzip();
        Ok((advantages, returns, opd_kl))
    }

    #[allow(clippy::too_many_arguments)]
    fn train_step(
        &mut self,
        items: &[TrainItem],
        range: std::ops::Range<usize>,
        old: &[Vec<f32>],
        old_from_forward: bool,
        refs: &[Vec<f32>],
        advantages: &[Vec<f32>],
        mask_sums: Option<&[f32]>,
        device: &Device,
        (times, flips): (&mut PhaseTimes, &mut FlipStats),
    ) -> Result<StepReport> {
        let step_items = &items[range.clone()];
        let per_token = self.config.policy_loss.calculate_per_token_loss;
        let normalizer = match mask_sums {
            // Per-rollout means: the step's loss is divided by its number of rollouts.
            Some(_) if !per_token => rollouts_of(step_items).len() as f32,
            _ => step_normalizer(step_items, per_token),
        };
        let micro = self.config.micro_batches(step_items);
        let recompute_plan = self
            .config
            .recompute
            .plan(self.model.config.num_hidden_layers);
        let mut acc = GradAccumulator::new();
        let mut metric_sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut pending: Vec<(&'static str, Tensor<1>)> = Vec::new();
        let step_no = self.optimizer.step_count() + 1;
        for mb in micro {
            let idx: Vec<usize> = mb.clone().map(|i| range.start + i).collect();
            let refs_mb: Vec<&TrainItem> = idx.iter().map(|&i| &items[i]).collect();
            let max_r = refs_mb.iter().map(|i| i.response_length).max().unwrap_or(0);
            let pad2 = |rows: Vec<&[f32]>| pad_rows(&rows, max_r, device);
            // Mixed precision: the forward runs on the f32 master weights cast to the compute
            // dtype (a graph op, cast anew per micro-batch so every backward owns its casts);
            // gradients arrive in f32 on the masters, which `acc` reads.
            let forward_started = Instant::now();
            // With full recomputation the layers are cast where they run and only the
            // output projection is cast here (`compute` then holds no decoder layer).
            let mut recomputed = recompute_plan
                .clone()
                .map(|plan| RecomputedForward::new(&self.model, self.config.precision, plan));
            let compute = match &recomputed {
                Some(r) => r.head().clone(),
                None => self.model.clone().to_precision(self.config.precision),
            };
            // When this forward also gives the old log-probs, it is where the rollout's
            // routing is compared with the trainer's (R3 flip statistics).
            let mut replays: Vec<Arc<RoutingReplay>> = Vec::new();
            let config = &self.config;
            let moe = self.moe.as_ref();
            let hooks: &mut HookFn<'_> = &mut |its| match moe {
                Some(moe) if config.use_routing_replay && old_from_forward => {
                    let replay = replay_for(moe, its, config.layout)?;
                    replay.set_compare(true)?;
                    replays.push(Arc::clone(&replay));
                    Ok(Box::new(SharedReplay(replay)) as Box<dyn RouterHook>)
                }
                _ => hook_for(config, moe, its, config.layout),
            };
            let scored = match recomputed.as_mut() {
                Some(r) => score_batch_with(
                    &compute,
                    &mut |input, hook| r.forward_hidden(input, hook),
                    &refs_mb,
                    config.layout,
                    hooks,
                    &config.fused,
                )?,
                None => score_batch(&compute, &refs_mb, config.layout, hooks, &config.fused)?,
            };
            for replay in &replays {
                flips.merge(&replay.take_flip_stats()?);
            }
            let mask = pad2(refs_mb.iter().map(|i| i.loss_mask.as_slice()).collect());
            let (loss, metrics) = match self.config.loss_type {
                LossType::SftLoss => {
                    let per_sample = (scored.log_probs.clone() * mask.clone()).sum_dim(1)
                        / mask.clone().sum_dim(1).clamp_min(1.0);
                    let loss = if per_token {
                        (scored.log_probs * mask).sum().neg() / normalizer
                    } else {
                        per_sample.sum().neg() / normalizer
                    };
                    let value = loss.clone().detach();
                    (loss, vec![("loss", value.clone()), ("sft_loss", value)])
                }
                LossType::PolicyLoss => {
                    // One optimizer step on the trainer's weights: this forward's log-probs
                    // are the old policy's (detached in the loss).
                    let old_mb = if old_from_forward {
                        scored.log_probs.clone().detach()
                    } else {
                        pad2(idx.iter().map(|&i| old[i].as_slice()).collect())
                    };
                    let mut input = PolicyLossInput::new(
                        scored.log_probs,
                        old_mb,
                        pad2(idx.iter().map(|&i| advantages[i].as_slice()).collect()),
                        mask,
                    )
                    .with_entropy(scored.entropy)
                    .with_normalizer(normalizer);
                    let rollout: Option<Vec<&[f32]>> = refs_mb
                        .iter()
                        .map(|i| i.rollout_log_probs.as_deref())
                        .collect();
                    if let Some(rollout) = rollout {
                        input = input.with_rollout_log_probs(pad2(rollout));
                    }
                    if let Some(sums) = mask_sums {
                        let rows: Vec<f32> = idx.iter().map(|&i| sums[i]).collect();
                        input = input.with_rollout_mask_sums(Tensor::from_data(
                            burn::tensor::TensorData::new(rows, [idx.len()]),
                            device,
                        ));
                    }
                    if !refs.is_empty() {
                        input = input.with_ref_log_probs(pad2(
                            idx.iter().map(|&i| refs[i].as_slice()).collect(),
                        ));
                    }
                    let out = self.loss.forward(input)?;
                    let metrics: Vec<(&'static str, Tensor<1>)> = out
                        .metrics
                        .entries()
                        .map(|(name, v)| (name, v.clone()))
                        .collect();
                    (out.loss.sum(), metrics)
                }
            };
            // Kept on the device: the step reads every micro-batch's metrics and the
            // gradient norm back in one read.
            pending.extend(metrics);
            times.forward += forward_started.elapsed().as_secs_f64();
            let backward_started = Instant::now();
            match recomputed {
                Some(r) => {
                    // One micro-batch's gradient summed over the stages first, so the sum
                    // over micro-batches adds what the plain path adds.
                    let mut local = GradAccumulator::new();
                    for grads in r.backward(loss)? {
                        local.accumulate(&*self.model, &grads);
                    }
                    acc.merge(local);
                }
                None => {
                    let grads = loss.backward();
                    acc.accumulate(&*self.model, &grads);
                }
            }
            times.backward += backward_started.elapsed().as_secs_f64();
        }
        let optimizer_started = Instant::now();
        acc.retain_trainable(|name| self.config.is_frozen(name));
        let norm_sq = acc.global_norm_sq();
        let mut values: Vec<Tensor<1>> = pending.iter().map(|(_, v)| v.clone()).collect();
        values.extend(norm_sq.clone());
        let read = miles_ops::read_scalars(&values);
        for ((name, _), v) in pending.iter().zip(&read) {
            *metric_sums.entry(format!("train/{name}")).or_default() += v;
        }
        let grad_norm = match norm_sq {
            Some(_) => read.last().copied().unwrap_or(f64::NAN).sqrt(),
            None => 0.0,
        };
        let mut metrics: Metrics = metric_sums;
        let loss = metrics.get("train/loss").copied().unwrap_or(0.0);
        if !loss.is_finite() {
            return Err(Error::NonFinite {
                what: "loss",
                step: step_no,
            });
        }
        // Clipping's coefficient is applied inside the AdamW pass (same bits as scaling the
        // gradients first).
        let clip = GradAccumulator::clip_coefficient(grad_norm, self.config.clip_grad);
        if !grad_norm.is_finite() {
            return Err(Error::NonFinite {
                what: "grad_norm",
                step: step_no,
            });
        }
        let lr = self.schedule.lr_at(self.optimizer.step_count());
        // By value: the update writes each parameter in place ([`ModelSlot`]).
        let optimizer = &mut self.optimizer;
        self.model
            .update(|model| optimizer.step_scaled(model, acc, lr, clip));
        times.optimizer += optimizer_started.elapsed().as_secs_f64();
        metrics.insert("train/grad_norm".into(), grad_norm);
        metrics.insert("train/lr".into(), lr);
        Ok(StepReport {
            step: step_no,
            metrics,
        })
    }

    /// The current policy's weights as HF-named host tensors in `dtype` — with LoRA, the base
    /// weights with every adapter merged in (`W + scaling·B·A`), so an engine that knows only
    /// the base model's names samples from the trained policy.
    pub fn export(&self, dtype: DType) -> Result<NamedTensors> {
        Ok(self.model.to_hf_tensors_merged(dtype)?)
    }

    /// The LoRA adapters as a PEFT adapter: tensors named
    /// `base_model.model.<module>.lora_A.weight` / `lora_B.weight` in `dtype` and the
    /// `adapter_config.json` value (`None` without LoRA). For engines that load adapters
    /// (SGLang's `/load_lora_adapter_from_tensors`) instead of merged weights.
    pub fn export_lora_adapter(
        &self,
        dtype: DType,
    ) -> Result<Option<(NamedTensors, serde_json::Value)>> {
        let Some(config) = self.model.peft_adapter_config() else {
            return Ok(None);
        };
        let tensors = self.model.lora_to_peft_tensors(dtype)?;
        Ok(Some((tensors, config)))
    }

    /// Uses `lm` (Miles' `--ref-load`) as the frozen reference model instead of a copy of the
    /// initial policy. `lm` lives on the inner (non-autodiff) device of the actor's model and
    /// has the same vocabulary. Without a config that needs a reference (KL loss, `kl_coef`)
    /// the actor keeps none and `lm` is dropped.
    pub fn with_reference(mut self, lm: CausalLm) -> Result<Self> {
        if lm.config.vocab_size != self.model.config.vocab_size {
            return Err(Error::Config {
                field: "ref_load",
                value: lm.config.vocab_size.to_string(),
                reason: "the reference model's vocabulary differs from the policy's",
            });
        }
        if lm.lm_head_weight().is_autodiff() {
            return Err(Error::Config {
                field: "ref_load",
                value: format!("{:?}", lm.lm_head_weight().device()),
                reason: "the reference model must live on a non-autodiff device",
            });
        }
        if self.config.needs_ref() {
            self.reference = Some(lm);
        }
        Ok(self)
    }

    /// Uses `lm` as the on-policy-distillation teacher (Miles' `--opd-type megatron` with
    /// `--opd-teacher-load`): the trainer scores every sample's response under it in the
    /// old-log-prob pass, and OPD's reverse KL uses those log-probs. `lm` lives on the inner
    /// (non-autodiff) device of the actor's model and has the same vocabulary; the config must
    /// have `opd.use_opd` with `opd_type = megatron`.
    pub fn with_teacher(mut self, lm: CausalLm) -> Result<Self> {
        let field = "opd_teacher_load";
        let bad = |value: String, reason| {
            Err(Error::Config {
                field,
                value,
                reason,
            })
        };
        if !self.config.opd.local_teacher() {
            return bad(
                format!("{:?}", self.config.opd.opd_type),
                "a local teacher needs use_opd with opd_type = megatron",
            );
        }
        if lm.config.vocab_size != self.model.config.vocab_size {
            return bad(
                lm.config.vocab_size.to_string(),
                "the teacher's vocabulary differs from the policy's",
            );
        }
        if lm.lm_head_weight().is_autodiff() {
            return bad(
                format!("{:?}", lm.lm_head_weight().device()),
                "the teacher must live on a non-autodiff device",
            );
        }
        self.teacher = Some(lm);
        Ok(self)
    }

    /// The reference model used for KL terms, if the config needs one (with LoRA: the base
    /// model without adapters, until `ref_update_interval` copies the policy into it).
    pub fn reference(&self) -> Option<&CausalLm> {
        self.reference.as_ref()
    }

    pub(crate) fn restore(
        &mut self,
        model: CausalLm,
        optimizer: AdamW,
        version: WeightVersion,
        rollouts_trained: u64,
        reference: Option<CausalLm>,
    ) {
        self.model = ModelSlot::new(model);
        self.optimizer = optimizer;
        self.version = version;
        self.rollouts_trained = rollouts_trained;
        if self.config.needs_ref() {
            self.reference = reference.or_else(|| self.reference.take());
        }
    }
}

impl PolicyTrainer for Actor {
    fn train(&mut self, rollout_id: u64, samples: &[Sample]) -> miles_core::Result<Metrics> {
        let require_reward = self.config.loss_type == LossType::PolicyLoss;
        let reward_key = self.config.reward_key.as_deref();
        // A sample flagged `remove_sample` (aborted, failed) has a zero loss mask; it stays in
        // the batch for its group's statistics when it can, and is left out when it cannot be
        // an item at all: no response token (aborted before its first token) or no reward (its
        // reward function failed). Any other malformed sample is an error.
        let unusable = |s: &Sample| {
            s.remove_sample
                && (s.response_length == 0
                    || (require_reward && s.scalar_reward(reward_key).is_none()))
        };
        let dropped = samples.iter().filter(|s| unusable(s)).count();
        let items = samples
            .iter()
            .enumerate()
            .filter(|(_, s)| !unusable(s))
            .map(|(i, s)| TrainItem::from_sample(i, s, reward_key, require_reward))
            .collect::<Result<Vec<_>>>()?;
        if items.is_empty() {
            return Err(Error::Sample {
                index: 0,
                reason: format!(
                    "none of the {} samples can be trained on (all removed: aborted or failed)",
                    samples.len()
                ),
            }
            .into());
        }
        let mut metrics = self.train_items(&items)?;
        metrics.insert("train/removed_samples_dropped".into(), dropped as f64);
        metrics.insert("train/rollout_id".into(), rollout_id as f64);
        Ok(metrics)
    }

    /// The weights in the compute dtype ([`TrainConfig::precision`]: what the engines serve).
    fn export_weights(&self) -> miles_core::Result<NamedTensors> {
        Ok(self.export(self.config.precision.checkpoint_dtype())?)
    }

    /// The model itself (its inner, non-autodiff module in the compute dtype, sharing the
    /// parameters' buffers: no copy in `f32`); `None` with LoRA adapters, whose export merges
    /// them.
    fn export_in_process(&self) -> miles_core::Result<Option<miles_core::InProcessWeights>> {
        if self.model.lora.is_some() {
            return Ok(None);
        }
        let model = self.model.valid().to_precision(self.config.precision);
        Ok(Some(miles_core::InProcessWeights::new(model)))
    }

    fn weight_version(&self) -> WeightVersion {
        self.version
    }

    fn save_checkpoint(&self, dir: &Path) -> miles_core::Result<()> {
        // The gradient buffers kept for the next step would come on top of the checkpoint's
        // host copies.
        miles_ops::drop_result_buffers();
        Ok(checkpoint::save(
            &self.model,
            &self.optimizer,
            self.version,
            self.rollouts_trained,
            dir,
        )?)
    }

    fn load_checkpoint(&mut self, dir: &Path) -> miles_core::Result<()> {
        let restored = checkpoint::load(&self.model, &self.optimizer, dir)?;
        self.restore(
            restored.model,
            restored.optimizer,
            restored.version,
            restored.rollouts_trained,
            None,
        );
        Ok(())
    }
}
