//! Activation recomputation with Megatron's names ([`RecomputeConfig`]): `full` granularity
//! recomputes whole decoder layers in the backward pass ([`RecomputedForward`]), `selective`
//! the attention core only (what the fused attention op does by itself).
//!
//! Full recomputation runs as a staged forward / backward over burn's public autodiff API,
//! with no second backend type: the recomputed layers first run without autodiff, keeping
//! only the input of each group of layers (and the experts each MoE layer chose); the layers
//! that are not recomputed, the final norm and the caller's loss run with autodiff from the
//! last group's output, made a leaf; the caller's `loss.backward()` then gives the gradient at
//! that leaf, and each group, last to first, is re-run with autodiff from its kept input and
//! back-propagated with `sum(output · upstream gradient)`, whose gradient at the output is the
//! upstream gradient exactly. Only one group's activations are alive at a time.

use std::collections::BTreeMap;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Mutex;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, Gradients, Int, Tensor};
use miles_core::NamedTensors;
use miles_ops::embedding;
use miles_r3::{MoeLayerInfo, R3Error, RouterHook};
use serde::{Deserialize, Serialize};

use crate::error::BridgeError;
use crate::model::causal_lm::CausalLm;
use crate::model::forward::{HiddenOutput, LayerContext, ModelInput, layer_forward};
use crate::nn::layer::{DecoderLayer, DecoderModel, FeedForward};
use crate::nn::moe::MoeRouting;
use crate::precision::Precision;

/// Megatron's `--recompute-granularity`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeGranularity {
    /// Whole decoder layers (which ones: [`RecomputeMethod`] and `recompute_num_layers`).
    Full,
    /// The attention core only (`softmax(q·kᵀ)·v`): its probabilities are not kept for the
    /// backward but recomputed there.
    Selective,
}

/// Megatron's `--recompute-method` (with `--recompute-granularity full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputeMethod {
    /// The layers in groups of `recompute_num_layers`, every group recomputed from its input.
    Uniform,
    /// The first `recompute_num_layers` layers recomputed one by one, the rest kept.
    Block,
}

impl RecomputeGranularity {
    /// Megatron's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Selective => "selective",
        }
    }
}

impl RecomputeMethod {
    /// Megatron's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Uniform => "uniform",
            Self::Block => "block",
        }
    }
}

impl FromStr for RecomputeGranularity {
    type Err = BridgeError;

    /// `full` or `selective`.
    fn from_str(s: &str) -> Result<Self, BridgeError> {
        match s {
            "full" => Ok(Self::Full),
            "selective" => Ok(Self::Selective),
            other => Err(BridgeError::input(format!(
                "recompute granularity {other:?}: expected full or selective"
            ))),
        }
    }
}

impl FromStr for RecomputeMethod {
    type Err = BridgeError;

    /// `uniform` or `block`.
    fn from_str(s: &str) -> Result<Self, BridgeError> {
        match s {
            "uniform" => Ok(Self::Uniform),
            "block" => Ok(Self::Block),
            other => Err(BridgeError::input(format!(
                "recompute method {other:?}: expected uniform or block"
            ))),
        }
    }
}

/// Activation recomputation, as Megatron's `--recompute-granularity`, `--recompute-method`
/// and `--recompute-num-layers` (all unset by default: every activation is kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RecomputeConfig {
    /// `--recompute-granularity`.
    pub granularity: Option<RecomputeGranularity>,
    /// `--recompute-method` (`full` only).
    pub method: Option<RecomputeMethod>,
    /// `--recompute-num-layers`: layers per group (`uniform`) or layers recomputed
    /// (`block`); `full` only.
    pub num_layers: Option<usize>,
}

/// Which layers a full recomputation recomputes: `groups` (each re-run from its input in the
/// backward pass), then `kept` (run once, activations kept), in layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecomputePlan {
    /// The recomputed groups of layers, in order, covering `0..kept.start`.
    pub groups: Vec<Range<usize>>,
    /// The layers whose activations are kept, `kept.start..num_layers`.
    pub kept: Range<usize>,
}

impl RecomputeConfig {
    /// Checks the combination as Megatron does: `full` needs a method and `1 <= num_layers <=
    /// layers`; `selective` takes neither (Megatron: "recompute method is not yet supported
    /// for selective recomputing granularity", "recompute_num_layers must be None"); a method
    /// or a number of layers without a granularity is refused too (Megatron ignores them).
    pub fn validate(&self, layers: usize) -> Result<(), BridgeError> {
        let bad = |reason: String| Err(BridgeError::input(reason));
        match self.granularity {
            None if self.method.is_some() || self.num_layers.is_some() => bad(
                "--recompute-method / --recompute-num-layers need --recompute-granularity full"
                    .into(),
            ),
            None => Ok(()),
            Some(RecomputeGranularity::Selective) if self.method.is_some() => bad(
                "--recompute-method is not supported with --recompute-granularity selective".into(),
            ),
            Some(RecomputeGranularity::Selective) if self.num_layers.is_some() => bad(
                "--recompute-num-layers must be unset with --recompute-granularity selective"
                    .into(),
            ),
            Some(RecomputeGranularity::Selective) => Ok(()),
            Some(RecomputeGranularity::Full) if self.method.is_none() => {
                bad("--recompute-granularity full needs --recompute-method uniform or block".into())
            }
            Some(RecomputeGranularity::Full) => match self.num_layers {
                Some(n) if (1..=layers).contains(&n) => Ok(()),
                n => bad(format!(
                    "--recompute-granularity full needs --recompute-num-layers between 1 and \
                     the model's {layers} layers, got {n:?}"
                )),
            },
        }
    }

    /// The plan of a full recomputation over `layers` decoder layers; `None` unless the
    /// granularity is `full` (and the config valid for `layers`).
    pub fn plan(&self, layers: usize) -> Option<RecomputePlan> {
        if self.granularity != Some(RecomputeGranularity::Full) || self.validate(layers).is_err() {
            return None;
        }
        let n = self.num_layers?;
        Some(match self.method? {
            RecomputeMethod::Uniform => RecomputePlan {
                groups: (0..layers)
                    .step_by(n)
                    .map(|s| s..(s + n).min(layers))
                    .collect(),
                kept: layers..layers,
            },
            RecomputeMethod::Block => RecomputePlan {
                groups: (0..n).map(|l| l..l + 1).collect(),
                kept: n..layers,
            },
        })
    }
}

/// Casts every float parameter to a dtype (as [`CausalLm::to_precision`] does).
struct Cast(FloatDType);

impl ModuleMapper for Cast {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype))
    }
}

/// `layer` in `precision`, as [`CausalLm::to_precision`] casts it (GLM's
/// `e_score_correction_bias` stays as it is); the layer itself when already there.
fn layer_in(layer: &DecoderLayer, precision: Precision) -> DecoderLayer {
    let dtype = precision.float_dtype();
    if Precision::of_dtype(layer.input_layernorm.weight.val().dtype()) == Some(precision) {
        return layer.clone();
    }
    let bias = match &layer.mlp {
        FeedForward::Moe(m) => m.gate.e_score_correction_bias.clone(),
        FeedForward::Dense(_) | FeedForward::BiasedMoe(_) => None,
    };
    let mut out = layer.clone().map(&mut Cast(dtype));
    if let FeedForward::Moe(m) = &mut out.mlp {
        m.gate.e_score_correction_bias = bias;
    }
    out
}

/// Records the experts the wrapped hook chose for each MoE layer.
struct Recording<'h> {
    hook: &'h dyn RouterHook,
    routes: Mutex<BTreeMap<usize, Tensor<2, Int>>>,
}

impl RouterHook for Recording<'_> {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        let chosen = self.hook.select_experts(layer, scores)?;
        if let Ok(mut routes) = self.routes.lock() {
            routes.insert(layer.layer_index, chosen.clone());
        }
        Ok(chosen)
    }
}

/// Gives each MoE layer the experts recorded by [`Recording`] in the first forward, so a
/// recomputed layer routes exactly as it did.
struct Recorded<'r>(&'r BTreeMap<usize, Tensor<2, Int>>);

impl RouterHook for Recorded<'_> {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        match self.0.get(&layer.layer_index) {
            Some(chosen) if scores.is_autodiff() => Ok(chosen.clone().autodiff()),
            Some(chosen) => Ok(chosen.clone()),
            None => Err(R3Error::InvalidModel {
                reason: format!(
                    "recomputed MoE layer {} has no routing from the forward",
                    layer.layer_index
                ),
            }),
        }
    }
}

/// One forward pass of a [`RecomputedForward`].
struct Pass {
    input: ModelInput,
    /// Masks and RoPE tables on the autodiff device.
    context: LayerContext,
    /// The input of each recomputed group (without autodiff); group 0's is the embedding.
    boundaries: Vec<Tensor<3>>,
    /// The experts each recomputed MoE layer chose, by layer index.
    routes: BTreeMap<usize, Tensor<2, Int>>,
    /// The last group's output as an autodiff leaf: where the caller's loss back-propagates to.
    leaf: Tensor<3>,
}

/// A training forward with full activation recomputation ([`RecomputePlan`]) over one or
/// more forward passes, then its backward pass ([`RecomputedForward::backward`]).
///
/// `master` is the trained model on an autodiff device; `precision` the compute precision
/// (the layers are cast from `master` where they run, a graph op as in
/// [`CausalLm::to_precision`], so gradients arrive on the masters). Call
/// [`RecomputedForward::forward_hidden`] for each pass (it gives what
/// [`CausalLm::forward_hidden`] gives), compute the loss from the hidden states with
/// [`RecomputedForward::head`] as the model (its output projection and config; it holds no
/// decoder layers), and hand the loss to [`RecomputedForward::backward`]: it returns the
/// gradients of every stage, which together are the loss's gradients.
///
/// Values and gradients equal the plain path's bit for bit where each parameter's gradient is
/// the sum of at most two terms in one backward (one forward pass per loss, untied or tied
/// embeddings); with several forward passes per loss (per-sample layout) a parameter's
/// gradient terms are summed per stage first, so its rounding can differ from the plain
/// path's (in the last bits). MoE layers that are recomputed route exactly as in the forward
/// (their experts are kept, as Miles' routing replay does in its `replay_backward` stage).
pub struct RecomputedForward<'m> {
    master: &'m CausalLm,
    inner: CausalLm,
    head: CausalLm,
    precision: Precision,
    plan: RecomputePlan,
    passes: Vec<Pass>,
}

impl std::fmt::Debug for RecomputedForward<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecomputedForward")
            .field("precision", &self.precision)
            .field("plan", &self.plan)
            .field("passes", &self.passes.len())
            .finish_non_exhaustive()
    }
}

impl<'m> RecomputedForward<'m> {
    /// A recomputed forward of `master` computing in `precision` under `plan`.
    pub fn new(master: &'m CausalLm, precision: Precision, plan: RecomputePlan) -> Self {
        let head = CausalLm {
            model: DecoderModel {
                embed_tokens: master.model.embed_tokens.clone(),
                layers: Vec::new(),
                norm: master.model.norm.clone(),
            },
            lm_head: master.lm_head.clone(),
            config: master.config.clone(),
            lora: master.lora.clone(),
            packed_lm_head: None,
            passthrough: NamedTensors::new(),
        }
        .to_precision(precision);
        Self {
            master,
            inner: master.valid(),
            head,
            precision,
            plan,
            passes: Vec::new(),
        }
    }

    /// The model the loss is computed with: `master`'s embeddings, final norm and output
    /// projection in the compute precision, no decoder layers.
    pub fn head(&self) -> &CausalLm {
        &self.head
    }

    /// The plan.
    pub fn plan(&self) -> &RecomputePlan {
        &self.plan
    }

    /// How many hidden-state tensors (`[batch, seq, hidden]` each) the passes keep for the
    /// backward pass beside the kept layers' activations: one per recomputed group and pass,
    /// plus each pass's leaf.
    pub fn kept_hidden_states(&self) -> usize {
        self.passes.iter().map(|p| p.boundaries.len() + 1).sum()
    }

    /// A forward pass over `input` (as [`CausalLm::forward_hidden`]): the recomputed groups
    /// without autodiff (their inputs kept), then the kept layers and the final norm with
    /// autodiff. `hook` routes every MoE layer once, in layer order.
    pub fn forward_hidden(
        &mut self,
        input: &ModelInput,
        hook: &dyn RouterHook,
    ) -> Result<HiddenOutput, BridgeError> {
        let c = &self.master.config;
        let plain = ModelInput {
            input_ids: input.input_ids.clone().without_autodiff(),
            position_ids: input.position_ids.clone().map(Tensor::without_autodiff),
            attention_mask: input.attention_mask.clone().map(Tensor::without_autodiff),
            segment_ids: input.segment_ids.clone().map(Tensor::without_autodiff),
            parent_segment_ids: input
                .parent_segment_ids
                .clone()
                .map(Tensor::without_autodiff),
        };
        let (plain_context, _) = self.inner.layer_context(&plain, None)?;
        let recording = Recording {
            hook,
            routes: Mutex::new(BTreeMap::new()),
        };
        let mut routing = Vec::new();
        let embed = self.head.model.embed_tokens.val().without_autodiff();
        let mut hidden = embedding(embed, plain.input_ids.clone());
        let mut boundaries = Vec::with_capacity(self.plan.groups.len());
        for group in &self.plan.groups {
            boundaries.push(hidden.clone());
            for l in group.clone() {
                let layer = layer_in(&self.inner.model.layers[l], self.precision);
                hidden = layer_forward(
                    c,
                    l,
                    &layer,
                    hidden,
                    &recording,
                    &mut routing,
                    &mut |l, a, x| plain_context.attend(c, l, a, x, None),
                )?;
            }
        }
        let routes = recording
            .routes
            .into_inner()
            .map_err(|_| BridgeError::input("routing record poisoned"))?;
        let mut routing: Vec<MoeRouting> = routing
            .into_iter()
            .map(|r| MoeRouting {
                layer_index: r.layer_index,
                experts: r.experts.autodiff(),
                weights: r.weights.autodiff(),
            })
            .collect();
        let (context, _) = self.master.layer_context(input, None)?;
        let leaf = hidden.autodiff().require_grad();
        let mut hidden = leaf.clone();
        for l in self.plan.kept.clone() {
            let layer = layer_in(&self.master.model.layers[l], self.precision);
            hidden = layer_forward(c, l, &layer, hidden, hook, &mut routing, &mut |l, a, x| {
                context.attend(c, l, a, x, None)
            })?;
        }
        let hidden = self.head.model.norm.forward(hidden);
        self.passes.push(Pass {
            input: input.clone(),
            context,
            boundaries,
            routes,
            leaf,
        });
        Ok(HiddenOutput { hidden, routing })
    }

    /// The backward pass of `loss` (computed from the passes' hidden states): `loss`'s own
    /// backward, then each recomputed group's, last to first, then the embeddings'. The
    /// gradients of every stage, in that order; a parameter's gradient is the sum of its
    /// entries over them.
    pub fn backward(self, loss: Tensor<1>) -> Result<Vec<Gradients>, BridgeError> {
        let c = &self.master.config;
        let mut stages = Vec::with_capacity(self.plan.groups.len() + 2);
        let grads = loss.backward();
        let mut upstream: Vec<Option<Tensor<3>>> =
            self.passes.iter().map(|p| p.leaf.grad(&grads)).collect();
        stages.push(grads);
        for (g, group) in self.plan.groups.iter().enumerate().rev() {
            let layers: Vec<DecoderLayer> = group
                .clone()
                .map(|l| layer_in(&self.master.model.layers[l], self.precision))
                .collect();
            let mut total: Option<Tensor<1>> = None;
            let mut leaves = Vec::with_capacity(self.passes.len());
            for (pass, up) in self.passes.iter().zip(&upstream) {
                let Some(up) = up else {
                    leaves.push(None);
                    continue;
                };
                let leaf = pass.boundaries[g].clone().autodiff().require_grad();
                let replay = Recorded(&pass.routes);
                let mut routing = Vec::new();
                let mut hidden = leaf.clone();
                for (layer, l) in layers.iter().zip(group.clone()) {
                    hidden = layer_forward(
                        c,
                        l,
                        layer,
                        hidden,
                        &replay,
                        &mut routing,
                        &mut |l, a, x| pass.context.attend(c, l, a, x, None),
                    )?;
                }
                let term = (hidden * up.clone()).sum();
                total = Some(match total {
                    Some(t) => t + term,
                    None => term,
                });
                leaves.push(Some(leaf));
            }
            let Some(total) = total else {
                return Ok(stages);
            };
            let grads = total.backward();
            upstream = leaves
                .iter()
                .map(|l| l.as_ref().and_then(|l| l.grad(&grads)))
                .collect();
            stages.push(grads);
        }
        let embed = self.master.model.embed_tokens.val();
        let embed = if Precision::of_dtype(embed.dtype()) == Some(self.precision) {
            embed
        } else {
            embed.cast(self.precision.float_dtype())
        };
        let mut total: Option<Tensor<1>> = None;
        for (pass, up) in self.passes.iter().zip(&upstream) {
            if let Some(up) = up {
                let term =
                    (embedding(embed.clone(), pass.input.input_ids.clone()) * up.clone()).sum();
                total = Some(match total {
                    Some(t) => t + term,
                    None => term,
                });
            }
        }
        if let Some(total) = total {
            stages.push(total.backward());
        }
        Ok(stages)
    }
}
