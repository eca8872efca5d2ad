//! Native `Flex` kernels of [`crate::attention()`]: masked softmax attention, forward and
//! backward, over contiguous `f32` `[batch, heads, rows, head_dim]` tensors.
//!
//! Work is split into rayon tasks — one per (batch, query head) forward and one per
//! (batch, key/value head) backward, so a task owns the key/value gradients it accumulates —
//! and each task walks its query rows in blocks of [`BLOCK`]. A block multiplies only the
//! keys up to the last unmasked one of its rows (`gemm`, single-threaded inside the task), so
//! a causal mask halves the work; the softmax, its gradient and the masking run fused over the
//! block's scores. The backward pass recomputes the probabilities from the forward's
//! log-sum-exp instead of keeping them.
//!
//! Semantics are those of `softmax(mask_fill(q·kᵀ·scale, mask, −1e30))·v`: a masked score
//! has probability 0, and a row with every key masked attends uniformly to all keys (its
//! gradient reaches `v` only).

use burn::backend::{DType, Flex, Shape, TensorMetadata, tensor::FloatTensor};
use rayon::prelude::*;

use super::exp::exp_nonpositive;
use super::gemm::matmul;
use super::tensor::{f32_data, tensor};

type FlexTensor = FloatTensor<Flex>;

/// Query rows per block.
const BLOCK: usize = 64;

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub rows: usize,
    pub keys: usize,
    pub head_dim: usize,
}

impl Dims {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// The data of a `[batch, heads, keys, dim]` tensor and the distance between consecutive
/// (batch, head) matrices: borrowed when each matrix is contiguous and the matrices are
/// evenly spaced (a KV cache narrowed to its used keys, whose matrices are `capacity · dim`
/// apart), copied to a contiguous tensor otherwise.
fn head_matrices(t: &FlexTensor) -> (std::borrow::Cow<'_, [f32]>, usize) {
    let layout = t.layout();
    let shape = layout.shape();
    let strides = layout.strides();
    if t.dtype() == DType::F32 && shape.num_dims() == 4 {
        let (heads, keys, d) = (shape[1], shape[2], shape[3]);
        let s1 = strides[1];
        let even = strides[3] == 1
            && strides[2] == d as isize
            && s1 >= (keys * d) as isize
            && strides[0] == s1 * heads as isize;
        if even {
            let s1 = s1 as usize;
            let start = layout.start_offset();
            let storage = t.storage::<f32>();
            let n = shape[0] * heads;
            // Bounds: the last matrix ends inside the storage.
            if n == 0 || start + (n - 1) * s1 + keys * d <= storage.len() {
                return (std::borrow::Cow::Borrowed(&storage[start..]), s1);
            }
        }
    }
    let shape = t.shape();
    (f32_data(t), shape[2] * shape[3])
}

/// The mask as one byte per element (non-zero = masked), contiguous.
fn mask_bytes(mask: &FlexTensor) -> Vec<u8> {
    let contiguous = mask.to_contiguous();
    let n = contiguous.shape().num_elements();
    contiguous.bytes()[..n].to_vec()
}

/// For every (batch, row), one past the last unmasked key (0: the whole row is masked).
fn row_limits(mask: &[u8], dims: &Dims) -> Vec<usize> {
    mask.chunks(dims.keys.max(1))
        .take(dims.batch * dims.rows)
        .map(|row| row.iter().rposition(|&m| m == 0).map_or(0, |j| j + 1))
        .collect()
}

/// For every (batch, row), the first unmasked key (0 for a fully masked row): under a
/// sliding window the keys before it are skipped as those past the limit are.
fn row_firsts(mask: &[u8], dims: &Dims) -> Vec<usize> {
    mask.chunks(dims.keys.max(1))
        .take(dims.batch * dims.rows)
        .map(|row| row.iter().position(|&m| m == 0).unwrap_or(0))
        .collect()
}

/// One block's first key: the earliest first key among its rows that see any key.
fn block_first(firsts: &[usize], limits: &[usize]) -> usize {
    firsts
        .iter()
        .zip(limits)
        .filter(|(_, l)| **l > 0)
        .map(|(f, _)| *f)
        .min()
        .unwrap_or(0)
}

/// `ln(eˣ + eʸ)`.
fn log_add_exp(x: f32, y: f32) -> f32 {
    let (hi, lo) = if x >= y { (x, y) } else { (y, x) };
    hi + (lo - hi).exp().ln_1p()
}

/// Folds a sink logit into one row's softmax: the probabilities `probs` (and the output
/// row, when given) scaled by `exp(lse − lse')`, returns `lse' = ln(e^lse + e^sink)`.
fn fold_sink(lse: f32, sink: f32, probs: &mut [f32]) -> f32 {
    let folded = log_add_exp(lse, sink);
    let factor = (lse - folded).exp();
    probs.iter_mut().for_each(|p| *p *= factor);
    folded
}

/// `dst[n×kk] = scale · q_rows[n×d] · keys[..kk]ᵀ` (keys `[t, d]` row-major).
fn scaled_scores(dst: &mut [f32], q_rows: &[f32], keys: &[f32], kk: usize, d: usize, scale: f32) {
    let n = q_rows.len() / d.max(1);
    matmul(
        n,
        kk,
        d,
        dst,
        kk,
        false,
        q_rows,
        (d, 1),
        keys,
        (1, d),
        scale,
    );
}

/// One block's key count: the furthest limit among its rows.
fn block_keys(limits: &[usize]) -> usize {
    limits.iter().copied().max().unwrap_or(0)
}

/// Lanes of the softmax passes (one AVX-512 register).
const LANES: usize = 16;

/// Softmax of one row of scaled scores in place (masked and beyond-limit keys → 0);
/// returns the row's log-sum-exp. The max and the sum run over [`LANES`] lanes (lane sums
/// added in order at the end), so the passes vectorise; compiled for AVX-512F when the CPU
/// has it, with the same bits either way (no fused multiply-adds).
fn softmax_row(scores: &mut [f32], mask: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::packed::supported() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { softmax_row_avx512(scores, mask) };
    }
    softmax_lanes(scores, mask)
}

/// [`softmax_lanes`] with explicit AVX-512 instructions, one register per [`LANES`] chunk:
/// the same operations in the same order (separate multiplies and adds, the lane sums added
/// in order at the end), so the same bits; the generic loop does not vectorise the exp.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn softmax_row_avx512(scores: &mut [f32], mask: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let n = scores.len().min(mask.len());
    // A chunk's scores and "masked" lanes; past the row's end a lane is masked (its score
    // never read as a value, its probability 0 and never stored).
    let load = |scores: &[f32], i: usize| -> (__m512, __mmask16) {
        let len = (n - i).min(LANES);
        let mut m = [1u8; LANES];
        m[..len].copy_from_slice(&mask[i..i + len]);
        let valid = if len == LANES {
            0xffff
        } else {
            (1u16 << len) - 1
        };
        // SAFETY: `valid` limits the load to the row's `len` remaining scores; `m` holds 16
        // bytes.
        unsafe {
            let v = _mm512_maskz_loadu_ps(valid, scores[i..].as_ptr());
            let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(m.as_ptr().cast()));
            (v, _mm512_cmpneq_epi32_mask(bytes, _mm512_setzero_si512()))
        }
    };
    let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut top = neg_inf;
    for i in (0..n).step_by(LANES) {
        let (v, masked) = load(scores, i);
        // `f32::max` keeps the running value when the candidate is NaN: so does MAXPS with
        // the candidate first.
        top = _mm512_max_ps(_mm512_mask_blend_ps(masked, v, neg_inf), top);
    }
    let mut lanes = [0.0f32; LANES];
    // SAFETY: `lanes` holds 16 floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), top) };
    let max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = _mm512_setzero_ps();
    let zero = _mm512_setzero_ps();
    for i in (0..n).step_by(LANES) {
        let (v, masked) = load(scores, i);
        let e = exp_nonpositive_avx512(_mm512_sub_ps(v, _mm512_set1_ps(max)));
        let p = _mm512_mask_blend_ps(masked, e, zero);
        sums = _mm512_add_ps(sums, p);
        let len = (n - i).min(LANES);
        let valid = if len == LANES {
            0xffff
        } else {
            (1u16 << len) - 1
        };
        // SAFETY: `valid` limits the store to the row's remaining scores.
        unsafe { _mm512_mask_storeu_ps(scores[i..].as_mut_ptr(), valid, p) };
    }
    // SAFETY: as above.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
    let sum: f32 = lanes.iter().sum();
    let inv = 1.0 / sum;
    for v in scores[..n].iter_mut() {
        *v *= inv;
    }
    max + sum.ln()
}

/// [`exp_nonpositive`] on 16 lanes, operation for operation (no fused multiply-adds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_nonpositive_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let c = _mm512_set1_ps;
    let low = c(-87.0);
    // `x < -87 → -87`, NaN kept.
    let x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, low), x, low);
    let t = _mm512_add_ps(_mm512_mul_ps(x, c(std::f32::consts::LOG2_E)), c(0.5));
    let n = _mm512_cvttps_epi32(t);
    let above = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_cvtepi32_ps(n), t);
    let n = _mm512_mask_sub_epi32(n, above, n, _mm512_set1_epi32(1));
    let nf = _mm512_cvtepi32_ps(n);
    let g = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(nf, c(0.693_359_4))),
        _mm512_mul_ps(nf, c(-2.121_944_4e-4)),
    );
    let z = _mm512_mul_ps(g, g);
    let mut p = _mm512_add_ps(_mm512_mul_ps(c(1.987_569_1e-4), g), c(1.398_199_9e-3));
    p = _mm512_add_ps(_mm512_mul_ps(p, g), c(8.333_452e-3));
    p = _mm512_add_ps(_mm512_mul_ps(p, g), c(4.166_579_6e-2));
    p = _mm512_add_ps(_mm512_mul_ps(p, g), c(1.666_666_5e-1));
    p = _mm512_add_ps(_mm512_mul_ps(p, g), c(0.5));
    let reduced = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, z), g), c(1.0));
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        n,
        _mm512_set1_epi32(127),
    )));
    _mm512_mul_ps(reduced, scale)
}

#[inline(always)]
fn softmax_lanes(scores: &mut [f32], mask: &[u8]) -> f32 {
    let mut top = [f32::NEG_INFINITY; LANES];
    for (s, m) in scores.chunks(LANES).zip(mask.chunks(LANES)) {
        for ((t, &v), &m) in top.iter_mut().zip(s).zip(m) {
            *t = t.max(if m == 0 { v } else { f32::NEG_INFINITY });
        }
    }
    let max = top.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sums = [0.0f32; LANES];
    for (s, m) in scores.chunks_mut(LANES).zip(mask.chunks(LANES)) {
        for ((acc, v), &m) in sums.iter_mut().zip(s.iter_mut()).zip(m) {
            let e = exp_nonpositive(*v - max);
            *v = if m == 0 { e } else { 0.0 };
            *acc += *v;
        }
    }
    let sum: f32 = sums.iter().sum();
    let inv = 1.0 / sum;
    for v in scores.iter_mut() {
        *v *= inv;
    }
    max + sum.ln()
}

/// `exp(scores − lse)` in place, masked keys → 0 (the forward's probabilities); compiled
/// for AVX-512F when the CPU has it (same bits).
fn probs_row(scores: &mut [f32], mask: &[u8], lse: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::packed::supported() {
        // SAFETY: the CPU has AVX-512F.
        return unsafe { probs_row_avx512(scores, mask, lse) };
    }
    probs_lanes(scores, mask, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn probs_row_avx512(scores: &mut [f32], mask: &[u8], lse: f32) {
    probs_lanes(scores, mask, lse)
}

#[inline(always)]
fn probs_lanes(scores: &mut [f32], mask: &[u8], lse: f32) {
    for (s, &m) in scores.iter_mut().zip(mask) {
        let e = exp_nonpositive(*s - lse);
        *s = if m == 0 { e } else { 0.0 };
    }
}

/// Forward: `(out [b, h, s, d], lse [b, h, s])`. Rows with every key masked get the mean of
/// `v` and a log-sum-exp of `−1e30 + ln(keys)` (as the masked-fill reference computes it);
/// with `sinks` (`[heads]`), every row's softmax also counts `exp(sinks[h])` (folded into
/// its log-sum-exp) and a fully masked row gets zeros and `lse = sinks[h]`.
pub(crate) fn forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    mask: &FlexTensor,
    sinks: Option<&[f32]>,
    scale: f32,
    dims: Dims,
) -> (FlexTensor, FlexTensor) {
    let q = f32_data(q);
    // Keys and values in place when they are a cache's used part (see `head_matrices`).
    let ((k, k_stride), (v, v_stride)) = (head_matrices(k), head_matrices(v));
    let mask = mask_bytes(mask);
    let limits = row_limits(&mask, &dims);
    let firsts = row_firsts(&mask, &dims);
    let Dims {
        batch,
        heads,
        kv_heads,
        rows: s,
        keys: t,
        head_dim: d,
    } = dims;
    let group = dims.group();
    let masked_lse = -1.0e30f32 + (t as f32).ln();
    // Mean of v over all keys per (batch, kv head), for fully masked rows: only computed
    // when there is such a row (a decode step over a padded cache has none, and the pass
    // would read every value once more).
    let means: Vec<f32> = if limits.contains(&0) && sinks.is_none() {
        (0..batch * kv_heads)
            .flat_map(|bk| {
                let vs = &v[bk * v_stride..bk * v_stride + t * d];
                let mut mean = vec![0.0f32; d];
                for row in vs.chunks(d) {
                    for (m, x) in mean.iter_mut().zip(row) {
                        *m += x;
                    }
                }
                mean.iter_mut().for_each(|m| *m /= t.max(1) as f32);
                mean
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut out = vec![0.0f32; batch * heads * s * d];
    let mut lse = vec![0.0f32; batch * heads * s];
    if s == 1 && decode::applies(d) {
        // A decode step: one query row per head; each task takes a key/value head and the
        // query heads of its group, reading every cached key and value once.
        out.par_chunks_mut(group * d)
            .zip(lse.par_chunks_mut(group))
            .enumerate()
            .for_each(|(bk, (out, lse))| {
                let bi = bk / kv_heads;
                let (lim, maskb) = (limits[bi], &mask[bi * t..(bi + 1) * t]);
                let first = firsts[bi];
                // The sinks of this task's query heads.
                let sink_of = |g: usize| sinks.map(|x| x[(bk % kv_heads) * group + g]);
                if lim == 0 {
                    for (g, (o, l)) in out.chunks_mut(d).zip(lse.iter_mut()).enumerate() {
                        match sink_of(g) {
                            Some(sink) => {
                                o.fill(0.0);
                                *l = sink;
                            }
                            None => {
                                o.copy_from_slice(&means[bk * d..(bk + 1) * d]);
                                *l = masked_lse;
                            }
                        }
                    }
                    return;
                }
                let qs = &q[bk * group * d..(bk + 1) * group * d];
                let kh = &k[bk * k_stride + first * d..bk * k_stride + lim * d];
                let vh = &v[bk * v_stride + first * d..bk * v_stride + lim * d];
                decode::attend(qs, kh, vh, &maskb[first..lim], scale, d, out, lse);
                for (g, (o, l)) in out.chunks_mut(d).zip(lse.iter_mut()).enumerate() {
                    if let Some(sink) = sink_of(g) {
                        *l = fold_sink(*l, sink, o);
                    }
                }
            });
        return (
            tensor(out, &[batch, heads, s, d]),
            tensor(lse, &[batch, heads, s]),
        );
    }
    out.par_chunks_mut((s * d).max(1))
        .zip(lse.par_chunks_mut(s.max(1)))
        .enumerate()
        .for_each(|(bh, (out, lse))| {
            let (bi, h) = (bh / heads, bh % heads);
            let kv = bi * kv_heads + h / group;
            let qh = &q[bh * s * d..(bh + 1) * s * d];
            let kh = &k[kv * k_stride..kv * k_stride + t * d];
            let vh = &v[kv * v_stride..kv * v_stride + t * d];
            let maskb = &mask[bi * s * t..(bi + 1) * s * t];
            let lim = &limits[bi * s..(bi + 1) * s];
            let fst = &firsts[bi * s..(bi + 1) * s];
            let sink = sinks.map(|x| x[h]);
            // Scratch for one block's scores; every element a block reads it writes first.
            let mut scores = vec![0.0f32; BLOCK.min(s) * t];
            for r0 in (0..s).step_by(BLOCK) {
                let r1 = (r0 + BLOCK).min(s);
                let n = r1 - r0;
                // The block's keys: `k0..kk` (a sliding window starts past 0).
                let kk = block_keys(&lim[r0..r1]);
                let k0 = block_first(&fst[r0..r1], &lim[r0..r1]).min(kk);
                let w = kk - k0;
                if w > 0 {
                    let sc = &mut scores[..n * w];
                    scaled_scores(sc, &qh[r0 * d..r1 * d], &kh[k0 * d..], w, d, scale);
                    for (i, row) in sc.chunks_mut(w).enumerate() {
                        let r = r0 + i;
                        if lim[r] == 0 {
                            row.fill(0.0);
                        } else {
                            lse[r] = softmax_row(row, &maskb[r * t + k0..r * t + kk]);
                            if let Some(sink) = sink {
                                lse[r] = fold_sink(lse[r], sink, row);
                            }
                        }
                    }
                    matmul(
                        n,
                        d,
                        w,
                        &mut out[r0 * d..r1 * d],
                        d,
                        false,
                        sc,
                        (w, 1),
                        &vh[k0 * d..],
                        (d, 1),
                        1.0,
                    );
                }
                for r in r0..r1 {
                    if lim[r] == 0 {
                        match sink {
                            Some(sink) => {
                                out[r * d..(r + 1) * d].fill(0.0);
                                lse[r] = sink;
                            }
                            None => {
                                out[r * d..(r + 1) * d]
                                    .copy_from_slice(&means[kv * d..(kv + 1) * d]);
                                lse[r] = masked_lse;
                            }
                        }
                    }
                }
            }
        });
    (
        tensor(out, &[batch, heads, s, d]),
        tensor(lse, &[batch, heads, s]),
    )
}

/// Whether [`paged_decode`] takes head size `d` on this CPU.
pub(crate) fn decode_applies(d: usize) -> bool {
    decode::applies(d)
}

/// One decode step of attention over a paged pool (see [`crate::paged`]): `q`
/// `[batch · heads · d]`, `keys` / `values` `[kv_heads · slots, d]` (pool row
/// `h · slots + slot`); row `b` attends to its first `lens[b]` positions, position `p` at slot
/// `table[b · per_row + p / block] · block + p % block`. Each output is what the contiguous
/// decode loop computes over the same keys, bit for bit. The caller checked the sizes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    table: &[usize],
    lens: &[usize],
    block: usize,
    kv_heads: usize,
    heads: usize,
    d: usize,
    scale: f32,
) -> Vec<f32> {
    let batch = lens.len();
    let group = heads / kv_heads;
    let slots = keys.len() / (d * kv_heads);
    let per_row = table.len() / batch.max(1);
    let mut out = vec![0.0f32; batch * heads * d];
    // Pool rows of the keys and values of position block `i` of task `bk` (sequence
    // `bk / kv_heads`, key head `bk % kv_heads`).
    let block_range = |bk: usize, i: usize| {
        let (b, h) = (bk / kv_heads, bk % kv_heads);
        let start = (h * slots + table[b * per_row + i] * block) * d;
        start..start + block.min(lens[b] - i * block) * d
    };
    out.par_chunks_mut(group * d)
        .enumerate()
        .for_each(|(bk, out)| {
            let len = lens[bk / kv_heads];
            let blocks: Vec<(&[f32], &[f32])> = (0..len.div_ceil(block))
                .map(|i| {
                    let r = block_range(bk, i);
                    (&keys[r.clone()], &values[r])
                })
                .collect();
            // The next task's first keys, requested while this one runs.
            let following = match bk + 1 < batch * kv_heads {
                true => &keys[block_range(bk + 1, 0)],
                false => &[],
            };
            let mask = vec![0u8; len];
            let mut lse = vec![0.0f32; group];
            let qs = &q[bk * group * d..(bk + 1) * group * d];
            decode::attend_blocks(qs, &blocks, following, &mask, scale, d, out, &mut lse);
        });
    out
}

/// The one-row (decode) forward: direct AVX-512 loops instead of two `gemm` calls per head
/// (which pack their operands every call), so a decode step reads the cache at memory speed.
mod decode {
    use super::softmax_row;

    /// Whether the decode loops take head size `d` on this CPU.
    pub(super) fn applies(d: usize) -> bool {
        d > 0 && d.is_multiple_of(16) && d <= 256 && crate::packed::supported()
    }

    /// For each query row `g` of `qs` (`[group, d]`): scores `scale · q_g · k_j` over the
    /// `keys.len() / d` keys (masked where `mask[j] ≠ 0`), their softmax (as
    /// [`softmax_row`]) and `out_g = Σ_j p_gj · v_j`; `lse[g]` the log-sum-exp.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        qs: &[f32],
        keys: &[f32],
        values: &[f32],
        mask: &[u8],
        scale: f32,
        d: usize,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        attend_blocks(qs, &[(keys, values)], &[], mask, scale, d, out, lse);
    }

    /// [`attend`] over keys and values stored in blocks (a paged cache): `blocks[i]` holds
    /// the keys and values of consecutive positions, in order. Every output is computed as
    /// [`attend`] computes it over the same keys stored contiguously, bit for bit. While a
    /// block's scores run, its values and the next block's keys (after the last block,
    /// `following`) are prefetched: the hardware prefetcher stops at every page boundary,
    /// and a pool's blocks need not be adjacent.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_blocks(
        qs: &[f32],
        blocks: &[(&[f32], &[f32])],
        following: &[f32],
        mask: &[u8],
        scale: f32,
        d: usize,
        out: &mut [f32],
        lse: &mut [f32],
    ) {
        let group = qs.len() / d;
        let t: usize = blocks.iter().map(|(k, _)| k.len() / d).sum();
        let mut scores = vec![0.0f32; group * t];
        let mut offset = 0;
        for (i, (keys, values)) in blocks.iter().enumerate() {
            let next = blocks.get(i + 1).map_or(following, |(k, _)| k);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `applies` checked AVX-512F; the slices are sized as documented.
            unsafe {
                avx512::scores(qs, keys, values, next, d, scale, &mut scores, t, offset)
            };
            offset += keys.len() / d;
        }
        for (g, row) in scores.chunks_mut(t.max(1)).enumerate().take(group) {
            lse[g] = softmax_row(row, mask);
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        unsafe {
            avx512::weighted_sum(&scores, t, blocks, d, out)
        };
    }

    #[cfg(target_arch = "x86_64")]
    mod avx512 {
        use std::arch::x86_64::*;

        use super::super::LANES;

        /// `scores[g · t + offset + j] = scale · Σ_c qs[g · d + c] · keys[j · d + c]`,
        /// `d % 16 = 0`; prefetches `values` (as long as `keys`) and as much of `next` while
        /// it runs.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f")]
        pub(super) fn scores(
            qs: &[f32],
            keys: &[f32],
            values: &[f32],
            next: &[f32],
            d: usize,
            scale: f32,
            scores: &mut [f32],
            t: usize,
            offset: usize,
        ) {
            let n = keys.len() / d;
            for (g, q) in qs.chunks_exact(d).enumerate() {
                let row = &mut scores[g * t + offset..g * t + offset + n];
                for (j, (s, key)) in row.iter_mut().zip(keys.chunks_exact(d)).enumerate() {
                    if g == 0 {
                        for v in values[j * d..(j + 1) * d].chunks(LANES) {
                            _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().cast());
                        }
                        for v in next
                            .get(j * d..(j + 1) * d)
                            .unwrap_or_default()
                            .chunks(LANES)
                        {
                            _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().cast());
                        }
                    }
                    let mut acc = _mm512_setzero_ps();
                    for (qc, kc) in q.chunks_exact(16).zip(key.chunks_exact(16)) {
                        // SAFETY: both chunks hold 16 values.
                        let (a, b) =
                            unsafe { (_mm512_loadu_ps(qc.as_ptr()), _mm512_loadu_ps(kc.as_ptr())) };
                        acc = _mm512_fmadd_ps(a, b, acc);
                    }
                    *s = scale * _mm512_reduce_add_ps(acc);
                }
            }
        }

        /// `out[g · d + c] = Σ_j probs[g · t + j] · v_j[c]` over the values of `blocks` in
        /// order (`t` of them), `d % 16 = 0`, `d ≤ 256`.
        #[target_feature(enable = "avx512f")]
        pub(super) fn weighted_sum(
            probs: &[f32],
            t: usize,
            blocks: &[(&[f32], &[f32])],
            d: usize,
            out: &mut [f32],
        ) {
            for (p, o) in probs.chunks_exact(t.max(1)).zip(out.chunks_exact_mut(d)) {
                let mut acc = [_mm512_setzero_ps(); 16];
                let lanes = d / 16;
                let mut weights = p.iter();
                for (_, values) in blocks {
                    // Values first: `zip` stops on them without taking a weight.
                    for (v, &w) in values.chunks_exact(d).zip(weights.by_ref()) {
                        let w = _mm512_set1_ps(w);
                        for (a, vc) in acc[..lanes].iter_mut().zip(v.chunks_exact(16)) {
                            // SAFETY: the chunk holds 16 values.
                            let x = unsafe { _mm512_loadu_ps(vc.as_ptr()) };
                            *a = _mm512_fmadd_ps(w, x, *a);
                        }
                    }
                }
                for (a, oc) in acc[..lanes].iter().zip(o.chunks_exact_mut(16)) {
                    // SAFETY: the chunk holds 16 values.
                    unsafe { _mm512_storeu_ps(oc.as_mut_ptr(), *a) };
                }
            }
        }
    }
}

/// Backward: `(dq, dk, dv, dsinks)` for upstream `grad` `[b, h, s, d]`, from the forward's
/// `out` and `lse` (with `sinks`, the log-sum-exp includes the sink, so the probabilities
/// recomputed from it are the sinked ones; `∂sinks[h] = −Σ_rows exp(sinks[h] − lse)·δ`,
/// `δ = Σ ∂O ⊙ O`).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn backward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    mask: &FlexTensor,
    sinks: Option<&[f32]>,
    out: &FlexTensor,
    lse: &FlexTensor,
    grad: &FlexTensor,
    scale: f32,
    dims: Dims,
) -> (FlexTensor, FlexTensor, FlexTensor, Option<FlexTensor>) {
    let (q, k, v) = (f32_data(q), f32_data(k), f32_data(v));
    let (o, lse, go) = (f32_data(out), f32_data(lse), f32_data(grad));
    let mask = mask_bytes(mask);
    let limits = row_limits(&mask, &dims);
    let firsts = row_firsts(&mask, &dims);
    let Dims {
        batch,
        heads,
        kv_heads,
        rows: s,
        keys: t,
        head_dim: d,
    } = dims;
    let group = dims.group();
    let mut dq = vec![0.0f32; batch * heads * s * d];
    let mut dk = vec![0.0f32; batch * kv_heads * t * d];
    let mut dv = vec![0.0f32; batch * kv_heads * t * d];
    // Per (batch, head): its part of `∂sinks`.
    let mut dsink = vec![0.0f32; batch * heads];
    dq.par_chunks_mut((group * s * d).max(1))
        .zip(dk.par_chunks_mut((t * d).max(1)))
        .zip(dv.par_chunks_mut((t * d).max(1)))
        .zip(dsink.par_chunks_mut(group.max(1)))
        .enumerate()
        .for_each(|(kv, (((dq, dk), dv), dsink))| {
            let bi = kv / kv_heads;
            let kh = &k[kv * t * d..(kv + 1) * t * d];
            let vh = &v[kv * t * d..(kv + 1) * t * d];
            let maskb = &mask[bi * s * t..(bi + 1) * s * t];
            let lim = &limits[bi * s..(bi + 1) * s];
            let fst = &firsts[bi * s..(bi + 1) * s];
            let mut probs = vec![0.0f32; BLOCK * t];
            let mut dscores = vec![0.0f32; BLOCK * t];
            for g in 0..group {
                let bh = bi * heads + (kv % kv_heads) * group + g;
                let span = bh * s * d..(bh + 1) * s * d;
                let (qh, oh, goh) = (&q[span.clone()], &o[span.clone()], &go[span]);
                let lseh = &lse[bh * s..(bh + 1) * s];
                let dqh = &mut dq[g * s * d..(g + 1) * s * d];
                if let Some(sinks) = sinks {
                    let sink = sinks[bh % heads];
                    dsink[g] = -(0..s)
                        .map(|r| {
                            let delta: f32 = goh[r * d..(r + 1) * d]
                                .iter()
                                .zip(&oh[r * d..(r + 1) * d])
                                .map(|(a, b)| a * b)
                                .sum();
                            (sink - lseh[r]).exp() * delta
                        })
                        .sum::<f32>();
                }
                for r0 in (0..s).step_by(BLOCK) {
                    let r1 = (r0 + BLOCK).min(s);
                    let n = r1 - r0;
                    // Fully masked rows: uniform weights over all keys reach v only (with
                    // sinks, every weight is the sink's: nothing).
                    for r in r0..r1 {
                        if lim[r] == 0 && t > 0 && sinks.is_none() {
                            let w = 1.0 / t as f32;
                            let g_row = &goh[r * d..(r + 1) * d];
                            for dv_row in dv.chunks_mut(d) {
                                for (x, gr) in dv_row.iter_mut().zip(g_row) {
                                    *x += w * gr;
                                }
                            }
                        }
                    }
                    let kk = block_keys(&lim[r0..r1]);
                    let k0 = block_first(&fst[r0..r1], &lim[r0..r1]).min(kk);
                    let kw = kk - k0;
                    if kw == 0 {
                        continue;
                    }
                    let (kh, vh) = (&kh[k0 * d..], &vh[k0 * d..]);
                    let p = &mut probs[..n * kw];
                    scaled_scores(p, &qh[r0 * d..r1 * d], kh, kw, d, scale);
                    for (i, row) in p.chunks_mut(kw).enumerate() {
                        let r = r0 + i;
                        if lim[r] == 0 {
                            row.fill(0.0);
                        } else {
                            probs_row(row, &maskb[r * t + k0..r * t + kk], lseh[r]);
                        }
                    }
                    // dP = dO·vᵀ, then dS = P ⊙ (dP − rowsum(dO ⊙ O)).
                    let ds = &mut dscores[..n * kw];
                    matmul(
                        n,
                        kw,
                        d,
                        ds,
                        kw,
                        false,
                        &goh[r0 * d..r1 * d],
                        (d, 1),
                        vh,
                        (1, d),
                        1.0,
                    );
                    for (i, (ds_row, p_row)) in ds.chunks_mut(kw).zip(p.chunks(kw)).enumerate() {
                        let r = r0 + i;
                        let delta: f32 = goh[r * d..(r + 1) * d]
                            .iter()
                            .zip(&oh[r * d..(r + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum();
                        for (x, &pv) in ds_row.iter_mut().zip(p_row) {
                            *x = pv * (*x - delta);
                        }
                    }
                    // dQ = scale·dS·k; dK += scale·dSᵀ·q; dV += Pᵀ·dO.
                    matmul(
                        n,
                        d,
                        kw,
                        &mut dqh[r0 * d..r1 * d],
                        d,
                        false,
                        ds,
                        (kw, 1),
                        kh,
                        (d, 1),
                        scale,
                    );
                    matmul(
                        kw,
                        d,
                        n,
                        &mut dk[k0 * d..kk * d],
                        d,
                        true,
                        ds,
                        (1, kw),
                        &qh[r0 * d..r1 * d],
                        (d, 1),
                        scale,
                    );
                    matmul(
                        kw,
                        d,
                        n,
                        &mut dv[k0 * d..kk * d],
                        d,
                        true,
                        p,
                        (1, kw),
                        &goh[r0 * d..r1 * d],
                        (d, 1),
                        1.0,
                    );
                }
            }
        });
    let dsinks = sinks.map(|_| {
        let per_head: Vec<f32> = (0..heads)
            .map(|h| (0..batch).map(|b| dsink[b * heads + h]).sum())
            .collect();
        tensor(per_head, &[heads])
    });
    (
        tensor(dq, &[batch, heads, s, d]),
        tensor(dk, &[batch, kv_heads, t, d]),
        tensor(dv, &[batch, kv_heads, t, d]),
        dsinks,
    )
}

/// Whether the flex kernels take these tensors (`f32` floats).
pub(crate) fn supported(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor) -> bool {
    [q, k, v].iter().all(|t| t.dtype() == DType::F32)
}

/// The dims of a call, from `q` `[b, h, s, d]` and `k` `[b, hkv, t, d]`.
pub(crate) fn dims_of(q: &Shape, k: &Shape) -> Dims {
    Dims {
        batch: q[0],
        heads: q[1],
        kv_heads: k[1],
        rows: q[2],
        keys: k[2],
        head_dim: q[3],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 softmax against the generic lane loop: the same bits, for rows of every
    /// length around the lane count, masked keys anywhere (masked scores above the max
    /// included), and large score ranges.
    #[test]
    fn avx512_softmax_has_the_generic_bits() {
        if !crate::packed::supported() {
            return;
        }
        let mut state = 12345u64;
        let mut next = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695);
            (state >> 33) as u32
        };
        for len in (1..70).chain([128, 255, 512]) {
            for round in 0..6 {
                let scale = [0.1f32, 1.0, 10.0, 40.0, 100.0, 1.0][round];
                let scores: Vec<f32> = (0..len)
                    .map(|_| (next() as f32 / u32::MAX as f32 - 0.5) * scale)
                    .collect();
                let mut mask: Vec<u8> = (0..len).map(|_| u8::from(next() % 4 == 0)).collect();
                if round == 5 {
                    mask.iter_mut().for_each(|m| *m = 0);
                }
                if mask.iter().all(|&m| m != 0) {
                    mask[len / 2] = 0;
                }
                let mut scores = scores;
                // A masked score far above the others: masked lanes must not leak.
                if let Some(j) = mask.iter().position(|&m| m != 0) {
                    scores[j] = 1.0e30;
                }
                let (mut a, mut b) = (scores.clone(), scores.clone());
                let la = softmax_lanes(&mut a, &mask);
                // SAFETY: `supported` checked AVX-512F.
                let lb = unsafe { softmax_row_avx512(&mut b, &mask) };
                assert_eq!(la.to_bits(), lb.to_bits(), "lse, len {len} round {round}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "probabilities, len {len} round {round}");
            }
        }
    }

    #[test]
    fn row_limits_find_the_last_unmasked_key() {
        let dims = Dims {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            rows: 3,
            keys: 4,
            head_dim: 1,
        };
        let mask = [0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 1, 1];
        assert_eq!(row_limits(&mask, &dims), vec![1, 4, 0]);
    }
}
