//! Metrics: named scalar values per step, and where they go.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Number, Value};

use crate::error::{Error, Result};

/// Metric name (Miles' names: `train/pg_loss`, `rollout/raw_reward`, `perf/...`) → value.
pub type Metrics = BTreeMap<String, f64>;

/// Receives metrics. Object-safe and shareable (`Arc<dyn MetricsSink>`).
pub trait MetricsSink: Send + Sync {
    /// Records the metrics of one step.
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()>;

    /// Flushes buffered output. The default does nothing.
    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

/// Writes one JSON object per call: `{"step": 3, "train/pg_loss": 0.12, …}`, keys in name
/// order; non-finite values are written as `null` (JSON has no NaN). Lines are flushed as
/// they are written, so a crashed run keeps every step it logged.
pub struct JsonlMetricsSink {
    path: PathBuf,
    writer: Mutex<BufWriter<File>>,
}

impl JsonlMetricsSink {
    /// Creates (truncating) the file at `path`, creating its parent folders.
    pub fn create(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), false)
    }

    /// Opens the file at `path` for appending (resuming a run).
    pub fn append(path: impl AsRef<Path>) -> Result<Self> {
        Self::open(path.as_ref(), true)
    }

    fn open(path: &Path, append: bool) -> Result<Self> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        if append {
            drop_partial_last_line(path).map_err(|e| Error::io(path, e))?;
        }
        Ok(Self {
            path: path.to_path_buf(),
            writer: Mutex::new(BufWriter::new(file)),
        })
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The JSON line [`JsonlMetricsSink`] writes for one step.
pub fn metrics_line(step: u64, metrics: &Metrics) -> String {
    // Written key by key: `step` first whatever `serde_json::Map`'s order is (it sorts keys
    // unless some crate of the build enables serde_json's `preserve_order`).
    let mut line = format!("{{\"step\":{step}");
    for (name, value) in metrics {
        let value = Number::from_f64(*value).map_or(Value::Null, Value::Number);
        line.push(',');
        line.push_str(&Value::String(name.clone()).to_string());
        line.push(':');
        line.push_str(&value.to_string());
    }
    line.push('}');
    line
}

/// Cuts a line left unfinished by a killed writer (no final newline) off the end of `path`, so
/// appended lines start on a line of their own and the file stays one JSON object per line.
fn drop_partial_last_line(path: &Path) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let len = file.metadata()?.len();
    let mut end = len;
    let mut chunk = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(chunk.len() as u64);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut chunk[..n])?;
        if let Some(at) = chunk[..n].iter().rposition(|&b| b == b'\n') {
            let keep = start + at as u64 + 1;
            if keep < len {
                file.set_len(keep)?;
            }
            return Ok(());
        }
        end = start;
    }
    // No newline at all: the whole file is one unfinished line.
    if len > 0 {
        file.set_len(0)?;
    }
    Ok(())
}

impl MetricsSink for JsonlMetricsSink {
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()> {
        let line = metrics_line(step, metrics);
        let mut writer = self
            .writer
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?;
        writeln!(writer, "{line}")
            .and_then(|()| writer.flush())
            .map_err(|e| Error::io(&self.path, e))
    }

    fn flush(&self) -> Result<()> {
        self.writer
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?
            .flush()
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// Keeps every logged step in memory (for tests and in-process dashboards).
#[derive(Default)]
pub struct MemoryMetricsSink {
    steps: Mutex<Vec<(u64, Metrics)>>,
}

impl MemoryMetricsSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of everything logged so far, in order.
    pub fn steps(&self) -> Vec<(u64, Metrics)> {
        self.steps.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

impl MetricsSink for MemoryMetricsSink {
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()> {
        self.steps
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?
            .push((step, metrics.clone()));
        Ok(())
    }
}

/// Sends every step to several sinks (JSONL + TensorBoard + Prometheus, ...), in order.
///
/// Every sink gets every step even when an earlier one fails; the first error is returned.
#[derive(Default)]
pub struct FanoutMetricsSink {
    sinks: Vec<Arc<dyn MetricsSink>>,
}

impl FanoutMetricsSink {
    /// Fans out to `sinks`.
    pub fn new(sinks: Vec<Arc<dyn MetricsSink>>) -> Self {
        Self { sinks }
    }

    /// Adds one more sink (builder style).
    pub fn with(mut self, sink: Arc<dyn MetricsSink>) -> Self {
        self.sinks.push(sink);
        self
    }

    /// Adds one more sink.
    pub fn push(&mut self, sink: Arc<dyn MetricsSink>) {
        self.sinks.push(sink);
    }

    /// How many sinks there are.
    pub fn len(&self) -> usize {
        self.sinks.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.sinks.is_empty()
    }
}

impl MetricsSink for FanoutMetricsSink {
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()> {
        let mut first = Ok(());
        for sink in &self.sinks {
            if let Err(e) = sink.log(step, metrics) {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn flush(&self) -> Result<()> {
        let mut first = Ok(());
        for sink in &self.sinks {
            if let Err(e) = sink.flush() {
                first = first.and(Err(e));
            }
        }
        first
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn appending_drops_a_line_cut_by_a_kill() {
        let path = std::env::temp_dir().join(format!("miles-jsonl-cut-{}", std::process::id()));
        std::fs::write(&path, "{\"step\":0,\"a\":1}\n{\"step\":1,\"a\"").unwrap();
        let sink = JsonlMetricsSink::append(&path).unwrap();
        let mut m = Metrics::new();
        m.insert("a".into(), 2.0);
        sink.log(1, &m).unwrap();
        sink.flush().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"step\":0,\"a\":1}\n{\"step\":1,\"a\":2.0}\n");
        // A complete file is left as it is.
        drop(sink);
        let sink = JsonlMetricsSink::append(&path).unwrap();
        drop(sink);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), text);
        std::fs::remove_file(&path).ok();
    }

    use super::*;

    #[test]
    fn jsonl_sink_writes_one_object_per_step() {
        let dir = std::env::temp_dir().join(format!("miles-core-metrics-{}", std::process::id()));
        let path = dir.join("nested/metrics.jsonl");
        let sink = JsonlMetricsSink::create(&path).unwrap();
        let mut m = Metrics::new();
        m.insert("train/pg_loss".into(), 0.25);
        m.insert("train/grad_norm".into(), f64::NAN);
        sink.log(1, &m).unwrap();
        m.insert("train/pg_loss".into(), -1.5);
        sink.log(2, &m).unwrap();
        drop(sink);
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                r#"{"step":1,"train/grad_norm":null,"train/pg_loss":0.25}"#,
                r#"{"step":2,"train/grad_norm":null,"train/pg_loss":-1.5}"#,
            ]
        );
        let appended = JsonlMetricsSink::append(&path).unwrap();
        appended.log(3, &Metrics::new()).unwrap();
        drop(appended);
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn memory_sink_keeps_order() {
        let sink = MemoryMetricsSink::new();
        sink.log(5, &Metrics::from([("a".to_string(), 1.0)]))
            .unwrap();
        sink.log(6, &Metrics::new()).unwrap();
        let steps = sink.steps();
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[0].0, 5);
        assert_eq!(steps[0].1["a"], 1.0);
    }

    struct Failing;

    impl MetricsSink for Failing {
        fn log(&self, _: u64, _: &Metrics) -> Result<()> {
            Err(Error::Metrics("full".into()))
        }
    }

    #[test]
    fn fanout_reaches_every_sink_and_reports_the_first_error() {
        let a = Arc::new(MemoryMetricsSink::new());
        let b = Arc::new(MemoryMetricsSink::new());
        let fanout = FanoutMetricsSink::new(vec![a.clone(), Arc::new(Failing)]).with(b.clone());
        assert_eq!(fanout.len(), 3);
        let m = Metrics::from([("train/pg_loss".to_string(), 0.5)]);
        let err = fanout.log(7, &m).unwrap_err();
        assert!(err.to_string().contains("full"));
        assert_eq!(a.steps(), [(7, m.clone())]);
        assert_eq!(b.steps(), [(7, m)]);
        fanout.flush().unwrap();
        assert!(FanoutMetricsSink::default().is_empty());
    }
}
