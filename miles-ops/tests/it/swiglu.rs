//! The fused SwiGLU gate on flex against `silu(gate) * up` with tensor ops: values and both
//! gradients, on contiguous and strided (transposed) inputs, and the shape error.

use burn::tensor::{Device, Tensor};
use miles_ops::OpsError;
use miles_ops::{swiglu, swiglu_reference};

use crate::common::{assert_rel_close, lcg, to_vec};

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
            assert_rel_close(what, &fused[i], &reference[i], 1e-6);
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
