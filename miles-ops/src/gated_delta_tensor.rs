//! The chunked gated delta rule's forward and explicit backward in batched tensor ops (no
//! autodiff graph): what [`crate::ChunkedDeltaOps`] runs on CubeCL devices, where every
//! product and element-wise step is one of burn's CubeCL kernels over all (batch, head,
//! chunk) at once, and the chunks are scanned in order. The same products as the native
//! flex loops (`src/flex/chunked.rs`), with the sequence padded to whole chunks of
//! [`DELTA_CHUNK`] tokens (a padded token has `β = 0`, `g = 0`, zero `q`, `k`, `v`: it leaves
//! the state alone) and the triangular system inverted by blocks ([`unit_lower_inverse`]).

use burn::tensor::{Bool, Tensor, TensorData};

use crate::gated_delta::{DELTA_CHUNK, unit_lower_inverse};

/// A `[c, c]` bool mask, true where `keep(row, column)`, broadcast to `[b, h, n, c, c]`.
fn mask(
    dims: [usize; 5],
    device: &burn::tensor::Device,
    keep: impl Fn(usize, usize) -> bool,
) -> Tensor<5, Bool> {
    let c = dims[3];
    let values: Vec<bool> = (0..c * c).map(|i| keep(i / c, i % c)).collect();
    Tensor::<2, Bool>::from_data(TensorData::new(values, [c, c]), device)
        .reshape([1, 1, 1, c, c])
        .expand(dims)
}

/// The chunk-local products of every chunk (see `src/flex/chunked.rs`).
struct Local {
    q: Tensor<5>,
    k: Tensor<5>,
    v: Tensor<5>,
    beta: Tensor<5>,
    gamma: Tensor<4>,
    decay: Tensor<5>,
    kb: Tensor<5>,
    vb: Tensor<5>,
    kbe: Tensor<5>,
    l: Tensor<5>,
    t: Tensor<5>,
    u: Tensor<5>,
    w: Tensor<5>,
    a: Tensor<5>,
    qe: Tensor<5>,
    kd: Tensor<5>,
    /// `e^{γ_last}` per chunk, `[b, h, n, 1, 1]`.
    el: Tensor<5>,
}

/// Queries or keys `[b, hk, t, d]` repeated over each key head's group of `h` heads.
fn spread(x: Tensor<4>, h: usize) -> Tensor<4> {
    let [b, hk, t, d] = x.dims();
    if hk == h {
        return x;
    }
    x.unsqueeze_dim::<5>(2)
        .expand([b, hk, h / hk, t, d])
        .reshape([b, h, t, d])
}

fn local(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, g: Tensor<3>, beta: Tensor<3>) -> Local {
    let h = v.dims()[1];
    let (q, k) = (spread(q, h), spread(k, h));
    let [b, _, t, dk] = q.dims();
    let dv = v.dims()[3];
    let device = q.device();
    let c = DELTA_CHUNK;
    let n = t.div_ceil(c);
    let pad = n * c - t;
    let pad4 = |x: Tensor<4>, d: usize| -> Tensor<5> {
        let x = if pad == 0 {
            x
        } else {
            Tensor::cat(vec![x, Tensor::zeros([b, h, pad, d], &device)], 2)
        };
        x.reshape([b, h, n, c, d])
    };
    let pad3 = |x: Tensor<3>| -> Tensor<4> {
        let x = if pad == 0 {
            x
        } else {
            Tensor::cat(vec![x, Tensor::zeros([b, h, pad], &device)], 2)
        };
        x.reshape([b, h, n, c])
    };
    let (q, k, v) = (pad4(q, dk), pad4(k, dk), pad4(v, dv));
    let beta = pad3(beta).unsqueeze_dim::<5>(4);
    let gamma = pad3(g).cumsum(3);
    let dims = [b, h, n, c, c];
    let decay = (gamma.clone().unsqueeze_dim::<5>(4) - gamma.clone().unsqueeze_dim::<5>(3))
        .mask_fill(mask(dims, &device, |i, j| j > i), f32::NEG_INFINITY)
        .exp();
    let kb = k.clone() * beta.clone();
    let vb = v.clone() * beta.clone();
    let eg = gamma.clone().exp().unsqueeze_dim::<5>(4);
    let kbe = kb.clone() * eg.clone();
    let l = (kb.clone().matmul(k.clone().swap_dims(3, 4)) * decay.clone())
        .mask_fill(mask(dims, &device, |i, j| j >= i), 0.0);
    let tinv = unit_lower_inverse(l.clone().reshape([b * h * n, c, c])).reshape(dims);
    let u = tinv.clone().matmul(vb.clone());
    let w = tinv.clone().matmul(kbe.clone());
    let a = q.clone().matmul(k.clone().swap_dims(3, 4)) * decay.clone();
    let last = gamma.clone().narrow(3, c - 1, 1);
    let qe = q.clone() * eg;
    let kd = k.clone() * (last.clone() - gamma.clone()).exp().unsqueeze_dim::<5>(4);
    let el = last.exp().unsqueeze_dim::<5>(4);
    Local {
        q,
        k,
        v,
        beta,
        gamma,
        decay,
        kb,
        vb,
        kbe,
        l,
        t: tinv,
        u,
        w,
        a,
        qe,
        kd,
        el,
    }
}

/// Chunk `i` of a `[b, h, n, x, y]` tensor, `[b, h, x, y]`.
fn at(x: &Tensor<5>, i: usize) -> Tensor<4> {
    let [b, h, _, r, c] = x.dims();
    x.clone().narrow(2, i, 1).reshape([b, h, r, c])
}

/// The forward: `([b, h, t + dk, dv]` outputs then final state, the state entering every
/// chunk `[b, h, n, dk, dv])`.
/// (`kept`: else an empty `[0, 0, 0, 0, 0]` tensor).
pub(crate) fn forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    g: Tensor<3>,
    beta: Tensor<3>,
    initial: Tensor<4>,
    keep: bool,
) -> (Tensor<4>, Tensor<5>) {
    let t = q.dims()[2];
    let lo = local(q, k, v, g, beta);
    let n = lo.q.dims()[2];
    let mut state = initial;
    let (mut outs, mut kept) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        if keep {
            kept.push(state.clone().unsqueeze_dim::<5>(2));
        }
        let vn = at(&lo.u, i) - at(&lo.w, i).matmul(state.clone());
        outs.push(at(&lo.qe, i).matmul(state.clone()) + at(&lo.a, i).matmul(vn.clone()));
        state = state * at(&lo.el, i) + at(&lo.kd, i).swap_dims(2, 3).matmul(vn);
    }
    let device = state.device();
    let kept = if keep && n > 0 {
        Tensor::cat(kept, 2)
    } else {
        Tensor::zeros([0, 0, 0, 0, 0], &device)
    };
    if n == 0 {
        return (state, kept);
    }
    let out = Tensor::cat(outs, 2).narrow(2, 0, t);
    (Tensor::cat(vec![out, state], 2), kept)
}

/// The backward: `(dq, dk, dv, d_decay, d_beta, d_initial)` for the gradient `grad`
/// (`[b, h, t + dk, dv]`) of [`forward`]'s first result, from its chunk states.
#[allow(clippy::type_complexity)]
pub(crate) fn backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    g: Tensor<3>,
    beta: Tensor<3>,
    states: Tensor<5>,
    grad: Tensor<4>,
) -> (
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Tensor<3>,
    Tensor<3>,
    Tensor<4>,
) {
    let [b, hk, t, dk] = q.dims();
    let [_, h, _, dv] = v.dims();
    let device = q.device();
    let lo = local(q, k, v, g, beta);
    let [_, _, n, c, _] = lo.q.dims();
    let pad = n * c - t;
    let mut d_out = grad.clone().narrow(2, 0, t);
    if pad > 0 {
        d_out = Tensor::cat(vec![d_out, Tensor::zeros([b, h, pad, dv], &device)], 2);
    }
    let d_out = d_out.reshape([b, h, n, c, dv]);
    let mut ds = grad.narrow(2, t, dk);
    // The scan, last chunk first: the products that read the state or its gradient.
    let mut parts: Vec<[Tensor<4>; 5]> = Vec::with_capacity(n);
    let mut dlast = Vec::with_capacity(n);
    for i in (0..n).rev() {
        let st = at(&states, i);
        let d_o = at(&d_out, i);
        let (a, w, kd) = (at(&lo.a, i), at(&lo.w, i), at(&lo.kd, i));
        let vn = at(&lo.u, i) - w.clone().matmul(st.clone());
        let dvn = a.swap_dims(2, 3).matmul(d_o.clone()) + kd.matmul(ds.clone());
        let dqe = d_o.clone().matmul(st.clone().swap_dims(2, 3));
        let dkd = vn.clone().matmul(ds.clone().swap_dims(2, 3));
        let dw = dvn.clone().matmul(st.clone().swap_dims(2, 3)).neg();
        let el = at(&lo.el, i);
        dlast.push((st * ds.clone()).sum_dim(3).sum_dim(2) * el.clone());
        let prev = ds * el + at(&lo.qe, i).swap_dims(2, 3).matmul(d_o)
            - w.swap_dims(2, 3).matmul(dvn.clone());
        parts.push([vn, dvn, dqe, dkd, dw]);
        ds = prev;
    }
    parts.reverse();
    dlast.reverse();
    let stack =
        |j: usize| -> Tensor<5> { Tensor::stack(parts.iter().map(|p| p[j].clone()).collect(), 2) };
    let (vn, dvn, dqe, dkd, dw) = (stack(0), stack(1), stack(2), stack(3), stack(4));
    // [b, h, n, 1, 1] → [b, h, n].
    let dlast: Tensor<3> = Tensor::stack::<5>(dlast, 2).reshape([b, h, n]);
    let dims = [b, h, n, c, c];
    let lower = |x: Tensor<5>| x.mask_fill(mask(dims, &device, |i, j| j > i), 0.0);
    let strict = |x: Tensor<5>| x.mask_fill(mask(dims, &device, |i, j| j >= i), 0.0);
    let rows = |a: Tensor<5>, b: Tensor<5>| -> Tensor<4> { (a * b).sum_dim(4).squeeze_dim(4) };
    let da = lower(d_out.clone().matmul(vn.clone().swap_dims(3, 4)));
    let mut e = da.clone() * lo.a.clone();
    let ma = da * lo.decay.clone();
    let eg = lo.gamma.clone().exp().unsqueeze_dim::<5>(4);
    let mut dgamma = rows(lo.qe.clone(), dqe.clone());
    let dq = dqe * eg.clone() + ma.clone().matmul(lo.k.clone());
    let mut dkk = ma.swap_dims(3, 4).matmul(lo.q.clone());
    let r = rows(lo.kd.clone(), dkd.clone());
    dgamma = dgamma - r.clone();
    let last = lo.gamma.clone().narrow(3, c - 1, 1);
    dkk = dkk + dkd * (last - lo.gamma.clone()).exp().unsqueeze_dim::<5>(4);
    let dlast = dlast + r.sum_dim(3).squeeze_dim::<3>(3);
    let dt = dvn.clone().matmul(lo.vb.clone().swap_dims(3, 4))
        + dw.clone().matmul(lo.kbe.clone().swap_dims(3, 4));
    let tt = lo.t.clone().swap_dims(3, 4);
    let dvb = tt.clone().matmul(dvn);
    let dkbe = tt.clone().matmul(dw);
    dgamma = dgamma + rows(lo.kbe.clone(), dkbe.clone());
    let mut dkb = dkbe * eg;
    let dl = strict(tt.clone().matmul(dt).matmul(tt).neg());
    e = e + dl.clone() * lo.l.clone();
    let ml = dl * lo.decay.clone();
    dkb = dkb + ml.clone().matmul(lo.k.clone());
    dkk = dkk + ml.swap_dims(3, 4).matmul(lo.kb.clone());
    dgamma = dgamma + e.clone().sum_dim(4).squeeze_dim(4) - e.sum_dim(3).squeeze_dim(3);
    let dbeta = rows(lo.k.clone(), dkb.clone()) + rows(lo.v.clone(), dvb.clone());
    dkk = dkk + dkb * lo.beta.clone();
    let dvv = dvb * lo.beta.clone();
    // γ = cumsum(g) per chunk: dg = the reverse cumsum of dγ (with dγ_last on the last).
    let dgamma = Tensor::cat(
        vec![
            dgamma.clone().narrow(3, 0, c - 1),
            dgamma.narrow(3, c - 1, 1) + dlast.unsqueeze_dim::<4>(3),
        ],
        3,
    );
    let dg = dgamma.flip([3]).cumsum(3).flip([3]);
    let unpad4 = |x: Tensor<5>, d: usize| x.reshape([b, h, n * c, d]).narrow(2, 0, t);
    let unpad3 = |x: Tensor<4>| x.reshape([b, h, n * c]).narrow(2, 0, t);
    let group = |x: Tensor<4>| -> Tensor<4> {
        if hk == h {
            return x;
        }
        x.reshape([b, hk, h / hk, t, dk])
            .sum_dim(2)
            .reshape([b, hk, t, dk])
    };
    (
        group(unpad4(dq, dk)),
        group(unpad4(dkk, dk)),
        unpad4(dvv, dv),
        unpad3(dg),
        unpad3(dbeta),
        ds,
    )
}
