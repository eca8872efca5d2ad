//! The one declarative table between HF checkpoint names and this crate's parameter names.
//!
//! Our parameters carry their HF names (`model.layers.3.self_attn.q_proj.weight`, HF
//! `[out, in]` layout, no transposes), with one exception: routed experts are stacked into one
//! tensor per projection (`model.layers.3.mlp.experts.gate_proj.weight`, `[E, out, in]`) so the
//! MoE layer can run all experts without a per-expert loop. [`EXPERT_STACKS`] lists those
//! projections; [`hf_to_internal`] stacks the per-expert HF keys and [`internal_to_hf`] splits
//! them again, so HF → ours → HF is the identity on bytes.

use miles_core::{NamedTensors, TensorBytes};

use crate::error::BridgeError;

/// One stacked-expert rule: `{prefix}mlp.experts.{e}.{projection}.weight` (HF, one tensor per
/// expert `e`) ⇄ `{prefix}mlp.experts.{projection}.weight` (ours, experts stacked on dim 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertStack {
    /// Projection name (`gate_proj`, `up_proj`, `down_proj`).
    pub projection: &'static str,
}

/// The stacked-expert projections (GLM-4-MoE and Qwen3-MoE use the same HF names).
pub const EXPERT_STACKS: &[ExpertStack] = &[
    ExpertStack {
        projection: "gate_proj",
    },
    ExpertStack {
        projection: "up_proj",
    },
    ExpertStack {
        projection: "down_proj",
    },
];

impl ExpertStack {
    /// Our stacked name for the layer prefix `model.layers.{l}.`.
    pub fn internal_name(&self, layer_prefix: &str) -> String {
        format!("{layer_prefix}mlp.experts.{}.weight", self.projection)
    }

    /// The HF name of expert `expert` for the layer prefix `model.layers.{l}.`.
    pub fn hf_name(&self, layer_prefix: &str, expert: usize) -> String {
        format!(
            "{layer_prefix}mlp.experts.{expert}.{}.weight",
            self.projection
        )
    }

    /// If `hf_name` is a per-expert key of this projection, its layer prefix and expert id.
    fn parse<'a>(&self, hf_name: &'a str) -> Option<(&'a str, usize)> {
        let suffix = format!(".{}.weight", self.projection);
        let rest = hf_name.strip_suffix(suffix.as_str())?;
        let at = rest.rfind("mlp.experts.")?;
        let expert: usize = rest[at + "mlp.experts.".len()..].parse().ok()?;
        Some((&hf_name[..at], expert))
    }
}

/// Turns HF-named tensors into our names: per-expert keys are stacked (expert order 0..E,
/// all of them must be present with equal shapes and dtypes); every other key is kept.
pub fn hf_to_internal(
    mut hf: NamedTensors,
    num_experts: usize,
) -> Result<NamedTensors, BridgeError> {
    let mut prefixes: Vec<(String, ExpertStack)> = Vec::new();
    for name in hf.keys() {
        for stack in EXPERT_STACKS {
            if let Some((prefix, _)) = stack.parse(name) {
                let key = (prefix.to_string(), *stack);
                if !prefixes.contains(&key) {
                    prefixes.push(key);
                }
            }
        }
    }
    let mut out = NamedTensors::new();
    for (prefix, stack) in prefixes {
        let mut parts: Vec<TensorBytes> = Vec::with_capacity(num_experts);
        for e in 0..num_experts {
            let name = stack.hf_name(&prefix, e);
            let t = hf
                .remove(&name)
                .ok_or(BridgeError::MissingTensor { name: name.clone() })?;
            if let Some(first) = parts.first()
                && (first.shape() != t.shape() || first.dtype() != t.dtype())
            {
                return Err(BridgeError::ShapeMismatch {
                    name,
                    expected: first.shape().to_vec(),
                    got: t.shape().to_vec(),
                });
            }
            parts.push(t);
        }
        // Any per-expert key left for this projection has an id >= num_experts.
        if let Some(extra) = hf
            .keys()
            .find(|k| stack.parse(k).is_some_and(|(p, _)| p == prefix))
        {
            return Err(BridgeError::UnexpectedTensor {
                name: extra.to_owned(),
            });
        }
        let mut shape = vec![num_experts];
        shape.extend_from_slice(parts[0].shape());
        let dtype = parts[0].dtype();
        let bytes = parts.into_iter().flat_map(TensorBytes::into_data).collect();
        out.insert(
            stack.internal_name(&prefix),
            TensorBytes::new(dtype, shape, bytes)?,
        );
    }
    out.append(&mut hf);
    Ok(out)
}

/// Inverse of [`hf_to_internal`]: splits stacked expert tensors into per-expert HF keys.
pub fn internal_to_hf(internal: NamedTensors) -> NamedTensors {
    let mut out = NamedTensors::new();
    'names: for (name, tensor) in internal {
        for stack in EXPERT_STACKS {
            let suffix = format!("mlp.experts.{}.weight", stack.projection);
            if let Some(prefix) = name.strip_suffix(suffix.as_str())
                && tensor.shape().len() == 3
            {
                for (e, part) in tensor.unstack().into_iter().enumerate() {
                    out.insert(stack.hf_name(prefix, e), part);
                }
                continue 'names;
            }
        }
        out.insert(name, tensor);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: f32) -> TensorBytes {
        TensorBytes::from_f32(vec![1, 2], &[v, v + 0.5]).unwrap()
    }

    #[test]
    fn stack_and_split_round_trip() {
        let mut hf = NamedTensors::new();
        for e in 0..3 {
            hf.insert(
                format!("model.layers.1.mlp.experts.{e}.up_proj.weight"),
                t(e as f32),
            );
        }
        hf.insert("model.norm.weight", t(9.0));
        let ours = hf_to_internal(hf.clone(), 3).unwrap();
        let stacked = &ours["model.layers.1.mlp.experts.up_proj.weight"];
        assert_eq!(stacked.shape(), [3, 1, 2]);
        assert_eq!(
            stacked.to_f32().unwrap(),
            vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
        );
        assert_eq!(internal_to_hf(ours), hf);
    }

    #[test]
    fn missing_and_extra_experts_are_named() {
        let mut hf = NamedTensors::new();
        hf.insert("model.layers.1.mlp.experts.0.up_proj.weight", t(0.0));
        hf.insert("model.layers.1.mlp.experts.2.up_proj.weight", t(0.0));
        match hf_to_internal(hf.clone(), 2) {
            Err(BridgeError::MissingTensor { name }) => {
                assert_eq!(name, "model.layers.1.mlp.experts.1.up_proj.weight")
            }
            other => panic!("{other:?}"),
        }
        hf.insert("model.layers.1.mlp.experts.1.up_proj.weight", t(0.0));
        match hf_to_internal(hf, 2) {
            Err(BridgeError::UnexpectedTensor { name }) => {
                assert_eq!(name, "model.layers.1.mlp.experts.2.up_proj.weight")
            }
            other => panic!("{other:?}"),
        }
    }
}
