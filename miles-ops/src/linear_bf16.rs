//! Training linear layer `x · wᵀ` for `bf16` tensors on flex through Intel AMX, forward and
//! backward.
//!
//! flex multiplies `bf16` tensors by converting both operands to `f32` and running an `f32`
//! `gemm` (about as fast as `f32`); on CPUs with AMX (Sapphire Rapids and later Xeons)
//! [`linear_bf16`] runs the product on AMX tiles instead ([`Bf16LinearOps`]), and so do its
//! two gradients, `∂x = ∂y · w` and `∂w = ∂yᵀ · x`: `f32` accumulation, results rounded to
//! `bf16`, as flex's own `bf16` matmul returns them up to summation order (AMX also treats
//! `bf16` subnormal inputs as zero). Other dtypes, other devices, CPUs without AMX,
//! `MILES_NO_AMX=1` or the fused ops switched off ([`crate::fused_ops_enabled`]) take
//! [`crate::linear_train`]: for `f32` autodiff tensors on flex (with the fused ops on) the
//! plain forward with gradients each written once, else `x.matmul(w.transpose())`
//! ([`crate::linear_reference`]) unchanged.

use std::borrow::Cow;

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, DType, Dispatch, DispatchDevice, Flex, backend_extension,
    tensor::FloatTensor,
};
use burn::tensor::{Tensor, TensorData, bf16};

use crate::flex::amx::{self, MatrixView, matmul_bf16};
use crate::flex::tensor::{as_f32, dims, f32_data};

/// `x · wᵀ` for `x` `[rows, in]` and `w` `[out, in]`; panics on mismatched widths as
/// `matmul` does. `bf16` on flex with AMX: [`Bf16LinearOps`] (see the module docs);
/// otherwise [`crate::linear_train`] (`f32` autodiff tensors on flex: the plain forward, its
/// gradients each written once; else `x.matmul(w.transpose())`).
pub fn linear_bf16(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    let x_takes = x.dtype() == burn::tensor::DType::BF16 && on_flex(&x);
    if x.dims()[1] != w.dims()[1] || !x_takes || !runs_amx(&w) {
        return crate::matmul::linear_train(x, w);
    }
    Tensor::from_dispatch(<Dispatch as Bf16LinearOps>::linear_bf16(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

/// Whether [`linear_bf16`] runs on AMX for a weight `w` (and `bf16` input rows on flex): `w`
/// `bf16` on flex (with or without autodiff), the fused ops on, and AMX available in this
/// process.
pub fn runs_amx(w: &Tensor<2>) -> bool {
    w.dtype() == burn::tensor::DType::BF16
        && on_flex(w)
        && crate::fused_ops_enabled()
        && amx::available()
}

/// Whether `t` lives on flex (with or without autodiff).
fn on_flex(t: &Tensor<2>) -> bool {
    matches!(
        t.device().without_autodiff().as_dispatch(),
        DispatchDevice::Flex(_)
    )
}

/// Backend op of [`linear_bf16`] (flex, with its autodiff version).
#[backend_extension(Flex, Autodiff)]
pub trait Bf16LinearOps: Backend {
    /// `x · wᵀ` (`x` `[rows, in]`, `w` `[out, in]`), rounded to `bf16`.
    fn linear_bf16(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `op(lhs) · op(rhs)` rounded to `bf16`, `op` transposing the 2-D operand when its flag
    /// is set; not tracked by autodiff (the gradients of [`Bf16LinearOps::linear_bf16`]).
    fn matmul_bf16(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        lhs_transposed: bool,
        rhs_transposed: bool,
    ) -> FloatTensor<Self>;
}

/// A tensor's values for [`matmul_bf16`]: its `bf16` data, or `f32` data (other dtypes cast)
/// that the packing rounds to `bf16`.
enum Values<'a> {
    Bf16(Cow<'a, [bf16]>),
    F32(Vec<f32>),
}

/// The contiguous `bf16` data of a `bf16` tensor in logical order.
fn bf16_data(t: &FloatTensor<Flex>) -> Cow<'_, [bf16]> {
    match t.as_slice::<bf16>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(
            t.to_contiguous()
                .as_slice::<bf16>()
                .map(<[bf16]>::to_vec)
                .unwrap_or_default(),
        ),
    }
}

impl Values<'_> {
    fn of(t: &FloatTensor<Flex>) -> Values<'_> {
        if t.dtype() == DType::BF16 {
            Values::Bf16(bf16_data(t))
        } else {
            let t = as_f32(t.clone());
            Values::F32(f32_data(&t).into_owned())
        }
    }

    /// The view of a row-major `[rows, cols]` matrix, transposed when `transposed`.
    fn view(&self, cols: usize, transposed: bool) -> MatrixView<'_> {
        let view = match self {
            Values::Bf16(d) => MatrixView::bf16(d, (cols, 1)),
            Values::F32(d) => MatrixView::f32(d, (cols, 1)),
        };
        if transposed { view.t() } else { view }
    }
}

impl Bf16LinearOps for Flex {
    fn linear_bf16(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::matmul_bf16(x, w, false, true)
    }

    fn matmul_bf16(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        lhs_transposed: bool,
        rhs_transposed: bool,
    ) -> FloatTensor<Self> {
        let ([lr, lc], [rr, rc]) = (two_dims(&lhs), two_dims(&rhs));
        let (m, k) = if lhs_transposed { (lc, lr) } else { (lr, lc) };
        let (rk, n) = if rhs_transposed { (rc, rr) } else { (rr, rc) };
        assert_eq!(k, rk, "bf16 matmul: inner dimensions {k} and {rk} differ");
        let (a, b) = (Values::of(&lhs), Values::of(&rhs));
        let mut out = vec![bf16::from_f32(0.0); m * n];
        matmul_bf16(
            m,
            n,
            k,
            &mut out,
            n,
            a.view(lc, lhs_transposed),
            b.view(rc, rhs_transposed),
        );
        FloatTensor::<Flex>::from_data(TensorData::new(out, vec![m, n]))
    }
}

/// The two dims of a 2-D tensor.
fn two_dims(t: &FloatTensor<Flex>) -> [usize; 2] {
    let d = dims(t);
    assert_eq!(d.len(), 2, "bf16 matmul of a {}-D tensor", d.len());
    [d[0], d[1]]
}

#[derive(Debug)]
struct LinearBf16Backward;

impl<B: Bf16LinearOps> Backward<B, 2> for LinearBf16Backward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        // y = x·wᵀ: ∂x = ∂y·w, ∂w = ∂yᵀ·x.
        if let Some(node) = node_w {
            grads.register::<B>(node.id, B::matmul_bf16(grad.clone(), x, true, false));
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::matmul_bf16(grad, w, false, false));
        }
    }
}

impl<B: Backend + Bf16LinearOps, C: CheckpointStrategy> Bf16LinearOps for Autodiff<B, C> {
    fn linear_bf16(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let guards = [x.node(), w.node()];
        let (x, w) = (x.into_primitive(), w.into_primitive());
        match LinearBf16Backward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::linear_bf16(x.clone(), w.clone());
                prep.finish((x, w), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_bf16(x, w)),
        }
    }

    fn matmul_bf16(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        lhs_transposed: bool,
        rhs_transposed: bool,
    ) -> FloatTensor<Self> {
        // Constants: only called inside the op's own backward.
        <Self as AutodiffBackend>::from_inner(B::matmul_bf16(
            lhs.into_primitive(),
            rhs.into_primitive(),
            lhs_transposed,
            rhs_transposed,
        ))
    }
}
