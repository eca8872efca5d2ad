//! Routing flip statistics between rollout and trainer.

use std::collections::BTreeMap;

use miles_core::Metrics;

use crate::{MoeModel, R3Error, ReplayTable};

/// Counts for one MoE layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerFlips {
    /// Tokens compared (padding rows excluded).
    pub tokens: u64,
    /// Tokens whose expert **set** differs (order ignored).
    pub flipped: u64,
    /// Tokens with no expert in common (Miles' `check_replay_result` mismatch).
    pub no_overlap: u64,
}

impl LayerFlips {
    /// `flipped / tokens`, or `None` when nothing was compared.
    pub fn flip_rate(&self) -> Option<f64> {
        (self.tokens > 0).then(|| self.flipped as f64 / self.tokens as f64)
    }
}

/// Per-layer routing flip counts: for each MoE layer (keyed by model layer index), how many
/// tokens were routed to a different expert set by the trainer than by the rollout engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlipStats {
    layers: BTreeMap<usize, LayerFlips>,
}

impl FlipStats {
    /// No observations.
    pub fn new() -> Self {
        Self::default()
    }

    /// Compares two `[tokens, top_k]` row-major id lists of model layer `layer`: `reference`
    /// (the rollout's choice) and `other` (the trainer's). Rows of `reference` that are all
    /// `-1` (padding) are skipped; `-1` entries never count as a shared expert.
    pub fn observe(&mut self, layer: usize, top_k: usize, reference: &[i32], other: &[i32]) {
        let entry = self.layers.entry(layer).or_default();
        if top_k == 0 {
            return;
        }
        let mut a = Vec::with_capacity(top_k);
        let mut b = Vec::with_capacity(top_k);
        for (r, o) in reference.chunks_exact(top_k).zip(other.chunks_exact(top_k)) {
            if r.iter().all(|&id| id < 0) {
                continue;
            }
            a.clear();
            a.extend_from_slice(r);
            a.sort_unstable();
            b.clear();
            b.extend_from_slice(o);
            b.sort_unstable();
            entry.tokens += 1;
            if a != b {
                entry.flipped += 1;
            }
            if !r.iter().any(|&x| x >= 0 && o.contains(&x)) {
                entry.no_overlap += 1;
            }
        }
    }

    /// Flip statistics of `trainer` against `rollout`, two tables of the same batch (e.g. the
    /// batch's replay table and what [`crate::RoutingReplay`] recorded in `record` stage).
    pub fn compare(
        model: &MoeModel,
        rollout: &ReplayTable,
        trainer: &ReplayTable,
    ) -> Result<Self, R3Error> {
        rollout.check_model(model, "rollout table")?;
        trainer.check_model(model, "trainer table")?;
        if rollout.rows() != trainer.rows() {
            return Err(R3Error::ReplayRows {
                layer: model.moe_layers()[0],
                replay_rows: rollout.rows(),
                tokens: trainer.rows(),
            });
        }
        let mut stats = Self::new();
        for (m, &layer) in model.moe_layers().iter().enumerate() {
            stats.observe(
                layer,
                model.top_k(),
                &rollout.layer_ids(m),
                &trainer.layer_ids(m),
            );
        }
        Ok(stats)
    }

    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: &FlipStats) {
        for (layer, counts) in &other.layers {
            let entry = self.layers.entry(*layer).or_default();
            entry.tokens += counts.tokens;
            entry.flipped += counts.flipped;
            entry.no_overlap += counts.no_overlap;
        }
    }

    /// Counts per model layer index.
    pub fn layers(&self) -> &BTreeMap<usize, LayerFlips> {
        &self.layers
    }

    /// Flip rate of model layer `layer`.
    pub fn flip_rate(&self, layer: usize) -> Option<f64> {
        self.layers.get(&layer).and_then(LayerFlips::flip_rate)
    }

    /// Flipped (token, layer) pairs over compared pairs, all layers together.
    pub fn overall_flip_rate(&self) -> Option<f64> {
        let (tokens, flipped) = self
            .layers
            .values()
            .fold((0, 0), |(t, f), c| (t + c.tokens, f + c.flipped));
        (tokens > 0).then(|| flipped as f64 / tokens as f64)
    }

    /// As metrics: `r3/flip_rate/layer_{i}` per MoE layer, `r3/flip_rate` (all layers),
    /// `r3/no_overlap_rate` and `r3/compared_tokens` (token-layer pairs compared).
    pub fn to_metrics(&self) -> Metrics {
        let mut metrics = Metrics::new();
        let (mut tokens, mut no_overlap) = (0u64, 0u64);
        for (layer, counts) in &self.layers {
            if let Some(rate) = counts.flip_rate() {
                metrics.insert(format!("r3/flip_rate/layer_{layer}"), rate);
            }
            tokens += counts.tokens;
            no_overlap += counts.no_overlap;
        }
        if let Some(rate) = self.overall_flip_rate() {
            metrics.insert("r3/flip_rate".into(), rate);
            metrics.insert(
                "r3/no_overlap_rate".into(),
                no_overlap as f64 / tokens as f64,
            );
        }
        metrics.insert("r3/compared_tokens".into(), tokens as f64);
        metrics
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flips_count_sets_and_skip_padding() {
        let mut s = FlipStats::new();
        // Row 0 same set in another order, row 1 one expert differs, row 2 disjoint,
        // row 3 padding.
        s.observe(1, 2, &[0, 1, 2, 3, 4, 5, -1, -1], &[1, 0, 2, 6, 6, 7, 0, 1]);
        let c = s.layers()[&1];
        assert_eq!((c.tokens, c.flipped, c.no_overlap), (3, 2, 1));
        assert_eq!(s.flip_rate(1), Some(2.0 / 3.0));
        s.observe(2, 2, &[0, 1], &[0, 1]);
        assert_eq!(s.overall_flip_rate(), Some(0.5));
        let m = s.to_metrics();
        assert_eq!(m["r3/flip_rate/layer_1"], 2.0 / 3.0);
        assert_eq!(m["r3/flip_rate/layer_2"], 0.0);
        assert_eq!(m["r3/flip_rate"], 0.5);
        assert_eq!(m["r3/no_overlap_rate"], 0.25);
        assert_eq!(m["r3/compared_tokens"], 4.0);
        let mut total = FlipStats::new();
        total.merge(&s);
        total.merge(&s);
        assert_eq!(total.layers()[&1].tokens, 6);
    }

    #[test]
    fn compare_tables() {
        let model = MoeModel::new(2, vec![1], 4, 2).unwrap();
        let a = ReplayTable::from_layer_ids(3, 2, 4, &[&[0, 1, 2, 3, -1, -1]]).unwrap();
        let b = ReplayTable::from_layer_ids(3, 2, 4, &[&[1, 0, 2, 1, 0, 1]]).unwrap();
        let s = FlipStats::compare(&model, &a, &b).unwrap();
        assert_eq!(s.flip_rate(1), Some(0.5));
        let short = ReplayTable::from_layer_ids(1, 2, 4, &[&[0, 1]]).unwrap();
        assert!(matches!(
            FlipStats::compare(&model, &a, &short),
            Err(R3Error::ReplayRows { .. })
        ));
    }
}
