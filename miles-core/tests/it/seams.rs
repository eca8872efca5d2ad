//! The seams are object-safe and usable as `Arc<dyn …>` / `Box<dyn …>`: a small counting
//! engine, an exact-match reward and a one-parameter trainer drive one rollout → reward →
//! train → weight-update cycle through trait objects only.

use std::future::Future;
use std::path::Path;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use miles_core::{
    DType, EngineErrorKind, Error, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine,
    Metrics, NamedTensors, PauseMode, PolicyTrainer, Prompt, RequestId, Result, Reward, RewardFn,
    Sample, SampleStatus, SamplingParams, TensorBytes, WeightVersion, async_trait,
};

/// Polls a future that never waits on I/O to completion.
fn block_on<F: Future>(future: F) -> F::Output {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(v) = future.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// Emits `last + step` repeatedly, where `step` is its single weight; stops at token 0 (mod 10).
struct CountingEngine {
    state: Mutex<(i64, WeightVersion, bool)>,
}

#[async_trait]
impl InferenceEngine for CountingEngine {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput> {
        let (step, version, paused) = *self.state.lock().unwrap();
        if paused {
            return Err(Error::engine(EngineErrorKind::Aborted, "paused"));
        }
        let Some(&last) = request.input_ids.last() else {
            return Err(Error::engine(
                EngineErrorKind::InvalidRequest,
                "empty input",
            ));
        };
        let max = request.sampling_params.max_new_tokens.unwrap_or(8);
        let mut out = Vec::new();
        let mut token = i64::from(last);
        let mut finish = FinishReason::Length;
        while out.len() < max {
            token = (token + step).rem_euclid(10);
            out.push(token as u32);
            if token == 0 {
                finish = FinishReason::Stop;
                break;
            }
        }
        Ok(GenerateOutput {
            request_id: request.request_id,
            output_log_probs: vec![0.0; out.len()],
            output_ids: out,
            routed_experts: None,
            finish_reason: finish,
            matched_stop: None,
            weight_version: version,
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(&self, weights: &NamedTensors, version: WeightVersion) -> Result<()> {
        let step = weights
            .get("step")
            .ok_or_else(|| Error::engine(EngineErrorKind::WeightUpdate, "missing tensor step"))?
            .to_f32()?[0];
        let mut state = self.state.lock().unwrap();
        if version < state.1 {
            return Err(Error::engine(
                EngineErrorKind::WeightUpdate,
                "version went backwards",
            ));
        }
        *state = (step as i64, version, state.2);
        Ok(())
    }

    async fn update_weights_from_disk(&self, dir: &Path, version: WeightVersion) -> Result<()> {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| Error::io(path, e))?;
        self.update_weights(&NamedTensors::from_safetensors_bytes(&bytes)?, version)
            .await
    }

    async fn pause(&self, _mode: PauseMode) -> Result<()> {
        self.state.lock().unwrap().2 = true;
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        self.state.lock().unwrap().2 = false;
        Ok(())
    }

    async fn flush_cache(&self) -> Result<()> {
        Ok(())
    }

    async fn abort(&self, _request_id: &RequestId) -> Result<()> {
        Ok(())
    }

    async fn abort_all(&self) -> Result<()> {
        Ok(())
    }

    async fn health(&self) -> Result<()> {
        Ok(())
    }

    async fn weight_version(&self) -> Result<WeightVersion> {
        Ok(self.state.lock().unwrap().1)
    }
}

/// Reward 1 when the response ends with the label's token, else 0.
struct EndsWith;

#[async_trait]
impl RewardFn for EndsWith {
    async fn reward(&self, sample: &Sample) -> Result<Reward> {
        let label: u32 = sample
            .label
            .as_deref()
            .ok_or_else(|| Error::Reward("no label".into()))?
            .parse()
            .map_err(|_| Error::Reward("label is not a token id".into()))?;
        Ok(Reward::Scalar(f64::from(u8::from(
            sample.response_tokens().last() == Some(&label),
        ))))
    }
}

/// Sets its step to 1 when the mean reward is below 1, counting versions.
struct StepTrainer {
    step: f32,
    version: WeightVersion,
}

impl PolicyTrainer for StepTrainer {
    fn train(&mut self, _rollout_id: u64, samples: &[Sample]) -> Result<Metrics> {
        let rewards: Vec<f64> = samples
            .iter()
            .map(|s| {
                s.reward
                    .as_ref()
                    .and_then(|r| r.scalar(None))
                    .unwrap_or(0.0)
            })
            .collect();
        let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
        if mean < 1.0 {
            self.step = 1.0;
        }
        self.version = self.version.next();
        Ok(Metrics::from([("rollout/raw_reward".to_string(), mean)]))
    }

    fn export_weights(&self) -> Result<NamedTensors> {
        let mut t = NamedTensors::new();
        t.insert("step", TensorBytes::from_f32(vec![1], &[self.step])?);
        Ok(t)
    }

    fn weight_version(&self) -> WeightVersion {
        self.version
    }

    fn save_checkpoint(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let path = dir.join("model.safetensors");
        std::fs::write(&path, self.export_weights()?.to_safetensors_bytes())
            .map_err(|e| Error::io(path, e))
    }

    fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).map_err(|e| Error::io(path, e))?;
        self.step = NamedTensors::from_safetensors_bytes(&bytes)?
            .get("step")
            .ok_or_else(|| Error::Trainer("checkpoint lacks step".into()))?
            .to_f32()?[0];
        Ok(())
    }
}

fn rollout(engine: &Arc<dyn InferenceEngine>, reward: &Arc<dyn RewardFn>) -> Vec<Sample> {
    let prompts = [(vec![3u32, 7], "0")];
    let mut samples = Vec::new();
    for (i, (ids, label)) in prompts.iter().enumerate() {
        let params = SamplingParams {
            max_new_tokens: Some(4),
            ..SamplingParams::default()
        };
        let out = block_on(engine.generate(GenerateRequest::new(ids.clone(), params))).unwrap();
        let mut sample = Sample::builder(Prompt::Text(String::new()))
            .tokens(ids.clone(), 0)
            .ids(i as u64, i as u64)
            .label(*label)
            .build()
            .unwrap();
        sample
            .append_response(&out.output_ids, Some(&out.output_log_probs), 1)
            .unwrap();
        sample.weight_versions.push(out.weight_version.to_string());
        sample.status = match out.finish_reason {
            FinishReason::Stop => SampleStatus::Completed,
            FinishReason::Length => SampleStatus::Truncated,
            FinishReason::Abort => SampleStatus::Aborted,
        };
        sample.reward = Some(block_on(reward.reward(&sample)).unwrap());
        sample.validate().unwrap();
        samples.push(sample);
    }
    samples
}

#[test]
fn one_rl_cycle_through_trait_objects() {
    let engine: Arc<dyn InferenceEngine> = Arc::new(CountingEngine {
        state: Mutex::new((0, WeightVersion(0), false)),
    });
    let reward: Arc<dyn RewardFn> = Arc::new(EndsWith);
    let mut trainer: Box<dyn PolicyTrainer> = Box::new(StepTrainer {
        step: 0.0,
        version: WeightVersion(0),
    });

    // Step 0 repeats the last token: 7 7 7 7, truncated, reward 0.
    let first = rollout(&engine, &reward);
    assert_eq!(first[0].response_tokens(), &[7, 7, 7, 7]);
    assert_eq!(first[0].status, SampleStatus::Truncated);
    assert_eq!(first[0].reward, Some(Reward::Scalar(0.0)));

    let metrics = trainer.train(0, &first).unwrap();
    assert_eq!(metrics["rollout/raw_reward"], 0.0);
    let weights = trainer.export_weights().unwrap();
    assert_eq!(weights.get("step").unwrap().dtype(), DType::F32);
    block_on(engine.pause(PauseMode::Abort)).unwrap();
    assert!(
        block_on(engine.generate(GenerateRequest::new(vec![1], SamplingParams::default())))
            .is_err()
    );
    block_on(engine.update_weights(&weights, trainer.weight_version())).unwrap();
    block_on(engine.resume()).unwrap();

    // Step 1 counts up: 8 9 0, stopped at 0, reward 1, stamped with version 1.
    let second = rollout(&engine, &reward);
    assert_eq!(second[0].response_tokens(), &[8, 9, 0]);
    assert_eq!(second[0].status, SampleStatus::Completed);
    assert_eq!(second[0].reward, Some(Reward::Scalar(1.0)));
    assert_eq!(second[0].oldest_weight_version(), Some(WeightVersion(1)));
    assert!(block_on(engine.update_weights(&weights, WeightVersion(0))).is_err());

    // Checkpoint round trip through the disk path of the engine seam.
    let dir = std::env::temp_dir().join(format!("miles-core-seams-{}", std::process::id()));
    trainer.save_checkpoint(&dir).unwrap();
    block_on(engine.update_weights_from_disk(&dir, WeightVersion(2))).unwrap();
    assert_eq!(block_on(engine.weight_version()).unwrap(), WeightVersion(2));
    trainer.load_checkpoint(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let missing = block_on(engine.update_weights_from_disk(&dir, WeightVersion(3)));
    assert!(matches!(missing, Err(Error::Io { .. })));
}
