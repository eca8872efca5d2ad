//! The scoring function: per-token log-probs (and entropy) of a sample's response under a
//! model, through miles-ops' fused path. The trainer differentiates through it; the embedded
//! engine calls it to score what it generated, so both sides see identical numbers.

use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use miles_bridge::{CausalLm, ModelInput, MoeRouting};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::RouterHook;

use crate::batch::{BatchLayout, TrainItem, pad_row};
use crate::{Error, Result};

/// Supplies the router hook of each forward pass (see [`score_batch`]).
pub type HookFn<'a> = dyn FnMut(&[&TrainItem]) -> Result<Box<dyn RouterHook>> + 'a;

/// Log-probs of a micro-batch, one row per sample, right-padded with zeros to the longest
/// response.
#[derive(Debug, Clone)]
pub struct ScoredBatch {
    /// `[batch, max_response]` log-probs of the response tokens (differentiable on autodiff
    /// models).
    pub log_probs: Tensor<2>,
    /// `[batch, max_response]` entropy of the next-token distribution at each response token.
    pub entropy: Tensor<2>,
    /// `[batch, max_response]` 1 on real response tokens, 0 on padding.
    pub valid: Tensor<2>,
    /// Routing of every forward pass, in order (one entry per sample with
    /// [`BatchLayout::PerSample`], one for the whole micro-batch otherwise).
    pub routing: Vec<Vec<MoeRouting>>,
}

fn ids_row(tokens: &[u32], device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Tensor::from_data(TensorData::new(ids, [1, tokens.len()]), device)
}

fn int_vec(values: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

fn check_item(tokens: &[u32], response_length: usize, vocab: usize) -> Result<()> {
    let bad = |reason: String| Error::Sample { index: 0, reason };
    if response_length == 0 || response_length >= tokens.len() {
        return Err(bad(format!(
            "response_length {response_length} must be in 1..{}",
            tokens.len()
        )));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary ({vocab})"
        )));
    }
    Ok(())
}

/// The fused log-prob op's inputs in f32: a half-precision model's final hidden states and
/// output projection are cast up (exactly) before the op, so the logits, log-softmax and
/// entropy are computed in f32 from the compute-dtype values (Megatron casts its logits up
/// before the cross-entropy the same way; here the logits themselves are never rounded to
/// the compute dtype). Differentiable: the cast's backward casts the gradients back.
fn in_f32(hidden: Tensor<2>, weight: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
    if hidden.dtype() == DType::F32 && weight.dtype() == DType::F32 {
        return (hidden, weight);
    }
    (hidden.cast(FloatDType::F32), weight.cast(FloatDType::F32))
}

/// Log-probs and entropy of the last `response_length` tokens of `tokens`: entry `i` is
/// `log p(tokens[n − R + i] | tokens[..n − R + i])`. One forward at the sequence's exact
/// length, so the result does not depend on anything but the model, the tokens and the
/// routing the hook returns. Differentiable when `model` lives on an autodiff device.
pub fn score_response(
    model: &CausalLm,
    tokens: &[u32],
    response_length: usize,
    hook: &dyn RouterHook,
    fused: &FusedLogProbConfig,
) -> Result<(Tensor<1>, Tensor<1>, Vec<MoeRouting>)> {
    check_item(tokens, response_length, model.config.vocab_size)?;
    let device = model.lm_head_weight().device();
    let n = tokens.len();
    let out = model.forward_hidden(&ModelInput::new(ids_row(tokens, &device)), hook)?;
    let [_, _, h] = out.hidden.dims();
    let rows = out
        .hidden
        .reshape([n, h])
        .narrow(0, n - 1 - response_length, response_length);
    // Host targets: the fused op checks them there and reads nothing back.
    let (rows, weight) = in_f32(rows, model.lm_head_weight());
    let (lp, ent) = fused.forward_ids(rows, weight, &tokens[n - response_length..])?;
    Ok((lp, ent, out.routing))
}

/// [`score_response`] read back to the host: the response log-probs as `f32`.
pub fn score_log_probs(
    model: &CausalLm,
    tokens: &[u32],
    response_length: usize,
    hook: &dyn RouterHook,
    fused: &FusedLogProbConfig,
) -> Result<Vec<f32>> {
    let (lp, _, _) = score_response(model, tokens, response_length, hook, fused)?;
    lp.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| Error::Sample {
            index: 0,
            reason: format!("cannot read log-probs back: {e:?}"),
        })
}

/// Scores a micro-batch in `layout`. `hooks` yields the router hook of each forward pass:
/// called with the items of that pass (one item with [`BatchLayout::PerSample`], all of them
/// otherwise) in the row order the pass uses.
pub fn score_batch(
    model: &CausalLm,
    items: &[&TrainItem],
    layout: BatchLayout,
    hooks: &mut HookFn<'_>,
    fused: &FusedLogProbConfig,
) -> Result<ScoredBatch> {
    let device = model.lm_head_weight().device();
    let vocab = model.config.vocab_size;
    for (index, item) in items.iter().enumerate() {
        check_item(&item.tokens, item.response_length, vocab).map_err(|e| match e {
            Error::Sample { reason, .. } => Error::Sample { index, reason },
            other => other,
        })?;
    }
    let max_r = items.iter().map(|i| i.response_length).max().unwrap_or(0);
    let mut routing = Vec::new();
    let mut per_sample: Vec<(Tensor<1>, Tensor<1>)> = Vec::with_capacity(items.len());
    match layout {
        BatchLayout::PerSample => {
            for item in items {
                let hook = hooks(std::slice::from_ref(item))?;
                let (lp, ent, r) =
                    score_response(model, &item.tokens, item.response_length, &*hook, fused)?;
                routing.push(r);
                per_sample.push((lp, ent));
            }
        }
        BatchLayout::Packed | BatchLayout::Padded => {
            let hook = hooks(items)?;
            let (input, row_len) = batched_input(items, layout, &device);
            let out = model.forward_hidden(&input, &*hook)?;
            routing.push(out.routing);
            let [b, s, h] = out.hidden.dims();
            let flat = out.hidden.reshape([b * s, h]);
            let mut rows = Vec::new();
            let mut targets = Vec::new();
            let mut offset = 0;
            for (i, item) in items.iter().enumerate() {
                let n = item.len();
                let r = item.response_length;
                let base = match layout {
                    BatchLayout::Packed => offset,
                    _ => i * row_len,
                };
                rows.extend((base + n - 1 - r..base + n - 1).map(|x| x as i32));
                targets.extend_from_slice(&item.tokens[n - r..]);
                offset += n;
            }
            let selected = flat.select(0, int_vec(rows, &device));
            let (selected, weight) = in_f32(selected, model.lm_head_weight());
            let (lp, ent) = fused.forward_ids(selected, weight, &targets)?;
            let mut at = 0;
            for item in items {
                let r = item.response_length;
                per_sample.push((lp.clone().narrow(0, at, r), ent.clone().narrow(0, at, r)));
                at += r;
            }
        }
    }
    let mut lps = Vec::with_capacity(items.len());
    let mut ents = Vec::with_capacity(items.len());
    let mut valid = Vec::with_capacity(items.len() * max_r);
    for ((lp, ent), item) in per_sample.into_iter().zip(items) {
        lps.push(pad_row(lp, max_r));
        ents.push(pad_row(ent, max_r));
        valid.extend((0..max_r).map(|j| {
            if j < item.response_length {
                1.0f32
            } else {
                0.0
            }
        }));
    }
    Ok(ScoredBatch {
        log_probs: Tensor::cat(lps, 0),
        entropy: Tensor::cat(ents, 0),
        valid: Tensor::from_data(TensorData::new(valid, [items.len(), max_r]), &device),
        routing,
    })
}

/// Builds the packed (`[1, Σn]`, segment ids, positions restarting per sample) or padded
/// (`[b, max n]`, attention mask) input; returns it with the row length.
fn batched_input(
    items: &[&TrainItem],
    layout: BatchLayout,
    device: &Device,
) -> (ModelInput, usize) {
    if layout == BatchLayout::Packed {
        let total: usize = items.iter().map(|i| i.len()).sum();
        let mut ids = Vec::with_capacity(total);
        let mut seg = Vec::with_capacity(total);
        let mut pos = Vec::with_capacity(total);
        for (s, item) in items.iter().enumerate() {
            ids.extend(item.tokens.iter().map(|&t| t as i32));
            seg.extend(std::iter::repeat_n(s as i32, item.len()));
            pos.extend(0..item.len() as i32);
        }
        let t = |v: Vec<i32>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, total]), device);
        let mut input = ModelInput::new(t(ids));
        input.segment_ids = Some(t(seg));
        input.position_ids = Some(t(pos));
        (input, total)
    } else {
        let len = items.iter().map(|i| i.len()).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(items.len() * len);
        let mut mask = Vec::with_capacity(items.len() * len);
        for item in items {
            ids.extend(item.tokens.iter().map(|&t| t as i32));
            ids.extend(std::iter::repeat_n(0, len - item.len()));
            mask.extend((0..len).map(|j| i32::from(j < item.len())));
        }
        let shape = [items.len(), len];
        let mut input = ModelInput::new(Tensor::from_data(TensorData::new(ids, shape), device));
        input.attention_mask =
            Some(Tensor::<2, Int>::from_data(TensorData::new(mask, shape), device).equal_elem(1));
        (input, len)
    }
}
