//! The critic for `--advantage-estimator ppo`: a copy of the policy's transformer with a
//! scalar value head, trained with Miles' clipped value loss (`--value-clip`) before the actor
//! in every step, as Miles' `train.py` does ("critic first").

use std::collections::BTreeMap;

use burn::module::{Module, Param};
use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::nn::{Linear, ParamRef, ParamVisitor};
use miles_bridge::{CausalLm, ModelInput};
use miles_ops::value_loss;
use miles_ops::{LossAggregation, Reducer};
use miles_r3::RouterHook;

use crate::batch::{TrainItem, pad_row, pad_rows, step_normalizer};
use crate::optim::{AdamW, GradAccumulator, ModelSlot, NamedParams};
use crate::{Error, LrSchedule, Result, TrainConfig};

/// Transformer + value head `[1, hidden]` (HF name `value_head.weight`).
#[derive(Module, Debug)]
pub struct ValueModel {
    /// The transformer (its `lm_head` is unused).
    pub lm: CausalLm,
    /// Scalar value projection.
    pub value_head: Linear,
}

impl NamedParams for ValueModel {
    fn visit_named(&self, f: &mut ParamVisitor<'_>) {
        self.lm.visit_params(f);
        f("value_head.weight", ParamRef::R2(&self.value_head.weight));
    }
}

impl ValueModel {
    /// Wraps `lm` with a zero-initialised value head (every value starts at 0).
    pub fn new(lm: CausalLm) -> Self {
        let device = lm.lm_head_weight().device();
        let hidden = lm.config.hidden_size;
        Self {
            lm,
            value_head: Linear {
                weight: Param::from_tensor(Tensor::zeros([1, hidden], &device)),
                bias: None,
                lora: None,
            },
        }
    }

    /// Values of the response tokens of `tokens`, `[response_length]`: entry `i` is read at
    /// the position that predicts response token `i` (the same rows as the log-probs).
    pub fn values(
        &self,
        tokens: &[u32],
        response_length: usize,
        hook: &dyn RouterHook,
    ) -> Result<Tensor<1>> {
        let n = tokens.len();
        if response_length == 0 || response_length >= n {
            return Err(Error::Sample {
                index: 0,
                reason: format!("response_length {response_length} must be in 1..{n}"),
            });
        }
        let device = self.lm.lm_head_weight().device();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let ids = Tensor::<2, Int>::from_data(TensorData::new(ids, [1, n]), &device);
        let out = self.lm.forward_hidden(&ModelInput::new(ids), hook)?;
        let h = self.lm.config.hidden_size;
        let rows = out
            .hidden
            .reshape([n, h])
            .narrow(0, n - 1 - response_length, response_length);
        Ok(self.value_head.forward(rows).reshape([response_length]))
    }
}

/// The critic: value model, its own AdamW and LR schedule (`--critic-lr`).
#[derive(Debug)]
pub struct Critic {
    model: ModelSlot<ValueModel>,
    optimizer: AdamW,
    schedule: LrSchedule,
}

impl Critic {
    /// A critic initialised from `lm` (usually the actor's starting checkpoint) on an autodiff
    /// device, with the actor's config (`critic_lr` overrides the learning rate).
    pub fn new(lm: CausalLm, config: &TrainConfig) -> Result<Self> {
        if !lm.lm_head_weight().is_autodiff() {
            return Err(Error::Config {
                field: "device",
                value: format!("{:?}", lm.lm_head_weight().device()),
                reason: "the critic's model must live on an autodiff device",
            });
        }
        let mut schedule = config.lr_schedule;
        if let Some(lr) = config.critic_lr {
            schedule.lr = lr;
        }
        if config.recompute.plan(lm.config.num_hidden_layers).is_some() {
            crate::optim::keep_gradient_buffers(lm.num_params());
        }
        Ok(Self {
            model: ModelSlot::new(ValueModel::new(lm)),
            optimizer: AdamW::new(config.optimizer),
            schedule: schedule.validate()?,
        })
    }

    /// The value model.
    pub fn model(&self) -> &ValueModel {
        &self.model
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.optimizer.step_count()
    }

    /// Values of every item with the current weights (no gradient).
    pub fn values(
        &self,
        items: &[TrainItem],
        hook: &dyn Fn(&TrainItem) -> Result<Box<dyn RouterHook>>,
    ) -> Result<Vec<Vec<f32>>> {
        let model = self.model.valid();
        items
            .iter()
            .enumerate()
            .map(|(index, item)| {
                let h = hook(item)?;
                let v = model
                    .values(&item.tokens, item.response_length, &*h)
                    .map_err(|e| match e {
                        Error::Sample { reason, .. } => Error::Sample { index, reason },
                        other => other,
                    })?;
                v.into_data()
                    .convert::<f32>()
                    .try_into_vec::<f32>()
                    .map_err(|e| Error::Sample {
                        index,
                        reason: format!("cannot read values back: {e:?}"),
                    })
            })
            .collect()
    }

    /// One optimizer step of the clipped value loss on `items[range]` against `returns`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn train_step(
        &mut self,
        items: &[TrainItem],
        range: std::ops::Range<usize>,
        old_values: &[Vec<f32>],
        returns: &[Vec<f32>],
        config: &TrainConfig,
        hook: &dyn Fn(&TrainItem) -> Result<Box<dyn RouterHook>>,
        device: &Device,
    ) -> Result<BTreeMap<String, f64>> {
        let step_items = &items[range.clone()];
        let per_token = config.policy_loss.calculate_per_token_loss;
        let normalizer = step_normalizer(step_items, per_token);
        let aggregation = if per_token {
            LossAggregation::PerToken
        } else {
            LossAggregation::SampleMean
        };
        let mut acc = GradAccumulator::new();
        let mut loss_sum = 0.0;
        let mut clip_sum = 0.0;
        for mb in config.micro_batches(step_items) {
            let idx: Vec<usize> = mb.map(|i| range.start + i).collect();
            let max_r = idx
                .iter()
                .map(|&i| items[i].response_length)
                .max()
                .unwrap_or(0);
            let pad = |rows: Vec<&[f32]>| pad_rows(&rows, max_r, device);
            let mut rows = Vec::with_capacity(idx.len());
            for &i in &idx {
                let item = &items[i];
                let h = hook(item)?;
                let v = self.model.values(&item.tokens, item.response_length, &*h)?;
                rows.push(pad_row(v, max_r));
            }
            let values = Tensor::cat(rows, 0);
            let mask = pad(idx.iter().map(|&i| items[i].loss_mask.as_slice()).collect());
            let reducer = Reducer::new(mask, None, aggregation);
            let (loss, clipfrac) = value_loss(
                values,
                pad(idx.iter().map(|&i| old_values[i].as_slice()).collect()),
                pad(idx.iter().map(|&i| returns[i].as_slice()).collect()),
                config.value_clip,
                &reducer,
            );
            let loss = loss / normalizer;
            loss_sum += f64::from(loss.clone().into_scalar::<f32>());
            clip_sum += f64::from(clipfrac.into_scalar::<f32>()) / f64::from(normalizer);
            let grads = loss.backward();
            acc.accumulate(&*self.model, &grads);
        }
        acc.retain_trainable(|name| config.is_frozen(name));
        let step = self.optimizer.step_count() + 1;
        if !loss_sum.is_finite() {
            return Err(Error::NonFinite { what: "loss", step });
        }
        // Clipping's coefficient is applied inside the AdamW pass, as the actor's is.
        let grad_norm = acc.global_norm();
        if !grad_norm.is_finite() {
            return Err(Error::NonFinite {
                what: "grad_norm",
                step,
            });
        }
        let lr = self.schedule.lr_at(self.optimizer.step_count());
        let clip = GradAccumulator::clip_coefficient(grad_norm, config.clip_grad);
        // By value: the update writes each parameter in place ([`ModelSlot`]).
        let optimizer = &mut self.optimizer;
        self.model
            .update(|model| optimizer.step_scaled(model, acc, lr, clip));
        Ok(BTreeMap::from([
            ("train/value_loss".to_string(), loss_sum),
            ("train/value_clipfrac".to_string(), clip_sum),
            ("train/critic_grad_norm".to_string(), grad_norm),
            ("train/critic_lr".to_string(), lr),
        ]))
    }
}
