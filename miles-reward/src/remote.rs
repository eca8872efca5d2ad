//! A reward model behind HTTP: Miles' `--rm-type remote_rm` with `--rm-url`.

use miles_core::{Error as CoreError, Result as CoreResult, Reward, RewardFn, Sample, async_trait};
use serde_json::Value;

/// A reward model behind HTTP (Miles' `--rm-type remote_rm` with `--rm-url`): each sample is
/// POSTed as Miles does, `{"prompt", "response", "label"}` (plus `"metadata"` with
/// [`RemoteReward::with_metadata`]), and the answer is the reward — a JSON number, or an
/// object of named components (select one with `--reward-key`). Transport
/// errors and 5xx answers are retried `retries` times with a short backoff; a 4xx, a body that
/// is neither a number nor an object, or running out of retries is a reward error (the
/// sample turns FAILED with the reason, the rollout goes on).
#[derive(Debug, Clone)]
pub struct RemoteReward {
    url: String,
    http: miles_session::http::HttpClient,
    retries: usize,
    send_metadata: bool,
}

impl RemoteReward {
    /// A client for `url` with a per-call `timeout` and 3 retries.
    pub fn new(url: impl Into<String>, timeout: std::time::Duration) -> Self {
        Self {
            url: url.into(),
            http: miles_session::http::HttpClient::new(timeout),
            retries: 3,
            send_metadata: false,
        }
    }

    /// Also sends the sample's `metadata` (Miles sends only prompt, response and label).
    pub fn with_metadata(mut self, send: bool) -> Self {
        self.send_metadata = send;
        self
    }

    /// Retries after a transport error or a 5xx answer.
    pub fn with_retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }

    /// The request body for `sample`: Miles' `{"prompt", "response", "label"}`.
    pub fn payload(sample: &Sample) -> Value {
        let prompt = match &sample.prompt {
            miles_core::Prompt::Text(t) => Value::String(t.clone()),
            miles_core::Prompt::Messages(m) => serde_json::to_value(m).unwrap_or(Value::Null),
        };
        serde_json::json!({
            "prompt": prompt,
            "response": sample.response,
            "label": sample.label,
        })
    }
}

#[async_trait]
impl RewardFn for RemoteReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let mut body = Self::payload(sample);
        if self.send_metadata
            && let Value::Object(map) = &mut body
        {
            map.insert("metadata".into(), Value::Object(sample.metadata.clone()));
        }
        let mut last_error = String::new();
        for attempt in 0..=self.retries {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(100 << attempt.min(5))).await;
            }
            let response = match self.http.post_json(&self.url, &body, &[]).await {
                Ok(r) => r,
                Err(e) => {
                    last_error = e.to_string();
                    continue;
                }
            };
            if response.status.is_server_error() {
                last_error = format!("answered {}: {}", response.status, response.text());
                continue;
            }
            if !response.status.is_success() {
                return Err(CoreError::Reward(format!(
                    "reward model {} answered {}: {}",
                    self.url,
                    response.status,
                    response.text()
                )));
            }
            let value: Value = response
                .json()
                .map_err(|e| CoreError::Reward(format!("reward model {}: {e}", self.url)))?;
            return match value {
                Value::Number(n) => Ok(Reward::Scalar(n.as_f64().unwrap_or(f64::NAN))),
                Value::Object(map) => Ok(Reward::Map(map)),
                other => Err(CoreError::Reward(format!(
                    "reward model {} answered {other}, expected a number or an object",
                    self.url
                ))),
            };
        }
        Err(CoreError::Reward(format!(
            "reward model {} failed after {} attempts: {last_error}",
            self.url,
            self.retries + 1
        )))
    }
}
