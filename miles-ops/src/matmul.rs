//! Training products whose results are written once, straight into their own buffer: the
//! linear layer `x · wᵀ` with a backward that writes `∂w` in the weight's layout
//! ([`linear_train`]), and the 2-D product the backward passes use ([`MatmulOps::dense_matmul`]).
//!
//! Why: flex 0.22's `matmul` makes its output with `FlexTensor::empty`, which allocates a
//! zeroed byte buffer and then, to align it, a second one that the zeros are copied into, on
//! the calling thread while the other cores wait. For the weight-sized gradients of a
//! training step (Qwen3-0.6B: 596 M values, a 622 MB tied vocabulary matrix among them) that
//! is two fresh buffers and a serial copy per gradient, and autodiff's
//! `x.matmul(w.transpose())` adds a third: `∂w` arrives as the transpose of `xᵀ · ∂y`, a strided view that the
//! optimizer's flattening copies. On flex in `f32`, [`MatmulOps::dense_matmul`] runs the same
//! `gemm` call flex runs (same operands, strides, parallelism and scalars, so the same bits)
//! into one `f32` buffer that the product writes once (on the threads computing it), and
//! [`linear_train`]'s backward computes `∂w = ∂yᵀ · x` in `w`'s own `[out, in]` layout. Other
//! devices and dtypes run `float_matmul`.
//!
//! A trainer can also have the next step's gradients written into this step's buffers:
//! [`keep_result_buffers`] sets how many bytes of finished results [`recycle`] may keep, and
//! [`MatmulOps::dense_matmul`] writes into a kept buffer of its result's size before it
//! allocates one (with full activation recomputation `miles_train`'s actor and critic keep up
//! to their model's size, and AdamW recycles each gradient after its update). The pages then
//! stay mapped from step to step instead of being returned to the kernel and faulted in anew
//! (on the KVM machines measured here, a GiB of fresh pages costs 0.4–1.3 s of kernel time).

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::ops::FloatTensorOps;
use burn::backend::{
    AutodiffBackend, Backend, DType, Dispatch, Flex, TensorMetadata, backend_extension,
    tensor::FloatTensor,
};
use burn::tensor::{Tensor, TensorData};

use crate::linear::linear_reference;

/// Multiply-adds from which flex runs a product on rayon's threads (its own threshold: the
/// same split, the same bits).
const FLEX_PARALLEL: usize = 192 * 192 * 192;

/// Smallest buffer [`recycle`] keeps (1 MiB of `f32`): smaller ones the allocator reuses
/// within a step anyway.
const RECYCLE_MIN: usize = 1 << 18;

/// Buffers of finished results kept for [`MatmulOps::dense_matmul`] to write into again, and
/// the bytes they may hold ([`keep_result_buffers`]; 0: none kept).
static RECYCLED: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());
static RECYCLE_LIMIT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Lets [`recycle`] keep up to `bytes` of finished results' buffers for the next products of
/// the same size (0, the default: none; a lower limit drops kept buffers down to it).
///
/// A training step's weight gradients are new buffers of the weights' sizes, freed by the
/// optimizer; by the next step's backward the allocator has returned their pages to the
/// kernel (`miles` purges freed pages after 500 ms), so every gradient is written into
/// fresh pages, each first touch a page fault (at Qwen3-0.6B 2.4 GB a step). A trainer that
/// recycles its gradients after the update (as `miles_train`'s AdamW step does) has the
/// next backward write into the same pages. The kept buffers count in the process's memory
/// between steps, at most `bytes`.
pub fn keep_result_buffers(bytes: usize) {
    RECYCLE_LIMIT.store(bytes, std::sync::atomic::Ordering::Relaxed);
    if let Ok(mut kept) = RECYCLED.lock() {
        while held(&kept) > bytes {
            kept.pop();
        }
    }
}

/// The bytes the kept buffers hold.
fn held(kept: &[Vec<f32>]) -> usize {
    kept.iter()
        .map(|v| v.capacity() * std::mem::size_of::<f32>())
        .sum()
}

/// Drops every kept buffer (the limit stays): before a phase that needs the memory more, e.g.
/// a checkpoint's host copy of the weights.
pub fn drop_result_buffers() {
    if let Ok(mut kept) = RECYCLED.lock() {
        kept.clear();
    }
}

/// The limit [`keep_result_buffers`] set last (bytes).
pub fn result_buffer_limit() -> usize {
    RECYCLE_LIMIT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Keeps `t`'s buffer for a later [`MatmulOps::dense_matmul`] of the same size, when `t` is a
/// plain (non-autodiff) `f32` flex tensor of at least 1 MiB that nothing else holds and the
/// kept buffers stay within [`keep_result_buffers`]' limit; otherwise drops it.
pub fn recycle<const D: usize>(t: Tensor<D>) {
    if let Some(flex) = crate::packed::flex_primitive(t) {
        recycle_flex(flex);
    }
}

/// [`recycle`] for a flex tensor (within the limit, else dropped).
pub(crate) fn recycle_flex(flex: FloatTensor<Flex>) {
    let limit = RECYCLE_LIMIT.load(std::sync::atomic::Ordering::Relaxed);
    let n = flex.layout().num_elements();
    if limit == 0 || n < RECYCLE_MIN || flex.dtype() != DType::F32 {
        return;
    }
    // Only a buffer that is exactly the tensor's values and was allocated as `f32`s (as
    // `dense_matmul` allocates them) converts back to a `Vec<f32>` without a copy.
    if !flex.is_unique()
        || flex.layout().contiguous_offsets() != Some((0, n))
        || flex.bytes().len() != n * 4
    {
        return;
    }
    let bytes = flex.into_data().into_bytes();
    if bytes.align() != std::mem::align_of::<f32>() {
        return;
    }
    let Ok(values) = bytes.try_into_vec::<f32>() else {
        return;
    };
    let Ok(mut kept) = RECYCLED.lock() else {
        return;
    };
    if held(&kept) + values.capacity() * std::mem::size_of::<f32>() <= limit {
        kept.push(values);
    }
}

/// A kept buffer with room for exactly `n` values (its contents are stale), if any.
fn recycled(n: usize) -> Option<Vec<f32>> {
    if n < RECYCLE_MIN {
        return None;
    }
    let mut kept = RECYCLED.lock().ok()?;
    let at = kept.iter().position(|v| v.capacity() == n)?;
    let mut values = kept.swap_remove(at);
    values.clear();
    Some(values)
}

/// `x · wᵀ` for `x` `[rows, in]` and `w` `[out, in]` (HF layout), differentiable; panics on
/// mismatched widths as `matmul` does. For `f32` autodiff tensors on flex with the fused ops
/// on it is [`MatmulOps::linear_tracked`]: the forward is `x.matmul(w.transpose())`'s own,
/// the backward writes `∂x = ∂y · w` and `∂w = ∂yᵀ · x` each once into a buffer of its own,
/// `∂w` contiguous in `w`'s layout (see the module docs); values, forward and gradients, are
/// burn's bit for bit (the same products; `∂w` is the transpose of burn's `xᵀ · ∂y`, each
/// value summed over the rows in the same order). Anything else takes
/// `x.matmul(w.transpose())` ([`linear_reference`]).
pub fn linear_train(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    let takes = x.dims()[1] == w.dims()[1]
        && x.dtype() == burn::tensor::DType::F32
        && w.dtype() == burn::tensor::DType::F32
        && (x.is_autodiff() || w.is_autodiff())
        && crate::device::is_flex(&x.device())
        && crate::device::is_flex(&w.device())
        && crate::fused_ops_enabled();
    if !takes {
        return linear_reference(x, w);
    }
    Tensor::from_dispatch(<Dispatch as MatmulOps>::linear_tracked(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

/// Backend ops of [`linear_train`] and of the fused ops' backward products.
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait MatmulOps: Backend {
    /// `lhs · rhs` for 2-D operands (either may be a strided view, e.g. a transpose), as
    /// `float_matmul` computes it; on flex for `f32` written straight into one new buffer.
    /// On autodiff backends a constant (the backward passes call it on plain tensors).
    fn dense_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `x · wᵀ` (`x` `[rows, in]`, `w` `[out, in]`); on autodiff backends its backward
    /// computes both gradients with [`MatmulOps::dense_matmul`], `∂w` as `∂yᵀ · x`.
    fn linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl MatmulOps for Flex {
    fn dense_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        match dense_matmul_f32(&lhs, &rhs) {
            Some(out) => out,
            None => Self::float_matmul(lhs, rhs),
        }
    }

    fn linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(x, Self::float_transpose(w))
    }
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
impl MatmulOps for burn_cubecl::CubeBackend {
    fn dense_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    fn linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(x, Self::float_transpose(w))
    }
}

/// A 2-D operand's storage, first element and (row, column) strides, when its strides are
/// non-negative and every element it addresses lies inside its storage.
fn operand(t: &FloatTensor<Flex>) -> Option<(&[f32], usize, usize, usize)> {
    let layout = t.layout();
    let shape = layout.shape();
    let strides = layout.strides();
    if shape.num_dims() != 2 || strides.iter().any(|s| *s < 0) {
        return None;
    }
    let (rows, cols) = (shape[0], shape[1]);
    let (rs, cs) = (strides[0] as usize, strides[1] as usize);
    let data: &[f32] = t.storage();
    let start = layout.start_offset();
    let last = if rows == 0 || cols == 0 {
        start
    } else {
        start
            .checked_add((rows - 1).checked_mul(rs)?)?
            .checked_add((cols - 1).checked_mul(cs)?)?
    };
    (last < data.len() || rows == 0 || cols == 0).then_some((data, start, rs, cs))
}

/// `lhs · rhs` for 2-D `f32` flex tensors with the `gemm` call flex's `matmul` makes, into a
/// `Vec<f32>` that becomes the result's buffer as it is (`None`: another dtype, rank or
/// a negative stride, for flex's own `matmul`).
fn dense_matmul_f32(lhs: &FloatTensor<Flex>, rhs: &FloatTensor<Flex>) -> Option<FloatTensor<Flex>> {
    if lhs.dtype() != DType::F32 || rhs.dtype() != DType::F32 {
        return None;
    }
    let (a, a0, a_rs, a_cs) = operand(lhs)?;
    let (b, b0, b_rs, b_cs) = operand(rhs)?;
    let (m, k) = (lhs.shape()[0], lhs.shape()[1]);
    let (rk, n) = (rhs.shape()[0], rhs.shape()[1]);
    assert_eq!(k, rk, "matmul: inner dimensions must match");
    if m == 0 || n == 0 || k == 0 {
        return Some(FloatTensor::<Flex>::from_data(TensorData::new(
            vec![0.0f32; m * n],
            vec![m, n],
        )));
    }
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= FLEX_PARALLEL {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // Not zeroed first: `gemm` writes every value (it does not read the destination), on the
    // threads that compute it, so a fresh buffer's pages are first touched in parallel; a
    // recycled buffer of the same size ([`recycle`]) is written again as it is.
    let mut out: Vec<f32> = recycled(m * n).unwrap_or_else(|| Vec::with_capacity(m * n));
    {
        // SAFETY: `operand` checked that every (row, column) of both operands lies inside
        // their storage; `out` has room for `m × n` values written row-major (row stride
        // `n`), aliases neither operand and is only written (`read_dst` is false).
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr().add(a0),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr().add(b0),
                b_cs as isize,
                b_rs as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
            // SAFETY: with `k > 0` and the destination not read, `gemm` has written all
            // `m × n` values.
            out.set_len(m * n);
        }
    }
    Some(FloatTensor::<Flex>::from_data(TensorData::new(
        out,
        vec![m, n],
    )))
}

#[derive(Debug)]
struct LinearBackward;

impl<B: MatmulOps> Backward<B, 2> for LinearBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        // y = x·wᵀ: ∂w = ∂yᵀ·x (in w's own [out, in] layout), ∂x = ∂y·w.
        if let Some(node) = node_w {
            let dw = B::dense_matmul(B::float_transpose(grad.clone()), x);
            grads.register::<B>(node.id, dw);
        }
        if let Some(node) = node_x {
            grads.register::<B>(node.id, B::dense_matmul(grad, w));
        }
    }
}

impl<B: Backend + MatmulOps, C: CheckpointStrategy> MatmulOps for Autodiff<B, C> {
    fn dense_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        // A constant: only called on the values of a backward pass.
        <Self as AutodiffBackend>::from_inner(B::dense_matmul(
            lhs.into_primitive(),
            rhs.into_primitive(),
        ))
    }

    fn linear_tracked(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let guards = [x.node(), w.node()];
        let (x, w) = (x.into_primitive(), w.into_primitive());
        match LinearBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = B::linear_tracked(x.clone(), w.clone());
                prep.finish((x, w), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::linear_tracked(x, w)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    use crate::packed::tests::values;

    fn host(t: Tensor<2>) -> Vec<f32> {
        crate::packed::host_f32(t).unwrap()
    }

    /// The product flex's own `matmul` returns, bit for bit, for contiguous and transposed
    /// operands, below and above the size at which it runs on rayon's threads.
    #[test]
    fn dense_matmul_returns_flex_matmul_bits() {
        let device = Device::flex();
        for (m, k, n) in [(3, 5, 4), (1, 7, 1), (64, 328, 192), (200, 96, 300)] {
            let a = Tensor::<2>::from_data(TensorData::new(values(m * k, 1), [m, k]), &device);
            let b = Tensor::<2>::from_data(TensorData::new(values(k * n, 2), [k, n]), &device);
            let at = Tensor::<2>::from_data(TensorData::new(values(k * m, 3), [k, m]), &device);
            let bt = Tensor::<2>::from_data(TensorData::new(values(n * k, 4), [n, k]), &device);
            for (lhs, rhs) in [
                (a.clone(), b.clone()),
                (at.clone().transpose(), b.clone()),
                (a.clone(), bt.clone().transpose()),
                (at.transpose(), bt.transpose()),
            ] {
                let expected = host(lhs.clone().matmul(rhs.clone()));
                let got = host(Tensor::from_dispatch(
                    <Dispatch as MatmulOps>::dense_matmul(lhs.into_dispatch(), rhs.into_dispatch()),
                ));
                assert_eq!(got.len(), m * n);
                let same = got
                    .iter()
                    .zip(&expected)
                    .all(|(g, e)| g.to_bits() == e.to_bits());
                assert!(
                    same,
                    "({m}, {k}, {n}): dense_matmul differs from flex's matmul"
                );
            }
        }
    }

    /// `y = x·wᵀ` and both gradients of `Σ y ⊙ c` against burn's own
    /// `x.matmul(w.transpose())`, bit for bit: the forward and `∂x` are the same products;
    /// `∂w = ∂yᵀ·x` is the transpose of burn's `xᵀ·∂y`, each value summed over the rows in
    /// the same order (checked up to Qwen3-0.6B's `[328, 1024] → 3072` and past `gemm`'s
    /// depth block at 700 rows) — and `∂w` against `f64` sums worked out here.
    #[test]
    fn linear_train_equals_the_plain_product_and_its_gradients() {
        let device = Device::flex().autodiff();
        for (rows, d_in, d_out) in [
            (5, 3, 4),
            (33, 64, 48),
            (328, 96, 160),
            (328, 1024, 3072),
            (700, 256, 128),
        ] {
            let xv = values(rows * d_in, 5);
            let wv = values(d_out * d_in, 6);
            let cv = values(rows * d_out, 7);
            let c = Tensor::<2>::from_data(TensorData::new(cv.clone(), [rows, d_out]), &device);
            let run = |fused: bool| {
                let x = Tensor::<2>::from_data(TensorData::new(xv.clone(), [rows, d_in]), &device)
                    .require_grad();
                let w = Tensor::<2>::from_data(TensorData::new(wv.clone(), [d_out, d_in]), &device)
                    .require_grad();
                let y = if fused {
                    linear_train(x.clone(), w.clone())
                } else {
                    linear_reference(x.clone(), w.clone())
                };
                let grads = (y.clone() * c.clone()).sum().backward();
                let dw = w.grad(&grads).unwrap();
                (
                    host(y.inner()),
                    host(x.grad(&grads).unwrap()),
                    dw.clone(),
                    host(dw),
                )
            };
            let (y, dx, dw_tensor, dw) = run(true);
            let (y_ref, dx_ref, _, dw_ref) = run(false);
            let bits =
                |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(bits(&y, &y_ref), "forward differs");
            assert!(bits(&dx, &dx_ref), "∂x differs");
            assert!(bits(&dw, &dw_ref), "∂w differs");
            // ∂w[o][i] = Σ_r c[r][o]·x[r][i] in f64 (on the smaller shapes).
            let checked = if d_out * d_in <= 1 << 15 { d_out } else { 0 };
            for o in 0..checked {
                for i in 0..d_in {
                    let exact: f64 = (0..rows)
                        .map(|r| f64::from(cv[r * d_out + o]) * f64::from(xv[r * d_in + i]))
                        .sum();
                    let got = f64::from(dw[o * d_in + i]);
                    assert!(
                        (got - exact).abs() <= 1e-4 * exact.abs().max(1.0),
                        "∂w[{o}][{i}]"
                    );
                }
            }
            // Written once in w's layout: a dense [out, in] buffer, no strided view.
            let dense = crate::packed::flex_primitive(dw_tensor)
                .is_some_and(|t| t.layout().contiguous_offsets() == Some((0, d_out * d_in)));
            assert!(dense, "∂w is not a contiguous [out, in] tensor");
        }
    }

    /// A recycled result's buffer is what the next product of its size writes into, with the
    /// same values as a fresh product; nothing is kept without a limit, or past it.
    #[test]
    fn a_recycled_buffer_is_written_again() {
        let device = Device::flex();
        // 641 × 409 values (≥ 1 MiB): a size no other test here multiplies.
        let (m, k, n) = (641, 23, 409);
        let lhs = Tensor::<2>::from_data(TensorData::new(values(m * k, 11), [m, k]), &device);
        let rhs = Tensor::<2>::from_data(TensorData::new(values(k * n, 12), [k, n]), &device);
        let product = || -> Tensor<2> {
            Tensor::from_dispatch(<Dispatch as MatmulOps>::dense_matmul(
                lhs.clone().into_dispatch(),
                rhs.clone().into_dispatch(),
            ))
        };
        let start = |t: &Tensor<2>| {
            crate::packed::flex_primitive(t.clone())
                .and_then(|f| f.as_slice::<f32>().map(|s| s.as_ptr() as usize))
        };
        let expected = host(lhs.clone().matmul(rhs.clone()));
        let kept_len = || {
            RECYCLED
                .lock()
                .unwrap()
                .iter()
                .filter(|v| v.capacity() == m * n)
                .count()
        };

        keep_result_buffers(0);
        recycle(product());
        assert_eq!(kept_len(), 0, "kept without a limit");

        keep_result_buffers(m * n * 4);
        let (first, second) = (product(), product());
        let at = start(&first).unwrap();
        // Held elsewhere too: not kept.
        let other = first.clone();
        recycle(first);
        assert_eq!(kept_len(), 0, "a shared buffer was kept");
        recycle(other);
        assert_eq!(kept_len(), 1);
        // Past the limit: not kept.
        recycle(second);
        assert_eq!(kept_len(), 1);
        let again = product();
        assert_eq!(
            start(&again),
            Some(at),
            "the kept buffer was not written again"
        );
        assert_eq!(kept_len(), 0);
        let got = host(again);
        assert!(
            got.iter()
                .zip(&expected)
                .all(|(g, e)| g.to_bits() == e.to_bits())
        );
        recycle(product());
        keep_result_buffers(0);
        assert_eq!(kept_len(), 0, "lowering the limit keeps buffers past it");
    }

    /// Without autodiff [`linear_train`] is the plain product.
    #[test]
    fn linear_train_elsewhere_is_the_plain_product() {
        let device = Device::flex();
        let x = Tensor::<2>::from_data(TensorData::new(values(12, 8), [3, 4]), &device);
        let w = Tensor::<2>::from_data(TensorData::new(values(8, 9), [2, 4]), &device);
        assert_eq!(
            host(linear_train(x.clone(), w.clone())),
            host(linear_reference(x, w))
        );
    }
}
