//! The fused chunked log-prob/entropy op against the plain `lm_head → log_softmax → gather`
//! path: values and gradients (w.r.t. hidden states and `lm_head`) within 1e-5 relative.

use burn::tensor::{Device, Int, Tensor};
use miles_ops::OpsError;
use miles_ops::fused::FusedLogProbConfig;
use miles_ops::logprobs::log_probs_and_entropy_plain;

use crate::common::{assert_rel_close, lcg, to_vec};

struct Case {
    tokens: usize,
    hidden: usize,
    vocab: usize,
    h: Vec<f32>,
    w: Vec<f32>,
    targets: Vec<i64>,
    c_lp: Vec<f32>,
    c_ent: Vec<f32>,
}

fn case(tokens: usize, hidden: usize, vocab: usize, seed: u64) -> Case {
    let targets = lcg(tokens, seed + 3, 1.0)
        .iter()
        .map(|x| (((x + 1.0) / 2.0 * vocab as f32) as i64).clamp(0, vocab as i64 - 1))
        .collect();
    Case {
        tokens,
        hidden,
        vocab,
        h: lcg(tokens * hidden, seed, 1.0),
        w: lcg(vocab * hidden, seed + 1, 0.5),
        targets,
        c_lp: lcg(tokens, seed + 4, 1.0),
        c_ent: lcg(tokens, seed + 5, 1.0),
    }
}

/// Returns (log_probs, entropy, ∂hidden, ∂lm_head) of `Σ c_lp·logp + Σ c_ent·H`.
fn run(c: &Case, fused: Option<FusedLogProbConfig>) -> [Vec<f32>; 4] {
    let device = Device::flex().autodiff();
    let h = Tensor::<1>::from_floats(c.h.as_slice(), &device)
        .reshape([c.tokens, c.hidden])
        .require_grad();
    let w = Tensor::<1>::from_floats(c.w.as_slice(), &device)
        .reshape([c.vocab, c.hidden])
        .require_grad();
    let y = Tensor::<1, Int>::from_ints(c.targets.as_slice(), &device);
    let (lp, ent) = match fused {
        Some(cfg) => cfg.forward(h.clone(), w.clone(), y).unwrap(),
        None => log_probs_and_entropy_plain(h.clone(), w.clone(), y),
    };
    let c_lp = Tensor::<1>::from_floats(c.c_lp.as_slice(), &device);
    let c_ent = Tensor::<1>::from_floats(c.c_ent.as_slice(), &device);
    let objective = (lp.clone() * c_lp).sum() + (ent.clone() * c_ent).sum();
    let grads = objective.backward();
    [
        to_vec(lp.detach()),
        to_vec(ent.detach()),
        to_vec(h.grad(&grads).unwrap()),
        to_vec(w.grad(&grads).unwrap()),
    ]
}

/// Both backward modes: reusing the forward's logit chunks (the default budget holds these
/// small cases) and recomputing them (budget 0).
fn compare(c: &Case, cfg: FusedLogProbConfig) {
    let plain = run(c, None);
    for cfg in [cfg, cfg.with_keep_logits_bytes(0)] {
        let fused = run(c, Some(cfg));
        for (i, what) in ["log_probs", "entropy", "d_hidden", "d_lm_head"]
            .iter()
            .enumerate()
        {
            assert_rel_close(what, &fused[i], &plain[i], 1e-5);
        }
    }
}

#[test]
fn fused_matches_plain_with_ragged_chunks() {
    // 37 tokens in chunks of 8, 101 vocab rows in chunks of 24: both have ragged tails.
    compare(&case(37, 16, 101, 7), FusedLogProbConfig::new(8, 24));
}

#[test]
fn fused_matches_plain_with_single_chunk_and_tiny_chunks() {
    let c = case(9, 8, 33, 11);
    compare(&c, FusedLogProbConfig::new(64, 4096));
    compare(&c, FusedLogProbConfig::new(1, 1));
}

#[test]
fn fused_matches_plain_on_peaked_logits() {
    // Large logits (scale 8 hidden) stress the online log-sum-exp rescaling.
    let mut c = case(21, 12, 257, 5);
    c.h.iter_mut().for_each(|x| *x *= 8.0);
    compare(&c, FusedLogProbConfig::new(5, 64));
}

#[test]
fn fused_hand_computed_values() {
    // hidden = [1, 0], lm_head rows [0,0], [ln 2, 0], [ln 3, 0] → logits 0, ln 2, ln 3:
    // softmax = [1, 2, 3] / 6; target 2 → log(3/6); H = −Σ p ln p.
    let d = Device::flex();
    let h = Tensor::<2>::from_floats([[1.0, 0.0]], &d);
    let w = Tensor::<2>::from_floats([[0.0, 0.0], [2f32.ln(), 0.0], [3f32.ln(), 0.0]], &d);
    let y = Tensor::<1, Int>::from_ints([2], &d);
    let (lp, ent) = FusedLogProbConfig::new(1, 2).forward(h, w, y).unwrap();
    let p = [1.0f64 / 6.0, 2.0 / 6.0, 3.0 / 6.0];
    let h_expected: f64 = -p.iter().map(|q| q * q.ln()).sum::<f64>();
    assert!((f64::from(lp.into_scalar::<f32>()) - 0.5f64.ln()).abs() < 1e-6);
    assert!((f64::from(ent.into_scalar::<f32>()) - h_expected).abs() < 1e-6);
}

#[test]
fn fused_gradient_matches_finite_differences() {
    // Central differences of the fused forward itself (no autodiff) on a few coordinates.
    let c = case(6, 4, 11, 3);
    let grads = run(&c, Some(FusedLogProbConfig::new(4, 5)));
    let objective = |h: &[f32], w: &[f32]| -> f64 {
        let d = Device::flex();
        let (lp, ent) = FusedLogProbConfig::new(4, 5)
            .forward(
                Tensor::<1>::from_floats(h, &d).reshape([c.tokens, c.hidden]),
                Tensor::<1>::from_floats(w, &d).reshape([c.vocab, c.hidden]),
                Tensor::<1, Int>::from_ints(c.targets.as_slice(), &d),
            )
            .unwrap();
        let lp = to_vec(lp);
        let ent = to_vec(ent);
        (0..c.tokens)
            .map(|t| {
                f64::from(c.c_lp[t]) * f64::from(lp[t]) + f64::from(c.c_ent[t]) * f64::from(ent[t])
            })
            .sum()
    };
    let eps = 1e-2f32;
    for i in [0usize, 5, 13, 23] {
        let (mut hp, mut hm) = (c.h.clone(), c.h.clone());
        hp[i] += eps;
        hm[i] -= eps;
        let fd = (objective(&hp, &c.w) - objective(&hm, &c.w)) / (2.0 * f64::from(eps));
        assert!(
            (fd - f64::from(grads[2][i])).abs() < 2e-3,
            "d_hidden[{i}]: fd {fd} vs {}",
            grads[2][i]
        );
    }
    for i in [0usize, 7, 19, 43] {
        let (mut wp, mut wm) = (c.w.clone(), c.w.clone());
        wp[i] += eps;
        wm[i] -= eps;
        let fd = (objective(&c.h, &wp) - objective(&c.h, &wm)) / (2.0 * f64::from(eps));
        assert!(
            (fd - f64::from(grads[3][i])).abs() < 2e-3,
            "d_lm_head[{i}]: fd {fd} vs {}",
            grads[3][i]
        );
    }
}

#[test]
fn fused_rejects_bad_input() {
    let d = Device::flex();
    let h = Tensor::<2>::zeros([2, 4], &d);
    let w = Tensor::<2>::zeros([5, 4], &d);
    let err = FusedLogProbConfig::default()
        .forward(
            h.clone(),
            w.clone(),
            Tensor::<1, Int>::from_ints([1, 5], &d),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        OpsError::TokenOutOfRange {
            position: 1,
            token: 5,
            vocab: 5
        }
    ));
    let err = FusedLogProbConfig::default()
        .forward(
            h,
            Tensor::<2>::zeros([5, 3], &d),
            Tensor::<1, Int>::from_ints([1, 2], &d),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        OpsError::ShapeMismatch {
            what: "lm_head",
            ..
        }
    ));
}

/// `forward_ids` (host targets, nothing read back) gives `forward`'s values bit for bit and
/// rejects the same bad input.
#[test]
fn host_targets_give_the_same_values_and_errors() {
    let d = Device::flex();
    let c = case(37, 16, 50, 11);
    let h = Tensor::<1>::from_floats(c.h.as_slice(), &d).reshape([c.tokens, c.hidden]);
    let w = Tensor::<1>::from_floats(c.w.as_slice(), &d).reshape([c.vocab, c.hidden]);
    let ids: Vec<u32> = c.targets.iter().map(|&t| t as u32).collect();
    let cfg = FusedLogProbConfig::new(8, 16);
    let targets = Tensor::<1, Int>::from_ints(c.targets.as_slice(), &d);
    let (lp, ent) = cfg.forward(h.clone(), w.clone(), targets).unwrap();
    let (lp2, ent2) = cfg.forward_ids(h.clone(), w.clone(), &ids).unwrap();
    assert_eq!(to_vec(lp2), to_vec(lp));
    assert_eq!(to_vec(ent2), to_vec(ent));
    let mut bad = ids.clone();
    bad[3] = 50;
    assert!(matches!(
        cfg.forward_ids(h.clone(), w.clone(), &bad).unwrap_err(),
        OpsError::TokenOutOfRange {
            position: 3,
            token: 50,
            vocab: 50
        }
    ));
    assert!(matches!(
        cfg.forward_ids(h, w, &ids[1..]).unwrap_err(),
        OpsError::ShapeMismatch {
            what: "targets",
            ..
        }
    ));
}

#[test]
fn flex_devices_take_the_fused_path() {
    assert!(miles_ops::runs_fused(&Device::flex()));
    assert!(miles_ops::runs_fused(&Device::flex().autodiff()));
}

#[test]
fn flex_chunk_steps_match_their_references() {
    use burn::backend::Dispatch;
    use burn::tensor::TensorData;
    use miles_ops::fused::{
        RUNNING_MAX_INIT, logit_chunk_grad, logit_chunk_grad_reference, logit_chunk_stats,
        logit_chunk_stats_reference,
    };
    let d = Device::flex();
    let (rows, cols) = (5usize, 77usize);
    let z = lcg(rows * cols, 9, 6.0);
    let logits = || Tensor::<2>::from_data(TensorData::new(z.clone(), [rows, cols]), &d);
    for state in [
        [RUNNING_MAX_INIT, 0.0, 0.0],
        [3.0, 2.5, -1.0],
        [9.0, 1.0, 4.0],
    ] {
        let run: Vec<f32> = (0..rows).flat_map(|_| state).collect();
        let running = || Tensor::<2>::from_data(TensorData::new(run.clone(), [rows, 3]), &d);
        let native = to_vec(logit_chunk_stats(logits(), running()));
        let reference = to_vec(Tensor::<2>::from_dispatch(logit_chunk_stats_reference::<
            Dispatch,
        >(
            logits().into_dispatch(),
            running().into_dispatch(),
        )));
        assert_rel_close("chunk stats", &native, &reference, 1e-6);
    }
    let stats: Vec<f32> = (0..rows)
        .flat_map(|r| [7.0 + r as f32, 0.3, 0.8 - r as f32 * 0.3, -0.6])
        .collect();
    let stats = || Tensor::<2>::from_data(TensorData::new(stats.clone(), [rows, 4]), &d);
    let native = to_vec(logit_chunk_grad(logits(), stats()));
    let reference = to_vec(Tensor::<2>::from_dispatch(logit_chunk_grad_reference::<
        Dispatch,
    >(
        logits().into_dispatch(),
        stats().into_dispatch(),
    )));
    assert_rel_close("chunk grad", &native, &reference, 1e-6);
}
