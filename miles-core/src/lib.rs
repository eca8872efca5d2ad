//! # miles-core
//!
//! The shared vocabulary and seams of miles-rs. Every other crate speaks these types, and
//! meets the others only through the traits defined here:
//!
//! * [`Sample`]: one trajectory with tokens, loss mask, rollout log-probs, routed experts,
//!   reward, status and weight versions — every field of Miles' `Sample`, with its invariants
//!   checked at construction and on deserialisation.
//! * [`Message`], [`ToolCall`], [`ToolSpec`]: OpenAI-shaped chat messages.
//! * [`RoutedExperts`]: the `[rows, layers, top_k]` MoE routing table with SGLang's base64
//!   little-endian int32 codec, merge and truncation (R3).
//! * [`WeightVersion`], [`DType`], [`TensorBytes`], [`NamedTensors`]: versioned HF-named host
//!   tensors and the one safetensors codec (bytes, files, sharded Hugging Face checkpoint
//!   directories) of the workspace.
//! * [`GenerateRequest`], [`GenerateOutput`], [`SamplingParams`]: the token-level generation
//!   protocol with SGLang's field names.
//! * The seams: [`InferenceEngine`] (async, object-safe), [`PolicyTrainer`] (blocking),
//!   [`RewardFn`] (async, object-safe), [`MetricsSink`] (+ [`JsonlMetricsSink`]).
//! * Observability: [`tensorboard::TensorBoardSink`] (TensorBoard event files, written by hand),
//!   [`FanoutMetricsSink`] (several sinks at once), and [`prometheus`]: a small registry
//!   and text-format encoder with SGLang's engine metrics, a trainer set and
//!   [`prometheus::PrometheusMetricsSink`].
//! * [`python`]: Python's semantics where our text must be Python's — `repr(float)`,
//!   `json.dumps`, `str()` / `repr()` of JSON values, truthiness, `round`, `str` methods and
//!   `float()` — one module for every crate.
//! * [`rng::SplitMix64`]: the one small seeded generator of the workspace.
//!
//! It depends only on serde, serde_json, thiserror and async-trait, so `cargo add miles-core`
//! stays light.
//!
//! ```
//! use miles_core::{Prompt, RoutedExperts, Sample, SampleStatus};
//!
//! // A two-token response to a three-token prompt, routed through 2 layers with top-2 experts.
//! let routes = RoutedExperts::from_base64(
//!     "AAAAAAEAAAACAAAAAwAAAAQAAAAFAAAABgAAAAcAAAAIAAAACQAAAAoAAAALAAAADAAAAA0AAAAOAAAADwAAAA==",
//!     4, 2,
//! )?;
//! assert_eq!(routes.shape(), [4, 2, 2]);
//! let sample = Sample::builder(Prompt::Text("1+1=".into()))
//!     .tokens(vec![10, 11, 12, 13, 14], 2)
//!     .loss_mask(vec![1, 1])
//!     .rollout_log_probs(vec![-0.1, -0.2])
//!     .routed_experts(routes)
//!     .status(SampleStatus::Completed)
//!     .build()?;
//! assert_eq!(sample.response_tokens(), &[13, 14]);
//!
//! // A loss mask with the wrong length is a typed error, not a panic.
//! let bad = Sample::builder(Prompt::Text("x".into())).tokens(vec![1, 2], 1).loss_mask(vec![1, 1]).build();
//! assert!(matches!(bad, Err(miles_core::Error::SampleLength { field: "loss_mask", .. })));
//! # Ok::<(), miles_core::Error>(())
//! ```

pub mod base64;
mod engine;
mod error;
mod message;
mod metrics;
pub mod prometheus;
pub mod python;
mod reward;
pub mod rng;
mod routed;
mod sample;
pub mod tensorboard;
mod trainer;
mod weights;

pub use engine::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, InputLogprobRequest,
    InputLogprobs, MemoryTag, PauseMode, RequestId, SamplingParams, output_text,
};
pub use error::{EngineErrorKind, Error, Result};
pub use message::{
    Content, FunctionCall, FunctionSpec, Message, Role, ToolArguments, ToolCall, ToolSpec,
    pydantic_lax_bool,
};
pub use metrics::{
    FanoutMetricsSink, JsonlMetricsSink, MemoryMetricsSink, Metrics, MetricsSink, metrics_line,
};
pub use reward::RewardFn;
pub use routed::RoutedExperts;
pub use sample::{
    PrefixCacheInfo, Prompt, Reward, Sample, SampleBuilder, SampleStatus, SpecInfo, TokenId,
};
pub use trainer::PolicyTrainer;
pub use weights::{
    DType, INDEX_FILE, InProcessWeights, MAX_HEADER_BYTES, NamedTensors, SINGLE_FILE, TensorBytes,
    WeightVersion,
};

/// Re-exported so implementors of the async seams use the same macro version.
pub use async_trait::async_trait;
