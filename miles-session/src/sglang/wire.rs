//! SGLang's `/generate` answer as types: what the server writes and the client reads, so the two
//! ends cannot drift apart. The request side is miles-core's
//! [`GenerateRequest`](miles_core::GenerateRequest), serialised as SGLang's body.
//!
//! Reading is strict about shapes and lenient only where SGLang itself varies: a finish reason
//! is an object (`{"type": "stop", "matched": …}`) or a bare string, a weight version a string
//! (`"7"`, `"default"`) or a number. Counts are only read here; whether they agree with each
//! other and with the request is checked by the client ([`GenerateResponse`] carries no such
//! promise).

use miles_core::{FinishReason, TokenId, WeightVersion};
use serde::{Deserialize, Serialize};
use serde_json::Value;

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
