//! `/metrics` scraped over loopback and parsed by the real Prometheus parser
//! (`prometheus_client.parser.text_string_to_metric_families`): names, types, labels and
//! values of the SGLang set, the trainer set, the metrics sink and escaped label values.
//!
//! Needs a Python with `prometheus_client`: `MILES_TORCH_PYTHON`, else `.venv-ref/bin/python`
//! at the workspace root (CI makes it, see `.ci/run`). Without one the test fails when `CI`
//! is set, and otherwise prints a loud NOT RUN line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use miles_core::prometheus::PrometheusMetricsSink;
use miles_core::prometheus::{Registry, SglangMetrics, TrainerMetrics};
use miles_core::{Metrics, MetricsSink};
use miles_session::metrics_server::MetricsServer;
use serde_json::{Value, json};

/// The first Python (`MILES_TORCH_PYTHON`, then `<workspace>/.venv-ref/bin/python`) that
/// imports `module`.
fn python_with(module: &str) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    let candidates = std::env::var_os("MILES_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv]);
    candidates.into_iter().find(|python| {
        Command::new(python)
            .args(["-c", &format!("import {module}")])
            .output()
            .is_ok_and(|out| out.status.success())
    })
}

/// Returns the Python, or `None` after printing NOT RUN; panics in CI.
fn require_python(module: &str, test: &str) -> Option<PathBuf> {
    let python = python_with(module);
    if python.is_none() {
        let msg = format!(
            "no Python with `{module}` (set MILES_TORCH_PYTHON or make .venv-ref: \
             python3 -m venv .venv-ref && .venv-ref/bin/pip install tensorboard prometheus_client)"
        );
        if std::env::var_os("CI").is_some() {
            panic!("{test}: {msg}");
        }
        eprintln!("\n######## NOT RUN: {test}: {msg} ########\n");
    }
    python
}

/// Scrapes the URL with urllib and prints the parsed families as JSON.
const SCRAPER: &str = r#"
import json, math, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
with urllib.request.urlopen(sys.argv[1], timeout=10) as response:
    content_type = response.headers["Content-Type"]
    text = response.read().decode("utf-8")
def enc(v):
    return v if math.isfinite(v) else repr(v)
families = {
    f.name: {"type": f.type, "help": f.documentation,
             "samples": [[s.name, s.labels, enc(s.value)] for s in f.samples]}
    for f in text_string_to_metric_families(text)
}
print(json.dumps({"content_type": content_type, "families": families}))
"#;

fn sample<'a>(family: &'a Value, name: &str, labels: &Value) -> &'a Value {
    family["samples"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s[0] == name && &s[1] == labels)
        .map(|s| &s[2])
        .unwrap_or_else(|| panic!("no sample {name} {labels} in {family}"))
}

#[test]
fn prometheus_parser_reads_the_metrics_endpoint() {
    let Some(python) = require_python(
        "prometheus_client",
        "prometheus_parser_reads_the_metrics_endpoint",
    ) else {
        return;
    };
    let registry = Arc::new(Registry::new());

    // An engine server's view (miles serve).
    let sglang = SglangMetrics::register(&registry, "Qwen/Qwen3-0.6B").unwrap();
    sglang.num_running_reqs.set(3.0);
    sglang.num_queue_reqs.set(1.0);
    sglang.token_usage.set(0.42);
    sglang.prompt_tokens_total.inc_by(100.0);
    sglang.generation_tokens_total.inc_by(250.0);
    for ttft in [0.05, 0.3, 0.3, 5.0, 1000.0] {
        sglang.time_to_first_token_seconds.observe(ttft);
    }
    for itl in [0.003, 0.009] {
        sglang.inter_token_latency_seconds.observe(itl);
    }
    sglang.weight_version.set(7.0);

    // A trainer's view: its own set plus every logged metric as a gauge.
    let trainer = TrainerMetrics::register(&registry).unwrap();
    trainer.record_step(4.0, 2048);
    trainer.weight_version.set(7.0);
    trainer.staleness.set(1.0);
    trainer.buffer_groups.set(12.0);
    let sink = PrometheusMetricsSink::new(registry.clone()).with_run_name("run \"a\"\\b");
    let mut logged = Metrics::new();
    logged.insert("train/pg_loss".into(), -0.125);
    logged.insert("perf/step_time".into(), 4.0);
    logged.insert("eval/gsm8k/pass@1".into(), 0.5);
    logged.insert("train/grad_norm".into(), f64::NAN);
    sink.log(9, &logged).unwrap();
    let odd = registry
        .gauge_with_labels(
            "miles_test_escapes",
            "Help with \\ and\nnewline.",
            &[("v", "x\ny\"z")],
        )
        .unwrap();
    odd.set(f64::INFINITY);

    let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), registry.clone()).unwrap();
    let url = format!("http://{}/metrics", server.local_addr());
    let out = Command::new(&python)
        .arg("-c")
        .arg(SCRAPER)
        .arg(&url)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scrape/parse failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        parsed["content_type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let families = &parsed["families"];
    let model = json!({"model_name": "Qwen/Qwen3-0.6B", "engine_type": "unified"});

    // SGLang's names and types. The parser names a counter family without `_total`.
    for (family, kind) in [
        ("sglang:num_running_reqs", "gauge"),
        ("sglang:num_queue_reqs", "gauge"),
        ("sglang:token_usage", "gauge"),
        ("sglang:prompt_tokens", "counter"),
        ("sglang:generation_tokens", "counter"),
        ("sglang:time_to_first_token_seconds", "histogram"),
        ("sglang:inter_token_latency_seconds", "histogram"),
        ("miles_rollout_weight_version", "gauge"),
        ("miles_trainer_steps", "counter"),
        ("miles_trainer_step_seconds", "histogram"),
        ("miles_trainer_tokens_per_second", "gauge"),
        ("miles_metric_train_pg_loss", "gauge"),
        ("miles_metric_step", "gauge"),
    ] {
        assert_eq!(families[family]["type"], kind, "{family}");
    }
    let f = |name: &str| &families[name];
    assert_eq!(
        *sample(
            f("sglang:num_running_reqs"),
            "sglang:num_running_reqs",
            &model
        ),
        3.0
    );
    assert_eq!(
        *sample(f("sglang:token_usage"), "sglang:token_usage", &model),
        0.42
    );
    assert_eq!(
        *sample(
            f("sglang:generation_tokens"),
            "sglang:generation_tokens_total",
            &model
        ),
        250.0
    );
    assert_eq!(
        *sample(
            f("sglang:prompt_tokens"),
            "sglang:prompt_tokens_total",
            &model
        ),
        100.0
    );
    let ttft = f("sglang:time_to_first_token_seconds");
    let bucket = |le: &str| {
        let mut labels = model.clone();
        labels["le"] = json!(le);
        sample(ttft, "sglang:time_to_first_token_seconds_bucket", &labels).clone()
    };
    assert_eq!(bucket("0.1"), 1.0);
    assert_eq!(bucket("0.4"), 3.0);
    assert_eq!(bucket("6.0"), 4.0);
    assert_eq!(bucket("400.0"), 4.0);
    assert_eq!(bucket("+Inf"), 5.0);
    assert_eq!(
        *sample(ttft, "sglang:time_to_first_token_seconds_count", &model),
        5.0
    );
    let sum = sample(ttft, "sglang:time_to_first_token_seconds_sum", &model);
    assert!((sum.as_f64().unwrap() - 1005.65).abs() < 1e-9, "{sum}");
    assert_eq!(
        ttft["samples"].as_array().unwrap().len(),
        18 + 1 + 2,
        "18 SGLang buckets + Inf + sum + count"
    );
    let itl = f("sglang:inter_token_latency_seconds");
    let mut le = model.clone();
    le["le"] = json!("0.004");
    assert_eq!(
        *sample(itl, "sglang:inter_token_latency_seconds_bucket", &le),
        1.0
    );
    assert_eq!(
        *sample(
            f("miles_rollout_weight_version"),
            "miles_rollout_weight_version",
            &json!({"model_name": "Qwen/Qwen3-0.6B"})
        ),
        7.0
    );

    // The trainer set.
    let none = json!({});
    assert_eq!(
        *sample(f("miles_trainer_steps"), "miles_trainer_steps_total", &none),
        1.0
    );
    assert_eq!(
        *sample(
            f("miles_trainer_tokens_per_second"),
            "miles_trainer_tokens_per_second",
            &none
        ),
        512.0
    );
    let mut le = json!({"le": "5.0"});
    assert_eq!(
        *sample(
            f("miles_trainer_step_seconds"),
            "miles_trainer_step_seconds_bucket",
            &le
        ),
        1.0
    );
    le["le"] = json!("2.5");
    assert_eq!(
        *sample(
            f("miles_trainer_step_seconds"),
            "miles_trainer_step_seconds_bucket",
            &le
        ),
        0.0
    );
    assert_eq!(
        *sample(
            f("miles_trainer_staleness"),
            "miles_trainer_staleness",
            &none
        ),
        1.0
    );

    // The sink: Miles' names, the original name as help, the run_name label unescaped.
    let run = json!({"run_name": "run \"a\"\\b"});
    let pg = f("miles_metric_train_pg_loss");
    assert_eq!(pg["help"], "train/pg_loss");
    assert_eq!(*sample(pg, "miles_metric_train_pg_loss", &run), -0.125);
    assert_eq!(
        *sample(
            f("miles_metric_perf_step_time"),
            "miles_metric_perf_step_time",
            &run
        ),
        4.0
    );
    assert_eq!(
        *sample(
            f("miles_metric_eval_gsm8k_pass_at_1"),
            "miles_metric_eval_gsm8k_pass_at_1",
            &run
        ),
        0.5
    );
    assert_eq!(
        *sample(
            f("miles_metric_train_grad_norm"),
            "miles_metric_train_grad_norm",
            &run
        ),
        "nan"
    );
    assert_eq!(
        *sample(f("miles_metric_step"), "miles_metric_step", &run),
        9.0
    );

    // Escaping round-trips through the parser.
    let odd = f("miles_test_escapes");
    assert_eq!(odd["help"], "Help with \\ and\nnewline.");
    assert_eq!(
        *sample(odd, "miles_test_escapes", &json!({"v": "x\ny\"z"})),
        "inf"
    );

    // Live values: a second log is seen by the next scrape.
    sink.log(10, &Metrics::from([("train/pg_loss".to_string(), 0.75)]))
        .unwrap();
    let out = Command::new(&python)
        .arg("-c")
        .arg(SCRAPER)
        .arg(&url)
        .output()
        .unwrap();
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let families = &parsed["families"];
    assert_eq!(
        *sample(
            &families["miles_metric_train_pg_loss"],
            "miles_metric_train_pg_loss",
            &run
        ),
        0.75
    );
    assert_eq!(
        *sample(&families["miles_metric_step"], "miles_metric_step", &run),
        10.0
    );
    server.stop().unwrap();
}
