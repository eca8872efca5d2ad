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
