//! miles-bridge: the model layer of miles-rs.
//!
//! This crate owns the architectures RL users post-train, written once in burn and shared by
//! the trainer and the embedded inference engine, and the bridges to HF checkpoints:
//!
//! - [`CausalLm`], one burn model for every [`Architecture`], keyed by HF `model_type`:
//!   `glm4_moe` (GLM-4.5 / 4.6 / 4.7 MoE: sigmoid routing with `e_score_correction_bias`,
//!   group-limited top-k, shared experts, dense first layers, partial RoPE), `qwen3` (qk-norm),
//!   `qwen3_moe` (softmax routing), `llama` (Llama-3 RoPE scaling) and `qwen2` (Qwen2 /
//!   Qwen2.5: q/k/v bias; sliding-window layers rejected), configured by
//!   [`ModelConfig`] read from HF `config.json` (transformers-5 `rope_parameters` layout and the
//!   older top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling` layout);
//! - one forward for training (padded or packed batches, per-token positions, routed expert
//!   table per MoE layer) and inference ([`KvCache`] prefill + decode); every MoE layer asks a
//!   [`miles_r3::RouterHook`] for its experts, so routing can be recorded or replayed;
//! - import of HF safetensors (single file or sharded, f32 / bf16 / f16) and export to
//!   HF-named safetensors in a chosen dtype, through one declarative name table
//!   ([`names`]) that stacks / splits per-expert tensors;
//! - half precision ([`Precision`], Miles' `--bf16` / `--fp16`): weights loaded into or cast
//!   to bf16 / f16 ([`CausalLm::from_pretrained_in`], [`CausalLm::to_precision`]; a
//!   differentiable cast on autodiff devices, for mixed-precision training), with norms,
//!   attention softmax and router scores kept in f32;
//! - LoRA ([`lora`]): adapters on the HF-layout linear layers and the routed experts,
//!   attached by PEFT's `target_modules` rule, merged export for engines and PEFT adapter
//!   import / export;
//! - typed errors ([`BridgeError`]) naming the offending tensor or field.
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

pub mod checkpoint;
mod config;
mod error;
pub mod lora;
pub mod mla;
mod model;
pub mod names;
pub mod nn;
pub mod paged;
pub mod parallel;
mod precision;
pub mod profile;

pub use checkpoint::{FloatDtype, HostTensor, TensorMap};
pub use config::{
    ARCHITECTURES, Architecture, ArchitectureSpec, AttentionKind, ExpertCountField, FieldRule,
    Llama3RopeScaling, MlaConfig, ModelConfig, MoeLayers, MoeSpec, PinnedField, PinnedValue,
    RopeScalingKind, RouterKind, YarnRopeScaling,
};
pub use error::BridgeError;
pub use lora::{ExpertLora, LoraAdapter, LoraConfig, LoraForward};
pub use model::{
    CausalLm, DecoderLayer, DecoderModel, Experts, FeedForward, HiddenOutput, KvCache, ModelInput,
    ModelOutput, MoeBlock, MoeDispatch, MoeRouting, PackedMoe, SelfAttention, TopkRouter,
    ids_tensor, mtp_tensor_names, token_logprobs,
};
pub use paged::{PagedKvCache, RowId};
pub use precision::Precision;
