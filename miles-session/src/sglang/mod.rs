//! SGLang's HTTP protocol, both ends, and a router over engines:
//!
//! * the client: [`SglangEngine`], an [`InferenceEngine`](miles_core::InferenceEngine) over an
//!   SGLang-compatible server (`/generate` with token ids, log-probs, routed experts, weight
//!   versions; pause / continue / flush / abort; weight updates from disk), and
//!   [`WeightPublisher`], which writes HF-named safetensors for `update_weights_from_disk`;
//! * the server: [`sglang_router`], the SGLang routes (`/generate`, `/v1/chat/completions`,
//!   health, model / server info, pause / continue / abort / flush, weight updates) served over
//!   any `InferenceEngine` — the embedded engine, a [`Router`] over a fleet, or a test double —
//!   described by a [`ServerInfo`], and [`serve`], which binds, hardens and serves it;
//! * the [`Router`]: itself an `InferenceEngine` over several engines (sticky routing keys,
//!   least outstanding requests, failover, health checks with re-creation and weight catch-up).
//!
//! Client and server read and write the same `/generate` types: the request body
//! ([`GenerateRequestBody`], SGLang's `GenerateReqInput`: text or ids, batches, `n`; the
//! client writes it from miles-core's [`GenerateRequest`](miles_core::GenerateRequest)) and
//! the answer ([`GenerateResponse`]).

mod admin;
mod chat;
mod client;
mod generate;
mod info;
mod router;
mod serve;
mod server;
mod state;
mod wire;

pub use client::{SglangConfig, SglangEngine, WeightDtype, WeightPublisher};
pub use info::{DEFAULT_MAX_NEW_TOKENS, ServerInfo, load_chat_tokenizer};
pub use router::{EngineFactory, MAX_ROUTING_KEYS, Router};
pub use serve::serve;
pub use server::sglang_router;
pub use wire::{
    GenerateRequestBody, GenerateResponse, MetaInfo, OneOrBatch, TokenLogprob, WireFinishReason,
    WireWeightVersion,
};
