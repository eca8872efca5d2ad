//! The split inference linear layer on plain flex (over `[out, in]` weights and over weights
//! stored transposed) against `x.matmul(w.transpose())`, for
//! decode-sized row counts, output widths that do not divide into aligned blocks, strided
//! inputs, and sizes on both sides of the split thresholds; and that autodiff tensors keep
//! the differentiable reference path. The training `bf16` linear layer ([`linear_bf16`], Intel
//! AMX where the CPU has it) and its gradients against an `f64` product of the same `bf16`
//! values and against flex's own `bf16` matmul.

use burn::tensor::{DType, Device, FloatDType, Tensor};
use miles_ops::{linear, linear_bf16, linear_reference, linear_t, runs_amx};

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

fn bf16_matrix(rows: usize, cols: usize, seed: u64, device: &Device) -> Tensor<2> {
    matrix(rows, cols, seed, device).cast(FloatDType::BF16)
}

/// |a − b| ≤ one `bf16` step of `b` (2⁻⁷ relative) plus `abs` (sums that cancel), per element.
fn assert_within_bf16(what: &str, a: &[f32], b: &[f32], abs: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= y.abs() / 128.0 + abs,
            "{what} [{i}]: {x} vs {y}"
        );
    }
}

/// `Σ_k a[i, k] · b[j, k]` in `f64` (both row-major, `[m, k]` and `[n, k]`).
fn product_f64(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|kk| f64::from(a[i * k + kk]) * f64::from(b[j * k + kk]))
                .sum();
            out[i * n + j] = s as f32;
        }
    }
    out
}

#[test]
fn bf16_linear_and_its_gradients_match_the_bf16_products() {
    let device = Device::flex().autodiff();
    // Shapes crossing the 16-row / 16-column / 32-k tile edges, and a strided input.
    for (m, k, n, strided) in [
        (37, 70, 45, false),
        (16, 64, 32, false),
        (5, 300, 129, true),
    ] {
        let x = if strided {
            bf16_matrix(k, m, 7, &device).transpose()
        } else {
            bf16_matrix(m, k, 7, &device)
        }
        .require_grad();
        let w = bf16_matrix(n, k, 8, &device).require_grad();
        let dy = bf16_matrix(m, n, 9, &device);
        let amx = runs_amx(&w);
        println!(
            "bf16 linear {m}x{k} · {n}x{k}ᵀ: {}",
            if amx {
                "AMX path"
            } else {
                "no AMX: plain matmul path"
            }
        );
        let y = linear_bf16(x.clone(), w.clone());
        assert_eq!(y.dtype(), DType::BF16);
        let grads = (y.clone() * dy.clone()).sum().backward();
        let (dx, dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
        assert_eq!((dx.dtype(), dw.dtype()), (DType::BF16, DType::BF16));
        // The same bf16 values multiplied exactly (f64), then compared within a bf16 step.
        let (xv, wv, dyv) = (to_vec(x.clone()), to_vec(w.clone()), to_vec(dy.clone()));
        let transpose = |v: &[f32], r: usize, c: usize| -> Vec<f32> {
            (0..r * c).map(|i| v[(i % r) * c + i / r]).collect()
        };
        let abs = 1e-3;
        assert_within_bf16("y", &to_vec(y), &product_f64(&xv, &wv, m, n, k), abs);
        // ∂x = ∂y · w: rows of ∂y against columns of w.
        let expected_dx = product_f64(&dyv, &transpose(&wv, n, k), m, k, n);
        assert_within_bf16("dx", &to_vec(dx.clone()), &expected_dx, abs);
        // ∂w = ∂yᵀ · x.
        let expected_dw = product_f64(&transpose(&dyv, m, n), &transpose(&xv, m, k), n, k, m);
        assert_within_bf16("dw", &to_vec(dw.clone()), &expected_dw, abs);
        // And flex's own bf16 matmul path (the fallback) agrees within a bf16 step.
        let (xr, wr) = (x.detach().require_grad(), w.detach().require_grad());
        let yr = linear_reference(xr.clone(), wr.clone());
        let grads_r = (yr * dy).sum().backward();
        for (what, ours, theirs) in [
            ("dx vs plain", dx, xr.grad(&grads_r).unwrap()),
            ("dw vs plain", dw, wr.grad(&grads_r).unwrap()),
        ] {
            assert_within_bf16(what, &to_vec(ours), &to_vec(theirs), 2.0 * abs);
        }
    }
    // f32 tensors keep the plain path, bit for bit.
    let (x, w) = (matrix(3, 40, 1, &device), matrix(20, 40, 2, &device));
    assert!(!runs_amx(&w));
    assert_eq!(
        to_vec(linear_bf16(x.clone(), w.clone())),
        to_vec(linear_reference(x, w))
    );
}
