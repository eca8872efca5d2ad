//! Grouped matmul for MoE experts: rows sorted by expert, each group multiplied by its own
//! expert's weight, forward and backward as one op.
//!
//! For `x` `[rows, k]` whose rows come in consecutive groups of `group_sizes[e]` rows and
//! stacked weights `w` `[experts, m, k]` (HF's `[out, in]` per expert), [`grouped_matmul`]
//! returns `[rows, m]` with group `e` equal to `x_e · w_eᵀ`. Backward:
//! `∂x_e = ∂y_e · w_e`, `∂w_e = ∂y_eᵀ · x_e` (zero for an expert without rows).
//!
//! On flex (`f32`) it is one backend op ([`GroupedMatmulOps`]): one `gemm` per group, groups
//! in parallel (rayon), and a backward that writes each expert's weight gradient and each
//! group's input gradient in place; on CubeCL devices (feature `wgpu` / `cuda`, `f32`) CubeCL
//! kernels do the same (one unit per output element). Written with tensor ops instead
//! ([`grouped_matmul_reference`]: a slice of `x` and a narrow of `w` per group), autodiff turns
//! every slice and narrow into a zero tensor of the full input's size plus an add, which for
//! an MoE layer is gigabytes of memory traffic per training step.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Flex, backend_extension, tensor::FloatTensor,
};
use burn::tensor::Tensor;
use rayon::prelude::*;

use crate::flex_attention::matmul;
use crate::flex_util::{as_f32, dims, f32_data, takes_fused, tensor};
use crate::{OpsError, Result};

/// `x_e · w_eᵀ` for consecutive row groups (see the module docs). Errors when the group
/// sizes do not add up to the rows, there are more groups than experts, or `k` differs.
pub fn grouped_matmul(x: Tensor<2>, w: Tensor<3>, group_sizes: &[usize]) -> Result<Tensor<2>> {
    let [rows, k] = x.dims();
    let [experts, m, wk] = w.dims();
    if wk != k || group_sizes.len() > experts {
        return Err(OpsError::ShapeMismatch {
            what: "grouped_matmul weights",
            expected: vec![group_sizes.len().max(experts), m, k],
            got: w.dims().to_vec(),
        });
    }
    let total: usize = group_sizes.iter().sum();
    if total != rows {
        return Err(OpsError::ShapeMismatch {
            what: "grouped_matmul group sizes (sum)",
            expected: vec![rows],
            got: vec![total],
        });
    }
    if !takes_fused(&[x.dtype(), w.dtype()], &x.device()) {
        return Ok(grouped_matmul_reference(x, w, group_sizes));
    }
    let mut sizes = group_sizes.to_vec();
    sizes.resize(experts, 0);
    Ok(Tensor::from_dispatch(
        <Dispatch as GroupedMatmulOps>::grouped_matmul(x.into_dispatch(), w.into_dispatch(), sizes),
    ))
}

/// The same with tensor ops: a slice of `x` and a narrow of `w` per non-empty group.
pub fn grouped_matmul_reference(x: Tensor<2>, w: Tensor<3>, group_sizes: &[usize]) -> Tensor<2> {
    let [rows, k] = x.dims();
    let [_, m, _] = w.dims();
    let mut outputs = Vec::new();
    let mut from = 0;
    for (e, &n) in group_sizes.iter().enumerate() {
        if n > 0 {
            let xs = x.clone().slice([from..from + n, 0..k]);
            let we = w.clone().narrow(0, e, 1).reshape([m, k]);
            outputs.push(xs.matmul(we.transpose()));
        }
        from += n;
    }
    if outputs.is_empty() {
        return Tensor::zeros([rows, m], (&x.device(), x.dtype()));
    }
    Tensor::cat(outputs, 0)
}

/// Backend op of [`grouped_matmul`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait GroupedMatmulOps: Backend {
    /// `x_e · w_eᵀ` per group; `sizes` has one entry per expert.
    fn grouped_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> FloatTensor<Self>;

    /// `(∂x, ∂w)` for the upstream gradient `grad`.
    fn grouped_matmul_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

/// Splits `data` into consecutive chunks of `sizes[e] * width` elements.
fn split_groups<'a>(mut data: &'a mut [f32], sizes: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut parts = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let (head, tail) = data.split_at_mut(n * width);
        parts.push(head);
        data = tail;
    }
    parts
}

/// Row offsets of the groups.
fn offsets(sizes: &[usize]) -> Vec<usize> {
    sizes
        .iter()
        .scan(0, |acc, &n| {
            let at = *acc;
            *acc += n;
            Some(at)
        })
        .collect()
}

impl GroupedMatmulOps for Flex {
    fn grouped_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> FloatTensor<Self> {
        let (x, w) = (as_f32(x), as_f32(w));
        let (xd, wd) = (f32_data(&x), f32_data(&w));
        let [rows, k] = [dims(&x)[0], dims(&x)[1]];
        let m = dims(&w)[1];
        let starts = offsets(&sizes);
        let mut out = vec![0.0f32; rows * m];
        split_groups(&mut out, &sizes, m)
            .into_par_iter()
            .enumerate()
            .for_each(|(e, y)| {
                let n = sizes[e];
                if n == 0 {
                    return;
                }
                let xs = &xd[starts[e] * k..(starts[e] + n) * k];
                let we = &wd[e * m * k..(e + 1) * m * k];
                // y[n×m] = xs[n×k] · weᵀ (weᵀ[p, j] = we[j·k + p]).
                matmul(n, m, k, y, m, false, xs, (k, 1), we, (1, k), 1.0);
            });
        tensor(out, &[rows, m])
    }

    fn grouped_matmul_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (x, w, grad) = (as_f32(x), as_f32(w), as_f32(grad));
        let (xd, wd, gd) = (f32_data(&x), f32_data(&w), f32_data(&grad));
        let [rows, k] = [dims(&x)[0], dims(&x)[1]];
        let [experts, m] = [dims(&w)[0], dims(&w)[1]];
        let starts = offsets(&sizes);
        let mut dx = vec![0.0f32; rows * k];
        let mut dw = vec![0.0f32; experts * m * k];
        split_groups(&mut dx, &sizes, k)
            .into_par_iter()
            .zip(dw.par_chunks_mut((m * k).max(1)))
            .enumerate()
            .for_each(|(e, (dxe, dwe))| {
                let n = sizes[e];
                if n == 0 {
                    return;
                }
                let xs = &xd[starts[e] * k..(starts[e] + n) * k];
                let gs = &gd[starts[e] * m..(starts[e] + n) * m];
                let we = &wd[e * m * k..(e + 1) * m * k];
                // ∂x_e[n×k] = g_e[n×m] · w_e[m×k].
                matmul(n, k, m, dxe, k, false, gs, (m, 1), we, (k, 1), 1.0);
                // ∂w_e[m×k] = g_eᵀ[m×n] · x_e[n×k] (g_eᵀ[j, i] = g_e[i·m + j]).
                matmul(m, k, n, dwe, k, false, gs, (1, m), xs, (k, 1), 1.0);
            });
        (tensor(dx, &[rows, k]), tensor(dw, &[experts, m, k]))
    }
}

#[derive(Debug)]
struct GroupedBackward;

impl<B: GroupedMatmulOps> Backward<B, 2> for GroupedBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, Vec<usize>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, sizes) = ops.state;
        let (dx, dw) = B::grouped_matmul_backward(x, w, grad, sizes);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw);
        }
    }
}

impl<B: Backend + GroupedMatmulOps, C: CheckpointStrategy> GroupedMatmulOps for Autodiff<B, C> {
    fn grouped_matmul(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> FloatTensor<Self> {
        let guards = [x.node(), w.node()];
        let (x, w) = (x.into_primitive(), w.into_primitive());
        match GroupedBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::grouped_matmul(x.clone(), w.clone(), sizes.clone());
                prep.finish((x, w, sizes), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::grouped_matmul(x, w, sizes)),
        }
    }

    fn grouped_matmul_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        sizes: Vec<usize>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own backward.
        let (dx, dw) = B::grouped_matmul_backward(
            x.into_primitive(),
            w.into_primitive(),
            grad.into_primitive(),
            sizes,
        );
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }
}

/// Expert weights stacked once for inference in the layout `gemm` reads fastest with few rows
/// per expert: each expert's `[out, in]` matrix transposed to `[in, out]`, rows padded to
/// `stride` columns (a row length that is not a multiple of 1 KiB keeps consecutive rows out
/// of the same cache sets). Forward only ([`grouped_matmul_packed`]); built per weight
/// version by the model, never trained.
#[derive(Debug, Clone)]
pub struct PackedExperts {
    /// `[experts, in, stride]`.
    pub data: Tensor<3>,
    /// Output width of each expert.
    pub out: usize,
}

impl PackedExperts {
    /// Packs `w` `[experts, out, in]` (HF layout).
    pub fn new(w: Tensor<3>) -> Self {
        let [experts, out, k] = w.dims();
        let stride = out + PACK_PAD;
        let t = w.swap_dims(1, 2);
        let data = if stride == out {
            t
        } else {
            let pad = Tensor::<3>::zeros([experts, k, stride - out], (&t.device(), t.dtype()));
            Tensor::cat(vec![t, pad], 2)
        };
        Self { data, out }
    }
}

/// Padding columns of a packed expert row.
const PACK_PAD: usize = 16;

/// [`grouped_matmul`] over [`PackedExperts`]: `x_e · w_eᵀ` for consecutive row groups.
/// Forward only; on other devices than flex (or autodiff tensors) it is the same product
/// with tensor ops.
pub fn grouped_matmul_packed(
    x: Tensor<2>,
    w: &PackedExperts,
    group_sizes: &[usize],
) -> Result<Tensor<2>> {
    let [rows, k] = x.dims();
    let [experts, wk, stride] = w.data.dims();
    if wk != k || group_sizes.len() > experts || w.out > stride {
        return Err(OpsError::ShapeMismatch {
            what: "grouped_matmul_packed weights",
            expected: vec![group_sizes.len().max(experts), k, w.out],
            got: w.data.dims().to_vec(),
        });
    }
    let total: usize = group_sizes.iter().sum();
    if total != rows {
        return Err(OpsError::ShapeMismatch {
            what: "grouped_matmul_packed group sizes (sum)",
            expected: vec![rows],
            got: vec![total],
        });
    }
    let plain_flex = matches!(
        x.device().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    );
    if !plain_flex || !takes_fused(&[x.dtype(), w.data.dtype()], &x.device()) {
        // [E, in, out] back to [E, out, in] for the reference.
        let hf = w.data.clone().narrow(2, 0, w.out).swap_dims(1, 2);
        return Ok(grouped_matmul_reference(x, hf, group_sizes));
    }
    let mut sizes = group_sizes.to_vec();
    sizes.resize(experts, 0);
    Ok(Tensor::from_dispatch(
        <Dispatch as GroupedPackedOps>::grouped_matmul_packed(
            x.into_dispatch(),
            w.data.clone().into_dispatch(),
            sizes,
            w.out,
        ),
    ))
}

/// Backend op of [`grouped_matmul_packed`] (plain flex only).
#[backend_extension(Flex)]
pub trait GroupedPackedOps: Backend {
    /// `x_e · w_e` per group, `w` `[experts, in, stride]`, outputs `out` wide.
    fn grouped_matmul_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
        out: usize,
    ) -> FloatTensor<Self>;
}

impl GroupedPackedOps for Flex {
    fn grouped_matmul_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        sizes: Vec<usize>,
        out: usize,
    ) -> FloatTensor<Self> {
        let (x, w) = (as_f32(x), as_f32(w));
        let (xd, wd) = (f32_data(&x), f32_data(&w));
        let [rows, k] = [dims(&x)[0], dims(&x)[1]];
        let stride = dims(&w)[2];
        let starts = offsets(&sizes);
        let mut y_all = vec![0.0f32; rows * out];
        split_groups(&mut y_all, &sizes, out)
            .into_par_iter()
            .enumerate()
            .for_each(|(e, y)| {
                let n = sizes[e];
                if n == 0 {
                    return;
                }
                let xs = &xd[starts[e] * k..(starts[e] + n) * k];
                let we = &wd[e * k * stride..(e + 1) * k * stride];
                // y[n×out] = xs[n×k] · we[k×out] (rows `stride` apart).
                matmul(n, out, k, y, out, false, xs, (k, 1), we, (stride, 1), 1.0);
            });
        tensor(y_all, &[rows, out])
    }
}
