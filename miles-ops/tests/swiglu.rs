//! The fused SwiGLU gate on flex against `silu(gate) * up` with tensor ops: values and both
//! gradients, on contiguous and strided (transposed) inputs, and the shape error.

use burn::tensor::{Device, Tensor};
use miles_ops::OpsError;
use miles_ops::swiglu::{swiglu, swiglu_reference};

fn lcg(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

fn run(fused: bool, transposed: bool) -> [Vec<f32>; 3] {
    let device = Device::flex().autodiff();
    let (rows, cols) = (37, 1000);
    // Values up to ±12 reach both tails of the sigmoid.
    let make = |seed| {
        let data = Tensor::<1>::from_floats(lcg(rows * cols, seed, 12.0).as_slice(), &device);
        if transposed {
            data.reshape([cols, rows]).require_grad()
        } else {
            data.reshape([rows, cols]).require_grad()
        }
    };
    let (g0, u0) = (make(1), make(2));
    let view = |t: &Tensor<2>| {
        if transposed {
            t.clone().transpose()
        } else {
            t.clone()
        }
    };
    let out = if fused {
        swiglu(view(&g0), view(&u0)).unwrap()
    } else {
        swiglu_reference(view(&g0), view(&u0))
    };
    let w = Tensor::<1>::from_floats(lcg(rows * cols, 3, 1.0).as_slice(), &device)
        .reshape([rows, cols]);
    let grads = (out.clone() * w).sum().backward();
    [
        to_vec(out.detach()),
        to_vec(g0.grad(&grads).unwrap()),
        to_vec(u0.grad(&grads).unwrap()),
    ]
}

#[test]
fn fused_swiglu_matches_the_tensor_op_form() {
    for transposed in [false, true] {
        let (fused, reference) = (run(true, transposed), run(false, transposed));
        for (i, what) in ["out", "d_gate", "d_up"].iter().enumerate() {
            let scale = reference[i].iter().fold(0f32, |m, x| m.max(x.abs()));
            let err = fused[i]
                .iter()
                .zip(&reference[i])
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                err <= 1e-6 * scale,
                "{what} (transposed {transposed}): {err} vs scale {scale}"
            );
        }
    }
}

#[test]
fn mismatched_shapes_are_a_typed_error() {
    let device = Device::flex();
    let err = swiglu(
        Tensor::<2>::zeros([2, 3], &device),
        Tensor::<2>::zeros([3, 2], &device),
    )
    .unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "swiglu up",
            ..
        }
    ));
}
