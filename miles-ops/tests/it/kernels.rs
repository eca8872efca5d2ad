//! CubeCL kernels (feature `wgpu`) on the kernel test device (`Device::wgpu(DeviceKind::Cpu)`,
//! lavapipe without a GPU) against their plain-op `*_reference` twins on flex: the per-chunk
//! forward and backward steps of the fused log-prob + entropy op, the whole fused op with its
//! gradients, and the clipped policy-gradient loss with its gradients.
//!
//! Tolerances are explicit per test: f32 reductions in a different order (shared-memory tree
//! vs flex's sums) differ by a few ulps of the row sums, so values are compared with a
//! relative tolerance of 1e-5 of the largest magnitude and gradients with 1e-4.
#![cfg(any(feature = "wgpu", feature = "cuda"))]

use burn::backend::Dispatch;
use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_ops::fused::{
    FusedLogProbConfig, RUNNING_MAX_INIT, logit_chunk_grad, logit_chunk_grad_reference,
    logit_chunk_stats, logit_chunk_stats_reference,
};
use miles_ops::kernels::kernel_test_device;
use miles_ops::logprobs::log_probs_and_entropy_plain;
use miles_ops::{clipped_pg_loss, clipped_pg_loss_reference};

use crate::common::lcg;

fn t2(v: &[f32], shape: [usize; 2], d: &Device) -> Tensor<2> {
    Tensor::<2>::from_data(TensorData::new(v.to_vec(), shape), d)
}

fn vals<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
}

/// max |a − b| ≤ tol · max(1, max |b|).
fn assert_close(what: &str, a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    let (i, err) = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, e)| if e > m.1 { (i, e) } else { m });
    assert!(
        err <= tol * scale && a.iter().all(|x| x.is_finite()),
        "{what}: max abs err {err} at {i} ({} vs {}) > {tol} × {scale}",
        a[i],
        b[i]
    );
    println!("{what}: max err {err:.3e} (scale {scale:.3e})");
}

/// Running states: first chunk (the init sentinel) and a mid-stream state.
fn running_states(rows: usize, d: &Device) -> Vec<Tensor<2>> {
    let init: Vec<f32> = (0..rows)
        .flat_map(|_| [RUNNING_MAX_INIT, 0.0, 0.0])
        .collect();
    let mid: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let m = 2.0 + (r % 5) as f32;
            [m, 1.0 + r as f32 * 0.1, 3.0 - r as f32 * 0.05]
        })
        .collect();
    vec![t2(&init, [rows, 3], d), t2(&mid, [rows, 3], d)]
}

#[test]
fn chunk_stats_kernel_matches_reference() {
    let Some(dev) = kernel_test_device("chunk_stats_kernel_matches_reference") else {
        return;
    };
    let flex = Device::flex();
    // 300 columns: not a multiple of the block, so every unit's stride has a ragged tail;
    // scale 8 logits exercise the max-rescaling.
    for (rows, cols) in [(7usize, 300usize), (3, 1), (33, 1024)] {
        let z = lcg(rows * cols, rows as u64 + cols as u64, 8.0);
        for (k, running) in running_states(rows, &flex).into_iter().enumerate() {
            let run = vals(running.clone());
            let reference = vals(Tensor::<2>::from_dispatch(logit_chunk_stats_reference::<
                Dispatch,
            >(
                t2(&z, [rows, cols], &flex).into_dispatch(),
                running.into_dispatch(),
            )));
            let kernel = vals(logit_chunk_stats(
                t2(&z, [rows, cols], &dev),
                t2(&run, [rows, 3], &dev),
            ));
            assert_close(
                &format!("stats {rows}x{cols} state {k}"),
                &kernel,
                &reference,
                1e-5,
            );
        }
    }
}

#[test]
fn chunk_grad_kernel_matches_reference() {
    let Some(dev) = kernel_test_device("chunk_grad_kernel_matches_reference") else {
        return;
    };
    let flex = Device::flex();
    let (rows, cols) = (9usize, 257usize);
    let z = lcg(rows * cols, 5, 4.0);
    // (lse, E, g_lp, g_H) per row; lse above the row max so p ≤ 1.
    let stats: Vec<f32> = (0..rows)
        .flat_map(|r| {
            let g = lcg(2, r as u64 + 40, 1.5);
            [6.0 + r as f32 * 0.1, 0.5 - r as f32 * 0.2, g[0], g[1]]
        })
        .collect();
    let reference = vals(Tensor::<2>::from_dispatch(logit_chunk_grad_reference::<
        Dispatch,
    >(
        t2(&z, [rows, cols], &flex).into_dispatch(),
        t2(&stats, [rows, 4], &flex).into_dispatch(),
    )));
    let kernel = vals(logit_chunk_grad(
        t2(&z, [rows, cols], &dev),
        t2(&stats, [rows, 4], &dev),
    ));
    assert_close("chunk grad", &kernel, &reference, 1e-5);
}

/// (log_probs, entropy, ∂hidden, ∂lm_head) of `Σ c_lp·logp + Σ c_ent·H`.
fn fused_case(device: &Device, fused: bool) -> [Vec<f32>; 4] {
    let (tokens, hidden, vocab) = (23usize, 16usize, 301usize);
    let d = device.clone().autodiff();
    let h = t2(&lcg(tokens * hidden, 1, 1.5), [tokens, hidden], &d).require_grad();
    let w = t2(&lcg(vocab * hidden, 2, 0.7), [vocab, hidden], &d).require_grad();
    let y: Vec<i64> = (0..tokens)
        .map(|t| ((t * 37 + 11) % vocab) as i64)
        .collect();
    let y = Tensor::<1, Int>::from_ints(y.as_slice(), &d);
    let (lp, ent) = if fused {
        // Ragged chunks on both axes.
        FusedLogProbConfig::new(8, 64)
            .forward(h.clone(), w.clone(), y)
            .unwrap()
    } else {
        log_probs_and_entropy_plain(h.clone(), w.clone(), y)
    };
    let c_lp = Tensor::<1>::from_floats(lcg(tokens, 3, 1.0).as_slice(), &d);
    let c_ent = Tensor::<1>::from_floats(lcg(tokens, 4, 1.0).as_slice(), &d);
    let grads = ((lp.clone() * c_lp).sum() + (ent.clone() * c_ent).sum()).backward();
    [
        vals(lp.detach()),
        vals(ent.detach()),
        vals(h.grad(&grads).unwrap()),
        vals(w.grad(&grads).unwrap()),
    ]
}

#[test]
fn fused_op_with_kernels_matches_plain_path_with_gradients() {
    let Some(dev) = kernel_test_device("fused_op_with_kernels_matches_plain_path_with_gradients")
    else {
        return;
    };
    assert!(miles_ops::runs_fused(&dev.clone().autodiff()));
    let kernel = fused_case(&dev, true);
    let reference = fused_case(&Device::flex(), false);
    for (i, (what, tol)) in [
        ("log_probs", 1e-5),
        ("entropy", 1e-5),
        ("d_hidden", 1e-4),
        ("d_lm_head", 1e-4),
    ]
    .into_iter()
    .enumerate()
    {
        assert_close(what, &kernel[i], &reference[i], tol);
    }
}

/// (losses, clipfrac, ∂ppo_kl, ∂advantages) of `Σ g·L`.
fn pg_case(device: &Device, kernel: bool, dual: Option<f32>) -> [Vec<f32>; 4] {
    let d = device.clone().autodiff();
    let shape = [16, 33];
    let n = shape[0] * shape[1];
    // ppo_kl in ±0.6 puts ratios on both sides of the clip band; advantages of both signs.
    let kl = t2(&lcg(n, 21, 0.6), shape, &d).require_grad();
    let adv = t2(&lcg(n, 22, 2.0), shape, &d).require_grad();
    let g = t2(&lcg(n, 23, 1.0), shape, &d);
    let f = if kernel {
        clipped_pg_loss::<2>
    } else {
        clipped_pg_loss_reference::<2>
    };
    let (losses, clipfrac) = f(kl.clone(), adv.clone(), 0.2, 0.28, dual);
    let grads = (losses.clone() * g).sum().backward();
    [
        vals(losses.detach()),
        vals(clipfrac.detach()),
        vals(kl.grad(&grads).unwrap()),
        vals(adv.grad(&grads).unwrap()),
    ]
}

#[test]
fn clipped_pg_loss_kernel_matches_reference_with_gradients() {
    let Some(dev) = kernel_test_device("clipped_pg_loss_kernel_matches_reference_with_gradients")
    else {
        return;
    };
    // Dual clip 1.5: active for A < 0 with ratio > 1.5 (ppo_kl < −0.405).
    for dual in [None, Some(1.5)] {
        let kernel = pg_case(&dev, true, dual);
        let reference = pg_case(&Device::flex(), false, dual);
        for (i, what) in ["losses", "clipfrac", "d_ppo_kl", "d_advantages"]
            .into_iter()
            .enumerate()
        {
            assert_close(
                &format!("{what} (dual {dual:?})"),
                &kernel[i],
                &reference[i],
                1e-5,
            );
        }
        // The case covers clipped and unclipped tokens.
        let clipped = reference[1].iter().filter(|&&c| c == 1.0).count();
        assert!(clipped > 0 && clipped < reference[1].len());
    }
}
