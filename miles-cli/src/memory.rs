//! The memory a `miles train` process plans to hold with the embedded engine, from the model's
//! shape and the run's flags, printed at start (`memory plan: …`).
//!
//! Copies of the weights a `miles train` process holds (f32 training, embedded engine):
//! 1. the trainer's parameters (f32 masters; the autodiff graph reads them, it does not copy
//!    them);
//! 2. the engine's served version: the trainer's own buffers, handed over in process at each
//!    weight push ([`miles_core::InProcessWeights`]: no copy) and shared from the start when
//!    the engine runs on the trainer's device (a separate rollout device loads its own);
//! 3. the engine's decode copies (`EngineConfig::specialised_path`; `miles train` sets
//!    `EngineConfig::decode_weights` to `DecodeWeights::InPlace`): on flex in `f32` with
//!    AVX-512F or AVX2 and FMA, the routed experts of MoE layers alone (the dense projections
//!    and `lm_head` are multiplied where they lie, q / k / v and gate / up read as one matmul
//!    each: a dense model has none); elsewhere q / k / v and gate / up stacked and the
//!    projections stored transposed, about one more copy in the engine's precision. Rebuilt
//!    at every push. (A standalone engine, `miles serve`, packs the dense weights into
//!    panels with AVX-512F instead: one more copy, the faster decode above a few rows.)
//!
//! With `--offload-rollout` (Miles' flag; on by default for `miles train`, as Miles'
//! `--colocate` sets it) the engine releases its served version, its decode copies and (level
//! `kv_cache`) its KV pool before each training step that ends with a push, and takes them
//! back at the push. The optimizer then updates the trainer's buffers in place, so the
//! process holds **two** weight-sized copies at most: the trainer's parameters, and the decode
//! copies while the engine generates (which the training pass does not hold). Without it
//! (`--no-offload-rollout`, and always with `train-async`, which generates while it trains)
//! the engine keeps its buffers through the training step: the optimizer's update writes the
//! trainer's parameters into new buffers (copy-on-write), so from the AdamW step to the next
//! push the engine holds the previous version, a **third** full copy (what keeps every rollout
//! on exactly one weight version), beside the decode copies.
//!
//! Besides: the gradients (one f32 copy, accumulated over micro-batches), AdamW's two moments
//! (two f32 copies), the KV pool (allocated once) and one micro-batch's activations. The
//! peak is the larger of generation / push (trainer's weights, gradients, moments, decode
//! copies and pool) and the training step (the same less what the engine released, plus the
//! larger of the activations and the engine's previous version).

/// Bytes of one GiB.
const GIB: f64 = (1u64 << 30) as f64;

/// The model shape and run sizes a [`MemoryPlan`] is made from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInputs {
    /// Parameters of the policy (tied embeddings counted once).
    pub params: u64,
    /// Decoder layers.
    pub layers: u64,
    /// Hidden size.
    pub hidden: u64,
    /// MLP intermediate size (the dense layers').
    pub intermediate: u64,
    /// Attention heads.
    pub heads: u64,
    /// Width of all query heads together (`heads × head_dim`).
    pub q_width: u64,
    /// Width of all key (or value) heads together (`kv_heads × head_dim`).
    pub kv_width: u64,
    /// Bytes per element of the engine's weights and KV cache (4 for f32, 2 for bf16 / fp16).
    pub engine_dtype_bytes: u64,
    /// Parameters the engine copies into decode layouts
    /// ([`miles_bridge::CausalLm::decode_copy_params`]; 0 without `specialised_path`).
    pub engine_decode_copy_params: u64,
    /// Whether the engine releases its weights (served version and decode copies) while the
    /// trainer trains (`--offload-rollout` at level `weight`).
    pub offload_weights: bool,
    /// Whether it releases its KV pool too (level `kv_cache`).
    pub offload_kv_cache: bool,
    /// Tokens the KV pool holds.
    pub kv_tokens: u64,
    /// Bytes one cached position takes in the pool (every layer's keys and values).
    pub kv_bytes_per_token: u64,
    /// Sequences of one training micro-batch.
    pub micro_batch_seqs: u64,
    /// Tokens of its longest sequence (prompt and response; a padded micro-batch).
    pub seq_len: u64,
}

/// Planned bytes by part (see the module docs for which copy is which).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The trainer's parameters: `params × 4`.
    pub trainer_weights: u64,
    /// The accumulated gradients: `params × 4`.
    pub gradients: u64,
    /// AdamW's moments: `params × 8`.
    pub optimizer: u64,
    /// The engine's previous version between the AdamW step and the next push:
    /// `params × engine_dtype_bytes`; 0 when the engine releases its weights (the optimizer
    /// then updates the trainer's buffers in place).
    pub engine_version: u64,
    /// The engine's decode copies: `engine_decode_copy_params × engine_dtype_bytes`.
    pub engine_decode_copies: u64,
    /// The KV pool: `kv_tokens × kv_bytes_per_token`.
    pub kv_pool: u64,
    /// What the engine releases for the training step: its decode copies with
    /// `offload_weights`, its pool with `offload_kv_cache`.
    pub offloaded: u64,
    /// One micro-batch's activations kept for the backward pass, estimated as
    /// `tokens × layers × (6·hidden + 4·q_width + 4·kv_width + 4·intermediate) × 4` (norm
    /// inputs and outputs, residuals, projections before and after RoPE, attention output,
    /// gate, up, their product and activation) plus `seqs × heads × seq_len² × layers × 8`
    /// (attention scores and probabilities), `tokens = seqs × seq_len`.
    pub activations: u64,
}

impl MemoryPlan {
    /// The plan for `inputs`.
    pub fn new(i: &MemoryInputs) -> Self {
        let tokens = i.micro_batch_seqs * i.seq_len;
        let per_token = 6 * i.hidden + 4 * i.q_width + 4 * i.kv_width + 4 * i.intermediate;
        let attention = i.micro_batch_seqs * i.heads * i.seq_len * i.seq_len * i.layers * 8;
        let engine_copy = i.params * i.engine_dtype_bytes;
        let engine_decode_copies = i.engine_decode_copy_params * i.engine_dtype_bytes;
        let kv_pool = i.kv_tokens * i.kv_bytes_per_token;
        Self {
            trainer_weights: i.params * 4,
            gradients: i.params * 4,
            optimizer: i.params * 8,
            engine_version: if i.offload_weights { 0 } else { engine_copy },
            engine_decode_copies,
            kv_pool,
            offloaded: if i.offload_weights {
                engine_decode_copies
            } else {
                0
            } + if i.offload_kv_cache { kv_pool } else { 0 },
            activations: tokens * i.layers * per_token * 4 + attention,
        }
    }

    /// What the engine holds while it generates and from the push on: its decode copies and
    /// its pool.
    pub fn engine(&self) -> u64 {
        self.engine_decode_copies + self.kv_pool
    }

    /// What is held at every moment of a step: the trainer's weights, gradients, moments,
    /// and the engine's decode copies and pool less what it releases for training.
    pub fn resident(&self) -> u64 {
        self.trainer_weights + self.gradients + self.optimizer + self.engine() - self.offloaded
    }

    /// The planned peak: the larger of generation / push (the resident part plus what the
    /// engine released) and the training step (the resident part plus the larger of the
    /// activations, backward, and the engine's previous version, AdamW step to push).
    pub fn peak(&self) -> u64 {
        (self.resident() + self.activations.max(self.engine_version))
            .max(self.resident() + self.offloaded)
    }

    /// What the trainer is sure to allocate after start (gradients, moments, the engine's
    /// previous version from the AdamW step to the push when it keeps its weights): memory
    /// the engine's KV pool leaves free before its fraction applies. The activations are not in it: their estimate is an
    /// upper bound (padded rows, the prompts' JSON bytes for their tokens) that can exceed the
    /// machine when the step fits; they live in the share the fraction leaves.
    pub fn trainer_growth(&self) -> u64 {
        self.gradients + self.optimizer + self.engine_version
    }

    /// One line for the log: every part and the peak, in GiB, against `available` bytes.
    pub fn line(&self, available: Option<u64>) -> String {
        let g = |b: u64| format!("{:.2}", b as f64 / GIB);
        let mut line = format!(
            "memory plan (GiB): trainer weights {} + gradients {} + AdamW moments {} + engine \
             decode copies {} + KV pool {}; training adds max(activations {}, engine's previous \
             version {}) and releases {} (--offload-rollout); peak {}",
            g(self.trainer_weights),
            g(self.gradients),
            g(self.optimizer),
            g(self.engine_decode_copies),
            g(self.kv_pool),
            g(self.activations),
            g(self.engine_version),
            g(self.offloaded),
            g(self.peak()),
        );
        if let Some(available) = available {
            line.push_str(&format!(" of {} available", g(available)));
        }
        line
    }
}
