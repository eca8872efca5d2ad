//! The TensorBoard sink's files, read by TensorBoard's own reader (`EventAccumulator`) and
//! checked against what the JSONL sink wrote for the same steps: every name, step and value.
//!
//! Needs a Python with `tensorboard`: `MILES_TORCH_PYTHON`, else `.venv-ref/bin/python` at the
//! workspace root (CI makes it, see `.ci/run`). Without one the test fails when `CI` is set,
//! and otherwise prints a loud NOT RUN line.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use miles_core::tensorboard::TensorBoardSink;
use miles_core::tensorboard::read_event_file;
use miles_core::{FanoutMetricsSink, JsonlMetricsSink, Metrics, MetricsSink};
use serde_json::Value;

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

const READER: &str = r#"
import json, math, sys
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util
def enc(v):
    return v if math.isfinite(v) else repr(v)
# The classic reader's scalars.
acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
scalars = {tag: [[e.step, enc(e.value)] for e in acc.Scalars(tag)]
           for tag in acc.Tags()["scalars"]}
# What the TensorBoard server itself loads (simple_value migrated to scalar tensors).
plugin = plugin_event_accumulator.EventAccumulator(sys.argv[1], size_guidance={"tensors": 0})
plugin.Reload()
tensors = {tag: {"plugin": plugin.SummaryMetadata(tag).plugin_data.plugin_name,
                 "points": [[e.step, enc(float(tensor_util.make_ndarray(e.tensor_proto)))]
                            for e in plugin.Tensors(tag)]}
           for tag in plugin.Tags()["tensors"]}
print(json.dumps({"scalars": scalars, "tensors": tensors}))
"#;

fn metrics(step: u64) -> Metrics {
    let s = step as f64;
    let mut m = Metrics::new();
    m.insert("rollout/raw_reward".into(), 0.1 * s);
    m.insert("train/pg_loss".into(), -0.37 + 0.011 * s);
    m.insert("train/ppo_kl".into(), 1e-7 * s);
    m.insert("perf/step_time".into(), 12.5 + s);
    m.insert("eval/gsm8k/accuracy".into(), 0.333_333_333_3 * s);
    m.insert("tito_session_mismatch_rate/v1".into(), 0.0);
    if step == 2 {
        m.insert("train/grad_norm".into(), f64::NAN);
    }
    if step == 3 {
        m.insert("train/grad_norm".into(), f64::INFINITY);
        m.insert("perf/update_weights_time".into(), 3.25);
    }
    m
}

#[test]
fn tensorboard_reader_sees_what_jsonl_got() {
    let Some(python) = require_python("tensorboard", "tensorboard_reader_sees_what_jsonl_got")
    else {
        return;
    };
    let root = std::env::temp_dir().join(format!("miles-core-tb-reader-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let tb_dir = root.join("tb");
    let jsonl = root.join("metrics.jsonl");

    // A run of 3 steps, then a resumed run (new sinks, same places) of 2 more.
    let tb = Arc::new(TensorBoardSink::create(&tb_dir).unwrap());
    let sink = FanoutMetricsSink::new(vec![
        Arc::new(JsonlMetricsSink::create(&jsonl).unwrap()),
        tb.clone(),
    ]);
    for step in 1..=3 {
        sink.log(step, &metrics(step)).unwrap();
    }
    // Flushed per log: TensorBoard reads the first steps while the sink is still open.
    let early = read_event_file(tb.path()).unwrap();
    assert_eq!(early.len(), 4, "version event + 3 steps");
    drop((sink, tb));
    let resumed = FanoutMetricsSink::new(vec![
        Arc::new(JsonlMetricsSink::append(&jsonl).unwrap()),
        Arc::new(TensorBoardSink::append(&tb_dir).unwrap()),
    ]);
    for step in 4..=5 {
        resumed.log(step, &metrics(step)).unwrap();
    }
    drop(resumed);
    assert_eq!(std::fs::read_dir(&tb_dir).unwrap().count(), 2);

    let out = Command::new(&python)
        .arg("-c")
        .arg(READER)
        .arg(&tb_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "EventAccumulator failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: Value = serde_json::from_slice(&out.stdout).unwrap();
    let seen = read["scalars"].as_object().unwrap();
    // The server's loader sees the same points, as the `scalars` plugin's data.
    let tensors = read["tensors"].as_object().unwrap();
    assert_eq!(tensors.len(), seen.len());
    for (tag, points) in seen {
        assert_eq!(tensors[tag]["plugin"], "scalars", "{tag}");
        assert_eq!(&tensors[tag]["points"], points, "{tag}");
    }

    // Expected from the JSONL file: tag -> [(step, value or null)].
    let mut expected: std::collections::BTreeMap<String, Vec<(u64, Value)>> = Default::default();
    for line in std::fs::read_to_string(&jsonl).unwrap().lines() {
        let object: serde_json::Map<String, Value> = serde_json::from_str(line).unwrap();
        let step = object["step"].as_u64().unwrap();
        for (name, value) in object {
            if name != "step" {
                expected.entry(name).or_default().push((step, value));
            }
        }
    }
    assert_eq!(expected.len(), 8);
    assert_eq!(
        seen.keys().collect::<std::collections::BTreeSet<_>>(),
        expected.keys().collect(),
        "tags"
    );
    let mut checked = 0;
    for (tag, points) in &expected {
        let got = seen[tag].as_array().unwrap();
        assert_eq!(got.len(), points.len(), "{tag}: number of points");
        for ((step, want), got) in points.iter().zip(got) {
            assert_eq!(got[0].as_u64(), Some(*step), "{tag}: step");
            match want.as_f64() {
                // f32 as TensorBoard stores it, exactly.
                Some(want) => assert_eq!(got[1].as_f64(), Some(want as f32 as f64), "{tag}@{step}"),
                // JSON's null is TensorBoard's non-finite value.
                None => {
                    let text = got[1].as_str().unwrap_or_default();
                    assert!(["nan", "inf"].contains(&text), "{tag}@{step}: {got:?}");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5 * 6 + 2 + 1);
    assert_eq!(seen["train/grad_norm"][0][1], "nan");
    assert_eq!(seen["train/grad_norm"][1][1], "inf");
    std::fs::remove_dir_all(root).unwrap();
}
