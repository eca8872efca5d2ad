//! Native `Flex` loop of [`crate::gated_delta_rule`] (forward only): the recurrent form over
//! contiguous `f32` tensors, one rayon task per (batch, head, block of value columns).
//!
//! Every column of the state evolves on its own, so a task keeps `[key_dim, block]` of the
//! state in a local buffer and walks the tokens in order: decay, `u = kᵀS`,
//! `δ = β (v − u)`, `S += k δᵀ`, `o = qᵀS` — two passes over its part of the state per
//! token, each an inner loop over the block's columns that vectorises. Splitting the
//! columns keeps every core busy at batch 1 with few heads (a prefill step).

use burn::backend::{Flex, tensor::FloatTensor};
use rayon::prelude::*;

use super::tensor::{dims, f32_data, tensor};

type FlexTensor = FloatTensor<Flex>;

/// Value columns per task.
const COLUMNS: usize = 32;

/// `(out [b, h, t, dv], state [b, h, dk, dv])` from `q`, `k` `[b, h, t, dk]`, `v`
/// `[b, h, t, dv]`, `decay`, `beta` `[b, h, t]` and the initial state `[b, h, dk, dv]`.
pub(crate) fn forward(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    decay: &FlexTensor,
    beta: &FlexTensor,
    initial: &FlexTensor,
) -> (FlexTensor, FlexTensor) {
    let (qd, vd) = (dims(q), dims(v));
    let (b, h, t, dk, dv) = (qd[0], qd[1], qd[2], qd[3], vd[3]);
    let (q, k, v) = (f32_data(q), f32_data(k), f32_data(v));
    let (decay, beta) = (f32_data(decay), f32_data(beta));
    let initial = f32_data(initial);
    let width = COLUMNS.min(dv.max(1));
    let blocks = dv.div_ceil(width);
    // Per task: its outputs `[t, cols]` and final state `[dk, cols]`.
    let parts: Vec<(Vec<f32>, Vec<f32>)> = (0..b * h * blocks)
        .into_par_iter()
        .map(|task| {
            let (bh, blk) = (task / blocks, task % blocks);
            let c0 = blk * width;
            let cols = width.min(dv - c0);
            let mut state = vec![0.0f32; dk * cols];
            let base = bh * dk * dv;
            for (a, row) in state.chunks_mut(cols).enumerate() {
                let at = base + a * dv + c0;
                row.copy_from_slice(&initial[at..at + cols]);
            }
            let mut out = vec![0.0f32; t * cols];
            let mut delta = vec![0.0f32; cols];
            for i in 0..t {
                let at = bh * t + i;
                let (g, bt) = (decay[at].exp(), beta[at]);
                let kt = &k[at * dk..(at + 1) * dk];
                let qt = &q[at * dk..(at + 1) * dk];
                let vt = &v[at * dv + c0..at * dv + c0 + cols];
                // S ← g·S; u = kᵀS (into `delta`).
                delta.fill(0.0);
                for (row, &ka) in state.chunks_mut(cols).zip(kt) {
                    for (s, u) in row.iter_mut().zip(delta.iter_mut()) {
                        *s *= g;
                        *u += ka * *s;
                    }
                }
                for (u, &x) in delta.iter_mut().zip(vt) {
                    *u = bt * (x - *u);
                }
                // S += k δᵀ; o = qᵀS.
                let o = &mut out[i * cols..(i + 1) * cols];
                for ((row, &ka), &qa) in state.chunks_mut(cols).zip(kt).zip(qt) {
                    for ((s, &dj), oj) in row.iter_mut().zip(&delta).zip(o.iter_mut()) {
                        *s += ka * dj;
                        *oj += qa * *s;
                    }
                }
            }
            (out, state)
        })
        .collect();
    let mut out = vec![0.0f32; b * h * t * dv];
    let mut state = vec![0.0f32; b * h * dk * dv];
    for (task, (o, s)) in parts.iter().enumerate() {
        let (bh, blk) = (task / blocks, task % blocks);
        let c0 = blk * width;
        let cols = width.min(dv - c0);
        for (i, row) in o.chunks(cols).enumerate() {
            let at = (bh * t + i) * dv + c0;
            out[at..at + cols].copy_from_slice(row);
        }
        for (a, row) in s.chunks(cols).enumerate() {
            let at = (bh * dk + a) * dv + c0;
            state[at..at + cols].copy_from_slice(row);
        }
    }
    (tensor(out, &[b, h, t, dv]), tensor(state, &[b, h, dk, dv]))
}
