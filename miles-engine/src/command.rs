//! What the engine handle and its scheduler thread share: the commands sent to the thread, a
//! pending request with its reply channel, the counters and the detokenizer seam.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};

use miles_bridge::CausalLm;
use miles_core::{
    GenerateOutput, GenerateRequest, InputLogprobRequest, InputLogprobs, MemoryTag, PauseMode,
    RequestId, WeightVersion,
};
use tokio::sync::oneshot;

/// Turns output ids into text, for stop strings.
pub trait Detokenizer: Send + Sync {
    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> String;
}

impl Detokenizer for tokenizers::Tokenizer {
    fn decode(&self, ids: &[u32]) -> String {
        std::ops::Deref::deref(self)
            .decode(ids, false)
            .unwrap_or_default()
    }
}

/// Counters of an engine's life, for tests and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Decode steps run.
    pub decode_steps: u64,
    /// Largest number of sequences decoded in one step.
    pub max_batch: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u64,
    /// Tokens prefilled.
    pub prefill_tokens: u64,
    /// Most prompts prefilled together in one batched forward (0 while every prompt ran
    /// alone; see the crate docs).
    pub max_prefill_batch: usize,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Requests that had to wait for KV budget (or, for a hybrid model, a state slot).
    pub budget_waits: u64,
    /// Linear-attention state slots of a hybrid model (0 for other models; see
    /// [`crate::StateBudget`]).
    pub state_slots: usize,
    /// State slots no running sequence holds.
    pub free_state_slots: usize,
}

pub(crate) enum Cmd {
    Generate(Box<Pending>),
    Abort(RequestId),
    AbortAll,
    Pause(PauseMode, oneshot::Sender<()>),
    Resume,
    Flush(oneshot::Sender<()>),
    Update(Box<CausalLm>, WeightVersion, oneshot::Sender<()>),
    Release(Vec<MemoryTag>, oneshot::Sender<()>),
    ResumeMemory(Vec<MemoryTag>, oneshot::Sender<Result<(), String>>),
    InputLogprobs(
        Box<InputLogprobRequest>,
        oneshot::Sender<miles_core::Result<InputLogprobs>>,
    ),
    Shutdown,
}

pub(crate) struct Pending {
    pub(crate) request: GenerateRequest,
    pub(crate) reply: oneshot::Sender<miles_core::Result<GenerateOutput>>,
}

pub(crate) struct Shared {
    pub(crate) version: AtomicU64,
    pub(crate) alive: AtomicBool,
    /// The scheduler has released its weights ([`crate::release`]).
    pub(crate) weights_released: AtomicBool,
    /// The scheduler has released its KV pool.
    pub(crate) kv_released: AtomicBool,
    pub(crate) stats: Mutex<EngineStats>,
    /// SGLang-named Prometheus metrics the scheduler keeps current, once attached.
    pub(crate) metrics: OnceLock<Arc<miles_core::prometheus::SglangMetrics>>,
}

/// What the engine has released ([`crate::release`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Released {
    /// The served weights and decode copies are gone until the next weight update.
    pub(crate) weights: bool,
    /// The KV pool is shrunk to one block until a resume of `kv_cache`.
    pub(crate) kv_cache: bool,
    /// Rows (sequences, or a hybrid model's state slots) the full pool is allocated for.
    pub(crate) pool_rows: usize,
}

impl Released {
    /// Whether generation has to wait (weights or KV cache released).
    pub(crate) fn holds_generation(self) -> bool {
        self.weights || self.kv_cache
    }
}
