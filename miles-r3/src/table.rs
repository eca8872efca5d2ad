//! [`ReplayTable`]: routing of one training micro-batch in compact form, and the mapping of
//! samples' [`RoutedExperts`] onto a packed or padded batch ([`BatchLayout`]).

use std::ops::Range;

use miles_core::{RoutedExperts, Sample};

use crate::{MoeModel, R3Error};

/// Expert ids in the narrowest unsigned type that holds every id plus a padding sentinel
/// (the type's maximum stands for Miles' `-1`).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ids {
    U8(Vec<u8>),
    U16(Vec<u16>),
}

impl Ids {
    fn padding(len: usize, num_experts: usize) -> Self {
        if num_experts <= u8::MAX as usize {
            Ids::U8(vec![u8::MAX; len])
        } else {
            Ids::U16(vec![u16::MAX; len])
        }
    }

    fn get(&self, at: usize) -> i32 {
        match self {
            Ids::U8(v) if v[at] == u8::MAX => -1,
            Ids::U8(v) => v[at] as i32,
            Ids::U16(v) if v[at] == u16::MAX => -1,
            Ids::U16(v) => v[at] as i32,
        }
    }

    /// Stores `id` (already range-checked: `-1..num_experts`).
    fn set(&mut self, at: usize, id: i32) {
        match self {
            Ids::U8(v) => v[at] = if id < 0 { u8::MAX } else { id as u8 },
            Ids::U16(v) => v[at] = if id < 0 { u16::MAX } else { id as u16 },
        }
    }

    fn element_bytes(&self) -> usize {
        match self {
            Ids::U8(_) => 1,
            Ids::U16(_) => 2,
        }
    }
}

/// Expert choices of one batch, `[rows, moe_layers, top_k]`, stored layer-major in `u8`
/// (at most 255 experts) or `u16` ids, `-1` (padding) kept as the type's maximum.
///
/// Rows are the batch's token positions in row-major `[batch, seq]` order — the order in
/// which miles-bridge's MoE layers see tokens — and layers are the model's **MoE layers
/// only**. Compared with Miles' int32 `[rows, all layers, top_k]` arrays this is 4× (u8) or
/// 2× (u16) smaller per entry, times `layers / moe_layers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayTable {
    rows: usize,
    moe_layers: usize,
    top_k: usize,
    num_experts: usize,
    ids: Ids,
}

impl ReplayTable {
    /// A table with every entry `-1` (padding).
    pub fn padding(
        rows: usize,
        moe_layers: usize,
        top_k: usize,
        num_experts: usize,
    ) -> Result<Self, R3Error> {
        if num_experts > u16::MAX as usize {
            return Err(R3Error::TooManyExperts { num_experts });
        }
        let len = rows
            .checked_mul(moe_layers)
            .and_then(|n| n.checked_mul(top_k))
            .ok_or_else(|| R3Error::InvalidModel {
                reason: format!("table [{rows}, {moe_layers}, {top_k}] overflows"),
            })?;
        Ok(Self {
            rows,
            moe_layers,
            top_k,
            num_experts,
            ids: Ids::padding(len, num_experts),
        })
    }

    /// A table from per-MoE-layer `[rows, top_k]` row-major ids (as a router hook records
    /// them). Every slice must have `rows · top_k` ids in `-1..num_experts`.
    pub fn from_layer_ids(
        rows: usize,
        top_k: usize,
        num_experts: usize,
        layers: &[&[i32]],
    ) -> Result<Self, R3Error> {
        let mut table = Self::padding(rows, layers.len(), top_k, num_experts)?;
        for (layer, ids) in layers.iter().enumerate() {
            if ids.len() != rows * top_k {
                return Err(R3Error::TableMismatch {
                    rows,
                    moe_layers: layers.len(),
                    top_k,
                    num_experts,
                    reason: format!("layer {layer} has {} ids", ids.len()),
                });
            }
            for (at, &id) in ids.iter().enumerate() {
                if id < -1 || id as i64 >= num_experts as i64 {
                    return Err(R3Error::ExpertOutOfRange {
                        sample: 0,
                        row: at / top_k,
                        layer,
                        expert: id as i64,
                        num_experts,
                    });
                }
                table.ids.set(layer * rows * top_k + at, id);
            }
        }
        Ok(table)
    }

    /// Rows (token positions of the batch).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// MoE layers.
    pub fn moe_layers(&self) -> usize {
        self.moe_layers
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Routed experts the ids refer to.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Bytes per stored id: 1 (`u8`) or 2 (`u16`).
    pub fn id_bytes(&self) -> usize {
        self.ids.element_bytes()
    }

    /// Bytes held by the ids.
    pub fn bytes(&self) -> usize {
        self.rows * self.moe_layers * self.top_k * self.id_bytes()
    }

    fn offset(&self, row: usize, moe_layer: usize) -> usize {
        (moe_layer * self.rows + row) * self.top_k
    }

    /// The `top_k` ids of `row` at MoE layer `moe_layer` (`-1` for padding), or `None` out of
    /// range.
    pub fn get(&self, row: usize, moe_layer: usize) -> Option<Vec<i32>> {
        if row >= self.rows || moe_layer >= self.moe_layers {
            return None;
        }
        let start = self.offset(row, moe_layer);
        Some(
            (start..start + self.top_k)
                .map(|i| self.ids.get(i))
                .collect(),
        )
    }

    /// Whether every id of `row` at `moe_layer` is padding.
    pub fn is_padding_row(&self, row: usize, moe_layer: usize) -> bool {
        let start = self.offset(row, moe_layer);
        (start..start + self.top_k).all(|i| self.ids.get(i) < 0)
    }

    /// All ids of one MoE layer, `[rows, top_k]` row-major, `-1` for padding.
    pub fn layer_ids(&self, moe_layer: usize) -> Vec<i32> {
        let start = self.offset(0, moe_layer);
        (start..start + self.rows * self.top_k)
            .map(|i| self.ids.get(i))
            .collect()
    }

    /// The ids a replaying router uses for one MoE layer: [`Self::layer_ids`] with every `-1`
    /// replaced as Miles does (`replay_base.py`): the n-th padding entry of the layer, counted
    /// row-major, becomes `n % num_experts`, so padding tokens spread over valid experts.
    pub fn replay_ids(&self, moe_layer: usize) -> Vec<i32> {
        let mut ids = self.layer_ids(moe_layer);
        let mut n = 0usize;
        for id in &mut ids {
            if *id < 0 {
                *id = (n % self.num_experts) as i32;
                n += 1;
            }
        }
        ids
    }

    fn set_row(&mut self, row: usize, moe_layer: usize, ids: &[i32]) {
        let start = self.offset(row, moe_layer);
        for (k, &id) in ids.iter().enumerate() {
            self.ids.set(start + k, id);
        }
    }

    /// Rows `range` of this table back in SGLang / Miles form: int32 `[rows, num_layers,
    /// top_k]` over **all** layers of `model`, dense layers filled with 0 (what an engine
    /// reports for layers without a router). This is what an embedded engine stores in
    /// `Sample::rollout_routed_experts` after a forward pass.
    pub fn to_routed_experts(
        &self,
        model: &MoeModel,
        range: Range<usize>,
    ) -> Result<RoutedExperts, R3Error> {
        self.check_model(model, "to_routed_experts")?;
        if range.start > range.end || range.end > self.rows {
            return Err(R3Error::TableMismatch {
                rows: self.rows,
                moe_layers: self.moe_layers,
                top_k: self.top_k,
                num_experts: self.num_experts,
                reason: format!("row range {range:?} is out of bounds"),
            });
        }
        let (layers, k) = (model.num_layers(), self.top_k);
        let mut data = vec![0i32; range.len() * layers * k];
        for (r, row) in range.clone().enumerate() {
            for (m, &layer) in model.moe_layers().iter().enumerate() {
                let start = self.offset(row, m);
                for j in 0..k {
                    data[(r * layers + layer) * k + j] = self.ids.get(start + j);
                }
            }
        }
        RoutedExperts::new(range.len(), layers, k, data).map_err(|e| R3Error::TableMismatch {
            rows: self.rows,
            moe_layers: self.moe_layers,
            top_k: self.top_k,
            num_experts: self.num_experts,
            reason: e.to_string(),
        })
    }

    /// Checks that this table fits `model` (MoE-layer count, top-k, expert count).
    pub fn check_model(&self, model: &MoeModel, what: &str) -> Result<(), R3Error> {
        if self.moe_layers != model.num_moe_layers()
            || self.top_k != model.top_k()
            || self.num_experts != model.num_experts()
        {
            return Err(R3Error::TableMismatch {
                rows: self.rows,
                moe_layers: self.moe_layers,
                top_k: self.top_k,
                num_experts: self.num_experts,
                reason: format!(
                    "{what}: the model has {} MoE layers, top_k {}, {} experts",
                    model.num_moe_layers(),
                    model.top_k(),
                    model.num_experts()
                ),
            });
        }
        Ok(())
    }
}

/// How samples are laid out in a training batch of `[rows, seq_len]` token positions.
///
/// Each batch row holds one or more whole samples back to back (their order in the row as
/// listed), followed by padding up to `seq_len`. One sample per row is Miles' padded `bshd`
/// layout (`seq_len` = the longest sample); several per row is the packed `thd` layout
/// (segment ids keep attention inside each sample; pad `seq_len` to the multiple your kernels
/// need, as Miles pads to `tp_size · data_pad_size_multiplier`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchLayout {
    rows: Vec<Vec<usize>>,
    seq_len: usize,
}

impl BatchLayout {
    /// One sample per row: samples `0..num_samples`, rows `seq_len` long.
    pub fn padded(num_samples: usize, seq_len: usize) -> Self {
        Self {
            rows: (0..num_samples).map(|i| vec![i]).collect(),
            seq_len,
        }
    }

    /// Packed rows: `rows[r]` lists the samples placed in batch row `r`, in order.
    pub fn packed(rows: Vec<Vec<usize>>, seq_len: usize) -> Self {
        Self { rows, seq_len }
    }

    /// Batch rows.
    pub fn rows(&self) -> &[Vec<usize>] {
        &self.rows
    }

    /// Length of every batch row.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Token positions of the batch (`rows × seq_len`).
    pub fn num_positions(&self) -> usize {
        self.rows.len() * self.seq_len
    }

    /// The flat position (row-major `[batch, seq]`) at which each sample starts, given each
    /// sample's token count; validates the layout (every listed sample exists once, rows fit).
    /// Samples not in the layout get `None`.
    pub fn offsets(&self, lengths: &[usize]) -> Result<Vec<Option<usize>>, R3Error> {
        let mut offsets = vec![None; lengths.len()];
        for (r, row) in self.rows.iter().enumerate() {
            let mut at = 0usize;
            for &s in row {
                let Some(&len) = lengths.get(s) else {
                    return Err(R3Error::LayoutSample {
                        sample: s,
                        reason: "is out of range",
                        num_samples: lengths.len(),
                    });
                };
                if offsets[s].is_some() {
                    return Err(R3Error::LayoutSample {
                        sample: s,
                        reason: "appears twice",
                        num_samples: lengths.len(),
                    });
                }
                offsets[s] = Some(r * self.seq_len + at);
                at += len;
            }
            if at > self.seq_len {
                return Err(R3Error::RowOverflow {
                    row: r,
                    tokens: at,
                    seq_len: self.seq_len,
                });
            }
        }
        Ok(offsets)
    }

    /// The token side of the same layout: ids, RoPE positions (restarting at 0 for every
    /// sample), segment ids (1, 2, … per sample within a row, 0 for padding) and the
    /// real-token mask, each `rows × seq_len` row-major. Padding ids are `pad_id`.
    pub fn tokens(&self, samples: &[Sample], pad_id: u32) -> Result<BatchTokens, R3Error> {
        let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
        let offsets = self.offsets(&lengths)?;
        let n = self.num_positions();
        let mut out = BatchTokens {
            input_ids: vec![pad_id; n],
            position_ids: vec![0; n],
            segment_ids: vec![0; n],
            valid: vec![false; n],
            shape: [self.rows.len(), self.seq_len],
        };
        for row in &self.rows {
            for (segment, &s) in row.iter().enumerate() {
                let start = offsets[s].unwrap_or(0);
                for (t, &id) in samples[s].tokens.iter().enumerate() {
                    out.input_ids[start + t] = id;
                    out.position_ids[start + t] = t as i64;
                    out.segment_ids[start + t] = segment as i64 + 1;
                    out.valid[start + t] = true;
                }
            }
        }
        Ok(out)
    }
}

/// Host-side token tensors of a [`BatchLayout`], row-major `[rows, seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchTokens {
    /// Token ids (`pad_id` on padding).
    pub input_ids: Vec<u32>,
    /// RoPE positions, restarting at 0 for every sample.
    pub position_ids: Vec<i64>,
    /// 1-based sample number within its row; 0 on padding.
    pub segment_ids: Vec<i64>,
    /// Real-token mask.
    pub valid: Vec<bool>,
    /// `[rows, seq_len]`.
    pub shape: [usize; 2],
}

/// Maps the samples' rollout routing onto a training batch and onto the model's MoE layers:
/// the replay table one trainer forward over `layout` consumes (Miles' `fill_replay_data`
/// followed by the MoE-layer stream mapping, Miles' trainer-side R3 mapping).
///
/// Each sample placed in `layout` must carry `rollout_routed_experts` with `tokens − 1` rows,
/// the model's top-k, and either all `model.num_layers()` layers (SGLang's form; dense layers
/// are skipped) or exactly the MoE layers. Its row `i` lands on the sample's token `i`; the
/// sample's last token and every padding position get `-1` rows (Miles pads one `-1` row per
/// sample and pads the batch with `-1`). Ids outside `-1..num_experts` are errors.
pub fn replay_table_for_batch(
    samples: &[Sample],
    layout: &BatchLayout,
    model: &MoeModel,
) -> Result<ReplayTable, R3Error> {
    let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
    let offsets = layout.offsets(&lengths)?;
    let mut table = ReplayTable::padding(
        layout.num_positions(),
        model.num_moe_layers(),
        model.top_k(),
        model.num_experts(),
    )?;
    for (s, sample) in samples.iter().enumerate() {
        let Some(start) = offsets[s] else { continue };
        let routed = sample
            .rollout_routed_experts
            .as_ref()
            .ok_or(R3Error::MissingRouting { sample: s })?;
        place_sample(&mut table, s, sample.tokens.len(), routed, start, model)?;
    }
    Ok(table)
}

/// Writes one sample's `RoutedExperts` at flat position `start` of `table`.
fn place_sample(
    table: &mut ReplayTable,
    sample: usize,
    tokens: usize,
    routed: &RoutedExperts,
    start: usize,
    model: &MoeModel,
) -> Result<(), R3Error> {
    let expected = tokens.saturating_sub(1);
    if routed.rows() != expected {
        return Err(R3Error::RowMismatch {
            sample,
            tokens,
            expected,
            got: routed.rows(),
        });
    }
    if expected == 0 {
        return Ok(());
    }
    // Which table layer feeds each MoE layer.
    let sources: Vec<usize> = if routed.layers() == model.num_layers() {
        model.moe_layers().to_vec()
    } else if routed.layers() == model.num_moe_layers() {
        (0..model.num_moe_layers()).collect()
    } else {
        return Err(R3Error::LayerMismatch {
            sample,
            got: routed.layers(),
            num_layers: model.num_layers(),
            moe_layers: model.num_moe_layers(),
        });
    };
    if routed.top_k() != model.top_k() {
        return Err(R3Error::TopKMismatch {
            sample,
            got: routed.top_k(),
            expected: model.top_k(),
        });
    }
    let num_experts = model.num_experts() as i64;
    for row in 0..expected {
        for (m, &source) in sources.iter().enumerate() {
            let ids = routed.get(row, source).unwrap_or(&[]);
            if let Some(&bad) = ids.iter().find(|&&id| id < -1 || id as i64 >= num_experts) {
                return Err(R3Error::ExpertOutOfRange {
                    sample,
                    row,
                    layer: model.moe_layers()[m],
                    expert: bad as i64,
                    num_experts: model.num_experts(),
                });
            }
            table.set_row(start + row, m, ids);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;

    fn model() -> MoeModel {
        // 3 layers, layer 0 dense, 8 experts, top-2.
        MoeModel::first_k_dense(3, 1, 8, 2).unwrap()
    }

    /// A sample of `n` tokens whose routing at (row r, layer l, slot j) is
    /// `(r + l + j) % 8` for MoE layers and 0 for the dense layer.
    fn sample(n: usize) -> Sample {
        let rows = n - 1;
        let mut data = Vec::new();
        for r in 0..rows {
            for l in 0..3 {
                for j in 0..2 {
                    data.push(if l == 0 { 0 } else { ((r + l + j) % 8) as i32 });
                }
            }
        }
        Sample::builder(Prompt::Text("p".into()))
            .tokens((0..n as u32).collect(), 1)
            .routed_experts(RoutedExperts::new(rows, 3, 2, data).unwrap())
            .build()
            .unwrap()
    }

    #[test]
    fn compact_ids_round_trip_with_padding() {
        let t = ReplayTable::from_layer_ids(2, 2, 8, &[&[0, 7, -1, -1], &[3, 4, 5, 6]]).unwrap();
        assert_eq!(t.id_bytes(), 1);
        assert_eq!(t.bytes(), 8);
        assert_eq!(t.get(0, 0), Some(vec![0, 7]));
        assert_eq!(t.get(1, 0), Some(vec![-1, -1]));
        assert!(t.is_padding_row(1, 0));
        assert_eq!(t.layer_ids(1), vec![3, 4, 5, 6]);
        assert_eq!(t.get(2, 0), None);
        let wide = ReplayTable::from_layer_ids(1, 2, 300, &[&[299, -1]]).unwrap();
        assert_eq!(wide.id_bytes(), 2);
        assert_eq!(wide.get(0, 0), Some(vec![299, -1]));
        // 255 experts need id 254 plus the sentinel 255: still u8; 256 experts need u16.
        assert_eq!(ReplayTable::padding(1, 1, 1, 255).unwrap().id_bytes(), 1);
        assert_eq!(ReplayTable::padding(1, 1, 1, 256).unwrap().id_bytes(), 2);
    }

    #[test]
    fn bytes_per_token_vs_miles_int32() {
        // GLM-4.5-355B: 92 layers (3 dense), 160 experts, top-8. Miles stores int32 over all
        // layers: 92 · 8 · 4 = 2944 bytes per token; here u8 over the 89 MoE layers: 712.
        let glm = MoeModel::first_k_dense(92, 3, 160, 8).unwrap();
        let t = ReplayTable::padding(10, glm.num_moe_layers(), 8, 160).unwrap();
        assert_eq!(t.bytes() / 10, 712);
        // 256 experts (DeepSeek-V3) need the u16 form: 58 · 8 · 2 = 928 vs 61 · 8 · 4 = 1952.
        let t = ReplayTable::padding(10, 58, 8, 256).unwrap();
        assert_eq!(t.bytes() / 10, 928);
    }

    #[test]
    fn replay_ids_replace_padding_like_miles() {
        // Miles: top_indices[top_indices == -1] = arange(count) % num_experts, row-major.
        let t = ReplayTable::from_layer_ids(3, 2, 3, &[&[-1, -1, 2, 1, -1, -1]]).unwrap();
        assert_eq!(t.replay_ids(0), vec![0, 1, 2, 1, 2, 0]);
    }

    #[test]
    fn padded_layout_maps_rows_and_skips_dense_layers() {
        let samples = vec![sample(4), sample(2)];
        let layout = BatchLayout::padded(2, 5);
        let t = replay_table_for_batch(&samples, &layout, &model()).unwrap();
        assert_eq!([t.rows(), t.moe_layers(), t.top_k()], [10, 2, 2]);
        // Sample 0 rows 0..3 at positions 0..3; MoE layer 0 = model layer 1.
        assert_eq!(t.get(0, 0), Some(vec![1, 2]));
        assert_eq!(t.get(2, 1), Some(vec![4, 5]));
        // Its last token (position 3) and the padding (4) are -1.
        assert_eq!(t.get(3, 0), Some(vec![-1, -1]));
        assert_eq!(t.get(4, 1), Some(vec![-1, -1]));
        // Sample 1 (2 tokens, 1 row) starts at position 5.
        assert_eq!(t.get(5, 0), Some(vec![1, 2]));
        assert!(t.is_padding_row(6, 0));
    }

    #[test]
    fn packed_layout_concatenates_samples() {
        let samples = vec![sample(3), sample(4), sample(2)];
        let layout = BatchLayout::packed(vec![vec![1, 0], vec![2]], 8);
        let t = replay_table_for_batch(&samples, &layout, &model()).unwrap();
        assert_eq!(t.rows(), 16);
        // Row 0: sample 1 at 0..4 (rows 0..3 + pad), then sample 0 at 4..7.
        assert_eq!(t.get(0, 0), Some(vec![1, 2]));
        assert_eq!(t.get(2, 0), Some(vec![3, 4]));
        assert!(t.is_padding_row(3, 0));
        assert_eq!(t.get(4, 0), Some(vec![1, 2]));
        assert_eq!(t.get(5, 1), Some(vec![3, 4]));
        assert!(t.is_padding_row(6, 0));
        assert!(t.is_padding_row(7, 0));
        // Row 1: sample 2 at 8.
        assert_eq!(t.get(8, 0), Some(vec![1, 2]));
        assert!(t.is_padding_row(9, 1));
        let tokens = layout.tokens(&samples, 0).unwrap();
        assert_eq!(tokens.segment_ids[..8], [1, 1, 1, 1, 2, 2, 2, 0]);
        assert_eq!(tokens.position_ids[..8], [0, 1, 2, 3, 0, 1, 2, 0]);
        assert_eq!(tokens.input_ids[..8], [0, 1, 2, 3, 0, 1, 2, 0]);
    }

    #[test]
    fn moe_only_tables_and_inverse_mapping() {
        let samples = vec![sample(4)];
        let layout = BatchLayout::padded(1, 4);
        let t = replay_table_for_batch(&samples, &layout, &model()).unwrap();
        let back = t.to_routed_experts(&model(), 0..3).unwrap();
        assert_eq!(&back, samples[0].rollout_routed_experts.as_ref().unwrap());
        // A table over MoE layers only maps the same way.
        let full = t.to_routed_experts(&model(), 0..3).unwrap();
        let full = &full;
        let data: Vec<i32> = (0..3)
            .flat_map(|r| (1..3).flat_map(move |l| full.get(r, l).unwrap().to_vec()))
            .collect();
        let mut s = sample(4);
        s.rollout_routed_experts = Some(RoutedExperts::new(3, 2, 2, data).unwrap());
        assert_eq!(replay_table_for_batch(&[s], &layout, &model()).unwrap(), t);
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let m = model();
        let layout = BatchLayout::padded(1, 6);
        let mut s = sample(4);
        s.rollout_routed_experts = None;
        assert!(matches!(
            replay_table_for_batch(&[s], &layout, &m),
            Err(R3Error::MissingRouting { sample: 0 })
        ));
        let mut s = sample(4);
        s.tokens.push(9);
        assert!(matches!(
            replay_table_for_batch(&[s], &layout, &m),
            Err(R3Error::RowMismatch {
                expected: 4,
                got: 3,
                ..
            })
        ));
        let mut s = sample(4);
        s.rollout_routed_experts = Some(RoutedExperts::new(3, 3, 2, vec![8; 18]).unwrap());
        assert!(matches!(
            replay_table_for_batch(&[s], &layout, &m),
            Err(R3Error::ExpertOutOfRange {
                expert: 8,
                layer: 1,
                ..
            })
        ));
        let mut s = sample(4);
        s.rollout_routed_experts = Some(RoutedExperts::new(3, 4, 2, vec![0; 24]).unwrap());
        assert!(matches!(
            replay_table_for_batch(&[s], &layout, &m),
            Err(R3Error::LayerMismatch { got: 4, .. })
        ));
        let mut s = sample(4);
        s.rollout_routed_experts = Some(RoutedExperts::new(3, 3, 1, vec![0; 9]).unwrap());
        assert!(matches!(
            replay_table_for_batch(&[s], &layout, &m),
            Err(R3Error::TopKMismatch { got: 1, .. })
        ));
        assert!(matches!(
            replay_table_for_batch(&[sample(4)], &BatchLayout::padded(1, 3), &m),
            Err(R3Error::RowOverflow { tokens: 4, .. })
        ));
        assert!(matches!(
            replay_table_for_batch(&[sample(4)], &BatchLayout::packed(vec![vec![0, 0]], 9), &m),
            Err(R3Error::LayoutSample { sample: 0, .. })
        ));
        assert!(matches!(
            replay_table_for_batch(&[sample(4)], &BatchLayout::padded(2, 9), &m),
            Err(R3Error::LayoutSample { sample: 1, .. })
        ));
    }
}
