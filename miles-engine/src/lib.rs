//! # miles-engine
//!
//! The embedded inference engine of miles-rs: any miles-bridge [`CausalLm`](miles_bridge::CausalLm)
//! served through miles-core's [`InferenceEngine`](miles_core::InferenceEngine) on a
//! non-autodiff device (flex by default).
//!
//! One scheduler thread owns the model. Between decode steps it takes commands (new requests,
//! aborts, pause / resume, cache flushes, weight updates), admits waiting requests while the KV
//! token budget allows (reusing the longest cached prefix; the prompts admitted together are
//! prefilled together: prompts of similar lengths right-padded into one forward of at most
//! 4,096 positions, equal lengths only for a hybrid model, a prompt alone in its group by the
//! single-sequence prefill), then runs one batched decode step over every running sequence:
//! continuous batching. Each sequence
//! samples from its own seeded generator, so a request's tokens do not depend on what it was
//! batched with.
//!
//! KV cache: one paged pool per layer ([`miles_bridge::PagedKvCache`]), allocated when the
//! engine starts from `kv_token_budget` (on the CPU bounded by `kv_memory_fraction` of the
//! memory available then, see [`KvBudget`]; plus one block per running sequence for rounding)
//! and never grown ([`RolloutKvNeed`]: the budget a rollout can fill, `miles train`'s default). An admitted request takes blocks for its whole reservation (prompt +
//! `max_new_tokens`), its prefill is copied in, each decode step writes one slot per sequence
//! in place, and the blocks return to the pool when it finishes (its cache is copied out to the
//! prefix cache first). On flex (`f32`, AVX-512F) decode attention reads the pool directly.
//!
//! Hybrid models (Qwen3.5's Gated DeltaNet linear-attention layers beside full attention): the
//! same pool keeps, for every linear layer, one state slot per running sequence (its conv window
//! and delta-rule state; a fixed size whatever the length), allocated once. [`StateBudget`]
//! charges each slot as its bytes' worth of `kv_token_budget` positions (at most
//! `max_running_requests` slots and at most half the budget): an admitted request takes a free
//! slot or waits, and returns it when it finishes, is aborted or retracted. Prefill writes the
//! chunked form's final states into the slot, each decode step runs the recurrent form over the
//! batch's slots. A state cannot be cut back, so a cached prefix is reused only whole (the next
//! turn of a session), never truncated (a repeated prompt is prefilled again).
//!
//! GPT-OSS (attention sinks, a sliding window on the layers `layer_types` marks) decodes from
//! the same pool as transformers attends: its layers gather their keys (a sliding layer only its
//! window's) and attend with tensor ops (the flex decode kernel takes neither sinks nor a
//! window); blocks of positions that left a window stay held until the sequence finishes.
//!
//! Versions: a weight update waits until no sequence is mid-generation (admission stops, the
//! running ones finish), then swaps the weights and flushes the prefix cache; every output
//! carries the single version all its tokens were generated with. Sequences held by an in-place
//! or retract pause when an update arrives end with finish reason `abort` at the old version
//! (their partial output is returned, as Miles' partial rollout expects) rather than continuing
//! on new weights.
//!
//! Log-probs: per-token log-probs of the sampled tokens under the untempered distribution. With
//! `recompute_logprobs_via_prefill` (default on) they are recomputed after the sequence ends by
//! a [`SequenceScorer`] over the whole sequence; the default scorer,
//! [`TrainerScorer`], is the trainer's own scoring function (`miles_bridge`'s sequence scorer,
//! which miles-train calls), so rollout log-probs equal the trainer's bit for bit with no glue. Aborted requests keep their decode-time log-probs: a weight update ends every
//! interrupted request at once, and a prefill per request then would stall the update (the
//! difference is float rounding under the same weights, which TIS absorbs).
//!
//! Serve it over SGLang's HTTP protocol with miles-session's `sglang_router` (the
//! `miles serve --model DIR` command does), put several behind miles-session's `Router`,
//! or drive it from miles-rollout's RL loops: it is just an `InferenceEngine`.
//!
//! ```
//! use burn::tensor::Device;
//! use miles_bridge::{CausalLm, ModelConfig};
//! use miles_core::{GenerateRequest, InferenceEngine, SamplingParams};
//! use miles_engine::{EmbeddedEngine, EngineConfig};
//!
//! let config = ModelConfig::from_hf_json(
//!     r#"{"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32,
//!     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
//!     "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
//!     "rope_theta": 10000.0, "tie_word_embeddings": true}"#,
//! )
//! .unwrap();
//! let model = CausalLm::init(&config, &Device::flex()).unwrap();
//! let engine = EmbeddedEngine::new(model, EngineConfig::default()).unwrap();
//! let mut params = SamplingParams::default();
//! params.max_new_tokens = Some(4);
//! params.temperature = 0.0;
//! let request = GenerateRequest::new(vec![1, 2, 3], params);
//! let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! let output = runtime.block_on(engine.generate(request)).unwrap();
//! assert_eq!(output.output_ids.len(), 4);
//! assert_eq!(output.output_log_probs.len(), 4);
//! ```

mod command;
mod config;
mod engine;
mod error;
mod input_scoring;
mod prefill;
mod release;
mod sampling;
mod scheduler;
pub mod serve;
mod step;

pub use command::{Detokenizer, EngineStats};
pub use config::{
    DEFAULT_KV_MEMORY_FRACTION, DEFAULT_MAX_NEW_TOKENS, EngineConfig, KvBudget, RolloutKvNeed,
    StateBudget, available_memory, eos_from_tokenizer_config, read_eos_ids,
};
pub use engine::{EmbeddedEngine, EngineBuilder};
pub use error::{Error, Result};
pub use step::{PrefillScorer, SequenceScorer, TrainerScorer};
