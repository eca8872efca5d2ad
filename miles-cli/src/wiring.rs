//! Glue between crates that must not know each other: engines and trainers built for the
//! examples, a progress-bar metrics sink, curves redrawn after each evaluation.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::{Arc, Mutex};

use indicatif::{ProgressBar, ProgressStyle};
use miles_core::{Metrics, MetricsSink, NamedTensors};

/// Redraws `curves.svg` from the run's `metrics.jsonl` after every step that evaluated
/// (a metric under `eval/`), so the curves can be opened mid-run. Put it after the JSONL
/// sink in a [`miles_core::FanoutMetricsSink`]: that sink has written and flushed the step's line by then. A plot
/// that fails is reported and the run goes on.
pub struct CurvesOnEval {
    jsonl: std::path::PathBuf,
    svg: std::path::PathBuf,
    spec: crate::plot::PlotSpec,
}

impl CurvesOnEval {
    /// Curves of reward (with the held-out `eval_key`), KL and entropy from `out/metrics.jsonl`
    /// to `out/curves.svg`.
    pub fn new(out: &Path, eval_key: &str) -> Self {
        let mut spec = crate::plot::PlotSpec::reward_kl_entropy();
        spec.panels[0].metrics.push(eval_key.to_owned());
        Self {
            jsonl: out.join("metrics.jsonl"),
            svg: out.join("curves.svg"),
            spec,
        }
    }
}

impl MetricsSink for CurvesOnEval {
    fn log(&self, _step: u64, metrics: &Metrics) -> miles_core::Result<()> {
        if metrics.keys().any(|k| k.starts_with("eval/"))
            && let Err(error) = crate::plot::plot_metrics_file(&self.jsonl, &self.svg, &self.spec)
        {
            tracing::warn!(%error, "curves.svg not updated");
        }
        Ok(())
    }
}

/// A progress bar over training steps in an interactive terminal, plain lines otherwise. Each
/// step shows the rollout reward, the held-out reward when evaluated, and the step times. Log
/// lines of [`crate::logging`] suspend the bar while they are written.
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
            // Log lines are written with the bar suspended (miles-cli's subscriber).
            crate::logging::set_progress_bar(bar.clone());
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
            crate::logging::clear_progress_bar();
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

/// Serves a session server over `engine` on 127.0.0.1 (an ephemeral port) with the TITO
/// `family` of `model_dir` and `config` (routed experts, chat-template kwargs, the message
/// matcher, limits); returns its base URL. The server runs until the process ends.
pub async fn spawn_session_server(
    engine: Arc<dyn miles_core::InferenceEngine>,
    model_dir: &Path,
    family: &str,
    config: miles_session::server::SessionServerConfig,
) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let chat = miles_tito::TitoChat::load(model_dir, family)?;
    let server = miles_session::server::SessionServer::new(engine, Arc::new(chat), config);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let app = server.router();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(url)
}

/// A TensorBoard sink in `dir` (`--tensorboard-dir`), else `$TENSORBOARD_DIR` (Miles' default),
/// else `out/tensorboard`; prints the `tensorboard --logdir` line. A resumed run adds a new
/// event file beside the old ones; TensorBoard reads both.
pub fn tensorboard_sink(
    dir: Option<&str>,
    out: &Path,
) -> Result<miles_core::tensorboard::TensorBoardSink, miles_core::Error> {
    let dir = dir
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("TENSORBOARD_DIR").map(std::path::PathBuf::from))
        .unwrap_or_else(|| out.join("tensorboard"));
    let sink = miles_core::tensorboard::TensorBoardSink::create(&dir)?;
    println!("TensorBoard: tensorboard --logdir {}", dir.display());
    Ok(sink)
}

/// A [`miles_session::sglang::Router`] over SGLang-compatible servers at `urls`: the key of
/// `MILES_API_KEY` sent to each, `num_layers` MoE layers for routed experts, and one
/// [`miles_session::sglang::WeightPublisher`] under `weights_dir` (each version written once
/// for the fleet, the two newest kept; the servers must be able to read it).
pub fn sglang_fleet(
    urls: &[String],
    weights_dir: &Path,
    num_layers: Option<usize>,
) -> Result<miles_session::sglang::Router, miles_session::Error> {
    use miles_session::sglang::{SglangConfig, SglangEngine, WeightPublisher};
    let key = miles_session::guard::ApiKey::from_env()?;
    let publisher = Arc::new(WeightPublisher::new(weights_dir).with_keep(2));
    let engines = urls
        .iter()
        .enumerate()
        .map(|(i, url)| {
            let mut config = SglangConfig::new(url.clone())
                .with_api_key(key.clone())
                .with_publisher(publisher.clone());
            config.num_layers = num_layers;
            (
                format!("engine-{i}"),
                Arc::new(SglangEngine::new(config)) as Arc<dyn miles_core::InferenceEngine>,
                None,
            )
        })
        .collect();
    Ok(miles_session::sglang::Router::new(engines))
}

/// Writes HF-named `weights` as `dir/model.safetensors` with the config, generation config,
/// tokenizer and chat-template files of `model_dir`: a directory HF transformers (and
/// `--hf-checkpoint`) loads.
pub fn save_hf_checkpoint(
    weights: &NamedTensors,
    model_dir: &Path,
    dir: &Path,
) -> Result<(), crate::error::Error> {
    std::fs::create_dir_all(dir).map_err(|e| crate::error::Error::io(dir, e))?;
    // Streamed to the file: no second in-memory image of the weights.
    weights.write_safetensors_file(&dir.join("model.safetensors"))?;
    for name in crate::sft::TOKENIZER_FILES {
        let from = model_dir.join(name);
        if from.exists() {
            std::fs::copy(&from, dir.join(name)).map_err(|e| crate::error::Error::io(&from, e))?;
        }
    }
    Ok(())
}

/// The embedded engine the examples roll out on: `model` (an inference copy), continuous
/// batching up to `max_running_requests`, the trainer's scoring function (rollout log-probs
/// equal to the trainer's when the trainer computes in the same `precision`), the tokenizer
/// of `model_dir` as detokenizer, seeded sampling.
pub fn embedded_engine(
    model: miles_bridge::CausalLm,
    model_dir: &Path,
    eos_token_ids: Vec<u32>,
    max_running_requests: usize,
    seed: u64,
    precision: miles_bridge::Precision,
) -> Result<Arc<dyn miles_core::InferenceEngine>, crate::error::Error> {
    let config = miles_engine::EngineConfig {
        max_running_requests,
        eos_token_ids,
        seed,
        precision,
        ..miles_engine::EngineConfig::default()
    };
    Ok(embedded_engine_with(model, model_dir, config)?)
}

/// [`embedded_engine`] with a whole [`miles_engine::EngineConfig`], returned as the concrete
/// engine (to read its stats or [`miles_engine::EmbeddedEngine::shutdown`] it).
pub fn embedded_engine_with(
    model: miles_bridge::CausalLm,
    model_dir: &Path,
    config: miles_engine::EngineConfig,
) -> Result<Arc<miles_engine::EmbeddedEngine>, crate::error::Error> {
    let path = model_dir.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| crate::error::Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let engine = miles_engine::EmbeddedEngine::builder(model)
        .config(config)
        .scorer(Arc::new(miles_engine::TrainerScorer::default()))
        .detokenizer(Arc::new(tokenizer))
        .build()?;
    Ok(Arc::new(engine))
}

/// Evaluates `set` on the current weights and prints `held-out reward {label}: R`, where R
/// is `eval/<set name>/raw_reward`.
pub async fn held_out_reward(
    set: miles_rollout::EvalSet,
    label: &str,
) -> Result<f64, miles_rollout::Error> {
    let key = format!("eval/{}/raw_reward", set.name);
    let metrics = set.evaluate().await?;
    let reward = metrics.get(&key).copied().unwrap_or(f64::NAN);
    println!("held-out reward {label}: {reward:.3}");
    Ok(reward)
}

/// The end of an RL example: the trainer's weights as an HF checkpoint in `out/final/` (with
/// `model_dir`'s config and tokenizer files), and `out/curves.svg` from `out/metrics.jsonl`
/// (reward with the held-out `eval_key`, KL, entropy). Returns the final weight version.
pub fn write_final_outputs(
    trainer: &miles_rollout::SharedTrainer,
    model_dir: &Path,
    out: &Path,
    eval_key: &str,
) -> Result<u64, crate::error::Error> {
    // The gradient buffers the trainer kept for a next step are not needed any more.
    miles_ops::drop_result_buffers();
    let (weights, version) = {
        let guard = trainer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (guard.export_weights()?, guard.weight_version())
    };
    save_hf_checkpoint(&weights, model_dir, &out.join("final"))?;
    let mut plot = crate::plot::PlotSpec::reward_kl_entropy();
    plot.panels[0].metrics.push(eval_key.to_owned());
    crate::plot::plot_metrics_file(&out.join("metrics.jsonl"), &out.join("curves.svg"), &plot)?;
    Ok(version.0)
}

/// The trainer's on-policy-distillation settings from the flags, with Miles' argument checks
/// (`--opd-type` required with `--use-opd`; top-k and teacher URLs only with `sglang`; no OPD
/// flag without `--use-opd`).
pub(crate) fn opd_config(a: &crate::args::OpdArgs) -> Result<miles_train::OpdConfig, String> {
    let opd_type = match (a.use_opd, a.opd_type.as_deref()) {
        (true, None) => {
            return Err(
                "--opd-type must be specified when --use-opd is enabled. Choose \
                        'sglang' or 'megatron'."
                    .into(),
            );
        }
        (_, Some(t)) => t
            .parse::<miles_train::OpdType>()
            .map_err(|e| format!("--opd-type: {e}"))?,
        (false, None) => miles_train::OpdType::Sglang,
    };
    if a.use_opd && a.opd_log_prob_top_k > 0 && opd_type != miles_train::OpdType::Sglang {
        return Err(
            "--opd-log-prob-top-k is currently supported only with --opd-type=sglang.".into(),
        );
    }
    if !a.opd_teacher_urls.is_empty() {
        if !a.use_opd {
            return Err(
                "--opd-teacher-urls is set but --use-opd is not enabled. Please add \
                        --use-opd flag."
                    .into(),
            );
        }
        if opd_type != miles_train::OpdType::Sglang {
            return Err("--opd-teacher-urls is only supported with --opd-type=sglang.".into());
        }
        miles_rollout::opd::parse_teacher_urls(&a.opd_teacher_urls).map_err(|e| e.to_string())?;
    }
    let config = miles_train::OpdConfig {
        use_opd: a.use_opd,
        opd_type,
        opd_kl_coef: a.opd_kl_coef,
        opd_teacher_load: a.opd_teacher_load.as_deref().map(Into::into),
    };
    config.validate().map_err(|e| e.to_string())?;
    Ok(config)
}

/// The rollout's teacher scorer with `--use-opd --opd-type sglang` (teacher at `--rm-url` or
/// routed by `--opd-teacher-urls`; the student scored at the first `--engine-url` for the
/// strategies that need it); `None` otherwise.
pub(crate) fn opd_teacher(
    a: &crate::args::TrainArgs,
) -> Result<Option<Arc<miles_rollout::opd::OpdTeacher>>, String> {
    use miles_rollout::opd::{OpdTeacher, OpdTeacherConfig};
    let o = &a.opd;
    if !o.use_opd || o.opd_type.as_deref() != Some("sglang") {
        return Ok(None);
    }
    let config = OpdTeacherConfig {
        top_k: o.opd_log_prob_top_k,
        strategy: o.opd_top_k_strategy.parse().map_err(|e| format!("{e}"))?,
        weight_mode: o
            .opd_reward_weight_mode
            .parse()
            .map_err(|e| format!("{e}"))?,
        teacher_urls: miles_rollout::opd::parse_teacher_urls(&o.opd_teacher_urls)
            .map_err(|e| e.to_string())?,
        teacher_key: o.opd_teacher_key.clone(),
        rm_url: a.reward.rm_url.clone(),
        student_url: a
            .rollout
            .engine_url
            .first()
            .map(|u| format!("{}/generate", u.trim_end_matches('/'))),
        per_position: o.opd_topk_per_position,
        ..OpdTeacherConfig::default()
    };
    if config.teacher_urls.is_empty() && config.rm_url.is_none() {
        return Err(
            "--use-opd --opd-type sglang needs the teacher's /generate URL: --rm-url or \
                    --opd-teacher-urls"
                .into(),
        );
    }
    Ok(Some(Arc::new(OpdTeacher::new(config))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::JsonlMetricsSink;

    #[test]
    fn curves_are_redrawn_after_each_evaluating_step_only() {
        let out = std::env::temp_dir().join(format!("miles-ex-curves-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let sink = miles_core::FanoutMetricsSink::new(vec![
            Arc::new(JsonlMetricsSink::create(out.join("metrics.jsonl")).unwrap()),
            Arc::new(CurvesOnEval::new(&out, "eval/x/raw_reward")),
        ]);
        let svg = out.join("curves.svg");
        let step = |i: u64, eval: bool| {
            let mut m = Metrics::new();
            m.insert("rollout/raw_reward".into(), 0.1 * i as f64);
            if eval {
                m.insert("eval/x/raw_reward".into(), 0.2 * i as f64);
            }
            sink.log(i, &m).unwrap();
        };
        step(0, false);
        step(1, false);
        assert!(!svg.exists(), "no evaluation yet");
        step(2, true);
        let first = std::fs::read_to_string(&svg).unwrap();
        assert!(
            first.starts_with("<svg"),
            "{}",
            &first[..first.len().min(80)]
        );
        step(3, false);
        assert_eq!(std::fs::read_to_string(&svg).unwrap(), first, "not redrawn");
        step(4, true);
        assert_ne!(
            std::fs::read_to_string(&svg).unwrap(),
            first,
            "redrawn with step 4"
        );
        std::fs::remove_dir_all(&out).ok();
    }
}
