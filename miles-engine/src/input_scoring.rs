//! Input log-probs: the distribution of each token of a sequence given its prefix, without
//! generating (SGLang's `/generate` with `max_new_tokens = 0`, `return_logprob` and
//! `logprob_start_len`; what an on-policy-distillation teacher answers).

use burn::tensor::FloatDType;
use burn::tensor::activation::log_softmax;
use miles_bridge::{CausalLm, ModelInput};
use miles_core::{
    EngineErrorKind, Error as CoreError, InputLogprobRequest, InputLogprobs, WeightVersion,
};
use miles_r3::Fallthrough;

use crate::step::{SequenceScorer, ids_row};

fn invalid(reason: String) -> CoreError {
    CoreError::engine(EngineErrorKind::InvalidRequest, reason)
}

/// Scores `request` on `model` at `version`: the sampled-token log-probs through `scorer`
/// (the trainer's scoring function by default, so a teacher served here scores exactly as a
/// trainer holding the same weights), the top-k and requested ids from one full forward.
pub(crate) fn input_logprobs(
    model: &CausalLm,
    scorer: &dyn SequenceScorer,
    request: &InputLogprobRequest,
    version: WeightVersion,
) -> miles_core::Result<InputLogprobs> {
    let ids = &request.input_ids;
    let vocab = model.config.vocab_size;
    if ids.is_empty() {
        return Err(invalid("input_ids is empty".into()));
    }
    let positions = request.token_ids_logprob_positions.as_deref();
    if positions.is_some() && !request.token_ids_logprob.is_empty() {
        return Err(invalid(
            "token_ids_logprob and token_ids_logprob_positions are exclusive".into(),
        ));
    }
    if let Some(p) = positions.filter(|p| p.len() > ids.len()) {
        return Err(invalid(format!(
            "token_ids_logprob_positions has {} positions, the input {}",
            p.len(),
            ids.len()
        )));
    }
    if let Some(t) = ids
        .iter()
        .chain(&request.token_ids_logprob)
        .chain(positions.into_iter().flatten().flatten())
        .find(|&&t| t as usize >= vocab)
    {
        return Err(invalid(format!(
            "token id {t} is outside the vocabulary of {vocab}"
        )));
    }
    let n = ids.len();
    let mut out = InputLogprobs {
        token_logprobs: Vec::new(),
        top_logprobs: vec![Vec::new(); n - 1],
        token_ids_logprobs: vec![Vec::new(); n - 1],
        weight_version: version,
    };
    if n < 2 {
        return Ok(out);
    }
    out.token_logprobs = scorer
        .score(model, ids, n - 1)
        .map_err(|e| CoreError::engine(EngineErrorKind::Internal, e))?
        .into_iter()
        .map(f64::from)
        .collect();
    let k = request.top_logprobs_num.min(vocab);
    if k == 0 && request.token_ids_logprob.is_empty() && positions.is_none() {
        return Ok(out);
    }
    let device = model.lm_head_weight().device();
    let logits = model
        .forward(&ModelInput::new(ids_row(ids, &device)), &Fallthrough)
        .map_err(|e| CoreError::engine(EngineErrorKind::Internal, e.to_string()))?
        .logits;
    let lp = log_softmax(logits.narrow(1, 0, n - 1).cast(FloatDType::F32), 2);
    let rows: Vec<f32> = lp
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| {
            CoreError::engine(
                EngineErrorKind::Internal,
                format!("cannot read log-probs back: {e:?}"),
            )
        })?;
    for (p, row) in rows.chunks_exact(vocab).enumerate() {
        if k > 0 {
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            // Most likely first; equal log-probs by id.
            let rank =
                |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
            if k < vocab {
                order.select_nth_unstable_by(k, rank);
            }
            order[..k].sort_by(rank);
            out.top_logprobs[p] = order[..k]
                .iter()
                .map(|&id| (id, f64::from(row[id as usize])))
                .collect();
        }
        // Row `p` is the distribution of `input_ids[p + 1]`: position `p + 1`'s own ids.
        let asked = match positions {
            Some(lists) => lists.get(p + 1).map_or(&[][..], Vec::as_slice),
            None => &request.token_ids_logprob,
        };
        out.token_ids_logprobs[p] = asked
            .iter()
            .map(|&id| (id, f64::from(row[id as usize])))
            .collect();
    }
    Ok(out)
}
