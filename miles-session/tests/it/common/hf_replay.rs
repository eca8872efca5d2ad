//! A "model" that writes the reference conversation `single_tool_string_args@miles` as Miles'
//! session server renders it (`fixtures/session/miles_tool_renders.json`: the tools dumped by
//! SGLang's protocol models, then HF transformers' `apply_chat_template` with Miles'
//! `qwen3_fixed.jinja`): the prompt it gets must be a prefix of those ids, and it answers with
//! them up to the next `<|im_end|>`.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, NamedTensors,
    PauseMode, RequestId, TokenId, WeightVersion,
};
use serde_json::{Value, json};

/// Qwen3's `<|im_end|>` (tokenizer.json).
pub const IM_END: TokenId = 151645;
/// The conversation replayed.
pub const CONVERSATION: &str = "single_tool_string_args@miles";

/// `fixtures/tokenizers` (the Qwen3 tokenizer and `hf_renders.json`).
pub fn tokenizer_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers")
}

/// `fixtures/session`.
pub fn session_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/session")
}

/// (conversation JSON, HF ids of the full conversation without a generation prompt, with the
/// tools as sent: `fixtures/tokenizers/hf_renders.json`).
pub fn hf_reference() -> (Value, Vec<TokenId>) {
    let text = std::fs::read_to_string(tokenizer_fixtures().join("hf_renders.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    let conversation = all["conversations"][CONVERSATION].clone();
    let template = all["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "qwen3_fixed")
        .unwrap();
    let case = template["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["conversation"] == CONVERSATION && c["add_generation_prompt"] == false)
        .unwrap();
    (
        conversation,
        serde_json::from_value(case["ids"].clone()).unwrap(),
    )
}

/// A case of `fixtures/session/miles_tool_renders.json` by name.
pub fn miles_render(name: &str) -> Value {
    let text = std::fs::read_to_string(session_fixtures().join("miles_tool_renders.json")).unwrap();
    let all: Value = serde_json::from_str(&text).unwrap();
    all["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no case {name}"))
        .clone()
}

/// (conversation JSON, ids of the full conversation without a generation prompt as Miles'
/// session server renders it: tools dumped by SGLang's protocol models).
pub fn miles_reference() -> (Value, Vec<TokenId>) {
    let case = miles_render(&format!("replay:{CONVERSATION}:full"));
    let conversation = json!({"messages": case["messages"], "tools": case["tools"]});
    (
        conversation,
        serde_json::from_value(case["ids"].clone()).unwrap(),
    )
}

/// The log-prob the engine reports for the `position`-th token of an answer.
pub fn logprob(position: usize) -> f64 {
    -0.125 * (position as f64 + 1.0)
}

/// The replaying engine; `seen` holds each (prompt, answer) it served.
pub struct HfReplayEngine {
    pub hf_ids: Vec<TokenId>,
    pub version: WeightVersion,
    pub seen: Mutex<Vec<(Vec<TokenId>, Vec<TokenId>)>>,
}

impl HfReplayEngine {
    /// Replays `hf_ids`, answering at weight `version`.
    pub fn new(hf_ids: Vec<TokenId>, version: WeightVersion) -> Self {
        Self {
            hf_ids,
            version,
            seen: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait]
impl InferenceEngine for HfReplayEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        let prompt = &request.input_ids;
        if !self.hf_ids.starts_with(prompt) {
            return Err(miles_core::Error::engine(
                EngineErrorKind::InvalidRequest,
                "prompt is not a prefix of HF's rendering",
            ));
        }
        let rest = &self.hf_ids[prompt.len()..];
        let end = rest.iter().position(|&id| id == IM_END).ok_or_else(|| {
            miles_core::Error::engine(EngineErrorKind::InvalidRequest, "nothing left to say")
        })?;
        let output = rest[..=end].to_vec();
        self.seen
            .lock()
            .unwrap()
            .push((prompt.clone(), output.clone()));
        Ok(GenerateOutput {
            request_id: request.request_id.clone(),
            output_log_probs: (0..output.len()).map(logprob).collect(),
            output_ids: output,
            routed_experts: None,
            finish_reason: FinishReason::Stop,
            matched_stop: Some(json!(IM_END)),
            weight_version: self.version,
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(&self, _: &NamedTensors, _: WeightVersion) -> miles_core::Result<()> {
        Ok(())
    }
    async fn update_weights_from_disk(&self, _: &Path, _: WeightVersion) -> miles_core::Result<()> {
        Ok(())
    }
    async fn pause(&self, _: PauseMode) -> miles_core::Result<()> {
        Ok(())
    }
    async fn resume(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn flush_cache(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn abort(&self, _: &RequestId) -> miles_core::Result<()> {
        Ok(())
    }
    async fn abort_all(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn health(&self) -> miles_core::Result<()> {
        Ok(())
    }
    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        Ok(self.version)
    }
}
