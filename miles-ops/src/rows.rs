//! Decode matmuls over weights read where they lie, in their HF layout `[out, in]` row-major
//! (flex, `f32`, CPUs with AVX-512F and AVX-512VL, or AVX2 and FMA): no copy of the weights,
//! where [`crate::packed`]'s panels are one more copy of the model. At Qwen3-0.6B's shapes on
//! an Intel Xeon (Sapphire Rapids) the panels are faster from about 8 input rows (32 rows:
//! these kernels take 1.3–1.5x their time) and equal at one (both read the weights at the
//! memory's speed).
//!
//! [`crate::packed`] packs each weight once per weight version into column panels, which
//! costs one more copy of the model and a pass over it at every weight update. Here every
//! output element is a dot product of an input row with a weight row, both contiguous:
//!
//! - the micro-kernel keeps `R × C` accumulators of 16 lanes (AVX-512F: up to 6 input rows
//!   times 4 weight rows; AVX2: 8 lanes, 2 × 4, which keeps its 16 registers from spilling) and, for each 16 (8) input indices, loads the
//!   weight vectors and the input vectors once and does one FMA per accumulator; the lanes
//!   are summed at the end;
//! - a task covers a range of weight rows (at most about 512 KiB of them, and small enough
//!   that each core gets several tasks) and a range of input rows (at most about 256 KiB of
//!   them, so they stay in L2): it walks its weight rows 4 at a time and runs every block of
//!   input rows over them (the 4 rows stay in L1) before the next 4, whose lines are
//!   prefetched while the first block runs.
//!
//! Stacked weights (q / k / v, or several projections of one input) are read as the
//! concatenation of their rows without building it, and a gate and an up projection give
//! `silu(x · gateᵀ) ⊙ (x · upᵀ)` directly ([`Product::Glu`], the formula of
//! [`crate::swiglu()`]'s flex op).
//!
//! Every output element is the same sequence of operations whatever the number of rows, the
//! block or the task it falls in: one partial sum per lane accumulated by FMA in input order
//! from zero (the last inputs masked), then summed across lanes in one fixed order (the
//! same on every CPU of one [`Isa`]). A row's result
//! does not depend on which other rows share the call, so continuous batching gives the same
//! logits as one sequence at a time. The order is neither `gemm`'s nor the packed kernels',
//! so results differ from [`crate::linear_reference`] at float rounding (tests hold them
//! within `1e-5` relative). Forward only: the engine's step model uses them.
//!
//! [`RowsMatrix`] holds the weights as tensors sharing their buffers: the trainer's
//! parameters handed to the engine stay one copy (an optimizer step that finds them shared
//! writes new buffers, so the engine keeps serving the version it holds).

use burn::backend::{BackendTensor, DispatchTensorKind, Flex, tensor::FloatTensor};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use crate::flex::tensor::{as_f32, f32_data, tensor};
use crate::packed::{OutPtr, Product, flex_primitive};

/// Weight rows per register block of the micro-kernel.
const COL_BLOCK: usize = 4;
/// Input rows per register block of the micro-kernel (AVX-512F; AVX2: 2).
const ROW_BLOCK: usize = 6;
/// Bytes of weight rows one task reads.
const TASK_WEIGHT_BYTES: usize = 512 * 1024;
/// Bytes of input rows one task reads (kept in L2 while its weight rows pass).
const TASK_INPUT_BYTES: usize = 256 * 1024;
/// Multiply-adds below which a product runs on the calling thread alone.
const PARALLEL_WORK: usize = 1 << 18;

/// Weights `[out, in]` (HF layout) multiplied in place by [`RowsMatrix::matmul`] (see the
/// module docs). Cloning shares the buffers.
#[derive(Debug, Clone)]
pub struct RowsMatrix {
    /// The weights: for [`Product::Plain`] one or more `[out_i, in]` stacked on the output
    /// axis; for [`Product::Glu`] the gate then the up projection, `[out, in]` each.
    pub parts: Vec<Tensor<2>>,
    /// Input width.
    pub k: usize,
    /// Output width (`Σ out_i`, or the SwiGLU width).
    pub n: usize,
    /// What [`RowsMatrix::matmul`] computes.
    pub product: Product,
}

impl RowsMatrix {
    /// `w` `[out, in]`, or `None` where this path does not apply ([`applies`]).
    pub fn new(w: Tensor<2>) -> Option<Self> {
        Self::build(Product::Plain, vec![w])
    }

    /// Weights `[out_i, in]` read as one `[Σ out_i, in]` matrix (e.g. q / k / v as one
    /// matmul), or `None` where this path does not apply.
    pub fn stacked(weights: Vec<Tensor<2>>) -> Option<Self> {
        Self::build(Product::Plain, weights)
    }

    /// A gate and an up projection (`[inter, in]` each) for `silu(x · gateᵀ) ⊙ (x · upᵀ)`,
    /// or `None` where this path does not apply.
    pub fn glu(gate: Tensor<2>, up: Tensor<2>) -> Option<Self> {
        Self::build(Product::Glu, vec![gate, up])
    }

    fn build(product: Product, weights: Vec<Tensor<2>>) -> Option<Self> {
        let first = weights.first()?;
        let (device, dtype) = (first.device(), first.dtype());
        let (k, n) = product.shape(&weights)?;
        // Contiguous buffers only (a strided view would need a copy to be read in place).
        let contiguous = weights
            .iter()
            .all(|w| flex_primitive(w.clone()).is_some_and(|t| t.as_slice::<f32>().is_some()));
        if !applies(&device, dtype) || !contiguous {
            return None;
        }
        Some(Self {
            parts: weights,
            k,
            n,
            product,
        })
    }

    /// Whether one of the matrix's parts is `w`'s own buffer (read in place, not a copy).
    pub fn reads(&self, w: &Tensor<2>) -> bool {
        let start = |t: &Tensor<2>| {
            flex_primitive(t.clone()).and_then(|f| f.as_slice::<f32>().map(|s| s.as_ptr() as usize))
        };
        let Some(target) = start(w) else {
            return false;
        };
        self.parts.iter().any(|p| start(p) == Some(target))
    }

    /// `x · wᵀ` for `x` `[rows, in]`: `[rows, out]` (for [`Product::Glu`] the SwiGLU
    /// activations). Any other input than plain flex `f32` (e.g. an autodiff tensor) takes the
    /// reference product. Panics on a mismatched input width, as `matmul` does.
    pub fn matmul(&self, x: Tensor<2>) -> Tensor<2> {
        let [m, k] = x.dims();
        assert_eq!(
            k, self.k,
            "rows matmul: input width {k}, weight takes {}",
            self.k
        );
        let Some(xf) = flex_primitive(x.clone()).filter(|t| t.dtype() == DType::F32) else {
            return self.reference(x);
        };
        let xf = as_f32(xf);
        let xd = f32_data(&xf);
        let weights: Vec<FloatTensor<Flex>> = self
            .parts
            .iter()
            .map(|w| flex_primitive(w.clone()).expect("checked at construction"))
            .collect();
        let host: Vec<_> = weights.iter().map(f32_data).collect();
        let parts: Vec<&[f32]> = host.iter().map(|h| &h[..]).collect();
        let y = product_host(self.product, &xd, m, k, &parts, self.n);
        Tensor::from_dispatch(burn::backend::DispatchTensor {
            kind: DispatchTensorKind::Flex(BackendTensor::Float(tensor(y, &[m, self.n]))),
            autodiff: Default::default(),
        })
    }

    /// The product by `matmul` over the weights as they are (any device).
    fn reference(&self, x: Tensor<2>) -> Tensor<2> {
        match self.product {
            Product::Plain => {
                let outs: Vec<Tensor<2>> = self
                    .parts
                    .iter()
                    .map(|w| x.clone().matmul(w.clone().transpose()))
                    .collect();
                Tensor::cat(outs, 1)
            }
            Product::Glu => crate::swiglu::swiglu_reference(
                x.clone().matmul(self.parts[0].clone().transpose()),
                x.matmul(self.parts[1].clone().transpose()),
            ),
        }
    }
}

/// `y[m, n]` for `x` `[m, k]` row-major and weights given as `parts` (`[n_i, k]` row-major
/// each): for [`Product::Plain`] `y[r, c] = x[r] · w[c]` over the parts' rows in turn
/// (`n = Σ n_i`); for [`Product::Glu`] `y[r, c] = silu(x[r] · gate[c]) · (x[r] · up[c])` with
/// `parts = [gate, up]`, `n` rows each.
///
/// # Panics
/// When `x` or a part has another length than its shape, the parts do not give `n`
/// outputs, or the CPU runs none of the kernels ([`supported`]).
pub fn product_host(
    product: Product,
    x: &[f32],
    m: usize,
    k: usize,
    parts: &[&[f32]],
    n: usize,
) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "rows matmul: input of {} values", x.len());
    for p in parts {
        assert!(
            k == 0 || p.len().is_multiple_of(k),
            "rows matmul: {} weight values for rows of {k}",
            p.len()
        );
    }
    let rows_of = |p: &[f32]| p.len().checked_div(k).unwrap_or(0);
    match product {
        Product::Plain => assert_eq!(
            parts.iter().map(|p| rows_of(p)).sum::<usize>(),
            n,
            "rows matmul: weight rows"
        ),
        Product::Glu => assert!(
            parts.len() == 2 && parts.iter().all(|p| rows_of(p) == n),
            "rows matmul: gate and up of {n} rows each"
        ),
    }
    let isa = Isa::detect().expect("rows matmul: this CPU has neither AVX-512F nor AVX2 + FMA");
    product_with(isa, product, x, m, k, parts, n)
}

/// [`product_host`] with the kernels of `isa` (which the CPU runs).
fn product_with(
    isa: Isa,
    product: Product,
    x: &[f32],
    m: usize,
    k: usize,
    parts: &[&[f32]],
    n: usize,
) -> Vec<f32> {
    let row_block = isa.row_block();
    let mut y = vec![0.0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    // The weight row behind each product column (for Glu: gate row c, then up row c).
    let weight_row = |c: usize| -> *const f32 {
        match product {
            Product::Glu => parts[0][c * k..].as_ptr(),
            Product::Plain => {
                let mut c = c;
                for p in parts {
                    let rows = p.len() / k;
                    if c < rows {
                        return p[c * k..].as_ptr();
                    }
                    c -= rows;
                }
                unreachable!("column inside the parts (checked above)")
            }
        }
    };
    // Output columns per register block: 4 weight rows (Glu: 2 gate and 2 up rows).
    let cols_per_block = COL_BLOCK / product.width();
    let threads = rayon::current_num_threads().max(1);
    let row_bytes = k * 4 * product.width();
    let col_blocks = n.div_ceil(cols_per_block);
    let by_bytes = (TASK_WEIGHT_BYTES / (row_bytes * cols_per_block)).max(1);
    let col_chunk = by_bytes.min(col_blocks.div_ceil(4 * threads)).max(1);
    let row_chunk = ((TASK_INPUT_BYTES / (k * 4)).max(row_block) / row_block) * row_block;
    let mut tasks: Vec<(usize, usize, usize, usize)> = Vec::new();
    for r0 in (0..m).step_by(row_chunk) {
        for b0 in (0..col_blocks).step_by(col_chunk) {
            tasks.push((
                r0,
                (r0 + row_chunk).min(m),
                b0,
                (b0 + col_chunk).min(col_blocks),
            ));
        }
    }
    let out = OutPtr(y.as_mut_ptr());
    let run = |&(r0, r1, b0, b1): &(usize, usize, usize, usize)| {
        for b in b0..b1 {
            let c0 = b * cols_per_block;
            let cols = (n - c0).min(cols_per_block);
            let mut w = [std::ptr::null::<f32>(); COL_BLOCK];
            for j in 0..cols {
                w[j] = weight_row(c0 + j);
                if product == Product::Glu {
                    w[cols + j] = parts[1][(c0 + j) * k..].as_ptr();
                }
            }
            // The next block's weight rows, prefetched during this block's first row block.
            let next_cols = if b + 1 < col_blocks {
                (n - c0 - cols).min(cols_per_block)
            } else {
                0
            };
            let mut next = [std::ptr::null::<f32>(); COL_BLOCK];
            for j in 0..next_cols {
                next[j] = weight_row(c0 + cols + j);
                if product == Product::Glu {
                    next[next_cols + j] = parts[1][(c0 + cols + j) * k..].as_ptr();
                }
            }
            let weights = cols * product.width();
            let mut r = r0;
            while r < r1 {
                let rows = (r1 - r).min(row_block);
                let mut acc = [[0.0f32; COL_BLOCK]; ROW_BLOCK];
                let prefetch = if r == r0 {
                    &next[..next_cols * product.width()]
                } else {
                    &[][..]
                };
                // SAFETY: rows r..r+rows < m of `x` hold k values each; every `w[j]` for
                // j < weights points at a weight row of k values inside `parts`; prefetch
                // pointers are weight rows too; the CPU runs `isa` (detected above).
                unsafe {
                    dots(
                        isa,
                        rows,
                        weights,
                        x[r * k..].as_ptr(),
                        k,
                        &w,
                        prefetch,
                        &mut acc,
                    )
                };
                for (i, a) in acc.iter().enumerate().take(rows) {
                    // SAFETY: row r + i < m and columns c0..c0+cols ≤ n lie inside `y`; tasks
                    // cover disjoint (row, column) ranges, so no two write the same element;
                    // `y` outlives the parallel loop.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(out.at((r + i) * n + c0), cols) };
                    match product {
                        Product::Plain => dst.copy_from_slice(&a[..cols]),
                        Product::Glu => {
                            for (j, d) in dst.iter_mut().enumerate() {
                                let (g, u) = (a[j], a[cols + j]);
                                *d = g * crate::swiglu::sigmoid(g) * u;
                            }
                        }
                    }
                }
                r += rows;
            }
        }
    };
    if threads == 1 || tasks.len() == 1 || m * n * k < PARALLEL_WORK {
        tasks.iter().for_each(run);
    } else {
        tasks.par_iter().for_each(run);
    }
    y
}

/// The vector instructions the kernels run with, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F with AVX-512VL (every AVX-512 CPU since Skylake-SP and Zen 4): 16 lanes, up
    /// to 6 input rows × 4 weight rows per register block.
    Avx512,
    /// AVX2 with FMA: 8 lanes, up to 2 input rows × 4 weight rows per register block.
    Avx2,
}

impl Isa {
    /// What this CPU runs, if any.
    pub fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Some(Self::Avx512);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Some(Self::Avx2);
            }
        }
        None
    }

    /// Lanes of one accumulator.
    pub fn lanes(self) -> usize {
        match self {
            Self::Avx512 => 16,
            Self::Avx2 => 8,
        }
    }

    /// Input rows per register block.
    fn row_block(self) -> usize {
        match self {
            Self::Avx512 => ROW_BLOCK,
            Self::Avx2 => 2,
        }
    }
}

/// Whether the kernels can run here: an x86-64 CPU with AVX-512F, or with AVX2 and FMA.
pub fn supported() -> bool {
    Isa::detect().is_some()
}

/// Whether weights on `device` in `dtype` are multiplied in place: plain flex (no autodiff),
/// `f32`, the fused ops on ([`crate::fused_ops_enabled`]) and [`supported`].
pub fn applies(device: &burn::tensor::Device, dtype: DType) -> bool {
    crate::packed::flex_f32_fused(device, dtype) && supported()
}

/// `acc[r][j] = x[r] · w[j]` for `r < rows`, `j < weights` (`rows ≤` the ISA's row block,
/// `weights ≤ 4`), each as the module docs order it; the lines of the `prefetch` rows (k
/// values each) are requested as it goes.
///
/// # Safety
/// `x` holds `rows · k` values; `w[j]` for `j < weights` and every `prefetch` pointer point
/// at `k` values; the CPU runs `isa`.
#[allow(clippy::too_many_arguments)]
unsafe fn dots(
    isa: Isa,
    rows: usize,
    weights: usize,
    x: *const f32,
    k: usize,
    w: &[*const f32; COL_BLOCK],
    prefetch: &[*const f32],
    acc: &mut [[f32; COL_BLOCK]; ROW_BLOCK],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let pf = x86::Prefetch::new(prefetch, k, k.div_ceil(isa.lanes()));
        macro_rules! dispatch {
            ($kernel:ident; $(($r:literal, $c:literal)),*) => {
                match (rows, weights) {
                    $(($r, $c) => x86::$kernel::<$r, $c>(x, k, w, pf, acc),)*
                    _ => unreachable!("register blocks hold at most the ISA's rows of 4 weights"),
                }
            };
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            match isa {
                Isa::Avx512 => dispatch!(avx512;
                    (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4),
                    (3, 1), (3, 2), (3, 3), (3, 4), (4, 1), (4, 2), (4, 3), (4, 4),
                    (5, 1), (5, 2), (5, 3), (5, 4), (6, 1), (6, 2), (6, 3), (6, 4)),
                Isa::Avx2 => dispatch!(avx2;
                    (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4)),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, rows, weights, x, k, w, prefetch, acc);
        unreachable!("this path exists only where `supported()`");
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{COL_BLOCK, ROW_BLOCK};

    /// Lines of up to [`COL_BLOCK`] rows of `k` values requested evenly over a kernel's steps,
    /// with the `T2` hint (as [`crate::packed`]'s prefetch, for the same reason).
    pub(super) struct Prefetch {
        rows: [*const f32; COL_BLOCK],
        count: usize,
        /// Lines per row, and the next line (over all rows) to request.
        lines: usize,
        next: usize,
        /// The kernel's steps; one line per `steps` accumulated.
        steps: usize,
        acc: usize,
    }

    impl Prefetch {
        pub(super) fn new(rows: &[*const f32], k: usize, steps: usize) -> Self {
            let mut r = [std::ptr::null(); COL_BLOCK];
            let count = rows.len().min(COL_BLOCK);
            r[..count].copy_from_slice(&rows[..count]);
            Self {
                rows: r,
                count,
                lines: k.div_ceil(16),
                next: 0,
                steps: steps.max(1),
                acc: 0,
            }
        }

        #[inline(always)]
        fn step(&mut self) {
            self.acc += self.count * self.lines;
            while self.acc >= self.steps && self.next < self.count * self.lines {
                let (row, line) = (self.next / self.lines, self.next % self.lines);
                // SAFETY: a prefetch never faults; the address is inside row `row`'s `k`
                // values (line < ⌈k / 16⌉).
                unsafe {
                    _mm_prefetch::<_MM_HINT_T2>(self.rows[row].wrapping_add(line * 16).cast())
                };
                self.next += 1;
                self.acc -= self.steps;
            }
        }
    }

    /// `acc[r][j] = Σ_i x[r · k + i] · w[j][i]` for `r < R`, `j < C`: per pair 16 lanes
    /// accumulated by FMA over `i` in steps of 16 from zero (the tail masked), then summed
    /// across lanes.
    ///
    /// Compiled with AVX-512VL as well: the lane sums at the end are 256- and 128-bit
    /// operations, which without VL can only use the low 16 vector registers, so the
    /// accumulators they read were confined to those and 10 of the 24 spilled to the stack
    /// inside the loop (the 6 × 4 block ran at 0.7x the speed it runs at with all 32).
    ///
    /// # Safety
    /// `x` holds `R · k` values, `w[j]` (`j < C`) `k` values each; the CPU has AVX-512F and
    /// AVX-512VL.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn avx512<const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        w: &[*const f32; COL_BLOCK],
        mut pf: Prefetch,
        acc: &mut [[f32; COL_BLOCK]; ROW_BLOCK],
    ) {
        let mut s = [[_mm512_setzero_ps(); C]; R];
        // SAFETY: every offset below is inside the extents the caller guarantees (the tail's
        // loads are masked to the last `k % 16` values).
        unsafe {
            let full = k / 16;
            for step in 0..full {
                pf.step();
                let i = step * 16;
                let mut wv = [_mm512_setzero_ps(); C];
                for (v, row) in wv.iter_mut().zip(w) {
                    *v = _mm512_loadu_ps(row.add(i));
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(x.add(r * k + i));
                    for (sj, wj) in sr.iter_mut().zip(&wv) {
                        *sj = _mm512_fmadd_ps(xv, *wj, *sj);
                    }
                }
            }
            let tail = k % 16;
            if tail > 0 {
                pf.step();
                let (i, mask) = (full * 16, ((1u32 << tail) - 1) as __mmask16);
                let mut wv = [_mm512_setzero_ps(); C];
                for (v, row) in wv.iter_mut().zip(w) {
                    *v = _mm512_maskz_loadu_ps(mask, row.add(i));
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let xv = _mm512_maskz_loadu_ps(mask, x.add(r * k + i));
                    for (sj, wj) in sr.iter_mut().zip(&wv) {
                        *sj = _mm512_fmadd_ps(xv, *wj, *sj);
                    }
                }
            }
            for (ar, sr) in acc.iter_mut().zip(&s) {
                for (a, v) in ar.iter_mut().zip(sr) {
                    *a = _mm512_reduce_add_ps(*v);
                }
            }
        }
    }

    /// As [`avx512`] with 8 lanes: steps of 8 inputs, the tail masked, the lanes summed as
    /// `((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))`.
    ///
    /// # Safety
    /// `x` holds `R · k` values, `w[j]` (`j < C`) `k` values each; the CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<const R: usize, const C: usize>(
        x: *const f32,
        k: usize,
        w: &[*const f32; COL_BLOCK],
        mut pf: Prefetch,
        acc: &mut [[f32; COL_BLOCK]; ROW_BLOCK],
    ) {
        let mut s = [[_mm256_setzero_ps(); C]; R];
        // SAFETY: every offset below is inside the extents the caller guarantees (the tail's
        // loads are masked to the last `k % 8` values).
        unsafe {
            let full = k / 8;
            for step in 0..full {
                pf.step();
                let i = step * 8;
                let mut wv = [_mm256_setzero_ps(); C];
                for (v, row) in wv.iter_mut().zip(w) {
                    *v = _mm256_loadu_ps(row.add(i));
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(r * k + i));
                    for (sj, wj) in sr.iter_mut().zip(&wv) {
                        *sj = _mm256_fmadd_ps(xv, *wj, *sj);
                    }
                }
            }
            let tail = k % 8;
            if tail > 0 {
                pf.step();
                let i = full * 8;
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail as i32), lane);
                let mut wv = [_mm256_setzero_ps(); C];
                for (v, row) in wv.iter_mut().zip(w) {
                    *v = _mm256_maskload_ps(row.add(i), mask);
                }
                for (r, sr) in s.iter_mut().enumerate() {
                    let xv = _mm256_maskload_ps(x.add(r * k + i), mask);
                    for (sj, wj) in sr.iter_mut().zip(&wv) {
                        *sj = _mm256_fmadd_ps(xv, *wj, *sj);
                    }
                }
            }
            for (ar, sr) in acc.iter_mut().zip(&s) {
                for (a, v) in ar.iter_mut().zip(sr) {
                    let half = _mm_add_ps(_mm256_castps256_ps128(*v), _mm256_extractf128_ps(*v, 1));
                    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
                    *a = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::tests::{assert_close, exact, values};

    /// The ISAs this CPU runs (AVX-512F CPUs run the AVX2 kernels too). The kernels need
    /// AVX2 and FMA at least; without them the tests say so, and fail where
    /// `MILES_REQUIRE_KERNEL_TESTS` is set (CI).
    fn isas() -> Vec<Isa> {
        let isas = match Isa::detect() {
            Some(Isa::Avx512) => vec![Isa::Avx512, Isa::Avx2],
            Some(Isa::Avx2) => vec![Isa::Avx2],
            None => Vec::new(),
        };
        if isas.is_empty() {
            assert!(
                std::env::var_os("MILES_REQUIRE_KERNEL_TESTS").is_none(),
                "MILES_REQUIRE_KERNEL_TESTS is set but this CPU has neither AVX-512F nor AVX2"
            );
            eprintln!("rows kernel tests skipped: this CPU has neither AVX-512F nor AVX2");
        }
        isas
    }

    #[test]
    fn stacked_products_match_f64_and_rows_are_batch_invariant() {
        // Widths with and without a lane tail, output counts not multiples of the register
        // block, several tasks (rows and columns), stacked parts of odd sizes.
        for isa in isas() {
            for &(m, k, ns) in &[
                (1, 7, &[5][..]),
                (3, 64, &[45, 20, 7][..]),
                (13, 33, &[64][..]),
                (32, 96, &[70, 3][..]),
                (200, 40, &[33][..]),
                (70, 1000, &[130, 130][..]),
            ] {
                let x = values(m * k, 2);
                let ws: Vec<Vec<f32>> = ns
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| values(n * k, 10 + i as u64))
                    .collect();
                let parts: Vec<&[f32]> = ws.iter().map(|w| &w[..]).collect();
                let n: usize = ns.iter().sum();
                let all: Vec<f32> = ws.concat();
                let what = format!("{isa:?} [{m}, {k}, {ns:?}]");
                let y = product_with(isa, Product::Plain, &x, m, k, &parts, n);
                let want = exact(&x, &all, m, k, n);
                assert_close(&what, &y, |i| want[i]);
                for r in [0, m / 2, m - 1] {
                    let row = &x[r * k..(r + 1) * k];
                    let alone = product_with(isa, Product::Plain, row, 1, k, &parts, n);
                    assert_eq!(alone, y[r * n..(r + 1) * n], "{what} row {r}");
                }
                // The stacked parts equal their concatenation, bit for bit.
                assert_eq!(
                    product_with(isa, Product::Plain, &x, m, k, &[&all], n),
                    y,
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn glu_products_match_f64_swiglu_and_rows_are_batch_invariant() {
        for isa in isas() {
            for &(m, k, inter) in &[
                (1, 9, 5),
                (7, 64, 70),
                (13, 40, 32),
                (40, 33, 97),
                (70, 24, 45),
            ] {
                let x = values(m * k, 7);
                let (gate, up) = (values(inter * k, 8), values(inter * k, 9));
                let y = product_with(isa, Product::Glu, &x, m, k, &[&gate, &up], inter);
                let (g, u) = (exact(&x, &gate, m, k, inter), exact(&x, &up, m, k, inter));
                let what = format!("{isa:?} [{m}, {k}, {inter}] SwiGLU");
                assert_close(&what, &y, |i| g[i] / (1.0 + (-g[i]).exp()) * u[i]);
                let r = m - 1;
                let alone =
                    product_with(isa, Product::Glu, &x[r * k..], 1, k, &[&gate, &up], inter);
                assert_eq!(alone, y[r * inter..], "{what} last row alone");
            }
        }
    }

    #[test]
    fn the_matrix_reads_the_weights_in_place_and_falls_back_off_flex() {
        if isas().is_empty() || !crate::fused_ops_enabled() {
            return;
        }
        let device = burn::tensor::Device::flex();
        let (m, k) = (5, 48);
        let t = |v: Vec<f32>, rows: usize| {
            Tensor::<2>::from_data(burn::tensor::TensorData::new(v, [rows, k]), &device)
        };
        let (q, kk) = (t(values(24 * k, 3), 24), t(values(8 * k, 4), 8));
        let x = t(values(m * k, 5), m);
        let rows = RowsMatrix::stacked(vec![q.clone(), kk.clone()]).unwrap();
        assert_eq!((rows.n, rows.k), (32, k));
        assert!(rows.reads(&q) && rows.reads(&kk));
        // A tensor with the same values in another buffer is not read.
        assert!(!rows.reads(&(q.clone() * 1.0)));
        let y = rows.matmul(x.clone());
        let want = Tensor::cat(vec![q.transpose(), kk.transpose()], 1);
        let want = x.clone().matmul(want);
        let (y, want) = (
            y.into_data().try_to_vec::<f32>().unwrap(),
            want.into_data().try_to_vec::<f32>().unwrap(),
        );
        assert_close("stacked matrix", &y, |i| want[i] as f64);
        // Not f32: no rows matrix.
        let half = t(values(4 * k, 6), 4).cast(DType::BF16);
        assert!(RowsMatrix::new(half).is_none());
    }
}
