//! The per-layer pools of a paged KV cache and one step's view of them: [`PoolLayer`] (a
//! layer's keys / values, `[heads · slots, width]`, written in place), [`StepPlan`] (the page
//! table, positions and mask of a step over a set of sequences) and [`LayerStep`] (what an
//! attention layer writes to and reads from in that step).

use std::cell::{OnceCell, RefCell};
use std::collections::HashMap;

use burn::tensor::{Bool, DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};
use miles_ops::paged::PageTable;

/// One layer's pool.
#[derive(Debug)]
pub(crate) struct PoolLayer {
    /// `[heads · slots, width]`; `None` only while a write holds it.
    pub(crate) keys: Option<Tensor<2>>,
    /// Like `keys`; `None` for a layer that stores no values (latent attention).
    pub(crate) values: Option<Tensor<2>>,
    /// Key / value heads.
    pub(crate) heads: usize,
    /// Channels of one cached position per head.
    pub(crate) width: usize,
}

/// Pool rows of positions `range` of sequence `b` for every head, in `(head, position)`
/// order: the order of a `[heads, positions, width]` block of keys.
pub(crate) fn pool_rows(
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
pub(crate) fn index_tensor(index: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = index.len();
    Tensor::from_data(TensorData::new(index, [n]), device)
}

impl PoolLayer {
    /// Writes `keys` / `values` `[batch, heads, seq, width]` at pool rows `index` (in
    /// `(batch, head, position)` order), in place.
    pub(crate) fn write(
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
    writes: RefCell<HashMap<usize, Tensor<1, Int>>>,
    gathers: RefCell<HashMap<usize, Tensor<1, Int>>>,
    mask: OnceCell<Tensor<4, Bool>>,
}

impl StepPlan {
    /// The plan of a step of `seq` new tokens for sequences that hold `past` positions each,
    /// `table` their page table after the step, over a pool of `slots` positions.
    pub(crate) fn new(
        table: PageTable,
        past: Vec<usize>,
        seq: usize,
        slots: usize,
        device: Device,
    ) -> Self {
        Self {
            table,
            past,
            seq,
            slots,
            device,
            writes: Default::default(),
            gathers: Default::default(),
            mask: OnceCell::new(),
        }
    }

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

impl<'a> LayerStep<'a> {
    /// Layer `pool`'s view of the step `plan`, in the pool's `dtype`.
    pub(crate) fn new(pool: &'a mut PoolLayer, plan: &'a StepPlan, dtype: DType) -> Self {
        Self { pool, plan, dtype }
    }

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
