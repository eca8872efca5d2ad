//! Training curves to SVG: reads the metrics JSONL that miles-core's `JsonlMetricsSink`
//! writes (one `{"step": N, "name": value, …}` object per line, `null` for non-finite values)
//! and draws one panel per group of metrics with `plotters`' SVG backend.
//!
//! [`PlotSpec::reward_kl_entropy`] is the reference example's figure: mean rollout reward
//! (and held-out evaluation reward when logged), KL (`train/kl_loss`, `train/ppo_kl`,
//! `train/train_rollout_kl`) and entropy (`train/entropy_loss`).
//!
//! ```
//! use miles_cli::plot::{PlotSpec, read_metrics, render_svg};
//!
//! let jsonl = "{\"step\":1,\"rollout/raw_reward\":0.1,\"train/ppo_kl\":0.0}\n\
//!              {\"step\":2,\"rollout/raw_reward\":0.4,\"train/ppo_kl\":null}\n";
//! let metrics = read_metrics(jsonl, "inline")?;
//! assert_eq!(metrics.series("rollout/raw_reward"), [(1.0, 0.1), (2.0, 0.4)]);
//! assert_eq!(metrics.series("train/ppo_kl"), [(1.0, 0.0)]); // null is skipped
//! let svg = render_svg(&metrics, &PlotSpec::reward_kl_entropy())?;
//! assert!(svg.starts_with("<svg") && svg.contains("reward"));
//! # Ok::<(), miles_cli::Error>(())
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

use crate::error::Error;

/// Every metric of a run: name → `(step, value)` points in file order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsLog {
    series: BTreeMap<String, Vec<(f64, f64)>>,
}

impl MetricsLog {
    /// The points of one metric (empty when it was never logged).
    pub fn series(&self, name: &str) -> &[(f64, f64)] {
        self.series.get(name).map_or(&[], Vec::as_slice)
    }

    /// The names of all metrics seen.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.series.keys().map(String::as_str)
    }

    /// The last value of a metric.
    pub fn last(&self, name: &str) -> Option<f64> {
        self.series(name).last().map(|&(_, v)| v)
    }
}

/// Parses metrics JSONL text; `source` names it in errors. Blank lines are skipped; a line
/// that is not a JSON object with a numeric `step` is an error naming the line.
pub fn read_metrics(text: &str, source: impl Into<PathBuf>) -> Result<MetricsLog, Error> {
    let source = source.into();
    let mut log = MetricsLog::default();
    for (index, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |reason: String| Error::Line {
            path: source.clone(),
            line: index + 1,
            reason,
        };
        let Value::Object(object) =
            serde_json::from_str::<Value>(line).map_err(|e| bad(e.to_string()))?
        else {
            return Err(bad("not a JSON object".into()));
        };
        let step = object
            .get("step")
            .and_then(Value::as_f64)
            .ok_or_else(|| bad("no numeric \"step\"".into()))?;
        for (name, value) in &object {
            if name == "step" {
                continue;
            }
            if let Some(v) = value.as_f64().filter(|v| v.is_finite()) {
                log.series.entry(name.clone()).or_default().push((step, v));
            }
        }
    }
    Ok(log)
}

/// Reads a metrics JSONL file.
pub fn read_metrics_file(path: &Path) -> Result<MetricsLog, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    read_metrics(&text, path)
}

/// One panel: a title and the metrics drawn in it (those present).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panel {
    /// Caption.
    pub title: String,
    /// Metric names.
    pub metrics: Vec<String>,
}

impl Panel {
    /// A panel of `metrics`.
    pub fn new(title: impl Into<String>, metrics: &[&str]) -> Self {
        Self {
            title: title.into(),
            metrics: metrics.iter().map(|m| (*m).to_string()).collect(),
        }
    }
}

/// The figure: panels stacked vertically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlotSpec {
    /// Panels, top to bottom; panels with no data are left out.
    pub panels: Vec<Panel>,
    /// Width in pixels.
    pub width: u32,
    /// Height of one panel in pixels.
    pub panel_height: u32,
}

impl PlotSpec {
    /// Reward, KL and entropy panels under Miles' metric names.
    pub fn reward_kl_entropy() -> Self {
        Self {
            panels: vec![
                Panel::new(
                    "reward",
                    &["rollout/raw_reward", "eval/reward", "eval/raw_reward"],
                ),
                Panel::new(
                    "KL",
                    &["train/kl_loss", "train/ppo_kl", "train/train_rollout_kl"],
                ),
                Panel::new("entropy", &["train/entropy_loss"]),
            ],
            width: 800,
            panel_height: 260,
        }
    }
}

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::Plot(e.to_string())
}

/// Range of `values` with a margin, never empty.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    let span = (hi - lo).max(1e-9 * lo.abs().max(1.0));
    let pad = if hi > lo {
        0.05 * span
    } else {
        0.5 * span.max(1e-3)
    };
    (lo - pad, hi + pad)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    metrics: &MetricsLog,
    panels: &[&Panel],
) -> Result<(), Error> {
    root.fill(&WHITE).map_err(plot_error)?;
    let areas = root.split_evenly((panels.len(), 1));
    for (area, panel) in areas.iter().zip(panels) {
        let present: Vec<&String> = panel
            .metrics
            .iter()
            .filter(|m| !metrics.series(m).is_empty())
            .collect();
        let points = present.iter().flat_map(|m| metrics.series(m).iter());
        let (x0, x1) = padded_range(points.clone().map(|&(x, _)| x));
        let (y0, y1) = padded_range(points.map(|&(_, y)| y));
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(28)
            .y_label_area_size(60)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(plot_error)?;
        for (i, name) in present.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let data = metrics.series(name).to_vec();
            chart
                .draw_series(LineSeries::new(data.clone(), color.stroke_width(2)))
                .map_err(plot_error)?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            if data.len() <= 60 {
                chart
                    .draw_series(data.into_iter().map(|p| Circle::new(p, 2, color.filled())))
                    .map_err(plot_error)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
    }
    root.present().map_err(plot_error)
}

fn panels_with_data<'a>(metrics: &MetricsLog, spec: &'a PlotSpec) -> Result<Vec<&'a Panel>, Error> {
    let panels: Vec<&Panel> = spec
        .panels
        .iter()
        .filter(|p| p.metrics.iter().any(|m| !metrics.series(m).is_empty()))
        .collect();
    if panels.is_empty() {
        return Err(Error::NoMetric {
            names: spec
                .panels
                .iter()
                .flat_map(|p| p.metrics.iter().cloned())
                .collect(),
        });
    }
    Ok(panels)
}

/// The figure as SVG text.
pub fn render_svg(metrics: &MetricsLog, spec: &PlotSpec) -> Result<String, Error> {
    let panels = panels_with_data(metrics, spec)?;
    let mut svg = String::new();
    {
        let height = spec.panel_height * panels.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (spec.width, height)).into_drawing_area();
        draw(root, metrics, &panels)?;
    }
    Ok(svg)
}

/// Reads `metrics_jsonl` and writes the figure to `svg_path` (parent folders created).
pub fn plot_metrics_file(
    metrics_jsonl: &Path,
    svg_path: &Path,
    spec: &PlotSpec,
) -> Result<(), Error> {
    let metrics = read_metrics_file(metrics_jsonl)?;
    let svg = render_svg(&metrics, spec)?;
    if let Some(parent) = svg_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    std::fs::write(svg_path, svg).map_err(|e| Error::io(svg_path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::{JsonlMetricsSink, Metrics, MetricsSink};

    #[test]
    fn reads_what_the_jsonl_sink_writes_and_draws_it() {
        let dir = std::env::temp_dir().join(format!("miles-ex-plot-{}", std::process::id()));
        let path = dir.join("metrics.jsonl");
        let sink = JsonlMetricsSink::create(&path).unwrap();
        for step in 0..5u64 {
            let mut m = Metrics::new();
            m.insert("rollout/raw_reward".into(), 0.1 * step as f64);
            m.insert(
                "train/ppo_kl".into(),
                if step == 2 { f64::NAN } else { 0.01 },
            );
            m.insert("train/entropy_loss".into(), 2.0 - 0.1 * step as f64);
            sink.log(step, &m).unwrap();
        }
        drop(sink);
        let log = read_metrics_file(&path).unwrap();
        assert_eq!(log.series("rollout/raw_reward").len(), 5);
        assert_eq!(
            log.series("rollout/raw_reward")[3],
            (3.0, 0.30000000000000004)
        );
        // The NaN step was written as null and is skipped.
        assert_eq!(
            log.series("train/ppo_kl")
                .iter()
                .map(|p| p.0)
                .collect::<Vec<_>>(),
            [0.0, 1.0, 3.0, 4.0]
        );
        assert!((log.last("train/entropy_loss").unwrap() - 1.6).abs() < 1e-12);
        let svg_path = dir.join("plots/curves.svg");
        plot_metrics_file(&path, &svg_path, &PlotSpec::reward_kl_entropy()).unwrap();
        let svg = std::fs::read_to_string(&svg_path).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in [
            "reward",
            "KL",
            "entropy",
            "rollout/raw_reward",
            "train/ppo_kl",
            "step",
        ] {
            assert!(svg.contains(text), "{text} missing from the SVG");
        }
        // Three panels of 260 px.
        assert!(svg.contains("height=\"780\""), "{}", &svg[..200]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn missing_panels_are_dropped_and_no_data_is_an_error() {
        let log = read_metrics("{\"step\":0,\"rollout/raw_reward\":0.5}\n", "x").unwrap();
        let svg = render_svg(&log, &PlotSpec::reward_kl_entropy()).unwrap();
        assert!(svg.contains("height=\"260\""));
        assert!(!svg.contains(">entropy<"));
        let empty = read_metrics("{\"step\":0,\"other\":1}\n", "x").unwrap();
        assert!(matches!(
            render_svg(&empty, &PlotSpec::reward_kl_entropy()),
            Err(Error::NoMetric { .. })
        ));
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let err = read_metrics("{\"step\":0}\n\n[1]\n", "m.jsonl").unwrap_err();
        assert!(matches!(err, Error::Line { line: 3, .. }), "{err}");
        assert!(read_metrics("{\"loss\":1}\n", "m").is_err());
        assert!(read_metrics("nope\n", "m").is_err());
    }
}
