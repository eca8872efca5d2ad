//! Gradient accumulation, global-norm clipping and AdamW with decoupled weight decay, with
//! state keyed by parameter name (so it can be checkpointed and resumed exactly).
//!
//! burn's built-in clipping is per tensor; Megatron's `--clip-grad` is global:
//! `g ← g · min(1, clip / (‖g‖₂ + 1e-6))` over all parameters together.

use std::collections::{BTreeMap, HashMap};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Gradients, Tensor, TensorData};
use miles_bridge::CausalLm;
use miles_bridge::nn::{ParamRef, ParamVisitor};
use miles_ops::{AdamWHyper, adamw_update, adamw_zero_moment, squared_norm};

use crate::config::AdamWConfig;
use crate::{Error, Result};

fn flat<const D: usize>(t: Tensor<D>) -> Tensor<1> {
    let n: usize = t.dims().iter().product();
    t.reshape([n])
}

/// A module whose parameters have stable names (HF names for models), so optimizer state can
/// be keyed, checkpointed and checked by name.
pub trait NamedParams: Module {
    /// Calls `f` with every parameter and its name.
    fn visit_named(&self, f: &mut ParamVisitor<'_>);
}

/// Base parameters (HF names) followed by the LoRA adapters, if any
/// (`<module>.lora_A.weight`, `<module>.lora_B.weight`).
impl NamedParams for CausalLm {
    fn visit_named(&self, f: &mut ParamVisitor<'_>) {
        self.visit_params(f);
        self.visit_lora_params(f);
    }
}

/// Sum of gradients over micro-batches, per parameter name, flattened, without autodiff.
#[derive(Debug, Clone, Default)]
pub struct GradAccumulator {
    grads: BTreeMap<String, Tensor<1>>,
}

impl GradAccumulator {
    /// An empty accumulator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the gradient of every parameter of `model` found in `grads` (parameters without a
    /// gradient — frozen ones, `e_score_correction_bias` — are skipped).
    pub fn accumulate<M: NamedParams>(&mut self, model: &M, grads: &Gradients) {
        model.visit_named(&mut |name, p| {
            let g = match p {
                ParamRef::R1(p) => p.val().grad(grads).map(flat),
                ParamRef::R2(p) => p.val().grad(grads).map(flat),
                ParamRef::R3(p) => p.val().grad(grads).map(flat),
            };
            if let Some(g) = g {
                let g = match self.grads.remove(name) {
                    Some(acc) => acc + g,
                    None => g,
                };
                self.grads.insert(name.to_string(), g);
            }
        });
    }

    /// Adds every gradient of `other` (one micro-batch's, summed over the stages of a
    /// recomputed backward) to this sum.
    pub fn merge(&mut self, other: GradAccumulator) {
        for (name, g) in other.grads {
            let g = match self.grads.remove(&name) {
                Some(acc) => acc + g,
                None => g,
            };
            self.grads.insert(name, g);
        }
    }

    /// Drops the gradients of parameters for which `frozen(name)` holds (they are not updated).
    pub fn retain_trainable(&mut self, frozen: impl Fn(&str) -> bool) {
        self.grads.retain(|name, _| !frozen(name));
    }

    /// Number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.grads.len()
    }

    /// Whether no gradient was accumulated.
    pub fn is_empty(&self) -> bool {
        self.grads.is_empty()
    }

    /// The accumulated (flattened) gradient of `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor<1>> {
        self.grads.get(name)
    }

    /// Global L2 norm over every accumulated gradient (one host read).
    pub fn global_norm(&self) -> f64 {
        self.global_norm_sq()
            .map_or(0.0, |total| f64::from(total.into_scalar::<f32>()).sqrt())
    }

    /// The squared global L2 norm as a `[1]` tensor on the gradients' device, not read back
    /// (`None` without gradients): for a caller that reads it with other values at once.
    /// Each gradient's sum of squares is one pass over it ([`miles_ops::squared_norm`]).
    pub fn global_norm_sq(&self) -> Option<Tensor<1>> {
        let device = self.grads.values().next()?.device();
        let mut total = Tensor::<1>::zeros([1], &device);
        for g in self.grads.values() {
            total = total + squared_norm(g.clone());
        }
        Some(total)
    }

    /// Multiplies every gradient by `factor`.
    pub fn scale(&mut self, factor: f64) {
        for g in self.grads.values_mut() {
            *g = g.clone() * factor;
        }
    }

    /// Megatron's global clipping: scales by `clip / (norm + 1e-6)` when that is below 1.
    /// Returns the norm before clipping.
    pub fn clip_global_norm(&mut self, clip: f64) -> f64 {
        let norm = self.global_norm();
        self.clip_to_norm(norm, clip);
        norm
    }

    /// [`GradAccumulator::clip_global_norm`] with the norm already read (the square root of
    /// [`GradAccumulator::global_norm_sq`]).
    pub fn clip_to_norm(&mut self, norm: f64, clip: f64) {
        let coef = Self::clip_coefficient(norm, clip);
        if coef < 1.0 {
            self.scale(coef);
        }
    }

    /// The factor Megatron's global clipping multiplies the gradients by at global norm
    /// `norm` with `--clip-grad` `clip`: `clip / (norm + 1e-6)` when that is below 1, else 1
    /// (also for `clip ≤ 0` or a non-finite norm). [`AdamW::step_scaled`] applies it inside the
    /// update instead of a pass of its own ([`GradAccumulator::clip_to_norm`]).
    pub fn clip_coefficient(norm: f64, clip: f64) -> f64 {
        if clip > 0.0 && norm.is_finite() {
            let coef = clip / (norm + 1e-6);
            if coef < 1.0 {
                return coef;
            }
        }
        1.0
    }
}

/// A trainer's model, handed to [`AdamW::step_scaled`] by value for the update
/// ([`ModelSlot::update`]): while the update runs nothing else holds the parameters' buffers,
/// so it writes each parameter in place. (A `model.clone()` kept beside the update would hold
/// every old buffer until the update returns, and the update would write the whole model
/// anew into fresh pages: one more weight-sized buffer per step.)
#[derive(Debug)]
pub(crate) struct ModelSlot<M>(Option<M>);

/// Why a [`ModelSlot`] can be empty: only inside [`ModelSlot::update`].
const AWAY: &str = "the model is away only during its optimizer update, which panicked";

impl<M> ModelSlot<M> {
    pub(crate) fn new(model: M) -> Self {
        Self(Some(model))
    }

    /// Replaces the model by `f(model)`, passing it on by value.
    pub(crate) fn update(&mut self, f: impl FnOnce(M) -> M) {
        let model = self.0.take().expect(AWAY);
        self.0 = Some(f(model));
    }
}

impl<M> std::ops::Deref for ModelSlot<M> {
    type Target = M;

    fn deref(&self) -> &M {
        self.0.as_ref().expect(AWAY)
    }
}

impl<M> std::ops::DerefMut for ModelSlot<M> {
    fn deref_mut(&mut self) -> &mut M {
        self.0.as_mut().expect(AWAY)
    }
}

/// Lets the optimizer's updates keep their gradients' buffers for the next backward to write
/// into ([`miles_ops::recycle`]): raises the process's limit to the `f32` size of `params`
/// values if it is lower. A step's weight gradients are weight-sized new buffers; freed at the
/// update, their pages would go back to the kernel before the next backward and every
/// gradient would be faulted in anew (2.4 GB a step at Qwen3-0.6B).
///
/// Trainers ask for it only with full activation recomputation: then a step's memory peaks
/// at the end of the backward, where every gradient is alive anyway, so the kept buffers
/// add nothing to it; with every activation kept the peak is at the start of the backward,
/// and buffers kept from the previous step would add the model's size to it (measured at
/// 0.6B, 4 × 256 tokens: 13.9 GiB instead of 11.1).
pub(crate) fn keep_gradient_buffers(params: usize) {
    let bytes = params.saturating_mul(std::mem::size_of::<f32>());
    if bytes > miles_ops::result_buffer_limit() {
        miles_ops::keep_result_buffers(bytes);
    }
}

/// First and second moments of one parameter (flattened).
#[derive(Debug, Clone)]
struct Moments {
    m: Tensor<1>,
    v: Tensor<1>,
}

/// AdamW (PyTorch / Megatron semantics): `p ← p·(1 − lr·wd)`; `m ← β₁m + (1−β₁)g`;
/// `v ← β₂v + (1−β₂)g²`; `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`, one pass per parameter
/// on flex that updates the parameter and its moments in place ([`miles_ops::adamw_update`]).
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
    step: u64,
    state: BTreeMap<String, Moments>,
}

impl AdamW {
    /// A fresh optimizer (step 0, zero moments).
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            step: 0,
            state: BTreeMap::new(),
        }
    }

    /// Number of updates applied so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Applies one update with learning rate `lr` to every parameter of `model` that has an
    /// accumulated gradient, and returns the updated model.
    pub fn step<M: NamedParams>(&mut self, model: M, grads: GradAccumulator, lr: f64) -> M {
        self.step_scaled(model, grads, lr, 1.0)
    }

    /// [`AdamW::step`] on the gradients multiplied by `grad_scale` (global-norm clipping's
    /// [`GradAccumulator::clip_coefficient`]), applied in the update's own pass: the same bits
    /// as [`GradAccumulator::clip_to_norm`] then [`AdamW::step`] (the product is rounded to
    /// `f32` once either way), without writing the clipped gradients out.
    pub fn step_scaled<M: NamedParams>(
        &mut self,
        model: M,
        grads: GradAccumulator,
        lr: f64,
        grad_scale: f64,
    ) -> M {
        self.step += 1;
        let mut names = HashMap::new();
        model.visit_named(&mut |name, p| {
            let id = match p {
                ParamRef::R1(p) => p.id,
                ParamRef::R2(p) => p.id,
                ParamRef::R3(p) => p.id,
            };
            names.insert(id, name.to_string());
        });
        let c = self.config;
        let t = self.step as i32;
        let mut mapper = Update {
            names,
            grads: grads.grads,
            state: &mut self.state,
            hyper: AdamWHyper {
                lr,
                weight_decay: c.weight_decay,
                beta1: c.adam_beta1,
                beta2: c.adam_beta2,
                eps: c.adam_eps,
                bias1: 1.0 - c.adam_beta1.powi(t),
                bias2: 1.0 - c.adam_beta2.powi(t),
                grad_scale,
            },
        };
        model.map(&mut mapper)
    }

    /// The state as named host tensors (`<param>.exp_avg`, `<param>.exp_avg_sq`) for
    /// checkpoints.
    pub fn state_tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut out = Vec::with_capacity(self.state.len() * 2);
        for (name, s) in &self.state {
            for (suffix, t) in [("exp_avg", &s.m), ("exp_avg_sq", &s.v)] {
                let values = t.clone().into_data().convert::<f32>().try_to_vec::<f32>();
                let values = values.unwrap_or_default();
                out.push((format!("{name}.{suffix}"), vec![values.len()], values));
            }
        }
        out
    }

    /// Restores state saved by [`AdamW::state_tensors`] at optimizer step `step`.
    pub fn load_state(
        &mut self,
        step: u64,
        tensors: BTreeMap<String, Vec<f32>>,
        device: &Device,
    ) -> Result<()> {
        let mut state = BTreeMap::new();
        let mut tensors = tensors;
        let names: Vec<String> = tensors
            .keys()
            .filter_map(|k| k.strip_suffix(".exp_avg").map(str::to_string))
            .collect();
        for name in names {
            let m = tensors.remove(&format!("{name}.exp_avg"));
            let v = tensors.remove(&format!("{name}.exp_avg_sq"));
            let (Some(m), Some(v)) = (m, v) else {
                return Err(Error::checkpoint(
                    "optimizer.safetensors",
                    format!("{name}: exp_avg without exp_avg_sq"),
                ));
            };
            if m.len() != v.len() {
                return Err(Error::checkpoint(
                    "optimizer.safetensors",
                    format!("{name}: moments of different sizes"),
                ));
            }
            let n = m.len();
            state.insert(
                name,
                Moments {
                    m: Tensor::from_data(TensorData::new(m, [n]), device),
                    v: Tensor::from_data(TensorData::new(v, [n]), device),
                },
            );
        }
        if let Some(extra) = tensors.keys().next() {
            return Err(Error::checkpoint(
                "optimizer.safetensors",
                format!("unexpected tensor {extra}"),
            ));
        }
        self.state = state;
        self.step = step;
        Ok(())
    }

    /// Checks that every stored moment matches a parameter of `model` by name and size.
    pub fn check_against<M: NamedParams>(&self, model: &M) -> Result<()> {
        let mut sizes = HashMap::new();
        model.visit_named(&mut |name, p| {
            sizes.insert(name.to_string(), p.shape().iter().product::<usize>());
        });
        for (name, s) in &self.state {
            match sizes.get(name) {
                None => {
                    return Err(Error::checkpoint(
                        "optimizer.safetensors",
                        format!("state for unknown parameter {name}"),
                    ));
                }
                Some(&n) if n != s.m.dims()[0] => {
                    return Err(Error::checkpoint(
                        "optimizer.safetensors",
                        format!(
                            "state of {name} has {} values, the parameter {n}",
                            s.m.dims()[0]
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

struct Update<'a> {
    names: HashMap<ParamId, String>,
    grads: BTreeMap<String, Tensor<1>>,
    state: &'a mut BTreeMap<String, Moments>,
    hyper: AdamWHyper,
}

impl ModuleMapper for Update<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let Some(name) = self.names.get(&param.id) else {
            return param;
        };
        let Some(g) = self.grads.remove(name) else {
            return param;
        };
        let (id, value, mapper) = param.consume();
        let dims = value.dims();
        let autodiff = value.is_autodiff();
        let p = flat(value.inner());
        let device = p.device();
        // The moments are taken out of the state so that the update can write them in place.
        let Moments { m, v } = self.state.remove(name).unwrap_or_else(|| Moments {
            m: adamw_zero_moment(g.dims()[0], &device),
            v: adamw_zero_moment(g.dims()[0], &device),
        });
        // Optimizer state is plain data: moments restored from a checkpoint on the trainer's
        // (autodiff) device, and gradients, are taken off the graph.
        let plain = |t: Tensor<1>| if t.is_autodiff() { t.inner() } else { t };
        let (g, m, v) = (plain(g), plain(m), plain(v));
        // Shapes agree by construction (the gradient and moments of this parameter); an error
        // here is a broken invariant.
        // On flex the update recycles the gradient's buffer for the next backward (within
        // the limit the trainer set), or writes the new parameter into it when the old one is
        // still served.
        let (p, m, v) = adamw_update(p, g, m, v, &self.hyper)
            .unwrap_or_else(|e| panic!("AdamW update of {name}: {e}"));
        self.state.insert(name.clone(), Moments { m, v });
        let mut value = p.reshape(dims);
        if autodiff {
            value = Tensor::from_inner(value).require_grad();
        }
        Param::from_mapped_value(id, value, mapper)
    }
}
