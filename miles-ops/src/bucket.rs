//! Expert bucketing for the sparse MoE dispatch, computed where the routing is: the
//! `(token, slot)` pairs of a `[tokens, top_k]` table of chosen expert ids sorted by expert,
//! without reading the ids back to the host on CubeCL devices.

use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
use burn::backend::{Backend, Dispatch, Flex, backend_extension, tensor::IntTensor};
use burn::tensor::{Int, Tensor, TensorData};

use crate::{OpsError, Result};

/// The expert-sorted order of a routing table, on its device. All tensors have the ids'
/// int dtype.
///
/// Pair `p = t · top_k + j` is token `t`'s `j`-th choice. [`bucket_by_expert`] returns, on the
/// ids' device ([`ExpertBuckets`]): the groups' slot offsets `[experts + 1]` (group `e` holds
/// slots `offsets[e]..offsets[e + 1]`, the layout [`crate::grouped_matmul_offsets`]
/// takes), and for every slot of the expert-sorted order its pair and token, plus the inverse
/// permutation (the slot of every pair). The order is **stable**: the pairs of one expert keep
/// ascending pair order, so results are deterministic.
///
/// Ids outside `0..experts` (a router hook may return anything) are never used as an index:
/// their pairs get the slots after the last group (`offsets[experts]..pairs`, in pair order),
/// where the grouped matmul writes zero rows, and are counted in [`ExpertBuckets::invalid`] (a
/// device scalar, never read here: a caller that reads something per step can fold it into
/// that read; [`HostBuckets::new`] reports it on the host).
///
/// On CubeCL devices (feature `wgpu` / `cuda`) three small kernels do it: one unit per expert
/// (plus one for invalid ids) counts its pairs, one unit turns the counts into offsets (experts
/// are at most a few hundred), and one unit per expert walks the pairs in order writing its
/// slots — `O(experts × pairs)` work in `experts + 1` parallel units. Elsewhere (flex, or with
/// the fused ops switched off) the ids are read and [`HostBuckets::new`], the counting sort
/// that is also the kernels' test oracle, does it.
#[derive(Debug, Clone)]
pub struct ExpertBuckets {
    /// `[experts + 1]`: group `e` holds slots `offsets[e]..offsets[e + 1]`;
    /// `offsets[experts]` is the number of valid pairs.
    pub offsets: Tensor<1, Int>,
    /// `[pairs]`: the pair `t · top_k + j` placed at each slot.
    pub pair_of_slot: Tensor<1, Int>,
    /// `[pairs]`: the token `t` of each slot's pair.
    pub token_of_slot: Tensor<1, Int>,
    /// `[pairs]`: the slot of each pair (the inverse of `pair_of_slot`).
    pub slot_of_pair: Tensor<1, Int>,
    /// `[1]`: how many ids lie outside `0..experts`.
    pub invalid: Tensor<1, Int>,
}

/// The same on the host: the counting sort the device kernels are checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBuckets {
    /// `[experts + 1]` group offsets.
    pub offsets: Vec<usize>,
    /// The pair at each slot.
    pub pair_of_slot: Vec<usize>,
    /// The token of each slot's pair.
    pub token_of_slot: Vec<usize>,
    /// The slot of each pair.
    pub slot_of_pair: Vec<usize>,
    /// Ids outside `0..experts`.
    pub invalid: usize,
}

impl HostBuckets {
    /// Buckets row-major `[tokens, top_k]` ids (`top_k ≥ 1`) over `experts` experts; invalid
    /// ids go after the last group, in pair order.
    pub fn new(ids: &[i64], top_k: usize, experts: usize) -> Self {
        let k = top_k.max(1);
        let expert_of = |id: i64| usize::try_from(id).ok().filter(|&e| e < experts);
        // Group `experts` collects the invalid ids.
        let mut counts = vec![0usize; experts + 1];
        for &id in ids {
            counts[expert_of(id).unwrap_or(experts)] += 1;
        }
        let mut cursor = Vec::with_capacity(experts + 1);
        let mut at = 0;
        for &n in &counts {
            cursor.push(at);
            at += n;
        }
        let mut offsets = cursor.clone();
        offsets.truncate(experts);
        offsets.push(cursor[experts]);
        let mut pair_of_slot = vec![0; ids.len()];
        let mut slot_of_pair = vec![0; ids.len()];
        for (p, &id) in ids.iter().enumerate() {
            let g = expert_of(id).unwrap_or(experts);
            pair_of_slot[cursor[g]] = p;
            slot_of_pair[p] = cursor[g];
            cursor[g] += 1;
        }
        let token_of_slot = pair_of_slot.iter().map(|&p| p / k).collect();
        Self {
            offsets,
            pair_of_slot,
            token_of_slot,
            slot_of_pair,
            invalid: counts[experts],
        }
    }
}

/// Buckets the `[tokens, top_k]` chosen expert ids by expert on their device (see the module
/// docs). Errors when `experts` or `top_k` is zero or `experts` exceeds `u32`.
pub fn bucket_by_expert(ids: Tensor<2, Int>, experts: usize) -> Result<ExpertBuckets> {
    let [tokens, top_k] = ids.dims();
    if experts == 0 || top_k == 0 || u32::try_from(experts).is_err() {
        return Err(OpsError::ShapeMismatch {
            what: "bucket_by_expert ids / experts",
            expected: vec![tokens, top_k.max(1), experts.max(1)],
            got: vec![tokens, top_k, experts],
        });
    }
    let pairs = tokens * top_k;
    let device = ids.device();
    let flat = ids.reshape([pairs]);
    if pairs > 0 && crate::runs_fused(&device) {
        let (offsets, pair_of_slot, token_of_slot, slot_of_pair, invalid) =
            <Dispatch as ExpertBucketOps>::bucket_by_expert(flat.into_dispatch(), experts, top_k);
        return Ok(ExpertBuckets {
            offsets: Tensor::from_dispatch(offsets),
            pair_of_slot: Tensor::from_dispatch(pair_of_slot),
            token_of_slot: Tensor::from_dispatch(token_of_slot),
            slot_of_pair: Tensor::from_dispatch(slot_of_pair),
            invalid: Tensor::from_dispatch(invalid),
        });
    }
    let data = flat.into_data();
    let dtype = data.dtype();
    let host: Vec<i64> =
        data.convert::<i64>()
            .try_into_vec::<i64>()
            .map_err(|_| OpsError::ShapeMismatch {
                what: "bucket_by_expert ids (unreadable)",
                expected: vec![pairs],
                got: vec![0],
            })?;
    let b = HostBuckets::new(&host, top_k, experts);
    let make = |v: &[usize]| {
        let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
        let n = v.len();
        Tensor::<1, Int>::from_data(TensorData::new(v, [n]).convert_dtype(dtype), &device)
    };
    Ok(ExpertBuckets {
        offsets: make(&b.offsets),
        pair_of_slot: make(&b.pair_of_slot),
        token_of_slot: make(&b.token_of_slot),
        slot_of_pair: make(&b.slot_of_pair),
        invalid: make(&[b.invalid]),
    })
}

/// Backend op of [`bucket_by_expert`]: flat `[pairs]` ids →
/// `(offsets, pair_of_slot, token_of_slot, slot_of_pair, invalid)`.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait ExpertBucketOps: Backend {
    /// Buckets the flat ids (`pairs ≥ 1`) of `top_k` choices per token over `experts`.
    #[allow(clippy::type_complexity)]
    fn bucket_by_expert(
        ids: IntTensor<Self>,
        experts: usize,
        top_k: usize,
    ) -> (
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
    );
}

impl ExpertBucketOps for Flex {
    fn bucket_by_expert(
        ids: IntTensor<Self>,
        experts: usize,
        top_k: usize,
    ) -> (
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
    ) {
        let data = ids.into_data();
        let dtype = data.dtype();
        // Flex int data always converts to i64.
        let host: Vec<i64> = data
            .convert::<i64>()
            .try_into_vec::<i64>()
            .unwrap_or_default();
        let b = HostBuckets::new(&host, top_k, experts);
        let make = |v: &[usize]| {
            let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            let n = v.len();
            IntTensor::<Self>::from_data(TensorData::new(v, [n]).convert_dtype(dtype))
        };
        (
            make(&b.offsets),
            make(&b.pair_of_slot),
            make(&b.token_of_slot),
            make(&b.slot_of_pair),
            make(&[b.invalid]),
        )
    }
}

impl<B: Backend + ExpertBucketOps, C: CheckpointStrategy> ExpertBucketOps for Autodiff<B, C> {
    fn bucket_by_expert(
        ids: IntTensor<Self>,
        experts: usize,
        top_k: usize,
    ) -> (
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
        IntTensor<Self>,
    ) {
        // Int tensors carry no gradient: the inner backend's op as is.
        B::bucket_by_expert(ids, experts, top_k)
    }
}
