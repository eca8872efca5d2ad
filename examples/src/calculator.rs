//! The agentic task of the `agentic_tool_call` example: multiplication with a calculator tool.
//!
//! A problem is `a*b=` with two-digit operands. The model cannot multiply in its head (it is
//! tiny); it must call the `calculator` tool with the expression, read the tool's answer and
//! repeat it. [`CalculatorAgent`] is an ordinary async agent: it talks to a session server's
//! OpenAI-style `/v1/chat/completions` over HTTP, runs the tool calls the model makes with
//! [`evaluate`], and ends when the model answers in text (or after `max_turns` model turns).
//! [`CalculatorReward`] scores the final answer and counts the TITO mismatches the session
//! server reported for each trajectory.
//!
//! ```
//! use miles_examples::calculator::{MulTask, evaluate};
//!
//! assert_eq!(evaluate("23*47"), Ok(1081));
//! assert_eq!(evaluate("(2 + 3) * -4 - 10 / 3"), Ok(-23));
//! assert!(evaluate("2**3").is_err());
//! let split = MulTask { seed: 3 }.split(100, 10)?;
//! assert_eq!(split.train.len(), 100);
//! assert!(split.held_out.iter().all(|h| !split.train.contains(h)));
//! # Ok::<(), miles_examples::Error>(())
//! ```

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use miles_core::rng::SplitMix64;
use miles_core::{
    Error as CoreError, Message, Prompt, Result as CoreResult, Reward, RewardFn, Sample,
    SampleStatus, async_trait,
};
use miles_rollout::PromptRecord;
use miles_session::agent::{Agent, AgentContext};
use miles_session::http::HttpClient;
use serde_json::{Map, Value, json};

use crate::Error;
use crate::sft::Conversation;

/// Name of the tool.
pub const TOOL_NAME: &str = "calculator";

/// Words the example's tokenizer merges so that a tool call is short: the JSON keys and
/// the punctuation runs of `{"name": "calculator", "arguments": {"expression": "…"}}`.
pub const TOOL_CALL_WORDS: [&str; 9] = [
    "calculator",
    "expression",
    "name",
    "arguments",
    "{\"",
    "\":",
    "\",",
    "\"}}",
    "\"",
];

/// The OpenAI tool object of the calculator.
pub fn calculator_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluates an integer arithmetic expression (+ - * / and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": "e.g. 23*47"}
                },
                "required": ["expression"]
            }
        }
    })
}

/// Why [`evaluate`] rejected an expression (the tool answers `error: …`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CalcError(String);

/// Evaluates an integer expression: decimal literals, `+ - * /` (integer division towards
/// zero), unary minus, parentheses, spaces. Overflow, division by zero, unknown characters
/// and malformed expressions are errors.
pub fn evaluate(expression: &str) -> Result<i64, CalcError> {
    let tokens: Vec<char> = expression.chars().filter(|c| !c.is_whitespace()).collect();
    if tokens.is_empty() {
        return Err(CalcError("empty expression".into()));
    }
    let mut parser = Parser { tokens, at: 0 };
    let value = parser.sum()?;
    if parser.at != parser.tokens.len() {
        return Err(CalcError(format!(
            "unexpected {:?} at {}",
            parser.tokens[parser.at], parser.at
        )));
    }
    Ok(value)
}

struct Parser {
    tokens: Vec<char>,
    at: usize,
}

impl Parser {
    const MAX_DEPTH: usize = 64;

    fn peek(&self) -> Option<char> {
        self.tokens.get(self.at).copied()
    }

    fn overflow() -> CalcError {
        CalcError("overflow".into())
    }

    fn sum(&mut self) -> Result<i64, CalcError> {
        let mut value = self.product()?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.at += 1;
            let rhs = self.product()?;
            value = if op == '+' {
                value.checked_add(rhs)
            } else {
                value.checked_sub(rhs)
            }
            .ok_or_else(Self::overflow)?;
        }
        Ok(value)
    }

    fn product(&mut self) -> Result<i64, CalcError> {
        let mut value = self.unary(0)?;
        while let Some(op @ ('*' | '/')) = self.peek() {
            self.at += 1;
            let rhs = self.unary(0)?;
            value = if op == '*' {
                value.checked_mul(rhs).ok_or_else(Self::overflow)?
            } else if rhs == 0 {
                return Err(CalcError("division by zero".into()));
            } else {
                value.checked_div(rhs).ok_or_else(Self::overflow)?
            };
        }
        Ok(value)
    }

    fn unary(&mut self, depth: usize) -> Result<i64, CalcError> {
        if depth > Self::MAX_DEPTH {
            return Err(CalcError("expression nested too deeply".into()));
        }
        match self.peek() {
            Some('-') => {
                self.at += 1;
                self.unary(depth + 1)?
                    .checked_neg()
                    .ok_or_else(Self::overflow)
            }
            Some('(') => {
                self.at += 1;
                let value = self.sum()?;
                if self.peek() != Some(')') {
                    return Err(CalcError("missing )".into()));
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.at;
                while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                    self.at += 1;
                }
                let text: String = self.tokens[start..self.at].iter().collect();
                text.parse().map_err(|_| Self::overflow())
            }
            Some(c) => Err(CalcError(format!("unexpected {c:?} at {}", self.at))),
            None => Err(CalcError("unexpected end".into())),
        }
    }
}

/// One problem: `a * b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MulProblem {
    /// First operand.
    pub a: u64,
    /// Second operand.
    pub b: u64,
}

impl MulProblem {
    /// The user's message: `"23*47="`.
    pub fn question(&self) -> String {
        format!("{}*{}=", self.a, self.b)
    }

    /// The expression the model should hand the tool: `"23*47"`.
    pub fn expression(&self) -> String {
        format!("{}*{}", self.a, self.b)
    }

    /// The label: the product in decimal.
    pub fn answer(&self) -> String {
        (self.a * self.b).to_string()
    }

    /// The prompt record (one user message, the product as label).
    pub fn prompt_record(&self) -> PromptRecord {
        let mut metadata = Map::new();
        metadata.insert("a".into(), self.a.into());
        metadata.insert("b".into(), self.b.into());
        PromptRecord {
            prompt: Prompt::Messages(vec![Message::user(self.question())]),
            label: Some(self.answer()),
            metadata,
        }
    }

    /// The demonstration for the supervised warm-start: the user's question, an assistant
    /// turn that calls the calculator, the tool's answer, the assistant's final answer; with
    /// the tool declared when `declare_tools` (as the agent sends it).
    pub fn demonstration(&self, declare_tools: bool) -> Result<Conversation, Error> {
        let messages = json!([
            {"role": "user", "content": self.question()},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_0",
                "type": "function",
                "function": {"name": TOOL_NAME, "arguments": {"expression": self.expression()}}
            }]},
            {"role": "tool", "tool_call_id": "call_0", "name": TOOL_NAME, "content": self.answer()},
            {"role": "assistant", "content": self.answer()},
        ]);
        demonstration_conversation(messages, declare_tools)
    }

    /// A careless demonstrator's answer given without the calculator: a mental estimate, each
    /// operand rounded to the nearest ten (`23*47` → `1000`). The product itself for only
    /// 89 of the 8,100 two-digit pairs (both operands multiples of ten, or `12*25`-like pairs
    /// whose roundings cancel).
    pub fn estimate(&self) -> String {
        let round = |x: u64| (x + 5) / 10 * 10;
        (round(self.a) * round(self.b)).to_string()
    }

    /// The careless demonstration: the assistant answers at once with
    /// [`MulProblem::estimate`] instead of calling the calculator.
    pub fn careless_demonstration(&self, declare_tools: bool) -> Result<Conversation, Error> {
        let messages = json!([
            {"role": "user", "content": self.question()},
            {"role": "assistant", "content": self.estimate()},
        ]);
        demonstration_conversation(messages, declare_tools)
    }
}

/// A demonstration's messages (JSON) as a conversation, with the calculator declared when
/// `declare_tools`.
fn demonstration_conversation(messages: Value, declare_tools: bool) -> Result<Conversation, Error> {
    let messages: Vec<Message> = serde_json::from_value(messages).map_err(|e| Error::Invalid {
        what: "demonstration",
        reason: e.to_string(),
    })?;
    Ok(Conversation {
        messages,
        tools: declare_tools.then(|| vec![calculator_tool()]),
    })
}

/// The task: two-digit operands (`10..=99`), seeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MulTask {
    /// Generator seed.
    pub seed: u64,
}

/// Disjoint train and held-out problems (a held-out pair never appears in training, in
/// either order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MulSplit {
    /// Training problems.
    pub train: Vec<MulProblem>,
    /// Evaluation problems.
    pub held_out: Vec<MulProblem>,
}

impl MulTask {
    /// Draws `train` and `held_out` distinct problems (together at most 4,000: half the
    /// 8,100 ordered pairs, since commuted pairs are excluded).
    pub fn split(&self, train: usize, held_out: usize) -> Result<MulSplit, Error> {
        if train + held_out > 4000 {
            return Err(Error::Invalid {
                what: "problem count",
                reason: format!(
                    "{} problems asked for; two-digit operands allow at most 4000 without commuted repeats",
                    train + held_out
                ),
            });
        }
        let mut rng = SplitMix64::new(self.seed);
        let mut seen = HashSet::new();
        let mut draw = |n: usize| {
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let p = MulProblem {
                    a: rng.range_inclusive(10, 99),
                    b: rng.range_inclusive(10, 99),
                };
                if seen.insert((p.a, p.b)) {
                    seen.insert((p.b, p.a));
                    out.push(p);
                }
            }
            out
        };
        let held_out = draw(held_out);
        let train = draw(train);
        Ok(MulSplit { train, held_out })
    }
}

/// The agent: asks the model, runs its calculator calls, and stops at the first text
/// answer or after `max_turns` model turns. With `declare_tools` it sends the calculator in
/// the request's `tools` (a chat template then renders its tool preamble into the prompt:
/// Qwen3's is about 500 tokens of a byte-level tokenizer); without, the model must know the
/// tool from training, and the server still parses its calls. Its metadata (merged into the sample) holds
/// `final_answer` (null when the model never answered in text), `turns`, `tool_calls`,
/// `tool_errors` and `agent_metrics.total_tool_time`.
#[derive(Debug, Clone)]
pub struct CalculatorAgent {
    /// Most model turns per problem.
    pub max_turns: usize,
    /// Timeout of one chat call.
    pub request_timeout: Duration,
    /// Send the tool in the request's `tools`.
    pub declare_tools: bool,
}

impl Default for CalculatorAgent {
    /// 3 turns, 120 s per call, tools declared.
    fn default() -> Self {
        Self {
            max_turns: 3,
            request_timeout: Duration::from_secs(120),
            declare_tools: true,
        }
    }
}

/// The tool's answer to one call: the value, or `error: …` for bad arguments.
pub fn run_tool_call(call: &Value) -> (String, bool) {
    let function = &call["function"];
    if function["name"] != TOOL_NAME {
        return (format!("error: unknown tool {}", function["name"]), false);
    }
    // OpenAI sends arguments as a JSON string; accept an object too.
    let arguments = match &function["arguments"] {
        Value::String(text) => serde_json::from_str::<Value>(text).unwrap_or(Value::Null),
        other => other.clone(),
    };
    match arguments["expression"].as_str().map(evaluate) {
        Some(Ok(value)) => (value.to_string(), true),
        Some(Err(e)) => (format!("error: {e}"), false),
        None => ("error: missing \"expression\"".into(), false),
    }
}

#[async_trait]
impl Agent for CalculatorAgent {
    async fn run(&self, ctx: AgentContext) -> Result<Map<String, Value>, String> {
        // The session server's key, when it requires one.
        let http = HttpClient::new(self.request_timeout).with_api_key(ctx.api_key.as_ref());
        let url = format!("{}/v1/chat/completions", ctx.base_url);
        let mut messages: Vec<Value> = ctx
            .prompt
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let (mut turns, mut calls, mut errors) = (0usize, 0usize, 0usize);
        let mut tool_time = 0.0;
        let mut final_answer = None;
        while turns < self.max_turns {
            let mut body = json!({"model": "miles", "messages": messages});
            if self.declare_tools {
                body["tools"] = json!([calculator_tool()]);
            }
            for (key, value) in &ctx.request_kwargs {
                body[key] = value.clone();
            }
            let response = http
                .post_json(&url, &body, &[])
                .await
                .map_err(|e| e.to_string())?;
            if response.status != 200 {
                return Err(format!(
                    "chat completion answered {}: {}",
                    response.status,
                    response.text()
                ));
            }
            turns += 1;
            let reply: Value = response.json().map_err(|e| e.to_string())?;
            let choice = &reply["choices"][0];
            let message = choice["message"].clone();
            messages.push(message.clone());
            let tool_calls = message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            if tool_calls.is_empty() {
                final_answer = message["content"].as_str().map(str::to_owned);
                break;
            }
            if choice["finish_reason"] == "length" {
                break;
            }
            let started = Instant::now();
            for call in &tool_calls {
                let (output, ok) = run_tool_call(call);
                calls += 1;
                errors += usize::from(!ok);
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "name": TOOL_NAME,
                    "content": output,
                }));
            }
            tool_time += started.elapsed().as_secs_f64();
        }
        let mut meta = Map::new();
        // Always set (null without an answer), so that a regenerated sample never keeps a
        // previous attempt's answer in its metadata.
        meta.insert("final_answer".into(), json!(final_answer));
        meta.insert("turns".into(), json!(turns));
        meta.insert("tool_calls".into(), json!(calls));
        meta.insert("tool_errors".into(), json!(errors));
        meta.insert(
            "agent_metrics".into(),
            json!({"total_tool_time": tool_time}),
        );
        Ok(meta)
    }
}

/// 1 when the agent's final answer equals the label (after trimming), else 0. Also counts,
/// over every sample it scores, the trajectories the session server checked for TITO
/// mismatches (`metadata.tito_session_mismatch`). Two kinds are counted apart and not
/// compared, because no template can render them back: those whose last turn hit the token
/// limit (unfinished: the render closes a message the model never closed) and those where
/// the model itself generated a chat-structure token ([`CalculatorReward::with_control_tokens`],
/// e.g. `<|im_start|>` inside a reply: unrenderable). Among the others it counts those with
/// a hard mismatch (any type but `assistant_text`: a token-in-token-out failure) and those
/// with a tolerated `assistant_text` one (the model's own tokens differ from the canonical
/// tokenization of their text: exactly what TITO keeps and re-tokenization would lose).
#[derive(Debug, Default)]
pub struct CalculatorReward {
    control_tokens: Vec<u32>,
    unrenderable: AtomicU64,
    unfinished: AtomicU64,
    checked: AtomicU64,
    hard: AtomicU64,
    assistant_text: AtomicU64,
}

/// Session-mismatch counts over the scored samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TitoCounts {
    /// Samples whose last turn hit the token limit (not compared).
    pub unfinished: u64,
    /// Samples where the model generated a chat-structure token (not compared).
    pub unrenderable: u64,
    /// Finished samples that carried the session server's check.
    pub checked: u64,
    /// Of them, with a hard mismatch.
    pub hard: u64,
    /// Of them, with an `assistant_text` mismatch.
    pub assistant_text: u64,
}

impl CalculatorReward {
    /// The counts so far.
    pub fn tito_counts(&self) -> TitoCounts {
        TitoCounts {
            unfinished: self.unfinished.load(Ordering::Relaxed),
            unrenderable: self.unrenderable.load(Ordering::Relaxed),
            checked: self.checked.load(Ordering::Relaxed),
            hard: self.hard.load(Ordering::Relaxed),
            assistant_text: self.assistant_text.load(Ordering::Relaxed),
        }
    }

    /// Token ids that open or close chat structure (`<|im_start|>`, `<|endoftext|>`, …): a
    /// trajectory where the model generated one is not compared.
    pub fn with_control_tokens(mut self, ids: Vec<u32>) -> Self {
        self.control_tokens = ids;
        self
    }

    /// Whether `sample` is left out of the comparison (and counted as such).
    fn count_uncomparable(&self, sample: &Sample) -> bool {
        if sample.status == SampleStatus::Truncated {
            self.unfinished.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        let mask = sample.loss_mask.as_deref().unwrap_or(&[]);
        let generated_control = sample
            .response_tokens()
            .iter()
            .zip(mask)
            .any(|(id, &m)| m == 1 && self.control_tokens.contains(id));
        if generated_control {
            self.unrenderable.fetch_add(1, Ordering::Relaxed);
        }
        generated_control
    }

    /// The score of a final answer for `label`.
    pub fn score(answer: Option<&str>, label: &str) -> f64 {
        match answer {
            Some(answer) if answer.trim() == label.trim() => 1.0,
            _ => 0.0,
        }
    }
}

#[async_trait]
impl RewardFn for CalculatorReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let label = sample
            .label
            .as_deref()
            .ok_or_else(|| CoreError::Reward(format!("sample {:?} has no label", sample.index)))?;
        if let Some(found) = sample
            .metadata
            .get("tito_session_mismatch")
            .and_then(Value::as_array)
            && !self.count_uncomparable(sample)
        {
            self.checked.fetch_add(1, Ordering::Relaxed);
            let kind = |m: &Value| m.get("type").and_then(Value::as_str).map(str::to_owned);
            if found
                .iter()
                .any(|m| kind(m).as_deref() != Some("assistant_text"))
            {
                self.hard.fetch_add(1, Ordering::Relaxed);
            }
            if found
                .iter()
                .any(|m| kind(m).as_deref() == Some("assistant_text"))
            {
                self.assistant_text.fetch_add(1, Ordering::Relaxed);
            }
        }
        let answer = sample.metadata.get("final_answer").and_then(Value::as_str);
        Ok(Reward::Scalar(Self::score(answer, label)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluate_follows_integer_arithmetic() {
        assert_eq!(evaluate("23*47").unwrap(), 1081);
        assert_eq!(evaluate(" 1 + 2 * 3 ").unwrap(), 7);
        assert_eq!(evaluate("(1+2)*3").unwrap(), 9);
        assert_eq!(evaluate("7/2").unwrap(), 3);
        assert_eq!(evaluate("-7/2").unwrap(), -3);
        assert_eq!(evaluate("--5").unwrap(), 5);
        assert_eq!(evaluate("10-4-3").unwrap(), 3, "left-associative");
        for bad in [
            "",
            "1+",
            "(1",
            "1)",
            "2**3",
            "1/0",
            "x",
            "99999999999999999999",
        ] {
            assert!(evaluate(bad).is_err(), "{bad:?} should be rejected");
        }
        assert!(evaluate("9223372036854775807+1").is_err(), "overflow");
        assert!(
            evaluate(&"(".repeat(200)).is_err(),
            "deep nesting is an error, not a crash"
        );
    }

    #[test]
    fn tool_calls_accept_string_or_object_arguments() {
        let call =
            |args: Value| json!({"id": "c", "function": {"name": TOOL_NAME, "arguments": args}});
        assert_eq!(
            run_tool_call(&call(json!("{\"expression\": \"6*7\"}"))),
            ("42".into(), true)
        );
        assert_eq!(
            run_tool_call(&call(json!({"expression": "6*7"}))),
            ("42".into(), true)
        );
        assert!(!run_tool_call(&call(json!({"x": 1}))).1);
        assert!(!run_tool_call(&call(json!("not json"))).1);
        let other = json!({"function": {"name": "search", "arguments": "{}"}});
        assert!(run_tool_call(&other).0.starts_with("error: unknown tool"));
    }

    #[test]
    fn estimates_round_to_tens_and_miss_the_product() {
        let p = |a, b| MulProblem { a, b };
        assert_eq!(p(23, 47).estimate(), "1000");
        assert_eq!(p(95, 15).estimate(), "2000");
        assert_eq!(p(30, 40).estimate(), "1200");
        let demo = p(23, 47).careless_demonstration(false).unwrap();
        assert_eq!(demo.messages.len(), 2);
        assert!(demo.messages[1].tool_calls.is_none());
        // Right only when both operands are multiples of ten (81 pairs) or the two roundings
        // cancel (8 pairs: 12*25, 24*25, 32*75, 64*75 and their reverses): 89 of the 8,100.
        let mut right = 0;
        for a in 10..100 {
            for b in 10..100 {
                let q = p(a, b);
                if q.estimate() == q.answer() {
                    right += 1;
                    assert!(a % 10 == 0 && b % 10 == 0 || a * b % 100 == 0, "{a}*{b}");
                }
            }
        }
        assert_eq!(right, 89);
    }

    #[test]
    fn split_is_disjoint_and_seeded() {
        let task = MulTask { seed: 9 };
        let a = task.split(500, 50).unwrap();
        assert_eq!(a, task.split(500, 50).unwrap());
        let held: HashSet<_> = a.held_out.iter().map(|p| (p.a, p.b)).collect();
        for p in &a.train {
            assert!(!held.contains(&(p.a, p.b)) && !held.contains(&(p.b, p.a)));
            assert!((10..=99).contains(&p.a) && (10..=99).contains(&p.b));
        }
        assert!(task.split(4000, 1).is_err());
        let p = MulProblem { a: 23, b: 47 };
        assert_eq!((p.question(), p.answer()), ("23*47=".into(), "1081".into()));
    }

    #[tokio::test]
    async fn reward_scores_the_final_answer_and_counts_mismatches() {
        let reward = CalculatorReward::default();
        let mut sample = Sample {
            label: Some("1081".into()),
            ..Sample::default()
        };
        sample
            .metadata
            .insert("final_answer".into(), json!(" 1081"));
        sample
            .metadata
            .insert("tito_session_mismatch".into(), json!([]));
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(1.0));
        sample.metadata.insert("final_answer".into(), json!("1080"));
        sample.metadata.insert(
            "tito_session_mismatch".into(),
            json!([{"type": "special_token_type"}, {"type": "assistant_text"}]),
        );
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(0.0));
        sample.metadata.remove("final_answer");
        sample.metadata.insert(
            "tito_session_mismatch".into(),
            json!([{"type": "assistant_text"}]),
        );
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(0.0));
        sample.status = SampleStatus::Truncated;
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(0.0));
        // The model generated control token 9 (mask 1): not compared; 9 as a tool's output
        // (mask 0) does not count.
        let reward = reward.with_control_tokens(vec![9]);
        sample.status = SampleStatus::Completed;
        sample.tokens = vec![1, 2, 5, 9, 6];
        sample.response_length = 3;
        sample.loss_mask = Some(vec![1, 0, 1]);
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(0.0));
        sample.loss_mask = Some(vec![1, 1, 1]);
        assert_eq!(reward.reward(&sample).await.unwrap(), Reward::Scalar(0.0));
        assert_eq!(
            reward.tito_counts(),
            TitoCounts {
                unrenderable: 1,
                unfinished: 1,
                checked: 4,
                hard: 1,
                assistant_text: 3
            }
        );
        sample.label = None;
        assert!(reward.reward(&sample).await.is_err());
    }
}
