//! Small but real implementations of the two seams, for tests, benchmarks and trying the
//! binary without a model: [`ByteChatml`] (miles-tito's byte-level ChatML tokenizer, ids 0–255
//! bytes and 256–263 the specials, re-exported here), and
//! [`ToyEngine`], a deterministic engine that reads the prompt ids and answers with token ids
//! and log-probs computed from them (a weather tool call for "weather in X", a sentence using a
//! tool response, an echo otherwise), with [`WeatherAgent`], a user agent that drives it
//! through a session server, and its [`weather_tool`].

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::Error;
use miles_core::{
    EngineErrorKind, FinishReason, GenerateOutput, GenerateRequest, InferenceEngine, NamedTensors,
    PauseMode, RequestId, RoutedExperts, TokenId, ToolSpec, WeightVersion, async_trait,
};
use miles_tito::ChatTokenizer;
pub use miles_tito::testkit::{ByteChatml, IM_END, IM_START, SPECIALS};
use serde_json::{Map, Value, json};

/// The log-prob the toy engine gives token `id` at output position `pos` (exact in binary).
pub fn toy_logprob(id: TokenId, pos: usize) -> f64 {
    -(((id as u64 * 31 + pos as u64) % 17) as f64 + 1.0) / 8.0
}

/// The expert id the toy engine routes row `row`, layer `layer`, slot `k` to.
pub fn toy_expert(row: usize, layer: usize, k: usize) -> i32 {
    ((row * 3 + layer * 5 + k) % 8) as i32
}

/// A deterministic engine speaking token ids: it decodes the prompt, looks at the last block and
/// answers (tool call for "weather in X", a sentence using a tool response, else an echo).
pub struct ToyEngine {
    /// The tokenizer it reads prompts and writes answers with.
    pub tok: ByteChatml,
    /// Current weight version (7 at start).
    pub version: AtomicU64,
    /// Optional delay before answering.
    pub delay: Mutex<Option<Duration>>,
    /// Number of generate calls.
    pub calls: AtomicUsize,
    /// The last request seen.
    pub last_request: Mutex<Option<GenerateRequest>>,
}

impl ToyEngine {
    /// A new engine behind an `Arc`.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            tok: ByteChatml::default(),
            version: AtomicU64::new(7),
            delay: Mutex::new(None),
            calls: AtomicUsize::new(0),
            last_request: Mutex::new(None),
        })
    }

    /// The reply text for a prompt (public so tests can state expectations).
    pub fn reply_for(prompt: &str) -> Result<String, miles_core::Error> {
        let body = prompt
            .strip_suffix("<|im_start|>assistant\n")
            .ok_or_else(|| {
                miles_core::Error::engine(EngineErrorKind::InvalidRequest, "no generation prompt")
            })?;
        let last = body.rsplit("<|im_start|>").next().unwrap_or("");
        let content = last.split_once('\n').map(|(_, c)| c).unwrap_or("");
        let content = content.strip_suffix("<|im_end|>\n").unwrap_or(content);
        if content.contains("FAIL") {
            return Err(miles_core::Error::engine(
                EngineErrorKind::Internal,
                "scripted failure",
            ));
        }
        if let Some((_, resp)) = content.split_once("<tool_response>\n") {
            let resp = resp.split("\n</tool_response>").next().unwrap_or("");
            return Ok(format!(
                "<think>\nThe tool answered.\n</think>\n\nThe weather is {resp}.<|im_end|>"
            ));
        }
        if let Some((_, place)) = content.split_once("weather in ") {
            let city: String = place.chars().take_while(|c| c.is_alphabetic()).collect();
            return Ok(format!(
                "<think>\nI should call the weather tool.\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
                json!({"name": "get_weather", "arguments": {"city": city}})
            ));
        }
        Ok(format!(
            "<think>\nEchoing.\n</think>\n\nYou said: {content}<|im_end|>"
        ))
    }
}

#[async_trait]
impl InferenceEngine for ToyEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        *self
            .last_request
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(request.clone());
        let delay = *self
            .delay
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let prompt = self.tok.decode(&request.input_ids);
        let reply = Self::reply_for(&prompt)?;
        let mut ids = self.tok.encode(&reply);
        let mut finish = FinishReason::Stop;
        let mut matched = Some(json!(IM_END));
        if let Some(max) = request.sampling_params.max_new_tokens
            && ids.len() > max
        {
            ids.truncate(max);
            finish = FinishReason::Length;
            matched = None;
        }
        let mut log_probs: Vec<f64> = ids
            .iter()
            .enumerate()
            .map(|(p, id)| toy_logprob(*id, p))
            .collect();
        if prompt.contains("GARBAGE") {
            log_probs.pop();
        }
        let routed_experts = if request.return_routed_experts {
            let rows = request.input_ids.len() + ids.len() - 1;
            let mut data = Vec::with_capacity(rows * 4);
            for row in 0..rows {
                for layer in 0..2 {
                    for k in 0..2 {
                        data.push(toy_expert(row, layer, k));
                    }
                }
            }
            Some(RoutedExperts::new(rows, 2, 2, data)?)
        } else {
            None
        };
        Ok(GenerateOutput {
            request_id: request.request_id.clone(),
            output_ids: ids,
            output_log_probs: log_probs,
            routed_experts,
            finish_reason: finish,
            matched_stop: matched,
            weight_version: WeightVersion(self.version.load(Ordering::SeqCst)),
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(
        &self,
        _weights: &NamedTensors,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        self.version.store(version.0, Ordering::SeqCst);
        Ok(())
    }

    async fn update_weights_from_disk(
        &self,
        _dir: &Path,
        version: WeightVersion,
    ) -> miles_core::Result<()> {
        self.version.store(version.0, Ordering::SeqCst);
        Ok(())
    }

    async fn pause(&self, _mode: PauseMode) -> miles_core::Result<()> {
        Ok(())
    }

    async fn resume(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn flush_cache(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn abort(&self, _request_id: &RequestId) -> miles_core::Result<()> {
        Ok(())
    }

    async fn abort_all(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn health(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn weight_version(&self) -> miles_core::Result<WeightVersion> {
        Ok(WeightVersion(self.version.load(Ordering::SeqCst)))
    }
}

/// An engine that answers instantly with pre-tokenized replies, for measuring the session
/// server's own cost (benchmarks, load tests): when the prompt's last turn holds a tool
/// response it answers with [`InstantEngine::ANSWER`], otherwise with a `get_weather` tool call
/// ([`InstantEngine::TOOL_CALL`]). Deciding costs one backwards scan of the last turn; the
/// log-probs are [`toy_logprob`].
#[derive(Debug, Clone)]
pub struct InstantEngine {
    turn_start: Vec<TokenId>,
    tool_response: Vec<TokenId>,
    tool_call_ids: Vec<TokenId>,
    answer_ids: Vec<TokenId>,
    stop: TokenId,
    version: WeightVersion,
}

/// Whether `needle` occurs in `hay`.
fn contains_seq(hay: &[TokenId], needle: &[TokenId]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

impl InstantEngine {
    /// The tool-call reply (Qwen3 / ChatML form; the stop token is appended).
    pub const TOOL_CALL: &'static str = "<think>\nI should call the weather tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    /// The reply after a tool response (the stop token is appended).
    pub const ANSWER: &'static str =
        "<think>\nThe tool answered.\n</think>\n\nThe weather in Paris is sunny.";

    /// Builds the engine for a chat tokenizer whose turns open with `<|im_start|>`, tool
    /// results are wrapped in `<tool_response>` and turns end with `stop` (its first stop token
    /// id: `<|im_end|>` for Qwen3 / ChatML).
    pub fn for_chatml(tok: &dyn ChatTokenizer) -> crate::Result<Arc<Self>> {
        let stop = *tok
            .stop_token_ids()
            .first()
            .ok_or_else(|| Error::Config(format!("family {} has no stop token", tok.family())))?;
        let with_stop = |text: &str| -> crate::Result<Vec<TokenId>> {
            let mut ids = tok.encode(text)?;
            ids.push(stop);
            Ok(ids)
        };
        Ok(Arc::new(Self {
            turn_start: tok.encode("<|im_start|>")?,
            tool_response: tok.encode("<tool_response>")?,
            tool_call_ids: with_stop(Self::TOOL_CALL)?,
            answer_ids: with_stop(Self::ANSWER)?,
            stop,
            version: WeightVersion(1),
        }))
    }

    /// The reply ids for a prompt.
    pub fn reply(&self, prompt: &[TokenId]) -> &[TokenId] {
        // The last turn is the generation prompt; the one before it the newest message.
        let n = self.turn_start.len();
        let mut starts = (0..prompt.len().saturating_sub(n - 1))
            .rev()
            .filter(|&i| prompt[i..i + n] == self.turn_start[..]);
        let _generation_prompt = starts.next();
        let from = starts.next().unwrap_or(0);
        if contains_seq(&prompt[from..], &self.tool_response) {
            &self.answer_ids
        } else {
            &self.tool_call_ids
        }
    }
}

#[async_trait]
impl InferenceEngine for InstantEngine {
    async fn generate(&self, request: GenerateRequest) -> miles_core::Result<GenerateOutput> {
        let mut ids = self.reply(&request.input_ids).to_vec();
        let mut finish = FinishReason::Stop;
        let mut matched = Some(json!(self.stop));
        if let Some(max) = request.sampling_params.max_new_tokens
            && ids.len() > max
        {
            ids.truncate(max);
            finish = FinishReason::Length;
            matched = None;
        }
        let output_log_probs = ids
            .iter()
            .enumerate()
            .map(|(p, id)| toy_logprob(*id, p))
            .collect();
        Ok(GenerateOutput {
            request_id: request.request_id,
            output_ids: ids,
            output_log_probs,
            routed_experts: None,
            finish_reason: finish,
            matched_stop: matched,
            weight_version: self.version,
            prompt_tokens: request.input_ids.len(),
            cached_tokens: 0,
        })
    }

    async fn update_weights(
        &self,
        _weights: &NamedTensors,
        _version: WeightVersion,
    ) -> miles_core::Result<()> {
        Ok(())
    }

    async fn update_weights_from_disk(
        &self,
        _dir: &Path,
        _version: WeightVersion,
    ) -> miles_core::Result<()> {
        Ok(())
    }

    async fn pause(&self, _mode: PauseMode) -> miles_core::Result<()> {
        Ok(())
    }

    async fn resume(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn flush_cache(&self) -> miles_core::Result<()> {
        Ok(())
    }

    async fn abort(&self, _request_id: &RequestId) -> miles_core::Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::SamplingParams;

    #[test]
    fn instant_engine_calls_the_tool_then_answers_from_its_result() {
        let tok = ByteChatml::default();
        let engine = InstantEngine::for_chatml(&tok).unwrap();
        let user = tok.encode(
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
        );
        let reply = engine.reply(&user);
        assert_eq!(
            tok.decode(reply),
            format!("{}<|im_end|>", InstantEngine::TOOL_CALL)
        );
        let parsed = tok.parse_assistant(reply, &[]).unwrap();
        assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
        let mut after_tool = user.clone();
        after_tool.extend(tok.encode(
            "<tool_call>x</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        ));
        assert_eq!(
            tok.decode(engine.reply(&after_tool)),
            format!("{}<|im_end|>", InstantEngine::ANSWER)
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let params = SamplingParams {
            max_new_tokens: Some(3),
            ..SamplingParams::default()
        };
        let out = rt
            .block_on(engine.generate(GenerateRequest::new(user, params)))
            .unwrap();
        assert_eq!(out.output_ids.len(), 3);
        assert_eq!(out.finish_reason, FinishReason::Length);
        assert_eq!(out.output_log_probs[1], toy_logprob(out.output_ids[1], 1));
    }
}

/// The weather tool of [`ToyEngine`]'s script: `get_weather(city)`.
pub fn weather_tool() -> ToolSpec {
    ToolSpec::function(
        "get_weather",
        "Weather of a city",
        json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    )
}

/// A user agent for tests (Miles' `agentic_tool_call.generate`'s shape): offers [`weather_tool`], answers every
/// tool call with "sunny" and asks again until the model answers in text, through a real HTTP
/// client against `ctx.base_url`. Its metadata: `turns`, `final_answer` and
/// `agent_metrics.total_tool_time` = 0.25. With `fail_after_first_turn` it fails ("tool
/// crashed") after its first chat call.
#[derive(Debug, Clone, Default)]
pub struct WeatherAgent {
    /// Fail after the first turn.
    pub fail_after_first_turn: bool,
}

#[async_trait]
impl crate::agent::Agent for WeatherAgent {
    async fn run(
        &self,
        ctx: crate::agent::AgentContext,
    ) -> std::result::Result<Map<String, Value>, String> {
        let http = crate::http::HttpClient::new(Duration::from_secs(10))
            .with_api_key(ctx.api_key.as_ref());
        let mut messages: Vec<Value> = ctx
            .prompt
            .iter()
            .map(serde_json::to_value)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let mut turns = 0;
        let final_answer = loop {
            let mut body = json!({"model": "toy", "messages": messages, "tools": [weather_tool()]});
            for (k, v) in &ctx.request_kwargs {
                body[k] = v.clone();
            }
            let r = http
                .post_json(&format!("{}/v1/chat/completions", ctx.base_url), &body, &[])
                .await
                .map_err(|e| e.to_string())?;
            if r.status != 200 {
                return Err(format!("chat answered {}: {}", r.status, r.text()));
            }
            turns += 1;
            if self.fail_after_first_turn {
                return Err("tool crashed".into());
            }
            let v: Value = r.json().map_err(|e| e.to_string())?;
            let message = v["choices"][0]["message"].clone();
            messages.push(message.clone());
            let Some(calls) = message["tool_calls"].as_array() else {
                break message["content"].clone();
            };
            for call in calls {
                messages
                    .push(json!({"role": "tool", "tool_call_id": call["id"], "content": "sunny"}));
            }
        };
        let mut meta = Map::new();
        meta.insert("turns".into(), json!(turns));
        meta.insert("final_answer".into(), final_answer);
        meta.insert("agent_metrics".into(), json!({"total_tool_time": 0.25}));
        Ok(meta)
    }
}
