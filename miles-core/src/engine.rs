//! The token-level generation protocol and the [`InferenceEngine`] seam.
//!
//! Field names follow SGLang's `/generate` API (SGLang's `/generate` API), so the embedded engine and
//! the SGLang HTTP client speak the same vocabulary.

use std::fmt;
use std::path::Path;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Result;
use crate::routed::RoutedExperts;
use crate::sample::TokenId;
use crate::weights::{InProcessWeights, NamedTensors, WeightVersion};

/// Identifies a generation request (for abort and tracing).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct RequestId(pub String);

impl RequestId {
    /// A request id from any string.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Sampling parameters with SGLang's names and defaults (`temperature` 1, `top_p` 1, `top_k`
/// −1 = off, `min_p` 0, `skip_special_tokens` on, `spaces_between_special_tokens` on,
/// `no_stop_trim` off: the output text skips special tokens and the matched stop, as SGLang's
/// `/generate` answers). Optional fields are omitted from the wire form when unset.
///
/// The text switches only change the text ([`output_text`]); the generated ids, their
/// log-probs and loss masks always include the stop token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; −1 disables.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` × the top probability.
    pub min_p: f32,
    /// Maximum tokens to generate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Minimum tokens before a stop may end generation.
    #[serde(skip_serializing_if = "is_zero")]
    pub min_new_tokens: usize,
    /// Stop strings.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Stop token ids.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop_token_ids: Vec<TokenId>,
    /// Drop special tokens when detokenising the output text (SGLang's default: on).
    pub skip_special_tokens: bool,
    /// Keep the matched stop token / string in the output text (SGLang's default: off; the
    /// ids keep the stop token either way).
    pub no_stop_trim: bool,
    /// Insert spaces between special tokens when detokenising.
    pub spaces_between_special_tokens: bool,
    /// Seed for reproducible sampling.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sampling_seed: Option<u64>,
    /// Number of completions to sample for the prompt.
    #[serde(skip_serializing_if = "is_one")]
    pub n: usize,
    /// OpenAI frequency penalty.
    #[serde(skip_serializing_if = "is_zero_f32")]
    pub frequency_penalty: f32,
    /// OpenAI presence penalty.
    #[serde(skip_serializing_if = "is_zero_f32")]
    pub presence_penalty: f32,
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

fn is_one(v: &usize) -> bool {
    *v == 1
}

fn is_zero_f32(v: &f32) -> bool {
    *v == 0.0
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            max_new_tokens: None,
            min_new_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            skip_special_tokens: true,
            no_stop_trim: false,
            spaces_between_special_tokens: true,
            sampling_seed: None,
            n: 1,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// One token-level generation request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The prompt, as token ids.
    pub input_ids: Vec<TokenId>,
    /// How to sample.
    #[serde(default)]
    pub sampling_params: SamplingParams,
    /// Id for abort / tracing (`rid` in SGLang).
    #[serde(default, rename = "rid", skip_serializing_if = "Option::is_none")]
    pub request_id: Option<RequestId>,
    /// Sticky routing key (sent as the `X-SMG-Routing-Key` header, not in the body).
    #[serde(skip)]
    pub routing_key: Option<String>,
    /// Return per-token log-probs of the sampled tokens.
    #[serde(default)]
    pub return_logprob: bool,
    /// Return the MoE expert choices of every forwarded position.
    #[serde(default)]
    pub return_routed_experts: bool,
    /// With addition-R3: only rows from this position on are returned (Miles' addition-R3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts_start_len: Option<usize>,
}

impl GenerateRequest {
    /// A request for `input_ids` with default sampling, log-probs on.
    pub fn new(input_ids: Vec<TokenId>, sampling_params: SamplingParams) -> Self {
        Self {
            input_ids,
            sampling_params,
            request_id: None,
            routing_key: None,
            return_logprob: true,
            return_routed_experts: false,
            routed_experts_start_len: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token or stop string was produced.
    Stop,
    /// `max_new_tokens` or the context limit was reached.
    Length,
    /// The request was aborted.
    Abort,
}

impl FinishReason {
    /// SGLang's wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// The result of one generation request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateOutput {
    /// The request's id, if it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<RequestId>,
    /// Generated token ids (the matched stop token included, whatever `no_stop_trim` says).
    pub output_ids: Vec<TokenId>,
    /// Log-prob of each generated token under the generating weights (empty unless asked).
    #[serde(default)]
    pub output_log_probs: Vec<f64>,
    /// Expert choices `[prompt + output − 1, layers, top_k]` (or from
    /// `routed_experts_start_len` on), when asked and the model is MoE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<RoutedExperts>,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// The stop token id or string that ended generation, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matched_stop: Option<Value>,
    /// The weight version every token was generated with.
    pub weight_version: WeightVersion,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: usize,
}

/// The text SGLang's detokenizer gives for generated ids (its `trim_matched_stop` and
/// `skip_special_tokens`): unless `params.no_stop_trim`, a stop *token* that ended generation
/// (`matched_stop` a number) is left out of the decoded ids, and the text is cut before the
/// first occurrence of a stop *string* that ended it. `decode(ids, skip_special_tokens)` is
/// the tokenizer's decode. As in SGLang, a falsy `matched` (token id 0, an empty string) trims
/// nothing. The ids themselves are never changed.
///
/// ```
/// use miles_core::{SamplingParams, output_text};
/// use serde_json::json;
/// let decode = |ids: &[u32], skip: bool| {
///     ids.iter()
///         .filter(|&&id| !(skip && id == 9))
///         .map(|id| if *id == 9 { "<eos>".to_string() } else { id.to_string() })
///         .collect::<String>()
/// };
/// let params = SamplingParams::default();
/// assert_eq!(output_text(&[1, 3, 5, 9], Some(&json!(9)), &params, decode), "135");
/// let keep = SamplingParams { no_stop_trim: true, skip_special_tokens: false, ..params.clone() };
/// assert_eq!(output_text(&[1, 3, 5, 9], Some(&json!(9)), &keep, decode), "135<eos>");
/// assert_eq!(output_text(&[1, 3, 5], Some(&json!("35")), &params, decode), "1");
/// ```
pub fn output_text(
    output_ids: &[TokenId],
    matched_stop: Option<&Value>,
    params: &SamplingParams,
    decode: impl FnOnce(&[TokenId], bool) -> String,
) -> String {
    let trim = !params.no_stop_trim;
    let mut ids = output_ids;
    if trim
        && let Some(Value::Number(n)) = matched_stop
        && n.as_u64() != Some(0)
        && let Some((_, head)) = ids.split_last()
    {
        ids = head;
    }
    let mut text = decode(ids, params.skip_special_tokens);
    if trim
        && let Some(Value::String(stop)) = matched_stop
        && !stop.is_empty()
        && let Some(at) = text.find(stop.as_str())
    {
        text.truncate(at);
    }
    text
}

/// What happens to in-flight requests when generation is paused (SGLang's `pause_generation`
/// modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PauseMode {
    /// Abort in-flight requests (they return with finish reason `abort`).
    #[default]
    Abort,
    /// Stop scheduling; in-flight requests keep their state and continue after resume.
    InPlace,
    /// Retract in-flight requests to the waiting queue, releasing their KV cache.
    Retract,
}

/// What an engine releases for the trainer while it trains and takes back afterwards (SGLang's
/// `/release_memory_occupation` / `/resume_memory_occupation` `tags`; Miles'
/// `--offload-rollout-level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryTag {
    /// The served weights and every copy the engine keeps of them (SGLang's `weights`; Miles'
    /// level `weight`). They come back with the next weight update.
    Weights,
    /// The KV cache pool and the prefix cache (`kv_cache`).
    KvCache,
}

impl MemoryTag {
    /// SGLang's name of the tag (`weights`, `kv_cache`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Weights => "weights",
            Self::KvCache => "kv_cache",
        }
    }
}

/// A request for the log-probs of a sequence's own tokens, without generating (SGLang's
/// `/generate` with `max_new_tokens = 0`, `return_logprob` and `logprob_start_len`): what an
/// on-policy-distillation teacher answers.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct InputLogprobRequest {
    /// The sequence (at least one token).
    pub input_ids: Vec<TokenId>,
    /// Also the `k` most likely tokens at each position (SGLang's `top_logprobs_num`; 0: none).
    #[serde(default)]
    pub top_logprobs_num: usize,
    /// Also the log-probs of these token ids at each position (SGLang's `token_ids_logprob`).
    #[serde(default)]
    pub token_ids_logprob: Vec<TokenId>,
    /// Instead of `token_ids_logprob`: the ids to score at each input position, entry `p` for
    /// the distribution of `input_ids[p]` (entry 0 is SGLang's placeholder position, ignored;
    /// positions past the list's end get none). A patched SGLang's
    /// `token_ids_logprob_positions`, what Miles' `--opd-topk-per-position` sends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids_logprob_positions: Option<Vec<Vec<TokenId>>>,
}

/// The answer to an [`InputLogprobRequest`]: for every position `p ≥ 1` of the input, the
/// distribution of `input_ids[p]` given `input_ids[..p]` (SGLang's first, placeholder position
/// has none). Every vector has `input_ids.len() − 1` entries.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct InputLogprobs {
    /// `log p(input_ids[p] | input_ids[..p])`.
    pub token_logprobs: Vec<f64>,
    /// The `top_logprobs_num` most likely `(token id, log-prob)` pairs, most likely first
    /// (empty lists when not asked).
    pub top_logprobs: Vec<Vec<(TokenId, f64)>>,
    /// `(token id, log-prob)` of each id of `token_ids_logprob`, in the request's order (empty
    /// lists when not asked).
    pub token_ids_logprobs: Vec<Vec<(TokenId, f64)>>,
    /// The weight version that scored the input.
    pub weight_version: WeightVersion,
}

/// A token-in-token-out inference engine: the embedded burn engine, a remote SGLang server, or
/// a router over many. Object-safe, used as `Arc<dyn InferenceEngine>`.
///
/// Contract: every output carries the weight version it was generated with, and a weight
/// update never lands in the middle of a generation step.
#[async_trait]
pub trait InferenceEngine: Send + Sync {
    /// Generates a completion for one request.
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput>;

    /// Replaces the weights in place with HF-named tensors and sets the version.
    async fn update_weights(&self, weights: &NamedTensors, version: WeightVersion) -> Result<()>;

    /// Whether [`InferenceEngine::update_weights_in_process`] can take a trainer's
    /// in-process weights (an engine in the same process; default `false`).
    fn takes_in_process_weights(&self) -> bool {
        false
    }

    /// Replaces the weights with a trainer's in-process value
    /// ([`crate::PolicyTrainer::export_in_process`]) and sets the version, as
    /// [`InferenceEngine::update_weights`] does with host tensors. `Ok(false)` (the default)
    /// when this engine cannot take that value (nothing changed: push host tensors instead).
    async fn update_weights_in_process(
        &self,
        weights: &InProcessWeights,
        version: WeightVersion,
    ) -> Result<bool> {
        let _ = (weights, version);
        Ok(false)
    }

    /// Loads HF-named safetensors from a directory (SGLang's `update_weights_from_disk`) and
    /// sets the version.
    async fn update_weights_from_disk(&self, dir: &Path, version: WeightVersion) -> Result<()>;

    /// Pauses generation.
    async fn pause(&self, mode: PauseMode) -> Result<()>;

    /// Resumes generation after a pause.
    async fn resume(&self) -> Result<()>;

    /// Drops cached prefixes (after a weight update they are stale).
    async fn flush_cache(&self) -> Result<()>;

    /// Aborts one request; unknown ids are not an error (it may have finished).
    async fn abort(&self, request_id: &RequestId) -> Result<()>;

    /// Aborts every in-flight request.
    async fn abort_all(&self) -> Result<()>;

    /// `Ok` when the engine can serve.
    async fn health(&self) -> Result<()>;

    /// The version of the weights currently loaded.
    async fn weight_version(&self) -> Result<WeightVersion>;

    /// Frees the memory of `tags` until [`InferenceEngine::resume_memory_occupation`] (SGLang's
    /// `/release_memory_occupation`, what Miles' `--offload-rollout` calls before training):
    /// waits until nothing is generating, then drops the served weights (they come back with
    /// the next weight update) and / or the KV cache. Generation requests sent meanwhile wait.
    /// `Ok(false)` (the default) when this engine cannot release memory (nothing changed).
    async fn release_memory_occupation(&self, tags: &[MemoryTag]) -> Result<bool> {
        let _ = tags;
        Ok(false)
    }

    /// Takes back the memory of `tags` released by
    /// [`InferenceEngine::release_memory_occupation`] (SGLang's `/resume_memory_occupation`):
    /// the KV cache is allocated again; released weights are back once a weight update has
    /// loaded them (Miles' order: resume weights, update, resume the KV cache). `Ok(false)`
    /// (the default) when this engine cannot release memory.
    async fn resume_memory_occupation(&self, tags: &[MemoryTag]) -> Result<bool> {
        let _ = tags;
        Ok(false)
    }

    /// Scores a sequence's own tokens without generating (see [`InputLogprobRequest`]). The
    /// default answers an `invalid_request` engine error: engines that can score override it.
    async fn input_logprobs(&self, request: InputLogprobRequest) -> Result<InputLogprobs> {
        let _ = request;
        Err(crate::Error::engine(
            crate::EngineErrorKind::InvalidRequest,
            "this engine does not score input tokens (input log-probs)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn absent_text_switches_take_sglang_defaults() {
        // SGLang's SamplingParams: skip_special_tokens=True, spaces_between_special_tokens=True,
        // no_stop_trim=False.
        let p: SamplingParams = serde_json::from_value(json!({"temperature": 0})).unwrap();
        assert!(p.skip_special_tokens && p.spaces_between_special_tokens && !p.no_stop_trim);
    }

    #[test]
    fn output_text_trims_like_sglang_detokenizer() {
        let decode = |ids: &[u32], skip: bool| -> String {
            ids.iter()
                .filter(|&&id| !(skip && id >= 100))
                .map(|&id| match id {
                    100 => "<|im_end|>".to_string(),
                    101 => "<|endoftext|>".to_string(),
                    n => char::from(b'a' + n as u8).to_string(),
                })
                .collect()
        };
        let sglang = SamplingParams::default();
        let miles = SamplingParams {
            skip_special_tokens: false,
            no_stop_trim: true,
            ..SamplingParams::default()
        };
        let no_skip = SamplingParams {
            skip_special_tokens: false,
            ..SamplingParams::default()
        };
        // EOS matched: dropped by the trim, and by the skip.
        assert_eq!(
            output_text(&[0, 1, 100], Some(&json!(100)), &sglang, decode),
            "ab"
        );
        assert_eq!(
            output_text(&[0, 1, 100], Some(&json!(100)), &no_skip, decode),
            "ab"
        );
        assert_eq!(
            output_text(&[0, 1, 100], Some(&json!(100)), &miles, decode),
            "ab<|im_end|>"
        );
        // A non-special stop token is trimmed too; a special one in the middle only skipped.
        assert_eq!(
            output_text(&[0, 101, 2, 3], Some(&json!(3)), &sglang, decode),
            "ac"
        );
        assert_eq!(
            output_text(&[0, 101, 2, 3], Some(&json!(3)), &no_skip, decode),
            "a<|endoftext|>c"
        );
        // A stop string cuts the text at its first occurrence.
        assert_eq!(
            output_text(&[0, 1, 2, 1], Some(&json!("b")), &sglang, decode),
            "a"
        );
        assert_eq!(
            output_text(&[0, 1, 2, 1], Some(&json!("b")), &miles, decode),
            "abcb"
        );
        // Length / abort: nothing trimmed; token id 0 is falsy in Python, so not trimmed.
        assert_eq!(output_text(&[0, 1], None, &sglang, decode), "ab");
        assert_eq!(output_text(&[1, 0], Some(&json!(0)), &sglang, decode), "ba");
        assert_eq!(output_text(&[], Some(&json!(7)), &sglang, decode), "");
    }

    #[test]
    fn request_wire_form_uses_sglang_names() {
        let mut params = SamplingParams {
            max_new_tokens: Some(16),
            sampling_seed: Some(7),
            ..SamplingParams::default()
        };
        params.stop_token_ids.push(2);
        let mut request = GenerateRequest::new(vec![1, 2, 3], params);
        request.request_id = Some(RequestId::new("r1"));
        request.routing_key = Some("session-1".into());
        request.return_routed_experts = true;
        let wire = serde_json::to_value(&request).unwrap();
        assert_eq!(
            wire,
            json!({
                "input_ids": [1, 2, 3],
                "sampling_params": {
                    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                    "max_new_tokens": 16, "stop_token_ids": [2],
                    "skip_special_tokens": true, "no_stop_trim": false,
                    "spaces_between_special_tokens": true, "sampling_seed": 7
                },
                "rid": "r1",
                "return_logprob": true,
                "return_routed_experts": true
            })
        );
        let back: GenerateRequest = serde_json::from_value(wire).unwrap();
        assert_eq!(
            back.routing_key, None,
            "the routing key travels as a header"
        );
        assert_eq!(back.sampling_params, request.sampling_params);
    }

    #[test]
    fn output_and_pause_mode_round_trip() {
        let output = GenerateOutput {
            request_id: None,
            output_ids: vec![5, 6],
            output_log_probs: vec![-0.5, -1.5],
            routed_experts: None,
            finish_reason: FinishReason::Length,
            matched_stop: None,
            weight_version: WeightVersion(3),
            prompt_tokens: 4,
            cached_tokens: 0,
        };
        let wire = serde_json::to_value(&output).unwrap();
        assert_eq!(wire["finish_reason"], json!("length"));
        assert_eq!(wire["weight_version"], json!("3"));
        assert_eq!(
            serde_json::from_value::<GenerateOutput>(wire).unwrap(),
            output
        );
        assert_eq!(
            serde_json::to_value(PauseMode::InPlace).unwrap(),
            json!("in_place")
        );
    }
}
