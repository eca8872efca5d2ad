//! Glue between crates that must not know each other: the trainer's scoring function as the
//! embedded engine's [`SequenceScorer`], a progress-bar metrics sink, and a fan-out sink.

use std::io::IsTerminal;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use miles_bridge::CausalLm;
use miles_core::{Metrics, MetricsSink};
use miles_ops::fused::FusedLogProbConfig;
use miles_r3::Fallthrough;
use miles_rollout::SequenceScorer;

/// miles-train's batch-invariant scoring ([`miles_train::score_log_probs`]) as the engine's
/// `recompute_logprobs_via_prefill` scorer: rollout log-probs then equal the trainer's
/// `per_sample` log-probs bit for bit (`train/train_rollout_logprob_abs_diff` = 0).
#[derive(Debug, Clone, Default)]
pub struct TrainerScorer {
    /// The fused log-prob settings the trainer uses.
    pub fused: FusedLogProbConfig,
}

impl SequenceScorer for TrainerScorer {
    fn score(
        &self,
        model: &CausalLm,
        tokens: &[u32],
        response_length: usize,
    ) -> Result<Vec<f32>, String> {
        miles_train::score_log_probs(model, tokens, response_length, &Fallthrough, &self.fused)
            .map_err(|e| e.to_string())
    }
}

/// Sends every step's metrics to several sinks.
pub struct FanOut(pub Vec<Box<dyn MetricsSink>>);

impl MetricsSink for FanOut {
    fn log(&self, step: u64, metrics: &Metrics) -> miles_core::Result<()> {
        for sink in &self.0 {
            sink.log(step, metrics)?;
        }
        Ok(())
    }

    fn flush(&self) -> miles_core::Result<()> {
        for sink in &self.0 {
            sink.flush()?;
        }
        Ok(())
    }
}

/// A progress bar over training steps in an interactive terminal, plain lines otherwise. Each
/// step shows the rollout reward, the held-out reward when evaluated, and the step times.
pub struct ProgressSink {
    bar: Option<ProgressBar>,
    total: u64,
    last_eval: Mutex<Option<f64>>,
    eval_key: String,
}

impl ProgressSink {
    /// A sink for `total` steps; `eval_key` is the held-out reward metric to show.
    pub fn new(total: u64, eval_key: impl Into<String>) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] {pos}/{len} steps  {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar
        });
        Self {
            bar,
            total,
            last_eval: Mutex::new(None),
            eval_key: eval_key.into(),
        }
    }

    /// Ends the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

impl MetricsSink for ProgressSink {
    fn log(&self, step: u64, metrics: &Metrics) -> miles_core::Result<()> {
        let mut eval = self.last_eval.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&v) = metrics.get(&self.eval_key) {
            *eval = Some(v);
        }
        let Some(&reward) = metrics.get("rollout/raw_reward") else {
            if let (None, Some(v)) = (&self.bar, metrics.get(&self.eval_key)) {
                println!("step {step:>4}: held-out reward {v:.3}");
            }
            return Ok(());
        };
        let get = |k: &str| metrics.get(k).copied().unwrap_or(f64::NAN);
        let msg = format!(
            "reward {reward:.3}  held-out {}  kl {:+.1e}  rollout (wait) {:.1}s  train {:.1}s",
            eval.map_or("-".to_string(), |v| format!("{v:.3}")),
            get("train/ppo_kl"),
            metrics
                .get("perf/rollout_time")
                .or_else(|| metrics.get("perf/rollout_wait_time"))
                .copied()
                .unwrap_or(f64::NAN),
            get("perf/train_time"),
        );
        match &self.bar {
            Some(bar) => {
                bar.set_position((step + 1).min(self.total));
                bar.set_message(msg);
            }
            None => println!("step {:>4}/{}: {msg}", step + 1, self.total),
        }
        Ok(())
    }
}
