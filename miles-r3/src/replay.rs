//! The replay state machine (Miles' `BaseReplayManager` / `Replay`, Miles' replay manager).

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::tensor::{Int, Tensor, TensorData};
use miles_core::Sample;

use crate::{
    BatchLayout, FlipStats, MoeLayerInfo, MoeModel, R3Error, ReplayTable, RouterHook, check_scores,
    replay_table_for_batch,
};

/// What a [`RoutingReplay`] does when an MoE layer asks for its experts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum ReplayStage {
    /// Normal top-k routing; nothing stored (reference / teacher log-prob passes).
    #[default]
    Fallthrough,
    /// Normal top-k routing, and the chosen experts are appended to each layer's list
    /// (the actor's own log-prob pass when routing comes from the trainer, not the rollout).
    Record,
    /// Experts come from the next micro-batch of each layer's list (forward cursor).
    ReplayForward,
    /// Experts come from the list through the separate backward cursor, for forwards re-run
    /// during the backward pass (activation recomputation).
    ReplayBackward,
}

impl ReplayStage {
    /// Miles' name of the stage.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayStage::Fallthrough => "fallthrough",
            ReplayStage::Record => "record",
            ReplayStage::ReplayForward => "replay_forward",
            ReplayStage::ReplayBackward => "replay_backward",
        }
    }
}

impl fmt::Display for ReplayStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ReplayStage {
    type Err = R3Error;

    fn from_str(s: &str) -> Result<Self, R3Error> {
        Ok(match s {
            "fallthrough" => ReplayStage::Fallthrough,
            "record" => ReplayStage::Record,
            "replay_forward" => ReplayStage::ReplayForward,
            "replay_backward" => ReplayStage::ReplayBackward,
            other => {
                return Err(R3Error::InvalidModel {
                    reason: format!("unknown replay stage {other:?}"),
                });
            }
        })
    }
}

/// One micro-batch of one layer: a shared table and which of its MoE layers to read.
#[derive(Debug, Clone)]
struct Entry {
    table: Arc<ReplayTable>,
    moe_layer: usize,
}

/// Miles' `Replay`: the micro-batches of one MoE layer and two cursors.
#[derive(Debug, Clone, Default)]
struct LayerReplay {
    entries: Vec<Entry>,
    forward: usize,
    backward: usize,
}

/// The trainer's own top-k of one replayed layer, still on the device, and the routing it
/// replayed instead: compared when the flip statistics are taken.
#[derive(Debug)]
struct PendingCompare {
    layer_index: usize,
    top_k: usize,
    entry: Entry,
    own: Tensor<2, Int>,
}

#[derive(Debug, Default)]
struct State {
    stage: ReplayStage,
    layers: Vec<LayerReplay>,
    compare: bool,
    check_threshold: Option<f64>,
    flips: FlipStats,
    pending: Vec<PendingCompare>,
}

/// Record / replay of MoE routing for one model: a [`RouterHook`] with a stage
/// ([`ReplayStage`]) and, per MoE layer, a list of micro-batch routings with a forward and a
/// backward cursor — Miles' `RoutingReplayManager` with one `Replay` per MoE layer.
///
/// Typical step (Miles' actor): [`Self::push_samples`] once per micro-batch in training
/// order; the actor log-prob pass runs with [`ReplayStage::ReplayForward`]
/// ([`ReplayStage::Record`] when not replaying rollout routing); [`Self::clear_all_forward`];
/// every training forward again with `ReplayForward` (forwards re-run inside backward use
/// `ReplayBackward`); [`Self::clear_all`] after the step. The stage is either set for all
/// forwards ([`Self::set_stage`], the hook is `&replay`) or chosen per forward without touching
/// the shared stage ([`Self::with_stage`]).
///
/// In replay the hook returns the table's ids (padding `-1` replaced as Miles does, see
/// [`ReplayTable::replay_ids`]); the MoE layer recomputes the gate weights from its own router
/// scores at those ids — sigmoid scores for GLM (bias excluded, renormalised, scaled),
/// softmax probabilities for Qwen3-MoE — so the router keeps its gradient.
#[derive(Debug)]
pub struct RoutingReplay {
    model: MoeModel,
    state: Mutex<State>,
}

impl RoutingReplay {
    /// An empty replay for `model`, in [`ReplayStage::Fallthrough`].
    pub fn new(model: MoeModel) -> Self {
        let layers = vec![LayerReplay::default(); model.num_moe_layers()];
        Self {
            model,
            state: Mutex::new(State {
                layers,
                ..State::default()
            }),
        }
    }

    /// The model this replay serves.
    pub fn model(&self) -> &MoeModel {
        &self.model
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, R3Error> {
        self.state.lock().map_err(|_| R3Error::Poisoned)
    }

    /// The shared stage (used when the hook is `&self`).
    pub fn stage(&self) -> Result<ReplayStage, R3Error> {
        Ok(self.lock()?.stage)
    }

    /// Sets the shared stage.
    pub fn set_stage(&self, stage: ReplayStage) -> Result<(), R3Error> {
        self.lock()?.stage = stage;
        Ok(())
    }

    /// A hook for one forward pass that acts in `stage`, whatever the shared stage is.
    pub fn with_stage(&self, stage: ReplayStage) -> StagedReplay<'_> {
        StagedReplay {
            replay: self,
            stage,
        }
    }

    /// When on, replay stages also compute the trainer's own top-k and accumulate
    /// [`FlipStats`] of it against the replayed routing. The top-k stay on the device until
    /// [`Self::take_flip_stats`], which reads every layer's back at once (one device read
    /// per take instead of one per layer); with [`Self::set_check`] each layer is read at
    /// once, since the check must fail the forward.
    pub fn set_compare(&self, on: bool) -> Result<(), R3Error> {
        self.lock()?.compare = on;
        Ok(())
    }

    /// Miles' optional replay check (`enable_check_replay_result`, `MILES_TEST_R3_THRESHOLD`):
    /// with `Some(fraction)`, a replaying layer fails with [`R3Error::ReplayCheck`] when more
    /// than `fraction · tokens` tokens share no expert with the trainer's own top-k (padding
    /// rows excluded). Implies the comparison of [`Self::set_compare`].
    pub fn set_check(&self, threshold: Option<f64>) -> Result<(), R3Error> {
        self.lock()?.check_threshold = threshold;
        Ok(())
    }

    /// Appends one micro-batch's routing to every MoE layer's list (Miles' `fill_replay_data`
    /// → `register_replay_list_moe`). The table must fit the model.
    pub fn push(&self, table: ReplayTable) -> Result<(), R3Error> {
        table.check_model(&self.model, "push")?;
        let table = Arc::new(table);
        let mut state = self.lock()?;
        for (moe_layer, layer) in state.layers.iter_mut().enumerate() {
            layer.entries.push(Entry {
                table: Arc::clone(&table),
                moe_layer,
            });
        }
        Ok(())
    }

    /// Maps the samples' `rollout_routed_experts` onto `layout` ([`replay_table_for_batch`])
    /// and appends the result as the next micro-batch: engine output stored in
    /// [`Sample::rollout_routed_experts`] feeds the trainer forward over the same layout.
    pub fn push_samples(&self, samples: &[Sample], layout: &BatchLayout) -> Result<(), R3Error> {
        self.push(replay_table_for_batch(samples, layout, &self.model)?)
    }

    /// Micro-batches held by the first MoE layer's list (every layer holds as many after
    /// [`Self::push`]; in `record` stage a partially run forward may leave them uneven).
    pub fn len(&self) -> Result<usize, R3Error> {
        Ok(self.lock()?.layers.first().map_or(0, |l| l.entries.len()))
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> Result<bool, R3Error> {
        Ok(self.len()? == 0)
    }

    /// Micro-batch `index` of every layer's list as one table (e.g. what `record` stored).
    pub fn micro_batch(&self, index: usize) -> Result<ReplayTable, R3Error> {
        let state = self.lock()?;
        let mut columns = Vec::with_capacity(state.layers.len());
        for (m, layer) in state.layers.iter().enumerate() {
            let entry = layer.entries.get(index).ok_or(R3Error::ReplayExhausted {
                layer: self.model.moe_layers()[m],
                stage: "read",
                cursor: index,
                loaded: layer.entries.len(),
            })?;
            columns.push((entry.table.rows(), entry.table.layer_ids(entry.moe_layer)));
        }
        let rows = columns.first().map_or(0, |c| c.0);
        if let Some((m, c)) = columns.iter().enumerate().find(|(_, c)| c.0 != rows) {
            return Err(R3Error::ReplayRows {
                layer: self.model.moe_layers()[m],
                replay_rows: c.0,
                tokens: rows,
            });
        }
        let slices: Vec<&[i32]> = columns.iter().map(|c| c.1.as_slice()).collect();
        ReplayTable::from_layer_ids(rows, self.model.top_k(), self.model.num_experts(), &slices)
    }

    /// Resets both cursors and drops every stored micro-batch (Miles' `clear_all`).
    pub fn clear_all(&self) -> Result<(), R3Error> {
        for layer in &mut self.lock()?.layers {
            *layer = LayerReplay::default();
        }
        Ok(())
    }

    /// Resets the forward cursors only (Miles' `clear_all_forward`, between the log-prob pass
    /// and training).
    pub fn clear_all_forward(&self) -> Result<(), R3Error> {
        for layer in &mut self.lock()?.layers {
            layer.forward = 0;
        }
        Ok(())
    }

    /// Flip statistics gathered by replay stages since the last call, and resets them (the
    /// comparisons still pending are read back from the device here, in one read).
    pub fn take_flip_stats(&self) -> Result<FlipStats, R3Error> {
        let (mut flips, pending) = {
            let mut state = self.lock()?;
            (
                std::mem::take(&mut state.flips),
                std::mem::take(&mut state.pending),
            )
        };
        let Some(first) = pending.first() else {
            return Ok(flips);
        };
        let first_layer = first.layer_index;
        let lens: Vec<usize> = pending
            .iter()
            .map(|p| p.own.shape().num_elements())
            .collect();
        // Every layer's `[tokens, top_k]` (one top-k for the whole model), stacked by rows.
        let stacked = Tensor::cat(pending.iter().map(|p| p.own.clone()).collect(), 0);
        let own = read_ids(stacked, first_layer)?;
        let mut at = 0;
        for (p, n) in pending.iter().zip(lens) {
            flips.observe(
                p.layer_index,
                p.top_k,
                &p.entry.table.layer_ids(p.entry.moe_layer),
                &own[at..at + n],
            );
            at += n;
        }
        Ok(flips)
    }

    fn moe_slot(&self, info: &MoeLayerInfo) -> Result<usize, R3Error> {
        let m = info.moe_index;
        if self.model.moe_layers().get(m) != Some(&info.layer_index)
            || info.num_experts != self.model.num_experts()
            || info.top_k != self.model.top_k()
        {
            return Err(R3Error::UnknownLayer {
                layer_index: info.layer_index,
                moe_index: m,
            });
        }
        Ok(m)
    }

    fn select(
        &self,
        stage: ReplayStage,
        info: &MoeLayerInfo,
        scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        check_scores(info, &scores)?;
        let m = self.moe_slot(info)?;
        let (tokens, k) = (scores.dims()[0], info.top_k);
        match stage {
            ReplayStage::Fallthrough => Ok(scores.topk_with_indices(k, 1).1),
            ReplayStage::Record => {
                let chosen = scores.topk_with_indices(k, 1).1;
                let ids = read_ids(chosen.clone(), info.layer_index)?;
                let table = ReplayTable::from_layer_ids(tokens, k, info.num_experts, &[&ids])?;
                self.lock()?.layers[m].entries.push(Entry {
                    table: Arc::new(table),
                    moe_layer: 0,
                });
                Ok(chosen)
            }
            ReplayStage::ReplayForward | ReplayStage::ReplayBackward => {
                let backward = stage == ReplayStage::ReplayBackward;
                let (entry, compare, threshold) = {
                    let mut state = self.lock()?;
                    let (compare, threshold) = (state.compare, state.check_threshold);
                    let layer = &mut state.layers[m];
                    let cursor = if backward {
                        layer.backward
                    } else {
                        layer.forward
                    };
                    let entry =
                        layer
                            .entries
                            .get(cursor)
                            .cloned()
                            .ok_or(R3Error::ReplayExhausted {
                                layer: info.layer_index,
                                stage: if backward { "backward" } else { "forward" },
                                cursor,
                                loaded: layer.entries.len(),
                            })?;
                    if backward {
                        layer.backward += 1;
                    } else {
                        layer.forward += 1;
                    }
                    (entry, compare, threshold)
                };
                if entry.table.rows() != tokens {
                    return Err(R3Error::ReplayRows {
                        layer: info.layer_index,
                        replay_rows: entry.table.rows(),
                        tokens,
                    });
                }
                let device = scores.device();
                if compare && threshold.is_none() {
                    // Compared at `take_flip_stats`, in one read with the other layers'.
                    let own = scores.topk_with_indices(k, 1).1;
                    self.lock()?.pending.push(PendingCompare {
                        layer_index: info.layer_index,
                        top_k: k,
                        entry: entry.clone(),
                        own,
                    });
                } else if threshold.is_some() {
                    let own = read_ids(scores.topk_with_indices(k, 1).1, info.layer_index)?;
                    let mut stats = FlipStats::new();
                    stats.observe(
                        info.layer_index,
                        k,
                        &entry.table.layer_ids(entry.moe_layer),
                        &own,
                    );
                    let counts = stats.layers()[&info.layer_index];
                    self.lock()?.flips.merge(&stats);
                    if let Some(fraction) = threshold
                        && counts.no_overlap as f64 > fraction * tokens as f64
                    {
                        return Err(R3Error::ReplayCheck {
                            layer: info.layer_index,
                            mismatched: counts.no_overlap as usize,
                            tokens,
                            threshold: fraction,
                        });
                    }
                }
                let ids = entry.table.replay_ids(entry.moe_layer);
                Ok(Tensor::from_data(
                    TensorData::new(ids, [tokens, k]),
                    &device,
                ))
            }
        }
    }
}

/// Reads `[tokens, k]` expert ids back to the host as `i32`.
fn read_ids(ids: Tensor<2, Int>, layer: usize) -> Result<Vec<i32>, R3Error> {
    ids.into_data()
        .convert::<i32>()
        .try_into_vec::<i32>()
        .map_err(|e| R3Error::Readback {
            layer,
            reason: format!("{e:?}"),
        })
}

impl RouterHook for RoutingReplay {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        selection_scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        let stage = self.stage()?;
        self.select(stage, layer, selection_scores)
    }
}

/// A [`RoutingReplay`] acting in a fixed stage for one forward pass
/// (from [`RoutingReplay::with_stage`]).
#[derive(Debug, Clone, Copy)]
pub struct StagedReplay<'a> {
    replay: &'a RoutingReplay,
    stage: ReplayStage,
}

impl RouterHook for StagedReplay<'_> {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        selection_scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        self.replay.select(self.stage, layer, selection_scores)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn model() -> MoeModel {
        MoeModel::new(3, vec![1, 2], 4, 2).unwrap()
    }

    fn info(m: usize) -> MoeLayerInfo {
        MoeLayerInfo {
            layer_index: m + 1,
            moe_index: m,
            num_experts: 4,
            top_k: 2,
        }
    }

    fn scores(device: &Device) -> Tensor<2> {
        Tensor::from_data(
            [
                [0.1, 0.9, 0.3, 0.5],
                [0.7, 0.2, 0.8, 0.0],
                [0.0, 0.1, 0.2, 0.3],
            ],
            device,
        )
    }

    fn ids(t: Tensor<2, Int>) -> Vec<i32> {
        read_ids(t, 0).unwrap()
    }

    #[test]
    fn stages_record_then_replay() {
        let device = Device::flex();
        let replay = RoutingReplay::new(model());
        assert_eq!(replay.stage().unwrap(), ReplayStage::Fallthrough);
        // Fallthrough: plain top-k, nothing stored.
        assert_eq!(
            ids(replay.select_experts(&info(0), scores(&device)).unwrap()),
            vec![1, 3, 2, 0, 3, 2]
        );
        assert!(replay.is_empty().unwrap());
        // Record: two layers of one micro-batch.
        let rec = replay.with_stage(ReplayStage::Record);
        rec.select_experts(&info(0), scores(&device)).unwrap();
        rec.select_experts(&info(1), scores(&device).neg()).unwrap();
        let recorded = replay.micro_batch(0).unwrap();
        assert_eq!(recorded.layer_ids(0), vec![1, 3, 2, 0, 3, 2]);
        assert_eq!(recorded.layer_ids(1), vec![0, 2, 3, 1, 0, 1]);
        // Replay forward returns the recorded ids whatever the scores say.
        replay.set_stage(ReplayStage::ReplayForward).unwrap();
        let flat = Tensor::<2>::zeros([3, 4], &device);
        assert_eq!(
            ids(replay.select_experts(&info(1), flat.clone()).unwrap()),
            vec![0, 2, 3, 1, 0, 1]
        );
        // The forward cursor is exhausted; the backward cursor is independent.
        assert!(matches!(
            replay.select_experts(&info(1), flat.clone()),
            Err(R3Error::ReplayExhausted {
                stage: "forward",
                ..
            })
        ));
        let back = replay.with_stage(ReplayStage::ReplayBackward);
        assert_eq!(
            ids(back.select_experts(&info(1), flat.clone()).unwrap()),
            vec![0, 2, 3, 1, 0, 1]
        );
        replay.clear_all_forward().unwrap();
        assert!(replay.select_experts(&info(1), flat.clone()).is_ok());
        replay.clear_all().unwrap();
        assert!(replay.is_empty().unwrap());
    }

    #[test]
    fn replay_pads_like_miles_and_checks_rows() {
        let device = Device::flex();
        let replay = RoutingReplay::new(model());
        let t =
            ReplayTable::from_layer_ids(3, 2, 4, &[&[3, 2, -1, -1, -1, -1], &[0, 1, 2, 3, 0, 1]])
                .unwrap();
        replay.push(t.clone()).unwrap();
        replay.push(t).unwrap();
        let hook = replay.with_stage(ReplayStage::ReplayForward);
        assert_eq!(
            ids(hook.select_experts(&info(0), scores(&device)).unwrap()),
            vec![3, 2, 0, 1, 2, 3]
        );
        // Second micro-batch with the wrong token count.
        assert!(matches!(
            hook.select_experts(&info(0), Tensor::zeros([2, 4], &device)),
            Err(R3Error::ReplayRows {
                replay_rows: 3,
                tokens: 2,
                ..
            })
        ));
        // A layer the replay does not know.
        let stray = MoeLayerInfo {
            layer_index: 0,
            ..info(0)
        };
        assert!(matches!(
            hook.select_experts(&stray, scores(&device)),
            Err(R3Error::UnknownLayer { .. })
        ));
        let bad = ReplayTable::from_layer_ids(1, 1, 4, &[&[0], &[1]]).unwrap();
        assert!(matches!(
            replay.push(bad),
            Err(R3Error::TableMismatch { .. })
        ));
    }

    #[test]
    fn compare_and_check_count_flips() {
        let device = Device::flex();
        let replay = RoutingReplay::new(model());
        // Own top-k of scores(): [1,3], [2,0], [3,2].
        let t = ReplayTable::from_layer_ids(3, 2, 4, &[&[3, 1, 2, 1, 0, 1], &[0, 1, 2, 3, 0, 1]])
            .unwrap();
        replay.push(t.clone()).unwrap();
        replay.push(t).unwrap();
        replay.set_compare(true).unwrap();
        let hook = replay.with_stage(ReplayStage::ReplayForward);
        hook.select_experts(&info(0), scores(&device)).unwrap();
        let stats = replay.take_flip_stats().unwrap();
        let c = stats.layers()[&1];
        assert_eq!((c.tokens, c.flipped, c.no_overlap), (3, 2, 1));
        assert_eq!(replay.take_flip_stats().unwrap(), FlipStats::new(), "taken");
        // 1 zero-overlap token of 3 > 0.2 · 3.
        replay.set_check(Some(0.2)).unwrap();
        assert!(matches!(
            hook.select_experts(&info(0), scores(&device)),
            Err(R3Error::ReplayCheck { mismatched: 1, .. })
        ));
    }

    #[test]
    fn stage_names() {
        for stage in [
            ReplayStage::Fallthrough,
            ReplayStage::Record,
            ReplayStage::ReplayForward,
            ReplayStage::ReplayBackward,
        ] {
            assert_eq!(stage.as_str().parse::<ReplayStage>().unwrap(), stage);
        }
        assert!("replay".parse::<ReplayStage>().is_err());
    }
}
