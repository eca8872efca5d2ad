//! The seam between a model's MoE layers and routing replay: what a layer is, the hook it
//! calls with its router scores, the pass-through hook and the score check.

use burn::tensor::{Int, Tensor};

use crate::error::R3Error;

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
