//! The response text every reward reads (issue 45, point 5): a model that stops on its EOS
//! (`<|im_end|>` of the tiny Qwen3 chat checkpoint's tokenizer) gives a sample whose response
//! is the answer without the stop token — as SGLang's `/generate` text is — while its tokens,
//! log-probs and loss mask keep it; so each rule that reads the text scores a correct answer 1.

use std::path::Path;
use std::sync::Arc;

use miles_core::{
    FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, NamedTensors, PauseMode,
    RequestId, Result as CoreResult, RewardFn, SampleStatus, SamplingParams, TokenId,
    WeightVersion, async_trait,
};
use miles_reward::{BuiltinReward, RmHubReward, RmType};
use miles_rollout::{ChatPromptEncoder, DataSource, PromptRecord, RolloutConfig, RolloutManager};
use serde_json::json;

/// Answers every prompt with the ids of `reply` and the EOS, as a model that stops cleanly.
struct StopsOnEos {
    reply: Vec<TokenId>,
    eos: TokenId,
}

#[async_trait]
impl InferenceEngine for StopsOnEos {
    async fn generate(&self, request: GenerateRequest) -> CoreResult<GenerateOutput> {
        let mut ids = self.reply.clone();
        ids.push(self.eos);
        Ok(GenerateOutput {
            request_id: request.request_id,
            output_log_probs: (0..ids.len()).map(|i| -0.1 * i as f64).collect(),
            output_ids: ids,
            routed_experts: None,
            finish_reason: FinishReason::Stop,
            matched_stop: Some(json!(self.eos)),
            weight_version: WeightVersion(1),
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }
    async fn update_weights(&self, _: &NamedTensors, _: WeightVersion) -> CoreResult<()> {
        Ok(())
    }
    async fn update_weights_from_disk(&self, _: &Path, _: WeightVersion) -> CoreResult<()> {
        Ok(())
    }
    async fn pause(&self, _: PauseMode) -> CoreResult<()> {
        Ok(())
    }
    async fn resume(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn flush_cache(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn abort(&self, _: &RequestId) -> CoreResult<()> {
        Ok(())
    }
    async fn abort_all(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn health(&self) -> CoreResult<()> {
        Ok(())
    }
    async fn weight_version(&self) -> CoreResult<WeightVersion> {
        Ok(WeightVersion(1))
    }
}

fn encoder() -> ChatPromptEncoder {
    ChatPromptEncoder::load(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/serve/qwen3-tiny-chat"),
    )
    .unwrap()
}

/// The one sample of a rollout whose model answers `reply`, and the EOS id.
async fn rollout(reply: &str, label: &str, sampling: SamplingParams) -> (miles_core::Sample, u32) {
    let encoder = encoder();
    let eos = encoder.chat().encode("<|im_end|>").unwrap()[0];
    let engine = Arc::new(StopsOnEos {
        reply: encoder.chat().encode(reply).unwrap(),
        eos,
    });
    let config = RolloutConfig {
        sampling,
        ..RolloutConfig::default()
    };
    let manager = RolloutManager::new(
        config,
        engine,
        Arc::new(encoder),
        Arc::new(BuiltinReward::ExactMatch),
    )
    .unwrap();
    let mut data = DataSource::new(vec![PromptRecord::text("q", label)], 1, false, 0).unwrap();
    let batch = manager.generate_rollout(0, &mut data).await.unwrap();
    (batch.samples().remove(0), eos)
}

#[tokio::test]
async fn the_response_leaves_out_the_matched_eos_and_the_tokens_keep_it() {
    let (s, eos) = rollout("135", "135", SamplingParams::default()).await;
    assert_eq!(s.status, SampleStatus::Completed);
    assert_eq!(s.response, "135");
    assert_eq!(s.tokens.last(), Some(&eos));
    let n = s.response_length;
    assert_eq!(s.loss_mask.as_deref(), Some(&vec![1; n][..]));
    assert_eq!(s.rollout_log_probs.as_ref().unwrap().len(), n);
    assert_eq!(s.scalar_reward(None), Some(1.0), "exact_match rewards it");
    // Asked for, as SGLang does: the stop token stays in the text.
    let keep = SamplingParams {
        skip_special_tokens: false,
        no_stop_trim: true,
        ..SamplingParams::default()
    };
    let (kept, _) = rollout("135", "135", keep).await;
    assert_eq!(kept.response, "135<|im_end|>");
    assert_eq!(kept.tokens, s.tokens);
    assert_eq!(kept.scalar_reward(None), Some(0.0));
}

#[tokio::test]
async fn every_rule_that_reads_the_text_rewards_a_correct_answer_that_stops_cleanly() {
    // (rule, the model's answer, the label): each scores 1 on the answer as SGLang's text
    // gives it.
    let hub = |name: &str| -> Arc<dyn RewardFn> {
        Arc::new(RmHubReward::new(Some(RmType::from_rm_type(name).unwrap())))
    };
    // (rule, the model's answer, the label, the reward key of a dict reward).
    type Case = (
        Arc<dyn RewardFn>,
        &'static str,
        &'static str,
        Option<&'static str>,
    );
    let cases: [Case; 7] = [
        (Arc::new(BuiltinReward::ExactMatch), "135", "135", None),
        (
            Arc::new(BuiltinReward::NumericMatch { tolerance: 0.0 }),
            "135",
            "135",
            None,
        ),
        (hub("f1"), "the answer is 135", "the answer is 135", None),
        (hub("dapo"), "2 + 133\nAnswer: 135", "135", Some("score")),
        (hub("math"), "so \\boxed{135}", "135", None),
        (hub("boxed_f1"), "so \\boxed{135}", "135", None),
        (hub("deepscaler"), "think</think> \\boxed{135}", "135", None),
    ];
    for (i, (rule, answer, label, key)) in cases.into_iter().enumerate() {
        let (mut s, _) = rollout(answer, label, SamplingParams::default()).await;
        assert_eq!(s.response, answer);
        s.reward = None;
        let reward = rule.reward(&s).await.unwrap();
        assert_eq!(reward.scalar(key), Some(1.0), "case {i}: {answer:?}");
    }
}
