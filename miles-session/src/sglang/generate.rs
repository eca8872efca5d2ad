//! `/generate`: token-id or text prompts (one or a batch, `n` samples each), SGLang's sampling
//! checks and limits, `meta_info` with log-probs, routed experts and the weight version.

use std::sync::Arc;
use std::time::Instant;

use crate::server::ROUTING_KEY_HEADER;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine,
    InputLogprobRequest, InputLogprobs, RequestId, SamplingParams, TokenId, output_text,
};
use serde_json::Value;
use tokio::task::JoinSet;

use super::info::ServerInfo;
use super::state::{ApiError, ApiResult, AppState, AppStateRef, json_response, read_json};
use super::wire::{
    GenerateRequestBody, GenerateResponse, MetaInfo, OneOrBatch, TokenLogprob, WireFinishReason,
    WireWeightVersion,
};

// ---------------------------------------------------------------------------------------------
// /generate

/// Aborts a request in the engine when its future is dropped before it finished (the client
/// went away), as SGLang does on disconnect.
pub(super) struct AbortOnDrop {
    pub(super) engine: Arc<dyn InferenceEngine>,
    pub(super) request_id: RequestId,
    pub(super) armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let engine = self.engine.clone();
            let id = self.request_id.clone();
            handle.spawn(async move {
                if let Err(error) = engine.abort(&id).await {
                    tracing::debug!(%error, request = %id, "abort after disconnect failed");
                }
            });
        }
    }
}

/// Per-request output options of `/generate`.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct OutputOptions {
    pub(super) return_logprob: bool,
    pub(super) return_text_in_logprobs: bool,
}

/// The prompts of a `/generate` body as token ids (text tokenized with the server's
/// tokenizer), checked against the vocabulary and the context, and whether it was a batch.
pub(super) fn parse_prompts(
    state: &AppState,
    body: &GenerateRequestBody,
) -> ApiResult<(Vec<Vec<TokenId>>, bool)> {
    let (prompts, batched) = match (&body.input_ids, &body.text) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "either text or input_ids should be provided, not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "either text or input_ids should be provided",
            ));
        }
        (Some(OneOrBatch::One(ids)), None) => (vec![ids.clone()], false),
        (Some(OneOrBatch::Batch(batch)), None) => (batch.clone(), true),
        (None, Some(text)) => {
            let tokenizer = state.info.tokenizer.as_ref().ok_or_else(|| {
                ApiError::bad_request(
                    "this server has no tokenizer: send input_ids (start it with a tokenizer for text)",
                )
            })?;
            let encode = |t: &String| {
                tokenizer
                    .encode(t)
                    .map_err(|e| ApiError::bad_request(format!("cannot tokenize text: {e}")))
            };
            match text {
                OneOrBatch::One(s) => (vec![encode(s)?], false),
                OneOrBatch::Batch(items) => (
                    items.iter().map(encode).collect::<ApiResult<Vec<_>>>()?,
                    true,
                ),
            }
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_request("empty batch"));
    }
    for (i, prompt) in prompts.iter().enumerate() {
        check_prompt(&state.info, prompt).map_err(|e| {
            if batched {
                ApiError::bad_request(format!("prompt {i}: {}", e.message))
            } else {
                e
            }
        })?;
    }
    Ok((prompts, batched))
}

pub(super) fn check_prompt(info: &ServerInfo, prompt: &[TokenId]) -> ApiResult<()> {
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    if let Some(vocab) = info.vocab_size
        && let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab)
    {
        return Err(ApiError::bad_request(format!(
            "token id {bad} is out of the vocabulary (size {vocab})"
        )));
    }
    if let Some(limit) = info.context_length
        && prompt.len() >= limit
    {
        return Err(ApiError::bad_request(format!(
            "the input ({} tokens) is longer than the model's context length ({limit} tokens)",
            prompt.len()
        )));
    }
    Ok(())
}

/// Checks sampling parameters as SGLang's `SamplingParams.verify` does.
pub(super) fn verify_sampling(params: &SamplingParams) -> ApiResult<()> {
    let bad = |m: String| Err(ApiError::bad_request(m));
    if !params.temperature.is_finite() || params.temperature < 0.0 {
        return bad(format!(
            "temperature must be non-negative, got {}",
            params.temperature
        ));
    }
    if !(params.top_p.is_finite() && params.top_p > 0.0 && params.top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}", params.top_p));
    }
    if params.top_k < 1 && params.top_k != -1 {
        return bad(format!(
            "top_k must be -1 (disable), or at least 1, got {}",
            params.top_k
        ));
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        return bad(format!("min_p must be in [0, 1], got {}", params.min_p));
    }
    if !(-2.0..=2.0).contains(&params.frequency_penalty) {
        return bad(format!(
            "frequency_penalty must be in [-2, 2], got {}",
            params.frequency_penalty
        ));
    }
    if !(-2.0..=2.0).contains(&params.presence_penalty) {
        return bad(format!(
            "presence_penalty must be in [-2, 2], got {}",
            params.presence_penalty
        ));
    }
    if params.n == 0 {
        return bad("n must be at least 1".into());
    }
    if let Some(max) = params.max_new_tokens
        && params.min_new_tokens > max
    {
        return bad(format!(
            "min_new_tokens must be in [0, max_new_tokens], got {}",
            params.min_new_tokens
        ));
    }
    Ok(())
}

/// Checks a request's sampling parameters against the server's [`RequestLimits`] and
/// sequence bound; `prompts` is the number of prompts the request carries.
pub(super) fn check_limits(
    info: &ServerInfo,
    params: &SamplingParams,
    prompts: usize,
) -> ApiResult<()> {
    let limits = &info.limits;
    let bad = |m: String| Err(ApiError::bad_request(m));
    if params.n > limits.max_n {
        return bad(format!(
            "n = {} is over this server's limit of {} (--max-n)",
            params.n, limits.max_n
        ));
    }
    match prompts.checked_mul(params.n.max(1)) {
        Some(total) if total <= info.max_sequences => {}
        _ => {
            return bad(format!(
                "{prompts} prompts × n = {} is over this server's limit of {} sequences a request",
                params.n, info.max_sequences
            ));
        }
    }
    if params.stop.len() > limits.max_stop_strings {
        return bad(format!(
            "{} stop strings; at most {} are accepted",
            params.stop.len(),
            limits.max_stop_strings
        ));
    }
    if let Some(long) = params.stop.iter().find(|s| s.len() > limits.max_stop_len) {
        return bad(format!(
            "a stop string of {} bytes is over the limit of {} bytes",
            long.len(),
            limits.max_stop_len
        ));
    }
    if params.stop_token_ids.len() > limits.max_stop_token_ids {
        return bad(format!(
            "{} stop_token_ids; at most {} are accepted",
            params.stop_token_ids.len(),
            limits.max_stop_token_ids
        ));
    }
    Ok(())
}

/// `max_new_tokens` of one prompt: the request's (SGLang's default when unset), checked
/// against the context length.
pub(super) fn resolve_max_new(
    info: &ServerInfo,
    requested: Option<usize>,
    prompt_len: usize,
    default: usize,
) -> ApiResult<usize> {
    let max_new = requested.unwrap_or(default);
    if let Some(limit) = info.context_length
        && prompt_len
            .checked_add(max_new)
            .is_none_or(|total| total > limit)
    {
        return Err(ApiError::bad_request(format!(
            "requested token count exceeds the model's maximum context length of {limit} tokens: \
             {prompt_len} tokens from the input and {max_new} tokens for the completion"
        )));
    }
    Ok(max_new)
}

/// SGLang's finish reason object of `output`.
fn finish_reason(output: &GenerateOutput) -> WireFinishReason {
    WireFinishReason::new(
        output.finish_reason,
        output.matched_stop.clone(),
        output.output_ids.len(),
    )
}

/// `meta_info` of a `/generate` answer (SGLang's `/generate` answer).
pub(super) fn meta_info(
    state: &AppState,
    rid: &str,
    output: &GenerateOutput,
    options: OutputOptions,
    latency: f64,
) -> ApiResult<MetaInfo> {
    let output_token_logprobs = if options.return_logprob {
        if output.output_log_probs.len() != output.output_ids.len() {
            return Err(ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!(
                    "the engine returned {} log-probs for {} tokens",
                    output.output_log_probs.len(),
                    output.output_ids.len()
                ),
            });
        }
        let tokenizer = state
            .info
            .tokenizer
            .as_ref()
            .filter(|_| options.return_text_in_logprobs);
        Some(
            output
                .output_ids
                .iter()
                .zip(&output.output_log_probs)
                .map(|(&id, &lp)| {
                    TokenLogprob(lp, id, tokenizer.map(|t| t.decode_token(id).to_string()))
                })
                .collect(),
        )
    } else {
        None
    };
    Ok(MetaInfo {
        id: Some(rid.to_owned()),
        finish_reason: Some(finish_reason(output)),
        prompt_tokens: Some(output.prompt_tokens as u64),
        weight_version: Some(WireWeightVersion(output.weight_version)),
        completion_tokens: Some(output.output_ids.len() as u64),
        cached_tokens: Some(output.cached_tokens as u64),
        e2e_latency: Some(latency),
        output_token_logprobs,
        routed_experts: output.routed_experts.as_ref().map(|r| r.to_base64()),
        input_token_logprobs: None,
        input_top_logprobs: None,
        input_token_ids_logprobs: None,
    })
}

/// SGLang's input log-prob fields from position `start` on: `[logprob, token_id, null]` per
/// position (the first input position's log-prob `null`), and per position the top-k and the
/// requested ids (`null` at the first position) when asked.
fn input_logprob_fields(
    ids: &[TokenId],
    scores: &InputLogprobs,
    start: usize,
    top: bool,
    token_ids: bool,
) -> (Value, Option<Value>, Option<Value>) {
    let entries = |list: &[(TokenId, f64)]| -> Value {
        Value::Array(
            list.iter()
                .map(|&(id, lp)| serde_json::json!([lp, id, null]))
                .collect(),
        )
    };
    let positions = start.min(ids.len())..ids.len();
    let tokens = positions
        .clone()
        .map(|p| match p {
            0 => serde_json::json!([null, ids[0], null]),
            p => serde_json::json!([scores.token_logprobs[p - 1], ids[p], null]),
        })
        .collect();
    let per_position = |table: &[Vec<(TokenId, f64)>]| -> Value {
        Value::Array(
            positions
                .clone()
                .map(|p| match p {
                    0 => Value::Null,
                    p => entries(&table[p - 1]),
                })
                .collect(),
        )
    };
    (
        Value::Array(tokens),
        top.then(|| per_position(&scores.top_logprobs)),
        token_ids.then(|| per_position(&scores.token_ids_logprobs)),
    )
}

/// `/generate` with `max_new_tokens = 0`, `return_logprob` and `logprob_start_len ≥ 0`: every
/// prompt's input tokens scored by the engine, nothing generated (how an on-policy-distillation
/// teacher is asked).
async fn score_inputs(
    state: &AppState,
    body: &GenerateRequestBody,
    prompts: Vec<Vec<TokenId>>,
    batched: bool,
    start: usize,
) -> ApiResult<Value> {
    let started = Instant::now();
    let top_k = body.top_logprobs_num.unwrap_or(0);
    let token_ids = body.token_ids_logprob.clone().unwrap_or_default();
    let positions = body.token_ids_logprob_positions.clone();
    // The engine checks the lists against the input (`InputLogprobRequest`); a batch would
    // need one list per prompt.
    if positions.is_some() && prompts.len() != 1 {
        return Err(ApiError::bad_request(format!(
            "token_ids_logprob_positions scores one prompt per request, this batch has {}",
            prompts.len()
        )));
    }
    let ask_ids = !token_ids.is_empty() || positions.is_some();
    let mut answers = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let scores = state
            .engine
            .input_logprobs(InputLogprobRequest {
                input_ids: prompt.clone(),
                top_logprobs_num: top_k,
                token_ids_logprob: token_ids.clone(),
                token_ids_logprob_positions: positions.clone(),
            })
            .await
            .map_err(ApiError::from_engine)?;
        let (tokens, top, ids) = input_logprob_fields(&prompt, &scores, start, top_k > 0, ask_ids);
        let meta = MetaInfo {
            id: Some(state.fresh_id("")),
            finish_reason: Some(WireFinishReason::new(FinishReason::Length, None, 0)),
            prompt_tokens: Some(prompt.len() as u64),
            weight_version: Some(WireWeightVersion(scores.weight_version)),
            completion_tokens: Some(0),
            cached_tokens: Some(0),
            e2e_latency: Some(started.elapsed().as_secs_f64()),
            output_token_logprobs: Some(Vec::new()),
            routed_experts: None,
            input_token_logprobs: Some(tokens),
            input_top_logprobs: top,
            input_token_ids_logprobs: ids,
        };
        let answer = GenerateResponse {
            text: state.info.tokenizer.as_ref().map(|_| String::new()),
            output_ids: Some(Vec::new()),
            meta_info: meta,
        };
        answers.push(answer);
    }
    answers_body(answers, batched)
}

/// The `/generate` body SGLang returns: one answer object for one unbatched prompt, else the
/// array of answers in request order.
fn answers_body(answers: Vec<GenerateResponse>, batched: bool) -> ApiResult<Value> {
    let mut values = answers
        .into_iter()
        .map(|answer| {
            serde_json::to_value(answer).map_err(|e| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("cannot write the answer: {e}"),
            })
        })
        .collect::<ApiResult<Vec<Value>>>()?;
    if !batched && values.len() == 1 {
        Ok(values.pop().expect("one answer"))
    } else {
        Ok(Value::Array(values))
    }
}

/// Runs one request on the engine; a client disconnect aborts it. An engine-side abort is an
/// answer with finish reason `abort` (as SGLang answers an aborted request), not an error.
pub(super) async fn run_request(
    engine: Arc<dyn InferenceEngine>,
    request: GenerateRequest,
) -> ApiResult<GenerateOutput> {
    let request_id = request
        .request_id
        .clone()
        .unwrap_or_else(|| RequestId::new(""));
    let prompt_tokens = request.input_ids.len();
    let mut guard = AbortOnDrop {
        engine: engine.clone(),
        request_id,
        armed: true,
    };
    let result = engine.generate(request.clone()).await;
    guard.armed = false;
    match result {
        Ok(output) => Ok(output),
        Err(miles_core::Error::Engine {
            kind: EngineErrorKind::Aborted,
            message,
        }) => {
            tracing::debug!(%message, "request aborted in the engine");
            let weight_version = engine.weight_version().await.unwrap_or_default();
            Ok(GenerateOutput {
                request_id: request.request_id,
                output_ids: Vec::new(),
                output_log_probs: Vec::new(),
                routed_experts: None,
                finish_reason: FinishReason::Abort,
                matched_stop: None,
                weight_version,
                prompt_tokens,
                cached_tokens: 0,
            })
        }
        Err(error) => Err(ApiError::from_engine(error)),
    }
}

/// Runs requests concurrently, answers in order; the first failure fails the call (the other
/// requests are dropped, and so aborted).
pub(super) async fn run_all(
    engine: &Arc<dyn InferenceEngine>,
    requests: Vec<GenerateRequest>,
) -> ApiResult<Vec<GenerateOutput>> {
    if requests.len() == 1 {
        let request = requests.into_iter().next().expect("one request");
        return Ok(vec![run_request(engine.clone(), request).await?]);
    }
    let mut tasks = JoinSet::new();
    let count = requests.len();
    for (index, request) in requests.into_iter().enumerate() {
        let engine = engine.clone();
        tasks.spawn(async move { (index, run_request(engine, request).await) });
    }
    let mut outputs: Vec<Option<GenerateOutput>> = (0..count).map(|_| None).collect();
    while let Some(joined) = tasks.join_next().await {
        let (index, result) = joined.map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("generation task failed: {e}"),
        })?;
        outputs[index] = Some(result?);
    }
    Ok(outputs.into_iter().flatten().collect())
}

/// Expands `n > 1` into `n` single-sample requests (SGLang answers them as a list); with a
/// seed, sample `i` uses `seed + i` so the samples differ but stay reproducible.
pub(super) fn expand_n(request: GenerateRequest) -> Vec<GenerateRequest> {
    let n = request.sampling_params.n.max(1);
    if n == 1 {
        return vec![request];
    }
    (0..n)
        .map(|i| {
            let mut one = request.clone();
            one.sampling_params.n = 1;
            one.sampling_params.sampling_seed = request
                .sampling_params
                .sampling_seed
                .map(|s| s.wrapping_add(i as u64));
            one.request_id = request
                .request_id
                .as_ref()
                .map(|id| RequestId::new(format!("{id}-{i}")));
            one
        })
        .collect()
}

pub(super) fn routing_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get(ROUTING_KEY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

pub(super) async fn generate(State(state): AppStateRef, request: Request) -> Response {
    let headers = request.headers().clone();
    let result = async {
        state.check_serving()?;
        let body = read_json(&state, request, false).await?;
        generate_inner(&state, &headers, body).await
    }
    .await;
    json_response(result)
}

pub(super) async fn generate_inner(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
) -> ApiResult<Value> {
    let body: GenerateRequestBody =
        serde_json::from_value(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    if body.stream {
        return Err(ApiError::bad_request(
            "stream is not supported by this server; send stream: false",
        ));
    }
    let mut params = body.sampling_params.clone();
    verify_sampling(&params)?;
    check_limits(&state.info, &params, body.prompt_count())?;
    let (prompts, batched) = parse_prompts(state, &body)?;
    if let Some(start) = body
        .logprob_start_len
        .filter(|&s| s >= 0 && body.return_logprob)
    {
        if params.max_new_tokens != Some(0) {
            return Err(ApiError::bad_request(
                "input log-probs (logprob_start_len >= 0) are served with max_new_tokens = 0 only",
            ));
        }
        return score_inputs(state, &body, prompts, batched, start as usize).await;
    }
    let options = OutputOptions {
        return_logprob: body.return_logprob,
        return_text_in_logprobs: body.return_text_in_logprobs,
    };
    let return_routed_experts = body.return_routed_experts;
    let routed_experts_start_len = body.routed_experts_start_len;
    let rids: Vec<Option<String>> = match body.rid {
        None => vec![None; prompts.len()],
        Some(OneOrBatch::One(s)) if !batched => vec![Some(s)],
        Some(OneOrBatch::Batch(ids)) if batched && ids.len() == prompts.len() => {
            ids.into_iter().map(Some).collect()
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "rid must be a string (a list of one per prompt for a batch)",
            ));
        }
    };
    let routing_key = routing_key(headers);
    let requested_max = params.max_new_tokens;
    params.max_new_tokens = None;
    let mut requests = Vec::new();
    for (prompt, rid) in prompts.into_iter().zip(rids) {
        let mut one_params = params.clone();
        one_params.max_new_tokens = Some(resolve_max_new(
            &state.info,
            requested_max,
            prompt.len(),
            state.info.default_max_new_tokens,
        )?);
        let mut request = GenerateRequest::new(prompt, one_params);
        request.request_id = Some(RequestId::new(rid.unwrap_or_else(|| state.fresh_id(""))));
        request.routing_key = routing_key.clone();
        request.return_logprob = options.return_logprob;
        request.return_routed_experts = return_routed_experts;
        request.routed_experts_start_len = routed_experts_start_len;
        requests.extend(expand_n(request));
    }
    let ids: Vec<String> = requests
        .iter()
        .map(|r| {
            r.request_id
                .as_ref()
                .map(|id| id.0.clone())
                .unwrap_or_default()
        })
        .collect();
    let started = Instant::now();
    let outputs = run_all(&state.engine, requests).await?;
    let latency = started.elapsed().as_secs_f64();
    let mut answers = Vec::with_capacity(outputs.len());
    for (output, rid) in outputs.iter().zip(&ids) {
        let answer = GenerateResponse {
            // SGLang's text: special tokens skipped and the matched stop trimmed unless the
            // request says otherwise; `output_ids` keep the stop token.
            text: state.info.tokenizer.as_ref().map(|tokenizer| {
                output_text(
                    &output.output_ids,
                    output.matched_stop.as_ref(),
                    &params,
                    |ids, skip| tokenizer.decode_text(ids, skip),
                )
            }),
            output_ids: Some(output.output_ids.clone()),
            meta_info: meta_info(state, rid, output, options, latency)?,
        };
        answers.push(answer);
    }
    answers_body(answers, batched)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::RequestLimits;
    use miles_core::WeightVersion;
    use serde_json::json;

    fn finish_reason_json(output: &GenerateOutput) -> Value {
        serde_json::to_value(finish_reason(output)).unwrap()
    }

    #[test]
    fn request_limits_bound_n_sequences_and_stops() {
        let info = ServerInfo {
            limits: RequestLimits::default()
                .with_max_n(4)
                .with_stop_strings(2, 3)
                .with_max_stop_token_ids(2),
            max_sequences: 10,
            ..ServerInfo::new("limits")
        };
        let params = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = SamplingParams::default();
            f(&mut p);
            p
        };
        let message = |p: &SamplingParams, prompts: usize| {
            check_limits(&info, p, prompts).map_err(|e| (e.status, e.message))
        };
        assert!(message(&params(&|p| p.n = 4), 2).is_ok());
        assert!(
            message(&params(&|p| p.n = 5), 1)
                .unwrap_err()
                .1
                .contains("n = 5")
        );
        // 3 prompts × 4 = 12 > 10; usize::MAX prompts × 2 overflows and is rejected too.
        assert!(
            message(&params(&|p| p.n = 4), 3)
                .unwrap_err()
                .1
                .contains("3 prompts")
        );
        assert!(message(&params(&|p| p.n = 2), usize::MAX).is_err());
        assert!(message(&params(&|p| p.stop = vec!["a".into(); 3]), 1).is_err());
        assert!(message(&params(&|p| p.stop = vec!["abcd".into()]), 1).is_err());
        assert!(message(&params(&|p| p.stop = vec!["abc".into(); 2]), 1).is_ok());
        assert!(message(&params(&|p| p.stop_token_ids = vec![1, 2, 3]), 1).is_err());
        let (status, _) = message(&params(&|p| p.n = 99), 1).unwrap_err();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        // prompt + max_new past usize is over any context, never a wrap-around.
        let info = ServerInfo {
            context_length: Some(100),
            ..ServerInfo::new("m")
        };
        assert!(resolve_max_new(&info, Some(usize::MAX), 5, 1).is_err());
        assert_eq!(resolve_max_new(&info, Some(95), 5, 1).unwrap(), 95);
        assert!(resolve_max_new(&info, Some(96), 5, 1).is_err());
    }

    #[test]
    fn sampling_checks_match_sglang() {
        let ok = SamplingParams::default();
        assert!(verify_sampling(&ok).is_ok());
        for bad in [
            SamplingParams {
                temperature: -0.1,
                ..ok.clone()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..ok.clone()
            },
            SamplingParams {
                top_p: 0.0,
                ..ok.clone()
            },
            SamplingParams {
                top_k: 0,
                ..ok.clone()
            },
            SamplingParams {
                min_p: 1.5,
                ..ok.clone()
            },
            SamplingParams { n: 0, ..ok.clone() },
            SamplingParams {
                max_new_tokens: Some(2),
                min_new_tokens: 3,
                ..ok.clone()
            },
        ] {
            let error = verify_sampling(&bad).unwrap_err();
            assert_eq!(error.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
    }

    #[test]
    fn n_expands_with_distinct_seeds_and_ids() {
        let mut request = GenerateRequest::new(
            vec![1],
            SamplingParams {
                n: 3,
                sampling_seed: Some(10),
                ..SamplingParams::default()
            },
        );
        request.request_id = Some(RequestId::new("r"));
        let expanded = expand_n(request);
        let seeds: Vec<_> = expanded
            .iter()
            .map(|r| r.sampling_params.sampling_seed)
            .collect();
        assert_eq!(seeds, [Some(10), Some(11), Some(12)]);
        let ids: Vec<_> = expanded
            .iter()
            .map(|r| r.request_id.clone().unwrap().0)
            .collect();
        assert_eq!(ids, ["r-0", "r-1", "r-2"]);
        assert!(expanded.iter().all(|r| r.sampling_params.n == 1));
    }

    #[test]
    fn finish_reasons_use_sglang_objects() {
        let mut output = GenerateOutput {
            request_id: None,
            output_ids: vec![4, 5, 6],
            output_log_probs: vec![],
            routed_experts: None,
            finish_reason: FinishReason::Length,
            matched_stop: None,
            weight_version: WeightVersion(1),
            prompt_tokens: 2,
            cached_tokens: 0,
        };
        assert_eq!(
            finish_reason_json(&output),
            json!({"type": "length", "length": 3})
        );
        output.finish_reason = FinishReason::Stop;
        output.matched_stop = Some(json!(6));
        assert_eq!(
            finish_reason_json(&output),
            json!({"type": "stop", "matched": 6})
        );
        output.finish_reason = FinishReason::Abort;
        assert_eq!(finish_reason_json(&output)["type"], "abort");
    }
}
