//! Token embedding lookup whose backward adds into the weight's gradient in place.
//!
//! burn's `embedding` differentiates into a fresh dense `[vocab, hidden]` zero gradient with
//! the looked-up rows' gradients scattered into it; with tied embeddings (Qwen3's
//! `tie_word_embeddings`) that matrix is then added to the output projection's gradient of
//! the same weight, so a step writes and adds three vocabulary-sized matrices (at Qwen3-0.6B's
//! 151,936 × 1,024, 622 MB each) for a few hundred gradient rows. [`embedding`] computes the
//! same lookup; on autodiff devices its backward takes the gradient already registered for
//! the weight (the output projection's, whose backward runs first) and adds the rows into it
//! in place (`select_assign` with `Add`), so no zero matrix is made and nothing is added
//! twice. Without one (untied embeddings, or another order) it scatters into zeros as burn
//! does. The same sums either way, within rounding: burn adds the projection's gradient to
//! the scattered rows, this op adds the rows (in position order) onto the projection's
//! gradient.

use burn::backend::autodiff::{
    Autodiff, NodeId,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::ops::{FloatTensorOps, ModuleOps};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Shape, TensorMetadata, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{IndexingUpdateOp, Int, Tensor};

/// The rows of `weight` (`[vocab, hidden]`) at `ids` (`[batch, seq]`): `[batch, seq,
/// hidden]`, as `burn::tensor::module::embedding` computes them; differentiable with respect
/// to `weight`, its backward adding into the weight's gradient in place (see the module
/// docs).
pub fn embedding(weight: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as EmbeddingOps>::embedding_rows(
        weight.into_dispatch(),
        ids.into_dispatch(),
    ))
}

/// `burn::tensor::module::embedding` itself: the reference [`embedding`] is tested against.
pub fn embedding_reference(weight: Tensor<2>, ids: Tensor<2, Int>) -> Tensor<3> {
    burn::tensor::module::embedding(weight, ids)
}

/// Backend extension of [`embedding`]: the plain lookup on every backend, a backward that
/// adds into the registered gradient in place on autodiff ones.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait EmbeddingOps: Backend {
    /// `[batch, seq, hidden]` rows of `weight` `[vocab, hidden]` at `ids` `[batch, seq]`.
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self>;

    /// A zero gradient of `shape` (`[vocab, hidden]`) in `like`'s dtype and device, for the
    /// backward to add rows into when no gradient is registered for the weight. On flex for
    /// `f32` a zeroed `f32` buffer as it is: no second, aligned copy as flex's own zeros
    /// make, and fresh pages from the allocator are zero without being written, so only the
    /// rows added into are touched. On autodiff backends a constant.
    fn embedding_grad_zeros(like: FloatTensor<Self>, shape: [usize; 2]) -> FloatTensor<Self>;
}

impl EmbeddingOps for burn::backend::Flex {
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        Self::embedding(weight, ids)
    }

    fn embedding_grad_zeros(like: FloatTensor<Self>, shape: [usize; 2]) -> FloatTensor<Self> {
        if like.dtype() == burn::backend::DType::F32 {
            crate::flex::tensor::tensor(vec![0.0f32; shape[0] * shape[1]], &shape)
        } else {
            Self::float_zeros(Shape::from(shape), &like.device(), like.dtype().into())
        }
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl EmbeddingOps for burn_cubecl::CubeBackend {
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        Self::embedding(weight, ids)
    }

    fn embedding_grad_zeros(like: FloatTensor<Self>, shape: [usize; 2]) -> FloatTensor<Self> {
        Self::float_zeros(Shape::from(shape), &like.device(), like.dtype().into())
    }
}

#[derive(Debug)]
struct EmbeddingBackward;

/// The weight (to find its registered gradient), its node, the ids and the weight's shape.
type EmbeddingState<B> = (FloatTensor<Autodiff<B>>, NodeId, IntTensor<B>, [usize; 2]);

impl<B: EmbeddingOps> Backward<B, 1> for EmbeddingBackward {
    type State = EmbeddingState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (weight, weight_id, ids, [vocab, hidden]) = ops.state;
        let Some(parent) = parent else {
            return;
        };
        debug_assert_eq!(parent.id, weight_id);
        let n: usize = ids.shape().iter().product();
        let ids = B::int_reshape(ids, Shape::from([n]));
        let rows = B::float_reshape(grad, Shape::from([n, hidden]));
        // The gradient the output projection registered for a tied weight, else zeros.
        let base = weight
            .grad_remove(grads)
            .unwrap_or_else(|| B::embedding_grad_zeros(rows.clone(), [vocab, hidden]));
        let out = B::float_select_assign(base, 0, ids, rows, IndexingUpdateOp::Add);
        grads.register::<B>(parent.id, out);
    }
}

impl<B: Backend + EmbeddingOps, C: CheckpointStrategy> EmbeddingOps for Autodiff<B, C> {
    fn embedding_rows(weight: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        let guards = [weight.node()];
        let shape = weight.shape();
        let dims = [shape[0], shape[1]];
        let kept = weight.clone();
        let id = weight.id();
        let primitive = weight.into_primitive();
        match EmbeddingBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::embedding_rows(primitive, ids.clone());
                prep.finish((kept, id, ids, dims), out)
            }
            OpsKind::UnTracked(prep) => {
                drop(kept);
                prep.finish(B::embedding_rows(primitive, ids))
            }
        }
    }

    fn embedding_grad_zeros(like: FloatTensor<Self>, shape: [usize; 2]) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::embedding_grad_zeros(like.into_primitive(), shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// A weight `[vocab, hidden]` used both as the embedding and (tied) as the output
    /// projection of one row `x`: `loss = Σ embedding(w, ids)·c + Σ_v (x·wᵀ)_v·d_v`, so
    /// `∂w[v] = Σ_{positions p with ids[p] = v} c[p] + d_v·x` (worked out here in f64).
    #[test]
    fn tied_gradient_is_the_sum_of_both_uses() {
        let device = Device::flex().autodiff();
        let (vocab, hidden) = (7usize, 3usize);
        let w: Vec<f32> = (0..vocab * hidden)
            .map(|i| (i as f32 * 0.3).sin())
            .collect();
        let ids = [[1i32, 4, 1], [6, 0, 4]];
        let c: Vec<f32> = (0..6 * hidden).map(|i| (i as f32 * 0.7).cos()).collect();
        let x = [0.5f32, -1.25, 2.0];
        let d: Vec<f32> = (0..vocab).map(|v| v as f32 * 0.25 - 0.5).collect();
        let mut expected = vec![0f64; vocab * hidden];
        for (p, &id) in ids.iter().flatten().enumerate() {
            let row = &mut expected[id as usize * hidden..(id as usize + 1) * hidden];
            for (e, &g) in row.iter_mut().zip(&c[p * hidden..(p + 1) * hidden]) {
                *e += f64::from(g);
            }
        }
        for (i, e) in expected.iter_mut().enumerate() {
            *e += f64::from(d[i / hidden]) * f64::from(x[i % hidden]);
        }
        for (tied, untied) in [(true, false), (false, true)] {
            let weight =
                Tensor::<2>::from_data(TensorData::new(w.clone(), [vocab, hidden]), &device)
                    .require_grad();
            let id_tensor = Tensor::<2, Int>::from_data(
                TensorData::new(ids.iter().flatten().copied().collect::<Vec<_>>(), [2, 3]),
                &device,
            );
            let rows = embedding(weight.clone(), id_tensor.clone());
            let reference = embedding_reference(weight.clone(), id_tensor);
            assert_eq!(
                rows.clone().into_data().try_to_vec::<f32>().unwrap(),
                reference.into_data().try_to_vec::<f32>().unwrap()
            );
            let c_t = Tensor::<3>::from_data(TensorData::new(c.clone(), [2, 3, hidden]), &device);
            let mut loss = (rows * c_t).sum();
            if tied {
                let x_t = Tensor::<2>::from_data(TensorData::new(x.to_vec(), [1, hidden]), &device);
                let d_t = Tensor::<2>::from_data(TensorData::new(d.clone(), [1, vocab]), &device);
                loss = loss + (x_t.matmul(weight.clone().transpose()) * d_t).sum();
            }
            let grads = loss.backward();
            let got = weight
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_to_vec::<f32>()
                .unwrap();
            for (i, (&g, want)) in got.iter().zip(&expected).enumerate() {
                let (v, j) = (i / hidden, i % hidden);
                let head = f64::from(d[v]) * f64::from(x[j]);
                let want = if untied { want - head } else { *want };
                assert!(
                    (f64::from(g) - want).abs() < 1e-5,
                    "tied {tied}, w[{v}][{j}]: {g} vs {want}"
                );
            }
        }
    }
}
