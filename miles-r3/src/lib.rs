//! miles-r3: rollout routing replay (R3) for MoE training (MILES_SPEC §4).
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

use burn::tensor::{Int, Tensor};

mod error;
mod model;
mod replay;
mod stats;
mod table;

pub use error::R3Error;
pub use model::MoeModel;
pub use replay::{ReplayStage, RoutingReplay, StagedReplay};
pub use stats::{FlipStats, LayerFlips};
pub use table::{BatchLayout, BatchTokens, ReplayTable, replay_table_for_batch};

/// What an MoE layer tells its [`RouterHook`] about itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MoeLayerInfo {
    /// Index of the layer in the whole model (dense layers included), as in HF parameter names.
    pub layer_index: usize,
    /// Index among the MoE layers only (0 for the first MoE layer).
    pub moe_index: usize,
    /// Number of routed experts.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
}

/// Chooses the experts of every token of one MoE layer.
///
/// Object safe: models hold a `&dyn RouterHook` for the duration of a forward pass.
/// Implementations may keep state behind interior mutability (a recorder, a replay cursor).
pub trait RouterHook: Send + Sync {
    /// Given the `[tokens, num_experts]` selection scores of `layer` (higher is better; experts
    /// that must not be chosen hold `-inf`), return the `[tokens, top_k]` expert indices to
    /// route each token to. The returned tensor must live on the scores' device.
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        selection_scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error>;
}

/// Normal routing: the `top_k` highest selection scores, best first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fallthrough;

impl RouterHook for Fallthrough {
    fn select_experts(
        &self,
        layer: &MoeLayerInfo,
        selection_scores: Tensor<2>,
    ) -> Result<Tensor<2, Int>, R3Error> {
        check_scores(layer, &selection_scores)?;
        let (_, indices) = selection_scores.topk_with_indices(layer.top_k, 1);
        Ok(indices)
    }
}

/// Validates the shape of `scores` and `layer.top_k` against `layer`.
pub fn check_scores(layer: &MoeLayerInfo, scores: &Tensor<2>) -> Result<(), R3Error> {
    let dims = scores.dims();
    if dims[1] != layer.num_experts {
        return Err(R3Error::ScoreShape {
            layer: layer.layer_index,
            num_experts: layer.num_experts,
            got: dims.to_vec(),
        });
    }
    if layer.top_k == 0 || layer.top_k > layer.num_experts {
        return Err(R3Error::InvalidTopK {
            layer: layer.layer_index,
            top_k: layer.top_k,
            num_experts: layer.num_experts,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    fn info(num_experts: usize, top_k: usize) -> MoeLayerInfo {
        MoeLayerInfo {
            layer_index: 3,
            moe_index: 2,
            num_experts,
            top_k,
        }
    }

    #[test]
    fn fallthrough_is_top_k_with_neg_inf_excluded() {
        let device = Device::flex();
        let scores = Tensor::<2>::from_data(
            [[f32::NEG_INFINITY, 5.0, f32::NEG_INFINITY, 1.0, 2.0]],
            &device,
        );
        let hook: &dyn RouterHook = &Fallthrough;
        let ids = hook.select_experts(&info(5, 3), scores).unwrap();
        assert_eq!(ids.into_data().try_to_vec::<i32>().unwrap(), vec![1, 4, 3]);
    }

    #[test]
    fn wrong_shapes_are_typed_errors() {
        let device = Device::flex();
        let scores = Tensor::<2>::zeros([2, 4], &device);
        let err = Fallthrough
            .select_experts(&info(5, 2), scores.clone())
            .unwrap_err();
        assert!(matches!(err, R3Error::ScoreShape { num_experts: 5, .. }));
        let err = Fallthrough.select_experts(&info(4, 0), scores).unwrap_err();
        assert!(matches!(err, R3Error::InvalidTopK { top_k: 0, .. }));
    }
}
