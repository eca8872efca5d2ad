//! miles-bridge: the model layer of miles-rs.
//!
//! This crate owns the architectures RL users post-train, written once in burn and shared by
//! the trainer and the embedded inference engine, the bridges to HF checkpoints, and the
//! sequence scorer both of them use:
//!
//! - the **architecture table** ([`ARCHITECTURES`], one [`ArchitectureSpec`] row per
//!   [`Architecture`], keyed by HF `model_type`): `glm4_moe` (GLM-4.5 / 4.6 / 4.7 MoE: sigmoid
//!   routing with `e_score_correction_bias`, group-limited top-k, shared experts, dense first
//!   layers, partial RoPE), `qwen3` (qk-norm), `qwen3_moe` (softmax routing), `llama` (Llama-3
//!   RoPE scaling), `qwen2` (Qwen2 / Qwen2.5: q/k/v bias; sliding-window layers rejected) and
//!   `deepseek_v3` (DeepSeek-V3 / Moonlight / Kimi-K2: multi-head latent attention, YaRN),
//!   `glm4_moe_lite` (GLM-4.7-Flash: DeepSeek-V3's latent attention with GLM's router, MoE
//!   layers by `mlp_layer_types`), `qwen3_5` / `qwen3_5_moe` (Qwen3.5: Gated DeltaNet
//!   linear-attention layers and gated full attention by `layer_types`, the releases'
//!   vision-language layout read through `text_config` with the vision tower carried through),
//!   `gpt_oss` (GPT-OSS: attention sinks, sliding-window layers by `layer_types`, biased
//!   experts with a clamped SwiGLU behind a biased top-k-then-softmax router, YaRN);
//!   each row says how that architecture's `config.json` maps onto the one [`ModelConfig`]
//!   (defaults, ignored and pinned fields, RoPE scaling, attention kind, MoE layout), read by
//!   [`ModelConfig::from_hf_json`] (transformers-5 `rope_parameters` layout and the older
//!   top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` layout);
//! - [`CausalLm`], one configurable burn model for every architecture, built from the
//!   modules in [`nn`] (linear layers, RMSNorm, SwiGLU MLP, RoPE, grouped-query and latent
//!   attention, the MoE block); one forward for training (padded or packed batches,
//!   per-token positions, routed expert table per MoE layer, [`ModelInput`] →
//!   [`ModelOutput`] / [`HiddenOutput`]) and inference (a contiguous [`KvCache`] for prefill
//!   and decode, a [`PagedKvCache`] allocated once from a token budget); every MoE layer
//!   asks a [`miles_r3::RouterHook`] for its experts, so routing can be recorded or replayed,
//!   and runs its experts as [`MoeDispatch`] says;
//! - the **sequence scorer** ([`score_response`], [`score_log_probs`]): per-token log-probs
//!   and entropy of a response through miles-ops' fused log-prob op, the function the
//!   trainer differentiates through and the embedded engine scores with;
//! - import of HF checkpoints (single file or sharded, any float dtype) and export to
//!   HF-named weights in a chosen dtype, as miles-core's host tensors
//!   ([`miles_core::NamedTensors`], [`miles_core::TensorBytes`], [`miles_core::DType`]) and
//!   its one safetensors codec, through one declarative name table ([`names`]) that stacks /
//!   splits per-expert tensors, and TP / EP sharding ([`parallel`]);
//! - half precision ([`Precision`], Miles' `--bf16` / `--fp16`): weights loaded into or cast
//!   to bf16 / f16 ([`CausalLm::from_pretrained_in`], [`CausalLm::to_precision`]; a
//!   differentiable cast on autodiff devices, for mixed-precision training), with norms,
//!   attention softmax and router scores kept in f32;
//! - LoRA ([`lora`]): adapters on the HF-layout linear layers and the routed experts,
//!   attached by PEFT's `target_modules` rule ([`CausalLm::with_lora`]), merged export for
//!   engines and PEFT adapter import / export;
//! - an op-class profiler ([`profile`]) and typed errors ([`BridgeError`]) naming the
//!   offending tensor or field.
//!
//! **Adding an architecture** is one row of the table plus its model code: add a variant to
//! [`Architecture`] and its row to [`ARCHITECTURES`] (in the variants' order; a compile-time
//! check holds the table to it), filling in the HF names, the defaults transformers gives
//! absent fields, and the attention / RoPE / MoE kinds. An architecture that only recombines
//! what the table already describes needs nothing else; one with a new kind of layer adds
//! the layer to [`nn`], the kind to the row's types and the [`ModelConfig`] field the model
//! is built from.
//!
//! Parameters keep their HF names and HF `[out, in]` layouts, so export is the identity on
//! bytes for f32 checkpoints.
//!
//! ```
//! use burn::tensor::Device;
//! use miles_bridge::{CausalLm, ModelConfig, ModelInput, ids_tensor, token_logprobs};
//! use miles_r3::Fallthrough;
//!
//! let config = ModelConfig::from_hf_json(r#"{
//!     "model_type": "glm4_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
//!     "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
//!     "num_key_value_heads": 1, "head_dim": 8, "n_routed_experts": 4,
//!     "num_experts_per_tok": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.5
//! }"#).unwrap();
//! let device = Device::flex();
//! let model = CausalLm::init(&config, &device).unwrap();
//! let ids = ids_tensor(&[vec![1, 5, 7, 2]], &device).unwrap();
//! let out = model.forward(&ModelInput::new(ids.clone()), &Fallthrough).unwrap();
//! assert_eq!(out.logits.dims(), [1, 4, 32]);
//! assert_eq!(out.routing.len(), 1); // layer 0 is dense, layer 1 is MoE
//! assert_eq!(out.routing[0].experts.dims(), [4, 2]);
//! let lp = token_logprobs(out.logits, ids);
//! assert_eq!(lp.dims(), [1, 3]);
//! ```

mod config;
mod error;
mod kv_cache;
mod kv_pool;
mod model;
mod paged;
mod precision;
mod scoring;
mod state_pool;

pub mod lora;
pub mod names;
pub mod nn;
pub mod parallel;
pub mod profile;

pub use config::{
    ARCHITECTURES, Architecture, ArchitectureSpec, AttentionKind, ExpertCountField, ExpertKind,
    FieldRule, LayerType, LinearAttentionConfig, Llama3RopeScaling, MlaConfig, MlpLayerType,
    ModelConfig, MoeLayers, MoeSpec, MultimodalLayout, PinnedField, PinnedValue, RopeScalingKind,
    RouterKind, SharedExpertKind, YarnRopeScaling,
};
pub use error::BridgeError;
pub use kv_cache::{KvCache, LayerCache};
pub use model::causal_lm::{CausalLm, mtp_tensor_names};
pub use model::forward::{HiddenOutput, ModelInput, ModelOutput, ids_tensor};
pub use model::recompute::{
    RecomputeConfig, RecomputeGranularity, RecomputeMethod, RecomputePlan, RecomputedForward,
};
pub use nn::linear::DecodeWeights;
pub use nn::moe::{MoeDispatch, MoeRouting};
pub use paged::{PagedKvCache, RowId};
pub use precision::Precision;
pub use scoring::{
    check_response, score_hidden_rows, score_log_probs, score_response, score_response_hidden,
    token_logprobs,
};
