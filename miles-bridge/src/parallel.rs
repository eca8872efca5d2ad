//! Tensor- and expert-parallel sharding of HF-named checkpoints, Megatron style.
//!
//! One declarative table ([`TP_RULES`]) says how each HF tensor is cut across tensor-parallel
//! ranks: column-parallel projections (`q/k/v_proj`, MLA's `q_b_proj` / `kv_b_proj`,
//! `gate_proj`, `up_proj`, per expert too)
//! split their output dim 0 (biases with them), row-parallel ones (`o_proj`, `down_proj`)
//! split their input dim 1, the vocabulary matrices (`embed_tokens`, `lm_head`) split dim 0,
//! and everything else (norms, router, `e_score_correction_bias`) is replicated. Expert
//! parallelism gives EP rank `r` the routed experts `r*E/ep .. (r+1)*E/ep` (keeping their
//! global ids in the names) and replicates every non-expert tensor. [`gather_shards`] inverts
//! [`shard`] exactly.

use miles_core::{NamedTensors, TensorBytes};

use crate::error::BridgeError;

/// How one tensor is laid out across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpLayout {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Rank `r` holds the `r`-th of `tp` equal slices along `dim`.
    Split {
        /// Dimension that is cut.
        dim: usize,
    },
}

/// Name-suffix → layout table (first match wins; no match = replicated).
pub const TP_RULES: &[(&str, TpLayout)] = &[
    ("self_attn.q_proj.weight", TpLayout::Split { dim: 0 }),
    ("self_attn.q_proj.bias", TpLayout::Split { dim: 0 }),
    ("self_attn.k_proj.weight", TpLayout::Split { dim: 0 }),
    ("self_attn.k_proj.bias", TpLayout::Split { dim: 0 }),
    ("self_attn.v_proj.weight", TpLayout::Split { dim: 0 }),
    ("self_attn.v_proj.bias", TpLayout::Split { dim: 0 }),
    ("self_attn.o_proj.weight", TpLayout::Split { dim: 1 }),
    // Multi-head latent attention: the per-head up-projections are column-parallel; the
    // down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and their norms are replicated.
    ("self_attn.q_b_proj.weight", TpLayout::Split { dim: 0 }),
    ("self_attn.kv_b_proj.weight", TpLayout::Split { dim: 0 }),
    ("gate_proj.weight", TpLayout::Split { dim: 0 }),
    ("up_proj.weight", TpLayout::Split { dim: 0 }),
    ("down_proj.weight", TpLayout::Split { dim: 1 }),
    ("embed_tokens.weight", TpLayout::Split { dim: 0 }),
    ("lm_head.weight", TpLayout::Split { dim: 0 }),
];

/// The layout of HF tensor `name`.
pub fn tp_layout(name: &str) -> TpLayout {
    TP_RULES
        .iter()
        .find(|(suffix, _)| name.ends_with(suffix))
        .map_or(TpLayout::Replicated, |(_, layout)| *layout)
}

/// The routed-expert id in an HF name (`...mlp.experts.{e}.…`), if any.
pub fn expert_id(name: &str) -> Option<usize> {
    let rest = &name[name.find("mlp.experts.")? + "mlp.experts.".len()..];
    rest.split('.').next()?.parse().ok()
}

/// Slice `index` of `parts` equal slices of `t` along `dim`.
fn slice(
    name: &str,
    t: &TensorBytes,
    dim: usize,
    parts: usize,
    index: usize,
) -> Result<TensorBytes, BridgeError> {
    let size = *t
        .shape()
        .get(dim)
        .ok_or_else(|| BridgeError::ShapeMismatch {
            name: name.to_string(),
            expected: vec![parts],
            got: t.shape().to_vec(),
        })?;
    if size % parts != 0 {
        return Err(BridgeError::config(
            "tp",
            format!("dim {dim} of `{name}` ({size}) is not divisible by {parts}"),
        ));
    }
    let outer: usize = t.shape()[..dim].iter().product();
    let inner: usize = t.shape()[dim + 1..].iter().product::<usize>() * t.dtype().size();
    let chunk = size / parts;
    let mut bytes = Vec::with_capacity(outer * chunk * inner);
    for o in 0..outer {
        let base = (o * size + index * chunk) * inner;
        bytes.extend_from_slice(&t.data()[base..base + chunk * inner]);
    }
    let mut shape = t.shape().to_vec();
    shape[dim] = chunk;
    Ok(TensorBytes::new(t.dtype(), shape, bytes)?)
}

/// Concatenates `parts` along `dim` (inverse of [`slice`]).
fn concat(name: &str, parts: &[&TensorBytes], dim: usize) -> Result<TensorBytes, BridgeError> {
    let first = parts[0];
    if let Some(other) = parts
        .iter()
        .find(|p| p.shape() != first.shape() || p.dtype() != first.dtype())
    {
        return Err(BridgeError::ShapeMismatch {
            name: name.to_string(),
            expected: first.shape().to_vec(),
            got: other.shape().to_vec(),
        });
    }
    let shape = first.shape();
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product::<usize>() * first.dtype().size();
    let chunk = shape[dim];
    let mut bytes = Vec::with_capacity(first.data().len() * parts.len());
    for o in 0..outer {
        for p in parts {
            bytes.extend_from_slice(&p.data()[o * chunk * inner..(o + 1) * chunk * inner]);
        }
    }
    let mut shape = shape.to_vec();
    shape[dim] = chunk * parts.len();
    Ok(TensorBytes::new(first.dtype(), shape, bytes)?)
}

/// The tensors that (TP rank `tp_rank` of `tp`, EP rank `ep_rank` of `ep`) holds.
pub fn shard(
    tensors: &NamedTensors,
    tp: usize,
    tp_rank: usize,
    ep: usize,
    ep_rank: usize,
    num_experts: usize,
) -> Result<NamedTensors, BridgeError> {
    if tp == 0 || tp_rank >= tp || ep == 0 || ep_rank >= ep {
        return Err(BridgeError::config(
            "tp/ep",
            "ranks must be below positive sizes",
        ));
    }
    if !num_experts.is_multiple_of(ep) {
        return Err(BridgeError::config(
            "ep",
            format!("{num_experts} experts are not divisible by ep = {ep}"),
        ));
    }
    let per_rank = num_experts / ep;
    let mut out = NamedTensors::new();
    for (name, t) in tensors {
        if let Some(e) = expert_id(name)
            && e / per_rank != ep_rank
        {
            continue;
        }
        let piece = match tp_layout(name) {
            TpLayout::Replicated => t.clone(),
            TpLayout::Split { dim } => slice(name, t, dim, tp, tp_rank)?,
        };
        out.insert(name, piece);
    }
    Ok(out)
}

/// Rebuilds the full tensors from `shards[ep_rank][tp_rank]` (inverse of [`shard`]).
pub fn gather_shards(shards: &[Vec<NamedTensors>]) -> Result<NamedTensors, BridgeError> {
    let mut out = NamedTensors::new();
    for (ep_rank, tp_shards) in shards.iter().enumerate() {
        let Some(first) = tp_shards.first() else {
            return Err(BridgeError::config("tp", "no tensor-parallel shards"));
        };
        for name in first.keys() {
            // Non-expert tensors are replicated across EP ranks: take them from rank 0.
            if expert_id(name).is_none() && ep_rank > 0 {
                continue;
            }
            let mut parts = Vec::with_capacity(tp_shards.len());
            for shard in tp_shards {
                parts.push(shard.get(name).ok_or_else(|| BridgeError::MissingTensor {
                    name: name.to_owned(),
                })?);
            }
            let full = match tp_layout(name) {
                TpLayout::Replicated => parts[0].clone(),
                TpLayout::Split { dim } => concat(name, &parts, dim)?,
            };
            out.insert(name, full);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: Vec<usize>, start: f32) -> TensorBytes {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| start + i as f32).collect();
        TensorBytes::from_f32(shape, &values).unwrap()
    }

    #[test]
    fn column_and_row_splits_by_hand() {
        let mut m = NamedTensors::new();
        m.insert("model.layers.0.self_attn.q_proj.weight", t(vec![4, 2], 0.0));
        m.insert("model.layers.0.self_attn.o_proj.weight", t(vec![2, 4], 0.0));
        m.insert("model.norm.weight", t(vec![2], 0.0));
        let r1 = shard(&m, 2, 1, 1, 0, 1).unwrap();
        assert_eq!(
            r1["model.layers.0.self_attn.q_proj.weight"]
                .to_f32()
                .unwrap(),
            vec![4.0, 5.0, 6.0, 7.0]
        );
        assert_eq!(
            r1["model.layers.0.self_attn.o_proj.weight"]
                .to_f32()
                .unwrap(),
            vec![2.0, 3.0, 6.0, 7.0]
        );
        assert_eq!(r1["model.norm.weight"], m["model.norm.weight"]);
    }

    #[test]
    fn tp_ep_round_trip() {
        let mut m = NamedTensors::new();
        for e in 0..4 {
            m.insert(
                format!("model.layers.1.mlp.experts.{e}.gate_proj.weight"),
                t(vec![4, 6], e as f32),
            );
            m.insert(
                format!("model.layers.1.mlp.experts.{e}.down_proj.weight"),
                t(vec![6, 4], e as f32),
            );
        }
        m.insert("model.layers.1.mlp.gate.weight", t(vec![4, 6], 0.5));
        m.insert("lm_head.weight", t(vec![8, 6], 0.0));
        let shards: Vec<Vec<NamedTensors>> = (0..2)
            .map(|ep| {
                (0..2)
                    .map(|tp| shard(&m, 2, tp, 2, ep, 4).unwrap())
                    .collect()
            })
            .collect();
        assert!(shards[1][0].contains_key("model.layers.1.mlp.experts.3.gate_proj.weight"));
        assert!(!shards[1][0].contains_key("model.layers.1.mlp.experts.1.gate_proj.weight"));
        assert_eq!(
            shards[0][1]["model.layers.1.mlp.experts.0.gate_proj.weight"].shape(),
            [2, 6]
        );
        assert_eq!(gather_shards(&shards).unwrap(), m);
        assert!(shard(&m, 3, 0, 1, 0, 4).is_err());
        assert!(shard(&m, 1, 0, 3, 0, 4).is_err());
    }
}
