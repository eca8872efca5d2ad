//! Fused, chunked per-token log-probs and entropy from hidden states and `lm_head`.
//!
//! For `hidden` `[tokens, hidden]`, `lm_head` `[vocab, hidden]` (HF layout) and target ids
//! `[tokens]`, computes `log p(target)` and the entropy of `softmax(hidden · lm_headᵀ)` chunk
//! by chunk: over tokens, and over the vocabulary with an online log-sum-exp. The backward
//! pass is custom: it recomputes each chunk's logits, so neither the `[tokens, vocab]`
//! logits nor their gradient are ever materialised. Peak extra memory is
//! O(`token_chunk × vocab_chunk`) instead of O(`tokens × vocab`).
//!
//! Math, per token with logits `z`, `p = softmax(z)`, `lse = log Σ exp z`,
//! `E = Σ p·z`: `logp = z_y − lse`, `H = lse − E`, and for upstream gradients `g_lp`, `g_H`:
//! `∂/∂z = g_lp·onehot(y) − p ⊙ (g_lp + g_H·(z − E))`, so
//! `∂hidden = (∂/∂z)·lm_head` and `∂lm_head = (∂/∂z)ᵀ·hidden`, accumulated per chunk.
//!
//! The operation is a burn backend extension ([`FusedLogProbOps`]): the chunk loops and the
//! matmuls are shared ([`forward_chunked`] / [`backward_chunked`]); the two per-chunk steps
//! (online log-sum-exp forward step, logits-gradient backward step) are backend methods —
//! native row loops on `Flex`, CubeCL kernels on CubeCL devices (feature `wgpu` / `cuda`,
//! `src/kernels/loss.rs`), each with a plain-op twin ([`logit_chunk_stats_reference`],
//! [`logit_chunk_grad_reference`]; [`forward_reference`] / [`backward_reference`] run the
//! whole op on them). `Autodiff<B>` gets the custom backward. On other backends
//! [`FusedLogProbConfig::forward`] falls back to
//! [`crate::logprobs::log_probs_and_entropy_plain`] (same values, full logits in memory).

use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, Shape, Slice, TensorMetadata, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::{IndexingUpdateOp, Int, Tensor};

use crate::flex::steps;
use crate::matmul::MatmulOps;
use crate::{OpsError, Result};

/// Default number of tokens per chunk.
pub const DEFAULT_TOKEN_CHUNK: usize = 1024;
/// Default number of vocabulary rows per chunk.
pub const DEFAULT_VOCAB_CHUNK: usize = 8192;

/// Largest `tokens × vocab` logits gradient the backward concatenates to compute
/// `∂lm_head` in one matmul (when all tokens are one token chunk): 64 M elements (256 MiB,
/// e.g. 420 scored tokens at a 151,936-token vocabulary).
const WHOLE_HEAD_GRAD_ELEMENTS: usize = 64 << 20;

/// Default [`FusedLogProbConfig::keep_logits_bytes`]: 1 GiB.
pub const DEFAULT_KEEP_LOGITS_BYTES: usize = 1 << 30;

/// Chunk sizes of the fused computation, and how much of the logits the backward may reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FusedLogProbConfig {
    /// Tokens per chunk (≥ 1).
    pub token_chunk: usize,
    /// Vocabulary rows per chunk (≥ 1).
    pub vocab_chunk: usize,
    /// On autodiff devices, the forward keeps its logit chunks for the backward when all of
    /// them (`tokens × vocab × 4` bytes) fit in this many bytes, saving the backward's
    /// recomputation (one `tokens × hidden × vocab` matmul); above it the backward
    /// recomputes them and memory stays O(chunk). 0: always recompute.
    #[serde(default = "default_keep_logits_bytes")]
    pub keep_logits_bytes: usize,
}

fn default_keep_logits_bytes() -> usize {
    DEFAULT_KEEP_LOGITS_BYTES
}

impl Default for FusedLogProbConfig {
    fn default() -> Self {
        Self {
            token_chunk: DEFAULT_TOKEN_CHUNK,
            vocab_chunk: DEFAULT_VOCAB_CHUNK,
            keep_logits_bytes: DEFAULT_KEEP_LOGITS_BYTES,
        }
    }
}

impl FusedLogProbConfig {
    /// Sets the chunk sizes (with the default logits budget).
    pub fn new(token_chunk: usize, vocab_chunk: usize) -> Self {
        Self {
            token_chunk,
            vocab_chunk,
            keep_logits_bytes: DEFAULT_KEEP_LOGITS_BYTES,
        }
    }

    /// Sets [`FusedLogProbConfig::keep_logits_bytes`].
    pub fn with_keep_logits_bytes(mut self, bytes: usize) -> Self {
        self.keep_logits_bytes = bytes;
        self
    }

    /// Computes `(log_probs, entropy)`, both `[tokens]`, from `hidden` `[tokens, hidden]`,
    /// `lm_head` `[vocab, hidden]` and `targets` `[tokens]`.
    ///
    /// Differentiable with respect to `hidden` and `lm_head` on autodiff devices. Checks
    /// shapes and that every target id is inside the vocabulary (one host read of
    /// `targets`; [`FusedLogProbConfig::forward_ids`] takes host ids and reads nothing).
    pub fn forward(
        &self,
        hidden: Tensor<2>,
        lm_head: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let (tokens, vocab) = self.check_shapes(&hidden, &lm_head)?;
        if targets.dims() != [tokens] {
            return Err(OpsError::ShapeMismatch {
                what: "targets",
                expected: vec![tokens],
                got: targets.dims().to_vec(),
            });
        }
        let ids: Vec<i64> = targets
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap_or_default();
        check_ids(ids.iter().copied(), vocab)?;
        Ok(self.run(hidden, lm_head, targets))
    }

    /// [`FusedLogProbConfig::forward`] with the target ids on the host: they are checked
    /// there and uploaded once, so the call reads nothing back from the device (the trainer's
    /// scoring builds its targets from host tokens). Same values as `forward`.
    pub fn forward_ids(
        &self,
        hidden: Tensor<2>,
        lm_head: Tensor<2>,
        targets: &[u32],
    ) -> Result<(Tensor<1>, Tensor<1>)> {
        let (tokens, vocab) = self.check_shapes(&hidden, &lm_head)?;
        if targets.len() != tokens {
            return Err(OpsError::ShapeMismatch {
                what: "targets",
                expected: vec![tokens],
                got: vec![targets.len()],
            });
        }
        check_ids(targets.iter().map(|&t| i64::from(t)), vocab)?;
        let ids: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
        let targets = Tensor::<1, Int>::from_data(
            burn::tensor::TensorData::new(ids, [tokens]),
            &hidden.device(),
        );
        Ok(self.run(hidden, lm_head, targets))
    }

    /// Checks the chunk sizes and that `hidden` and `lm_head` agree; returns
    /// `(tokens, vocab)`.
    fn check_shapes(&self, hidden: &Tensor<2>, lm_head: &Tensor<2>) -> Result<(usize, usize)> {
        if self.token_chunk == 0 || self.vocab_chunk == 0 {
            return Err(OpsError::InvalidConfig {
                flag: "fused-log-probs-chunk",
                reason: "chunk sizes must be at least 1".into(),
            });
        }
        let [tokens, h] = hidden.dims();
        let [vocab, h2] = lm_head.dims();
        if h != h2 {
            return Err(OpsError::ShapeMismatch {
                what: "lm_head",
                expected: vec![vocab, h],
                got: vec![vocab, h2],
            });
        }
        Ok((tokens, vocab))
    }

    /// The computation on checked inputs: the fused op where it runs, else the plain path.
    fn run(
        &self,
        hidden: Tensor<2>,
        lm_head: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> (Tensor<1>, Tensor<1>) {
        let [tokens, _] = hidden.dims();
        let [vocab, _] = lm_head.dims();
        if !crate::runs_fused(&hidden.device()) {
            // No fused implementation registered for this backend yet (or the fused ops are
            // switched off): same results through the plain path (which materialises the
            // logits).
            return crate::logprobs::log_probs_and_entropy_plain(hidden, lm_head, targets);
        }
        if tokens == 0 {
            let device = hidden.device();
            return (Tensor::zeros([0], &device), Tensor::zeros([0], &device));
        }
        let keep_logits = tokens
            .checked_mul(vocab)
            .and_then(|n| n.checked_mul(4))
            .is_some_and(|bytes| bytes <= self.keep_logits_bytes);
        let out =
            Tensor::<2>::from_dispatch(<Dispatch as FusedLogProbOps>::fused_log_prob_entropy(
                hidden.into_dispatch(),
                lm_head.into_dispatch(),
                targets.into_dispatch(),
                self.token_chunk,
                self.vocab_chunk,
                keep_logits,
            ));
        let log_probs = out.clone().slice([0..tokens, 0..1]).reshape([tokens]);
        let entropy = out.slice([0..tokens, 1..2]).reshape([tokens]);
        (log_probs, entropy)
    }
}

/// The first target id outside `0..vocab`, as [`OpsError::TokenOutOfRange`].
fn check_ids(ids: impl Iterator<Item = i64>, vocab: usize) -> Result<()> {
    for (position, token) in ids.enumerate() {
        if token < 0 || token as usize >= vocab {
            return Err(OpsError::TokenOutOfRange {
                position,
                token,
                vocab,
            });
        }
    }
    Ok(())
}

/// The forward step ([`FusedLogProbOps::logit_chunk_stats`]) on `logits`' device: folds a
/// `[rows, cols]` logits chunk into the running `[rows, 3]` `(m, s, u)`; start from
/// `(RUNNING_MAX_INIT, 0, 0)`. A constant on autodiff devices.
pub fn logit_chunk_stats(logits: Tensor<2>, running: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as FusedLogProbOps>::logit_chunk_stats(
        logits.into_dispatch(),
        running.into_dispatch(),
    ))
}

/// The backward step ([`FusedLogProbOps::logit_chunk_grad`]) on `logits`' device:
/// `−p ⊙ (g_lp + g_H·(z − E))` from `[rows, 4]` `(lse, E, g_lp, g_H)`.
pub fn logit_chunk_grad(logits: Tensor<2>, row_stats: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as FusedLogProbOps>::logit_chunk_grad(
        logits.into_dispatch(),
        row_stats.into_dispatch(),
    ))
}

/// `(log_probs, entropy)` with the default chunk sizes; see [`FusedLogProbConfig::forward`].
pub fn fused_log_probs_and_entropy(
    hidden: Tensor<2>,
    lm_head: Tensor<2>,
    targets: Tensor<1, Int>,
) -> Result<(Tensor<1>, Tensor<1>)> {
    FusedLogProbConfig::default().forward(hidden, lm_head, targets)
}

/// Initial running maximum of the online log-sum-exp. Finite (WGSL has no `-inf` literal) and
/// far below any real logit, so `exp(RUNNING_MAX_INIT − m)` is exactly 0.
pub const RUNNING_MAX_INIT: f32 = -1.0e30;

/// Backend extension carrying the fused op and its two per-chunk steps.
///
/// - [`fused_log_prob_entropy`](FusedLogProbOps::fused_log_prob_entropy): output `[tokens, 2]`,
///   column 0 the target log-prob, column 1 the entropy.
/// - [`logit_chunk_stats`](FusedLogProbOps::logit_chunk_stats): the forward step, folding one
///   `[rows, cols]` logits chunk into the running `[rows, 3]` state `(m, s, u)` of the online
///   log-sum-exp (`m` running max, `s = Σ exp(z − m)`, `u = Σ exp(z − m)·z`).
/// - [`logit_chunk_grad`](FusedLogProbOps::logit_chunk_grad): the backward step, the logits
///   gradient of one chunk without its one-hot part, `−p ⊙ (g_lp + g_H·(z − E))`, from the
///   `[rows, 4]` per-row `(lse, E, g_lp, g_H)`.
///
/// Flex implements the steps with native row loops, CubeCL backends (feature `wgpu` /
/// `cuda`) with kernels; [`logit_chunk_stats_reference`] / [`logit_chunk_grad_reference`] are
/// the plain-op twins they are tested against. On autodiff devices the steps are constants
/// (they are only called inside the fused op's own forward and backward).
#[backend_extension(
    Flex,
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff
)]
pub trait FusedLogProbOps: Backend {
    /// Forward pass (no autodiff bookkeeping on plain backends). With `keep_logits`, an
    /// autodiff backend keeps the logit chunks for its backward instead of recomputing them.
    fn fused_log_prob_entropy(
        hidden: FloatTensor<Self>,
        lm_head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        token_chunk: usize,
        vocab_chunk: usize,
        keep_logits: bool,
    ) -> FloatTensor<Self>;

    /// Forward step: `[rows, cols]` logits and `[rows, 3]` running `(m, s, u)` → updated
    /// `[rows, 3]` state.
    fn logit_chunk_stats(
        logits: FloatTensor<Self>,
        running: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Backward step: `[rows, cols]` logits and `[rows, 4]` `(lse, E, g_lp, g_H)` →
    /// `[rows, cols]` gradient `−p ⊙ (g_lp + g_H·(z − E))`.
    fn logit_chunk_grad(
        logits: FloatTensor<Self>,
        row_stats: FloatTensor<Self>,
    ) -> FloatTensor<Self>;
}

impl FusedLogProbOps for burn::backend::Flex {
    fn fused_log_prob_entropy(
        hidden: FloatTensor<Self>,
        lm_head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        token_chunk: usize,
        vocab_chunk: usize,
        _keep_logits: bool,
    ) -> FloatTensor<Self> {
        forward_chunked::<Self>(hidden, lm_head, targets, token_chunk, vocab_chunk).output
    }

    fn logit_chunk_stats(
        logits: FloatTensor<Self>,
        running: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match steps::logit_chunk_stats(&logits, &running) {
            Some(out) => out,
            None => logit_chunk_stats_reference::<Self>(logits, running),
        }
    }

    fn logit_chunk_grad(
        logits: FloatTensor<Self>,
        row_stats: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match steps::logit_chunk_grad(&logits, &row_stats) {
            Some(out) => out,
            None => logit_chunk_grad_reference::<Self>(logits, row_stats),
        }
    }
}

/// Forward results kept for the backward pass.
#[derive(Debug, Clone)]
pub struct ForwardState<B: Backend> {
    /// `[tokens, 2]` log-prob and entropy.
    pub output: FloatTensor<B>,
    /// `[tokens, 1]` log-sum-exp of the logits.
    pub lse: FloatTensor<B>,
    /// `[tokens, 1]` expected logit `Σ p·z`.
    pub expected_logit: FloatTensor<B>,
    /// The logit chunks, token chunk by token chunk and vocabulary chunk by vocabulary chunk,
    /// when the forward was asked to keep them ([`forward_chunked_keeping`]); else empty.
    pub logits: Vec<FloatTensor<B>>,
}

fn rows<B: Backend>(t: FloatTensor<B>, start: usize, end: usize) -> FloatTensor<B> {
    let cols = t.shape()[1];
    B::float_slice(t, &[Slice::from(start..end), Slice::from(0..cols)])
}

fn cols<B: Backend>(t: FloatTensor<B>, start: usize, end: usize) -> FloatTensor<B> {
    let rows = t.shape()[0];
    B::float_slice(t, &[Slice::from(0..rows), Slice::from(start..end)])
}

fn expand<B: Backend>(t: FloatTensor<B>, shape: [usize; 2]) -> FloatTensor<B> {
    B::float_expand(t, Shape::from(shape))
}

/// Plain-op twin of [`FusedLogProbOps::logit_chunk_stats`]: folds `logits` (`[rows, cols]`)
/// into the running `(m, s, u)` (`[rows, 3]`).
pub fn logit_chunk_stats_reference<B: Backend>(
    logits: FloatTensor<B>,
    running: FloatTensor<B>,
) -> FloatTensor<B> {
    let [n, v] = [logits.shape()[0], logits.shape()[1]];
    let m = cols::<B>(running.clone(), 0, 1);
    let s = cols::<B>(running.clone(), 1, 2);
    let u = cols::<B>(running, 2, 3);
    let chunk_max = B::float_max_dim(logits.clone(), 1);
    let m_new = B::float_max_dim(B::float_cat(vec![m.clone(), chunk_max], 1), 1);
    let e = B::float_exp(B::float_sub(
        logits.clone(),
        expand::<B>(m_new.clone(), [n, v]),
    ));
    let s_c = B::float_sum_dim(e.clone(), 1);
    let u_c = B::float_sum_dim(B::float_mul(e, logits), 1);
    let scale = B::float_exp(B::float_sub(m, m_new.clone()));
    let s = B::float_add(B::float_mul(s, scale.clone()), s_c);
    let u = B::float_add(B::float_mul(u, scale), u_c);
    B::float_cat(vec![m_new, s, u], 1)
}

/// Plain-op twin of [`FusedLogProbOps::logit_chunk_grad`]: `−p ⊙ (g_lp + g_H·(z − E))` with
/// `p = exp(z − lse)`, from `row_stats` `[rows, 4]` = `(lse, E, g_lp, g_H)`.
pub fn logit_chunk_grad_reference<B: Backend>(
    logits: FloatTensor<B>,
    row_stats: FloatTensor<B>,
) -> FloatTensor<B> {
    let shape = [logits.shape()[0], logits.shape()[1]];
    let col = |i: usize| expand::<B>(cols::<B>(row_stats.clone(), i, i + 1), shape);
    let p = B::float_exp(B::float_sub(logits.clone(), col(0)));
    let centred = B::float_sub(logits, col(1));
    let inner = B::float_add(B::float_mul(centred, col(3)), col(2));
    B::float_neg(B::float_mul(p, inner))
}

/// Chunked forward from plain backend ops (the reference implementation).
pub fn forward_reference<B: Backend>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> ForwardState<B> {
    forward_with::<B>(
        hidden,
        lm_head,
        targets,
        token_chunk,
        vocab_chunk,
        false,
        logit_chunk_stats_reference::<B>,
    )
}

/// Chunked forward with the backend's own per-chunk step ([`FusedLogProbOps::logit_chunk_stats`]).
pub fn forward_chunked<B: FusedLogProbOps>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> ForwardState<B> {
    forward_with::<B>(
        hidden,
        lm_head,
        targets,
        token_chunk,
        vocab_chunk,
        false,
        B::logit_chunk_stats,
    )
}

/// [`forward_chunked`], also returning the logit chunks in [`ForwardState::logits`] (for a
/// backward that reuses them: [`backward_chunked_from`]).
pub fn forward_chunked_keeping<B: FusedLogProbOps>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> ForwardState<B> {
    forward_with::<B>(
        hidden,
        lm_head,
        targets,
        token_chunk,
        vocab_chunk,
        true,
        B::logit_chunk_stats,
    )
}

fn forward_with<B: Backend>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
    keep: bool,
    step: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> ForwardState<B> {
    let tokens = hidden.shape()[0];
    let vocab = lm_head.shape()[0];
    let device = hidden.device();
    let dtype = hidden.dtype();
    // Target logits z_y = <h_t, W[y_t]> without touching the rest of the vocabulary.
    let w_y = B::float_select(lm_head.clone(), 0, targets);
    let z_y = B::float_sum_dim(B::float_mul(hidden.clone(), w_y), 1);

    let mut lse_chunks = Vec::new();
    let mut ez_chunks = Vec::new();
    let mut kept = Vec::new();
    for t0 in (0..tokens).step_by(token_chunk) {
        let t1 = (t0 + token_chunk).min(tokens);
        let n = t1 - t0;
        let h_c = rows::<B>(hidden.clone(), t0, t1);
        // Running (m, s, u) of the online log-sum-exp.
        let mut state = B::float_cat(
            vec![
                B::float_full(
                    Shape::from([n, 1]),
                    RUNNING_MAX_INIT.into(),
                    &device,
                    dtype.into(),
                ),
                B::float_zeros(Shape::from([n, 2]), &device, dtype.into()),
            ],
            1,
        );
        for v0 in (0..vocab).step_by(vocab_chunk) {
            let v1 = (v0 + vocab_chunk).min(vocab);
            let w_c = rows::<B>(lm_head.clone(), v0, v1);
            let z = B::float_matmul(h_c.clone(), B::float_transpose(w_c));
            if keep {
                kept.push(z.clone());
            }
            state = step(z, state);
        }
        let m = cols::<B>(state.clone(), 0, 1);
        let s = cols::<B>(state.clone(), 1, 2);
        let u = cols::<B>(state, 2, 3);
        lse_chunks.push(B::float_add(m, B::float_log(s.clone())));
        ez_chunks.push(B::float_div(u, s));
    }
    let lse = B::float_cat(lse_chunks, 0);
    let expected_logit = B::float_cat(ez_chunks, 0);
    let log_prob = B::float_sub(z_y, lse.clone());
    let entropy = B::float_sub(lse.clone(), expected_logit.clone());
    ForwardState {
        output: B::float_cat(vec![log_prob, entropy], 1),
        lse,
        expected_logit,
        logits: kept,
    }
}

/// Chunked backward from plain backend ops: returns `(∂hidden, ∂lm_head)` for the upstream
/// gradient `grad` (`[tokens, 2]`: log-prob and entropy columns).
#[allow(clippy::too_many_arguments)]
pub fn backward_reference<B: Backend>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    expected_logit: FloatTensor<B>,
    grad: FloatTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    backward_with::<B>(
        hidden,
        lm_head,
        targets,
        [lse, expected_logit, grad],
        token_chunk,
        vocab_chunk,
        Vec::new(),
        logit_chunk_grad_reference::<B>,
        B::float_matmul,
    )
}

/// Chunked backward with the backend's own per-chunk step
/// ([`FusedLogProbOps::logit_chunk_grad`]); `∂lm_head`, vocabulary-sized, is written once by
/// [`MatmulOps::dense_matmul`] (on flex the same bits as `float_matmul`, without its second
/// buffer and copy).
#[allow(clippy::too_many_arguments)]
pub fn backward_chunked<B: FusedLogProbOps + MatmulOps>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    expected_logit: FloatTensor<B>,
    grad: FloatTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    backward_with::<B>(
        hidden,
        lm_head,
        targets,
        [lse, expected_logit, grad],
        token_chunk,
        vocab_chunk,
        Vec::new(),
        B::logit_chunk_grad,
        B::dense_matmul,
    )
}

/// [`backward_chunked`] reusing the forward's logit chunks ([`ForwardState::logits`] of
/// [`forward_chunked_keeping`]) instead of recomputing them; with no chunks it recomputes.
#[allow(clippy::too_many_arguments)]
pub fn backward_chunked_from<B: FusedLogProbOps + MatmulOps>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    forward: ForwardState<B>,
    grad: FloatTensor<B>,
    token_chunk: usize,
    vocab_chunk: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    backward_with::<B>(
        hidden,
        lm_head,
        targets,
        [forward.lse, forward.expected_logit, grad],
        token_chunk,
        vocab_chunk,
        forward.logits,
        B::logit_chunk_grad,
        B::dense_matmul,
    )
}

#[allow(clippy::too_many_arguments)]
fn backward_with<B: Backend>(
    hidden: FloatTensor<B>,
    lm_head: FloatTensor<B>,
    targets: IntTensor<B>,
    [lse, expected_logit, grad]: [FloatTensor<B>; 3],
    token_chunk: usize,
    vocab_chunk: usize,
    kept: Vec<FloatTensor<B>>,
    step: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
    head_matmul: impl Fn(FloatTensor<B>, FloatTensor<B>) -> FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let tokens = hidden.shape()[0];
    let h = hidden.shape()[1];
    let vocab = lm_head.shape()[0];
    let g_lp = cols::<B>(grad.clone(), 0, 1);
    // Per-token (lse, E, g_lp, g_H).
    let row_stats = B::float_cat(vec![lse, expected_logit, grad], 1);
    let mut kept = kept.into_iter();

    // With one token chunk of few rows (RL's scored response tokens), `∂lm_head` is one
    // matmul over the chunk's whole logits gradient instead of a `[vocab_chunk, hidden]`
    // product per vocabulary chunk and a concatenation of them: the vocabulary-sized
    // gradient is written once.
    let whole_head = tokens <= token_chunk
        && tokens
            .checked_mul(vocab)
            .is_some_and(|n| n <= WHOLE_HEAD_GRAD_ELEMENTS);
    let mut d_hidden_chunks = Vec::new();
    let mut d_head_chunks: Vec<Option<FloatTensor<B>>> =
        (0..vocab.div_ceil(vocab_chunk)).map(|_| None).collect();
    let mut coefs = Vec::new();
    for t0 in (0..tokens).step_by(token_chunk) {
        let t1 = (t0 + token_chunk).min(tokens);
        let h_c = rows::<B>(hidden.clone(), t0, t1);
        let stats_c = rows::<B>(row_stats.clone(), t0, t1);
        let mut dh_c: Option<FloatTensor<B>> = None;
        for (k, v0) in (0..vocab).step_by(vocab_chunk).enumerate() {
            let v1 = (v0 + vocab_chunk).min(vocab);
            let w_c = rows::<B>(lm_head.clone(), v0, v1);
            let z = match kept.next() {
                Some(z) => z,
                None => B::float_matmul(h_c.clone(), B::float_transpose(w_c.clone())),
            };
            let coef = step(z, stats_c.clone());
            let dh = B::float_matmul(coef.clone(), w_c);
            dh_c = Some(match dh_c {
                Some(acc) => B::float_add(acc, dh),
                None => dh,
            });
            if whole_head {
                coefs.push(coef);
                continue;
            }
            let dw = head_matmul(B::float_transpose(coef), h_c.clone());
            d_head_chunks[k] = Some(match d_head_chunks[k].take() {
                Some(acc) => B::float_add(acc, dw),
                None => dw,
            });
        }
        d_hidden_chunks.push(dh_c.expect("vocab is non-empty"));
    }
    let d_hidden = B::float_cat(d_hidden_chunks, 0);
    let d_head = if whole_head {
        let coef = B::float_cat(coefs, 1);
        head_matmul(B::float_transpose(coef), hidden.clone())
    } else {
        B::float_cat(d_head_chunks.into_iter().flatten().collect(), 0)
    };
    // One-hot part: ∂hidden += g_lp·W[y], ∂lm_head[y] += g_lp·hidden.
    let g_lp_h = expand::<B>(g_lp, [tokens, h]);
    let w_y = B::float_select(lm_head, 0, targets.clone());
    let d_hidden = B::float_add(d_hidden, B::float_mul(g_lp_h.clone(), w_y));
    let d_head = B::float_select_assign(
        d_head,
        0,
        targets,
        B::float_mul(g_lp_h, hidden),
        IndexingUpdateOp::Add,
    );
    (d_hidden, d_head)
}

#[derive(Debug)]
struct FusedBackward;

impl<B: FusedLogProbOps + MatmulOps> Backward<B, 2> for FusedBackward {
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        ForwardState<B>,
        usize,
        usize,
    );

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_hidden, node_head] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (hidden, lm_head, targets, forward, tc, vc) = ops.state;
        let (d_hidden, d_head) =
            backward_chunked_from::<B>(hidden, lm_head, targets, forward, grad, tc, vc);
        if let Some(node) = node_hidden {
            grads.register::<B>(node.id, d_hidden);
        }
        if let Some(node) = node_head {
            grads.register::<B>(node.id, d_head);
        }
    }
}

impl<B: Backend + FusedLogProbOps + MatmulOps, C: CheckpointStrategy> FusedLogProbOps
    for Autodiff<B, C>
{
    fn fused_log_prob_entropy(
        hidden: FloatTensor<Self>,
        lm_head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        token_chunk: usize,
        vocab_chunk: usize,
        keep_logits: bool,
    ) -> FloatTensor<Self> {
        let guards = [hidden.node(), lm_head.node()];
        let hidden = hidden.into_primitive();
        let lm_head = lm_head.into_primitive();
        match FusedBackward
            .prepare::<C>(guards)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let forward = if keep_logits {
                    forward_chunked_keeping::<B>
                } else {
                    forward_chunked::<B>
                };
                let mut fwd = forward(
                    hidden.clone(),
                    lm_head.clone(),
                    targets.clone(),
                    token_chunk,
                    vocab_chunk,
                );
                let output = fwd.output.clone();
                // The backward needs the statistics (and kept logits), not the output.
                fwd.output = fwd.lse.clone();
                let state = (hidden, lm_head, targets, fwd, token_chunk, vocab_chunk);
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::fused_log_prob_entropy(
                hidden,
                lm_head,
                targets,
                token_chunk,
                vocab_chunk,
                keep_logits,
            )),
        }
    }

    fn logit_chunk_stats(
        logits: FloatTensor<Self>,
        running: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // A constant: only called inside the fused op's own passes.
        <Self as AutodiffBackend>::from_inner(B::logit_chunk_stats(
            logits.into_primitive(),
            running.into_primitive(),
        ))
    }

    fn logit_chunk_grad(
        logits: FloatTensor<Self>,
        row_stats: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(B::logit_chunk_grad(
            logits.into_primitive(),
            row_stats.into_primitive(),
        ))
    }
}
