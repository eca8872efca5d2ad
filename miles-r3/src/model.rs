//! What the replay needs to know about a model: which layers are MoE and how they route.

use crate::R3Error;

/// The routing shape of an MoE model: its layer count, which of those layers are MoE (in
/// order), the number of routed experts and `top_k`. Dense layers have no router and are
/// skipped when routing tables are mapped onto the model (Miles' trainer-side R3 mapping).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoeModel {
    num_layers: usize,
    moe_layers: Vec<usize>,
    num_experts: usize,
    top_k: usize,
}

impl MoeModel {
    /// A model of `num_layers` layers whose MoE layers are `moe_layers` (strictly increasing
    /// model layer indices), each routing to `top_k` of `num_experts` experts.
    pub fn new(
        num_layers: usize,
        moe_layers: Vec<usize>,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self, R3Error> {
        let invalid = |reason: String| Err(R3Error::InvalidModel { reason });
        if moe_layers.is_empty() {
            return invalid("no MoE layers".into());
        }
        if moe_layers.windows(2).any(|w| w[0] >= w[1]) {
            return invalid(format!(
                "MoE layers {moe_layers:?} are not strictly increasing"
            ));
        }
        if let Some(&last) = moe_layers.last()
            && last >= num_layers
        {
            return invalid(format!(
                "MoE layer {last} is not below num_layers {num_layers}"
            ));
        }
        if top_k == 0 || top_k > num_experts {
            return invalid(format!("top_k {top_k} is not in 1..={num_experts}"));
        }
        if num_experts > u16::MAX as usize {
            return Err(R3Error::TooManyExperts { num_experts });
        }
        Ok(Self {
            num_layers,
            moe_layers,
            num_experts,
            top_k,
        })
    }

    /// GLM-4-MoE / DeepSeek layout: layers `< first_k_dense_replace` are dense, the rest MoE.
    pub fn first_k_dense(
        num_layers: usize,
        first_k_dense_replace: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self, R3Error> {
        Self::new(
            num_layers,
            (first_k_dense_replace..num_layers).collect(),
            num_experts,
            top_k,
        )
    }

    /// Megatron's integer `--moe-layer-freq`: layer `l` is MoE when `l % freq == 0`.
    pub fn every(
        num_layers: usize,
        freq: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self, R3Error> {
        if freq == 0 {
            return Err(R3Error::InvalidModel {
                reason: "moe_layer_freq 0".into(),
            });
        }
        Self::new(
            num_layers,
            (0..num_layers).filter(|l| l % freq == 0).collect(),
            num_experts,
            top_k,
        )
    }

    /// All layers of the model, dense ones included.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Model layer indices of the MoE layers, in order.
    pub fn moe_layers(&self) -> &[usize] {
        &self.moe_layers
    }

    /// Number of MoE layers.
    pub fn num_moe_layers(&self) -> usize {
        self.moe_layers.len()
    }

    /// Routed experts per MoE layer.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The position of model layer `layer` among the MoE layers, if it is one.
    pub fn moe_index(&self, layer: usize) -> Option<usize> {
        self.moe_layers.binary_search(&layer).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        let glm = MoeModel::first_k_dense(4, 1, 8, 2).unwrap();
        assert_eq!(glm.moe_layers(), &[1, 2, 3]);
        assert_eq!(glm.moe_index(2), Some(1));
        assert_eq!(glm.moe_index(0), None);
        let freq = MoeModel::every(6, 2, 8, 2).unwrap();
        assert_eq!(freq.moe_layers(), &[0, 2, 4]);
    }

    #[test]
    fn invalid_descriptions_are_errors() {
        assert!(matches!(
            MoeModel::new(3, vec![2, 1], 8, 2),
            Err(R3Error::InvalidModel { .. })
        ));
        assert!(MoeModel::new(3, vec![3], 8, 2).is_err());
        assert!(MoeModel::new(3, vec![1], 8, 9).is_err());
        assert!(MoeModel::first_k_dense(3, 3, 8, 2).is_err());
        assert!(matches!(
            MoeModel::new(3, vec![1], 70_000, 2),
            Err(R3Error::TooManyExperts { .. })
        ));
    }
}
