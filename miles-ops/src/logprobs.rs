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

/// `(max, ln Σ exp(row))` of one host row of logits, for samplers: the exponentials in `f32`
/// (a vectorisable polynomial of the shifted, non-positive logits, within 2 ulp) summed in
/// `f64`, so the log-sum-exp is within a few `f32` ulps of the exact one at a small fraction
/// of the cost of `f64` exponentials. NaN in, NaN out; an empty row gives `(−∞, −∞)`.
pub fn max_and_log_sum_exp(row: &[f32]) -> (f32, f64) {
    const LANES: usize = 16;
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut acc = [0.0f64; LANES];
    let chunks = row.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += f64::from(crate::flex_attention::exp_nonpositive(x - max));
        }
    }
    let mut sum: f64 = acc.iter().sum();
    for &x in rest {
        sum += f64::from(crate::flex_attention::exp_nonpositive(x - max));
    }
    (max, sum.ln() + f64::from(max))
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
    }
}
