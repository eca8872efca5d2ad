//! The per-layer pools of a paged KV cache and one step's view of them: [`PoolLayer`] (a
//! layer's keys / values, `[heads · slots, width]`, written in place), [`StepPlan`] (the page
//! table, positions and mask of a step over a set of sequences) and [`LayerStep`] (what an
//! attention layer writes to and reads from in that step).
//!
//! A sliding-window layer (GPT-OSS' `sliding_attention`: a query at position `i` sees the keys
//! `i − window < j ≤ i`, transformers' mask) gathers and masks only the keys of its window, so
//! its step costs the window, not the sequence; the blocks of positions that left the window
//! stay allocated (a sequence's blocks are reserved for its whole budget at admission).

use std::cell::RefCell;
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

/// A gather index's key: (heads, sliding window).
type GatherKey = (usize, Option<usize>);

/// What one step over a set of sequences needs in every layer.
#[derive(Debug)]
pub(crate) struct StepPlan {
    pub(crate) table: PageTable,
    pub(crate) past: Vec<usize>,
    pub(crate) seq: usize,
    slots: usize,
    device: Device,
    writes: RefCell<HashMap<usize, Tensor<1, Int>>>,
    gathers: RefCell<HashMap<GatherKey, Tensor<1, Int>>>,
    /// Per window.
    masks: RefCell<HashMap<Option<usize>, Tensor<4, Bool>>>,
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
            masks: Default::default(),
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

    /// The first position each sequence's keys are gathered from: 0 without a window, else
    /// the first position the window of the step's first query reaches.
    fn starts(&self, window: Option<usize>) -> Vec<usize> {
        self.past
            .iter()
            .map(|&p| window.map_or(0, |w| (p + 1).saturating_sub(w)))
            .collect()
    }

    fn gather_index(&self, heads: usize, window: Option<usize>) -> Tensor<1, Int> {
        self.gathers
            .borrow_mut()
            .entry((heads, window))
            .or_insert_with(|| {
                miles_ops::paged::gather_index_from(
                    &self.table,
                    &self.starts(window),
                    heads,
                    self.slots,
                    &self.device,
                )
            })
            .clone()
    }

    /// The most keys a sequence gathers (its length past its start).
    fn total(&self, window: Option<usize>) -> usize {
        self.table
            .lens
            .iter()
            .zip(self.starts(window))
            .map(|(&len, start)| len.saturating_sub(start))
            .max()
            .unwrap_or(0)
    }

    /// `[batch, 1, seq, total]`, true where query `i` of a sequence must not see gathered key
    /// `k` (position `start + k`): past its own position, past the sequence's length, or, with
    /// a `window`, at or before its position minus the window.
    pub(crate) fn mask(&self, window: Option<usize>) -> Tensor<4, Bool> {
        self.masks
            .borrow_mut()
            .entry(window)
            .or_insert_with(|| {
                let (batch, total) = (self.past.len(), self.total(window));
                let mut data = Vec::with_capacity(batch * self.seq * total);
                for (&p, start) in self.past.iter().zip(self.starts(window)) {
                    for i in 0..self.seq {
                        let query = p + i;
                        data.extend(
                            (start..start + total)
                                .map(|key| key > query || window.is_some_and(|w| key + w <= query)),
                        );
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
    /// The layer's sliding window (`None`: full attention).
    window: Option<usize>,
    /// Whether the layer's softmax has attention sinks.
    sinks: bool,
}

impl<'a> LayerStep<'a> {
    /// Layer `pool`'s view of the step `plan`, in the pool's `dtype`, for a layer with the
    /// sliding `window` (if any) and attention `sinks` (if true).
    pub(crate) fn new(
        pool: &'a mut PoolLayer,
        plan: &'a StepPlan,
        dtype: DType,
        window: Option<usize>,
        sinks: bool,
    ) -> Self {
        Self {
            pool,
            plan,
            dtype,
            window,
            sinks,
        }
    }

    /// Writes the step's keys / values `[batch, heads, seq, width]` into their slots.
    pub(crate) fn write(&mut self, keys: Tensor<4>, values: Option<Tensor<4>>) {
        let index = self.plan.write_index(self.pool.heads);
        self.pool.write(index, keys, values, self.dtype);
    }

    /// The paged decode kernel's attention for `q` `[batch, heads, 1, width]` when it applies
    /// (flex, `f32`, AVX-512F, one token per sequence, a layer with values, without sinks or
    /// a sliding window, which the kernel does not take); `None` otherwise.
    pub(crate) fn decode(&self, q: &Tensor<4>, scale: f32) -> Option<Tensor<4>> {
        let (keys, values) = (self.pool.keys.as_ref()?, self.pool.values.as_ref()?);
        if self.plan.seq != 1
            || self.sinks
            || self.window.is_some()
            || !miles_ops::paged::applies(&q.device(), q.dtype(), self.pool.width)
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
    /// width]` (positions past a sequence's length masked by [`LayerStep::mask`]); for a
    /// sliding-window layer only the positions from the window of the step's first query on.
    pub(crate) fn gather(&self) -> Option<(Tensor<4>, Option<Tensor<4>>)> {
        let index = self.plan.gather_index(self.pool.heads, self.window);
        let (batch, total) = (self.plan.past.len(), self.plan.total(self.window));
        let shape = [batch, self.pool.heads, total, self.pool.width];
        let take = |t: &Tensor<2>| t.clone().select(0, index.clone()).reshape(shape);
        let keys = take(self.pool.keys.as_ref()?);
        Some((keys, self.pool.values.as_ref().map(take)))
    }

    /// The mask of the keys [`LayerStep::gather`] returns (see [`StepPlan::mask`]).
    pub(crate) fn mask(&self) -> Tensor<4, Bool> {
        self.plan.mask(self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sliding-window step gathers from its first query's window on and masks as
    /// transformers' `sliding_window_overlay` (`kv > q − window`) with the causal mask.
    #[test]
    fn window_gathers_and_masks_as_transformers() {
        let device = Device::flex();
        // Two sequences in blocks of 4 of a 16-slot pool: 5 cached + 2 new, 1 cached + 2 new.
        let table = PageTable {
            block: 4,
            blocks: vec![vec![2, 0], vec![1]],
            lens: vec![7, 3],
        };
        let plan = StepPlan::new(table, vec![5, 1], 2, 16, device);
        let window = Some(3);
        // Row 0: queries at 5 and 6 see 3..=5 and 4..=6; gathered from 5 + 1 − 3 = 3 on.
        // Row 1: queries at 1 and 2 see 0..=1 and 0..=2; gathered from 0.
        assert_eq!(plan.starts(window), [3, 0]);
        assert_eq!(plan.total(window), 4);
        let rows: Vec<i64> = plan
            .gather_index(1, window)
            .into_data()
            .convert::<i64>()
            .try_to_vec()
            .unwrap();
        // Positions 3, 4, 5, 6 of row 0: block 2 slot 3, then block 0 slots 0..3.
        // Positions 0, 1, 2 of row 1 (block 1), then padding.
        assert_eq!(rows, [11, 0, 1, 2, 4, 5, 6, 0]);
        let mask: Vec<bool> = plan.mask(window).into_data().try_to_vec().unwrap();
        let want = |q: usize, start: usize, len: usize| -> Vec<bool> {
            (start..start + 4)
                .map(|k| !(k < len && k <= q && k + 3 > q))
                .collect()
        };
        let expected: Vec<bool> =
            [want(5, 3, 7), want(6, 3, 7), want(1, 0, 3), want(2, 0, 3)].concat();
        assert_eq!(mask, expected);
        #[rustfmt::skip]
        assert_eq!(&mask[..8], [false, false, false, true,
                                true, false, false, false]);
        // Without a window: every position from 0, causal.
        assert_eq!(plan.total(None), 7);
        let full: Vec<bool> = plan.mask(None).into_data().try_to_vec().unwrap();
        assert_eq!(
            &full[..7],
            [false; 6].iter().copied().chain([true]).collect::<Vec<_>>()
        );
    }
}
