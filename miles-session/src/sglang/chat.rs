//! `/v1/chat/completions` over the engine: the chat template, reasoning and tool-call parsing
//! of the served family, streamed or whole.

use std::time::Instant;

use crate::openai::{ChatCompletionRequest, completion_body, sse_response};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use miles_core::{FinishReason, GenerateRequest, RequestId, ToolArguments};
use serde_json::{Map, Value, json};

use super::generate::{
    OutputOptions, check_limits, check_prompt, expand_n, meta_info, resolve_max_new, routing_key,
    run_all, verify_sampling,
};
use super::state::{ApiError, ApiResult, AppState, AppStateRef, now_secs, read_json};

// ---------------------------------------------------------------------------------------------
// /v1/chat/completions

pub(super) async fn chat_completions(State(state): AppStateRef, request: Request) -> Response {
    let headers = request.headers().clone();
    let result = async {
        state.check_serving()?;
        let body = read_json(&state, request, false).await?;
        chat_inner(&state, &headers, body).await
    }
    .await;
    match result {
        Ok((body, true)) => sse_response(&body),
        Ok((body, false)) => axum::Json(body).into_response(),
        Err(error) => error.into_response(),
    }
}

pub(super) async fn chat_inner(
    state: &AppState,
    headers: &HeaderMap,
    body: Value,
) -> ApiResult<(Value, bool)> {
    let tokenizer = state.info.tokenizer.clone().ok_or_else(|| {
        ApiError::bad_request("this server has no tokenizer: chat completions need one")
    })?;
    let chat: ChatCompletionRequest = serde_json::from_value(body)
        .map_err(|e| ApiError::bad_request(format!("invalid chat request: {e}")))?;
    if chat.messages.is_empty() && chat.input_ids.is_none() {
        return Err(ApiError::bad_request("messages must not be empty"));
    }
    let tools = chat.tools.clone().unwrap_or_default();
    let kwargs = match &chat.chat_template_kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "chat_template_kwargs must be an object, got {other}"
            )));
        }
    };
    let kwargs = tokenizer
        .resolve_kwargs(&kwargs)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = match &chat.input_ids {
        Some(ids) => ids.clone(),
        None => tokenizer
            .render(&chat.messages, &tools, true, &kwargs)
            .map_err(|e| ApiError::bad_request(format!("cannot render the chat: {e}")))?,
    };
    check_prompt(&state.info, &prompt)?;

    let mut params = chat.sampling_params(tokenizer.stop_token_ids());
    // The stop token stays in the ids (log-probs, meta_info); text trimming is done below.
    let requested = chat.requested_max_tokens();
    let default_max = state
        .info
        .context_length
        .map_or(state.info.default_max_new_tokens, |limit| {
            limit.saturating_sub(prompt.len())
        });
    params.max_new_tokens = Some(resolve_max_new(
        &state.info,
        requested,
        prompt.len(),
        default_max,
    )?);
    verify_sampling(&params)?;
    check_limits(&state.info, &params, 1)?;

    let mut request = GenerateRequest::new(prompt.clone(), params);
    request.request_id = Some(RequestId::new(
        chat.rid.clone().unwrap_or_else(|| state.fresh_id("chat-")),
    ));
    request.routing_key = routing_key(headers);
    request.return_logprob = true;
    request.return_routed_experts = chat.return_routed_experts.unwrap_or(false);
    request.routed_experts_start_len = chat.routed_experts_start_len;
    let requests = expand_n(request);
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

    let options = OutputOptions {
        return_logprob: true,
        return_text_in_logprobs: false,
    };
    let mut choices = Vec::with_capacity(outputs.len());
    let mut completion_tokens = 0;
    for (index, (output, rid)) in outputs.iter().zip(&ids).enumerate() {
        completion_tokens += output.output_ids.len();
        let mut parsed = tokenizer
            .parse_assistant(&output.output_ids, &tools)
            .map_err(|e| ApiError {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: format!("cannot parse the model output: {e}"),
            })?;
        if !chat.no_stop_trim.unwrap_or(false)
            && output.finish_reason == FinishReason::Stop
            && let Some(Value::String(stop)) = &output.matched_stop
            && let Some(stripped) = parsed.content.strip_suffix(stop.as_str())
        {
            parsed.content = stripped.to_owned();
        }
        let separate = chat.separate_reasoning.unwrap_or(true);
        if !separate && let Some(reasoning) = parsed.reasoning_content.take() {
            parsed.content = format!("<think>{reasoning}</think>{}", parsed.content);
        }
        let tool_calls: Vec<Value> = parsed
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let id = call
                    .id
                    .clone()
                    .unwrap_or_else(|| format!("call_{}", state.fresh_id("")));
                let arguments = match &call.function.arguments {
                    ToolArguments::Json(s) => s.clone(),
                    other => other.to_json_string(),
                };
                json!({"id": id, "index": i, "type": "function",
                       "function": {"name": call.function.name, "arguments": arguments}})
            })
            .collect();
        let finish_reason = match output.finish_reason {
            FinishReason::Stop if !tool_calls.is_empty() => "tool_calls",
            other => other.as_str(),
        };
        let message = json!({
            "role": "assistant",
            "content": parsed.content,
            "reasoning_content": parsed.reasoning_content,
            "tool_calls": if tool_calls.is_empty() { Value::Null } else { Value::Array(tool_calls) },
        });
        let logprobs = if chat.logprobs.unwrap_or(false) {
            let content: Vec<Value> = output
                .output_ids
                .iter()
                .zip(&output.output_log_probs)
                .map(|(&id, &lp)| {
                    let token = tokenizer.decode_token(id);
                    json!({"token": &*token, "logprob": lp,
                           "bytes": token.as_bytes(), "top_logprobs": []})
                })
                .collect();
            json!({"content": content})
        } else {
            Value::Null
        };
        let mut choice = json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "matched_stop": output.matched_stop.clone().unwrap_or(Value::Null),
        });
        if chat.return_meta_info.unwrap_or(false) {
            choice["meta_info"] =
                serde_json::to_value(meta_info(state, rid, output, options, latency)?)
                    .unwrap_or(Value::Null);
        }
        choices.push(choice);
    }
    let prompt_tokens = prompt.len();
    let body = completion_body(
        format!("chatcmpl-{}", state.fresh_id("")),
        now_secs(),
        chat.model
            .clone()
            .unwrap_or_else(|| state.info.served_model_name.clone()),
        choices,
        prompt_tokens,
        completion_tokens,
    );
    Ok((body, chat.stream.unwrap_or(false)))
}
