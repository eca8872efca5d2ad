//! Failed samples (an agent that exits non-zero, dies, times out or prints garbage; a reward
//! that cannot be computed; an engine that answers with an error): counted by kind, logged
//! (rate-limited, with the agent's stderr tail), their groups regenerated up to a bound or
//! dropped, and the run stopped with a clear error when failures dominate ([`FailurePolicy`]).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use miles_core::{Metrics, Sample, SampleStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// The metadata keys a failure leaves on a sample; cleared when its group is regenerated.
const FAILURE_KEYS: &[&str] = &[
    "failure",
    "failure_kind",
    "agent_stderr_tail",
    "abort_reason",
    "engine_error",
];

/// How many times a group was regenerated after a failure (sample metadata, so it survives a
/// checkpoint).
pub const FAILURE_RETRIES_KEY: &str = "failure_retries";

/// What the loops do with failed samples, and when a run gives up. Miles has no such bound:
/// an agent that always fails makes it regenerate forever.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FailurePolicy {
    /// A group holding a FAILED sample is generated again at most this many times, then
    /// dropped (`rollout/failed_groups_regenerated`, `rollout/failed_groups_dropped`).
    /// Default 2.
    pub max_group_retries: u32,
    /// Stop the run after this many failed samples in a row (0: never). Default 16.
    pub max_consecutive_failures: usize,
    /// Stop the run when more than this fraction of the last `failure_window` finished
    /// samples failed (1 or more: never). Default 0.9.
    pub max_failure_ratio: f64,
    /// The window of `max_failure_ratio`, in finished samples. Default 64.
    pub failure_window: usize,
    /// At most one failure log line per this many seconds; the others are counted and
    /// reported with the next line. Default 5.
    pub log_interval_secs: f64,
}

impl Default for FailurePolicy {
    fn default() -> Self {
        Self {
            max_group_retries: 2,
            max_consecutive_failures: 16,
            max_failure_ratio: 0.9,
            failure_window: 64,
            log_interval_secs: 5.0,
        }
    }
}

impl FailurePolicy {
    /// Checks the values once.
    pub fn validate(&self) -> Result<()> {
        if !(self.max_failure_ratio.is_finite() && self.max_failure_ratio > 0.0) {
            return Err(Error::Config(format!(
                "max_failure_ratio must be a positive number, got {}",
                self.max_failure_ratio
            )));
        }
        if self.failure_window == 0 {
            return Err(Error::Config("failure_window must be >= 1".into()));
        }
        if !(self.log_interval_secs.is_finite() && self.log_interval_secs >= 0.0) {
            return Err(Error::Config(
                "log_interval_secs must be a non-negative number".into(),
            ));
        }
        Ok(())
    }
}

/// The failure kind of a finished sample: `Some(kind)` for a FAILED sample (its
/// `metadata.failure_kind`, else `generation`) and for an ABORTED one whose engine call
/// failed (`engine`); `None` for a success or an abort (a weight update, a surplus request).
pub fn failure_kind(sample: &Sample) -> Option<String> {
    match sample.status {
        SampleStatus::Failed => Some(
            sample
                .metadata
                .get("failure_kind")
                .and_then(Value::as_str)
                .unwrap_or("generation")
                .to_owned(),
        ),
        SampleStatus::Aborted if sample.metadata.contains_key("engine_error") => {
            Some("engine".to_owned())
        }
        _ => None,
    }
}

/// What went wrong with a failed sample, in one line, and the last lines of its agent's
/// stderr (if any).
fn describe(sample: &Sample) -> (String, String) {
    let text = |key: &str| {
        sample
            .metadata
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let mut what = text("failure");
    if what.is_empty() {
        what = text("engine_error");
    }
    if what.is_empty() {
        what = text("abort_reason");
    }
    let tail = text("agent_stderr_tail");
    let lines: Vec<&str> = tail.trim_end().lines().collect();
    let last = lines[lines.len().saturating_sub(10)..].join("\n");
    (what, last)
}

/// A group with a FAILED sample, prepared to be generated again (every sample reset, the
/// failure cleared, [`FAILURE_RETRIES_KEY`] counted up), or `None` when it used its
/// `max_group_retries` and is to be dropped. A group without a FAILED sample is returned
/// unchanged in `Ok`.
pub fn retry_failed_group(
    mut group: Vec<Sample>,
    policy: &FailurePolicy,
) -> std::result::Result<Vec<Sample>, Option<Vec<Sample>>> {
    if !group.iter().any(|s| s.status == SampleStatus::Failed) {
        return Ok(group);
    }
    let retries = group
        .iter()
        .filter_map(|s| s.metadata.get(FAILURE_RETRIES_KEY).and_then(Value::as_u64))
        .max()
        .unwrap_or(0);
    if retries >= u64::from(policy.max_group_retries) {
        return Err(None);
    }
    for sample in &mut group {
        sample.reset_for_retry();
        for key in FAILURE_KEYS {
            sample.metadata.remove(*key);
        }
        sample
            .metadata
            .insert(FAILURE_RETRIES_KEY.into(), Value::from(retries + 1));
    }
    Err(Some(group))
}

/// Counts failures by kind, logs them (rate-limited) and decides when the run stops
/// ([`FailurePolicy`]). Shared by the generation tasks of a run.
#[derive(Debug)]
pub struct FailureTracker {
    policy: FailurePolicy,
    state: Mutex<TrackerState>,
}

#[derive(Debug, Default)]
struct TrackerState {
    consecutive: usize,
    window: VecDeque<bool>,
    failed_in_window: usize,
    /// Failed samples by kind since the metrics were last taken.
    by_kind: BTreeMap<String, u64>,
    groups_regenerated: u64,
    groups_dropped: u64,
    last_log: Option<Instant>,
    suppressed: u64,
    tripped: Option<String>,
}

impl FailureTracker {
    /// A tracker for `policy`.
    pub fn new(policy: FailurePolicy) -> Self {
        Self {
            policy,
            state: Mutex::new(TrackerState::default()),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &FailurePolicy {
        &self.policy
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TrackerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the finished samples of a group: a FAILED sample (or one whose engine call
    /// failed) is a failure, a COMPLETED or TRUNCATED one a success, any other abort neither.
    pub fn record(&self, group: &[Sample]) {
        let mut state = self.lock();
        for sample in group {
            let failed = match failure_kind(sample) {
                Some(kind) => {
                    *state.by_kind.entry(kind.clone()).or_default() += 1;
                    self.log(&mut state, &kind, sample);
                    true
                }
                None if matches!(
                    sample.status,
                    SampleStatus::Completed | SampleStatus::Truncated
                ) =>
                {
                    false
                }
                None => continue,
            };
            state.consecutive = if failed { state.consecutive + 1 } else { 0 };
            state.window.push_back(failed);
            state.failed_in_window += usize::from(failed);
            if state.window.len() > self.policy.failure_window
                && state.window.pop_front() == Some(true)
            {
                state.failed_in_window -= 1;
            }
            if failed && state.tripped.is_none() {
                state.tripped = self.verdict(&state, sample);
            }
        }
    }

    fn verdict(&self, state: &TrackerState, last: &Sample) -> Option<String> {
        let p = &self.policy;
        let why =
            if p.max_consecutive_failures > 0 && state.consecutive >= p.max_consecutive_failures {
                format!("{} samples in a row failed", state.consecutive)
            } else if p.max_failure_ratio < 1.0
                && state.window.len() >= p.failure_window
                && state.failed_in_window as f64 > p.max_failure_ratio * state.window.len() as f64
            {
                format!(
                    "{} of the last {} samples failed (more than max_failure_ratio = {})",
                    state.failed_in_window,
                    state.window.len(),
                    p.max_failure_ratio
                )
            } else {
                return None;
            };
        let (what, stderr) = describe(last);
        let mut message = format!("stopping the run: {why}; the last failure: {what}");
        if !stderr.is_empty() {
            message.push_str("\nthe last lines of its stderr:\n");
            message.push_str(&stderr);
        }
        Some(message)
    }

    fn log(&self, state: &mut TrackerState, kind: &str, sample: &Sample) {
        let now = Instant::now();
        let interval = Duration::from_secs_f64(self.policy.log_interval_secs);
        if state
            .last_log
            .is_some_and(|last| now.duration_since(last) < interval)
        {
            state.suppressed += 1;
            return;
        }
        state.last_log = Some(now);
        let suppressed = std::mem::take(&mut state.suppressed);
        let (what, stderr) = describe(sample);
        tracing::warn!(
            kind,
            index = sample.index,
            suppressed,
            stderr_tail = %stderr,
            "a rollout sample failed: {what}"
        );
    }

    /// Counts a group regenerated after a failure.
    pub fn group_regenerated(&self) {
        self.lock().groups_regenerated += 1;
    }

    /// Counts a group dropped after its last retry.
    pub fn group_dropped(&self) {
        self.lock().groups_dropped += 1;
    }

    /// `Err` once the policy says the run must stop (the message names the last failure and
    /// its agent's last stderr lines).
    pub fn check(&self) -> Result<()> {
        match &self.lock().tripped {
            Some(message) => Err(Error::TooManyFailures(message.clone())),
            None => Ok(()),
        }
    }

    /// Moves the counts since the last call into `metrics`: `rollout/failed_samples/<kind>`
    /// per kind, `rollout/failed_samples` in all, `rollout/failed_groups_regenerated` and
    /// `rollout/failed_groups_dropped`.
    pub fn take_metrics(&self, metrics: &mut Metrics) {
        let mut state = self.lock();
        let by_kind = std::mem::take(&mut state.by_kind);
        let total: u64 = by_kind.values().sum();
        for (kind, count) in by_kind {
            metrics.insert(format!("rollout/failed_samples/{kind}"), count as f64);
        }
        metrics.insert("rollout/failed_samples".into(), total as f64);
        metrics.insert(
            "rollout/failed_groups_regenerated".into(),
            std::mem::take(&mut state.groups_regenerated) as f64,
        );
        metrics.insert(
            "rollout/failed_groups_dropped".into(),
            std::mem::take(&mut state.groups_dropped) as f64,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::Prompt;
    use serde_json::json;

    fn sample(status: SampleStatus) -> Sample {
        let mut s = Sample::builder(Prompt::Text("q".into())).build().unwrap();
        s.status = status;
        s
    }

    fn agent_failure() -> Sample {
        let mut s = sample(SampleStatus::Failed);
        s.metadata.insert(
            "failure".into(),
            json!("agent failed: \"python3 agent.py\" exited with code 3"),
        );
        s.metadata.insert("failure_kind".into(), json!("exit"));
        s.metadata.insert(
            "agent_stderr_tail".into(),
            json!((0..15).map(|i| format!("line {i}\n")).collect::<String>()),
        );
        s
    }

    #[test]
    fn consecutive_failures_stop_the_run_naming_the_command_and_its_stderr() {
        let tracker = FailureTracker::new(FailurePolicy {
            max_consecutive_failures: 3,
            ..FailurePolicy::default()
        });
        tracker.record(&[agent_failure(), agent_failure()]);
        tracker.record(&[sample(SampleStatus::Completed)]);
        tracker.record(&[
            agent_failure(),
            sample(SampleStatus::Aborted),
            agent_failure(),
        ]);
        tracker.check().unwrap();
        tracker.record(&[agent_failure()]);
        let message = tracker.check().unwrap_err().to_string();
        assert!(message.contains("3 samples in a row failed"), "{message}");
        assert!(message.contains("\"python3 agent.py\" exited with code 3"));
        // The last ten stderr lines, not more.
        assert!(message.contains("line 5\n") && message.contains("line 14"));
        assert!(!message.contains("line 4\n"), "{message}");
        let mut metrics = Metrics::new();
        tracker.take_metrics(&mut metrics);
        assert_eq!(metrics["rollout/failed_samples/exit"], 5.0);
        assert_eq!(metrics["rollout/failed_samples"], 5.0);
        tracker.take_metrics(&mut metrics);
        assert_eq!(metrics["rollout/failed_samples"], 0.0);
    }

    #[test]
    fn the_failure_ratio_over_a_full_window_stops_the_run() {
        let tracker = FailureTracker::new(FailurePolicy {
            max_consecutive_failures: 0,
            max_failure_ratio: 0.5,
            failure_window: 4,
            ..FailurePolicy::default()
        });
        // Half fail: at the bound, not over it.
        for _ in 0..4 {
            tracker.record(&[agent_failure(), sample(SampleStatus::Truncated)]);
        }
        tracker.check().unwrap();
        tracker.record(&[agent_failure()]);
        tracker.record(&[agent_failure()]);
        let message = tracker.check().unwrap_err().to_string();
        assert!(
            message.contains("3 of the last 4 samples failed"),
            "{message}"
        );
    }

    #[test]
    fn failed_groups_are_retried_up_to_the_bound_then_dropped() {
        let policy = FailurePolicy {
            max_group_retries: 1,
            ..FailurePolicy::default()
        };
        let fine = vec![sample(SampleStatus::Completed)];
        assert_eq!(retry_failed_group(fine.clone(), &policy), Ok(fine));
        let group = vec![agent_failure(), sample(SampleStatus::Completed)];
        let Err(Some(retry)) = retry_failed_group(group, &policy) else {
            panic!("retried once")
        };
        for s in &retry {
            assert_eq!(s.status, SampleStatus::Aborted);
            assert_eq!(s.metadata[FAILURE_RETRIES_KEY], json!(1));
            assert!(!s.metadata.contains_key("failure"));
            assert!(!s.metadata.contains_key("agent_stderr_tail"));
        }
        let mut again = retry;
        again[0].status = SampleStatus::Failed;
        assert_eq!(retry_failed_group(again, &policy), Err(None));
    }

    #[test]
    fn engine_errors_count_as_failures_plain_aborts_do_not() {
        let mut engine = sample(SampleStatus::Aborted);
        engine
            .metadata
            .insert("engine_error".into(), json!("connection refused"));
        assert_eq!(failure_kind(&engine).as_deref(), Some("engine"));
        assert_eq!(failure_kind(&sample(SampleStatus::Aborted)), None);
        assert_eq!(
            failure_kind(&sample(SampleStatus::Failed)).as_deref(),
            Some("generation")
        );
    }
}
