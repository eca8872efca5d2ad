//! The forward passes of [`CausalLm`]: training / scoring over padded or packed batches
//! ([`CausalLm::forward`], [`CausalLm::forward_hidden`]) and inference with a contiguous
//! [`KvCache`] ([`CausalLm::forward_cached`]), all through one decoder loop that asks a
//! [`RouterHook`] for every MoE layer's experts.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use miles_r3::RouterHook;

use crate::config::ModelConfig;
use crate::error::BridgeError;
use crate::kv_cache::KvCache;
use crate::model::causal_lm::CausalLm;
use crate::nn::attention::{attention_mask, sliding_window_mask, sliding_window_mask_by_position};
use crate::nn::gated_delta::GatedDeltaNet;
use crate::nn::layer::{DecoderLayer, FeedForward, SelfAttention};
use crate::nn::moe::MoeRouting;
use crate::nn::rope::Rope;
use crate::profile::{self, OpClass};

/// Input of one forward pass over a padded or packed batch.
#[derive(Debug, Clone)]
pub struct ModelInput {
    /// Token ids, `[batch, seq]`.
    pub input_ids: Tensor<2, Int>,
    /// RoPE positions, `[batch, seq]`; default `0..seq` in every row (or, with a cache,
    /// continuing from the cached length).
    pub position_ids: Option<Tensor<2, Int>>,
    /// Real-token mask, `[batch, seq]` (false = padding, never attended to).
    pub attention_mask: Option<Tensor<2, Bool>>,
    /// Packed-sequence segment ids, `[batch, seq]`: tokens attend only within their segment.
    /// Not combinable with a KV cache.
    pub segment_ids: Option<Tensor<2, Int>>,
    /// Shared-prefix rows (with `segment_ids` and `position_ids`), `[batch, seq]`: the one
    /// segment whose keys each token may see besides its own (a response's prompt; a token
    /// whose parent is its own segment sees only that segment). A key is then visible when it
    /// is not after the query in the row, not padding, and in the query's segment or its
    /// parent; a sliding window is measured by position. Not combinable with a KV cache or
    /// linear-attention layers (their recurrent state runs along the row).
    pub parent_segment_ids: Option<Tensor<2, Int>>,
}

impl ModelInput {
    /// Plain causal input: every row one sequence starting at position 0.
    pub fn new(input_ids: Tensor<2, Int>) -> Self {
        Self {
            input_ids,
            position_ids: None,
            attention_mask: None,
            segment_ids: None,
            parent_segment_ids: None,
        }
    }
}

/// Output of a forward pass.
#[derive(Debug, Clone)]
pub struct ModelOutput {
    /// Next-token logits, `[batch, seq, vocab]`.
    pub logits: Tensor<3>,
    /// One entry per MoE layer, in layer order.
    pub routing: Vec<MoeRouting>,
}

/// Output of [`CausalLm::forward_hidden`].
#[derive(Debug, Clone)]
pub struct HiddenOutput {
    /// Final-norm hidden states, `[batch, seq, hidden]` (the input of `lm_head`).
    pub hidden: Tensor<3>,
    /// One entry per MoE layer, in layer order.
    pub routing: Vec<MoeRouting>,
}

/// What every decoder layer of one forward reads besides its input: the attention masks,
/// the RoPE tables and the linear-attention layers' padding and packed segments.
#[derive(Debug, Clone)]
pub(crate) struct LayerContext {
    mask: Tensor<4, Bool>,
    sliding_mask: Option<Tensor<4, Bool>>,
    rope: Rope,
    linear_valid: Option<Tensor<2, Bool>>,
    segments: Option<Vec<Vec<(usize, usize)>>>,
}

/// What a cached forward writes back into its [`KvCache`] after the layers.
#[derive(Debug)]
pub(crate) struct CacheUpdate {
    start: Tensor<2, Int>,
    valid: Tensor<2, Bool>,
    key_valid: Tensor<2, Bool>,
}

impl LayerContext {
    /// Layer `l`'s attention over its normed input `x` (appending to `cache` when given).
    pub(crate) fn attend(
        &self,
        config: &ModelConfig,
        l: usize,
        attention: &SelfAttention,
        x: Tensor<3>,
        cache: Option<&mut KvCache>,
    ) -> Tensor<3> {
        if let SelfAttention::Linear(linear) = attention {
            return match (&self.segments, cache) {
                (Some(runs), _) => linear_by_segments(linear, x, runs),
                (None, Some(c)) => {
                    linear.forward(x, self.linear_valid.clone(), Some(&mut c.linear[l]))
                }
                (None, None) => linear.forward(x, self.linear_valid.clone(), None),
            };
        }
        let slot = cache.map(|c| &mut c.layers[l]);
        let layer_mask = match (&self.sliding_mask, config.layer_window(l)) {
            (Some(sliding), Some(_)) => sliding.clone(),
            _ => self.mask.clone(),
        };
        attention.forward(x, &self.rope, layer_mask, slot)
    }
}

impl CausalLm {
    fn check_input(&self, input: &ModelInput) -> Result<[usize; 2], BridgeError> {
        let dims = input.input_ids.dims();
        for (name, other) in [
            (
                "position_ids",
                input.position_ids.as_ref().map(Tensor::dims),
            ),
            (
                "attention_mask",
                input.attention_mask.as_ref().map(Tensor::dims),
            ),
            ("segment_ids", input.segment_ids.as_ref().map(Tensor::dims)),
            (
                "parent_segment_ids",
                input.parent_segment_ids.as_ref().map(Tensor::dims),
            ),
        ] {
            if let Some(other) = other
                && other != dims
            {
                return Err(BridgeError::input(format!(
                    "{name} has shape {other:?}, input_ids {dims:?}"
                )));
            }
        }
        if dims[0] == 0 || dims[1] == 0 {
            return Err(BridgeError::input("empty batch"));
        }
        if input.parent_segment_ids.is_some() {
            if input.segment_ids.is_none() || input.position_ids.is_none() {
                return Err(BridgeError::input(
                    "parent_segment_ids needs segment_ids and position_ids",
                ));
            }
            if self.config.linear_attention.is_some() {
                return Err(BridgeError::input(
                    "shared-prefix rows (parent_segment_ids) cannot run linear-attention \
                     layers: their recurrent state runs along the row, through every response",
                ));
            }
        }
        Ok(dims)
    }

    /// Training / scoring forward over a padded or packed batch (no cache).
    pub fn forward(
        &self,
        input: &ModelInput,
        hook: &dyn RouterHook,
    ) -> Result<ModelOutput, BridgeError> {
        self.run(input, None, hook)
    }

    /// Inference forward that appends to `cache` (prefill when empty, then decode steps).
    ///
    /// Rows may have different lengths: mark padding with `attention_mask = false` (padded
    /// keys are never attended to, in this step or later ones). Positions default to the
    /// number of real tokens each row has seen so far.
    pub fn forward_cached(
        &self,
        input: &ModelInput,
        cache: &mut KvCache,
        hook: &dyn RouterHook,
    ) -> Result<ModelOutput, BridgeError> {
        if input.segment_ids.is_some() || input.parent_segment_ids.is_some() {
            return Err(BridgeError::input(
                "segment_ids cannot be used with a KV cache",
            ));
        }
        self.run(input, Some(cache), hook)
    }

    /// [`CausalLm::forward_cached`] stopped before `lm_head`: the final-norm hidden states
    /// `[batch, seq, hidden]` and the routing, for callers that need the logits of a few
    /// positions only (an inference engine's prefill needs the last one; see
    /// [`CausalLm::logits`]).
    pub fn forward_cached_hidden(
        &self,
        input: &ModelInput,
        cache: &mut KvCache,
        hook: &dyn RouterHook,
    ) -> Result<HiddenOutput, BridgeError> {
        if input.segment_ids.is_some() || input.parent_segment_ids.is_some() {
            return Err(BridgeError::input(
                "segment_ids cannot be used with a KV cache",
            ));
        }
        self.run_hidden(input, Some(cache), hook)
    }

    /// `lm_head` applied to final-norm hidden states `[rows, hidden]`: logits `[rows, vocab]`
    /// (what [`CausalLm::forward`] computes for every position).
    pub fn logits(&self, hidden: Tensor<2>) -> Tensor<2> {
        profile::time(OpClass::LmHead, || {
            if let Some(packed) = &self.packed_lm_head {
                return packed.forward_all(hidden);
            }
            match &self.lm_head {
                Some(head) => head.forward(hidden),
                None => hidden.matmul(self.model.embed_tokens.val().transpose()),
            }
        })
    }

    /// Training / scoring forward that stops before `lm_head`: the final-norm hidden states
    /// `[batch, seq, hidden]` and the routing, for callers that compute log-probs from hidden
    /// states and [`CausalLm::lm_head_weight`] without materialising the logits (miles-ops'
    /// fused path).
    pub fn forward_hidden(
        &self,
        input: &ModelInput,
        hook: &dyn RouterHook,
    ) -> Result<HiddenOutput, BridgeError> {
        self.run_hidden(input, None, hook)
    }

    fn run(
        &self,
        input: &ModelInput,
        cache: Option<&mut KvCache>,
        hook: &dyn RouterHook,
    ) -> Result<ModelOutput, BridgeError> {
        let HiddenOutput { hidden, routing } = self.run_hidden(input, cache, hook)?;
        let [batch, seq, h] = hidden.dims();
        let logits = self.logits(hidden.reshape([batch * seq, h]));
        Ok(ModelOutput {
            logits: logits.reshape([batch, seq, self.config.vocab_size]),
            routing,
        })
    }

    fn run_hidden(
        &self,
        input: &ModelInput,
        mut cache: Option<&mut KvCache>,
        hook: &dyn RouterHook,
    ) -> Result<HiddenOutput, BridgeError> {
        let (context, update) = self.layer_context(input, cache.as_deref())?;
        let hidden = self.embed(input);
        let layers = self.model.layers.len();
        if let Some(cache) = cache.as_deref_mut() {
            if cache.layers.len() != layers {
                cache.layers = vec![None; layers];
            }
            if cache.linear.len() != layers {
                cache.linear = vec![None; layers];
            }
        }
        let out = self.decoder(hidden, hook, |l, attention, x| {
            context.attend(&self.config, l, attention, x, cache.as_deref_mut())
        })?;
        if let Some(cache) = cache {
            cache.next_position = Some(update.start + update.valid.int().sum_dim(1));
            cache.key_valid = Some(update.key_valid);
        }
        Ok(out)
    }

    /// The token embeddings of `input`, `[batch, seq, hidden]`.
    pub(crate) fn embed(&self, input: &ModelInput) -> Tensor<3> {
        profile::time(OpClass::Embed, || {
            miles_ops::embedding(self.model.embed_tokens.val(), input.input_ids.clone())
        })
    }

    /// Checks `input` and builds what every layer of its forward reads besides its input
    /// (masks, RoPE tables, linear-attention padding and segments), with what the cache's
    /// bookkeeping needs after the layers.
    pub(crate) fn layer_context(
        &self,
        input: &ModelInput,
        cache: Option<&KvCache>,
    ) -> Result<(LayerContext, CacheUpdate), BridgeError> {
        let [batch, seq] = self.check_input(input)?;
        let device = input.input_ids.device();
        let c = &self.config;
        let valid = input
            .attention_mask
            .clone()
            .unwrap_or_else(|| Tensor::<2, Int>::ones([batch, seq], &device).equal_elem(1));
        let past = cache.map_or(0, |cache| cache.len());
        let start = match cache.and_then(|c| c.next_position.clone()) {
            Some(next) if next.dims()[0] != batch => {
                return Err(BridgeError::input(format!(
                    "cache holds {} rows, input has {batch}",
                    next.dims()[0]
                )));
            }
            Some(next) => next,
            None => Tensor::<2, Int>::zeros([batch, 1], &device),
        };
        // Default positions: count of real tokens before each one (plus the cached ones).
        let positions = match &input.position_ids {
            Some(p) => p.clone(),
            None => {
                let counted = valid.clone().int().cumsum(1) - valid.clone().int();
                counted + start.clone()
            }
        };
        let key_valid = match cache.and_then(|c| c.key_valid.clone()) {
            Some(old) => Tensor::cat(vec![old.int(), valid.clone().int()], 1).equal_elem(1),
            None => valid.clone(),
        };
        let needs_key_mask = input.attention_mask.is_some() || past > 0;
        let (mask, rope) = profile::time(OpClass::Rope, || {
            (
                attention_mask(
                    batch,
                    seq,
                    past,
                    needs_key_mask.then(|| key_valid.clone()),
                    input.segment_ids.clone(),
                    input.parent_segment_ids.clone(),
                    &device,
                ),
                Rope::new(positions.clone(), c.inv_freq()),
            )
        });
        // Sliding layers (GPT-OSS) also hide the keys outside their window: by cache index,
        // or by position in shared-prefix rows (where a response continues its prompt's
        // positions after other responses in the row).
        let sliding_mask = c
            .sliding_window
            .filter(|_| c.sliding_layers.contains(&true))
            .map(|window| match &input.parent_segment_ids {
                Some(_) => sliding_window_mask_by_position(mask.clone(), positions.clone(), window),
                None => sliding_window_mask(mask.clone(), past, window),
            });
        // Linear-attention layers: padding zeroed as transformers does, packed segments run
        // one by one (each from a zero state).
        let hybrid = c.linear_attention.is_some();
        let linear_valid = input.attention_mask.clone().filter(|_| hybrid);
        let segments = match &input.segment_ids {
            Some(seg) if hybrid => Some(segment_runs(seg)?),
            _ => None,
        };
        Ok((
            LayerContext {
                mask,
                sliding_mask,
                rope,
                linear_valid,
                segments,
            },
            CacheUpdate {
                start,
                valid,
                key_valid,
            },
        ))
    }

    /// The decoder layers and the final norm over embedded `hidden` `[batch, seq, hidden]`,
    /// with each layer's attention computed by `attention(layer index, attention, normed
    /// input)`.
    pub(crate) fn decoder(
        &self,
        mut hidden: Tensor<3>,
        hook: &dyn RouterHook,
        mut attention: impl FnMut(usize, &SelfAttention, Tensor<3>) -> Tensor<3>,
    ) -> Result<HiddenOutput, BridgeError> {
        let mut routing = Vec::new();
        for (l, layer) in self.model.layers.iter().enumerate() {
            hidden = layer_forward(
                &self.config,
                l,
                layer,
                hidden,
                hook,
                &mut routing,
                &mut attention,
            )?;
        }
        Ok(HiddenOutput {
            hidden: profile::time(OpClass::Norm, || self.model.norm.forward(hidden)),
            routing,
        })
    }
}

/// Decoder layer `l` over `hidden` `[batch, seq, hidden]`: pre-norm attention (computed by
/// `attention(l, attention module, normed input)`) and pre-norm MLP, each with its residual;
/// an MoE layer's routing is appended to `routing`.
pub(crate) fn layer_forward(
    config: &ModelConfig,
    l: usize,
    layer: &DecoderLayer,
    hidden: Tensor<3>,
    hook: &dyn RouterHook,
    routing: &mut Vec<MoeRouting>,
    attention: &mut impl FnMut(usize, &SelfAttention, Tensor<3>) -> Tensor<3>,
) -> Result<Tensor<3>, BridgeError> {
    let [batch, seq, _] = hidden.dims();
    let normed = profile::time(OpClass::Norm, || {
        layer.input_layernorm.forward(hidden.clone())
    });
    let hidden = hidden + attention(l, &layer.self_attn, normed);
    let normed = profile::time(OpClass::Norm, || {
        layer
            .post_attention_layernorm
            .forward(hidden.clone())
            .reshape([batch * seq, config.hidden_size])
    });
    let mlp_out = match &layer.mlp {
        FeedForward::Dense(mlp) => profile::time(OpClass::DenseMlp, || mlp.forward(normed)),
        FeedForward::Moe(moe) => {
            let (out, r) = moe.forward(normed, hook)?;
            routing.push(r);
            out
        }
        FeedForward::BiasedMoe(moe) => {
            let (out, r) = moe.forward(normed, hook)?;
            routing.push(r);
            out
        }
    };
    Ok(hidden + mlp_out.reshape([batch, seq, config.hidden_size]))
}

/// Each row's runs of equal segment ids, as `(start, len)`.
fn segment_runs(segment_ids: &Tensor<2, Int>) -> Result<Vec<Vec<(usize, usize)>>, BridgeError> {
    let [rows, seq] = segment_ids.dims();
    let ids = segment_ids
        .clone()
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .map_err(|e| BridgeError::input(format!("segment_ids: {e:?}")))?;
    Ok((0..rows)
        .map(|r| {
            let row = &ids[r * seq..(r + 1) * seq];
            let mut runs = Vec::new();
            let mut start = 0;
            for t in 1..=seq {
                if t == seq || row[t] != row[start] {
                    runs.push((start, t - start));
                    start = t;
                }
            }
            runs
        })
        .collect())
}

/// A linear-attention layer over packed rows: every segment on its own (the conv and the
/// recurrent state start from zero at each segment), as separate sequences would be.
fn linear_by_segments(
    layer: &GatedDeltaNet,
    x: Tensor<3>,
    runs: &[Vec<(usize, usize)>],
) -> Tensor<3> {
    if runs.iter().all(|r| r.len() == 1) {
        return layer.forward(x, None, None);
    }
    let rows = runs
        .iter()
        .enumerate()
        .map(|(r, row_runs)| {
            let row = x.clone().narrow(0, r, 1);
            let parts = row_runs
                .iter()
                .map(|&(start, len)| layer.forward(row.clone().narrow(1, start, len), None, None))
                .collect();
            Tensor::cat(parts, 1)
        })
        .collect();
    Tensor::cat(rows, 0)
}

/// Builds `[batch, seq]` id tensors from host rows of equal length.
pub fn ids_tensor(rows: &[Vec<u32>], device: &Device) -> Result<Tensor<2, Int>, BridgeError> {
    let seq = rows.first().map_or(0, Vec::len);
    if rows.iter().any(|r| r.len() != seq) {
        return Err(BridgeError::input("rows of different lengths"));
    }
    let flat: Vec<i32> = rows.iter().flatten().map(|&t| t as i32).collect();
    Ok(Tensor::from_data(
        TensorData::new(flat, [rows.len(), seq]),
        device,
    ))
}
