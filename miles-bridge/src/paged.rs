//! A paged KV cache for an inference engine: one pool per layer, allocated once.
//!
//! [`PagedKvCache::new`] sizes every layer's pool from a token budget (an engine's
//! `--kv-token-budget`) and allocates it once; nothing grows afterwards. The pool is cut into
//! blocks of [`PagedKvCache::BLOCK`] positions. A sequence reserves the blocks for its whole
//! budget when it is admitted ([`PagedKvCache::reserve`]) and returns them when it leaves
//! ([`PagedKvCache::release`]), so sequences of any length share the pool without padding,
//! copies or fragmentation, and a decode step writes one slot per sequence in place.
//!
//! Layout (see [`miles_ops::paged`]): a layer's keys are `[kv_heads · slots, width]`, row
//! `h · slots + slot`; values alike (none for DeepSeek-V3's latent attention, whose "keys"
//! are the compressed latent plus the rope key). [`CausalLm::forward_paged`] runs a
//! step over a set of sequences: it writes the step's keys and values into their slots, then
//! attends straight from the pool on flex (`f32`, AVX-512F: the paged decode kernel, bit for
//! bit what one sequence alone computes), or gathers each sequence's keys into a contiguous
//! batch elsewhere (other devices and dtypes, several tokens per sequence, latent attention).
//!
//! A one-row [`KvCache`] moves in with [`PagedKvCache::load`] (a prefill, a reused prefix)
//! and out with [`PagedKvCache::export`] (for a prefix cache); both copy.
//!
//! **Hybrid models** (Qwen3.5: Gated DeltaNet linear-attention layers beside full-attention
//! ones): the full-attention layers keep their pools as above; every linear-attention layer
//! keeps one state slot per sequence instead — its conv window (the last `kernel − 1` inputs
//! of its conv channels) and its delta-rule state (`value_heads × key_head_dim ×
//! value_head_dim`, f32) — allocated once for `rows` sequences
//! ([`PagedKvCache::state_slots`]; [`PagedKvCache::state_bytes_per_row`] says what one costs).
//! [`PagedKvCache::reserve`] takes a free slot beside the blocks (and refuses when none is
//! free), zeroed; [`PagedKvCache::release`] returns it. A step runs each linear layer's
//! recurrent form (one token per sequence) or chunked form (several; a right-padded batch of
//! prompts row by row over its real tokens) from the rows' slots and
//! writes the states after the step back in place; [`PagedKvCache::load`] /
//! [`PagedKvCache::export`] copy the states with the keys. A state cannot be cut back to a
//! shorter prefix, so a cache moved out is reusable whole only (see [`KvCache::truncate`]).
//!
//! **GPT-OSS** (attention sinks, a sliding window on the layers `layer_types` marks): a step
//! attends as transformers does — a sliding layer's query at position `i` sees the keys
//! `i − window < j ≤ i`, and every head's softmax has its sink logit in the denominator. Those
//! layers gather their keys (a sliding layer only its window's) and attend with tensor ops on
//! every device: the flex decode kernel takes neither. Every position stays in the pool (the
//! blocks of positions that left a window are not freed before the sequence leaves), so
//! prefix reuse and [`PagedKvCache::export`] work as for any model.

use std::collections::HashMap;

use burn::tensor::module::embedding;
use burn::tensor::{DType, Device, Int, Tensor};
use miles_ops::paged::PageTable;
use miles_r3::RouterHook;

use crate::error::BridgeError;
use crate::kv_cache::{KvCache, LayerCache};
use crate::kv_pool::{LayerStep, PoolLayer, StepPlan, index_tensor, pool_rows};
use crate::model::causal_lm::CausalLm;
use crate::model::forward::{HiddenOutput, ModelOutput};
use crate::nn::attention::KvTarget;
use crate::nn::gated_delta::{GatedDeltaNet, LinearState};
use crate::nn::layer::SelfAttention;
use crate::nn::rope::Rope;
use crate::profile::{self, OpClass};
use crate::state_pool::{StateLayer, slot_bytes, slot_index};

/// A sequence's place in a [`PagedKvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowId(usize);

#[derive(Debug, Clone)]
struct Row {
    blocks: Vec<u32>,
    len: usize,
    /// Its state slot (hybrid models only).
    state: Option<u32>,
}

/// Per-layer KV pools allocated once from a token budget, shared by sequences through block
/// tables (module docs).
#[derive(Debug)]
pub struct PagedKvCache {
    /// Per decoder layer: the KV pool of an attention layer, `None` for a linear one.
    layers: Vec<Option<PoolLayer>>,
    /// Per decoder layer: the state slots of a linear-attention layer, `None` otherwise.
    states: Vec<Option<StateLayer>>,
    /// State slots per linear layer (0 without linear layers).
    state_slots: usize,
    free_states: Vec<u32>,
    slots: usize,
    free: Vec<u32>,
    rows: Vec<Option<Row>>,
    free_ids: Vec<usize>,
    dtype: DType,
    device: Device,
}

/// Bytes a pool may take at most (a guard against a budget that overflows, not a policy).
const MAX_POOL_BYTES: u128 = 1 << 40;

impl PagedKvCache {
    /// Positions per block.
    pub const BLOCK: usize = 16;

    /// Pools for `model`'s layers holding `tokens` positions for up to `rows` sequences at
    /// once (each sequence's last block may be partly used, so the pool has a spare block
    /// per sequence, at most as many spare blocks as `tokens` takes), in the dtype of the
    /// model's attention weights, on their device; for a hybrid model also `rows` state
    /// slots per linear-attention layer (module docs). The memory is allocated here, once.
    pub fn new(model: &CausalLm, tokens: usize, rows: usize) -> Result<Self, BridgeError> {
        if tokens == 0 || rows == 0 {
            return Err(BridgeError::input(
                "a paged KV cache needs a positive token budget and row count",
            ));
        }
        let state_slots = if Self::state_bytes_per_row(model) > 0 {
            rows
        } else {
            0
        };
        if state_slots > u32::MAX as usize {
            return Err(BridgeError::input(format!("{rows} state slots")));
        }
        let needed = tokens.div_ceil(Self::BLOCK);
        let blocks = needed
            .checked_add(rows.min(needed))
            .filter(|&b| b <= u32::MAX as usize)
            .ok_or_else(|| BridgeError::input(format!("KV budget of {tokens} tokens")))?;
        let slots = blocks * Self::BLOCK;
        let (shapes, dtype, device) = Self::layout(model);
        let elem = dtype.size() as u128;
        let bytes: u128 = shapes
            .iter()
            .flatten()
            .map(|&(h, w, v)| (h * w) as u128 * slots as u128 * elem * (1 + u128::from(v)))
            .sum::<u128>()
            + Self::state_bytes_per_row(model) as u128 * state_slots as u128;
        if bytes > MAX_POOL_BYTES {
            return Err(BridgeError::input(format!(
                "a KV budget of {tokens} tokens and {state_slots} state slots need {bytes} \
                 bytes of pool"
            )));
        }
        let layers = shapes
            .into_iter()
            .map(|shape| {
                shape.map(|(heads, width, has_values)| {
                    let pool = || Tensor::<2>::zeros([heads * slots, width], (&device, dtype));
                    PoolLayer {
                        keys: Some(pool()),
                        values: has_values.then(pool),
                        heads,
                        width,
                    }
                })
            })
            .collect();
        let states = model
            .model
            .layers
            .iter()
            .map(|layer| {
                linear_layer(&layer.self_attn)
                    .map(|linear| StateLayer::new(linear, state_slots, conv_dtype(linear), &device))
            })
            .collect();
        Ok(Self {
            layers,
            states,
            state_slots,
            free_states: (0..state_slots as u32).rev().collect(),
            slots,
            free: (0..blocks as u32).rev().collect(),
            rows: Vec::new(),
            free_ids: Vec::new(),
            dtype,
            device,
        })
    }

    /// Each layer's cache shape (heads, width, whether it stores values; `None` for a
    /// linear-attention layer), and the dtype and device of the pools: the model's attention
    /// weights'.
    #[allow(clippy::type_complexity)]
    fn layout(model: &CausalLm) -> (Vec<Option<(usize, usize, bool)>>, DType, Device) {
        let reference = model.lm_head_weight();
        let (device, mut dtype) = (reference.device(), reference.dtype());
        if let Some(a) = model.model.layers.iter().find_map(|l| match &l.self_attn {
            SelfAttention::Grouped(a) => Some(a),
            _ => None,
        }) {
            dtype = a.k_proj.weight.val().dtype();
        }
        let shapes = model
            .model
            .layers
            .iter()
            .map(|layer| {
                linear_layer(&layer.self_attn)
                    .is_none()
                    .then(|| layer.self_attn.cache_shape())
            })
            .collect();
        (shapes, dtype, device)
    }

    /// Bytes one cached position takes in the pools of `model` (keys and values of every
    /// attention layer, in the pools' dtype): what sizes a budget from a memory bound.
    pub fn bytes_per_token(model: &CausalLm) -> usize {
        let (shapes, dtype, _) = Self::layout(model);
        shapes
            .iter()
            .flatten()
            .map(|&(heads, width, values)| heads * width * (1 + usize::from(values)))
            .sum::<usize>()
            * dtype.size()
    }

    /// Bytes one sequence's state slot takes over every linear-attention layer of `model`
    /// (conv windows in the layers' dtype, recurrent states in f32); 0 for a model without
    /// linear attention. A slot's size does not depend on the sequence's length.
    pub fn state_bytes_per_row(model: &CausalLm) -> usize {
        model
            .model
            .layers
            .iter()
            .filter_map(|l| linear_layer(&l.self_attn))
            .map(|linear| slot_bytes(linear, conv_dtype(linear)))
            .sum()
    }

    /// Whether the pools have `model`'s layers and shapes.
    pub(crate) fn fits(&self, model: &CausalLm) -> bool {
        self.layers.len() == model.model.layers.len()
            && self.states.len() == model.model.layers.len()
            && model.model.layers.iter().enumerate().all(|(l, layer)| {
                match (
                    &self.layers[l],
                    &self.states[l],
                    linear_layer(&layer.self_attn),
                ) {
                    (None, Some(state), Some(linear)) => state.fits(linear),
                    (Some(pool), None, None) => {
                        let (heads, width, values) = layer.self_attn.cache_shape();
                        pool.heads == heads
                            && pool.width == width
                            && pool.values.is_some() == values
                    }
                    _ => false,
                }
            })
    }

    /// Bytes of the pools (keys and values of every attention layer, and the state slots of
    /// the linear-attention layers).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| {
                let tensors = 1 + usize::from(l.values.is_some());
                tensors * l.heads * l.width * self.slots * self.dtype.size()
            })
            .sum::<usize>()
            + self
                .states
                .iter()
                .flatten()
                .map(StateLayer::bytes)
                .sum::<usize>()
    }

    /// State slots per linear-attention layer: the most sequences the cache holds at once (0
    /// for a model without linear attention, whose sequences are bounded by blocks only).
    pub fn state_slots(&self) -> usize {
        self.state_slots
    }

    /// State slots no sequence holds.
    pub fn free_state_slots(&self) -> usize {
        self.free_states.len()
    }

    /// Positions the pool holds (all blocks).
    pub fn capacity(&self) -> usize {
        self.slots
    }

    /// Positions in blocks no sequence holds.
    pub fn free_tokens(&self) -> usize {
        self.free.len() * Self::BLOCK
    }

    /// Number of sequences holding blocks.
    pub fn active_rows(&self) -> usize {
        self.rows.iter().flatten().count()
    }

    /// Whether [`PagedKvCache::reserve`] of `tokens` would succeed now.
    pub fn can_reserve(&self, tokens: usize) -> bool {
        tokens.div_ceil(Self::BLOCK).max(1) <= self.free.len()
            && (self.state_slots == 0 || !self.free_states.is_empty())
    }

    /// Reserves blocks for `tokens` positions of a new, empty sequence, and for a hybrid
    /// model a state slot (zeroed). An error (nothing reserved) when the free blocks do not
    /// cover them or no state slot is free.
    pub fn reserve(&mut self, tokens: usize) -> Result<RowId, BridgeError> {
        let need = tokens.div_ceil(Self::BLOCK).max(1);
        if need > self.free.len() {
            return Err(BridgeError::input(format!(
                "KV pool: {tokens} positions requested, {} free",
                self.free_tokens()
            )));
        }
        if self.state_slots > 0 && self.free_states.is_empty() {
            return Err(BridgeError::input(format!(
                "KV pool: all {} linear-attention state slots are held",
                self.state_slots
            )));
        }
        let state = self.free_states.pop();
        if let Some(slot) = state {
            let index = slot_index(&[slot], &self.device);
            for layer in self.states.iter_mut().flatten() {
                layer.zero(index.clone());
            }
        }
        let blocks = self.free.split_off(self.free.len() - need);
        let row = Row {
            blocks,
            len: 0,
            state,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.rows[id] = Some(row);
                id
            }
            None => {
                self.rows.push(Some(row));
                self.rows.len() - 1
            }
        };
        Ok(RowId(id))
    }

    /// Returns a sequence's blocks to the pool (a no-op for an unknown row).
    pub fn release(&mut self, row: RowId) {
        if let Some(r) = self.rows.get_mut(row.0).and_then(Option::take) {
            self.free.extend(r.blocks.into_iter().rev());
            self.free_states.extend(r.state);
            self.free_ids.push(row.0);
        }
    }

    /// Releases every sequence.
    pub fn clear(&mut self) {
        for id in 0..self.rows.len() {
            self.release(RowId(id));
        }
    }

    /// Positions cached for `row` (0 for an unknown row).
    pub fn len(&self, row: RowId) -> usize {
        self.row(row).map_or(0, |r| r.len)
    }

    /// Whether `row` caches nothing.
    pub fn is_empty(&self, row: RowId) -> bool {
        self.len(row) == 0
    }

    /// Positions `row` may hold (its blocks).
    pub fn row_capacity(&self, row: RowId) -> usize {
        self.row(row).map_or(0, |r| r.blocks.len() * Self::BLOCK)
    }

    fn row(&self, row: RowId) -> Option<&Row> {
        self.rows.get(row.0).and_then(Option::as_ref)
    }

    fn checked_row(&self, row: RowId) -> Result<&Row, BridgeError> {
        self.row(row)
            .ok_or_else(|| BridgeError::input(format!("KV pool: no sequence {}", row.0)))
    }

    /// Copies a one-row `cache` (every key real, filled from position 0: a prefill or a
    /// reused prefix; for a hybrid model with the linear layers' states after its last
    /// position) into `row`, replacing what it held.
    pub fn load(&mut self, row: RowId, cache: &KvCache) -> Result<(), BridgeError> {
        let capacity = self.row_capacity(row);
        let r = self.checked_row(row)?.clone();
        let len = cache.len();
        if len == 0 {
            if let Some(slot) = r.state {
                let index = slot_index(&[slot], &self.device);
                for layer in self.states.iter_mut().flatten() {
                    layer.zero(index.clone());
                }
            }
            self.set_len(row, 0);
            return Ok(());
        }
        if cache.rows() != 1 || cache.valid_lens() != [len] {
            return Err(BridgeError::input(
                "KV pool: load takes a one-row cache without padding",
            ));
        }
        if len > capacity {
            return Err(BridgeError::input(format!(
                "KV pool: {len} positions into a sequence of {capacity}"
            )));
        }
        let table = PageTable {
            block: Self::BLOCK,
            blocks: vec![r.blocks],
            lens: vec![len],
        };
        // Every state first, so a cache that lacks one writes nothing.
        let mut states: Vec<(usize, LinearState)> = Vec::new();
        for (l, layer) in self.states.iter().enumerate() {
            if layer.is_none() {
                continue;
            }
            let state = cache
                .linear_state(l)
                .filter(|s| s.conv.dims()[0] == 1 && s.recurrent.dims()[0] == 1)
                .ok_or_else(|| {
                    BridgeError::input("KV pool: a cache without a linear layer's state")
                })?;
            states.push((l, state.clone()));
        }
        let mut indices: HashMap<usize, Tensor<1, Int>> = HashMap::new();
        for l in 0..self.layers.len() {
            let Some(pool) = self.layers[l].as_mut() else {
                continue;
            };
            let layer = cache
                .layer(l)
                .ok_or_else(|| BridgeError::input("KV pool: a cache with a missing layer"))?;
            let [_, heads, _, width] = layer.keys.dims();
            if heads != pool.heads || width != pool.width {
                return Err(BridgeError::input(
                    "KV pool: a cache of another model's shapes",
                ));
            }
            let index = indices
                .entry(heads)
                .or_insert_with(|| {
                    index_tensor(
                        pool_rows(&table, 0, 0..len, heads, self.slots).collect(),
                        &self.device,
                    )
                })
                .clone();
            pool.write(index.clone(), layer.keys, layer.values, self.dtype);
        }
        if let Some(slot) = r.state {
            let index = slot_index(&[slot], &self.device);
            for (l, state) in states {
                if let Some(layer) = self.states[l].as_mut() {
                    layer.write(index.clone(), state);
                }
            }
        }
        self.set_len(row, len);
        Ok(())
    }

    fn set_len(&mut self, row: RowId, len: usize) {
        if let Some(r) = self.rows.get_mut(row.0).and_then(Option::as_mut) {
            r.len = len;
        }
    }

    /// A one-row [`KvCache`] holding a copy of `row`'s positions.
    pub fn export(&self, row: RowId) -> Result<KvCache, BridgeError> {
        let r = self.checked_row(row)?;
        let len = r.len;
        if len == 0 {
            return Ok(KvCache::new());
        }
        let table = PageTable {
            block: Self::BLOCK,
            blocks: vec![r.blocks.clone()],
            lens: vec![len],
        };
        let layers = self
            .layers
            .iter()
            .map(|pool| {
                let Some(pool) = pool else {
                    // A linear-attention layer: no keys (its state is copied below).
                    return Some(None);
                };
                let index = index_tensor(
                    pool_rows(&table, 0, 0..len, pool.heads, self.slots).collect(),
                    &self.device,
                );
                let take = |t: &Option<Tensor<2>>| {
                    t.as_ref().map(|t| {
                        t.clone()
                            .select(0, index.clone())
                            .reshape([1, pool.heads, len, pool.width])
                    })
                };
                take(&pool.keys).map(|keys| {
                    Some(LayerCache {
                        keys,
                        values: take(&pool.values),
                    })
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| BridgeError::input("KV pool: a layer is being written"))?;
        let linear = match r.state {
            None => Vec::new(),
            Some(slot) => {
                let index = slot_index(&[slot], &self.device);
                self.states
                    .iter()
                    .map(|layer| match layer {
                        None => Ok(None),
                        Some(layer) => layer
                            .read(index.clone())
                            .map(Some)
                            .ok_or_else(|| BridgeError::input("KV pool: a state is being written")),
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        Ok(KvCache::from_filled_row(layers, linear, len, &self.device))
    }

    /// The plan of a step of `seq` new tokens for each of `rows`: their page table after the
    /// step and the slots the new tokens go to. Errors for unknown or repeated rows and for
    /// rows whose blocks cannot take `seq` more positions.
    pub(crate) fn plan(&self, rows: &[RowId], seq: usize) -> Result<StepPlan, BridgeError> {
        let mut seen = std::collections::HashSet::new();
        let mut blocks = Vec::with_capacity(rows.len());
        let mut past = Vec::with_capacity(rows.len());
        for &row in rows {
            if !seen.insert(row) {
                return Err(BridgeError::input(format!(
                    "KV pool: sequence {} twice in one step",
                    row.0
                )));
            }
            let r = self.checked_row(row)?;
            if r.len + seq > r.blocks.len() * Self::BLOCK {
                return Err(BridgeError::input(format!(
                    "KV pool: sequence {} is full ({} positions)",
                    row.0,
                    r.blocks.len() * Self::BLOCK
                )));
            }
            blocks.push(r.blocks.clone());
            past.push(r.len);
        }
        let table = PageTable {
            block: Self::BLOCK,
            blocks,
            lens: past.iter().map(|&p| p + seq).collect(),
        };
        Ok(StepPlan::new(
            table,
            past,
            seq,
            self.slots,
            self.device.clone(),
        ))
    }

    /// Records a step's new lengths (after [`CausalLm::forward_paged`] wrote them).
    pub(crate) fn commit(&mut self, rows: &[RowId], plan: &StepPlan) {
        for (row, &len) in rows.iter().zip(&plan.table.lens) {
            self.set_len(*row, len);
        }
    }

    /// The step view of layer `l` (`None` past the model's layers and for a linear layer),
    /// a layer with the sliding `window` (if any) and attention `sinks` (if true).
    pub(crate) fn layer<'a>(
        &'a mut self,
        l: usize,
        plan: &'a StepPlan,
        window: Option<usize>,
        sinks: bool,
    ) -> Option<LayerStep<'a>> {
        let dtype = self.dtype;
        self.layers
            .get_mut(l)
            .and_then(Option::as_mut)
            .map(|pool| LayerStep::new(pool, plan, dtype, window, sinks))
    }

    /// The state slots of `rows` (in that order) as an index tensor; `None` for a model
    /// without linear attention.
    fn state_index(&self, rows: &[RowId]) -> Result<Option<Tensor<1, Int>>, BridgeError> {
        if self.state_slots == 0 {
            return Ok(None);
        }
        let slots = rows
            .iter()
            .map(|&row| {
                self.checked_row(row)?.state.ok_or_else(|| {
                    BridgeError::input(format!("KV pool: sequence {} has no state slot", row.0))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(slot_index(&slots, &self.device)))
    }

    /// Linear-attention layer `l` over `x` `[rows, seq, hidden]` from the states in the slots
    /// `index`, which then hold the states after the step (with `lens`, after each row's
    /// last real token: [`GatedDeltaNet::forward_ragged`]).
    fn linear_step(
        &mut self,
        l: usize,
        index: &Tensor<1, Int>,
        layer: &GatedDeltaNet,
        x: Tensor<3>,
        lens: Option<&[usize]>,
    ) -> Tensor<3> {
        let Some(states) = self.states.get_mut(l).and_then(Option::as_mut) else {
            // `fits` checked that every linear layer has its slots.
            unreachable!("state slots for every linear-attention layer")
        };
        let mut state = states.read(index.clone());
        let out = match lens {
            Some(lens) => layer.forward_ragged(x, lens, Some(&mut state)),
            None => layer.forward(x, None, Some(&mut state)),
        };
        if let Some(state) = state {
            states.write(index.clone(), state);
        }
        out
    }
}

/// The Gated DeltaNet layer of a linear-attention decoder layer.
fn linear_layer(attention: &SelfAttention) -> Option<&GatedDeltaNet> {
    match attention {
        SelfAttention::Linear(linear) => Some(linear),
        _ => None,
    }
}

/// The dtype a linear layer's conv window is kept in: its compute dtype (its weights').
fn conv_dtype(layer: &GatedDeltaNet) -> DType {
    layer.in_proj_qkv.weight.val().dtype()
}

impl CausalLm {
    /// One inference step over sequences held in a paged KV cache ([`PagedKvCache`]):
    /// `input_ids` `[rows.len(), seq]` are the next `seq` tokens of each of `rows`, at the
    /// positions that follow what each row has cached. Their keys / values are written into
    /// the rows' blocks and the rows' lengths grow by `seq`. Logits of every position and the
    /// routing, as [`CausalLm::forward_cached`]. Errors (nothing written) for unknown or
    /// repeated rows, rows whose blocks are full, or a cache built for another model.
    pub fn forward_paged(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut PagedKvCache,
        rows: &[RowId],
        hook: &dyn RouterHook,
    ) -> Result<ModelOutput, BridgeError> {
        let [batch, seq] = input_ids.dims();
        let HiddenOutput { hidden, routing } =
            self.forward_paged_hidden(input_ids, cache, rows, None, hook)?;
        let h = self.config.hidden_size;
        let logits = self.logits(hidden.reshape([batch * seq, h]));
        Ok(ModelOutput {
            logits: logits.reshape([batch, seq, self.config.vocab_size]),
            routing,
        })
    }

    /// [`CausalLm::forward_paged`] stopped before `lm_head` (the final-norm hidden states
    /// `[rows.len(), seq, hidden]` and the routing of every position), for a batched prefill
    /// that needs the logits of each row's last token only ([`CausalLm::logits`]).
    ///
    /// `lens` (one per row, each in `1..=seq`): the number of real tokens of each row, the
    /// rest of its `seq` being right padding (a ragged batch of prompts). Padding keys are
    /// written past a row's real positions (so each row's blocks must hold `seq` more
    /// positions) but the row's length grows by its real count only: later steps overwrite
    /// them and never attend to them, and no real token attends to them (they come after it).
    /// A model with linear-attention layers runs each row's conv and delta rule over its real
    /// tokens only ([`GatedDeltaNet::forward_ragged`]), so each state slot holds the state
    /// after the row's last real token.
    pub fn forward_paged_hidden(
        &self,
        input_ids: Tensor<2, Int>,
        cache: &mut PagedKvCache,
        rows: &[RowId],
        lens: Option<&[usize]>,
        hook: &dyn RouterHook,
    ) -> Result<HiddenOutput, BridgeError> {
        let [batch, seq] = input_ids.dims();
        if batch == 0 || seq == 0 || batch != rows.len() {
            return Err(BridgeError::input(format!(
                "paged step: input {:?} for {} rows",
                [batch, seq],
                rows.len()
            )));
        }
        if let Some(lens) = lens
            && (lens.len() != batch || lens.iter().any(|&n| n == 0 || n > seq))
        {
            return Err(BridgeError::input(format!(
                "paged step: real lengths {lens:?} for {batch} rows of {seq} tokens"
            )));
        }
        if !cache.fits(self) {
            return Err(BridgeError::input(
                "paged step: the KV pool was built for another model",
            ));
        }
        let plan = cache.plan(rows, seq)?;
        let states = cache.state_index(rows)?;
        let rope = profile::time(OpClass::Rope, || {
            Rope::new(plan.positions(), self.config.inv_freq())
        });
        let hidden = profile::time(OpClass::Embed, || {
            embedding(self.model.embed_tokens.val(), input_ids)
        });
        let HiddenOutput { hidden, routing } = self.decoder(hidden, hook, |l, attention, x| {
            if let (SelfAttention::Linear(linear), Some(index)) = (attention, &states) {
                return cache.linear_step(l, index, linear, x, lens);
            }
            // GPT-OSS: a sliding window on the layers `layer_types` marks, sinks on every
            // layer.
            let sinks = matches!(attention, SelfAttention::Grouped(a) if a.sinks.is_some());
            match cache.layer(l, &plan, self.config.layer_window(l), sinks) {
                Some(step) => attention.forward_kv(x, &rope, KvTarget::Paged(step)),
                // `fits` checked the layer count and kinds.
                None => unreachable!("a pool layer per attention layer"),
            }
        })?;
        cache.commit(rows, &plan);
        if let Some(lens) = lens {
            for ((&row, &len), &past) in rows.iter().zip(lens).zip(&plan.past) {
                cache.set_len(row, past + len);
            }
        }
        Ok(HiddenOutput { hidden, routing })
    }
}
