//! The sequence scorer: per-token log-probs (and entropy) of a sequence's response under a
//! model, through miles-ops' fused log-prob path ([`score_response`], [`score_log_probs`];
//! the logits are never materialised), and [`token_logprobs`] from full logits. The trainer
//! differentiates through [`score_response`] and the embedded engine scores what it generated
//! with it, so both sides see identical numbers.

use burn::tensor::activation::log_softmax;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor, TensorData};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::RouterHook;

use crate::error::BridgeError;
use crate::model::causal_lm::CausalLm;
use crate::model::forward::ModelInput;
use crate::nn::moe::MoeRouting;

fn ids_row(tokens: &[u32], device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Tensor::from_data(TensorData::new(ids, [1, tokens.len()]), device)
}

/// Checks a sequence before it is scored: `response_length` must be in `1..tokens.len()` and
/// every token id below `vocab_size`; otherwise [`BridgeError::Scoring`] saying why.
pub fn check_response(
    tokens: &[u32],
    response_length: usize,
    vocab_size: usize,
) -> Result<(), BridgeError> {
    let bad = |reason: String| BridgeError::Scoring { reason };
    if response_length == 0 || response_length >= tokens.len() {
        return Err(bad(format!(
            "response_length {response_length} must be in 1..{}",
            tokens.len()
        )));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(bad(format!(
            "token id {t} is outside the vocabulary ({vocab_size})"
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

/// Log-probs and entropy of `targets` from final-norm hidden states `rows` (`[targets.len(),
/// hidden]`, row `i` the position that predicts `targets[i]`) and `model`'s output projection,
/// through miles-ops' fused op in f32. Differentiable when `model` lives on an autodiff device.
pub fn score_hidden_rows(
    model: &CausalLm,
    rows: Tensor<2>,
    targets: &[u32],
    fused: &FusedLogProbConfig,
) -> Result<(Tensor<1>, Tensor<1>), BridgeError> {
    // Host targets: the fused op checks them there and reads nothing back.
    let (rows, weight) = in_f32(rows, model.lm_head_weight());
    Ok(fused.forward_ids(rows, weight, targets)?)
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
) -> Result<(Tensor<1>, Tensor<1>, Vec<MoeRouting>), BridgeError> {
    check_response(tokens, response_length, model.config.vocab_size)?;
    let device = model.lm_head_weight().device();
    let out = model.forward_hidden(&ModelInput::new(ids_row(tokens, &device)), hook)?;
    let (lp, ent) = score_response_hidden(model, out.hidden, tokens, response_length, fused)?;
    Ok((lp, ent, out.routing))
}

/// What [`score_response`] does after its forward: the response rows of one sequence's final
/// hidden states (`[1, n, hidden]`, from `forward_hidden` over `tokens` or an equal pass)
/// scored against its response tokens. `tokens` and `response_length` as [`check_response`]
/// accepts them.
pub fn score_response_hidden(
    model: &CausalLm,
    hidden: Tensor<3>,
    tokens: &[u32],
    response_length: usize,
    fused: &FusedLogProbConfig,
) -> Result<(Tensor<1>, Tensor<1>), BridgeError> {
    let n = tokens.len();
    let [_, _, h] = hidden.dims();
    let rows = hidden
        .reshape([n, h])
        .narrow(0, n - 1 - response_length, response_length);
    score_hidden_rows(model, rows, &tokens[n - response_length..], fused)
}

/// [`score_response`] read back to the host: the response log-probs as `f32`.
pub fn score_log_probs(
    model: &CausalLm,
    tokens: &[u32],
    response_length: usize,
    hook: &dyn RouterHook,
    fused: &FusedLogProbConfig,
) -> Result<Vec<f32>, BridgeError> {
    let (lp, _, _) = score_response(model, tokens, response_length, hook, fused)?;
    lp.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| BridgeError::Scoring {
            reason: format!("cannot read log-probs back: {e:?}"),
        })
}

/// `log p(token t+1 | tokens <= t)` for each row: `[batch, seq - 1]` from `[batch, seq, vocab]`
/// logits and `[batch, seq]` ids.
pub fn token_logprobs(logits: Tensor<3>, input_ids: Tensor<2, Int>) -> Tensor<2> {
    let [batch, seq, _] = logits.dims();
    // In f32 whatever the logits' dtype (half-precision logits are cast up first).
    let lp = log_softmax(logits.narrow(1, 0, seq - 1).cast(FloatDType::F32), 2);
    let targets = input_ids.narrow(1, 1, seq - 1).reshape([batch, seq - 1, 1]);
    lp.gather(2, targets).reshape([batch, seq - 1])
}
