//! The kernel test device runs the ops our kernels build on (matmul, reductions, log-softmax,
//! autodiff) with the same results as flex. This is the environment check every CubeCL kernel
//! test relies on; it fails under `MILES_REQUIRE_KERNEL_TESTS=1` when no adapter exists.
#![cfg(feature = "wgpu")]

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Tensor, TensorData, Tolerance};
use miles_ops::kernels::kernel_test_device;

fn inputs() -> (Vec<f32>, Vec<f32>) {
    // Deterministic, non-trivial values (no RNG: flex and wgpu must see the same numbers).
    let a = (0..6 * 5)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let b = (0..5 * 7)
        .map(|i| ((i * 53 % 29) as f32 - 14.0) / 9.0)
        .collect();
    (a, b)
}

/// log_softmax(a @ b) summed with weights, and its gradient with respect to `a`.
fn case(device: &Device) -> (TensorData, TensorData, TensorData) {
    let (a, b) = inputs();
    let device = device.clone().autodiff();
    let a = Tensor::<2>::from_data(TensorData::new(a, [6, 5]), &device).require_grad();
    let b = Tensor::<2>::from_data(TensorData::new(b, [5, 7]), &device);
    let logits = a.clone().matmul(b);
    let logp = log_softmax(logits, 1);
    let weights = Tensor::<2>::from_data(
        TensorData::new(
            (0..42).map(|i| (i % 5) as f32 - 2.0).collect::<Vec<_>>(),
            [6, 7],
        ),
        &device,
    );
    let row_sums = logp.clone().sum_dim(1);
    let loss = (logp.clone() * weights).sum();
    let grads = loss.backward();
    let grad = a.grad(&grads).expect("a requires grad");
    (
        logp.inner().into_data(),
        row_sums.inner().into_data(),
        grad.into_data(),
    )
}

#[test]
fn kernel_device_matches_flex() {
    let Some(device) = kernel_test_device("kernel_device_matches_flex") else {
        return;
    };
    let (logp_ref, sums_ref, grad_ref) = case(&Device::flex());
    let (logp, sums, grad) = case(&device);
    let tolerance = Tolerance::<f32>::absolute(1e-4);
    logp.assert_approx_eq::<f32>(&logp_ref, tolerance);
    sums.assert_approx_eq::<f32>(&sums_ref, tolerance);
    grad.assert_approx_eq::<f32>(&grad_ref, tolerance);
    // log-softmax rows are log-probabilities: logsumexp of each row is 0.
    let row_max_abs = logp_ref
        .try_to_vec::<f32>()
        .unwrap()
        .chunks(7)
        .map(|row| row.iter().map(|v| v.exp()).sum::<f32>().ln().abs())
        .fold(0.0f32, f32::max);
    assert!(row_max_abs < 1e-5, "rows do not normalise: {row_max_abs}");
}
