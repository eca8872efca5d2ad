//! Native `Flex` loops of the chunked gated delta rule ([`crate::gated_delta_rule_chunked`]),
//! forward and backward, over contiguous `f32` tensors: one rayon task per (batch, value
//! head), its chunks of at most [`crate::DELTA_CHUNK`] tokens walked in order (backwards for
//! the gradients), every product a `gemm` call on the task's thread.
//!
//! Per chunk of `c` tokens (`γ` the cumulative log decay inside the chunk, `Γᵢⱼ = e^{γᵢ−γⱼ}`
//! for `j ≤ i`, `kb = β·k`, `vb = β·v`):
//! `L = strict_lower(kb kᵀ ⊙ Γ)`, `T = (I + L)⁻¹` (forward substitution, row by row),
//! `U = T vb`, `W = T (e^γ ⊙ kb)`, `A = lower(q kᵀ ⊙ Γ)`; with the state `S` entering the
//! chunk: `V = U − W S`, `O = (e^γ ⊙ q) S + A V`,
//! `S ← e^{γ_last} S + (e^{γ_last−γ} ⊙ k)ᵀ V`. The forward keeps the state entering each
//! chunk when a backward will follow; the backward recomputes the chunk-local products and
//! applies the chain rule to each of the lines above, last chunk first. Several key heads
//! serve groups of consecutive value heads (Qwen3.5's `num_k_heads < num_v_heads`): the
//! tasks run per value head and the key heads' gradients are the sums over their groups.

use burn::backend::{Flex, tensor::FloatTensor};
use rayon::prelude::*;

use super::gemm::matmul;
use super::tensor::{dims, f32_data, tensor};

type FlexTensor = FloatTensor<Flex>;

/// Tokens per chunk ([`crate::DELTA_CHUNK`], defined here so the op's file reads it from its
/// loops).
pub(crate) const DELTA_CHUNK: usize = 64;

/// Sizes of one call.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    batch: usize,
    key_heads: usize,
    heads: usize,
    tokens: usize,
    dk: usize,
    dv: usize,
}

impl Sizes {
    fn of(q: &FlexTensor, v: &FlexTensor) -> Self {
        let (qd, vd) = (dims(q), dims(v));
        Self {
            batch: qd[0],
            key_heads: qd[1],
            heads: vd[1],
            tokens: qd[2],
            dk: qd[3],
            dv: vd[3],
        }
    }

    /// The (batch · key head) row of the value row `bh` (batch · value head).
    fn key_row(&self, bh: usize) -> usize {
        let (b, h) = (bh / self.heads, bh % self.heads);
        b * self.key_heads + h / (self.heads / self.key_heads.max(1)).max(1)
    }

    fn chunks(&self) -> usize {
        self.tokens.div_ceil(DELTA_CHUNK)
    }
}

/// One chunk's inputs for one (batch, value head).
struct ChunkIn<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

/// The chunk-local products of one chunk (see the module docs).
struct Local {
    c: usize,
    gamma: Vec<f32>,
    /// `Γ`, `[c, c]`, zero above the diagonal.
    decay: Vec<f32>,
    kb: Vec<f32>,
    vb: Vec<f32>,
    /// `e^γ ⊙ kb`.
    kbe: Vec<f32>,
    /// `L` (strictly lower).
    l: Vec<f32>,
    /// `T = (I + L)⁻¹` (unit lower).
    t: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    /// `A` (lower, diagonal included).
    a: Vec<f32>,
}

fn local(x: &ChunkIn<'_>, dk: usize, dv: usize) -> Local {
    let c = x.g.len();
    let mut gamma = Vec::with_capacity(c);
    let mut acc = 0.0f32;
    for &g in x.g {
        acc += g;
        gamma.push(acc);
    }
    let mut decay = vec![0.0f32; c * c];
    for i in 0..c {
        for j in 0..=i {
            decay[i * c + j] = (gamma[i] - gamma[j]).exp();
        }
    }
    let kb = scaled(x.k, dk, |i| x.beta[i]);
    let vb = scaled(x.v, dv, |i| x.beta[i]);
    let kbe = scaled(&kb, dk, |i| gamma[i].exp());
    // kb·kᵀ and q·kᵀ, then the masks and Γ.
    let mut l = vec![0.0f32; c * c];
    matmul(c, c, dk, &mut l, c, false, &kb, (dk, 1), x.k, (1, dk), 1.0);
    let mut a = vec![0.0f32; c * c];
    matmul(c, c, dk, &mut a, c, false, x.q, (dk, 1), x.k, (1, dk), 1.0);
    for i in 0..c {
        for j in 0..c {
            let at = i * c + j;
            l[at] = if j < i { l[at] * decay[at] } else { 0.0 };
            a[at] = if j <= i { a[at] * decay[at] } else { 0.0 };
        }
    }
    // T = I − L·T, row by row (row i needs the rows above it).
    let mut t = vec![0.0f32; c * c];
    for i in 0..c {
        let (above, rest) = t.split_at_mut(i * c);
        let row = &mut rest[..c];
        for m in 0..i {
            let lm = l[i * c + m];
            if lm != 0.0 {
                for (r, &tm) in row[..=m].iter_mut().zip(&above[m * c..m * c + m + 1]) {
                    *r -= lm * tm;
                }
            }
        }
        row[i] = 1.0;
    }
    let mut u = vec![0.0f32; c * dv];
    matmul(c, dv, c, &mut u, dv, false, &t, (c, 1), &vb, (dv, 1), 1.0);
    let mut w = vec![0.0f32; c * dk];
    matmul(c, dk, c, &mut w, dk, false, &t, (c, 1), &kbe, (dk, 1), 1.0);
    Local {
        c,
        gamma,
        decay,
        kb,
        vb,
        kbe,
        l,
        t,
        u,
        w,
        a,
    }
}

/// The inputs of chunk `n` of value row `bh`.
#[allow(clippy::too_many_arguments)]
fn chunk_in<'a>(
    s: &Sizes,
    bh: usize,
    n: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
) -> ChunkIn<'a> {
    let (t, dk, dv) = (s.tokens, s.dk, s.dv);
    let start = n * DELTA_CHUNK;
    let c = DELTA_CHUNK.min(t - start);
    let kr = s.key_row(bh);
    let kq = (kr * t + start) * dk..(kr * t + start + c) * dk;
    ChunkIn {
        q: &q[kq.clone()],
        k: &k[kq],
        v: &v[(bh * t + start) * dv..(bh * t + start + c) * dv],
        g: &g[bh * t + start..bh * t + start + c],
        beta: &beta[bh * t + start..bh * t + start + c],
    }
}

/// Rows of `src` (`[c, d]`) scaled by `f(row)`.
fn scaled(src: &[f32], d: usize, f: impl Fn(usize) -> f32) -> Vec<f32> {
    let mut out = src.to_vec();
    for (i, row) in out.chunks_mut(d).enumerate() {
        let s = f(i);
        row.iter_mut().for_each(|x| *x *= s);
    }
    out
}

/// The forward: `[b, h, t + dk, dv]` (per value row its outputs `[t, dv]` then its final
/// state `[dk, dv]`), and, when `keep_states`, the state entering every chunk
/// `[b, h, chunks, dk, dv]` (else an empty tensor).
pub(crate) fn forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    decay: &FlexTensor,
    beta: &FlexTensor,
    initial: &FlexTensor,
    keep_states: bool,
) -> (FlexTensor, FlexTensor) {
    let s = Sizes::of(q, v);
    let (q, k, v) = (f32_data(q), f32_data(k), f32_data(v));
    let (g, beta, initial) = (f32_data(decay), f32_data(beta), f32_data(initial));
    let (t, dk, dv) = (s.tokens, s.dk, s.dv);
    let rows = s.batch * s.heads;
    let chunks = s.chunks();
    let per_row = (t + dk) * dv;
    let per_states = if keep_states { chunks * dk * dv } else { 0 };
    let mut out = vec![0.0f32; rows * per_row];
    // One kept-state slot per row even when none is kept, so the zip pairs every row.
    let mut states = vec![0.0f32; rows * per_states.max(1)];
    out.par_chunks_mut(per_row.max(1))
        .zip(states.par_chunks_mut(per_states.max(1)))
        .enumerate()
        .for_each(|(bh, (o, kept))| {
            let (o, state_out) = o.split_at_mut(t * dv);
            let mut st = initial[bh * dk * dv..(bh + 1) * dk * dv].to_vec();
            for n in 0..chunks {
                if keep_states {
                    kept[n * dk * dv..(n + 1) * dk * dv].copy_from_slice(&st);
                }
                let x = chunk_in(&s, bh, n, &q, &k, &v, &g, &beta);
                let lo = local(&x, dk, dv);
                let c = lo.c;
                // V = U − W S.
                let mut vn = lo.u.clone();
                matmul(
                    c,
                    dv,
                    dk,
                    &mut vn,
                    dv,
                    true,
                    &lo.w,
                    (dk, 1),
                    &st,
                    (dv, 1),
                    -1.0,
                );
                // O = (e^γ ⊙ q) S + A V.
                let qe = scaled(x.q, dk, |i| lo.gamma[i].exp());
                let o = &mut o[n * DELTA_CHUNK * dv..(n * DELTA_CHUNK + c) * dv];
                matmul(c, dv, dk, o, dv, false, &qe, (dk, 1), &st, (dv, 1), 1.0);
                matmul(c, dv, c, o, dv, true, &lo.a, (c, 1), &vn, (dv, 1), 1.0);
                // S ← e^{γ_last} S + (e^{γ_last − γ} ⊙ k)ᵀ V.
                let last = lo.gamma[c - 1];
                let el = last.exp();
                st.iter_mut().for_each(|x| *x *= el);
                let kd = scaled(x.k, dk, |i| (last - lo.gamma[i]).exp());
                matmul(
                    dk,
                    dv,
                    c,
                    &mut st,
                    dv,
                    true,
                    &kd,
                    (1, dk),
                    &vn,
                    (dv, 1),
                    1.0,
                );
            }
            state_out.copy_from_slice(&st);
        });
    let states = if keep_states {
        tensor(states, &[s.batch, s.heads, chunks, dk, dv])
    } else {
        tensor(Vec::new(), &[0])
    };
    (tensor(out, &[s.batch, s.heads, t + dk, dv]), states)
}

/// One value row's gradients.
struct RowGrads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    dg: Vec<f32>,
    dbeta: Vec<f32>,
    dinitial: Vec<f32>,
}

/// `dst += src`, element-wise.
fn add(dst: &mut [f32], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
}

/// Row dot products of two `[c, d]` matrices.
fn row_dots(a: &[f32], b: &[f32], d: usize) -> Vec<f32> {
    a.chunks(d)
        .zip(b.chunks(d))
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p * q).sum())
        .collect()
}

/// The backward of one chunk: adds into the row's gradients at `start`, and turns `ds` (the
/// gradient of the state leaving the chunk) into the gradient of the state entering it.
#[allow(clippy::too_many_arguments)]
fn chunk_backward(
    x: &ChunkIn<'_>,
    st: &[f32],
    d_out: &[f32],
    ds: &mut Vec<f32>,
    dk: usize,
    dv: usize,
    start: usize,
    r: &mut RowGrads,
) {
    let lo = local(x, dk, dv);
    let c = lo.c;
    let mut vn = lo.u.clone();
    matmul(
        c,
        dv,
        dk,
        &mut vn,
        dv,
        true,
        &lo.w,
        (dk, 1),
        st,
        (dv, 1),
        -1.0,
    );
    let last = lo.gamma[c - 1];
    let el = last.exp();
    let qe = scaled(x.q, dk, |i| lo.gamma[i].exp());
    let kd = scaled(x.k, dk, |i| (last - lo.gamma[i]).exp());
    let mut dgamma = vec![0.0f32; c];
    let mut dlast = 0.0f32;
    // dV = Aᵀ dO + kd dS.
    let mut dvn = vec![0.0f32; c * dv];
    matmul(
        c,
        dv,
        c,
        &mut dvn,
        dv,
        false,
        &lo.a,
        (1, c),
        d_out,
        (dv, 1),
        1.0,
    );
    matmul(
        c,
        dv,
        dk,
        &mut dvn,
        dv,
        true,
        &kd,
        (dk, 1),
        ds,
        (dv, 1),
        1.0,
    );
    // dA = dO Vᵀ (lower): into q and k through q kᵀ ⊙ Γ; E = dΓ ⊙ Γ collects the decays'.
    let mut da = vec![0.0f32; c * c];
    matmul(
        c,
        c,
        dv,
        &mut da,
        c,
        false,
        d_out,
        (dv, 1),
        &vn,
        (1, dv),
        1.0,
    );
    let mut e = vec![0.0f32; c * c];
    for i in 0..c {
        for j in 0..c {
            let at = i * c + j;
            if j <= i {
                e[at] = da[at] * lo.a[at];
                da[at] *= lo.decay[at];
            } else {
                da[at] = 0.0;
            }
        }
    }
    let mut dq = vec![0.0f32; c * dk];
    let mut dkk = vec![0.0f32; c * dk];
    // (e^γ ⊙ q) S: d(qe) = dO Sᵀ.
    let mut dqe = vec![0.0f32; c * dk];
    matmul(
        c,
        dk,
        dv,
        &mut dqe,
        dk,
        false,
        d_out,
        (dv, 1),
        st,
        (1, dv),
        1.0,
    );
    for (i, d) in row_dots(&qe, &dqe, dk).into_iter().enumerate() {
        dgamma[i] += d;
    }
    for (i, (dst, src)) in dq.chunks_mut(dk).zip(dqe.chunks(dk)).enumerate() {
        let s = lo.gamma[i].exp();
        dst.iter_mut().zip(src).for_each(|(d, x)| *d = s * x);
    }
    matmul(c, dk, c, &mut dq, dk, true, &da, (c, 1), x.k, (dk, 1), 1.0);
    matmul(c, dk, c, &mut dkk, dk, true, &da, (1, c), x.q, (dk, 1), 1.0);
    // The state update: d(kd) = V dSᵀ; dγ_last from e^{γ_last} S and kd.
    let mut dkd = vec![0.0f32; c * dk];
    matmul(
        c,
        dk,
        dv,
        &mut dkd,
        dk,
        false,
        &vn,
        (dv, 1),
        ds,
        (1, dv),
        1.0,
    );
    for (i, rr) in row_dots(&kd, &dkd, dk).into_iter().enumerate() {
        dgamma[i] -= rr;
        dlast += rr;
    }
    for (i, (dst, src)) in dkk.chunks_mut(dk).zip(dkd.chunks(dk)).enumerate() {
        let s = (last - lo.gamma[i]).exp();
        dst.iter_mut().zip(src).for_each(|(d, x)| *d += s * x);
    }
    dlast += el * st.iter().zip(ds.iter()).map(|(a, b)| a * b).sum::<f32>();
    // dS entering = e^{γ_last} dS + qeᵀ dO − Wᵀ dV.
    let mut prev = vec![0.0f32; dk * dv];
    matmul(
        dk,
        dv,
        c,
        &mut prev,
        dv,
        false,
        &qe,
        (1, dk),
        d_out,
        (dv, 1),
        1.0,
    );
    matmul(
        dk,
        dv,
        c,
        &mut prev,
        dv,
        true,
        &lo.w,
        (1, dk),
        &dvn,
        (dv, 1),
        -1.0,
    );
    prev.iter_mut()
        .zip(ds.iter())
        .for_each(|(p, d)| *p += el * d);
    // V = U − W S: dU = dV, dW = −dV Sᵀ; U = T vb, W = T kbe.
    let mut dw = vec![0.0f32; c * dk];
    matmul(
        c,
        dk,
        dv,
        &mut dw,
        dk,
        false,
        &dvn,
        (dv, 1),
        st,
        (1, dv),
        -1.0,
    );
    let mut dt = vec![0.0f32; c * c];
    matmul(
        c,
        c,
        dv,
        &mut dt,
        c,
        false,
        &dvn,
        (dv, 1),
        &lo.vb,
        (1, dv),
        1.0,
    );
    matmul(
        c,
        c,
        dk,
        &mut dt,
        c,
        true,
        &dw,
        (dk, 1),
        &lo.kbe,
        (1, dk),
        1.0,
    );
    let mut dvb = vec![0.0f32; c * dv];
    matmul(
        c,
        dv,
        c,
        &mut dvb,
        dv,
        false,
        &lo.t,
        (1, c),
        &dvn,
        (dv, 1),
        1.0,
    );
    let mut dkbe = vec![0.0f32; c * dk];
    matmul(
        c,
        dk,
        c,
        &mut dkbe,
        dk,
        false,
        &lo.t,
        (1, c),
        &dw,
        (dk, 1),
        1.0,
    );
    for (i, d) in row_dots(&lo.kbe, &dkbe, dk).into_iter().enumerate() {
        dgamma[i] += d;
    }
    let mut dkb = dkbe;
    for (i, row) in dkb.chunks_mut(dk).enumerate() {
        let s = lo.gamma[i].exp();
        row.iter_mut().for_each(|x| *x *= s);
    }
    // T = (I + L)⁻¹: dL = −Tᵀ dT Tᵀ (strictly lower), L = kb kᵀ ⊙ Γ.
    let mut tmp = vec![0.0f32; c * c];
    matmul(c, c, c, &mut tmp, c, false, &lo.t, (1, c), &dt, (c, 1), 1.0);
    let mut dl = vec![0.0f32; c * c];
    matmul(
        c,
        c,
        c,
        &mut dl,
        c,
        false,
        &tmp,
        (c, 1),
        &lo.t,
        (1, c),
        -1.0,
    );
    for i in 0..c {
        for j in 0..c {
            let at = i * c + j;
            if j < i {
                e[at] += dl[at] * lo.l[at];
                dl[at] *= lo.decay[at];
            } else {
                dl[at] = 0.0;
            }
        }
    }
    matmul(c, dk, c, &mut dkb, dk, true, &dl, (c, 1), x.k, (dk, 1), 1.0);
    matmul(
        c,
        dk,
        c,
        &mut dkk,
        dk,
        true,
        &dl,
        (1, c),
        &lo.kb,
        (dk, 1),
        1.0,
    );
    // Γᵢⱼ = e^{γᵢ − γⱼ}: row sums in, column sums out.
    for i in 0..c {
        for j in 0..=i {
            let x = e[i * c + j];
            dgamma[i] += x;
            dgamma[j] -= x;
        }
    }
    // kb = β k, vb = β v.
    let db: Vec<f32> = row_dots(x.k, &dkb, dk)
        .into_iter()
        .zip(row_dots(x.v, &dvb, dv))
        .map(|(a, b)| a + b)
        .collect();
    for (i, (dst, src)) in dkk.chunks_mut(dk).zip(dkb.chunks(dk)).enumerate() {
        let s = x.beta[i];
        dst.iter_mut().zip(src).for_each(|(d, x)| *d += s * x);
    }
    for (i, row) in dvb.chunks_mut(dv).enumerate() {
        let s = x.beta[i];
        row.iter_mut().for_each(|x| *x *= s);
    }
    // γ = cumsum(g): dg = reverse cumsum of dγ.
    dgamma[c - 1] += dlast;
    let mut acc = 0.0f32;
    for i in (0..c).rev() {
        acc += dgamma[i];
        r.dg[start + i] = acc;
    }
    r.dbeta[start..start + c].copy_from_slice(&db);
    add(&mut r.dq[start * dk..(start + c) * dk], &dq);
    add(&mut r.dk[start * dk..(start + c) * dk], &dkk);
    r.dv[start * dv..(start + c) * dv].copy_from_slice(&dvb);
    *ds = prev;
}

/// The backward: `grad` is the gradient of the forward's `[b, h, t + dk, dv]` result,
/// `states` the states it kept. Returns `(dq, dk, dv, d_decay, d_beta, d_initial)` shaped
/// as the inputs.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn backward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    decay: &FlexTensor,
    beta: &FlexTensor,
    states: &FlexTensor,
    grad: &FlexTensor,
) -> (
    FlexTensor,
    FlexTensor,
    FlexTensor,
    FlexTensor,
    FlexTensor,
    FlexTensor,
) {
    let s = Sizes::of(q, v);
    let (q, k, v) = (f32_data(q), f32_data(k), f32_data(v));
    let (g, beta) = (f32_data(decay), f32_data(beta));
    let (states, grad) = (f32_data(states), f32_data(grad));
    let (t, dk, dv) = (s.tokens, s.dk, s.dv);
    let rows = s.batch * s.heads;
    let chunks = s.chunks();
    let per_row = (t + dk) * dv;
    let parts: Vec<RowGrads> = (0..rows)
        .into_par_iter()
        .map(|bh| {
            let gr = &grad[bh * per_row..(bh + 1) * per_row];
            let (d_out, d_final) = gr.split_at(t * dv);
            let mut r = RowGrads {
                dq: vec![0.0; t * dk],
                dk: vec![0.0; t * dk],
                dv: vec![0.0; t * dv],
                dg: vec![0.0; t],
                dbeta: vec![0.0; t],
                dinitial: Vec::new(),
            };
            let mut ds = d_final.to_vec();
            for n in (0..chunks).rev() {
                let x = chunk_in(&s, bh, n, &q, &k, &v, &g, &beta);
                let start = n * DELTA_CHUNK;
                let c = x.g.len();
                let at = (bh * chunks + n) * dk * dv;
                let st = &states[at..at + dk * dv];
                let d_o = &d_out[start * dv..(start + c) * dv];
                chunk_backward(&x, st, d_o, &mut ds, dk, dv, start, &mut r);
            }
            r.dinitial = ds;
            r
        })
        .collect();
    let mut dq = vec![0.0f32; s.batch * s.key_heads * t * dk];
    let mut dkk = vec![0.0f32; s.batch * s.key_heads * t * dk];
    let mut dvv = Vec::with_capacity(rows * t * dv);
    let mut dg = Vec::with_capacity(rows * t);
    let mut db = Vec::with_capacity(rows * t);
    let mut di = Vec::with_capacity(rows * dk * dv);
    // Value rows in order: each key row sums its group's gradients in head order.
    for (bh, r) in parts.into_iter().enumerate() {
        let kr = s.key_row(bh);
        add(&mut dq[kr * t * dk..(kr + 1) * t * dk], &r.dq);
        add(&mut dkk[kr * t * dk..(kr + 1) * t * dk], &r.dk);
        dvv.extend_from_slice(&r.dv);
        dg.extend_from_slice(&r.dg);
        db.extend_from_slice(&r.dbeta);
        di.extend_from_slice(&r.dinitial);
    }
    let (b, hk, h) = (s.batch, s.key_heads, s.heads);
    (
        tensor(dq, &[b, hk, t, dk]),
        tensor(dkk, &[b, hk, t, dk]),
        tensor(dvv, &[b, h, t, dv]),
        tensor(dg, &[b, h, t]),
        tensor(db, &[b, h, t]),
        tensor(di, &[b, h, dk, dv]),
    )
}
