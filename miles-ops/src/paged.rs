//! Decode attention over a paged KV cache.
//!
//! An inference engine keeps the keys and values of every running sequence in one pool per
//! layer, allocated once: `[kv_heads · slots, head_dim]`, pool row `h · slots + s` holding
//! key head `h` of slot `s`. Slots come in blocks of [`PageTable::block`] consecutive
//! positions, and a sequence owns a list of blocks ([`PageTable::blocks`]), so sequences of
//! any length share the pool without copies or padding, and a decode step writes one slot
//! per sequence in place.
//!
//! [`paged_decode`] attends one query row per sequence to its cached positions straight from
//! the pool on flex (`f32`, AVX-512F): for each key head it walks the sequence's blocks in
//! position order with the same loops as the contiguous decode step, so every output equals
//! the contiguous computation over the same keys bit for bit, and a sequence's result never
//! depends on the other sequences of the step. Elsewhere ([`applies`] is false), and for
//! attention with sinks or a sliding window (GPT-OSS), callers gather the keys with
//! [`gather_index`] (a sliding-window layer only its window's, [`gather_index_from`]) and run
//! the attention over the gathered batch.

use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::error::{OpsError, Result};
use crate::flex;
use crate::flex::tensor::{as_f32, dims, f32_data, tensor};

/// Where each sequence's keys live in a pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageTable {
    /// Positions per block.
    pub block: usize,
    /// Per sequence: its blocks in position order (block `i` holds positions
    /// `i · block .. (i + 1) · block`).
    pub blocks: Vec<Vec<u32>>,
    /// Per sequence: the positions attended to (`lens[b] ≤ blocks[b].len() · block`).
    pub lens: Vec<usize>,
}

impl PageTable {
    /// The pool slot of position `p` of sequence `b` (`p < blocks[b].len() · block`).
    pub fn slot(&self, b: usize, p: usize) -> usize {
        self.blocks[b][p / self.block] as usize * self.block + p % self.block
    }

    /// Checks the table against a pool of `slots` slots: positive block size, every
    /// sequence's length covered by its blocks, every block inside the pool.
    pub fn check(&self, slots: usize) -> Result<()> {
        if self.block == 0 || !slots.is_multiple_of(self.block) {
            return Err(OpsError::InvalidConfig {
                flag: "kv-block",
                reason: format!("block {} does not divide {slots} slots", self.block),
            });
        }
        if self.blocks.len() != self.lens.len() {
            return Err(OpsError::LengthMismatch {
                what: "page table lengths",
                expected: self.blocks.len(),
                got: self.lens.len(),
            });
        }
        let pool_blocks = slots / self.block;
        for (blocks, &len) in self.blocks.iter().zip(&self.lens) {
            if len > blocks.len() * self.block {
                return Err(OpsError::LengthMismatch {
                    what: "positions covered by a sequence's blocks",
                    expected: len,
                    got: blocks.len() * self.block,
                });
            }
            if let Some(&bad) = blocks.iter().find(|&&b| b as usize >= pool_blocks) {
                return Err(OpsError::ShapeMismatch {
                    what: "block id (pool blocks)",
                    expected: vec![pool_blocks],
                    got: vec![bad as usize],
                });
            }
        }
        Ok(())
    }
}

/// Whether [`paged_decode`] runs for queries of `head_dim` in `dtype` on `device`: plain
/// flex, `f32`, AVX-512F (as [`crate::packed::applies`]) and a head size the decode loops
/// take (a multiple of 16, at most 256).
pub fn applies(device: &Device, dtype: DType, head_dim: usize) -> bool {
    crate::packed::applies(device, dtype) && flex::attention::decode_applies(head_dim)
}

/// `softmax(q · kᵀ · scale) · v` for one query row per sequence, `q` `[batch, heads, 1, d]`,
/// over the first `table.lens[b]` positions of sequence `b` in the pools `keys` / `values`
/// `[kv_heads · slots, d]` (see the module docs). Grouped heads: query head `h` reads key
/// head `h / (heads / kv_heads)`. Only where [`applies`]; an error otherwise and for
/// inconsistent shapes.
pub fn paged_decode(
    q: Tensor<4>,
    keys: Tensor<2>,
    values: Tensor<2>,
    kv_heads: usize,
    table: &PageTable,
    scale: f32,
) -> Result<Tensor<4>> {
    let [batch, heads, seq, d] = q.dims();
    if !applies(&q.device(), q.dtype(), d) || keys.dtype() != q.dtype() {
        return Err(OpsError::InvalidConfig {
            flag: "device",
            reason: "paged decode attention runs on flex, f32, AVX-512F only".into(),
        });
    }
    let shape_error = |what, expected: Vec<usize>, got: Vec<usize>| OpsError::ShapeMismatch {
        what,
        expected,
        got,
    };
    if seq != 1 || batch != table.lens.len() {
        return Err(shape_error(
            "queries",
            vec![table.lens.len(), heads, 1, d],
            vec![batch, heads, seq, d],
        ));
    }
    let [rows, width] = keys.dims();
    if kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || width != d
        || !rows.is_multiple_of(kv_heads)
        || values.dims() != [rows, width]
    {
        return Err(shape_error(
            "key / value pools",
            vec![kv_heads, d],
            vec![rows, width],
        ));
    }
    table.check(rows / kv_heads)?;
    if table.lens.contains(&0) {
        return Err(OpsError::LengthMismatch {
            what: "cached positions of a sequence (at least one)",
            expected: 1,
            got: 0,
        });
    }
    let per_row = table.blocks.iter().map(Vec::len).max().unwrap_or(0);
    let mut flat = vec![0usize; batch * per_row];
    for (b, blocks) in table.blocks.iter().enumerate() {
        for (i, &block) in blocks.iter().enumerate() {
            flat[b * per_row + i] = block as usize;
        }
    }
    Ok(Tensor::from_dispatch(<Dispatch as PagedOps>::paged_decode(
        q.into_dispatch(),
        keys.into_dispatch(),
        values.into_dispatch(),
        flat,
        table.lens.clone(),
        vec![table.block, kv_heads],
        scale,
    )))
}

/// Pool rows that gather sequence `b`'s positions into `[batch, heads, total, ·]` order for
/// a pool of `slots` slots per head: entry `((b · heads + h) · total + p)` is
/// `h · slots + slot(b, p)` for `p < lens[b]` and row 0 past it (to be masked), with `total`
/// the longest length. With [`Tensor::select`] on dim 0 of a pool, then a reshape, this is
/// the contiguous cache of the batch on any device.
pub fn gather_index(
    table: &PageTable,
    heads: usize,
    slots: usize,
    device: &Device,
) -> Tensor<1, Int> {
    gather_index_from(table, &vec![0; table.lens.len()], heads, slots, device)
}

/// [`gather_index`] of each sequence's positions from `starts[b]` on (a sliding window: the
/// keys before it are never attended): entry `((b · heads + h) · total + p)` is
/// `h · slots + slot(b, starts[b] + p)` for `p < lens[b] − starts[b]` and row 0 past it, with
/// `total` the longest `lens[b] − starts[b]`. A start past a sequence's length gathers
/// nothing for it.
pub fn gather_index_from(
    table: &PageTable,
    starts: &[usize],
    heads: usize,
    slots: usize,
    device: &Device,
) -> Tensor<1, Int> {
    let spans: Vec<(usize, usize)> = table
        .lens
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            let start = starts.get(b).copied().unwrap_or(0).min(len);
            (start, len - start)
        })
        .collect();
    let total = spans.iter().map(|&(_, n)| n).max().unwrap_or(0);
    let mut index = Vec::with_capacity(spans.len() * heads * total);
    for (b, &(start, n)) in spans.iter().enumerate() {
        for h in 0..heads {
            for p in 0..total {
                let row = if p < n {
                    h * slots + table.slot(b, start + p)
                } else {
                    0
                };
                index.push(row as i32);
            }
        }
    }
    let n = index.len();
    Tensor::from_data(TensorData::new(index, [n]), device)
}

/// Backend op of [`paged_decode`]; plain flex only.
#[backend_extension(Flex)]
pub trait PagedOps: Backend {
    /// See [`paged_decode`]; `table` is `[batch, per_row]` block ids, `sizes` is
    /// `[block, kv_heads]`.
    fn paged_decode(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: Vec<usize>,
        lens: Vec<usize>,
        sizes: Vec<usize>,
        scale: f32,
    ) -> FloatTensor<Self>;
}

impl PagedOps for Flex {
    fn paged_decode(
        q: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        table: Vec<usize>,
        lens: Vec<usize>,
        sizes: Vec<usize>,
        scale: f32,
    ) -> FloatTensor<Self> {
        let q = as_f32(q);
        let shape = dims(&q);
        let (heads, d) = (shape[1], shape[3]);
        let (block, kv_heads) = (sizes[0], sizes[1]);
        let (qd, kd, vd) = (f32_data(&q), f32_data(&keys), f32_data(&values));
        let out = flex::attention::paged_decode(
            &qd, &kd, &vd, &table, &lens, block, kv_heads, heads, d, scale,
        );
        tensor(out, &shape)
    }
}
