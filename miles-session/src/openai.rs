//! The OpenAI chat-completions request body, with the SGLang extensions Miles sends
//! (SGLang's chat-completions API), as one typed view shared by the session server and by miles-rollout's
//! SGLang-compatible server.
//!
//! Only the fields either server acts on are typed; unknown fields are ignored (the session
//! server keeps them in the recorded body). [`ChatCompletionRequest::sampling_params`] maps the
//! OpenAI sampling fields onto [`SamplingParams`] the same way for both servers; the token
//! budget (`max_tokens` against the context length) stays with each server, since they bound it
//! differently.
//!
//! ```
//! use miles_session::openai::ChatCompletionRequest;
//!
//! let body = serde_json::json!({
//!     "messages": [{"role": "user", "content": "hi"}],
//!     "temperature": 0.7, "top_k": 20, "stop": "\n\n", "stop_token_ids": [7, 2],
//! });
//! let request: ChatCompletionRequest = serde_json::from_value(body)?;
//! let params = request.sampling_params(vec![2]);
//! assert_eq!(params.temperature, 0.7);
//! assert_eq!(params.top_k, 20);
//! assert_eq!(params.stop, vec!["\n\n".to_string()]);
//! assert_eq!(params.stop_token_ids, vec![2, 7]);
//! assert!(params.no_stop_trim);
//! # Ok::<(), serde_json::Error>(())
//! ```

use miles_core::{Message, SamplingParams, TokenId, ToolSpec};
use serde::Deserialize;
use serde_json::Value;

/// `stop` as OpenAI allows it: one string or a list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// `"stop": "\n\n"`.
    One(String),
    /// `"stop": ["a", "b"]`.
    Many(Vec<String>),
}

impl StopSpec {
    /// The stop strings as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s.clone()],
            StopSpec::Many(v) => v.clone(),
        }
    }
}

/// The typed view of a chat-completions body.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatCompletionRequest {
    /// The conversation.
    pub messages: Vec<Message>,
    /// Tools offered to the model.
    #[serde(default)]
    pub tools: Option<Vec<ToolSpec>>,
    /// Model name (echoed back).
    #[serde(default)]
    pub model: Option<String>,
    /// Legacy token limit.
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Token limit (wins over `max_tokens`).
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// SGLang's `min_tokens`.
    #[serde(default)]
    pub min_tokens: Option<usize>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Top-k (SGLang extension; `-1` = off).
    #[serde(default)]
    pub top_k: Option<i32>,
    /// Min-p (SGLang extension).
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Sampling seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<StopSpec>,
    /// Extra stop token ids (SGLang extension).
    #[serde(default)]
    pub stop_token_ids: Option<Vec<TokenId>>,
    /// Frequency penalty.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Presence penalty.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Completions per request.
    #[serde(default)]
    pub n: Option<usize>,
    /// Stream the answer (as one SSE chunk + `[DONE]`).
    #[serde(default)]
    pub stream: Option<bool>,
    /// Return per-token log-probs.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Extra chat-template variables.
    #[serde(default)]
    pub chat_template_kwargs: Option<Value>,
    /// SGLang extension (set by Miles' session server): the prompt as ids, not rendered again.
    #[serde(default)]
    pub input_ids: Option<Vec<TokenId>>,
    /// SGLang extension: return the routed experts.
    #[serde(default)]
    pub return_routed_experts: Option<bool>,
    /// SGLang extension: first position whose routed experts are returned.
    #[serde(default)]
    pub routed_experts_start_len: Option<usize>,
    /// SGLang extension: return `meta_info`.
    #[serde(default)]
    pub return_meta_info: Option<bool>,
    /// SGLang extension: keep the stop string / token in the text.
    #[serde(default)]
    pub no_stop_trim: Option<bool>,
    /// SGLang extension: split reasoning from content.
    #[serde(default)]
    pub separate_reasoning: Option<bool>,
    /// SGLang extension: the request id (abortable by it).
    #[serde(default)]
    pub rid: Option<String>,
}

impl ChatCompletionRequest {
    /// The request's sampling fields as [`SamplingParams`]: temperature, top-p / top-k / min-p,
    /// `min_tokens`, seed, penalties, `n`, stop strings, and `stop_token_ids` appended (without
    /// repeats) to `default_stop_ids` (the tokenizer's own stop tokens). `no_stop_trim` is on:
    /// the stop token stays in the output ids, whose log-probs are recorded; both servers trim
    /// the text themselves. `max_new_tokens` is left to the caller.
    pub fn sampling_params(&self, default_stop_ids: Vec<TokenId>) -> SamplingParams {
        let mut params = SamplingParams::default();
        if let Some(v) = self.temperature {
            params.temperature = v;
        }
        if let Some(v) = self.top_p {
            params.top_p = v;
        }
        if let Some(v) = self.top_k {
            params.top_k = v;
        }
        if let Some(v) = self.min_p {
            params.min_p = v;
        }
        params.min_new_tokens = self.min_tokens.unwrap_or(0);
        params.sampling_seed = self.seed;
        params.frequency_penalty = self.frequency_penalty.unwrap_or(0.0);
        params.presence_penalty = self.presence_penalty.unwrap_or(0.0);
        params.n = self.n.unwrap_or(1);
        params.stop = self.stop.as_ref().map(StopSpec::to_vec).unwrap_or_default();
        // Merged in linear time: the template's stop ids, then the request's new ones.
        let mut seen: std::collections::HashSet<TokenId> =
            default_stop_ids.iter().copied().collect();
        params.stop_token_ids = default_stop_ids;
        for &id in self.stop_token_ids.iter().flatten() {
            if seen.insert(id) {
                params.stop_token_ids.push(id);
            }
        }
        params.no_stop_trim = true;
        params
    }

    /// The requested token limit: `max_completion_tokens`, else `max_tokens`.
    pub fn requested_max_tokens(&self) -> Option<usize> {
        self.max_completion_tokens.or(self.max_tokens)
    }
}

/// Bounds on the fields of a chat request, checked by [`ChatCompletionRequest::check_limits`]
/// before anything is allocated for the request (`n` copies, stop matchers, …).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestLimits {
    /// Largest `n` (choices per request). Servers expand `n` lazily, one generation at a time.
    pub max_n: usize,
    /// Most stop strings.
    pub max_stop_strings: usize,
    /// Longest stop string, in bytes.
    pub max_stop_len: usize,
    /// Most `stop_token_ids`.
    pub max_stop_token_ids: usize,
}

impl Default for RequestLimits {
    /// `n ≤ 64`, ≤ 64 stop strings of ≤ 4096 bytes, ≤ 1024 stop token ids.
    fn default() -> Self {
        Self {
            max_n: 64,
            max_stop_strings: 64,
            max_stop_len: 4096,
            max_stop_token_ids: 1024,
        }
    }
}

impl RequestLimits {
    /// Sets [`RequestLimits::max_n`].
    pub fn with_max_n(mut self, max_n: usize) -> Self {
        self.max_n = max_n;
        self
    }
    /// Sets [`RequestLimits::max_stop_strings`] and [`RequestLimits::max_stop_len`].
    pub fn with_stop_strings(mut self, count: usize, max_len: usize) -> Self {
        self.max_stop_strings = count;
        self.max_stop_len = max_len;
        self
    }
    /// Sets [`RequestLimits::max_stop_token_ids`].
    pub fn with_max_stop_token_ids(mut self, count: usize) -> Self {
        self.max_stop_token_ids = count;
        self
    }
}

impl ChatCompletionRequest {
    /// Checks the request against `limits` and the value ranges SGLang accepts
    /// (`temperature ≥ 0`, `0 < top_p ≤ 1`, `top_k = -1` or `≥ 1`, `0 ≤ min_p ≤ 1`,
    /// penalties in `[-2, 2]`, `min_tokens ≤ max_tokens`); the error says which field.
    pub fn check_limits(&self, limits: &RequestLimits) -> Result<(), String> {
        if let Some(n) = self.n
            && (n == 0 || n > limits.max_n)
        {
            return Err(format!("n = {n} is outside 1..={}", limits.max_n));
        }
        let stops: &[String] = match &self.stop {
            None => &[],
            Some(StopSpec::One(s)) => std::slice::from_ref(s),
            Some(StopSpec::Many(v)) => v,
        };
        if stops.len() > limits.max_stop_strings {
            return Err(format!(
                "{} stop strings, more than the limit {}",
                stops.len(),
                limits.max_stop_strings
            ));
        }
        if let Some(long) = stops.iter().find(|s| s.len() > limits.max_stop_len) {
            return Err(format!(
                "a stop string of {} bytes, longer than the limit {}",
                long.len(),
                limits.max_stop_len
            ));
        }
        if stops.iter().any(String::is_empty) {
            return Err("empty stop string".into());
        }
        let ids = self.stop_token_ids.as_deref().unwrap_or(&[]);
        if ids.len() > limits.max_stop_token_ids {
            return Err(format!(
                "{} stop_token_ids, more than the limit {}",
                ids.len(),
                limits.max_stop_token_ids
            ));
        }
        let finite = |name: &str, v: Option<f32>, ok: &dyn Fn(f32) -> bool| match v {
            Some(x) if !(x.is_finite() && ok(x)) => Err(format!("{name} = {x} is out of range")),
            _ => Ok(()),
        };
        finite("temperature", self.temperature, &|x| x >= 0.0)?;
        finite("top_p", self.top_p, &|x| x > 0.0 && x <= 1.0)?;
        finite("min_p", self.min_p, &|x| (0.0..=1.0).contains(&x))?;
        finite("frequency_penalty", self.frequency_penalty, &|x| {
            (-2.0..=2.0).contains(&x)
        })?;
        finite("presence_penalty", self.presence_penalty, &|x| {
            (-2.0..=2.0).contains(&x)
        })?;
        if let Some(k) = self.top_k
            && k != -1
            && k < 1
        {
            return Err(format!("top_k = {k} must be -1 (off) or at least 1"));
        }
        if let (Some(min), Some(max)) = (self.min_tokens, self.requested_max_tokens())
            && min > max
        {
            return Err(format!("min_tokens = {min} is over max_tokens = {max}"));
        }
        Ok(())
    }
}

/// The OpenAI chat-completion envelope both servers answer with: `id`, `object`
/// (`chat.completion`), `created`, `model`, `choices` and `usage`.
pub fn completion_body(
    id: String,
    created: u64,
    model: String,
    choices: Vec<Value>,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    serde_json::json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    })
}

/// A chat completion as a non-incremental stream (what Miles' session server and SGLang's
/// `stream: true` answer with here): one `chat.completion.chunk` per choice carrying its whole
/// message as the delta (`role`, `content`, and `reasoning_content` / `tool_calls` when set),
/// its `logprobs` when the choice has the key, the `usage` when the body has it, then
/// `data: [DONE]`.
pub fn sse_response(body: &Value) -> axum::response::Response {
    use axum::http::{HeaderValue, header};
    let mut text = String::new();
    for choice in body["choices"].as_array().into_iter().flatten() {
        let message = &choice["message"];
        let mut delta = serde_json::json!({"role": "assistant", "content": message["content"]});
        for key in ["reasoning_content", "tool_calls"] {
            if message.get(key).is_some_and(|v| !v.is_null()) {
                delta[key] = message[key].clone();
            }
        }
        let mut streamed = serde_json::json!({"index": choice["index"], "delta": delta});
        if let Some(logprobs) = choice.get("logprobs") {
            streamed["logprobs"] = logprobs.clone();
        }
        streamed["finish_reason"] = choice["finish_reason"].clone();
        let mut chunk = serde_json::json!({
            "id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"], "choices": [streamed],
        });
        if let Some(usage) = body.get("usage") {
            chunk["usage"] = usage.clone();
        }
        text.push_str(&format!("data: {chunk}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    let mut response = axum::response::Response::new(axum::body::Body::from(text));
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        // With the charset, as FastAPI's StreamingResponse sends it: python-requests decodes
        // the stream as UTF-8 instead of ISO-8859-1.
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}
