//! The split inference linear layer on plain flex (over `[out, in]` weights and over weights
//! stored transposed) against `x.matmul(w.transpose())`, for
//! decode-sized row counts, output widths that do not divide into aligned blocks, strided
//! inputs, and sizes on both sides of the split thresholds; and that autodiff tensors keep
//! the differentiable reference path.

use burn::tensor::{Device, Tensor};
use miles_ops::{linear, linear_reference, linear_t};

use crate::common::{assert_rel_close, lcg, to_vec};

fn matrix(rows: usize, cols: usize, seed: u64, device: &Device) -> Tensor<2> {
    Tensor::<1>::from_floats(lcg(rows * cols, seed, 1.0).as_slice(), device).reshape([rows, cols])
}

#[test]
fn split_linear_equals_the_matmul_reference() {
    let device = Device::flex();
    for (m, k, n) in [
        (1, 384, 640),
        (1, 512, 1030),
        (3, 64, 100),
        (32, 384, 384),
        (32, 256, 512),
        (7, 96, 33),
        (1, 8, 8),
        (64, 512, 1024),
        // Above flex's own parallel threshold: split at decode row counts (lm_head-sized,
        // unaligned widths), flex's matmul for more rows.
        (32, 512, 32000),
        (17, 384, 4100),
        (65, 256, 640),
    ] {
        let x = matrix(m, k, 1, &device);
        let w = matrix(n, k, 2, &device);
        let ours = to_vec(linear(x.clone(), w.clone()));
        // The same weight stored transposed, `[in, out]` contiguous.
        let wt = Tensor::<2>::from_data(w.clone().transpose().into_data(), &device);
        let ours_t = to_vec(linear_t(x.clone(), wt));
        let reference = to_vec(linear_reference(x, w));
        assert_rel_close(&format!("{m}x{k} · {n}x{k}ᵀ"), &ours, &reference, 1e-5);
        assert_rel_close(&format!("{m}x{k} · ({k}x{n})"), &ours_t, &reference, 1e-5);
    }
    // A strided input (a transposed view) is read correctly.
    let x = matrix(384, 4, 3, &device).transpose();
    let w = matrix(640, 384, 4, &device);
    assert_rel_close(
        "strided x",
        &to_vec(linear(x.clone(), w.clone())),
        &to_vec(linear_reference(x, w)),
        1e-5,
    );
}

#[test]
fn autodiff_tensors_get_gradients_through_the_reference_path() {
    let device = Device::flex().autodiff();
    let x = matrix(2, 384, 5, &device).require_grad();
    let w = matrix(640, 384, 6, &device).require_grad();
    let grads = linear(x.clone(), w.clone()).sum().backward();
    let gx = to_vec(x.grad(&grads).expect("x gradient"));
    // ∂ Σ (x wᵀ) / ∂x = 1 · w: every row of ∂x is the column sums of w.
    let col_sums = to_vec(matrix(640, 384, 6, &Device::flex()).sum_dim(0));
    assert_rel_close("dx row 0", &gx[..384], &col_sums, 1e-5);
    assert!(w.grad(&grads).is_some());
}
