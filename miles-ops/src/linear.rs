//! Inference linear layer `x · wᵀ` (HF layout `w` `[out, in]`) that keeps both cores busy
//! on the small matmuls of a decode step.

use burn::backend::{
    Backend, Dispatch, DispatchDevice, Flex, backend_extension, tensor::FloatTensor,
};
use burn::tensor::{DType, Tensor};
use rayon::prelude::*;

use crate::flex::gemm::matmul;
use crate::flex::tensor::{as_f32, dims, f32_data, tensor};

/// Multiply-adds from which flex parallelises a matmul itself (its `192³`).
const FLEX_PARALLEL: usize = 192 * 192 * 192;
/// Multiply-adds below which a split costs more than it saves.
const MIN_SPLIT: usize = 1 << 15;
/// Output columns per block are a multiple of this (whole SIMD registers).
const COLUMN_ALIGN: usize = 16;
/// Rows up to which [`linear_t`] splits at every size (a decode step's batch).
pub const DECODE_ROWS: usize = 64;

/// `x · wᵀ` for `x` `[rows, in]` and `w` `[out, in]`; panics on mismatched widths as
/// `matmul` does.
///
/// flex runs a matmul on one thread below `192³` multiply-adds, so a decode step's
/// projections (`[rows ≤ 32, hidden]` by `[out, hidden]`, streaming every weight from memory
/// once) run on one core. On plain flex (no autodiff, `f32`) [`linear`] splits such a matmul
/// by output columns into one `gemm` per rayon task and joins the column blocks; larger
/// matmuls, other devices and autodiff tensors take `x.matmul(w.transpose())`
/// ([`linear_reference`], also what the split path is tested against). [`linear_t`] is the
/// same over a weight already stored transposed, `[in, out]` row-major: the layout `gemm`'s
/// AVX-512 kernels read fastest at decode row counts (the engine's step model packs its
/// weights that way once per weight version). At decode row counts (at most
/// [`DECODE_ROWS`]) [`linear_t`] splits at every size, `lm_head` included: one sequence's
/// `[1, 512] · [512, 32000]` took 4.3 ms per token through flex's own matmul and takes 2.1 ms
/// split (GLM-4-MoE 88 M decode on this project's 2-core machine); at 32 rows both stream
/// the weight from memory at about the same rate.
/// Forward only: the engine's step model uses them, training never does. On CPUs with
/// AVX-512F the step model packs its `f32` weights for [`crate::packed`] instead (about 1.5x
/// faster at 32 rows, no per-call packing); this is the path on other CPUs and dtypes.
pub fn linear(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    let ([m, k], [n, wk]) = (x.dims(), w.dims());
    if wk != k || !splits(&x, &w, m, k, n, FLEX_PARALLEL) {
        return linear_reference(x, w);
    }
    Tensor::from_dispatch(<Dispatch as LinearOps>::linear_split(
        x.into_dispatch(),
        w.into_dispatch(),
        false,
    ))
}

/// `x · wt` for `x` `[rows, in]` and `wt` `[in, out]` (a weight stored transposed), split
/// over the cores as [`linear`] is; panics on mismatched widths as `matmul` does.
pub fn linear_t(x: Tensor<2>, wt: Tensor<2>) -> Tensor<2> {
    let ([m, k], [wk, n]) = (x.dims(), wt.dims());
    let up_to = if m <= DECODE_ROWS {
        usize::MAX
    } else {
        FLEX_PARALLEL
    };
    if wk != k || !splits(&x, &wt, m, k, n, up_to) {
        return x.matmul(wt);
    }
    Tensor::from_dispatch(<Dispatch as LinearOps>::linear_split(
        x.into_dispatch(),
        wt.into_dispatch(),
        true,
    ))
}

/// Whether an `[m, k] · [k, n]` product takes the split path: plain flex, `f32`, a size
/// worth splitting and below `up_to` multiply-adds, and more than one core.
fn splits(x: &Tensor<2>, w: &Tensor<2>, m: usize, k: usize, n: usize, up_to: usize) -> bool {
    let work = m.saturating_mul(n).saturating_mul(k);
    matches!(x.device().as_dispatch(), DispatchDevice::Flex(_))
        && matches!(w.device().as_dispatch(), DispatchDevice::Flex(_))
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && (MIN_SPLIT..up_to).contains(&work)
        && n >= 2 * COLUMN_ALIGN
        && rayon::current_num_threads() >= 2
}

/// `x.matmul(w.transpose())`.
pub fn linear_reference(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    x.matmul(w.transpose())
}

/// Backend op of [`linear`] (plain flex only).
#[backend_extension(Flex)]
pub trait LinearOps: Backend {
    /// `x · wᵀ` (`w` `[out, in]`), or `x · w` when `transposed` (`w` `[in, out]`), split by
    /// output columns over the rayon pool.
    fn linear_split(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        transposed: bool,
    ) -> FloatTensor<Self>;
}

impl LinearOps for Flex {
    fn linear_split(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        transposed: bool,
    ) -> FloatTensor<Self> {
        let (x, w) = (as_f32(x), as_f32(w));
        let (xd, wd) = (f32_data(&x), f32_data(&w));
        let [m, k] = [dims(&x)[0], dims(&x)[1]];
        let n = if transposed { dims(&w)[1] } else { dims(&w)[0] };
        let tasks = rayon::current_num_threads().max(1);
        let block = n.div_ceil(tasks).div_ceil(COLUMN_ALIGN) * COLUMN_ALIGN;
        let starts: Vec<usize> = (0..n).step_by(block.max(1)).collect();
        // Each task: y_b[m × nb] = x[m × k] · w_bᵀ, w_b the rows start..start+nb of w (or,
        // transposed, the columns start..start+nb of w: rows `n` apart).
        let blocks: Vec<Vec<f32>> = starts
            .par_iter()
            .map(|&start| {
                let nb = block.min(n - start);
                let mut y = vec![0.0f32; m * nb];
                if transposed {
                    matmul(
                        m,
                        nb,
                        k,
                        &mut y,
                        nb,
                        false,
                        &xd,
                        (k, 1),
                        &wd[start..],
                        (n, 1),
                        1.0,
                    );
                } else {
                    let wb = &wd[start * k..(start + nb) * k];
                    matmul(m, nb, k, &mut y, nb, false, &xd, (k, 1), wb, (1, k), 1.0);
                }
                y
            })
            .collect();
        let mut out = Vec::with_capacity(m * n);
        for row in 0..m {
            for (b, &start) in blocks.iter().zip(&starts) {
                let nb = block.min(n - start);
                out.extend_from_slice(&b[row * nb..(row + 1) * nb]);
            }
        }
        tensor(out, &[m, n])
    }
}
