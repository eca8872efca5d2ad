//! The chunked gated delta rule's forward and explicit backward on CubeCL devices (no
//! autodiff graph): what [`crate::ChunkedDeltaOps`] runs there. The chunk-local products and
//! the backward's per-chunk products are batched tensor ops (burn's CubeCL matmul and
//! element-wise kernels over every (batch, head, chunk) at once); the sequential scans over
//! the chunks (forward: the states and outputs; backward: the state gradients and `dV`) are
//! passed in ([`ForwardScan`], [`BackwardScan`]: the fused kernels of
//! `src/kernels/chunked.rs`). The same products as the native flex loops
//! (`src/flex/chunked.rs`), with the sequence padded to whole chunks of [`DELTA_CHUNK`]
//! tokens (a padded token has `β = 0`, `g = 0`, zero `q`, `k`, `v`: it leaves the state
//! alone) and the triangular system inverted by blocks ([`unit_lower_inverse`]).

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

/// The chunk-local products of every chunk (see `src/flex/chunked.rs`), `[b, h, n, c, ·]`.
pub(crate) struct Local {
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
    /// `U = T vb`, `[b, h, n, c, dv]`.
    pub(crate) u: Tensor<5>,
    /// `W = T (e^γ ⊙ kb)`, `[b, h, n, c, dk]`.
    pub(crate) w: Tensor<5>,
    /// `A = lower(q kᵀ ⊙ Γ)`, `[b, h, n, c, c]`.
    pub(crate) a: Tensor<5>,
    /// `e^γ ⊙ q`, `[b, h, n, c, dk]`.
    pub(crate) qe: Tensor<5>,
    /// `e^{γ_last − γ} ⊙ k`, `[b, h, n, c, dk]`.
    pub(crate) kd: Tensor<5>,
    /// `e^{γ_last}` per chunk, `[b, h, n, 1, 1]`.
    pub(crate) el: Tensor<5>,
}

/// The forward's scan over the chunks: from the chunk products and the initial state
/// `[b, h, dk, dv]`, the padded outputs `[b, h, n, c, dv]`, the final state and, when the
/// flag asks, the state entering every chunk `[b, h, n, dk, dv]` (else an empty tensor).
pub(crate) type ForwardScan = fn(&Local, Tensor<4>, bool) -> (Tensor<5>, Tensor<4>, Tensor<5>);

/// The backward's scan over the chunks, last first: from the chunk products, the padded
/// output gradient `[b, h, n, c, dv]` and the final state's gradient `[b, h, dk, dv]`, the
/// gradient of every chunk's `V = U − W S` `[b, h, n, c, dv]`, of the state leaving every
/// chunk `[b, h, n, dk, dv]` and of the initial state.
pub(crate) type BackwardScan =
    fn(&Local, Tensor<5>, Tensor<4>) -> (Tensor<5>, Tensor<5>, Tensor<4>);

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

/// The forward: `([b, h, t + dk, dv]` outputs then final state, the state entering every
/// chunk `[b, h, n, dk, dv])` (`keep`: else an empty `[0, 0, 0, 0, 0]` tensor).
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    g: Tensor<3>,
    beta: Tensor<3>,
    initial: Tensor<4>,
    keep: bool,
    scan: ForwardScan,
) -> (Tensor<4>, Tensor<5>) {
    let t = q.dims()[2];
    let lo = local(q, k, v, g, beta);
    let [b, h, n, c, dv] = lo.u.dims();
    let (out, state, kept) = scan(&lo, initial, keep);
    if n == 0 {
        return (state, kept);
    }
    let out = out.reshape([b, h, n * c, dv]).narrow(2, 0, t);
    (Tensor::cat(vec![out, state], 2), kept)
}

/// The backward: `(dq, dk, dv, d_decay, d_beta, d_initial)` for the gradient `grad`
/// (`[b, h, t + dk, dv]`) of [`forward`]'s first result, from its chunk states.
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
pub(crate) fn backward(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    g: Tensor<3>,
    beta: Tensor<3>,
    states: Tensor<5>,
    grad: Tensor<4>,
    scan: BackwardScan,
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
    // The scan, last chunk first, then the products that read a chunk's state (`states`:
    // the state entering it) or its gradient (`d_states`: of the state leaving it).
    let (dvn, d_states, ds) = scan(&lo, d_out.clone(), grad.narrow(2, t, dk));
    let vn = lo.u.clone() - lo.w.clone().matmul(states.clone());
    let dqe = d_out.clone().matmul(states.clone().swap_dims(3, 4));
    let dkd = vn.clone().matmul(d_states.clone().swap_dims(3, 4));
    let dw = dvn.clone().matmul(states.clone().swap_dims(3, 4)).neg();
    // [b, h, n, 1, 1] → [b, h, n].
    let dlast: Tensor<3> =
        ((states * d_states).sum_dim(4).sum_dim(3) * lo.el.clone()).reshape([b, h, n]);
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
