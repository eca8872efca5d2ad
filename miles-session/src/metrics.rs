//! Server metrics in the Prometheus text format (`GET /metrics`). Labels are bounded: error
//! labels come from [`crate::Error::label`], mismatch types from [`miles_tito::MismatchType`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use miles_tito::MismatchType;

/// Histogram bucket upper bounds, in seconds.
pub const LATENCY_BUCKETS: [f64; 15] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];

/// A fixed-bucket latency histogram with lock-free updates.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, value: Duration) {
        let secs = value.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(
            value.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// Every counter and histogram the session server exports.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    /// Sessions created.
    pub sessions_created: AtomicU64,
    /// Sessions deleted.
    pub sessions_deleted: AtomicU64,
    /// Turns committed to a session.
    pub turns: AtomicU64,
    /// Turns not committed because the session was deleted or expired during the engine call
    /// (answered 404, never 200).
    pub turns_skipped: AtomicU64,
    /// Sessions closed by the idle timeout.
    pub sessions_expired: AtomicU64,
    /// Prompt tokens sent to the engine.
    pub prompt_tokens: AtomicU64,
    /// Completion tokens received from the engine.
    pub completion_tokens: AtomicU64,
    /// Whole-turn latency (request in → response out).
    pub turn_latency: Histogram,
    /// Engine call latency.
    pub engine_latency: Histogram,
    /// Latency the server adds to the engine call (turn − engine).
    pub added_latency: Histogram,
    mismatches: [AtomicU64; 4],
    sessions_with_mismatch: AtomicU64,
    sessions_checked: AtomicU64,
    errors: Mutex<BTreeMap<&'static str, u64>>,
}

impl ServerMetrics {
    /// Counts one error response by label.
    pub fn error(&self, label: &'static str) {
        if let Ok(mut map) = self.errors.lock() {
            *map.entry(label).or_default() += 1;
        }
    }

    /// Errors counted for `label`.
    pub fn errors(&self, label: &str) -> u64 {
        self.errors
            .lock()
            .ok()
            .and_then(|m| m.get(label).copied())
            .unwrap_or(0)
    }

    /// Records the mismatch check of one session.
    pub fn mismatch_check(&self, kinds: &[MismatchType]) {
        self.sessions_checked.fetch_add(1, Ordering::Relaxed);
        if !kinds.is_empty() {
            self.sessions_with_mismatch.fetch_add(1, Ordering::Relaxed);
        }
        for (i, kind) in MismatchType::ALL.iter().enumerate() {
            if kinds.contains(kind) {
                self.mismatches[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Renders everything in the Prometheus text exposition format.
    pub fn render(&self, sessions_open: usize) -> String {
        let mut out = String::with_capacity(4096);
        let counter = |out: &mut String, name: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        };
        let _ = writeln!(
            out,
            "# HELP miles_session_sessions_open Sessions currently open.\n# TYPE miles_session_sessions_open gauge\nmiles_session_sessions_open {sessions_open}"
        );
        counter(
            &mut out,
            "miles_session_sessions_created_total",
            "Sessions created.",
            &self.sessions_created,
        );
        counter(
            &mut out,
            "miles_session_sessions_deleted_total",
            "Sessions deleted.",
            &self.sessions_deleted,
        );
        counter(
            &mut out,
            "miles_session_sessions_expired_total",
            "Sessions closed by the idle timeout.",
            &self.sessions_expired,
        );
        counter(
            &mut out,
            "miles_session_turns_total",
            "Chat turns committed.",
            &self.turns,
        );
        counter(
            &mut out,
            "miles_session_turns_skipped_total",
            "Chat turns not committed because the session was deleted or expired during the engine call (answered 404).",
            &self.turns_skipped,
        );
        counter(
            &mut out,
            "miles_session_prompt_tokens_total",
            "Prompt tokens sent to the engine.",
            &self.prompt_tokens,
        );
        counter(
            &mut out,
            "miles_session_completion_tokens_total",
            "Completion tokens received from the engine.",
            &self.completion_tokens,
        );
        self.turn_latency.render(
            &mut out,
            "miles_session_turn_latency_seconds",
            "Chat turn latency, request to response.",
        );
        self.engine_latency.render(
            &mut out,
            "miles_session_engine_latency_seconds",
            "Engine generate latency.",
        );
        self.added_latency.render(
            &mut out,
            "miles_session_added_latency_seconds",
            "Latency added by the session server.",
        );
        counter(
            &mut out,
            "miles_session_mismatch_checks_total",
            "Sessions checked for TITO mismatches.",
            &self.sessions_checked,
        );
        counter(
            &mut out,
            "miles_session_mismatch_sessions_total",
            "Checked sessions with at least one TITO mismatch.",
            &self.sessions_with_mismatch,
        );
        let _ = writeln!(
            out,
            "# HELP miles_session_mismatch_total Checked sessions with a mismatch of this type.\n# TYPE miles_session_mismatch_total counter"
        );
        for (kind, count) in MismatchType::ALL.iter().zip(&self.mismatches) {
            let _ = writeln!(
                out,
                "miles_session_mismatch_total{{type=\"{}\"}} {}",
                kind.as_str(),
                count.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP miles_session_errors_total Error responses by label.\n# TYPE miles_session_errors_total counter"
        );
        if let Ok(map) = self.errors.lock() {
            for (label, count) in map.iter() {
                let _ = writeln!(
                    out,
                    "miles_session_errors_total{{label=\"{label}\"}} {count}"
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_millis(3));
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.00025\"} 0\n"));
        assert!(out.contains("x_bucket{le=\"0.0005\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"0.005\"} 2\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 2\n"));
        assert!(out.contains("x_sum 0.0033\n"));
        assert!(out.contains("x_count 2\n"));
    }
}
