//! A small Prometheus registry and text-format (0.0.4) encoder, with no dependencies.
//!
//! * [`Registry`] holds metric families in registration order; registering returns a cheap,
//!   clonable handle ([`Counter`], [`Gauge`], [`Histogram`]) whose updates are lock-free.
//!   Registering the same name and labels again returns the same series.
//! * Labels are fixed when a series is registered (no label values created on the hot
//!   path), and a registry refuses more than [`Registry::max_series`] series, so label
//!   cardinality stays bounded.
//! * [`Registry::render`] writes the text exposition format 0.0.4: `# HELP` and `# TYPE`
//!   per family, help and label values escaped, histograms as cumulative `_bucket{le=…}`
//!   (with `+Inf`; whole bounds keep their `.0`, `le="6.0"`, as SGLang's client writes), `_sum` and `_count`; values `NaN`, `+Inf`, `-Inf` spelled as Prometheus
//!   does. Serve it with `Content-Type: text/plain; version=0.0.4` ([`CONTENT_TYPE`]).
//! * Ready-made sets: [`SglangMetrics`] (SGLang's own metric names, for `miles-rollout
//!   serve`), [`TrainerMetrics`] (a trainer process), and [`PrometheusMetricsSink`], a
//!   [`MetricsSink`] keeping the last value of every logged metric as a gauge.
//!
//! ```
//! use miles_core::prometheus::Registry;
//!
//! let registry = Registry::new();
//! let tokens = registry.counter("sglang:generation_tokens_total", "Number of generation tokens processed.")?;
//! let ttft = registry.histogram("sglang:time_to_first_token_seconds", "Time to first token.", &[0.1, 1.0])?;
//! tokens.inc_by(12.0);
//! ttft.observe(0.25);
//! let text = registry.render();
//! assert!(text.contains("# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total 12\n"));
//! assert!(text.contains("sglang:time_to_first_token_seconds_bucket{le=\"1.0\"} 1\n"));
//! # Ok::<(), miles_core::Error>(())
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::metrics::{Metrics, MetricsSink};

/// The `Content-Type` of the text exposition format this module renders.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The most series a [`Registry`] holds unless told otherwise.
pub const DEFAULT_MAX_SERIES: usize = 10_000;

/// An `f64` updated atomically (stored as its bits).
#[derive(Debug, Default)]
struct AtomicF64(AtomicU64);

impl AtomicF64 {
    fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }

    fn set(&self, value: f64) {
        self.0.store(value.to_bits(), Ordering::Relaxed);
    }

    fn add(&self, delta: f64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + delta).to_bits())
            });
    }
}

/// A monotonically increasing value (name it `…_total`).
#[derive(Debug, Clone, Default)]
pub struct Counter(Arc<AtomicF64>);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.add(1.0);
    }

    /// Adds `delta`; negative or NaN deltas are ignored (a counter never goes down).
    pub fn inc_by(&self, delta: f64) {
        if delta > 0.0 {
            self.0.add(delta);
        }
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

/// A value that goes up and down.
#[derive(Debug, Clone, Default)]
pub struct Gauge(Arc<AtomicF64>);

impl Gauge {
    /// Sets the value (NaN and infinities are kept and rendered as Prometheus spells them).
    pub fn set(&self, value: f64) {
        self.0.set(value);
    }

    /// Adds `delta` (may be negative).
    pub fn add(&self, delta: f64) {
        self.0.add(delta);
    }

    /// Adds one.
    pub fn inc(&self) {
        self.0.add(1.0);
    }

    /// Subtracts one.
    pub fn dec(&self) {
        self.0.add(-1.0);
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        self.0.get()
    }
}

#[derive(Debug)]
struct HistogramCore {
    bounds: Box<[f64]>,
    /// Per-bucket (not cumulative) counts; the last is the `+Inf` overflow.
    buckets: Box<[AtomicU64]>,
    count: AtomicU64,
    sum: AtomicF64,
}

/// Observations counted into fixed buckets, with their count and sum.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<HistogramCore>);

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Self(Arc::new(HistogramCore {
            bounds: bounds.into(),
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicF64::default(),
        }))
    }

    /// Records one observation (a NaN observation is ignored).
    pub fn observe(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        let core = &self.0;
        let index = core.bounds.partition_point(|bound| *bound < value);
        core.buckets[index].fetch_add(1, Ordering::Relaxed);
        core.count.fetch_add(1, Ordering::Relaxed);
        core.sum.add(value);
    }

    /// Records a duration in seconds.
    pub fn observe_duration(&self, duration: std::time::Duration) {
        self.observe(duration.as_secs_f64());
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.0.count.load(Ordering::Relaxed)
    }

    /// Sum of the observations so far.
    pub fn sum(&self) -> f64 {
        self.0.sum.get()
    }

    /// The bucket upper bounds (without `+Inf`).
    pub fn bounds(&self) -> &[f64] {
        &self.0.bounds
    }

    /// Cumulative counts per bound, then the total (the `+Inf` bucket).
    pub fn cumulative_counts(&self) -> Vec<u64> {
        let mut total = 0;
        self.0
            .buckets
            .iter()
            .map(|b| {
                total += b.load(Ordering::Relaxed);
                total
            })
            .collect()
    }
}

/// The type of a metric family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricType {
    /// `counter`.
    Counter,
    /// `gauge`.
    Gauge,
    /// `histogram`.
    Histogram,
}

impl MetricType {
    /// The name in a `# TYPE` line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Counter => "counter",
            Self::Gauge => "gauge",
            Self::Histogram => "histogram",
        }
    }
}

#[derive(Debug, Clone)]
enum Series {
    Counter(Counter),
    Gauge(Gauge),
    Histogram(Histogram),
}

#[derive(Debug)]
struct Family {
    name: String,
    help: String,
    kind: MetricType,
    /// Histogram bounds every series of the family shares.
    bounds: Vec<f64>,
    series: Vec<(Vec<(String, String)>, Series)>,
}

#[derive(Debug, Default)]
struct Families {
    list: Vec<Family>,
    index: HashMap<String, usize>,
    series: usize,
}

/// Metric families, rendered in registration order. Share it as `Arc<Registry>`.
#[derive(Debug)]
pub struct Registry {
    families: Mutex<Families>,
    max_series: usize,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether `name` is a valid metric name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
pub fn is_valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// Whether `name` is a valid label name: `[a-zA-Z_][a-zA-Z0-9_]*`, not starting `__`.
pub fn is_valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with("__")
}

impl Registry {
    /// An empty registry holding at most [`DEFAULT_MAX_SERIES`] series.
    pub fn new() -> Self {
        Self::with_max_series(DEFAULT_MAX_SERIES)
    }

    /// An empty registry holding at most `max_series` series.
    pub fn with_max_series(max_series: usize) -> Self {
        Self {
            families: Mutex::new(Families::default()),
            max_series,
        }
    }

    /// The most series this registry accepts.
    pub fn max_series(&self) -> usize {
        self.max_series
    }

    /// Registers (or finds) an unlabelled counter.
    pub fn counter(&self, name: &str, help: &str) -> Result<Counter> {
        self.counter_with_labels(name, help, &[])
    }

    /// Registers (or finds) the counter series `name{labels}`.
    pub fn counter_with_labels(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Counter> {
        match self.register(name, help, MetricType::Counter, &[], labels)? {
            Series::Counter(c) => Ok(c),
            _ => unreachable!("registered as a counter"),
        }
    }

    /// Registers (or finds) an unlabelled gauge.
    pub fn gauge(&self, name: &str, help: &str) -> Result<Gauge> {
        self.gauge_with_labels(name, help, &[])
    }

    /// Registers (or finds) the gauge series `name{labels}`.
    pub fn gauge_with_labels(
        &self,
        name: &str,
        help: &str,
        labels: &[(&str, &str)],
    ) -> Result<Gauge> {
        match self.register(name, help, MetricType::Gauge, &[], labels)? {
            Series::Gauge(g) => Ok(g),
            _ => unreachable!("registered as a gauge"),
        }
    }

    /// Registers (or finds) an unlabelled histogram with the given bucket upper bounds
    /// (finite, strictly increasing; `+Inf` is implied).
    pub fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Result<Histogram> {
        self.histogram_with_labels(name, help, buckets, &[])
    }

    /// Registers (or finds) the histogram series `name{labels}`. Every series of one family
    /// has the same buckets.
    pub fn histogram_with_labels(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
        labels: &[(&str, &str)],
    ) -> Result<Histogram> {
        if buckets.iter().any(|b| !b.is_finite()) || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid(
                name,
                "histogram buckets must be finite and increasing",
            ));
        }
        match self.register(name, help, MetricType::Histogram, buckets, labels)? {
            Series::Histogram(h) => Ok(h),
            _ => unreachable!("registered as a histogram"),
        }
    }

    fn register(
        &self,
        name: &str,
        help: &str,
        kind: MetricType,
        bounds: &[f64],
        labels: &[(&str, &str)],
    ) -> Result<Series> {
        if !is_valid_metric_name(name) {
            return Err(invalid(name, "invalid metric name"));
        }
        for (i, (label, _)) in labels.iter().enumerate() {
            if !is_valid_label_name(label)
                || (kind == MetricType::Histogram && *label == "le")
                || labels[..i].iter().any(|(other, _)| other == label)
            {
                return Err(invalid(
                    name,
                    &format!("invalid or repeated label {label:?}"),
                ));
            }
        }
        let mut families = self
            .families
            .lock()
            .map_err(|_| Error::Metrics("registry lock poisoned".into()))?;
        let index = match families.index.get(name) {
            Some(&index) => {
                let family = &families.list[index];
                if family.kind != kind || (kind == MetricType::Histogram && family.bounds != bounds)
                {
                    return Err(invalid(
                        name,
                        "already registered with another type or buckets",
                    ));
                }
                if let Some((_, series)) = family.series.iter().find(|(l, _)| {
                    l.len() == labels.len()
                        && l.iter().zip(labels).all(|(a, b)| a.0 == b.0 && a.1 == b.1)
                }) {
                    return Ok(series.clone());
                }
                index
            }
            None => {
                families.list.push(Family {
                    name: name.to_string(),
                    help: help.to_string(),
                    kind,
                    bounds: bounds.to_vec(),
                    series: Vec::new(),
                });
                let index = families.list.len() - 1;
                families.index.insert(name.to_string(), index);
                index
            }
        };
        if families.series >= self.max_series {
            return Err(invalid(
                name,
                &format!("registry full ({} series)", self.max_series),
            ));
        }
        let series = match kind {
            MetricType::Counter => Series::Counter(Counter::default()),
            MetricType::Gauge => Series::Gauge(Gauge::default()),
            MetricType::Histogram => Series::Histogram(Histogram::new(bounds)),
        };
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        families.list[index].series.push((labels, series.clone()));
        families.series += 1;
        Ok(series)
    }

    /// Renders every family in the text exposition format 0.0.4.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        self.render_into(&mut out);
        out
    }

    /// Appends every family in the text exposition format 0.0.4 to `out` (so a server can
    /// concatenate several registries, or its own lines).
    pub fn render_into(&self, out: &mut String) {
        let Ok(families) = self.families.lock() else {
            return;
        };
        for family in &families.list {
            let name = &family.name;
            let _ = writeln!(out, "# HELP {name} {}", escape_help(&family.help));
            let _ = writeln!(out, "# TYPE {name} {}", family.kind.as_str());
            for (labels, series) in &family.series {
                match series {
                    Series::Counter(c) => sample(out, name, "", labels, None, c.get()),
                    Series::Gauge(g) => sample(out, name, "", labels, None, g.get()),
                    Series::Histogram(h) => {
                        let counts = h.cumulative_counts();
                        for (bound, count) in h.bounds().iter().zip(&counts) {
                            // `{:?}` keeps a `.0` on whole bounds (`le="6.0"`), as
                            // SGLang's (Python) client writes them.
                            let le = format!("{bound:?}");
                            sample(out, name, "_bucket", labels, Some(&le), *count as f64);
                        }
                        let count = counts.last().copied().unwrap_or(0) as f64;
                        sample(out, name, "_bucket", labels, Some("+Inf"), count);
                        sample(out, name, "_sum", labels, None, h.sum());
                        sample(out, name, "_count", labels, None, count);
                    }
                }
            }
        }
    }
}

fn invalid(name: &str, why: &str) -> Error {
    Error::Metrics(format!("prometheus metric {name:?}: {why}"))
}

fn sample(
    out: &mut String,
    name: &str,
    suffix: &str,
    labels: &[(String, String)],
    le: Option<&str>,
    value: f64,
) {
    out.push_str(name);
    out.push_str(suffix);
    if !labels.is_empty() || le.is_some() {
        out.push('{');
        let le = le.map(|le| ("le", le));
        let all = labels
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(le);
        for (i, (key, value)) in all.enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{key}=\"{}\"", escape_label_value(value));
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(&format_value(value));
    out.push('\n');
}

/// A sample value as the text format spells it (`NaN`, `+Inf`, `-Inf`, else the shortest
/// decimal that round-trips).
pub fn format_value(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value == f64::INFINITY {
        "+Inf".into()
    } else if value == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{value}")
    }
}

/// Escapes a `# HELP` text: `\` → `\\`, newline → `\n`.
pub fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Escapes a label value: `\` → `\\`, `"` → `\"`, newline → `\n`.
pub fn escape_label_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

// ---------------------------------------------------------------------------------------
// Ready-made metric sets.

/// SGLang's default time-to-first-token buckets (seconds).
pub const SGLANG_TTFT_BUCKETS: [f64; 18] = [
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];

/// SGLang's default inter-token-latency buckets (seconds).
pub const SGLANG_ITL_BUCKETS: [f64; 23] = [
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
];

/// SGLang's default end-to-end request latency buckets (seconds).
pub const SGLANG_E2E_BUCKETS: [f64; 22] = [
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 600.0, 1200.0, 1800.0, 2400.0,
];

/// The metrics an SGLang-compatible engine server exports, under SGLang's own names and
/// labels (`model_name`, `engine_type="unified"`) so SGLang dashboards work unchanged, plus
/// the weight version the engine serves.
#[derive(Debug, Clone)]
pub struct SglangMetrics {
    /// `sglang:num_running_reqs`: requests being decoded now.
    pub num_running_reqs: Gauge,
    /// `sglang:num_queue_reqs`: requests waiting for a slot.
    pub num_queue_reqs: Gauge,
    /// `sglang:token_usage`: fraction of the KV cache in use (0–1).
    pub token_usage: Gauge,
    /// `sglang:num_used_tokens`: KV cache tokens in use.
    pub num_used_tokens: Gauge,
    /// `sglang:gen_throughput`: generation throughput (tokens/s).
    pub gen_throughput: Gauge,
    /// `sglang:prompt_tokens_total`: prefill tokens processed.
    pub prompt_tokens_total: Counter,
    /// `sglang:generation_tokens_total`: generation tokens produced.
    pub generation_tokens_total: Counter,
    /// `sglang:num_requests_total`: requests finished.
    pub num_requests_total: Counter,
    /// `sglang:num_aborted_requests_total`: requests aborted.
    pub num_aborted_requests_total: Counter,
    /// `sglang:time_to_first_token_seconds` ([`SGLANG_TTFT_BUCKETS`]).
    pub time_to_first_token_seconds: Histogram,
    /// `sglang:inter_token_latency_seconds` ([`SGLANG_ITL_BUCKETS`]).
    pub inter_token_latency_seconds: Histogram,
    /// `sglang:e2e_request_latency_seconds` ([`SGLANG_E2E_BUCKETS`]).
    pub e2e_request_latency_seconds: Histogram,
    /// `miles_rollout_weight_version`: the weight version being served (SGLang has no such
    /// metric; it reports the version on `/get_weight_version`).
    pub weight_version: Gauge,
}

impl SglangMetrics {
    /// Registers the set in `registry`, labelled with `model_name` (SGLang's
    /// `--served-model-name`).
    pub fn register(registry: &Registry, model_name: &str) -> Result<Self> {
        let labels = [("model_name", model_name), ("engine_type", "unified")];
        let gauge = |name: &str, help: &str| registry.gauge_with_labels(name, help, &labels);
        let counter = |name: &str, help: &str| registry.counter_with_labels(name, help, &labels);
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            registry.histogram_with_labels(name, help, buckets, &labels)
        };
        Ok(Self {
            num_running_reqs: gauge("sglang:num_running_reqs", "The number of running requests.")?,
            num_queue_reqs: gauge(
                "sglang:num_queue_reqs",
                "The number of requests in the waiting queue.",
            )?,
            token_usage: gauge("sglang:token_usage", "The token usage.")?,
            num_used_tokens: gauge("sglang:num_used_tokens", "The number of used tokens.")?,
            gen_throughput: gauge(
                "sglang:gen_throughput",
                "The generation throughput (token/s).",
            )?,
            prompt_tokens_total: counter(
                "sglang:prompt_tokens_total",
                "Number of prefill tokens processed.",
            )?,
            generation_tokens_total: counter(
                "sglang:generation_tokens_total",
                "Number of generation tokens processed.",
            )?,
            num_requests_total: counter(
                "sglang:num_requests_total",
                "Number of requests processed.",
            )?,
            num_aborted_requests_total: counter(
                "sglang:num_aborted_requests_total",
                "Number of requests aborted.",
            )?,
            time_to_first_token_seconds: histogram(
                "sglang:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &SGLANG_TTFT_BUCKETS,
            )?,
            inter_token_latency_seconds: histogram(
                "sglang:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &SGLANG_ITL_BUCKETS,
            )?,
            e2e_request_latency_seconds: histogram(
                "sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                &SGLANG_E2E_BUCKETS,
            )?,
            weight_version: registry.gauge_with_labels(
                "miles_rollout_weight_version",
                "Weight version the engine serves.",
                &labels[..1],
            )?,
        })
    }
}

/// Train step time buckets (seconds).
pub const STEP_TIME_BUCKETS: [f64; 14] = [
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
];

/// The live state of a trainer process (`miles_trainer_*`). The loss values and every other
/// logged metric come through [`PrometheusMetricsSink`] on the same registry.
#[derive(Debug, Clone)]
pub struct TrainerMetrics {
    /// `miles_trainer_steps_total`: train steps done.
    pub steps_total: Counter,
    /// `miles_trainer_step_seconds`: train step time ([`STEP_TIME_BUCKETS`]).
    pub step_seconds: Histogram,
    /// `miles_trainer_tokens_per_second`: tokens/s of the last step.
    pub tokens_per_second: Gauge,
    /// `miles_trainer_trained_tokens_total`: tokens trained on.
    pub trained_tokens_total: Counter,
    /// `miles_trainer_weight_version`: the trainer's current weight version.
    pub weight_version: Gauge,
    /// `miles_trainer_staleness`: max weight-version staleness of the last batch.
    pub staleness: Gauge,
    /// `miles_trainer_buffer_groups`: groups waiting in the rollout buffer.
    pub buffer_groups: Gauge,
    /// `miles_trainer_buffer_capacity_groups`: the buffer's capacity in groups.
    pub buffer_capacity_groups: Gauge,
}

impl TrainerMetrics {
    /// Registers the set in `registry`.
    pub fn register(registry: &Registry) -> Result<Self> {
        Ok(Self {
            steps_total: registry.counter("miles_trainer_steps_total", "Train steps done.")?,
            step_seconds: registry.histogram(
                "miles_trainer_step_seconds",
                "Train step time in seconds.",
                &STEP_TIME_BUCKETS,
            )?,
            tokens_per_second: registry.gauge(
                "miles_trainer_tokens_per_second",
                "Tokens per second of the last train step.",
            )?,
            trained_tokens_total: registry
                .counter("miles_trainer_trained_tokens_total", "Tokens trained on.")?,
            weight_version: registry.gauge(
                "miles_trainer_weight_version",
                "The trainer's current weight version.",
            )?,
            staleness: registry.gauge(
                "miles_trainer_staleness",
                "Max weight-version staleness of the last train batch.",
            )?,
            buffer_groups: registry.gauge(
                "miles_trainer_buffer_groups",
                "Groups waiting in the rollout buffer.",
            )?,
            buffer_capacity_groups: registry.gauge(
                "miles_trainer_buffer_capacity_groups",
                "Capacity of the rollout buffer in groups.",
            )?,
        })
    }

    /// Records one train step: its time and the tokens it trained on.
    pub fn record_step(&self, seconds: f64, tokens: u64) {
        self.steps_total.inc();
        self.step_seconds.observe(seconds);
        self.trained_tokens_total.inc_by(tokens as f64);
        if seconds > 0.0 {
            self.tokens_per_second.set(tokens as f64 / seconds);
        }
    }
}

/// The prefix [`PrometheusMetricsSink`] puts before every metric name (Miles' own).
pub const METRIC_PREFIX: &str = "miles_metric_";

/// The Prometheus name of a logged metric, as Miles' Prometheus backend forms it:
/// `prefix` + the name with `/` and `-` → `_` and `@` → `_at_`; any other character not
/// allowed in a metric name also becomes `_`, and a leading digit gets a `_` before it.
/// `train/pg_loss` → `miles_metric_train_pg_loss`; `eval/gsm8k/pass@1` →
/// `miles_metric_eval_gsm8k_pass_at_1`.
pub fn prometheus_metric_name(prefix: &str, name: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + name.len() + 4);
    out.push_str(prefix);
    if out.is_empty() && name.starts_with(|c: char| c.is_ascii_digit()) {
        out.push('_');
    }
    for c in name.chars() {
        match c {
            '@' => out.push_str("_at_"),
            c if c.is_ascii_alphanumeric() || c == '_' || c == ':' => out.push(c),
            _ => out.push('_'),
        }
    }
    out
}

/// Keeps the last value of every logged metric as a Prometheus gauge named by
/// [`prometheus_metric_name`] (`miles_metric_train_pg_loss`), with the original name as its
/// help text and an optional `run_name` label (as Miles' `--prometheus-run-name`), plus
/// `miles_metric_step`, the last step logged. Names that differ only in characters mapped
/// to `_` share one gauge.
pub struct PrometheusMetricsSink {
    registry: Arc<Registry>,
    prefix: String,
    run_name: Option<String>,
    gauges: Mutex<HashMap<String, Gauge>>,
}

impl PrometheusMetricsSink {
    /// A sink registering its gauges in `registry`, prefix [`METRIC_PREFIX`], no labels.
    pub fn new(registry: Arc<Registry>) -> Self {
        Self {
            registry,
            prefix: METRIC_PREFIX.to_string(),
            run_name: None,
            gauges: Mutex::new(HashMap::new()),
        }
    }

    /// Labels every gauge `run_name="<run_name>"`.
    pub fn with_run_name(mut self, run_name: impl Into<String>) -> Self {
        self.run_name = Some(run_name.into());
        self
    }

    /// Uses another name prefix (valid metric-name characters only).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The registry the gauges live in.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    fn set(
        &self,
        gauges: &mut HashMap<String, Gauge>,
        key: &str,
        name: impl FnOnce() -> String,
        help: &str,
        value: f64,
    ) -> Result<()> {
        if let Some(gauge) = gauges.get(key) {
            gauge.set(value);
            return Ok(());
        }
        let name = name();
        let labels: Vec<(&str, &str)> = self
            .run_name
            .as_deref()
            .map(|run| ("run_name", run))
            .into_iter()
            .collect();
        let gauge = self.registry.gauge_with_labels(&name, help, &labels)?;
        gauge.set(value);
        gauges.insert(key.to_string(), gauge);
        Ok(())
    }
}

impl MetricsSink for PrometheusMetricsSink {
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()> {
        let mut gauges = self
            .gauges
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?;
        // The step's key starts with `\0`, so it never meets a logged metric's name.
        let step_name = || format!("{}step", self.prefix);
        self.set(
            &mut gauges,
            "\0step",
            step_name,
            "The last step logged.",
            step as f64,
        )?;
        let mut first = Ok(());
        for (name, value) in metrics {
            let prometheus_name = || prometheus_metric_name(&self.prefix, name);
            if let Err(e) = self.set(&mut gauges, name, prometheus_name, name, *value) {
                first = first.and(Err(e));
            }
        }
        first
    }
}

/// Keeps [`TrainerMetrics`] current from the metrics a training loop logs each step:
/// `perf/train_time` and `perf/actor_train_tok_per_s` (one step and its tokens),
/// `weight_version`, the staleness of the batch (`rollout/fully_async/max_staleness`, 0 for a
/// synchronous step) and the buffer fill (`rollout/fully_async/queue_size`). Pair it with a
/// [`PrometheusMetricsSink`] on the same registry for the last value of every other metric.
pub struct TrainerMetricsSink {
    metrics: TrainerMetrics,
}

impl TrainerMetricsSink {
    /// A sink updating `metrics`.
    pub fn new(metrics: TrainerMetrics) -> Self {
        Self { metrics }
    }

    /// The metrics it updates.
    pub fn metrics(&self) -> &TrainerMetrics {
        &self.metrics
    }
}

impl MetricsSink for TrainerMetricsSink {
    fn log(&self, _step: u64, metrics: &Metrics) -> Result<()> {
        let get = |k: &str| metrics.get(k).copied().filter(|v| v.is_finite());
        if let Some(seconds) = get("perf/train_time") {
            let tokens = get("perf/actor_train_tok_per_s").map_or(0.0, |r| r * seconds);
            self.metrics
                .record_step(seconds, tokens.round().max(0.0) as u64);
        }
        if let Some(v) = get("weight_version") {
            self.metrics.weight_version.set(v);
        }
        if get("perf/train_time").is_some() {
            self.metrics
                .staleness
                .set(get("rollout/fully_async/max_staleness").unwrap_or(0.0));
        }
        if let Some(v) = get("rollout/fully_async/queue_size") {
            self.metrics.buffer_groups.set(v);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn trainer_metrics_follow_the_logged_step() {
        let registry = Registry::new();
        let sink = TrainerMetricsSink::new(TrainerMetrics::register(&registry).unwrap());
        let mut m = Metrics::new();
        m.insert("perf/train_time".into(), 2.0);
        m.insert("perf/actor_train_tok_per_s".into(), 512.0);
        m.insert("weight_version".into(), 3.0);
        m.insert("rollout/fully_async/max_staleness".into(), 1.0);
        m.insert("rollout/fully_async/queue_size".into(), 5.0);
        sink.log(0, &m).unwrap();
        let t = sink.metrics();
        assert_eq!(t.steps_total.get(), 1.0);
        assert_eq!(t.trained_tokens_total.get(), 1024.0);
        assert_eq!(t.tokens_per_second.get(), 512.0);
        assert_eq!(t.weight_version.get(), 3.0);
        assert_eq!(t.staleness.get(), 1.0);
        assert_eq!(t.buffer_groups.get(), 5.0);
        // A step without training (an evaluation row) changes nothing but what it carries.
        let mut eval = Metrics::new();
        eval.insert("eval/x/raw_reward".into(), 0.5);
        sink.log(1, &eval).unwrap();
        assert_eq!(t.steps_total.get(), 1.0);
        m.remove("rollout/fully_async/max_staleness");
        sink.log(2, &m).unwrap();
        assert_eq!(t.steps_total.get(), 2.0);
        assert_eq!(t.staleness.get(), 0.0, "a synchronous step is never stale");
        assert!(registry.render().contains("miles_trainer_steps_total 2"));
    }

    use super::*;

    #[test]
    fn renders_counters_gauges_and_labels_with_escaping() {
        let registry = Registry::new();
        let c = registry
            .counter("x_total", "A \\ counter\nwith two lines.")
            .unwrap();
        let g = registry
            .gauge_with_labels("g", "gauge", &[("path", "a\"b\\c\nd")])
            .unwrap();
        c.inc();
        c.inc_by(2.5);
        c.inc_by(-7.0);
        c.inc_by(f64::NAN);
        g.set(f64::NEG_INFINITY);
        assert_eq!(
            registry.render(),
            "# HELP x_total A \\\\ counter\\nwith two lines.\n# TYPE x_total counter\nx_total 3.5\n\
             # HELP g gauge\n# TYPE g gauge\ng{path=\"a\\\"b\\\\c\\nd\"} -Inf\n"
        );
        g.set(f64::NAN);
        assert!(registry.render().ends_with("} NaN\n"));
        // Same name and labels: the same series.
        registry.counter("x_total", "other help").unwrap().inc();
        assert_eq!(c.get(), 4.5);
    }

    #[test]
    fn histogram_buckets_are_cumulative_with_inf() {
        let registry = Registry::new();
        let h = registry
            .histogram_with_labels("h_seconds", "h", &[0.1, 1.0], &[("m", "q")])
            .unwrap();
        for v in [0.05, 0.1, 0.5, 3.0, f64::NAN] {
            h.observe(v);
        }
        let text = registry.render();
        assert!(
            text.contains("h_seconds_bucket{m=\"q\",le=\"0.1\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("h_seconds_bucket{m=\"q\",le=\"1.0\"} 3\n"));
        assert!(text.contains("h_seconds_bucket{m=\"q\",le=\"+Inf\"} 4\n"));
        assert!(text.contains("h_seconds_sum{m=\"q\"} 3.65\n"));
        assert!(text.contains("h_seconds_count{m=\"q\"} 4\n"));
    }

    #[test]
    fn registration_is_validated_and_bounded() {
        let registry = Registry::with_max_series(2);
        assert!(registry.counter("bad name", "").is_err());
        assert!(registry.counter("9lives", "").is_err());
        assert!(
            registry
                .gauge_with_labels("g", "", &[("__x", "1")])
                .is_err()
        );
        assert!(
            registry
                .gauge_with_labels("g", "", &[("a", "1"), ("a", "2")])
                .is_err()
        );
        assert!(
            registry
                .histogram_with_labels("h", "", &[1.0], &[("le", "1")])
                .is_err()
        );
        assert!(registry.histogram("h", "", &[1.0, 1.0]).is_err());
        assert!(registry.histogram("h", "", &[f64::INFINITY]).is_err());
        registry.gauge("g", "").unwrap();
        assert!(registry.counter("g", "").is_err(), "type clash");
        registry.gauge_with_labels("g", "", &[("a", "1")]).unwrap();
        assert!(
            registry.gauge_with_labels("g", "", &[("a", "2")]).is_err(),
            "full"
        );
        registry.gauge_with_labels("g", "", &[("a", "1")]).unwrap(); // existing: fine
    }

    #[test]
    fn metric_names_map_like_miles() {
        assert_eq!(
            prometheus_metric_name(METRIC_PREFIX, "train/pg_loss"),
            "miles_metric_train_pg_loss"
        );
        assert_eq!(
            prometheus_metric_name(METRIC_PREFIX, "eval/gsm8k-test/pass@1"),
            "miles_metric_eval_gsm8k_test_pass_at_1"
        );
        assert_eq!(
            prometheus_metric_name(METRIC_PREFIX, "tito_session_mismatch_rate/v1"),
            "miles_metric_tito_session_mismatch_rate_v1"
        );
        assert_eq!(prometheus_metric_name("", "1x.y"), "_1x_y");
    }

    #[test]
    fn sink_keeps_the_last_value() {
        let registry = Arc::new(Registry::new());
        let sink = PrometheusMetricsSink::new(registry.clone()).with_run_name("r1");
        sink.log(1, &Metrics::from([("train/pg_loss".to_string(), 0.5)]))
            .unwrap();
        sink.log(2, &Metrics::from([("train/pg_loss".to_string(), -0.25)]))
            .unwrap();
        let text = registry.render();
        assert!(text.contains(
            "# HELP miles_metric_train_pg_loss train/pg_loss\n# TYPE miles_metric_train_pg_loss gauge\nmiles_metric_train_pg_loss{run_name=\"r1\"} -0.25\n"
        ), "{text}");
        assert!(text.contains("miles_metric_step{run_name=\"r1\"} 2\n"));
    }

    #[test]
    fn ready_made_sets_register_once() {
        let registry = Registry::new();
        let sglang = SglangMetrics::register(&registry, "qwen3").unwrap();
        sglang.generation_tokens_total.inc_by(5.0);
        let again = SglangMetrics::register(&registry, "qwen3").unwrap();
        assert_eq!(again.generation_tokens_total.get(), 5.0);
        let trainer = TrainerMetrics::register(&registry).unwrap();
        trainer.record_step(2.0, 1000);
        assert_eq!(trainer.tokens_per_second.get(), 500.0);
        let text = registry.render();
        assert!(text.contains(
            "sglang:generation_tokens_total{model_name=\"qwen3\",engine_type=\"unified\"} 5\n"
        ));
        assert!(text.contains("miles_trainer_step_seconds_bucket{le=\"2.5\"} 1\n"));
    }
}
