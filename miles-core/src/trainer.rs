//! The [`PolicyTrainer`] seam.

use std::path::Path;

use crate::error::Result;
use crate::metrics::Metrics;
use crate::sample::Sample;
use crate::weights::{InProcessWeights, NamedTensors, WeightVersion};

/// A policy trainer: consumes rewarded samples, updates the policy, exports weights.
///
/// Blocking by design (training saturates the device); async loops call it on a blocking
/// thread. Object-safe, used as `Box<dyn PolicyTrainer>` or `Arc<Mutex<dyn PolicyTrainer>>`.
pub trait PolicyTrainer: Send {
    /// Trains on one rollout's samples. Samples carry rewards and group indices; the trainer
    /// computes advantages itself (as Miles' actor does). Returns the step metrics under
    /// Miles' names (`train/loss`, `train/pg_loss`, …).
    fn train(&mut self, rollout_id: u64, samples: &[Sample]) -> Result<Metrics>;

    /// Exports the current policy weights with HF names.
    fn export_weights(&self) -> Result<NamedTensors>;

    /// The current weights as an in-process value for an engine of the same process that
    /// takes one ([`crate::InferenceEngine::takes_in_process_weights`]): what
    /// [`PolicyTrainer::export_weights`] gives, without the host copy. `None` (the default)
    /// when the trainer has no such form; the caller then exports host tensors.
    fn export_in_process(&self) -> Result<Option<InProcessWeights>> {
        Ok(None)
    }

    /// The version of the current weights (bumped by every optimizer update that changes
    /// what [`PolicyTrainer::export_weights`] returns).
    fn weight_version(&self) -> WeightVersion;

    /// Saves model, optimizer state and version into `dir`.
    fn save_checkpoint(&self, dir: &Path) -> Result<()>;

    /// Restores what [`PolicyTrainer::save_checkpoint`] wrote.
    fn load_checkpoint(&mut self, dir: &Path) -> Result<()>;
}
