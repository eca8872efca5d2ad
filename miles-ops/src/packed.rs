//! Decode matmuls over weights packed once per weight version in the layout the kernel reads
//! (flex, `f32`, CPUs with AVX-512F).
//!
//! A decode step multiplies a few rows (one per running sequence) by every weight matrix of
//! the model, so it streams the weights from memory once per step and does little arithmetic
//! per weight. `gemm` repacks its right-hand side on every call, which at these row counts
//! costs as much as the product itself. Here each weight `[out, in]` (HF layout) is packed
//! once into **panels** of [`PANEL`] output columns, each `[in, PANEL]` contiguous
//! (columns past `out` zero), and the kernel walks a panel front to back:
//!
//! - the input rows are packed per call into blocks of at most [`ROW_BLOCK`] rows, each
//!   `[in, rows]` (one cache line holds a block's values for one input index);
//! - the AVX-512 micro-kernel keeps a block's `rows × 32` outputs in 2 × `rows` registers and
//!   for each input index loads the panel's 32 weights once and does one FMA per register;
//! - a task covers a few panels (at most about 512 KiB, and small enough that each core gets
//!   several tasks) and up to 16 row blocks; it runs every row block on a panel before the
//!   next panel, and while it does, the next panel (after its last, the next task's first) is
//!   prefetched, spread evenly over the row blocks' input indices. The weight stream then
//!   overlaps the arithmetic of every row block, not only the first one's, and no task starts
//!   on a cold panel. Tasks run on the rayon pool.
//!
//! A gate and an up projection pack as one interleaved matrix ([`pack_glu`]: gate panel `j`
//! then up panel `j`) for [`Product::Glu`]: the kernel keeps both products of a block of up to
//! 6 rows in registers and writes `silu(gate) · up` (SwiGLU with the formula of
//! [`crate::swiglu()`]'s flex op), so the MLP's `[rows, 2 · inter]` intermediate, its column
//! splits and the separate activation pass never exist.
//!
//! Every output element is `Σ_i x[r, i] · w[i, c]` accumulated by FMA in input order from
//! zero, whatever the number of rows, the row block or the task it falls in: a row's result
//! does not depend on which other rows share the call (continuous batching gives the same
//! logits as one sequence at a time). It is not `gemm`'s order, so results differ from
//! [`crate::linear_reference`] at float rounding (tests hold them within `1e-5`
//! relative). Forward only: the engine's step model uses them, training never does.
//!
//! [`PackedMatrix::new`] returns `None` where this path does not apply (another device or
//! dtype, a CPU without AVX-512F, the fused ops switched off); callers then keep their
//! generic path.

use std::ops::Range;

use burn::backend::{
    Backend, BackendTensor, Dispatch, DispatchDevice, DispatchTensorKind, Flex, backend_extension,
    tensor::FloatTensor,
};
use burn::tensor::{DType, Tensor, TensorData};
use rayon::prelude::*;

use crate::flex::tensor::{as_f32, dims, f32_data, tensor};

/// Output columns per panel (two 16-lane registers).
pub const PANEL: usize = 32;
/// Rows per register block of the micro-kernel.
pub const ROW_BLOCK: usize = 12;
/// Bytes of panels one task reads (kept in L2 across its row blocks).
const TASK_PANEL_BYTES: usize = 512 * 1024;
/// Input values from which the per-call packing of the input runs on the rayon pool.
const PARALLEL_PACK: usize = 1 << 16;
/// Row blocks per task (prefill-sized inputs are split by rows too).
const TASK_ROW_BLOCKS: usize = 16;

/// Whether the packed kernels can run here: an x86-64 CPU with AVX-512F.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether weights on `device` in `dtype` get packed: plain flex (no autodiff), `f32`, the
/// fused ops on ([`crate::fused_ops_enabled`]) and [`supported`].
pub fn applies(device: &burn::tensor::Device, dtype: DType) -> bool {
    flex_f32_fused(device, dtype) && supported()
}

/// Plain flex (no autodiff), `f32`, the fused ops on: what the decode kernels here and in
/// [`crate::rows`] need besides the CPU's instructions.
pub(crate) fn flex_f32_fused(device: &burn::tensor::Device, dtype: DType) -> bool {
    matches!(device.as_dispatch(), DispatchDevice::Flex(_))
        && dtype == DType::F32
        && crate::fused_ops_enabled()
}

/// Number of panels of an `out`-wide weight.
pub fn panels(out: usize) -> usize {
    out.div_ceil(PANEL)
}

/// Packs `w` `[out, in]` row-major (HF layout) into panels: element `(i, c)` of the product
/// matrix `wᵀ` at `(c / PANEL) · in · PANEL + i · PANEL + c % PANEL`; columns past `out` zero.
/// Panels are written in parallel on the rayon pool ([`pack_rows`]).
pub fn pack(w: &[f32], out: usize, k: usize) -> Vec<f32> {
    assert_eq!(
        w.len(),
        out * k,
        "pack: {} values for [{out}, {k}]",
        w.len()
    );
    pack_rows(&[rows_of(w, k)], k)
}

/// Packs several weights `[out_i, in]` (row-major, HF layout) stacked on the output axis, as
/// [`pack`] packs their concatenation (`Σ out_i` outputs), without building it.
///
/// # Panics
/// When a part's length is not a multiple of `k`.
pub fn pack_stacked(parts: &[&[f32]], k: usize) -> Vec<f32> {
    let mut rows = Vec::new();
    for part in parts {
        assert!(
            k == 0 || part.len().is_multiple_of(k),
            "pack: {} values for rows of {k}",
            part.len()
        );
        rows.extend(rows_of(part, k));
    }
    pack_rows(&[rows], k)
}

/// The rows of `w` (`k` values each).
fn rows_of(w: &[f32], k: usize) -> Vec<&[f32]> {
    if k == 0 {
        return Vec::new();
    }
    w.chunks_exact(k).collect()
}

/// Input indices per tile when a panel is written: `PACK_TILE × PANEL` values (32 KiB) stay
/// in L1 while the panel's rows are read in order.
const PACK_TILE: usize = 256;

/// Panels of `lists.len()` row lists of `n` rows each, interleaved (panel `j` of each list in
/// turn; one list: [`pack`]'s layout, two: [`pack_glu`]'s), written straight into the one
/// buffer that is returned: each panel reads its (at most [`PANEL`]) rows in order and writes
/// its `[k, PANEL]` block tile by tile, panels in parallel on the rayon pool. Memory-bound: the
/// weights are read once and the panels written once.
fn pack_rows(lists: &[Vec<&[f32]>], k: usize) -> Vec<f32> {
    let n = lists.first().map_or(0, Vec::len);
    let width = lists.len();
    let len = k * PANEL;
    let mut data = vec![0.0f32; width * panels(n) * len];
    if len == 0 {
        return data;
    }
    data.par_chunks_mut(len).enumerate().for_each(|(q, dst)| {
        let (list, j) = (&lists[q % width], q / width);
        let rows = &list[j * PANEL..((j + 1) * PANEL).min(n)];
        for i0 in (0..k).step_by(PACK_TILE) {
            let i1 = (i0 + PACK_TILE).min(k);
            for (c, row) in rows.iter().enumerate() {
                for (i, &v) in row[i0..i1].iter().enumerate() {
                    dst[(i0 + i) * PANEL + c] = v;
                }
            }
        }
    });
    data
}

/// Unpacks [`pack`]'s panels back to `[out, in]` row-major.
pub fn unpack(data: &[f32], out: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; out * k];
    for (c, row) in w.chunks_exact_mut(k.max(1)).enumerate().take(out) {
        let base = (c / PANEL) * k * PANEL + c % PANEL;
        for (i, v) in row.iter_mut().enumerate() {
            *v = data[base + i * PANEL];
        }
    }
    w
}

/// Packs a gate and an up projection (`[inter, in]` each, HF layout) for the fused SwiGLU
/// product ([`PackedMatrix::glu`]): gate panel `j` then up panel `j`, for each `j`.
pub fn pack_glu(gate: &[f32], up: &[f32], inter: usize, k: usize) -> Vec<f32> {
    for (what, w) in [("gate", gate), ("up", up)] {
        assert_eq!(
            w.len(),
            inter * k,
            "pack_glu: {} {what} values for [{inter}, {k}]",
            w.len()
        );
    }
    pack_rows(&[rows_of(gate, k), rows_of(up, k)], k)
}

/// What a packed product computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// `x · W`.
    Plain,
    /// `silu(x · W_gate) ⊙ (x · W_up)` over [`pack_glu`]'s interleaved panels.
    Glu,
}

impl Product {
    /// Weight matrices the product packs (the weight, or gate and up).
    pub fn width(self) -> usize {
        match self {
            Self::Plain => 1,
            Self::Glu => 2,
        }
    }

    /// Values of one packed matrix with `out` outputs and `k` inputs.
    pub fn packed_len(self, out: usize, k: usize) -> usize {
        self.width() * panels(out) * k * PANEL
    }

    /// Packs [`Product::width`] matrices `[out, in]` (row-major, HF layout): [`pack`] or
    /// [`pack_glu`].
    ///
    /// # Panics
    /// When `parts` holds fewer matrices or one is not `out · k` long.
    pub fn pack(self, parts: &[&[f32]], out: usize, k: usize) -> Vec<f32> {
        match self {
            Self::Plain => pack(parts[0], out, k),
            Self::Glu => pack_glu(parts[0], parts[1], out, k),
        }
    }

    /// [`Product::pack`] undone: the weight `[out, in]`, or the gate rows then the up rows
    /// `[2 · out, in]`.
    pub fn unpack(self, data: &[f32], out: usize, k: usize) -> Vec<f32> {
        match self {
            Self::Plain => unpack(data, out, k),
            Self::Glu => {
                let len = k * PANEL;
                let (mut gate, mut up) = (Vec::new(), Vec::new());
                for pair in data.chunks_exact(2 * len.max(1)) {
                    gate.extend_from_slice(&pair[..len]);
                    up.extend_from_slice(&pair[len..]);
                }
                let mut w = unpack(&gate, out, k);
                w.extend(unpack(&up, out, k));
                w
            }
        }
    }

    /// `(k, n)` of `weights` multiplied as this product — for [`Product::Plain`] one or more
    /// matrices `[out_i, in]` of one input width stacked on the output axis (`n = Σ out_i`),
    /// for [`Product::Glu`] two of one shape (`n` their rows) — when they fit and share the
    /// first one's dtype; `None` otherwise.
    pub fn shape(self, weights: &[Tensor<2>]) -> Option<(usize, usize)> {
        let first = weights.first()?;
        let ([n0, k], dtype) = (first.dims(), first.dtype());
        let fits = match self {
            Self::Plain => weights.iter().all(|w| w.dims()[1] == k),
            Self::Glu => weights.len() == 2 && weights.iter().all(|w| w.dims() == [n0, k]),
        };
        if !fits || weights.iter().any(|w| w.dtype() != dtype) {
            return None;
        }
        let n = match self {
            Self::Plain => weights.iter().map(|w| w.dims()[0]).sum(),
            Self::Glu => n0,
        };
        Some((k, n))
    }

    /// Rows per register block.
    fn row_block(self) -> usize {
        match self {
            Self::Plain => ROW_BLOCK,
            Self::Glu => ROW_BLOCK / 2,
        }
    }
}

/// A weight `[out, in]` packed for [`PackedMatrix::matmul`] (see the module docs).
#[derive(Debug, Clone)]
pub struct PackedMatrix {
    /// The panels, `[panels(out) · in · PANEL]`, on the weight's (flex) device.
    pub data: Tensor<1>,
    /// Input width.
    pub k: usize,
    /// Output width.
    pub n: usize,
    /// What [`PackedMatrix::matmul`] computes.
    pub product: Product,
}

impl PackedMatrix {
    /// Packs `w` `[out, in]`, or `None` where the packed path does not apply ([`applies`]).
    pub fn new(w: Tensor<2>) -> Option<Self> {
        Self::build(Product::Plain, vec![w])
    }

    /// Packs weights `[out_i, in]` stacked on the output axis (`[Σ out_i, in]`, e.g. q / k / v
    /// as one matmul) straight from their buffers, or `None` where the packed path does not
    /// apply.
    pub fn stacked(weights: Vec<Tensor<2>>) -> Option<Self> {
        Self::build(Product::Plain, weights)
    }

    /// Packs a gate and an up projection (`[inter, in]` each) for the fused product
    /// `silu(x · gateᵀ) ⊙ (x · upᵀ)`, or `None` where the packed path does not apply.
    pub fn glu(gate: Tensor<2>, up: Tensor<2>) -> Option<Self> {
        Self::build(Product::Glu, vec![gate, up])
    }

    /// Packs `weights` for `product`: for [`Product::Plain`] one or more matrices of one input
    /// width and dtype, stacked on the output axis; for [`Product::Glu`] two of one shape.
    /// The panels are written from the weights' own buffers (borrowed, never copied first)
    /// into the packed matrix's buffer, which becomes its tensor without a copy.
    fn build(product: Product, weights: Vec<Tensor<2>>) -> Option<Self> {
        let first = weights.first()?;
        let (device, dtype) = (first.device(), first.dtype());
        let (k, n) = product.shape(&weights)?;
        if !applies(&device, dtype) {
            return None;
        }
        let primitives = weights
            .into_iter()
            .map(flex_primitive)
            .collect::<Option<Vec<_>>>()?;
        let host: Vec<_> = primitives.iter().map(f32_data).collect();
        let parts: Vec<&[f32]> = host.iter().map(|h| &h[..]).collect();
        let data = match product {
            Product::Plain => pack_stacked(&parts, k),
            Product::Glu => pack_glu(parts[0], parts[1], n, k),
        };
        let len = data.len();
        Some(Self {
            data: Tensor::from_data(TensorData::new(data, [len]), &device),
            k,
            n,
            product,
        })
    }

    /// `x · wᵀ` for `x` `[rows, in]`: `[rows, out]` (for [`Product::Glu`] the SwiGLU
    /// activations `silu(x · gateᵀ) ⊙ (x · upᵀ)`). Any other input than plain flex `f32`
    /// (e.g. an autodiff tensor) takes the reference product over the unpacked weight.
    /// Panics on a mismatched input width, as `matmul` does.
    pub fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        let [_, k] = x.dims();
        assert_eq!(
            k, self.k,
            "packed matmul: input width {k}, weight takes {}",
            self.k
        );
        if !matches!(x.device().as_dispatch(), DispatchDevice::Flex(_)) || x.dtype() != DType::F32 {
            let w = self.to_hf();
            return match self.product {
                Product::Plain => x.matmul(w.transpose()),
                Product::Glu => {
                    let (gate, up) = (w.clone().narrow(0, 0, self.n), w.narrow(0, self.n, self.n));
                    crate::swiglu::swiglu_reference(
                        x.clone().matmul(gate.transpose()),
                        x.matmul(up.transpose()),
                    )
                }
            };
        }
        Tensor::from_dispatch(<Dispatch as PackedOps>::packed_matmul(
            x.into_dispatch(),
            self.data.clone().into_dispatch(),
            vec![],
            self.n,
            self.product == Product::Glu,
        ))
    }

    /// The weight back in HF layout `[out, in]` (for [`Product::Glu`], the gate rows then the
    /// up rows, `[2 · out, in]`).
    pub fn to_hf(&self) -> Tensor<2> {
        let host = host_f32(self.data.clone()).unwrap_or_default();
        let w = self.product.unpack(&host, self.n, self.k);
        let rows = self.product.width() * self.n;
        Tensor::from_data(TensorData::new(w, [rows, self.k]), &self.data.device())
    }
}

/// The flex primitive of a plain flex float tensor (`None` for any other), sharing its buffer.
pub(crate) fn flex_primitive<const D: usize>(t: Tensor<D>) -> Option<FloatTensor<Flex>> {
    match t.into_dispatch().kind {
        DispatchTensorKind::Flex(BackendTensor::Float(t)) => Some(t),
        _ => None,
    }
}

/// `t`'s values as `f32` on the host (`None` when they cannot be read).
pub(crate) fn host_f32<const D: usize>(t: Tensor<D>) -> Option<Vec<f32>> {
    t.into_data().convert::<f32>().try_into_vec::<f32>().ok()
}

/// Backend op of [`PackedMatrix::matmul`] and of the packed grouped expert matmul
/// ([`crate::grouped_matmul_packed`]); plain flex only.
#[backend_extension(Flex)]
pub trait PackedOps: Backend {
    /// `x · W` for `x` `[rows, in]` over packed panels `data`, `out` columns (with `glu`,
    /// `silu(x · W_gate) ⊙ (x · W_up)` over [`pack_glu`]'s panels). With empty `sizes`,
    /// `data` is one matrix; otherwise it is one matrix per group (`[groups, len]`) and group
    /// `g` multiplies the next `sizes[g]` rows (rows past the groups are zero).
    fn packed_matmul(
        x: FloatTensor<Self>,
        data: FloatTensor<Self>,
        sizes: Vec<usize>,
        out: usize,
        glu: bool,
    ) -> FloatTensor<Self>;
}

impl PackedOps for Flex {
    fn packed_matmul(
        x: FloatTensor<Self>,
        data: FloatTensor<Self>,
        sizes: Vec<usize>,
        out: usize,
        glu: bool,
    ) -> FloatTensor<Self> {
        let (x, data) = (as_f32(x), as_f32(data));
        let (xd, wd) = (f32_data(&x), f32_data(&data));
        let [m, k] = [dims(&x)[0], dims(&x)[1]];
        let product = if glu { Product::Glu } else { Product::Plain };
        let y = if sizes.is_empty() {
            product_host(product, &xd, m, k, &[(0..m, &wd[..])], out)
        } else {
            let len = product.packed_len(out, k);
            let mut groups = Vec::with_capacity(sizes.len());
            let mut start = 0;
            for (g, &s) in sizes.iter().enumerate() {
                let end = (start + s).min(m);
                if end > start {
                    groups.push((start..end, &wd[g * len..(g + 1) * len]));
                }
                start = end;
            }
            product_host(product, &xd, m, k, &groups, out)
        };
        tensor(y, &[m, out])
    }
}

/// `y[m, n]` with rows `r` of each group `(rows, panels)` equal to `x[r] · W_group`
/// (rows outside every group zero); `x` `[m, k]` row-major, each group's panels packed for
/// `[n, k]` ([`pack`]).
///
/// # Panics
/// When `x` is not `m · k` long, the groups' rows are not in order and disjoint or run past
/// `m`, or a group's panels are short.
pub fn matmul_host(
    x: &[f32],
    m: usize,
    k: usize,
    groups: &[(Range<usize>, &[f32])],
    n: usize,
) -> Vec<f32> {
    product_host(Product::Plain, x, m, k, groups, n)
}

/// [`matmul_host`] for either [`Product`] (for [`Product::Glu`] each group's panels come
/// from [`pack_glu`] and `n` is the SwiGLU width).
///
/// # Panics
/// As [`matmul_host`].
pub fn product_host(
    product: Product,
    x: &[f32],
    m: usize,
    k: usize,
    groups: &[(Range<usize>, &[f32])],
    n: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "packed matmul: input of {} values", x.len());
    let np = panels(n);
    let panel_len = k * PANEL;
    let step = product.width() * panel_len;
    let row_block = product.row_block();
    let mut end = 0;
    for (rows, w) in groups {
        assert!(
            rows.start >= end && rows.start <= rows.end && rows.end <= m,
            "packed matmul: rows {rows:?} after {end} of {m}"
        );
        end = rows.end;
        assert!(w.len() >= np * step, "packed matmul: short panels");
    }
    let mut y = vec![0.0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    // Row blocks (balanced, at most the product's row block) within each group, the input packed
    // per block as `[k, rows]`.
    let mut blocks: Vec<(usize, usize, usize)> = Vec::new();
    for (g, (rows, _)) in groups.iter().enumerate() {
        let count = rows.len().div_ceil(row_block);
        let mut r = rows.start;
        for b in 0..count {
            let size = (rows.end - r) / (count - b);
            blocks.push((r, size, g));
            r += size;
        }
    }
    let threads = rayon::current_num_threads().max(1);
    let mut xp = vec![0.0f32; m * k];
    {
        // Each block's `[k, rows]` slice of `xp` (blocks are in row order and disjoint).
        let mut parts = Vec::with_capacity(blocks.len());
        let (mut rest, mut at) = (&mut xp[..], 0);
        for &(r0, size, _) in &blocks {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(r0 * k - at);
            let (dst, tail) = tail.split_at_mut(size * k);
            parts.push((r0, size, dst));
            (rest, at) = (tail, (r0 + size) * k);
        }
        let pack_block = |(r0, size, dst): (usize, usize, &mut [f32])| {
            for i in 0..size {
                let row = &x[(r0 + i) * k..(r0 + i + 1) * k];
                for (kk, &v) in row.iter().enumerate() {
                    dst[kk * size + i] = v;
                }
            }
        };
        // A prefill's input is megabytes: transposed on every core.
        if threads > 1 && m * k >= PARALLEL_PACK {
            parts.into_par_iter().for_each(pack_block);
        } else {
            parts.into_iter().for_each(pack_block);
        }
    }
    // Tasks: (row blocks of one group, panel range).
    let by_bytes = (TASK_PANEL_BYTES / (step * 4)).max(1);
    let chunk = by_bytes.min(np.div_ceil(4 * threads)).max(1);
    let mut tasks: Vec<(Range<usize>, Range<usize>)> = Vec::new();
    let mut b = 0;
    while b < blocks.len() {
        let g = blocks[b].2;
        let mut end = b + 1;
        while end < blocks.len() && blocks[end].2 == g && end - b < TASK_ROW_BLOCKS {
            end += 1;
        }
        for p in (0..np).step_by(chunk) {
            tasks.push((b..end, p..(p + chunk).min(np)));
        }
        b = end;
    }
    let out = OutPtr(y.as_mut_ptr());
    let (xp, blocks, tasks) = (&xp[..], &blocks[..], &tasks[..]);
    // A task walks its panels in order and runs every row block on a panel before the next;
    // while it does, the next panel (for the last one, the next task's first) is prefetched,
    // spread evenly over the row blocks, so the weight stream overlaps the arithmetic.
    let run = |t: usize| {
        let (bs, ps) = &tasks[t];
        let w = groups[blocks[bs.start].2].1;
        let following = tasks.get(t + 1).map(|(nbs, nps)| {
            let nw = groups[blocks[nbs.start].2].1;
            &nw[nps.start * step..(nps.start + 1) * step]
        });
        let count = bs.len();
        for p in ps.clone() {
            let next = if p + 1 < ps.end {
                Some(&w[(p + 1) * step..(p + 2) * step])
            } else {
                following
            };
            let cols = (n - p * PANEL).min(PANEL);
            for (j, &(r0, size, _)) in blocks[bs.clone()].iter().enumerate() {
                let share = next.map(|nx| &nx[j * step / count..(j + 1) * step / count]);
                // SAFETY: block rows r0..r0+size < m and panel columns p·PANEL..+cols ≤ n,
                // so the written region lies inside `y`; tasks cover disjoint (row block,
                // panel) pairs, so no two tasks write the same element; `y` outlives the
                // parallel loop below.
                unsafe {
                    block(
                        product,
                        size,
                        &xp[r0 * k..(r0 + size) * k],
                        &w[p * step..(p + 1) * step],
                        k,
                        out.at(r0 * n + p * PANEL),
                        n,
                        cols,
                        share,
                    );
                }
            }
        }
    };
    if tasks.len() == 1 || threads == 1 {
        (0..tasks.len()).for_each(run);
    } else {
        (0..tasks.len()).into_par_iter().for_each(run);
    }
    y
}

/// The output buffer shared by the tasks of [`matmul_host`] and [`crate::rows::product_host`]
/// (each writes its own elements).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements (see `matmul_host`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// One row block (`rows` ≤ the product's row block) times one panel (two for
/// [`Product::Glu`]) into `c` (row stride `ldc`, `cols` valid columns); `next`, when given, is
/// prefetched as the block runs (evenly over its input indices).
///
/// # Safety
/// `c` must be valid for writes of `rows` rows of `cols` elements `ldc` apart; `a` holds
/// `k · rows` values and `b` `width · k · PANEL`; the CPU has AVX-512F.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    product: Product,
    rows: usize,
    a: &[f32],
    b: &[f32],
    k: usize,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    next: Option<&[f32]>,
) {
    let step = product.width() * k * PANEL;
    debug_assert!(a.len() >= k * rows && b.len() >= step && cols <= PANEL);
    #[cfg(target_arch = "x86_64")]
    {
        let pf = avx512::Prefetch::new(next.unwrap_or_default(), k);
        let (a, b) = (a.as_ptr(), b.as_ptr());
        // SAFETY: forwarded from the caller.
        unsafe {
            use avx512::{glu as g, kernel as kr};
            match (product, rows) {
                (Product::Plain, 1) => kr::<1>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 2) => kr::<2>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 3) => kr::<3>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 4) => kr::<4>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 5) => kr::<5>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 6) => kr::<6>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 7) => kr::<7>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 8) => kr::<8>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 9) => kr::<9>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 10) => kr::<10>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 11) => kr::<11>(a, b, k, c, ldc, cols, pf),
                (Product::Plain, 12) => kr::<12>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 1) => g::<1>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 2) => g::<2>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 3) => g::<3>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 4) => g::<4>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 5) => g::<5>(a, b, k, c, ldc, cols, pf),
                (Product::Glu, 6) => g::<6>(a, b, k, c, ldc, cols, pf),
                _ => unreachable!("row blocks hold at most the product's row block"),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (product, rows, a, b, k, c, ldc, cols, next, step);
        unreachable!("packed weights exist only where `supported()`");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::PANEL;

    /// Cache lines of a range prefetched evenly over a kernel's `k` input indices: after
    /// index `i`, the first `⌈(i + 1) · lines / k⌉` lines have been requested. The hint is
    /// `T2` (the outer cache levels, not L1): prefetches into L1 hold its few fill buffers,
    /// which caps each core's memory stream; with `T2` the decode matmuls read their weights
    /// 4–9 % faster than with `T0` here (weights evicted between calls, as in a decode step).
    pub(super) struct Prefetch {
        at: *const f32,
        end: *const f32,
        /// `lines` (added per index) and `k` (one line per `k` accumulated).
        lines: usize,
        k: usize,
        acc: usize,
    }

    impl Prefetch {
        /// Lines of `range` over `k` indices.
        pub(super) fn new(range: &[f32], k: usize) -> Self {
            let lines = range.len().div_ceil(16);
            Self {
                at: range.as_ptr(),
                end: range.as_ptr_range().end,
                lines,
                k: k.max(1),
                acc: 0,
            }
        }

        /// Requests this index's share of lines.
        #[inline(always)]
        fn step(&mut self) {
            self.acc += self.lines;
            while self.acc >= self.k && self.at < self.end {
                // SAFETY: a prefetch never faults, and `at` lies inside the range `new` was
                // given (the loop condition).
                unsafe { _mm_prefetch::<_MM_HINT_T2>(self.at.cast()) };
                // The last line's step may pass the range's end: never dereferenced.
                self.at = self.at.wrapping_add(16);
                self.acc -= self.k;
            }
        }
    }

    /// `c[r, j] = Σ_i a[i · R + r] · b[i · PANEL + j]` for `r < R`, `j < cols`, FMAs in `i`
    /// order from zero; prefetches `pf`'s lines as it goes.
    ///
    /// # Safety
    /// `a` holds `k · R` values, `b` `k · PANEL`; `c` is valid for
    /// `R` rows of `cols ≤ PANEL` elements `ldc` apart; the CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn kernel<const R: usize>(
        a: *const f32,
        b: *const f32,
        k: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        mut pf: Prefetch,
    ) {
        let mut lo = [_mm512_setzero_ps(); R];
        let mut hi = [_mm512_setzero_ps(); R];
        // SAFETY: every offset below is inside the extents the caller guarantees.
        unsafe {
            for i in 0..k {
                pf.step();
                let b0 = _mm512_loadu_ps(b.add(i * PANEL));
                let b1 = _mm512_loadu_ps(b.add(i * PANEL + 16));
                for r in 0..R {
                    let av = _mm512_set1_ps(*a.add(i * R + r));
                    lo[r] = _mm512_fmadd_ps(av, b0, lo[r]);
                    hi[r] = _mm512_fmadd_ps(av, b1, hi[r]);
                }
            }
            if cols == PANEL {
                for r in 0..R {
                    _mm512_storeu_ps(c.add(r * ldc), lo[r]);
                    _mm512_storeu_ps(c.add(r * ldc + 16), hi[r]);
                }
            } else {
                let m0 = lane_mask(cols);
                let m1 = lane_mask(cols.saturating_sub(16));
                for r in 0..R {
                    _mm512_mask_storeu_ps(c.add(r * ldc), m0, lo[r]);
                    _mm512_mask_storeu_ps(c.add(r * ldc + 16), m1, hi[r]);
                }
            }
        }
    }

    /// `c[r, j] = silu(g) · u` with `g` the product of `a`'s row `r` with the gate panel at
    /// `b` and `u` with the up panel at `b + k · PANEL` (each accumulated as in [`kernel`]);
    /// prefetches `pf`'s lines as it goes.
    ///
    /// # Safety
    /// As [`kernel`], with `b` holding `2 · k · PANEL` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn glu<const R: usize>(
        a: *const f32,
        b: *const f32,
        k: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        mut pf: Prefetch,
    ) {
        let mut g = [[_mm512_setzero_ps(); 2]; R];
        let mut u = [[_mm512_setzero_ps(); 2]; R];
        // SAFETY: every offset below is inside the extents the caller guarantees.
        unsafe {
            let bu = b.add(k * PANEL);
            for i in 0..k {
                pf.step();
                let g0 = _mm512_loadu_ps(b.add(i * PANEL));
                let g1 = _mm512_loadu_ps(b.add(i * PANEL + 16));
                let u0 = _mm512_loadu_ps(bu.add(i * PANEL));
                let u1 = _mm512_loadu_ps(bu.add(i * PANEL + 16));
                for r in 0..R {
                    let av = _mm512_set1_ps(*a.add(i * R + r));
                    g[r][0] = _mm512_fmadd_ps(av, g0, g[r][0]);
                    g[r][1] = _mm512_fmadd_ps(av, g1, g[r][1]);
                    u[r][0] = _mm512_fmadd_ps(av, u0, u[r][0]);
                    u[r][1] = _mm512_fmadd_ps(av, u1, u[r][1]);
                }
            }
            let mut gs = [0.0f32; PANEL];
            let mut us = [0.0f32; PANEL];
            for r in 0..R {
                _mm512_storeu_ps(gs.as_mut_ptr(), g[r][0]);
                _mm512_storeu_ps(gs.as_mut_ptr().add(16), g[r][1]);
                _mm512_storeu_ps(us.as_mut_ptr(), u[r][0]);
                _mm512_storeu_ps(us.as_mut_ptr().add(16), u[r][1]);
                for (x, &y) in gs.iter_mut().zip(&us) {
                    *x = *x * crate::swiglu::sigmoid(*x) * y;
                }
                std::ptr::copy_nonoverlapping(gs.as_ptr(), c.add(r * ldc), cols);
            }
        }
    }

    /// The first `n` of 16 lanes (all for `n ≥ 16`).
    fn lane_mask(n: usize) -> __mmask16 {
        if n >= 16 {
            u16::MAX
        } else {
            ((1u32 << n) - 1) as u16
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `Σ_i x[r, i] · w[c, i]` accumulated in `f64`.
    pub(crate) fn exact(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut y = vec![0.0; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k)
                    .map(|i| x[r * k + i] as f64 * w[c * k + i] as f64)
                    .sum();
            }
        }
        y
    }

    pub(crate) fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// Whether this CPU runs the kernels. Without AVX-512F the tests say so loudly and pass:
    /// the machines CI draws include CPUs without it (AMD Zen 3), where nothing calls these
    /// kernels (`supported()` keeps every caller on its other path, which its own tests
    /// cover); `MILES_REQUIRE_KERNEL_TESTS` requires what can be installed (the Vulkan
    /// adapter), not the CPU's instruction set.
    fn runs_here() -> bool {
        if supported() {
            return true;
        }
        eprintln!("!!! KERNEL TEST NOT RUN: packed kernels need AVX-512F, which this CPU lacks");
        false
    }

    /// Every `got[i]` within `1e-5` (relative, plus absolute) of `want(i)`.
    pub(crate) fn assert_close(what: &str, got: &[f32], want: impl Fn(usize) -> f64) {
        for (i, &got) in got.iter().enumerate() {
            let want = want(i);
            assert!(
                (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{what} element {i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn pack_round_trips_and_pads_with_zeros() {
        let (n, k) = (37, 5);
        let w = values(n * k, 1);
        let p = pack(&w, n, k);
        assert_eq!(p.len(), 2 * k * PANEL);
        assert_eq!(unpack(&p, n, k), w);
        // Element (i = 3, c = 33): panel 1, column 1.
        assert_eq!(p[k * PANEL + 3 * PANEL + 1], w[33 * k + 3]);
        assert!(
            p[k * PANEL + 2 * PANEL + 5..k * PANEL + 3 * PANEL]
                .iter()
                .all(|&v| v == 0.0)
        );
    }

    #[test]
    fn stacked_and_glu_packing_equal_their_definitions() {
        // Stacked parts pack as their concatenation (q / k / v widths not multiples of a panel,
        // so panels straddle the parts); a GLU pair as gate panel j then up panel j, each
        // `pack`'s panel, whatever the parallel split. `pack` itself against the formula.
        let k = 300;
        let (q, kk, v) = (values(45 * k, 2), values(20 * k, 3), values(7 * k, 4));
        let stacked = pack_stacked(&[&q, &kk, &v], k);
        let all: Vec<f32> = [&q[..], &kk[..], &v[..]].concat();
        let n = 72;
        assert_eq!(stacked.len(), panels(n) * k * PANEL);
        for c in 0..panels(n) * PANEL {
            for i in 0..k {
                let want = if c < n { all[c * k + i] } else { 0.0 };
                assert_eq!(
                    stacked[(c / PANEL) * k * PANEL + i * PANEL + c % PANEL],
                    want
                );
            }
        }
        let (gate, up) = (values(40 * k, 5), values(40 * k, 6));
        let glu = pack_glu(&gate, &up, 40, k);
        let (pg, pu) = (pack(&gate, 40, k), pack(&up, 40, k));
        let len = k * PANEL;
        for j in 0..panels(40) {
            assert_eq!(
                glu[2 * j * len..(2 * j + 1) * len],
                pg[j * len..(j + 1) * len]
            );
            assert_eq!(
                glu[(2 * j + 1) * len..(2 * j + 2) * len],
                pu[j * len..(j + 1) * len]
            );
        }
        if runs_here() && crate::fused_ops_enabled() {
            // Packed from tensors: the same panels, read from the weights' own buffers.
            let device = burn::tensor::Device::flex();
            let t = |w: &[f32], rows: usize| {
                Tensor::<2>::from_data(TensorData::new(w.to_vec(), [rows, k]), &device)
            };
            let m = PackedMatrix::stacked(vec![t(&q, 45), t(&kk, 20), t(&v, 7)]).unwrap();
            assert_eq!((m.n, m.k), (n, k));
            assert_eq!(host_f32(m.data).unwrap(), stacked);
            let m = PackedMatrix::glu(t(&gate, 40), t(&up, 40)).unwrap();
            assert_eq!(host_f32(m.data).unwrap(), glu);
        }
    }

    #[test]
    fn products_match_f64_and_rows_are_batch_invariant() {
        if !runs_here() {
            return;
        }
        for &(m, k, n) in &[
            (1, 7, 5),
            (3, 64, 100),
            (13, 33, 64),
            (32, 96, 70),
            (200, 40, 33),
            // Input packed on the rayon pool (≥ PARALLEL_PACK values).
            (300, 256, 40),
        ] {
            let (x, w) = (values(m * k, 2), values(n * k, 3));
            let p = pack(&w, n, k);
            let y = matmul_host(&x, m, k, &[(0..m, &p[..])], n);
            let want = exact(&x, &w, m, k, n);
            assert_close(&format!("[{m}, {k}, {n}]"), &y, |i| want[i]);
            // Each row alone gives the same bits as within the batch.
            for r in [0, m / 2, m - 1] {
                let alone = matmul_host(&x[r * k..(r + 1) * k], 1, k, &[(0..1, &p[..])], n);
                assert_eq!(alone, y[r * n..(r + 1) * n], "[{m}, {k}, {n}] row {r}");
            }
        }
    }

    #[test]
    fn glu_products_match_f64_swiglu_and_rows_are_batch_invariant() {
        if !runs_here() {
            return;
        }
        for &(m, k, inter) in &[
            (1, 9, 5),
            (7, 64, 70),
            (13, 40, 32),
            (40, 33, 96),
            (70, 24, 45),
        ] {
            let x = values(m * k, 7);
            let (gate, up) = (values(inter * k, 8), values(inter * k, 9));
            let p = pack_glu(&gate, &up, inter, k);
            assert_eq!(p.len(), 2 * panels(inter) * k * PANEL);
            let y = product_host(Product::Glu, &x, m, k, &[(0..m, &p[..])], inter);
            let (g, u) = (exact(&x, &gate, m, k, inter), exact(&x, &up, m, k, inter));
            assert_close(&format!("[{m}, {k}, {inter}] SwiGLU"), &y, |i| {
                g[i] / (1.0 + (-g[i]).exp()) * u[i]
            });
            let r = m - 1;
            let alone = product_host(Product::Glu, &x[r * k..], 1, k, &[(0..1, &p[..])], inter);
            assert_eq!(alone, y[r * inter..], "[{m}, {k}, {inter}] last row alone");
        }
    }

    #[test]
    fn groups_use_their_own_weights_and_leave_other_rows_zero() {
        if !runs_here() {
            return;
        }
        let (m, k, n) = (20, 24, 40);
        let x = values(m * k, 4);
        let (w0, w1) = (values(n * k, 5), values(n * k, 6));
        let (p0, p1) = (pack(&w0, n, k), pack(&w1, n, k));
        let y = matmul_host(&x, m, k, &[(0..7, &p0[..]), (7..18, &p1[..])], n);
        let (y0, y1) = (exact(&x, &w0, m, k, n), exact(&x, &w1, m, k, n));
        assert_close("two groups", &y, |i| match i / n {
            0..7 => y0[i],
            7..18 => y1[i],
            _ => 0.0,
        });
    }
}
