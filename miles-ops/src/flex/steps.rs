//! Native `Flex` implementations of the fused ops' per-row steps: one pass over contiguous
//! `f32` rows, rows in parallel (rayon), sums accumulated in `f64`. For other dtypes or
//! layouts they return `None` and the caller (`FusedLogProbOps for Flex`) runs the plain-op
//! references.

use burn::backend::tensor::FloatTensor;
use burn::backend::{DType, Flex, TensorMetadata};
use burn::tensor::TensorData;
use rayon::prelude::*;

type FlexTensor = FloatTensor<Flex>;

/// `(data, rows, cols)` of a 2-D `f32` tensor, made contiguous; `None` for other dtypes.
fn rows_f32(t: &FlexTensor) -> Option<(Vec<f32>, usize, usize)> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let shape = t.shape();
    if shape.num_dims() != 2 {
        return None;
    }
    let (r, c) = (shape[0], shape[1]);
    let data = match t.as_slice::<f32>() {
        Some(s) => s.to_vec(),
        None => t.to_contiguous().as_slice::<f32>()?.to_vec(),
    };
    Some((data, r, c))
}

fn borrowed<R>(t: &FlexTensor, f: impl FnOnce(&[f32], usize, usize) -> R) -> Option<R> {
    if t.dtype() != DType::F32 || t.shape().num_dims() != 2 {
        return None;
    }
    let (r, c) = (t.shape()[0], t.shape()[1]);
    match t.as_slice::<f32>() {
        Some(s) => Some(f(s, r, c)),
        None => rows_f32(t).map(|(v, r, c)| f(&v, r, c)),
    }
}

fn from_vec(data: Vec<f32>, shape: [usize; 2]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(data, shape))
}

/// Folds a `[rows, cols]` logits chunk into the running `(m, s, u)` (`[rows, 3]`); `None`
/// unless both are 2-D `f32`.
pub(crate) fn logit_chunk_stats(logits: &FlexTensor, running: &FlexTensor) -> Option<FlexTensor> {
    let (state, rows, three) = rows_f32(running)?;
    debug_assert_eq!(three, 3);
    let out = borrowed(logits, |z, r, cols| {
        debug_assert_eq!(r, rows);
        let mut out = vec![0f32; rows * 3];
        out.par_chunks_mut(3)
            .zip(z.par_chunks(cols.max(1)))
            .zip(state.par_chunks(3))
            .for_each(|((o, zr), st)| {
                let m_new = zr.iter().fold(st[0], |m, &x| if x > m { x } else { m });
                let (mut s, mut u) = (0f64, 0f64);
                for &x in zr {
                    let e = (x - m_new).exp();
                    s += f64::from(e);
                    u += f64::from(e * x);
                }
                let scale = (st[0] - m_new).exp();
                o[0] = m_new;
                o[1] = (f64::from(st[1] * scale) + s) as f32;
                o[2] = (f64::from(st[2] * scale) + u) as f32;
            });
        out
    });
    out.map(|out| from_vec(out, [rows, 3]))
}

/// `−p ⊙ (g_lp + g_H·(z − E))` for a `[rows, cols]` logits chunk and `[rows, 4]`
/// `(lse, E, g_lp, g_H)`; `None` unless both are 2-D `f32`.
pub(crate) fn logit_chunk_grad(logits: &FlexTensor, row_stats: &FlexTensor) -> Option<FlexTensor> {
    let (stats, _, four) = rows_f32(row_stats)?;
    debug_assert_eq!(four, 4);
    let out = borrowed(logits, |z, rows, cols| {
        let mut out = vec![0f32; rows * cols];
        out.par_chunks_mut(cols.max(1))
            .zip(z.par_chunks(cols.max(1)))
            .zip(stats.par_chunks(4))
            .for_each(|((o, zr), st)| {
                let (lse, ez, g_lp, g_h) = (st[0], st[1], st[2], st[3]);
                for (o, &x) in o.iter_mut().zip(zr) {
                    *o = -(x - lse).exp() * (g_lp + g_h * (x - ez));
                }
            });
        (out, rows, cols)
    });
    out.map(|(out, rows, cols)| from_vec(out, [rows, cols]))
}
