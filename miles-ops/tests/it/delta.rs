//! The gated delta rule op ([`gated_delta_rule`]): its native forward on flex against the
//! chunked tensor-op form ([`gated_delta_rule_reference`]) and the recurrent tensor-op form,
//! outputs and final states, over several chunks with and without an initial state; the
//! chunked form against the recurrent one; under autodiff (a tracked input) the op's
//! gradients against the recurrent form's; the CubeCL kernel against the flex op. The chunked
//! op ([`gated_delta_rule_chunked`]: native forward and backward on flex) against the
//! chunked tensor-op form (values and autodiff gradients, grouped key heads, ragged last
//! chunks) and against transformers' `torch_chunk_gated_delta_rule`
//! (`fixtures/ops/gated_delta_rule.json`), and its bitwise stability across paths; on a
//! CubeCL device (its fused scan kernels) against the flex op and the fixture.

use burn::tensor::{Device, Tensor};
use miles_ops::{
    OpsError, gated_delta_rule, gated_delta_rule_chunked, gated_delta_rule_recurrent,
    gated_delta_rule_reference, unit_lower_inverse,
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

/// Inputs of a chunked case with `key_heads` key heads (dividing `c.heads`), as [`inputs`].
#[allow(clippy::type_complexity)]
fn grouped_inputs(
    c: &DeltaCase,
    key_heads: usize,
    device: &Device,
) -> (
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Tensor<3>,
    Tensor<3>,
    Option<Tensor<4>>,
) {
    let (q, k, v, decay, beta, initial) = inputs(c, device);
    // The first `key_heads` heads of q and k serve every head.
    let q = q.narrow(1, 0, key_heads);
    let k = k.narrow(1, 0, key_heads);
    (q, k, v, decay, beta, initial)
}

/// The chunked cases: several chunks with a ragged last one, a single partial chunk, one
/// token, grouped key heads (Qwen3.5: 2 key heads for 4 value heads).
fn chunked_cases() -> Vec<(&'static str, DeltaCase, usize)> {
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
            "3 chunks (last 22), from a state",
            case(2, 3, 150, 16, 12, true),
            3,
        ),
        (
            "grouped heads 2 → 4, 2 chunks + 1",
            case(1, 4, 129, 8, 6, true),
            2,
        ),
        (
            "one partial chunk, from zeros",
            case(2, 2, 37, 8, 8, false),
            2,
        ),
        ("one token", case(1, 2, 1, 4, 4, true), 1),
    ]
}

type Grads = Vec<Vec<f32>>;

/// (outputs, final state, gradients of q, k, v, decay, β, initial) of the chunked op (or the
/// reference) under autodiff for the loss `Σ out·w + Σ state·w'`.
fn chunked_run(c: &DeltaCase, key_heads: usize, reference: bool) -> (Vec<f32>, Vec<f32>, Grads) {
    let device = Device::flex().autodiff();
    let (q, k, v, decay, beta, initial) = grouped_inputs(c, key_heads, &device);
    let initial = initial.map(Tensor::require_grad);
    let leaves = [q.require_grad(), k.require_grad(), v.require_grad()];
    let (decay, beta) = (decay.require_grad(), beta.require_grad());
    let [q, k, v] = leaves.clone();
    let (out, state) = if reference {
        gated_delta_rule_reference(q, k, v, decay.clone(), beta.clone(), initial.clone())
    } else {
        gated_delta_rule_chunked(q, k, v, decay.clone(), beta.clone(), initial.clone()).unwrap()
    };
    let dims = out.dims();
    let n: usize = dims.iter().product();
    let w = Tensor::<1>::from_floats(lcg(n, 7, 1.0).as_slice(), &device).reshape(dims);
    let sd = state.dims();
    let ws =
        Tensor::<1>::from_floats(lcg(sd.iter().product(), 8, 0.5).as_slice(), &device).reshape(sd);
    let loss = (out.clone() * w).sum() + (state.clone() * ws).sum();
    let grads = loss.backward();
    let mut g: Grads = leaves
        .iter()
        .map(|x| to_vec(x.grad(&grads).unwrap()))
        .collect();
    g.push(to_vec(decay.grad(&grads).unwrap()));
    g.push(to_vec(beta.grad(&grads).unwrap()));
    if let Some(i) = &initial {
        g.push(to_vec(i.grad(&grads).unwrap()));
    }
    (to_vec(out), to_vec(state), g)
}

/// The chunked op (native flex loops, custom backward) against the chunked tensor-op form
/// under autodiff: values within 1e-5, every gradient within 1e-4 of the largest.
#[test]
fn chunked_op_matches_the_reference_values_and_gradients() {
    for (what, c, hk) in chunked_cases() {
        let (out, state, grads) = chunked_run(&c, hk, false);
        let (want_out, want_state, want_grads) = chunked_run(&c, hk, true);
        assert_rel_close(&format!("{what}: out"), &out, &want_out, 1e-5);
        assert_rel_close(&format!("{what}: state"), &state, &want_state, 1e-5);
        let names = ["dq", "dk", "dv", "ddecay", "dbeta", "dinitial"];
        assert_eq!(grads.len(), want_grads.len());
        for ((name, g), w) in names.iter().zip(&grads).zip(&want_grads) {
            assert_rel_close(&format!("{what}: {name}"), g, w, 1e-4);
        }
    }
}

/// The op's outputs are the same bits with and without a tracked input, and a row's are the
/// same bits alone and batched with others: what keeps training, scoring, prefill and a
/// recomputed layer equal.
#[test]
fn chunked_op_is_bitwise_stable_across_paths_and_batches() {
    let c = DeltaCase {
        batch: 2,
        heads: 4,
        tokens: 100,
        key_dim: 8,
        value_dim: 8,
        initial: true,
    };
    let plain = Device::flex();
    let ad = Device::flex().autodiff();
    let run = |device: &Device, tracked: bool, rows: usize| {
        let (q, k, v, decay, beta, initial) = grouped_inputs(&c, 2, device);
        let row = |x: Tensor<4>| x.narrow(0, 0, rows);
        let (q, k, v) = (row(q), row(k), row(v));
        let (decay, beta) = (decay.narrow(0, 0, rows), beta.narrow(0, 0, rows));
        let initial = initial.map(row);
        let q = if tracked { q.require_grad() } else { q };
        let (out, state) = gated_delta_rule_chunked(q, k, v, decay, beta, initial).unwrap();
        (to_vec(out.narrow(0, 0, 1)), to_vec(state.narrow(0, 0, 1)))
    };
    let base = run(&plain, false, 2);
    assert_eq!(base, run(&ad, true, 2), "tracked vs plain");
    assert_eq!(base, run(&ad, false, 2), "autodiff device, untracked");
    assert_eq!(base, run(&plain, false, 1), "row alone vs batched");
}

/// One flat `f32` array of the fixture.
fn fixture_values(doc: &serde_json::Value, path: &[&str]) -> Vec<f32> {
    let mut x = doc;
    for p in path {
        x = &x[*p];
    }
    x.as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

/// The chunked op (and the reference) against transformers 5.24's
/// `torch_chunk_gated_delta_rule` (`fixtures/ops/gated_delta_rule.json`: 130 tokens, 2 key
/// heads for 4 value heads, from a state): outputs, final state and torch autograd's
/// gradients of every input.
#[test]
fn chunked_op_matches_transformers() {
    transformers_check(&Device::flex(), &[false, true]);
}

/// The fixture's check on `device` (under autodiff), for the op (`false`) and the reference
/// (`true`) as `paths` lists.
fn transformers_check(device: &Device, paths: &[bool]) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/ops/gated_delta_rule.json"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let size = |n: &str| doc["sizes"][n].as_u64().unwrap() as usize;
    let (t, hk, h, dk, dv) = (
        size("tokens"),
        size("key_heads"),
        size("heads"),
        size("key_dim"),
        size("value_dim"),
    );
    let device = device.clone().autodiff();
    let load = |name: &str, shape: [usize; 4]| {
        Tensor::<1>::from_floats(fixture_values(&doc, &["inputs", name]).as_slice(), &device)
            .reshape(shape)
    };
    let per_head = |x: Tensor<4>| x.swap_dims(1, 2);
    let per_token = |x: Tensor<4>| x.reshape([1, t, h]).swap_dims(1, 2);
    let w_out = Tensor::<1>::from_floats(fixture_values(&doc, &["w_out"]).as_slice(), &device)
        .reshape([1, t, h, dv]);
    let w_state = Tensor::<1>::from_floats(fixture_values(&doc, &["w_state"]).as_slice(), &device)
        .reshape([1, h, dk, dv]);
    for &reference in paths {
        // transformers' layouts: [batch, tokens, heads, dim] and [batch, tokens, heads].
        let q = load("q", [1, t, hk, dk]).require_grad();
        let k = load("k", [1, t, hk, dk]).require_grad();
        let v = load("v", [1, t, h, dv]).require_grad();
        let g = load("g", [1, t, h, 1]).require_grad();
        let beta = load("beta", [1, t, h, 1]).require_grad();
        let initial = load("initial", [1, h, dk, dv]).require_grad();
        let args = (
            per_head(q.clone()) * (dk as f64).powf(-0.5),
            per_head(k.clone()),
            per_head(v.clone()),
            per_token(g.clone()),
            per_token(beta.clone()),
            Some(initial.clone()),
        );
        let (out, state) = if reference {
            let (q, k, v, d, b, i) = args;
            gated_delta_rule_reference(q, k, v, d, b, i)
        } else {
            let (q, k, v, d, b, i) = args;
            gated_delta_rule_chunked(q, k, v, d, b, i).unwrap()
        };
        let out = out.swap_dims(1, 2);
        let what = if reference { "reference" } else { "op" };
        let want = |name: &str| fixture_values(&doc, &[name]);
        assert_rel_close(
            &format!("{what}: out"),
            &to_vec(out.clone()),
            &want("out"),
            1e-5,
        );
        assert_rel_close(
            &format!("{what}: state"),
            &to_vec(state.clone()),
            &want("state"),
            1e-5,
        );
        let loss = (out * w_out.clone()).sum() + (state * w_state.clone()).sum();
        let grads = loss.backward();
        let got = [
            ("q", q.grad(&grads).unwrap()),
            ("k", k.grad(&grads).unwrap()),
            ("v", v.grad(&grads).unwrap()),
            ("g", g.grad(&grads).unwrap()),
            ("beta", beta.grad(&grads).unwrap()),
            ("initial", initial.grad(&grads).unwrap()),
        ];
        for (name, grad) in got {
            let want = fixture_values(&doc, &["grads", name]);
            assert_rel_close(&format!("{what}: d{name}"), &to_vec(grad), &want, 1e-4);
        }
    }
}

/// (outputs, final state, gradients) of the chunked op under autodiff on `device`, for the
/// loss of [`chunked_run`].
fn chunked_on(c: &DeltaCase, key_heads: usize, device: &Device) -> Vec<Vec<f32>> {
    let device = device.clone().autodiff();
    let (q, k, v, decay, beta, initial) = grouped_inputs(c, key_heads, &device);
    let initial = initial.map(Tensor::require_grad);
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let (decay, beta) = (decay.require_grad(), beta.require_grad());
    let (out, state) = gated_delta_rule_chunked(
        q.clone(),
        k.clone(),
        v.clone(),
        decay.clone(),
        beta.clone(),
        initial.clone(),
    )
    .unwrap();
    let dims = out.dims();
    let w = Tensor::<1>::from_floats(lcg(dims.iter().product(), 7, 1.0).as_slice(), &device)
        .reshape(dims);
    let sd = state.dims();
    let ws =
        Tensor::<1>::from_floats(lcg(sd.iter().product(), 8, 0.5).as_slice(), &device).reshape(sd);
    let loss = (out.clone() * w).sum() + (state.clone() * ws).sum();
    let grads = loss.backward();
    let mut all = vec![to_vec(out), to_vec(state)];
    for x in [q, k, v] {
        all.push(to_vec(x.grad(&grads).unwrap()));
    }
    all.push(to_vec(decay.grad(&grads).unwrap()));
    all.push(to_vec(beta.grad(&grads).unwrap()));
    if let Some(i) = initial {
        all.push(to_vec(i.grad(&grads).unwrap()));
    }
    all
}

/// The chunked op on a CubeCL device (the fused scan kernels of `src/kernels/chunked.rs`
/// between batched CubeCL tensor ops) against the flex op: outputs, final states and every
/// gradient within 1e-4, over three chunks (the last ragged) with two key heads for four
/// value heads from a state, and over value columns spread on two cubes (70 > 64) from
/// zeros; then against transformers' fixture.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
#[test]
fn chunked_delta_on_cubecl_matches_flex() {
    let Some(dev) = miles_ops::kernels::kernel_test_device("chunked_delta_on_cubecl_matches_flex")
    else {
        return;
    };
    let case = |batch, heads, tokens, key_dim, value_dim, initial| DeltaCase {
        batch,
        heads,
        tokens,
        key_dim,
        value_dim,
        initial,
    };
    let names = [
        "out", "state", "dq", "dk", "dv", "ddecay", "dbeta", "dinitial",
    ];
    for (what, c, hk) in [
        ("3 chunks, 2 → 4 heads", case(2, 4, 150, 16, 8, true), 2),
        ("70 value columns", case(1, 2, 66, 4, 70, false), 1),
    ] {
        let (cube, flex) = (
            chunked_on(&c, hk, &dev),
            chunked_on(&c, hk, &Device::flex()),
        );
        assert_eq!(cube.len(), flex.len());
        for ((name, a), b) in names.iter().zip(&cube).zip(&flex) {
            assert_rel_close(&format!("{what}: {name}"), a, b, 1e-4);
        }
    }
    transformers_check(&dev, &[false]);
}
