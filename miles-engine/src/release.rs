//! Releasing the engine's memory while the trainer trains, and taking it back (SGLang's
//! `/release_memory_occupation` and `/resume_memory_occupation`, what Miles'
//! `--offload-rollout` calls around each training step of a colocated run).
//!
//! A release waits, as a weight update does, until no sequence is generating and every
//! finished one is answered; then, for [`MemoryTag::Weights`], the scheduler drops its served
//! version and the step model's decode copies (stacked or packed weights where it has them),
//! keeping only the model's configuration: in process, the served version is the trainer's
//! own buffers, so once the engine lets go of them the optimizer updates them in place
//! instead of copying them. For [`MemoryTag::KvCache`] it shrinks the KV pool to one block
//! and drops the prefix cache. Generation requests sent meanwhile wait in the queue, and
//! input scoring is refused.
//! The weights come back with the next weight update (built as every update is: no step ever
//! runs on a previous version), the pool with a resume of `kv_cache`, which needs the weights
//! back first (Miles' order: resume the weights, update them, resume the KV cache).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use miles_bridge::{CausalLm, PagedKvCache};
use miles_core::{MemoryTag, NamedTensors};
use tokio::sync::oneshot;

use crate::scheduler::Scheduler;

/// Maps every float parameter to an empty tensor of its rank, dtype and device.
struct Hollow;

impl ModuleMapper for Hollow {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        param.map(|t| Tensor::empty([0; D], (&t.device(), t.dtype())))
    }
}

/// `model`'s configuration without its weights: what the scheduler keeps while its weights are
/// released (requests are still checked against the configuration; no step runs).
fn without_weights(model: &CausalLm) -> CausalLm {
    let mut hollow = model.clone().map(&mut Hollow);
    hollow.packed_lm_head = None;
    hollow.passthrough = NamedTensors::new();
    hollow
}

impl Scheduler {
    /// Drops the served version (its weights and decode copies), keeping its configuration;
    /// only while nothing generates.
    pub(crate) fn drop_served_weights(&mut self) {
        let hollow = Arc::new(without_weights(&self.model));
        self.step = hollow.clone();
        self.model = hollow;
    }

    /// Applies a pending release once nothing generates and every finished sequence is
    /// answered (the updates queued before it are applied first).
    pub(crate) fn apply_release(&mut self) {
        if self.pending_release.is_none()
            || !self.running.is_empty()
            || !self.finished.is_empty()
            || !self.updates.is_empty()
        {
            return;
        }
        let Some((tags, reply)) = self.pending_release.take() else {
            return;
        };
        self.prefix.clear();
        if tags.contains(&MemoryTag::KvCache) && !self.released.kv_cache {
            // One block (and a spare) instead of the budget; built while the step model still
            // has its weights (the pool's layout is read from them).
            let rows = match self.pool.state_slots() {
                0 => self.config.max_running_requests,
                slots => slots,
            };
            match PagedKvCache::new(&self.step, 1, 1) {
                Ok(pool) => {
                    self.pool = pool;
                    self.released.pool_rows = rows;
                    self.released.kv_cache = true;
                }
                Err(e) => tracing::warn!("KV pool not released: {e}"),
            }
        }
        if tags.contains(&MemoryTag::Weights) && !self.released.weights {
            self.drop_served_weights();
            self.released.weights = true;
        }
        self.publish_released();
        let _ = reply.send(());
    }

    /// Takes back what `tags` name: the KV pool is allocated again at its budget (an error while
    /// the weights are still released); released weights come back with the next update.
    pub(crate) fn resume_memory(
        &mut self,
        tags: &[MemoryTag],
        reply: oneshot::Sender<Result<(), String>>,
    ) {
        let mut result = Ok(());
        if tags.contains(&MemoryTag::KvCache) && self.released.kv_cache {
            if self.released.weights {
                result = Err(
                    "the KV cache comes back after the weights: update the weights \
                              before resuming kv_cache"
                        .to_string(),
                );
            } else {
                let rows = self.released.pool_rows;
                match PagedKvCache::new(&self.step, self.config.kv_token_budget, rows) {
                    Ok(pool) => {
                        self.pool = pool;
                        self.released.kv_cache = false;
                    }
                    Err(e) => result = Err(format!("KV cache: {e}")),
                }
            }
        }
        self.publish_released();
        let _ = reply.send(result);
    }

    /// Makes what is released visible to the engine handle.
    pub(crate) fn publish_released(&self) {
        let shared = &self.shared;
        shared
            .weights_released
            .store(self.released.weights, Ordering::SeqCst);
        shared
            .kv_released
            .store(self.released.kv_cache, Ordering::SeqCst);
    }
}
