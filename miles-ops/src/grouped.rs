//! Grouped matmul for MoE experts: rows sorted by expert, each group multiplied by its own
//! expert's weight, forward and backward as one op.

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Flex, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{Int, Tensor};
use rayon::prelude::*;

use crate::flex::gemm::matmul;
use crate::flex::tensor::{as_f32, dims, f32_data, takes_fused, tensor};
use crate::{OpsError, Result};

/// `x_e · w_eᵀ` for consecutive row groups. Errors when the group sizes do not add up to
/// the rows, there are more groups than experts, or `k` differs.
///
/// For `x` `[rows, k]` whose rows come in consecutive groups of `group_sizes[e]` rows and
/// stacked weights `w` `[experts, m, k]` (HF's `[out, in]` per expert), [`grouped_matmul`]
/// returns `[rows, m]` with group `e` equal to `x_e · w_eᵀ`. Backward:
/// `∂x_e = ∂y_e · w_e`, `∂w_e = ∂y_eᵀ · x_e` (zero for an expert without rows).
///
/// On flex (`f32`) it is one backend op ([`GroupedMatmulOps`]): one `gemm` per group, groups
/// in parallel (rayon), and a backward that writes each expert's weight gradient and each
/// group's input gradient in place; on CubeCL devices (feature `wgpu` / `cuda`, `f32`) CubeCL
/// kernels do the same (one unit per output element). Written with tensor ops instead
/// ([`grouped_matmul_reference`]: a slice of `x` and a narrow of `w` per group), autodiff turns
/// every slice and narrow into a zero tensor of the full input's size plus an add, which for
/// an MoE layer is gigabytes of memory traffic per training step.
///
/// [`grouped_matmul_offsets`] (and [`grouped_matmul_offsets_packed`] for inference) take the
/// groups as device row offsets `[experts + 1]` instead of host sizes — what
/// [`crate::bucket_by_expert`] computes on the device — so a sparse MoE dispatch
/// never reads the routing back on CubeCL devices. Rows at or past `offsets[experts]` belong
/// to no group: their outputs and input gradients are zero. On flex the offsets are read (a
/// copy) and the host-size op runs.
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

/// Expert weights stacked once for inference (forward only, [`grouped_matmul_packed`] and
/// [`grouped_matmul_offsets_packed`]); built per weight version by the model, never trained.
///
/// On plain flex with `f32` weights and an AVX-512F CPU each expert is packed into
/// [`crate::packed`]'s panels ([`ExpertLayout::Panels`]), which the packed micro-kernel
/// streams once per step; elsewhere each expert's `[out, in]` matrix is transposed to
/// `[in, out]` with rows padded to `stride` columns ([`ExpertLayout::Strided`]: a row length
/// that is not a multiple of 1 KiB keeps consecutive rows out of the same cache sets), which
/// `gemm` and the CubeCL kernel read.
#[derive(Debug, Clone)]
pub struct PackedExperts {
    /// The stacked weights.
    pub layout: ExpertLayout,
    /// Output width of each expert.
    pub out: usize,
    /// Input width of each expert.
    pub k: usize,
    /// Number of experts.
    pub experts: usize,
    /// What the product computes (always [`crate::packed::Product::Plain`] for
    /// [`ExpertLayout::Strided`]).
    pub product: crate::packed::Product,
}

/// How [`PackedExperts`] stores its weights.
#[derive(Debug, Clone)]
pub enum ExpertLayout {
    /// `[experts, in, stride]`: each expert transposed, rows padded.
    Strided(Tensor<3>),
    /// `[experts, panels(out) · in · PANEL]`: each expert in [`crate::packed::pack`]'s panels.
    Panels(Tensor<2>),
}

impl PackedExperts {
    /// Packs `w` `[experts, out, in]` (HF layout).
    pub fn new(w: Tensor<3>) -> Self {
        if let Some(packed) = Self::panels(crate::packed::Product::Plain, vec![w.clone()]) {
            return packed;
        }
        let [experts, out, k] = w.dims();
        let stride = out + PACK_PAD;
        let t = w.swap_dims(1, 2);
        let data = if stride == out {
            t
        } else {
            let pad = Tensor::<3>::zeros([experts, k, stride - out], (&t.device(), t.dtype()));
            Tensor::cat(vec![t, pad], 2)
        };
        Self {
            layout: ExpertLayout::Strided(data),
            out,
            k,
            experts,
            product: crate::packed::Product::Plain,
        }
    }

    /// Packs the gate and up projections `[experts, inter, in]` for the fused SwiGLU product:
    /// [`grouped_matmul_packed`] then returns `silu(x_e · gate_eᵀ) ⊙ (x_e · up_eᵀ)`
    /// (`[rows, inter]`). Where the panels do not apply, the same as [`PackedExperts::new`]
    /// over the two stacked on the output axis (the product then returns `[rows, 2 · inter]`;
    /// [`PackedExperts::is_glu`] tells which).
    pub fn glu(gate: Tensor<3>, up: Tensor<3>) -> Self {
        Self::panels(crate::packed::Product::Glu, vec![gate.clone(), up.clone()])
            .unwrap_or_else(|| Self::new(Tensor::cat(vec![gate, up], 1)))
    }

    /// Each expert of `weights` (`product.width()` stacks of one shape and dtype) packed for
    /// `product`, or `None` where the panels do not apply ([`crate::packed::applies`]).
    fn panels(product: crate::packed::Product, weights: Vec<Tensor<3>>) -> Option<Self> {
        let first = weights.first()?;
        let (device, [experts, out, k], dtype) = (first.device(), first.dims(), first.dtype());
        if !crate::packed::applies(&device, dtype)
            || weights.len() != product.width()
            || weights
                .iter()
                .any(|w| w.dims() != [experts, out, k] || w.dtype() != dtype)
        {
            return None;
        }
        let host = weights
            .into_iter()
            .map(crate::packed::host_f32)
            .collect::<Option<Vec<_>>>()?;
        let (each, len) = (out * k, product.packed_len(out, k));
        let mut data = Vec::with_capacity(experts * len);
        for e in 0..experts {
            let parts: Vec<&[f32]> = host.iter().map(|h| &h[e * each..(e + 1) * each]).collect();
            data.extend(product.pack(&parts, out, k));
        }
        let panels =
            Tensor::from_data(burn::tensor::TensorData::new(data, [experts, len]), &device);
        Some(Self {
            layout: ExpertLayout::Panels(panels),
            out,
            k,
            experts,
            product,
        })
    }

    /// Whether the product is the fused SwiGLU (`[rows, out]` activations).
    pub fn is_glu(&self) -> bool {
        self.product == crate::packed::Product::Glu
    }

    /// The weights back in HF layout `[experts, out, in]` (the reference paths; for the fused
    /// SwiGLU product the gate rows then the up rows, `[experts, 2 · out, in]`).
    pub fn to_hf(&self) -> Tensor<3> {
        match &self.layout {
            ExpertLayout::Strided(data) => data.clone().narrow(2, 0, self.out).swap_dims(1, 2),
            ExpertLayout::Panels(data) => {
                let host = crate::packed::host_f32(data.clone()).unwrap_or_default();
                let len = self.product.packed_len(self.out, self.k).max(1);
                let mut w = Vec::with_capacity(host.len());
                for e in host.chunks_exact(len).take(self.experts) {
                    w.extend(self.product.unpack(e, self.out, self.k));
                }
                let rows = self.product.width() * self.out;
                Tensor::from_data(
                    burn::tensor::TensorData::new(w, [self.experts, rows, self.k]),
                    &data.device(),
                )
            }
        }
    }

    /// The products of the row groups `sizes` (host sizes, in expert order) over panels, when
    /// this holds panels and `x` is plain flex `f32` with the fused ops on.
    fn panel_product(&self, x: &Tensor<2>, sizes: &[usize]) -> Option<Tensor<2>> {
        let ExpertLayout::Panels(data) = &self.layout else {
            return None;
        };
        let plain_flex = matches!(
            x.device().as_dispatch(),
            burn::backend::DispatchDevice::Flex(_)
        );
        if !plain_flex || !takes_fused(&[x.dtype()], &x.device()) {
            return None;
        }
        let mut sizes = sizes.to_vec();
        sizes.resize(self.experts, 0);
        Some(Tensor::from_dispatch(
            <Dispatch as crate::packed::PackedOps>::packed_matmul(
                x.clone().into_dispatch(),
                data.clone().into_dispatch(),
                sizes,
                self.out,
                self.is_glu(),
            ),
        ))
    }

    /// The reference product over `to_hf()` weights for host group sizes (rows past the
    /// groups zero): `x_e · w_eᵀ`, or for the fused SwiGLU product its activations.
    fn reference(&self, x: Tensor<2>, sizes: &[usize]) -> Tensor<2> {
        let w = self.to_hf();
        if !self.is_glu() {
            return reference_with_tail(x, w, sizes);
        }
        let gate = w.clone().narrow(1, 0, self.out);
        let up = w.narrow(1, self.out, self.out);
        crate::swiglu::swiglu_reference(
            reference_with_tail(x.clone(), gate, sizes),
            reference_with_tail(x, up, sizes),
        )
    }

    fn check(&self, what: &'static str, k: usize, groups: usize) -> Result<()> {
        let stride_ok = match &self.layout {
            ExpertLayout::Strided(data) => {
                data.dims() == [self.experts, self.k, data.dims()[2]] && self.out <= data.dims()[2]
            }
            ExpertLayout::Panels(data) => {
                data.dims() == [self.experts, self.product.packed_len(self.out, self.k)]
            }
        };
        if k != self.k || groups > self.experts || !stride_ok {
            return Err(OpsError::ShapeMismatch {
                what,
                expected: vec![groups.max(self.experts), k, self.out],
                got: vec![self.experts, self.k, self.out],
            });
        }
        Ok(())
    }
}

/// Padding columns of a strided expert row.
const PACK_PAD: usize = 16;

/// [`grouped_matmul`] over [`PackedExperts`]: `x_e · w_eᵀ` for consecutive row groups (for
/// [`PackedExperts::glu`] weights, `silu(x_e · gate_eᵀ) ⊙ (x_e · up_eᵀ)`). Forward only; on
/// other devices than flex (or autodiff tensors) it is the same product with tensor ops.
pub fn grouped_matmul_packed(
    x: Tensor<2>,
    w: &PackedExperts,
    group_sizes: &[usize],
) -> Result<Tensor<2>> {
    let [rows, k] = x.dims();
    w.check("grouped_matmul_packed weights", k, group_sizes.len())?;
    let total: usize = group_sizes.iter().sum();
    if total != rows {
        return Err(OpsError::ShapeMismatch {
            what: "grouped_matmul_packed group sizes (sum)",
            expected: vec![rows],
            got: vec![total],
        });
    }
    if let Some(y) = w.panel_product(&x, group_sizes) {
        return Ok(y);
    }
    let plain_flex = matches!(
        x.device().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    );
    let ExpertLayout::Strided(data) = &w.layout else {
        return Ok(w.reference(x, group_sizes));
    };
    if !plain_flex || !takes_fused(&[x.dtype(), data.dtype()], &x.device()) {
        return Ok(grouped_matmul_reference(x, w.to_hf(), group_sizes));
    }
    let mut sizes = group_sizes.to_vec();
    sizes.resize(w.experts, 0);
    Ok(Tensor::from_dispatch(
        <Dispatch as GroupedPackedOps>::grouped_matmul_packed(
            x.into_dispatch(),
            data.clone().into_dispatch(),
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

/// Checks `x` `[rows, k]` against `w` `[experts, m, k]` (or packed `[experts, k, ·]`) and
/// `offsets` `[experts + 1]`.
fn check_offsets(
    what: &'static str,
    x: [usize; 2],
    w: [usize; 3],
    wk: usize,
    offsets: usize,
) -> Result<()> {
    if wk != x[1] || offsets != w[0] + 1 {
        return Err(OpsError::ShapeMismatch {
            what,
            expected: vec![offsets.saturating_sub(1), x[1], offsets],
            got: vec![w[0], wk, offsets],
        });
    }
    Ok(())
}

/// Group sizes from offsets read on the host, made monotone and clamped to `rows` (the rows
/// past the last group are then `rows − Σ sizes`).
fn sizes_from_offsets(offsets: &[i64], rows: usize) -> Vec<usize> {
    let mut prev = 0usize;
    offsets
        .iter()
        .skip(1)
        .map(|&o| {
            let at = usize::try_from(o).unwrap_or(0).clamp(prev, rows);
            let n = at - prev;
            prev = at;
            n
        })
        .collect()
}

fn read_offsets(offsets: Tensor<1, Int>) -> Result<Vec<i64>> {
    let n = offsets.dims()[0];
    offsets
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|_| OpsError::ShapeMismatch {
            what: "grouped matmul offsets (unreadable)",
            expected: vec![n],
            got: vec![0],
        })
}

/// [`grouped_matmul_reference`] over the groups of `sizes`, rows past them zero.
fn reference_with_tail(x: Tensor<2>, w: Tensor<3>, sizes: &[usize]) -> Tensor<2> {
    let [rows, k] = x.dims();
    let [_, m, _] = w.dims();
    let total: usize = sizes.iter().sum();
    if total == rows {
        return grouped_matmul_reference(x, w, sizes);
    }
    let device = x.device();
    let head = grouped_matmul_reference(x.slice([0..total, 0..k]), w, sizes);
    Tensor::cat(vec![head, Tensor::zeros([rows - total, m], &device)], 0)
}

/// [`grouped_matmul`] with the groups given by device row offsets `[experts + 1]` (group `e`
/// is rows `offsets[e]..offsets[e + 1]`; rows from `offsets[experts]` on are zero), forward
/// and backward as one op; nothing is read back on CubeCL devices. Errors when `k` differs or
/// `offsets` is not `[experts + 1]`.
pub fn grouped_matmul_offsets(
    x: Tensor<2>,
    w: Tensor<3>,
    offsets: Tensor<1, Int>,
) -> Result<Tensor<2>> {
    let [_, wk] = [w.dims()[0], w.dims()[2]];
    check_offsets(
        "grouped_matmul_offsets weights / offsets",
        x.dims(),
        w.dims(),
        wk,
        offsets.dims()[0],
    )?;
    if !takes_fused(&[x.dtype(), w.dtype()], &x.device()) {
        let sizes = sizes_from_offsets(&read_offsets(offsets)?, x.dims()[0]);
        return Ok(reference_with_tail(x, w, &sizes));
    }
    Ok(Tensor::from_dispatch(
        <Dispatch as GroupedOffsetsOps>::grouped_matmul_offsets(
            x.into_dispatch(),
            w.into_dispatch(),
            offsets.into_dispatch(),
        ),
    ))
}

/// [`grouped_matmul_offsets`] over [`PackedExperts`] (inference: forward only, a constant on
/// autodiff devices).
pub fn grouped_matmul_offsets_packed(
    x: Tensor<2>,
    w: &PackedExperts,
    offsets: Tensor<1, Int>,
) -> Result<Tensor<2>> {
    check_offsets(
        "grouped_matmul_offsets_packed weights / offsets",
        x.dims(),
        [w.experts, w.out, w.k],
        w.k,
        offsets.dims()[0],
    )?;
    w.check("grouped_matmul_offsets_packed weights", x.dims()[1], 0)?;
    if matches!(w.layout, ExpertLayout::Panels(_)) {
        // Panels exist only on flex, where the offsets are read on the host anyway.
        let sizes = sizes_from_offsets(&read_offsets(offsets)?, x.dims()[0]);
        if let Some(y) = w.panel_product(&x, &sizes) {
            return Ok(y);
        }
        return Ok(w.reference(x, &sizes));
    }
    let ExpertLayout::Strided(data) = &w.layout else {
        unreachable!("panels handled above");
    };
    if !takes_fused(&[x.dtype(), data.dtype()], &x.device()) {
        let sizes = sizes_from_offsets(&read_offsets(offsets)?, x.dims()[0]);
        return Ok(reference_with_tail(x, w.to_hf(), &sizes));
    }
    Ok(Tensor::from_dispatch(
        <Dispatch as GroupedOffsetsOps>::grouped_matmul_offsets_packed(
            x.into_dispatch(),
            data.clone().into_dispatch(),
            offsets.into_dispatch(),
            w.out,
        ),
    ))
}

/// Backend op of [`grouped_matmul_offsets`] and [`grouped_matmul_offsets_packed`].
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait GroupedOffsetsOps: Backend {
    /// `x_e · w_eᵀ` per group, groups from `offsets` `[experts + 1]`.
    fn grouped_matmul_offsets(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `(∂x, ∂w)` for the upstream gradient `grad`.
    fn grouped_matmul_offsets_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `x_e · w_e` per group over packed `[experts, in, stride]` weights, `out` columns.
    fn grouped_matmul_offsets_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
        out: usize,
    ) -> FloatTensor<Self>;
}

/// Host group sizes of flex offsets for `rows` rows.
fn flex_sizes(offsets: IntTensor<Flex>, rows: usize) -> Vec<usize> {
    let host: Vec<i64> = offsets
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .unwrap_or_default();
    sizes_from_offsets(&host, rows)
}

impl GroupedOffsetsOps for Flex {
    fn grouped_matmul_offsets(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let sizes = flex_sizes(offsets, dims(&x)[0]);
        <Flex as GroupedMatmulOps>::grouped_matmul(x, w, sizes)
    }

    fn grouped_matmul_offsets_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let sizes = flex_sizes(offsets, dims(&x)[0]);
        <Flex as GroupedMatmulOps>::grouped_matmul_backward(x, w, grad, sizes)
    }

    fn grouped_matmul_offsets_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
        out: usize,
    ) -> FloatTensor<Self> {
        let sizes = flex_sizes(offsets, dims(&x)[0]);
        <Flex as GroupedPackedOps>::grouped_matmul_packed(x, w, sizes, out)
    }
}

#[derive(Debug)]
struct GroupedOffsetsBackward;

impl<B: GroupedOffsetsOps> Backward<B, 2> for GroupedOffsetsBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, offsets) = ops.state;
        let (dx, dw) = B::grouped_matmul_offsets_backward(x, w, grad, offsets);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let Some(node) = node_w {
            grads.register::<B>(node.id, dw);
        }
    }
}

impl<B: Backend + GroupedOffsetsOps, C: CheckpointStrategy> GroupedOffsetsOps for Autodiff<B, C> {
    fn grouped_matmul_offsets(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let guards = [x.node(), w.node()];
        let (x, w) = (x.into_primitive(), w.into_primitive());
        match GroupedOffsetsBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::grouped_matmul_offsets(x.clone(), w.clone(), offsets.clone());
                prep.finish((x, w, offsets), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::grouped_matmul_offsets(x, w, offsets)),
        }
    }

    fn grouped_matmul_offsets_backward(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        offsets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // Constants: only called inside the op's own backward.
        let (dx, dw) = B::grouped_matmul_offsets_backward(
            x.into_primitive(),
            w.into_primitive(),
            grad.into_primitive(),
            offsets,
        );
        (
            <Self as AutodiffBackend>::from_inner(dx),
            <Self as AutodiffBackend>::from_inner(dw),
        )
    }

    fn grouped_matmul_offsets_packed(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        offsets: IntTensor<Self>,
        out: usize,
    ) -> FloatTensor<Self> {
        // Inference only: a constant.
        <Self as AutodiffBackend>::from_inner(B::grouped_matmul_offsets_packed(
            x.into_primitive(),
            w.into_primitive(),
            offsets,
            out,
        ))
    }
}
