//! A reward model behind HTTP: Miles' `--rm-type remote_rm` with `--rm-url`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use miles_core::rng::SplitMix64;
use miles_core::{Error as CoreError, Result as CoreResult, Reward, RewardFn, Sample, async_trait};
use serde_json::Value;

/// A reward model behind HTTP (Miles' `--rm-type remote_rm` with `--rm-url`): each sample is
/// POSTed as Miles does, `{"prompt", "response", "label"}` (plus `"metadata"` with
/// [`RemoteReward::with_metadata`]), and the answer is the reward — a JSON number, or an
/// object of named components (select one with `--reward-key`).
///
/// A reward model that is down, slow (past the per-call timeout), answers 5xx / 429 or
/// garbage (a body that is neither a number nor an object) is retried `retries` times
/// (default 3) with exponential backoff and jitter — the `n`-th retry waits a random time in
/// `[d/2, d]`, `d = min(base_backoff × 2ⁿ⁻¹, max_backoff)` (100 ms, 10 s) — or, when the
/// answer says `Retry-After: S` (seconds), `S` capped at `max_backoff`. Another 4xx, or
/// running out of retries, is a reward error: the sample turns FAILED (kind `reward`) and the
/// rollout's failure policy applies (its group regenerated or dropped, the run stopped when
/// failures dominate).
#[derive(Debug, Clone)]
pub struct RemoteReward {
    url: String,
    http: miles_session::http::HttpClient,
    retries: usize,
    base_backoff: Duration,
    max_backoff: Duration,
    send_metadata: bool,
    jitter: Arc<AtomicU64>,
}

impl RemoteReward {
    /// A client for `url` with a per-call `timeout`, 3 retries and backoff from 100 ms to 10 s.
    pub fn new(url: impl Into<String>, timeout: Duration) -> Self {
        Self {
            url: url.into(),
            http: miles_session::http::HttpClient::new(timeout),
            retries: 3,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            send_metadata: false,
            jitter: Arc::new(AtomicU64::new(0x5EED)),
        }
    }

    /// Also sends the sample's `metadata` (Miles sends only prompt, response and label).
    pub fn with_metadata(mut self, send: bool) -> Self {
        self.send_metadata = send;
        self
    }

    /// Retries after a transport error, a timeout, a 5xx / 429 answer or garbage.
    pub fn with_retries(mut self, retries: usize) -> Self {
        self.retries = retries;
        self
    }

    /// The first retry's backoff and the cap of every wait (`Retry-After` included).
    pub fn with_backoff(mut self, base: Duration, max: Duration) -> Self {
        self.base_backoff = base;
        self.max_backoff = max.max(base);
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

    /// The wait before retry `n` (1-based): `Retry-After` when the answer gave one, else the
    /// jittered exponential backoff; never above `max_backoff`.
    fn backoff(&self, n: usize, retry_after: Option<Duration>) -> Duration {
        if let Some(wait) = retry_after {
            return wait.min(self.max_backoff);
        }
        let exp = self
            .base_backoff
            .saturating_mul(1u32 << (n.saturating_sub(1)).min(20))
            .min(self.max_backoff);
        let seed = self.jitter.fetch_add(1, Ordering::Relaxed);
        let unit = SplitMix64::new(seed ^ 0x9E37_79B9).next_f64();
        exp.mul_f64(0.5 + 0.5 * unit)
    }

    /// One call: `Ok` with the reward, or `Err((retryable, reason, Retry-After))`.
    async fn attempt(&self, body: &Value) -> Result<Reward, (bool, String, Option<Duration>)> {
        let response = self
            .http
            .post_json(&self.url, body, &[])
            .await
            .map_err(|e| (true, e.to_string(), None))?;
        let status = response.status;
        if status.is_server_error() || status.as_u16() == 429 {
            let retry_after = response
                .headers
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map(Duration::from_secs_f64);
            return Err((
                true,
                format!("answered {status}: {}", clip(&response.text())),
                retry_after,
            ));
        }
        if !status.is_success() {
            return Err((
                false,
                format!("answered {status}: {}", clip(&response.text())),
                None,
            ));
        }
        match response.json::<Value>() {
            Ok(Value::Number(n)) => Ok(Reward::Scalar(n.as_f64().unwrap_or(f64::NAN))),
            Ok(Value::Object(map)) => Ok(Reward::Map(map)),
            Ok(other) => Err((
                true,
                format!(
                    "answered {}, expected a number or an object",
                    clip(&other.to_string())
                ),
                None,
            )),
            Err(e) => Err((true, format!("answered garbage: {e}"), None)),
        }
    }
}

fn clip(text: &str) -> String {
    let mut end = text.len().min(200);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_owned()
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
        let mut retry_after = None;
        for attempt in 0..=self.retries {
            if attempt > 0 {
                tokio::time::sleep(self.backoff(attempt, retry_after.take())).await;
            }
            match self.attempt(&body).await {
                Ok(reward) => return Ok(reward),
                Err((true, reason, after)) => {
                    last_error = reason;
                    retry_after = after;
                }
                Err((false, reason, _)) => {
                    return Err(CoreError::Reward(format!(
                        "reward model {} {reason}",
                        self.url
                    )));
                }
            }
        }
        Err(CoreError::Reward(format!(
            "reward model {} failed after {} attempts: {last_error}",
            self.url,
            self.retries + 1
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_with_jitter_and_honours_retry_after_up_to_the_cap() {
        let r = RemoteReward::new("http://127.0.0.1:1", Duration::from_secs(1))
            .with_backoff(Duration::from_millis(100), Duration::from_secs(1));
        for n in 1..=6 {
            let d = r.backoff(n, None);
            let full = Duration::from_millis(100 << (n - 1)).min(Duration::from_secs(1));
            assert!(d >= full / 2 && d <= full, "retry {n}: {d:?} vs {full:?}");
        }
        assert_eq!(
            r.backoff(1, Some(Duration::from_millis(300))),
            Duration::from_millis(300)
        );
        assert_eq!(
            r.backoff(1, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }
}
