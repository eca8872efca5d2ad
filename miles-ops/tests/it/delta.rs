//! The gated delta rule op ([`gated_delta_rule`]): its native forward on flex against the
//! chunked tensor-op form ([`gated_delta_rule_reference`]) and the recurrent tensor-op form,
//! outputs and final states, over several chunks with and without an initial state; the
//! chunked form against the recurrent one; under autodiff (a tracked input) the op's
//! gradients against the recurrent form's; the CubeCL kernel against the flex op.

use burn::tensor::{Device, Tensor};
use miles_ops::{
    OpsError, gated_delta_rule, gated_delta_rule_recurrent, gated_delta_rule_reference,
    unit_lower_inverse,
};

use crate::common::{assert_rel_close, lcg, to_vec};

/// Sizes of one case: batch, heads, tokens, key dim, value dim.
#[derive(Clone, Copy)]
pub(crate) struct DeltaCase {
    pub batch: usize,
    pub heads: usize,
    pub tokens: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub initial: bool,
}

/// The inputs of a case on `device`: L2-normalised q (scaled by `key_dim^-1/2`) and k, as
/// the model makes them, decays in `[-0.5, 0]`, β in `[0, 1]`.
#[allow(clippy::type_complexity)]
pub(crate) fn inputs(
    c: &DeltaCase,
    device: &Device,
) -> (
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Tensor<3>,
    Tensor<3>,
    Option<Tensor<4>>,
) {
    let (b, h, t, dk, dv) = (c.batch, c.heads, c.tokens, c.key_dim, c.value_dim);
    let t4 = |shape: [usize; 4], seed: u64, scale: f32| {
        let n = shape.iter().product();
        Tensor::<1>::from_floats(lcg(n, seed, scale).as_slice(), device).reshape(shape)
    };
    let t3 = |seed: u64, lo: f32, hi: f32| {
        let data: Vec<f32> = lcg(b * h * t, seed, 1.0)
            .iter()
            .map(|x| lo + (x + 1.0) / 2.0 * (hi - lo))
            .collect();
        Tensor::<1>::from_floats(data.as_slice(), device).reshape([b, h, t])
    };
    let unit = |x: Tensor<4>| x.clone() / x.square().sum_dim(3).sqrt();
    let q = unit(t4([b, h, t, dk], 1, 1.0)) * (dk as f64).powf(-0.5);
    let k = unit(t4([b, h, t, dk], 2, 1.0));
    let v = t4([b, h, t, dv], 3, 1.5);
    let decay = t3(4, -0.5, 0.0);
    let beta = t3(5, 0.0, 1.0);
    let initial = c.initial.then(|| t4([b, h, dk, dv], 6, 0.3));
    (q, k, v, decay, beta, initial)
}

pub(crate) fn cases() -> Vec<(&'static str, DeltaCase)> {
    let case = |batch, heads, tokens, key_dim, value_dim, initial| DeltaCase {
        batch,
        heads,
        tokens,
        key_dim,
        value_dim,
        initial,
    };
    vec![
        (
            "3 chunks, from a state, 3 column blocks",
            case(2, 3, 150, 16, 70, true),
        ),
        (
            "one partial chunk, from zeros",
            case(1, 2, 37, 32, 32, false),
        ),
        ("decode step", case(3, 2, 1, 64, 16, true)),
    ]
}

/// (outputs, final state) of the op on `device`.
pub(crate) fn run_op(c: &DeltaCase, device: &Device) -> [Vec<f32>; 2] {
    let (q, k, v, decay, beta, initial) = inputs(c, device);
    let (out, state) = gated_delta_rule(q, k, v, decay, beta, initial).unwrap();
    [to_vec(out), to_vec(state)]
}

#[test]
fn native_forward_matches_the_chunked_and_recurrent_forms() {
    let device = Device::flex();
    for (what, c) in cases() {
        let op = run_op(&c, &device);
        let (q, k, v, decay, beta, initial) = inputs(&c, &device);
        let (q2, k2, v2, d2, b2, i2) = inputs(&c, &device);
        let (oc, sc) = gated_delta_rule_reference(q, k, v, decay, beta, initial);
        let (or, sr) = gated_delta_rule_recurrent(q2, k2, v2, d2, b2, i2);
        let (oc, sc, or, sr) = (to_vec(oc), to_vec(sc), to_vec(or), to_vec(sr));
        assert_rel_close(&format!("{what}: out vs chunked"), &op[0], &oc, 1e-5);
        assert_rel_close(&format!("{what}: state vs chunked"), &op[1], &sc, 1e-5);
        assert_rel_close(&format!("{what}: out vs recurrent"), &op[0], &or, 1e-5);
        assert_rel_close(&format!("{what}: state vs recurrent"), &op[1], &sr, 1e-5);
    }
}

/// Under autodiff with tracked inputs the op is the chunked tensor-op form: its gradients
/// (q, k, v, decay, β, initial state) against the recurrent form's.
#[test]
fn gradients_under_autodiff_match_the_recurrent_form() {
    let device = Device::flex().autodiff();
    let c = DeltaCase {
        batch: 1,
        heads: 2,
        tokens: 80,
        key_dim: 8,
        value_dim: 6,
        initial: true,
    };
    let run = |chunked: bool| {
        let (q, k, v, decay, beta, initial) = inputs(&c, &device);
        let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
        let (decay, beta) = (decay.require_grad(), beta.require_grad());
        let initial = initial.unwrap().require_grad();
        let args = (
            q.clone(),
            k.clone(),
            v.clone(),
            decay.clone(),
            beta.clone(),
            Some(initial.clone()),
        );
        let (out, state) = if chunked {
            gated_delta_rule(args.0, args.1, args.2, args.3, args.4, args.5).unwrap()
        } else {
            gated_delta_rule_recurrent(args.0, args.1, args.2, args.3, args.4, args.5)
        };
        let w = Tensor::<1>::from_floats(lcg(80 * 2 * 6, 7, 1.0).as_slice(), &device)
            .reshape([1, 2, 80, 6]);
        let loss = (out * w).sum() + state.sum() * 0.5;
        let grads = loss.backward();
        vec![
            to_vec(q.grad(&grads).unwrap()),
            to_vec(k.grad(&grads).unwrap()),
            to_vec(v.grad(&grads).unwrap()),
            to_vec(decay.grad(&grads).unwrap()),
            to_vec(beta.grad(&grads).unwrap()),
            to_vec(initial.grad(&grads).unwrap()),
        ]
    };
    let (op, recurrent) = (run(true), run(false));
    for (i, what) in ["dq", "dk", "dv", "ddecay", "dbeta", "dinitial"]
        .iter()
        .enumerate()
    {
        assert_rel_close(what, &op[i], &recurrent[i], 1e-4);
    }
}

#[test]
fn block_inverse_inverts_unit_lower_triangular_matrices() {
    let device = Device::flex();
    let c = 8;
    let values: Vec<f32> = lcg(2 * c * c, 11, 0.5)
        .iter()
        .enumerate()
        .map(|(i, &x)| if (i % c) < (i / c) % c { x } else { 0.0 })
        .collect();
    let l = Tensor::<1>::from_floats(values.as_slice(), &device).reshape([2, c, c]);
    let eye_values: Vec<f32> = (0..2 * c * c)
        .map(|i| f32::from(u8::from(i % c == (i / c) % c)))
        .collect();
    let eye = Tensor::<1>::from_floats(eye_values.as_slice(), &device).reshape([2, c, c]);
    let product = (eye.clone() + l.clone()).matmul(unit_lower_inverse(l));
    assert_rel_close("(I + L)(I + L)⁻¹", &to_vec(product), &to_vec(eye), 1e-5);
}

#[test]
fn shapes_are_checked() {
    let device = Device::flex();
    let c = DeltaCase {
        batch: 1,
        heads: 2,
        tokens: 5,
        key_dim: 4,
        value_dim: 3,
        initial: false,
    };
    let (q, k, v, decay, beta, _) = inputs(&c, &device);
    let bad = Tensor::<4>::zeros([1, 2, 3, 4], &device);
    let err = gated_delta_rule(q, k, v, decay, beta, Some(bad)).unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "delta rule state",
            ..
        }
    ));
}

/// The CubeCL kernel against the flex op: outputs and final states.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn delta_kernel_matches_flex() {
    let Some(dev) = miles_ops::kernels::kernel_test_device("delta_kernel_matches_flex") else {
        return;
    };
    for (what, c) in cases() {
        let (kernel, flex) = (run_op(&c, &dev), run_op(&c, &Device::flex()));
        assert_rel_close(&format!("{what}: out"), &kernel[0], &flex[0], 2e-5);
        assert_rel_close(&format!("{what}: state"), &kernel[1], &flex[1], 2e-5);
    }
}
