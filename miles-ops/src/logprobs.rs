//! Plain (unfused) per-token log-probs and entropy from logits.
//!
//! These are the reference path: `log_softmax(logits)` gathered at the target token, and
//! `H = logsumexp(z) − Σ softmax(z)·z`. They materialise `[tokens, vocab]` and are what
//! [`crate::fused`] must match.

use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Int, Tensor};

/// Log-prob of `targets` (`[tokens]`) under `logits` (`[tokens, vocab]`) → `[tokens]`.
pub fn log_probs_from_logits(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    let [n, _] = logits.dims();
    log_softmax(logits, 1)
        .gather(1, targets.reshape([n, 1]))
        .reshape([n])
}

/// Entropy of each row of `logits` (`[tokens, vocab]`) → `[tokens]`.
pub fn entropy_from_logits(logits: Tensor<2>) -> Tensor<1> {
    let [n, _] = logits.dims();
    let p = softmax(logits.clone(), 1);
    let logp = log_softmax(logits, 1);
    (p * logp).sum_dim(1).neg().reshape([n])
}

/// The plain path from hidden states: `logits = hidden · lm_headᵀ`, then
/// [`log_probs_from_logits`] and [`entropy_from_logits`].
///
/// `hidden` is `[tokens, hidden]`, `lm_head` is `[vocab, hidden]` (HF layout).
pub fn log_probs_and_entropy_plain(
    hidden: Tensor<2>,
    lm_head: Tensor<2>,
    targets: Tensor<1, Int>,
) -> (Tensor<1>, Tensor<1>) {
    let logits = hidden.matmul(lm_head.transpose());
    (
        log_probs_from_logits(logits.clone(), targets),
        entropy_from_logits(logits),
    )
}

/// `(max, ln Σ exp(row))` of one host row of logits, for samplers: [`row_max`], then
/// [`tempered_weights`] at temperature 1 and [`log_sum_exp_of`] its block sums — the
/// exponentials in `f32` (a vectorisable polynomial, within 2 ulp) summed in `f32` lanes over
/// blocks of [`WEIGHT_BLOCK`] and the blocks in `f64`, so the log-sum-exp is within a few
/// `f32` ulps of the exact one. NaN in, NaN out; an empty row gives `(−∞, −∞)`.
pub fn max_and_log_sum_exp(row: &[f32]) -> (f32, f64) {
    let max = row_max(row);
    let sums = tempered_weights(row, max, 1.0, &mut Vec::new());
    (max, log_sum_exp_of(max, &sums))
}

/// `ln Σ exp(row)` from the row's `max` and the block sums [`tempered_weights`] returned for
/// it at temperature 1 (`inv_temperature = 1`).
pub fn log_sum_exp_of(max: f32, block_sums: &[f64]) -> f64 {
    block_sums.iter().sum::<f64>().ln() + f64::from(max)
}

/// Whether the row passes may run their AVX2 + FMA builds (checked at run time). The lanes
/// and the order of every sum are fixed in the code, so either build gives the same bits.
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The largest value of `row` (NaNs ignored; `−∞` for an empty or all-NaN row), vectorised.
pub fn row_max(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (`has_avx2_fma`).
        return unsafe { row_max_avx2(row) };
    }
    row_max_body(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_max_avx2(row: &[f32]) -> f32 {
    row_max_body(row)
}

#[inline(always)]
fn row_max_body(row: &[f32]) -> f32 {
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Elements per block of [`tempered_weights`]' block sums (16 `f32` lanes × 16).
pub const WEIGHT_BLOCK: usize = 256;

/// A sampler's unnormalised weights `exp((row[i] − max) · inv_temperature)` in `f32` (a
/// vectorisable polynomial, within 2 ulp; arguments below −87 give `exp(−87)`) written over
/// `weights` (resized to the row), and their sums over consecutive blocks of
/// [`WEIGHT_BLOCK`] elements (`f32` lanes, then `f64`), returned, so that a draw can skip
/// whole blocks. `max` is the row's maximum ([`row_max`]) and `inv_temperature` positive; at
/// `inv_temperature = 1` the sums give the log-sum-exp ([`log_sum_exp_of`]). Compiled for
/// AVX2 + FMA when the CPU has them (same bits either way).
pub fn tempered_weights(
    row: &[f32],
    max: f32,
    inv_temperature: f32,
    weights: &mut Vec<f32>,
) -> Vec<f64> {
    weights.clear();
    weights.resize(row.len(), 0.0);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (`has_avx2_fma`).
        return unsafe { weights_avx2(row, max, inv_temperature, weights) };
    }
    weights_into(row, max, inv_temperature, weights)
}

/// [`weights_into`] compiled for AVX2 + FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn weights_avx2(row: &[f32], max: f32, inv_temperature: f32, out: &mut [f32]) -> Vec<f64> {
    weights_into(row, max, inv_temperature, out)
}

#[inline(always)]
fn weights_into(row: &[f32], max: f32, inv_temperature: f32, out: &mut [f32]) -> Vec<f64> {
    const LANES: usize = 16;
    let mut sums = Vec::with_capacity(row.len().div_ceil(WEIGHT_BLOCK));
    for (block, dst) in row.chunks(WEIGHT_BLOCK).zip(out.chunks_mut(WEIGHT_BLOCK)) {
        let mut acc = [0.0f32; LANES];
        let mut chunks = block.chunks_exact(LANES).zip(dst.chunks_exact_mut(LANES));
        for (src, dst) in &mut chunks {
            for ((a, d), &x) in acc.iter_mut().zip(dst.iter_mut()).zip(src) {
                let e = exp_nonpositive_rounded((x - max) * inv_temperature);
                *d = e;
                *a += e;
            }
        }
        let mut sum: f64 = acc.iter().map(|&a| f64::from(a)).sum();
        let done = block.len() / LANES * LANES;
        for (d, &x) in dst[done..].iter_mut().zip(&block[done..]) {
            let e = exp_nonpositive_rounded((x - max) * inv_temperature);
            *d = e;
            sum += f64::from(e);
        }
        sums.push(sum);
    }
    sums
}

/// The first index of the largest value of `row` (`max` as [`max_and_log_sum_exp`] returns
/// it): a greedy sampler's pick. 0 when no element equals `max` (an empty or all-NaN row).
pub fn first_index_of_max(row: &[f32], max: f32) -> usize {
    const BLOCK: usize = 64;
    // Whole blocks compared without an early exit (vectorised), then the hit's block scanned.
    row.chunks(BLOCK)
        .position(|block| block.iter().fold(false, |hit, &x| hit | (x == max)))
        .and_then(|b| {
            row[b * BLOCK..]
                .iter()
                .position(|&x| x == max)
                .map(|i| b * BLOCK + i)
        })
        .unwrap_or(0)
}

/// `exp(x)` for `x ≤ 0`: the polynomial of the flex row loops (`flex/exp.rs`)
/// (Cephes, within 2 ulp) with the power of two rounded to nearest by adding 1.5·2²³
/// instead of a saturating float-to-int cast, so that it vectorises on every x86-64 level.
/// NaN stays NaN; below −87 it returns `exp(−87)`.
#[inline(always)]
fn exp_nonpositive_rounded(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let t = x * LOG2E + ROUND;
    // `t`'s low mantissa bits hold round(x·log2 e) (between −126 and 0) as an offset.
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let nf = t - ROUND;
    let g = x - nf * C1 - nf * C2;
    crate::flex::exp::exp_reduced(g) * f32::from_bits((n.wrapping_add(127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_sum_exp_matches_f64_to_f32_rounding() {
        // A vocabulary-sized row with a wide spread, and short rows (remainder only).
        let mut s = 12345u64;
        let mut next = || {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 40.0
        };
        for n in [1usize, 7, 16, 33, 32000] {
            let row: Vec<f32> = (0..n).map(|_| next()).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exact = row
                .iter()
                .map(|&x| (f64::from(x) - f64::from(max)).exp())
                .sum::<f64>()
                .ln()
                + f64::from(max);
            let (m, lse) = max_and_log_sum_exp(&row);
            assert_eq!(m, max);
            assert!(
                (lse - exact).abs() < 1e-6 * exact.abs().max(1.0),
                "{n}: {lse} vs {exact}"
            );
        }
        assert!(max_and_log_sum_exp(&[1.0, f32::NAN]).1.is_nan());
        assert_eq!(
            max_and_log_sum_exp(&[]),
            (f32::NEG_INFINITY, f64::NEG_INFINITY)
        );
        // A masked row (−∞ logits) keeps the log-sum-exp of the others.
        let (m, lse) = max_and_log_sum_exp(&[0.0, f32::NEG_INFINITY, 0.0]);
        assert_eq!(m, 0.0);
        assert!((lse - 2f64.ln()).abs() < 1e-7, "{lse}");
    }

    #[test]
    fn rounded_exp_matches_std_on_the_softmax_range() {
        let mut worst = 0.0f64;
        for i in 0..=400_000 {
            let x = -87.0 * i as f32 / 400_000.0;
            let (ours, reference) = (exp_nonpositive_rounded(x), f64::from(x).exp());
            worst = worst.max(((f64::from(ours) - reference) / reference).abs());
        }
        assert!(
            worst < 2.5 * f64::from(f32::EPSILON),
            "worst relative error {worst}"
        );
        assert_eq!(exp_nonpositive_rounded(0.0), 1.0);
        assert!(exp_nonpositive_rounded(-1.0e30) < 1.0e-37);
        assert!(exp_nonpositive_rounded(f32::NAN).is_nan());
    }

    #[test]
    fn the_cpu_specific_build_gives_the_same_bits() {
        let row: Vec<f32> = (0..32_003)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.037 - 20.0)
            .collect();
        let max = row_max_body(&row);
        assert_eq!(max, 999.0f32 * 0.037 - 20.0);
        assert_eq!(row_max(&row), max);
        let mut plain = vec![0.0; row.len()];
        let sums = weights_into(&row, max, 1.0, &mut plain);
        assert_eq!(max_and_log_sum_exp(&row), (max, log_sum_exp_of(max, &sums)));
    }

    #[test]
    fn tempered_weights_are_exponentials_with_block_sums() {
        let row: Vec<f32> = (0..600).map(|i| (i % 37) as f32 * 0.25 - 3.0).collect();
        let (max, _) = max_and_log_sum_exp(&row);
        let mut w = vec![7.0; 3];
        let sums = tempered_weights(&row, max, 0.5, &mut w);
        assert_eq!(w.len(), 600);
        assert_eq!(sums.len(), 3);
        for (x, got) in row.iter().zip(&w) {
            let want = (0.5 * (f64::from(*x) - f64::from(max))).exp();
            assert!(
                (f64::from(*got) - want).abs() < 3e-7 * want,
                "{got} vs {want}"
            );
        }
        for (b, s) in sums.iter().enumerate() {
            let want: f64 = w[b * 256..(b * 256 + 256).min(600)]
                .iter()
                .map(|&v| f64::from(v))
                .sum();
            assert!((s - want).abs() < 1e-6 * want, "{s} vs {want}");
        }
        let mut plain = vec![0.0; 600];
        assert_eq!(weights_into(&row, max, 0.5, &mut plain), sums);
        assert_eq!(plain, w);
    }

    #[test]
    fn first_index_of_max_is_the_first_of_ties() {
        let mut row = vec![0.0f32; 1000];
        row[700] = 3.0;
        row[900] = 3.0;
        row[5] = f32::NAN;
        let (max, _) = max_and_log_sum_exp(&row);
        assert_eq!(max, 3.0);
        assert_eq!(first_index_of_max(&row, max), 700);
        row[63] = 3.0;
        assert_eq!(first_index_of_max(&row, max), 63);
        assert_eq!(first_index_of_max(&[1.0, 2.0], 2.0), 1);
        assert_eq!(first_index_of_max(&[], f32::NEG_INFINITY), 0);
        assert_eq!(first_index_of_max(&[f32::NAN], f32::NEG_INFINITY), 0);
    }
}
