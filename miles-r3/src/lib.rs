//! miles-r3: rollout routing replay (R3) for MoE training (Miles' rollout routing replay).
//!
//! This crate owns the **training side** of routing replay:
//!
//! * [`RouterHook`] — the trait every MoE layer of `miles-bridge` calls to choose its experts,
//!   and [`Fallthrough`] (ordinary top-k routing).
//! * Batch mapping — [`replay_table_for_batch`] maps each [`miles_core::Sample`]'s
//!   `rollout_routed_experts` (`[tokens − 1, all layers, top_k]` int32, as SGLang returns it)
//!   onto a padded or packed training batch ([`BatchLayout`]) and onto the model's MoE layers
//!   ([`MoeModel`]; dense layers skipped), giving a compact [`ReplayTable`] (`u8` / `u16` ids,
//!   `-1` padding on each sample's last token and on batch padding, as Miles pads). Missing
//!   tables, row-count / layer / top-k mismatches and out-of-range ids are typed [`R3Error`]s.
//! * The replay state machine — [`RoutingReplay`] with stages `fallthrough`, `record`,
//!   `replay_forward`, `replay_backward` ([`ReplayStage`]), chosen per forward with
//!   [`RoutingReplay::with_stage`], one micro-batch list and two cursors per MoE layer
//!   (Miles' `RoutingReplayManager`).
//! * Statistics — [`FlipStats`]: per-layer fraction of tokens whose expert set differs between
//!   rollout and trainer, as `r3/flip_rate/layer_{i}` metrics.
//!
//! The hook contract: an MoE layer computes its *selection scores* (GLM-4-MoE: sigmoid scores
//! plus `e_score_correction_bias`, experts outside the kept groups at `-inf`; Qwen3-MoE: the
//! softmax probabilities), hands them to the hook with a [`MoeLayerInfo`] and receives the
//! `[tokens, top_k]` expert ids to use. The layer then recomputes the gate weights from its
//! own router scores at those ids (GLM: un-biased sigmoid, renormalised, times
//! `routed_scaling_factor`; Qwen3-MoE: softmax, renormalised), so in replay the indices come
//! from the rollout while the router still gets gradients — exactly Miles' replay routers.
//!
//! From engine output to trainer forward: the engine's `meta_info.routed_experts` decodes
//! into `Sample::rollout_routed_experts` (miles-core); the trainer calls
//! [`RoutingReplay::push_samples`] with the micro-batch's samples and layout and passes the
//! replay as the model's router hook.
//!
//! ```
//! use burn::tensor::{Device, Tensor};
//! use miles_core::{Prompt, RoutedExperts, Sample};
//! use miles_r3::{BatchLayout, MoeLayerInfo, MoeModel, ReplayStage, RouterHook, RoutingReplay};
//!
//! // Two layers: layer 0 dense, layer 1 MoE with 4 experts, top-2.
//! let model = MoeModel::first_k_dense(2, 1, 4, 2)?;
//! // A 3-token sample: 2 routed rows over both layers (dense entries are 0), as SGLang sends.
//! let routed = RoutedExperts::new(2, 2, 2, vec![0, 0, 3, 1, 0, 0, 2, 0])?;
//! let sample = Sample::builder(Prompt::Text("hi".into()))
//!     .tokens(vec![5, 6, 7], 1)
//!     .routed_experts(routed)
//!     .build()?;
//!
//! let replay = RoutingReplay::new(model);
//! replay.push_samples(&[sample], &BatchLayout::padded(1, 4))?;
//!
//! // The MoE layer's call during the trainer forward over that batch (4 positions).
//! let layer = MoeLayerInfo { layer_index: 1, moe_index: 0, num_experts: 4, top_k: 2 };
//! let scores = Tensor::<2>::ones([4, 4], &Device::flex());
//! let experts = replay.with_stage(ReplayStage::ReplayForward).select_experts(&layer, scores)?;
//! let ids = experts.into_data().convert::<i32>().try_into_vec::<i32>().unwrap();
//! // Rollout rows, then the last token's and the padding's -1 rows spread as Miles does.
//! assert_eq!(ids, vec![3, 1, 2, 0, 0, 1, 2, 3]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod error;
mod hook;
mod model;
mod replay;
mod stats;
mod table;

pub use error::R3Error;
pub use hook::{Fallthrough, MoeLayerInfo, RouterHook, check_scores};
pub use model::MoeModel;
pub use replay::{ReplayStage, RoutingReplay, StagedReplay};
pub use stats::{FlipStats, LayerFlips};
pub use table::{BatchLayout, BatchTokens, ReplayTable, replay_table_for_batch};
