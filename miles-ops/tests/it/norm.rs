//! The fused RMSNorm and RoPE ops on flex against their tensor-op forms: values and
//! gradients (w.r.t. the input and the norm's weight), on contiguous and strided inputs,
//! full and partial rotary dims, and the shape errors.

use burn::tensor::{Device, Int, Tensor};
use miles_ops::OpsError;
use miles_ops::{rms_norm, rms_norm_reference, rope, rope_reference};

use crate::common::{assert_rel_close, lcg, to_vec};

/// `[b, h, s, d]` input built as `[b, s, h, d]` and swapped when `strided` (as attention
/// heads are).
fn input(shape: [usize; 4], seed: u64, strided: bool, device: &Device) -> Tensor<4> {
    let [b, h, s, d] = shape;
    let data = Tensor::<1>::from_floats(lcg(b * h * s * d, seed, 2.0).as_slice(), device);
    if strided {
        data.reshape([b, s, h, d]).require_grad()
    } else {
        data.reshape([b, h, s, d]).require_grad()
    }
}

fn view(t: &Tensor<4>, strided: bool) -> Tensor<4> {
    if strided {
        t.clone().swap_dims(1, 2)
    } else {
        t.clone()
    }
}

fn norm_case(fused: bool, strided: bool) -> [Vec<f32>; 3] {
    let device = Device::flex().autodiff();
    let shape = [2, 3, 17, 40];
    let x = input(shape, 1, strided, &device);
    let w = Tensor::<1>::from_floats(lcg(40, 2, 1.0).as_slice(), &device).require_grad();
    let y = if fused {
        rms_norm(view(&x, strided), w.clone(), 1e-6).unwrap()
    } else {
        rms_norm_reference(view(&x, strided), w.clone(), 1e-6)
    };
    let c =
        Tensor::<1>::from_floats(lcg(2 * 3 * 17 * 40, 3, 1.0).as_slice(), &device).reshape(shape);
    let grads = (y.clone() * c).sum().backward();
    [
        to_vec(y.detach()),
        to_vec(x.grad(&grads).unwrap()),
        to_vec(w.grad(&grads).unwrap()),
    ]
}

#[test]
fn fused_rms_norm_matches_tensor_ops() {
    for strided in [false, true] {
        let (f, r) = (norm_case(true, strided), norm_case(false, strided));
        for (i, what) in ["y", "dx", "dw"].iter().enumerate() {
            assert_rel_close(what, &f[i], &r[i], 1e-5);
        }
    }
}

fn rope_case(fused: bool, strided: bool, rot: usize) -> [Vec<f32>; 2] {
    let device = Device::flex().autodiff();
    let (b, h, s, d) = (2, 3, 11, 16);
    let x = input([b, h, s, d], 4, strided, &device);
    // Tables as a model builds them: per-token positions (packed: the second sequence
    // restarts), angles duplicated over the two halves.
    let positions: Vec<i64> = (0..b * s).map(|i| ((i % s) % 7) as i64).collect();
    let pos = Tensor::<1, Int>::from_ints(positions.as_slice(), &device)
        .float()
        .reshape([b, s, 1]);
    let inv: Vec<f32> = (0..rot / 2)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rot as f32))
        .collect();
    let inv = Tensor::<1>::from_floats(inv.as_slice(), &device).reshape([1, 1, rot / 2]);
    let freqs = pos * inv;
    let emb = Tensor::cat(vec![freqs.clone(), freqs], 2);
    let (cos, sin) = (emb.clone().cos(), emb.sin());
    let y = if fused {
        rope(view(&x, strided), cos, sin).unwrap()
    } else {
        rope_reference(view(&x, strided), cos, sin)
    };
    let c = Tensor::<1>::from_floats(lcg(b * h * s * d, 5, 1.0).as_slice(), &device)
        .reshape([b, h, s, d]);
    let grads = (y.clone() * c).sum().backward();
    [to_vec(y.detach()), to_vec(x.grad(&grads).unwrap())]
}

#[test]
fn fused_rope_matches_tensor_ops_full_and_partial() {
    for rot in [16, 8] {
        for strided in [false, true] {
            let (f, r) = (
                rope_case(true, strided, rot),
                rope_case(false, strided, rot),
            );
            assert_rel_close("y", &f[0], &r[0], 1e-6);
            assert_rel_close("dx", &f[1], &r[1], 1e-6);
        }
    }
}

#[test]
fn bad_shapes_are_typed_errors() {
    let device = Device::flex();
    let x = Tensor::<4>::zeros([1, 2, 3, 8], &device);
    let err = rms_norm(x.clone(), Tensor::<1>::ones([7], &device), 1e-6).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "rms_norm weight",
            ..
        }
    ));
    let odd = Tensor::<3>::zeros([1, 3, 3], &device);
    let err = rope(x.clone(), odd.clone(), odd).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "rope tables",
            ..
        }
    ));
    let long = Tensor::<3>::zeros([1, 3, 10], &device);
    assert!(rope(x, long.clone(), long).is_err());
}
