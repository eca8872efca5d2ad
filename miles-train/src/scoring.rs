//! Batch scoring: log-probs (and entropy) of a micro-batch's responses under a model, per
//! sample through miles-bridge's sequence scorer ([`score_response`], the function the
//! embedded engine scores with, so both sides see identical numbers) or with one packed /
//! padded / shared-prefix forward.

use burn::tensor::{Device, Int, Tensor, TensorData};
use miles_bridge::{
    BridgeError, CausalLm, HiddenOutput, ModelInput, MoeRouting, check_response, ids_tensor,
    score_hidden_rows, score_response_hidden,
};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::RouterHook;

use crate::batch::{BatchLayout, TrainItem, pad_row, shared_prefix_rows};
use crate::{Error, Result};

/// Supplies the router hook of each forward pass (see [`score_batch`]).
pub type HookFn<'a> = dyn FnMut(&[&TrainItem]) -> Result<Box<dyn RouterHook>> + 'a;

/// Runs one forward pass to the final-norm hidden states (see [`score_batch_with`]).
pub(crate) type ForwardFn<'a> =
    dyn FnMut(&ModelInput, &dyn RouterHook) -> std::result::Result<HiddenOutput, BridgeError> + 'a;

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

/// The trainer's error for a scoring failure of sample `index`: a sequence the scorer refuses
/// is [`Error::Sample`], a fused-op input it rejects [`Error::Ops`], anything else
/// [`Error::Bridge`].
pub(crate) fn sample_error(index: usize, e: BridgeError) -> Error {
    match e {
        BridgeError::Scoring { reason } => Error::Sample { index, reason },
        BridgeError::Ops(e) => Error::Ops(e),
        other => Error::Bridge(other),
    }
}

fn int_vec(values: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
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
    score_batch_with(
        model,
        &mut |input, hook| model.forward_hidden(input, hook),
        items,
        layout,
        hooks,
        fused,
    )
}

/// [`score_batch`] with every forward pass run by `forward` (a recomputed forward) and the
/// log-probs computed with `model`'s output projection.
pub(crate) fn score_batch_with(
    model: &CausalLm,
    forward: &mut ForwardFn<'_>,
    items: &[&TrainItem],
    layout: BatchLayout,
    hooks: &mut HookFn<'_>,
    fused: &FusedLogProbConfig,
) -> Result<ScoredBatch> {
    let device = model.lm_head_weight().device();
    let vocab = model.config.vocab_size;
    for (index, item) in items.iter().enumerate() {
        check_response(&item.tokens, item.response_length, vocab)
            .map_err(|e| sample_error(index, e))?;
    }
    let max_r = items.iter().map(|i| i.response_length).max().unwrap_or(0);
    let mut routing = Vec::new();
    let mut per_sample: Vec<(Tensor<1>, Tensor<1>)> = Vec::with_capacity(items.len());
    match layout {
        BatchLayout::PerSample => {
            for item in items {
                // `miles_bridge::score_response`: one forward at the sequence's exact length.
                let hook = hooks(std::slice::from_ref(item))?;
                let ids = ids_tensor(std::slice::from_ref(&item.tokens), &device)?;
                let out = forward(&ModelInput::new(ids), &*hook).map_err(|e| sample_error(0, e))?;
                let (lp, ent) = score_response_hidden(
                    model,
                    out.hidden,
                    &item.tokens,
                    item.response_length,
                    fused,
                )
                .map_err(|e| sample_error(0, e))?;
                routing.push(out.routing);
                per_sample.push((lp, ent));
            }
        }
        BatchLayout::Packed | BatchLayout::Padded | BatchLayout::SharedPrefix => {
            let hook = hooks(items)?;
            let (input, rows) = batched_input(items, layout, &device);
            let out = forward(&input, &*hook)?;
            routing.push(out.routing);
            let [b, s, h] = out.hidden.dims();
            let flat = out.hidden.reshape([b * s, h]);
            let targets: Vec<u32> = items
                .iter()
                .flat_map(|item| item.tokens[item.len() - item.response_length..].to_vec())
                .collect();
            let selected = flat.select(0, int_vec(rows, &device));
            let (lp, ent) = score_hidden_rows(model, selected, &targets, fused)
                .map_err(|e| sample_error(0, e))?;
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

/// Builds the batched input of `items` in `layout` (any but per-sample): packed (`[1, Σn]`,
/// segment ids, positions restarting per sample), padded (`[b, max n]`, attention mask) or
/// shared-prefix (see [`shared_prefix_input`]). Returns it with, for every item in order, the
/// flat (row-major) positions of the hidden states that predict its response tokens.
fn batched_input(
    items: &[&TrainItem],
    layout: BatchLayout,
    device: &Device,
) -> (ModelInput, Vec<i32>) {
    let mut rows = Vec::with_capacity(items.iter().map(|i| i.response_length).sum());
    match layout {
        BatchLayout::SharedPrefix => shared_prefix_input(items, device),
        BatchLayout::Packed => {
            let total: usize = items.iter().map(|i| i.len()).sum();
            let mut ids = Vec::with_capacity(total);
            let mut seg = Vec::with_capacity(total);
            let mut pos = Vec::with_capacity(total);
            for (s, item) in items.iter().enumerate() {
                let (base, n, r) = (ids.len(), item.len(), item.response_length);
                rows.extend((base + n - 1 - r..base + n - 1).map(|x| x as i32));
                ids.extend(item.tokens.iter().map(|&t| t as i32));
                seg.extend(std::iter::repeat_n(s as i32, n));
                pos.extend(0..n as i32);
            }
            let t =
                |v: Vec<i32>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, total]), device);
            let mut input = ModelInput::new(t(ids));
            input.segment_ids = Some(t(seg));
            input.position_ids = Some(t(pos));
            (input, rows)
        }
        BatchLayout::Padded | BatchLayout::PerSample => {
            let len = items.iter().map(|i| i.len()).max().unwrap_or(0);
            let mut ids = Vec::with_capacity(items.len() * len);
            let mut mask = Vec::with_capacity(items.len() * len);
            for (i, item) in items.iter().enumerate() {
                let (base, n, r) = (i * len, item.len(), item.response_length);
                rows.extend((base + n - 1 - r..base + n - 1).map(|x| x as i32));
                ids.extend(item.tokens.iter().map(|&t| t as i32));
                ids.extend(std::iter::repeat_n(0, len - n));
                mask.extend((0..len).map(|j| i32::from(j < n)));
            }
            let shape = [items.len(), len];
            let mut input = ModelInput::new(Tensor::from_data(TensorData::new(ids, shape), device));
            input.attention_mask = Some(
                Tensor::<2, Int>::from_data(TensorData::new(mask, shape), device).equal_elem(1),
            );
            (input, rows)
        }
    }
}

/// The [`BatchLayout::SharedPrefix`] input: one row per prompt ([`shared_prefix_rows`]),
/// `[prompt, response 1, response 2, …]` right-padded to the longest row. Segment ids: the
/// prompt 0, the k-th response k (the padding one more), parents: 0 for the prompt and every
/// response (the padding its own); positions: the prompt `0..P`, each response `P..` as in its
/// own sequence; the attention mask hides the padding. Returns it with each item's
/// predicting positions: the prompt's last one, then the response's own tokens but its last.
fn shared_prefix_input(items: &[&TrainItem], device: &Device) -> (ModelInput, Vec<i32>) {
    let groups = shared_prefix_rows(items);
    let row_len = |row: &[usize]| {
        let first = items[row[0]];
        let prompt = first.len() - first.response_length;
        prompt + row.iter().map(|&i| items[i].response_length).sum::<usize>()
    };
    let len = groups.iter().map(|g| row_len(g)).max().unwrap_or(0);
    let cells = groups.len() * len;
    let (mut ids, mut seg, mut parent, mut pos, mut valid) = (
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
        Vec::with_capacity(cells),
    );
    let mut starts = vec![0usize; items.len()];
    for (g, row) in groups.iter().enumerate() {
        let base = g * len;
        let first = items[row[0]];
        let prompt = &first.tokens[..first.len() - first.response_length];
        let p = prompt.len();
        ids.extend(prompt.iter().map(|&t| t as i32));
        seg.extend(std::iter::repeat_n(0, p));
        parent.extend(std::iter::repeat_n(0, p));
        pos.extend(0..p as i32);
        for (k, &i) in row.iter().enumerate() {
            let item = items[i];
            let r = item.response_length;
            starts[i] = ids.len() - base;
            ids.extend(item.tokens[p..].iter().map(|&t| t as i32));
            seg.extend(std::iter::repeat_n(k as i32 + 1, r));
            parent.extend(std::iter::repeat_n(0, r));
            pos.extend((p..p + r).map(|x| x as i32));
        }
        let used = ids.len() - base;
        let pad = row.len() as i32 + 1;
        ids.extend(std::iter::repeat_n(0, len - used));
        seg.extend(std::iter::repeat_n(pad, len - used));
        parent.extend(std::iter::repeat_n(pad, len - used));
        pos.extend(std::iter::repeat_n(0, len - used));
        valid.extend((0..len).map(|j| i32::from(j < used)));
    }
    let mut rows = Vec::with_capacity(items.iter().map(|i| i.response_length).sum());
    let mut row_of = vec![0usize; items.len()];
    for (g, row) in groups.iter().enumerate() {
        for &i in row {
            row_of[i] = g;
        }
    }
    for (i, item) in items.iter().enumerate() {
        let base = row_of[i] * len;
        let prompt = item.len() - item.response_length;
        rows.push((base + prompt - 1) as i32);
        let start = base + starts[i];
        rows.extend((start..start + item.response_length - 1).map(|x| x as i32));
    }
    let shape = [groups.len(), len];
    let t = |v: Vec<i32>| Tensor::<2, Int>::from_data(TensorData::new(v, shape), device);
    let mut input = ModelInput::new(t(ids));
    input.attention_mask = Some(t(valid).equal_elem(1));
    input.segment_ids = Some(t(seg));
    input.parent_segment_ids = Some(t(parent));
    input.position_ids = Some(t(pos));
    (input, rows)
}
