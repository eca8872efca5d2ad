//! The token-level multi-turn tool loop (Miles' `multi_turn.py`, Miles' `multi_turn.py`) as a
//! [`SampleGenerator`]: no session server, the engine is called with token ids.
//!
//! The prompt is rendered with the tools; then, for at most `max_turns` turns: generate (the
//! budget is what is left of `max_new_tokens` over the whole response), append the output ids
//! with loss mask 1 and their log-probs, stop on `abort` / `length`, parse the tool calls with
//! the family's parser, stop when there are none, run each call with the user's
//! [`ToolExecutor`] (`execute_one(name, params)`), and append the tool messages' ids —
//! tokenized incrementally with TITO (the family's boundary rule applied to the stored
//! prefix, never a re-tokenization of what the model produced) — with loss mask 0 and
//! log-prob 0. The result is one sample holding every turn.

use std::sync::Arc;

use miles_core::{
    GenerateRequest, InferenceEngine, Message, Prompt, Role, Sample, SampleStatus, SamplingParams,
    ToolSpec, async_trait, output_text,
};
use miles_tito::ChatTokenizer;
use serde_json::{Map, Value};

use crate::manager::{SampleGenerator, apply_output};

/// Runs one tool call (Miles' `execute_one(name, params) -> str`). An `Err` is sent back to
/// the model as the tool's output (`error: …`), as a failing tool would answer.
#[async_trait]
pub trait ToolExecutor: Send + Sync {
    /// Executes `name` with `params` (the call's arguments; `{}` when they are not an object).
    async fn execute_one(&self, name: &str, params: &Map<String, Value>) -> Result<String, String>;
}

/// The multi-turn tool loop over one engine.
pub struct MultiTurnGenerator {
    engine: Arc<dyn InferenceEngine>,
    chat: Arc<dyn ChatTokenizer>,
    executor: Arc<dyn ToolExecutor>,
    tools: Vec<ToolSpec>,
    max_turns: usize,
    kwargs: Map<String, Value>,
    return_routed_experts: bool,
}

impl MultiTurnGenerator {
    /// A loop over `engine`, rendering and parsing with `chat` (a miles-tito family through
    /// miles-session's adapter), offering `tools` and running them with `executor`; Miles'
    /// default of 16 turns.
    pub fn new(
        engine: Arc<dyn InferenceEngine>,
        chat: Arc<dyn ChatTokenizer>,
        tools: Vec<ToolSpec>,
        executor: Arc<dyn ToolExecutor>,
    ) -> Self {
        Self {
            engine,
            chat,
            executor,
            tools,
            max_turns: 16,
            kwargs: Map::new(),
            return_routed_experts: false,
        }
    }

    /// Most model turns (`--generate-max-turns`).
    pub fn with_max_turns(mut self, max_turns: usize) -> Self {
        self.max_turns = max_turns;
        self
    }

    /// Chat-template kwargs (merged over the family's forced ones; a conflict is an error).
    pub fn with_kwargs(mut self, kwargs: Map<String, Value>) -> Self {
        self.kwargs = kwargs;
        self
    }

    /// Ask the engine for routed experts (R3).
    pub fn with_routed_experts(mut self, on: bool) -> Self {
        self.return_routed_experts = on;
        self
    }

    /// Runs the turns; `matched` ends as the stop that ended the last model turn (`None` when
    /// the sample ends on tool messages), for the response text.
    async fn run(
        &self,
        sample: &mut Sample,
        sampling: &SamplingParams,
        matched: &mut Option<Value>,
    ) -> Result<(), String> {
        let kwargs = self
            .chat
            .resolve_kwargs(&self.kwargs)
            .map_err(|e| e.to_string())?;
        let mut messages: Vec<Message> = match &sample.prompt {
            Prompt::Messages(m) => m.clone(),
            Prompt::Text(t) => vec![Message::new(Role::User, t.clone())],
        };
        sample.tokens = self
            .chat
            .render(&messages, &self.tools, true, &kwargs)
            .map_err(|e| format!("rendering the prompt: {e}"))?;
        sample.response_length = 0;
        sample.loss_mask = Some(Vec::new());
        sample.rollout_log_probs = Some(Vec::new());
        let total = sampling.max_new_tokens.unwrap_or(usize::MAX);
        for turn in 0..self.max_turns {
            let budget = total.saturating_sub(sample.response_length);
            if budget == 0 {
                sample.status = SampleStatus::Truncated;
                return Ok(());
            }
            let mut params = sampling.clone();
            params.max_new_tokens = Some(budget);
            if let Some(seed) = params.sampling_seed {
                params.sampling_seed = Some(seed.wrapping_add(turn as u64 * 0x9E37));
            }
            // The family's end-of-turn ids end a turn (as the session server sends them).
            for id in self.chat.stop_token_ids() {
                if !params.stop_token_ids.contains(&id) {
                    params.stop_token_ids.push(id);
                }
            }
            let mut request = GenerateRequest::new(sample.tokens.clone(), params);
            request.routing_key = sample.routing_key.clone();
            request.return_routed_experts = self.return_routed_experts;
            let output = match self.engine.generate(request).await {
                Ok(o) => o,
                Err(e) => {
                    sample.status = SampleStatus::Aborted;
                    sample
                        .metadata
                        .insert("engine_error".into(), Value::from(e.to_string()));
                    return Ok(());
                }
            };
            let generated = output.output_ids.clone();
            matched.clone_from(&output.matched_stop);
            apply_output(sample, output).map_err(|e| e.to_string())?;
            if sample.status != SampleStatus::Completed {
                // Aborted or cut at the token limit: the loop ends here.
                return Ok(());
            }
            let parsed = self
                .chat
                .parse_assistant(&generated, &self.tools)
                .map_err(|e| format!("parsing turn {turn}: {e}"))?;
            if parsed.tool_calls.is_empty() {
                return Ok(());
            }
            *matched = None;
            let old = messages.clone();
            messages.push(parsed.to_message());
            for (i, call) in parsed.tool_calls.iter().enumerate() {
                let params = call.function.arguments.to_object().unwrap_or_default();
                let content = match self
                    .executor
                    .execute_one(&call.function.name, &params)
                    .await
                {
                    Ok(text) => text,
                    Err(e) => format!("error: {e}"),
                };
                let mut tool = Message::new(Role::Tool, content);
                tool.tool_call_id = Some(call.id.clone().unwrap_or_else(|| format!("call_{i}")));
                tool.name = Some(call.function.name.clone());
                messages.push(tool);
            }
            // The tool messages (and the next generation prompt), TITO-tokenized after the
            // stored ids with the family's boundary rule.
            let merged = self
                .chat
                .merge_tokens(&old, &messages, &sample.tokens, &self.tools, &kwargs)
                .map_err(|e| format!("tokenizing the tool messages: {e}"))?;
            let keep = sample
                .tokens
                .iter()
                .zip(&merged)
                .take_while(|(a, b)| a == b)
                .count();
            let trimmed = sample.tokens.len() - keep;
            if trimmed > self.chat.max_trim_tokens().min(generated.len()) {
                return Err(format!(
                    "the boundary rule rewrote {trimmed} stored ids (at most {} allowed)",
                    self.chat.max_trim_tokens()
                ));
            }
            let chat = self.chat.clone();
            sample
                .strip_last_output_tokens(trimmed, &|ids| chat.decode(ids))
                .map_err(|e| e.to_string())?;
            let appended = &merged[keep..];
            sample
                .append_response(appended, Some(&vec![0.0; appended.len()]), 0)
                .map_err(|e| e.to_string())?;
        }
        // Out of turns right after tool outputs: the sample ends on the tool messages, which
        // have no routed experts (the last routes cover up to the last model output only).
        sample.rollout_routed_experts = None;
        sample.status = SampleStatus::Completed;
        Ok(())
    }
}

#[async_trait]
impl SampleGenerator for MultiTurnGenerator {
    async fn generate(&self, mut sample: Sample, sampling: SamplingParams) -> Sample {
        let mut matched = None;
        if let Err(reason) = self.run(&mut sample, &sampling, &mut matched).await {
            sample.status = SampleStatus::Failed;
            sample
                .metadata
                .insert("failure".into(), Value::from(reason));
        }
        // SGLang's text: special tokens skipped, the final stop trimmed (unless asked).
        sample.response = output_text(
            sample.response_tokens(),
            matched.as_ref(),
            &sampling,
            |ids, skip| self.chat.decode_text(ids, skip),
        );
        sample
    }
}
