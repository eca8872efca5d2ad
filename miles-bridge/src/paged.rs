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
//! are the compressed latent plus the rope key). [`crate::CausalLm::forward_paged`] runs a
//! step over a set of sequences: it writes the step's keys and values into their slots, then
//! attends straight from the pool on flex (`f32`, AVX-512F: the paged decode kernel, bit for
//! bit what one sequence alone computes), or gathers each sequence's keys into a contiguous
//! batch elsewhere (other devices and dtypes, several tokens per sequence, latent attention).
//!
//! A one-row [`KvCache`] moves in with [`PagedKvCache::load`] (a prefill, a reused prefix)
//! and out with [`PagedKvCache::export`] (for a prefix cache); both copy.

use std::cell::OnceCell;
use std::collections::HashMap;

use burn::tensor::{Bool, DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};
use miles_ops::paged::PageTable;

use crate::error::BridgeError;
use crate::model::{CausalLm, KvCache, SelfAttention};
use crate::nn::LayerCache;

/// A sequence's place in a [`PagedKvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowId(usize);

#[derive(Debug, Clone)]
struct Row {
    blocks: Vec<u32>,
    len: usize,
}

/// One layer's pool.
#[derive(Debug)]
pub(crate) struct PoolLayer {
    /// `[heads · slots, width]`; `None` only while a write holds it.
    keys: Option<Tensor<2>>,
    values: Option<Tensor<2>>,
    heads: usize,
    width: usize,
}

/// Per-layer KV pools allocated once from a token budget, shared by sequences through block
/// tables (module docs).
#[derive(Debug)]
pub struct PagedKvCache {
    layers: Vec<PoolLayer>,
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
    /// model's attention weights, on their device. The memory is allocated here, once.
    pub fn new(model: &CausalLm, tokens: usize, rows: usize) -> Result<Self, BridgeError> {
        if tokens == 0 || rows == 0 {
            return Err(BridgeError::input(
                "a paged KV cache needs a positive token budget and row count",
            ));
        }
        let needed = tokens.div_ceil(Self::BLOCK);
        let blocks = needed
            .checked_add(rows.min(needed))
            .filter(|&b| b <= u32::MAX as usize)
            .ok_or_else(|| BridgeError::input(format!("KV budget of {tokens} tokens")))?;
        let slots = blocks * Self::BLOCK;
        let reference = model.lm_head_weight();
        let (device, mut dtype) = (reference.device(), reference.dtype());
        if let Some(SelfAttention::Grouped(a)) = model.model.layers.first().map(|l| &l.self_attn) {
            dtype = a.k_proj.weight.val().dtype();
        }
        let shapes: Vec<(usize, usize, bool)> = model
            .model
            .layers
            .iter()
            .map(|layer| layer.self_attn.cache_shape())
            .collect();
        let elem = dtype.size() as u128;
        let bytes: u128 = shapes
            .iter()
            .map(|&(h, w, v)| (h * w) as u128 * slots as u128 * elem * (1 + u128::from(v)))
            .sum();
        if bytes > MAX_POOL_BYTES {
            return Err(BridgeError::input(format!(
                "a KV budget of {tokens} tokens needs {bytes} bytes of pool"
            )));
        }
        let layers = shapes
            .into_iter()
            .map(|(heads, width, has_values)| {
                let pool = || Tensor::<2>::zeros([heads * slots, width], (&device, dtype));
                PoolLayer {
                    keys: Some(pool()),
                    values: has_values.then(pool),
                    heads,
                    width,
                }
            })
            .collect();
        Ok(Self {
            layers,
            slots,
            free: (0..blocks as u32).rev().collect(),
            rows: Vec::new(),
            free_ids: Vec::new(),
            dtype,
            device,
        })
    }

    /// Whether the pools have `model`'s layers and shapes.
    pub(crate) fn fits(&self, model: &CausalLm) -> bool {
        self.layers.len() == model.model.layers.len()
            && self
                .layers
                .iter()
                .zip(&model.model.layers)
                .all(|(pool, layer)| {
                    let (heads, width, values) = layer.self_attn.cache_shape();
                    pool.heads == heads && pool.width == width && pool.values.is_some() == values
                })
    }

    /// Bytes of the pools (keys and values of every layer).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let tensors = 1 + usize::from(l.values.is_some());
                tensors * l.heads * l.width * self.slots * self.dtype.size()
            })
            .sum()
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
    }

    /// Reserves blocks for `tokens` positions of a new, empty sequence. An error (nothing
    /// reserved) when the free blocks do not cover them.
    pub fn reserve(&mut self, tokens: usize) -> Result<RowId, BridgeError> {
        let need = tokens.div_ceil(Self::BLOCK).max(1);
        if need > self.free.len() {
            return Err(BridgeError::input(format!(
                "KV pool: {tokens} positions requested, {} free",
                self.free_tokens()
            )));
        }
        let blocks = self.free.split_off(self.free.len() - need);
        let row = Row { blocks, len: 0 };
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
    /// reused prefix) into `row`, replacing what it held.
    pub fn load(&mut self, row: RowId, cache: &KvCache) -> Result<(), BridgeError> {
        let capacity = self.row_capacity(row);
        let r = self.checked_row(row)?.clone();
        let len = cache.len();
        if len == 0 {
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
        let mut indices: HashMap<usize, Tensor<1, Int>> = HashMap::new();
        for l in 0..self.layers.len() {
            let layer = cache
                .layer(l)
                .ok_or_else(|| BridgeError::input("KV pool: a cache with a missing layer"))?;
            let pool = &mut self.layers[l];
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
                take(&pool.keys).map(|keys| LayerCache {
                    keys,
                    values: take(&pool.values),
                })
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| BridgeError::input("KV pool: a layer is being written"))?;
        Ok(KvCache::from_filled_row(layers, len, &self.device))
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
        Ok(StepPlan {
            table: PageTable {
                block: Self::BLOCK,
                blocks,
                lens: past.iter().map(|&p| p + seq).collect(),
            },
            past,
            seq,
            slots: self.slots,
            device: self.device.clone(),
            writes: Default::default(),
            gathers: Default::default(),
            mask: OnceCell::new(),
        })
    }

    /// Records a step's new lengths (after [`crate::CausalLm::forward_paged`] wrote them).
    pub(crate) fn commit(&mut self, rows: &[RowId], plan: &StepPlan) {
        for (row, &len) in rows.iter().zip(&plan.table.lens) {
            self.set_len(*row, len);
        }
    }

    /// The step view of layer `l` (`None` past the model's layers).
    pub(crate) fn layer<'a>(&'a mut self, l: usize, plan: &'a StepPlan) -> Option<LayerStep<'a>> {
        let dtype = self.dtype;
        self.layers
            .get_mut(l)
            .map(|pool| LayerStep { pool, plan, dtype })
    }
}

/// Pool rows of positions `range` of sequence `b` for every head, in `(head, position)`
/// order: the order of a `[heads, positions, width]` block of keys.
fn pool_rows(
    table: &PageTable,
    b: usize,
    range: std::ops::Range<usize>,
    heads: usize,
    slots: usize,
) -> impl Iterator<Item = i32> + '_ {
    (0..heads).flat_map(move |h| {
        range
            .clone()
            .map(move |p| (h * slots + table.slot(b, p)) as i32)
    })
}

/// An index tensor of pool rows.
fn index_tensor(index: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = index.len();
    Tensor::from_data(TensorData::new(index, [n]), device)
}

impl PoolLayer {
    /// Writes `keys` / `values` `[batch, heads, seq, width]` at pool rows `index` (in
    /// `(batch, head, position)` order), in place.
    fn write(
        &mut self,
        index: Tensor<1, Int>,
        keys: Tensor<4>,
        values: Option<Tensor<4>>,
        dtype: DType,
    ) {
        let put = |pool: &mut Option<Tensor<2>>, new: Tensor<4>, index: Tensor<1, Int>| {
            let [b, h, s, w] = new.dims();
            let new = new.reshape([b * h * s, w]);
            let new = if new.dtype() == dtype {
                new
            } else {
                new.cast(dtype)
            };
            // Taken out so the pool is the only handle: burn then assigns in place.
            if let Some(t) = pool.take() {
                *pool = Some(t.select_assign(0, index, new, IndexingUpdateOp::Assign));
            }
        };
        put(&mut self.keys, keys, index.clone());
        if let Some(v) = values {
            put(&mut self.values, v, index);
        }
    }
}

/// What one step over a set of sequences needs in every layer.
#[derive(Debug)]
pub(crate) struct StepPlan {
    pub(crate) table: PageTable,
    pub(crate) past: Vec<usize>,
    pub(crate) seq: usize,
    slots: usize,
    device: Device,
    writes: std::cell::RefCell<HashMap<usize, Tensor<1, Int>>>,
    gathers: std::cell::RefCell<HashMap<usize, Tensor<1, Int>>>,
    mask: OnceCell<Tensor<4, Bool>>,
}

impl StepPlan {
    /// Positions of the step's tokens, `[batch, seq]`.
    pub(crate) fn positions(&self) -> Tensor<2, Int> {
        let batch = self.past.len();
        let data: Vec<i32> = self
            .past
            .iter()
            .flat_map(|&p| (p..p + self.seq).map(|x| x as i32))
            .collect();
        Tensor::from_data(TensorData::new(data, [batch, self.seq]), &self.device)
    }

    fn write_index(&self, heads: usize) -> Tensor<1, Int> {
        self.writes
            .borrow_mut()
            .entry(heads)
            .or_insert_with(|| {
                // `(sequence, head, position)`: the order of the step's `[batch, heads, seq,
                // width]` keys.
                let index = self
                    .past
                    .iter()
                    .enumerate()
                    .flat_map(|(b, &p)| {
                        pool_rows(&self.table, b, p..p + self.seq, heads, self.slots)
                    })
                    .collect();
                index_tensor(index, &self.device)
            })
            .clone()
    }

    fn gather_index(&self, heads: usize) -> Tensor<1, Int> {
        self.gathers
            .borrow_mut()
            .entry(heads)
            .or_insert_with(|| {
                miles_ops::paged::gather_index(&self.table, heads, self.slots, &self.device)
            })
            .clone()
    }

    /// The longest sequence after the step.
    fn total(&self) -> usize {
        self.table.lens.iter().copied().max().unwrap_or(0)
    }

    /// `[batch, 1, seq, total]`, true where query `i` of a sequence must not see key `p`:
    /// past its own position or past its length.
    pub(crate) fn mask(&self) -> Tensor<4, Bool> {
        self.mask
            .get_or_init(|| {
                let (batch, total) = (self.past.len(), self.total());
                let mut data = Vec::with_capacity(batch * self.seq * total);
                for &p in &self.past {
                    for i in 0..self.seq {
                        data.extend((0..total).map(|k| k > p + i));
                    }
                }
                Tensor::from_data(
                    TensorData::new(data, [batch, 1, self.seq, total]),
                    &self.device,
                )
            })
            .clone()
    }
}

/// One layer of a paged step: the layer's pool and the step's plan.
pub(crate) struct LayerStep<'a> {
    pool: &'a mut PoolLayer,
    plan: &'a StepPlan,
    dtype: DType,
}

impl LayerStep<'_> {
    /// Writes the step's keys / values `[batch, heads, seq, width]` into their slots.
    pub(crate) fn write(&mut self, keys: Tensor<4>, values: Option<Tensor<4>>) {
        let index = self.plan.write_index(self.pool.heads);
        self.pool.write(index, keys, values, self.dtype);
    }

    /// The paged decode kernel's attention for `q` `[batch, heads, 1, width]` when it applies
    /// (flex, `f32`, AVX-512F, one token per sequence, a layer with values); `None` otherwise.
    pub(crate) fn decode(&self, q: &Tensor<4>, scale: f32) -> Option<Tensor<4>> {
        let (keys, values) = (self.pool.keys.as_ref()?, self.pool.values.as_ref()?);
        if self.plan.seq != 1 || !miles_ops::paged::applies(&q.device(), q.dtype(), self.pool.width)
        {
            return None;
        }
        miles_ops::paged::paged_decode(
            q.clone(),
            keys.clone(),
            values.clone(),
            self.pool.heads,
            &self.plan.table,
            scale,
        )
        .ok()
    }

    /// Every sequence's keys / values after the step, gathered into `[batch, heads, total,
    /// width]` (positions past a sequence's length masked by [`StepPlan::mask`]).
    pub(crate) fn gather(&self) -> Option<(Tensor<4>, Option<Tensor<4>>)> {
        let index = self.plan.gather_index(self.pool.heads);
        let (batch, total) = (self.plan.past.len(), self.plan.total());
        let shape = [batch, self.pool.heads, total, self.pool.width];
        let take = |t: &Tensor<2>| t.clone().select(0, index.clone()).reshape(shape);
        let keys = take(self.pool.keys.as_ref()?);
        Some((keys, self.pool.values.as_ref().map(take)))
    }

    /// See [`StepPlan::mask`].
    pub(crate) fn mask(&self) -> Tensor<4, Bool> {
        self.plan.mask()
    }
}
