//! SGLang's `/generate` request and answer as types: the client writes the request
//! ([`GenerateRequestBody`], SGLang's `GenerateReqInput`) and reads the answer
//! ([`GenerateResponse`]), the server reads the one and writes the other, so the two ends
//! cannot drift apart.
//!
//! The request is read with the server's messages: each malformed field is an error naming
//! the field and what it must be (`return_logprob must be a boolean, got "yes"`,
//! `input_ids[1] holds -2, not a token id`), which the server answers as a 400.
//!
//! Reading is strict about shapes and lenient only where SGLang itself varies: a finish reason
//! is an object (`{"type": "stop", "matched": …}`) or a bare string, a weight version a string
//! (`"7"`, `"default"`) or a number. Counts are only read here; whether they agree with each
//! other and with the request is checked by the client ([`GenerateResponse`] carries no such
//! promise).

use miles_core::{FinishReason, GenerateRequest, SamplingParams, TokenId, WeightVersion};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

/// One item, or a batch of them: SGLang's `Union[T, List[T]]` fields (`text`, `input_ids`,
/// `rid`). Written as the item or as a list.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum OneOrBatch<T> {
    /// One prompt (or its id).
    One(T),
    /// A batch, one per prompt.
    Batch(Vec<T>),
}

impl<T> OneOrBatch<T> {
    /// How many items: 1 for `One`, the batch's length otherwise.
    pub fn len(&self) -> usize {
        match self {
            Self::One(_) => 1,
            Self::Batch(items) => items.len(),
        }
    }

    /// True for an empty batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// SGLang's `/generate` body (`GenerateReqInput`), the fields this server honours: the
/// prompt as `text` or `input_ids` (one, or a batch), `sampling_params` (with `n`), `rid`,
/// `return_logprob`, `return_text_in_logprobs`, `return_routed_experts`,
/// `routed_experts_start_len`, the input log-prob fields (`logprob_start_len`,
/// `top_logprobs_num`, `token_ids_logprob`: served with `max_new_tokens = 0`) and `stream`
/// (which this server refuses). Other keys SGLang
/// accepts are ignored. Absent and `null` fields take SGLang's defaults.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GenerateRequestBody {
    /// The prompt as text: one string, or a batch of strings (tokenized by the server).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "read::text"
    )]
    pub text: Option<OneOrBatch<String>>,
    /// The prompt as token ids: one list, or a batch of lists.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "read::input_ids"
    )]
    pub input_ids: Option<OneOrBatch<Vec<TokenId>>>,
    /// How to sample (SGLang's `sampling_params`, `n` included).
    #[serde(default, deserialize_with = "read::sampling_params")]
    pub sampling_params: SamplingParams,
    /// The request id: one, or one per prompt of a batch.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "read::rid"
    )]
    pub rid: Option<OneOrBatch<String>>,
    /// Return the log-prob of every generated token.
    #[serde(default, deserialize_with = "read::return_logprob")]
    pub return_logprob: bool,
    /// Return each generated token's text beside its log-prob.
    #[serde(
        default,
        skip_serializing_if = "is_false",
        deserialize_with = "read::return_text_in_logprobs"
    )]
    pub return_text_in_logprobs: bool,
    /// Return the MoE expert choices of every forwarded position.
    #[serde(default, deserialize_with = "read::return_routed_experts")]
    pub return_routed_experts: bool,
    /// Only routing rows from this position on (Miles' addition-R3).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "read::routed_experts_start_len"
    )]
    pub routed_experts_start_len: Option<usize>,
    /// Stream the answer (refused by this server).
    #[serde(
        default,
        skip_serializing_if = "is_false",
        deserialize_with = "read::stream"
    )]
    pub stream: bool,
    /// With `return_logprob`: also the log-probs of the input tokens from this position on
    /// (SGLang's default −1: none). This server scores inputs only with `max_new_tokens = 0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprob_start_len: Option<i64>,
    /// With input log-probs: also the `k` most likely tokens at each input position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs_num: Option<usize>,
    /// With input log-probs: also the log-probs of these token ids at each input position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids_logprob: Option<Vec<TokenId>>,
    /// With input log-probs, instead of `token_ids_logprob`: one id list per input position
    /// (a patched SGLang's field; Miles' `--opd-topk-per-position`). One prompt per request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids_logprob_positions: Option<Vec<Vec<TokenId>>>,
}

fn is_false(value: &bool) -> bool {
    !*value
}

impl GenerateRequestBody {
    /// How many prompts the body carries, for the limits checked before the prompts are
    /// read: a batch's length (at least 1), else 1.
    pub fn prompt_count(&self) -> usize {
        match (&self.input_ids, &self.text) {
            (Some(OneOrBatch::Batch(items)), _) => items.len().max(1),
            (None, Some(OneOrBatch::Batch(items))) => items.len().max(1),
            _ => 1,
        }
    }
}

impl From<&GenerateRequest> for GenerateRequestBody {
    /// The body the client sends for one token-id request (the routing key travels as a
    /// header, not in the body).
    fn from(request: &GenerateRequest) -> Self {
        Self {
            input_ids: Some(OneOrBatch::One(request.input_ids.clone())),
            sampling_params: request.sampling_params.clone(),
            rid: request
                .request_id
                .as_ref()
                .map(|id| OneOrBatch::One(id.0.clone())),
            return_logprob: request.return_logprob,
            return_routed_experts: request.return_routed_experts,
            routed_experts_start_len: request.routed_experts_start_len,
            ..Self::default()
        }
    }
}

/// A boolean flag of a request body: absent or `null` is `false`.
pub(super) fn flag(value: Option<&Value>, key: &str) -> Result<bool, String> {
    match value {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(format!("{key} must be a boolean, got {other}")),
    }
}

/// The readers of [`GenerateRequestBody`]'s fields, each with the server's message.
mod read {
    use super::*;

    /// A token-id list named `what` in messages.
    fn token_ids(value: &Value, what: &str) -> Result<Vec<TokenId>, String> {
        let Value::Array(items) = value else {
            return Err(format!("{what} must be a list of ints"));
        };
        items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|x| TokenId::try_from(x).ok())
                    .ok_or_else(|| format!("{what} holds {v}, not a token id"))
            })
            .collect()
    }

    /// One string, or a batch of strings; `message` for anything else.
    fn strings(value: Value, message: &str) -> Result<OneOrBatch<String>, String> {
        match value {
            Value::String(s) => Ok(OneOrBatch::One(s)),
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(message.to_owned()),
                })
                .collect::<Result<_, _>>()
                .map(OneOrBatch::Batch),
            _ => Err(message.to_owned()),
        }
    }

    /// The field's value, `None` when it is `null`.
    fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
        Ok(Option::<Value>::deserialize(deserializer)?.filter(|v| !v.is_null()))
    }

    pub(super) fn input_ids<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<OneOrBatch<Vec<TokenId>>>, D::Error> {
        let Some(ids) = present(deserializer)? else {
            return Ok(None);
        };
        let read = match &ids {
            Value::Array(items) if items.first().is_some_and(Value::is_array) => items
                .iter()
                .enumerate()
                .map(|(i, v)| token_ids(v, &format!("input_ids[{i}]")))
                .collect::<Result<_, _>>()
                .map(OneOrBatch::Batch),
            other => token_ids(other, "input_ids").map(OneOrBatch::One),
        };
        read.map(Some).map_err(D::Error::custom)
    }

    pub(super) fn text<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<OneOrBatch<String>>, D::Error> {
        present(deserializer)?
            .map(|text| strings(text, "text must be a string or strings"))
            .transpose()
            .map_err(D::Error::custom)
    }

    pub(super) fn rid<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<OneOrBatch<String>>, D::Error> {
        let read = match present(deserializer)? {
            None => Ok(None),
            Some(Value::Array(items)) => {
                strings(Value::Array(items), "rid must be a string").map(Some)
            }
            Some(other) => strings(
                other,
                "rid must be a string (a list of one per prompt for a batch)",
            )
            .map(Some),
        };
        read.map_err(D::Error::custom)
    }

    pub(super) fn sampling_params<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<SamplingParams, D::Error> {
        match present(deserializer)? {
            None => Ok(SamplingParams::default()),
            Some(v @ Value::Object(_)) => serde_json::from_value(v)
                .map_err(|e| D::Error::custom(format!("invalid sampling_params: {e}"))),
            Some(other) => Err(D::Error::custom(format!(
                "sampling_params must be an object, got {other}"
            ))),
        }
    }

    pub(super) fn routed_experts_start_len<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<usize>, D::Error> {
        present(deserializer)?
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        D::Error::custom("routed_experts_start_len must be a non-negative int")
                    })
            })
            .transpose()
    }

    /// The reader of the boolean field `$key`.
    macro_rules! flags {
        ($($key:ident),*) => {$(
            pub(super) fn $key<'de, D: Deserializer<'de>>(deserializer: D) -> Result<bool, D::Error> {
                let value = Option::<Value>::deserialize(deserializer)?;
                flag(value.as_ref(), stringify!($key)).map_err(D::Error::custom)
            }
        )*};
    }

    flags!(
        return_logprob,
        return_text_in_logprobs,
        return_routed_experts,
        stream
    );
}

/// One `/generate` answer (one per prompt and sample of a request).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateResponse {
    /// The generated text, when the server has a tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// The generated token ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_ids: Option<Vec<TokenId>>,
    /// Everything else about the answer.
    pub meta_info: MetaInfo,
}

/// `meta_info` of a `/generate` answer, in SGLang's key order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetaInfo {
    /// The request id (`rid`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Why generation ended (`None`: the key was absent or null).
    #[serde(default)]
    pub finish_reason: Option<WireFinishReason>,
    /// Prompt length in tokens.
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// The weight version every token was generated with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_version: Option<WireWeightVersion>,
    /// Generated tokens.
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    /// Prompt tokens served from the prefix cache.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
    /// Seconds from arrival to answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_latency: Option<f64>,
    /// `[logprob, token_id, text]` per generated token, with `return_logprob`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "token_logprobs"
    )]
    pub output_token_logprobs: Option<Vec<TokenLogprob>>,
    /// The routed experts, base64 of int32 `[rows, layers, top_k]`, with
    /// `return_routed_experts` on a MoE model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<String>,
    /// `[logprob, token_id, text]` per input position from `logprob_start_len` on (the first
    /// input position's log-prob is `null`), with input log-probs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_token_logprobs: Option<Value>,
    /// Per input position, the `top_logprobs_num` most likely `[logprob, token_id, text]`
    /// (`null` at the first position), with `top_logprobs_num`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_top_logprobs: Option<Value>,
    /// Per input position, `[logprob, token_id, text]` of each `token_ids_logprob` id (`null`
    /// at the first position), with `token_ids_logprob`; with `token_ids_logprob_positions`,
    /// of that position's own ids.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_token_ids_logprobs: Option<Value>,
}

/// SGLang's finish reason object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", try_from = "Value")]
pub enum WireFinishReason {
    /// A stop token id or stop string (`matched`, null when none is reported) ended it.
    Stop {
        /// The matched stop token id or string.
        matched: Value,
    },
    /// `max_new_tokens` (or the context) was reached after `length` tokens.
    Length {
        /// Generated tokens.
        length: usize,
    },
    /// The request was aborted.
    Abort {
        /// Why.
        message: String,
    },
}

impl WireFinishReason {
    /// The wire form of a finish reason; `matched` is the stop that ended a `Stop`, `length`
    /// the tokens generated.
    pub fn new(reason: FinishReason, matched: Option<Value>, length: usize) -> Self {
        match reason {
            FinishReason::Stop => Self::Stop {
                matched: matched.unwrap_or(Value::Null),
            },
            FinishReason::Length => Self::Length { length },
            FinishReason::Abort => Self::Abort {
                message: "Abort before completion".into(),
            },
        }
    }

    /// The reason, without its details.
    pub fn reason(&self) -> FinishReason {
        match self {
            Self::Stop { .. } => FinishReason::Stop,
            Self::Length { .. } => FinishReason::Length,
            Self::Abort { .. } => FinishReason::Abort,
        }
    }

    /// The matched stop id or string of a `Stop` (`None` when not reported).
    pub fn matched(&self) -> Option<&Value> {
        match self {
            Self::Stop { matched } if !matched.is_null() => Some(matched),
            _ => None,
        }
    }
}

impl TryFrom<Value> for WireFinishReason {
    type Error = String;

    fn try_from(value: Value) -> Result<Self, String> {
        let (kind, object) = match &value {
            Value::Object(o) => (o.get("type").and_then(Value::as_str).unwrap_or(""), Some(o)),
            Value::String(s) => (s.as_str(), None),
            _ => ("", None),
        };
        let field = |key: &str| object.and_then(|o| o.get(key));
        match kind {
            "stop" => Ok(Self::Stop {
                matched: field("matched").cloned().unwrap_or(Value::Null),
            }),
            "length" => Ok(Self::Length {
                length: field("length")
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .unwrap_or(0),
            }),
            "abort" => Ok(Self::Abort {
                message: field("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            }),
            other => Err(format!("unknown finish_reason type {other:?}")),
        }
    }
}

/// One `[logprob, token_id, text]` entry of `output_token_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "Value")]
pub struct TokenLogprob(pub f64, pub TokenId, pub Option<String>);

/// `output_token_logprobs`, a bad entry named by its index.
fn token_logprobs<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<TokenLogprob>>, D::Error> {
    let Some(entries) = Option::<Vec<Value>>::deserialize(deserializer)? else {
        return Ok(None);
    };
    entries
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            TokenLogprob::try_from(entry)
                .map_err(|e| serde::de::Error::custom(format!("output_token_logprobs[{i}] = {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

impl TryFrom<Value> for TokenLogprob {
    type Error = String;

    fn try_from(value: Value) -> Result<Self, String> {
        let lp = value.get(0).and_then(Value::as_f64);
        let id = value
            .get(1)
            .and_then(Value::as_u64)
            .and_then(|v| TokenId::try_from(v).ok());
        match (lp, id) {
            (Some(lp), Some(id)) => Ok(Self(
                lp,
                id,
                value.get(2).and_then(Value::as_str).map(str::to_owned),
            )),
            _ => {
                let shown: String = value.to_string().chars().take(100).collect();
                Err(format!("{shown} is not [logprob, token_id, text]"))
            }
        }
    }
}

/// A weight version as SGLang reports it: written as a string (`"7"`), read from a string or a
/// number; `"default"` (before the first update) is version 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Value", into = "String")]
pub struct WireWeightVersion(pub WeightVersion);

impl From<WireWeightVersion> for String {
    fn from(version: WireWeightVersion) -> Self {
        version.0.to_string()
    }
}

impl TryFrom<Value> for WireWeightVersion {
    type Error = String;

    fn try_from(value: Value) -> Result<Self, String> {
        parse_weight_version(&value).map(Self)
    }
}

/// Parses a weight version as SGLang reports it (`"7"`, `7`; `"default"` and null before the
/// first update are version 0).
pub(crate) fn parse_weight_version(value: &Value) -> Result<WeightVersion, String> {
    match value {
        Value::Null => Ok(WeightVersion(0)),
        Value::String(s) if s == "default" => Ok(WeightVersion(0)),
        Value::String(s) => s.parse().map_err(|_| {
            let shown: String = s.chars().take(40).collect();
            format!("weight_version {shown:?} is not a version")
        }),
        Value::Number(n) => n
            .as_u64()
            .map(WeightVersion)
            .ok_or_else(|| format!("weight_version {n} is not a version")),
        other => Err(format!("weight_version {other} is not a version")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_answer_round_trips_in_sglang_key_order() {
        let answer = GenerateResponse {
            text: Some("hi".into()),
            output_ids: Some(vec![5, 6]),
            meta_info: MetaInfo {
                id: Some("r1".into()),
                finish_reason: Some(WireFinishReason::new(FinishReason::Stop, Some(json!(6)), 2)),
                prompt_tokens: Some(3),
                weight_version: Some(WireWeightVersion(WeightVersion(7))),
                completion_tokens: Some(2),
                cached_tokens: Some(0),
                e2e_latency: Some(0.5),
                output_token_logprobs: Some(vec![
                    TokenLogprob(-0.5, 5, None),
                    TokenLogprob(-0.25, 6, Some("b".into())),
                ]),
                routed_experts: None,
                input_token_logprobs: None,
                input_top_logprobs: None,
                input_token_ids_logprobs: None,
            },
        };
        let text = serde_json::to_string(&answer).unwrap();
        assert_eq!(
            text,
            r#"{"text":"hi","output_ids":[5,6],"meta_info":{"id":"r1","finish_reason":{"type":"stop","matched":6},"prompt_tokens":3,"weight_version":"7","completion_tokens":2,"cached_tokens":0,"e2e_latency":0.5,"output_token_logprobs":[[-0.5,5,null],[-0.25,6,"b"]]}}"#
        );
        let back: GenerateResponse = serde_json::from_str(&text).unwrap();
        assert_eq!(back, answer);
    }

    #[test]
    fn sglang_variants_are_read() {
        let meta: MetaInfo = serde_json::from_value(json!({
            "finish_reason": "length", "weight_version": 4, "completion_tokens": 1,
        }))
        .unwrap();
        assert_eq!(meta.finish_reason.unwrap().reason(), FinishReason::Length);
        assert_eq!(meta.weight_version.unwrap().0, WeightVersion(4));
        let meta: MetaInfo =
            serde_json::from_value(json!({"weight_version": "default", "finish_reason": null}))
                .unwrap();
        assert_eq!(meta.weight_version.unwrap().0, WeightVersion(0));
        assert!(meta.finish_reason.is_none());
        let length = WireFinishReason::new(FinishReason::Length, None, 9);
        assert_eq!(
            serde_json::to_value(&length).unwrap(),
            json!({"type": "length", "length": 9})
        );
        let abort = WireFinishReason::new(FinishReason::Abort, None, 0);
        assert_eq!(
            serde_json::to_value(&abort).unwrap(),
            json!({"type": "abort", "message": "Abort before completion"})
        );
    }

    #[test]
    fn the_client_body_is_sglangs() {
        let mut request = GenerateRequest::new(
            vec![1, 2],
            SamplingParams {
                max_new_tokens: Some(4),
                ..SamplingParams::default()
            },
        );
        request.request_id = Some(miles_core::RequestId::new("r7"));
        request.routed_experts_start_len = Some(1);
        let body = serde_json::to_value(GenerateRequestBody::from(&request)).unwrap();
        // SGLang's GenerateReqInput field names; miles-core's request serialises the same way.
        assert_eq!(body, serde_json::to_value(&request).unwrap());
        assert_eq!(body["input_ids"], json!([1, 2]));
        assert_eq!(body["rid"], "r7");
        assert_eq!(body["return_routed_experts"], false);
        assert!(body.get("stream").is_none() && body.get("text").is_none());
        let back: GenerateRequestBody = serde_json::from_value(body).unwrap();
        assert_eq!(back, GenerateRequestBody::from(&request));
    }

    #[test]
    fn request_bodies_read_as_sglang_reads_them() {
        let body: GenerateRequestBody = serde_json::from_value(json!({
            "text": ["a", "b"], "rid": ["x", "y"], "return_logprob": null,
            "sampling_params": null, "stream": false, "image_data": "ignored",
        }))
        .unwrap();
        assert_eq!(
            body.text,
            Some(OneOrBatch::Batch(vec!["a".into(), "b".into()]))
        );
        assert_eq!(body.prompt_count(), 2);
        assert!(!body.return_logprob);
        assert_eq!(body.sampling_params, SamplingParams::default());
        let body: GenerateRequestBody =
            serde_json::from_value(json!({"input_ids": [[1], [2, 3], [4]]})).unwrap();
        assert_eq!(body.prompt_count(), 3);
        assert_eq!(
            body.input_ids,
            Some(OneOrBatch::Batch(vec![vec![1], vec![2, 3], vec![4]]))
        );
        let body: GenerateRequestBody = serde_json::from_value(json!({"input_ids": []})).unwrap();
        assert_eq!(body.input_ids, Some(OneOrBatch::One(vec![])));
        for (bad, message) in [
            (
                json!({"input_ids": "abc"}),
                "input_ids must be a list of ints",
            ),
            (
                json!({"input_ids": [1, -2]}),
                "input_ids holds -2, not a token id",
            ),
            (
                json!({"input_ids": [[1], [true]]}),
                "input_ids[1] holds true, not a token id",
            ),
            (json!({"text": 3}), "text must be a string or strings"),
            (
                json!({"rid": 5}),
                "rid must be a string (a list of one per prompt for a batch)",
            ),
            (json!({"rid": ["a", 5]}), "rid must be a string"),
            (
                json!({"return_logprob": "yes"}),
                "return_logprob must be a boolean, got \"yes\"",
            ),
            (json!({"stream": 1}), "stream must be a boolean, got 1"),
            (
                json!({"sampling_params": [1]}),
                "sampling_params must be an object, got [1]",
            ),
            (
                json!({"sampling_params": {"max_new_tokens": "many"}}),
                "invalid sampling_params: invalid type: string \"many\"",
            ),
            (
                json!({"routed_experts_start_len": -1}),
                "routed_experts_start_len must be a non-negative int",
            ),
        ] {
            let err = serde_json::from_value::<GenerateRequestBody>(bad.clone())
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(message), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_shapes_say_what_is_wrong() {
        let err = serde_json::from_value::<MetaInfo>(json!({"finish_reason": {"type": "x"}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown finish_reason type \"x\""), "{err}");
        let err = serde_json::from_value::<MetaInfo>(
            json!({"output_token_logprobs": [[-0.5, -1, null]]}),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(
                "output_token_logprobs[0] = [-0.5,-1,null] is not [logprob, token_id, text]"
            ),
            "{err}"
        );
        let err = serde_json::from_value::<MetaInfo>(json!({"weight_version": "abc"}))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("weight_version \"abc\" is not a version"),
            "{err}"
        );
    }
}
