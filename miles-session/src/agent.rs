//! The agent driver (Miles' `agentic_tool_call.generate`, Miles' `agentic_tool_call.generate`): open a session,
//! let a user agent talk to it through an OpenAI-style client, collect the samples, delete the
//! session. Failures never propagate: they become a FAILED copy of the input sample, with
//! `metadata.failure` (what happened), `metadata.failure_kind` (an [`AgentFailureKind`] label)
//! and, for a subprocess agent, `metadata.agent_stderr_tail`.

use std::sync::Arc;
use std::time::Duration;

use hyper::Method;
use miles_core::{
    Message, Prompt, Reward, RewardFn, Sample, SampleStatus, SamplingParams, async_trait,
};
use serde_json::{Map, Value, json};

use crate::codec::decode_samples_as;
use crate::error::{Error, Result};
use crate::guard::ApiKey;
use crate::http::HttpClient;
use crate::tree::SessionVersion;

/// What an agent gets: where to send chat completions, the prompt, sampling kwargs in OpenAI
/// names, and metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentContext {
    /// `http://host:port/sessions/<id>`: an OpenAI client's `base_url` (append
    /// `/v1/chat/completions`).
    pub base_url: String,
    /// The sample's prompt messages.
    pub prompt: Vec<Message>,
    /// Sampling fields for the chat request (`max_tokens`, `temperature`, `top_p`, `seed`, …).
    pub request_kwargs: Map<String, Value>,
    /// The sample's metadata + `max_seq_len` + `session_server_id`.
    pub metadata: Map<String, Value>,
    /// The session server's API key, when it requires one: send it as
    /// `Authorization: Bearer <key>` ([`AgentContext::headers`]).
    pub api_key: Option<ApiKey>,
}

impl AgentContext {
    /// The headers every request to [`AgentContext::base_url`] needs (the bearer key, if any).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        self.api_key
            .iter()
            .map(|k| ("authorization", k.bearer()))
            .collect()
    }
}

/// The reserved key of an agent's returned metadata that carries its reward: [`generate`]
/// removes it from the metadata and stores it as [`Sample::reward`] (a number becomes
/// [`Reward::Scalar`], an object [`Reward::Map`]; anything else ABORTS the sample). Miles'
/// agents return no reward; this is how an agent that scores its own episode (a test suite
/// it ran, an environment's return) hands the score over. The rollout manager still calls
/// its `RewardFn`: use [`AgentReward`] there to keep the agent's reward.
pub const AGENT_REWARD_KEY: &str = "agent_reward";

/// What kind of failure ended an agent run: the sample's `metadata.failure_kind` and the
/// label of the rollout's `rollout/failed_samples/<kind>` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum AgentFailureKind {
    /// The agent's command could not be started.
    Spawn,
    /// The agent's process exited with a non-zero code.
    Exit,
    /// The agent's process was killed by a signal.
    Signal,
    /// The agent ran past its time limit.
    Timeout,
    /// The agent's output broke the protocol (unparsable stdout, too much of it, a bad reward).
    BadOutput,
    /// An in-process agent returned an error.
    Error,
    /// The session server could not open a session.
    SessionCreate,
    /// The session's samples could not be collected.
    Collect,
    /// The agent ended without a single model call: the session was left unfinished.
    EmptySession,
}

impl AgentFailureKind {
    /// The stable label (`exit`, `signal`, `timeout`, `bad_output`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Spawn => "spawn",
            Self::Exit => "exit",
            Self::Signal => "signal",
            Self::Timeout => "timeout",
            Self::BadOutput => "bad_output",
            Self::Error => "error",
            Self::SessionCreate => "session_create",
            Self::Collect => "collect",
            Self::EmptySession => "empty_session",
        }
    }
}

/// Why an agent run failed: its kind, a message, and the tail of the agent's stderr (empty for
/// in-process agents).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentFailure {
    /// What kind of failure.
    pub kind: AgentFailureKind,
    /// What happened (`agent command "python3 agent.py" exited with code 3`, …).
    pub message: String,
    /// The last bytes the agent wrote to stderr (lossy UTF-8).
    pub stderr_tail: String,
}

impl AgentFailure {
    /// A failure of `kind`.
    pub fn new(kind: AgentFailureKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            stderr_tail: String::new(),
        }
    }

    /// With the agent's stderr tail.
    pub fn with_stderr_tail(mut self, tail: impl Into<String>) -> Self {
        self.stderr_tail = tail.into();
        self
    }
}

impl From<String> for AgentFailure {
    fn from(message: String) -> Self {
        Self::new(AgentFailureKind::Error, message)
    }
}

impl std::fmt::Display for AgentFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A user agent: drives a conversation against `ctx.base_url` and returns its own metadata
/// (merged into the sample's; `agent_metrics.total_tool_time` becomes `non_generation_time`;
/// [`AGENT_REWARD_KEY`] becomes the sample's reward).
#[async_trait]
pub trait Agent: Send + Sync {
    /// Runs the agent. An error turns the sample FAILED (kind [`AgentFailureKind::Error`]).
    async fn run(&self, ctx: AgentContext) -> std::result::Result<Map<String, Value>, String>;

    /// [`Agent::run`] with the failure's kind and stderr tail, which the driver records;
    /// agents that know why they failed (a subprocess) override it. Default: `run`'s error
    /// as [`AgentFailureKind::Error`].
    async fn run_classified(
        &self,
        ctx: AgentContext,
    ) -> std::result::Result<Map<String, Value>, AgentFailure> {
        self.run(ctx).await.map_err(AgentFailure::from)
    }
}

/// Settings of [`generate`].
#[derive(Debug, Clone)]
pub struct AgentDriverConfig {
    /// The session server, `http://host:port`.
    pub server_url: String,
    /// `max_seq_len` for sample assembly.
    pub max_seq_len: Option<usize>,
    /// Wall-clock limit of the agent (`None`: none).
    pub agent_timeout: Option<Duration>,
    /// Timeout of session create / samples / delete calls (Miles: 120 s).
    pub http_timeout: Duration,
    /// FAIL the sample when the agent fails or times out (default). `false` keeps Miles'
    /// behaviour: log and train on whatever the session recorded.
    pub abort_on_agent_error: bool,
    /// The session server's API key (sent by the driver, handed to the agent).
    pub api_key: Option<ApiKey>,
    /// Miles' `--generate-multi-samples` (off): [`generate_samples`] returns one sample per
    /// turn instead of one merged sample per session, every one tagged with the rollout id
    /// of the input sample (`rollout_id`, else `index`).
    pub generate_multi_samples: bool,
    /// The session server's version (Miles' `--use-session-server`; default v1). With
    /// [`SessionVersion::V2`] (tree sessions) the agent's metadata and reward go with the
    /// samples request (the server's post-processor applies them) and [`generate_samples`]
    /// returns one sample per kept leaf, siblings tagged with the rollout id, as Miles'
    /// `agentic_tool_call.generate` does under v2.
    pub session_version: SessionVersion,
}

impl AgentDriverConfig {
    /// Defaults for a server URL.
    pub fn new(server_url: impl Into<String>) -> Self {
        Self {
            server_url: server_url.into().trim_end_matches('/').to_owned(),
            max_seq_len: None,
            agent_timeout: None,
            http_timeout: Duration::from_secs(120),
            abort_on_agent_error: true,
            api_key: None,
            generate_multi_samples: false,
            session_version: SessionVersion::V1,
        }
    }

    /// Sets [`AgentDriverConfig::session_version`].
    pub fn with_session_version(mut self, version: SessionVersion) -> Self {
        self.session_version = version;
        self
    }

    /// Sets [`AgentDriverConfig::generate_multi_samples`].
    pub fn with_generate_multi_samples(mut self, on: bool) -> Self {
        self.generate_multi_samples = on;
        self
    }

    /// Sets [`AgentDriverConfig::api_key`].
    pub fn with_api_key(mut self, key: Option<ApiKey>) -> Self {
        self.api_key = key;
        self
    }
}

/// Rollout sampling parameters as chat-completion fields (`max_new_tokens → max_tokens`,
/// `min_new_tokens → min_tokens`, `sampling_seed → seed`), unset ones dropped.
pub fn request_kwargs(params: &SamplingParams) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("temperature".into(), json!(params.temperature));
    m.insert("top_p".into(), json!(params.top_p));
    m.insert("top_k".into(), json!(params.top_k));
    m.insert("min_p".into(), json!(params.min_p));
    if let Some(v) = params.max_new_tokens {
        m.insert("max_tokens".into(), json!(v));
    }
    if params.min_new_tokens > 0 {
        m.insert("min_tokens".into(), json!(params.min_new_tokens));
    }
    if let Some(v) = params.sampling_seed {
        m.insert("seed".into(), json!(v));
    }
    if !params.stop.is_empty() {
        m.insert("stop".into(), json!(params.stop));
    }
    if !params.stop_token_ids.is_empty() {
        m.insert("stop_token_ids".into(), json!(params.stop_token_ids));
    }
    if params.frequency_penalty != 0.0 {
        m.insert("frequency_penalty".into(), json!(params.frequency_penalty));
    }
    if params.presence_penalty != 0.0 {
        m.insert("presence_penalty".into(), json!(params.presence_penalty));
    }
    m
}

/// A FAILED copy of `sample` saying why (`failure`, `failure_kind`, `agent_stderr_tail`).
fn failed(sample: &Sample, failure: AgentFailure) -> Sample {
    let mut out = sample.clone();
    out.status = SampleStatus::Failed;
    out.metadata
        .insert("failure".into(), json!(failure.message));
    out.metadata
        .insert("failure_kind".into(), json!(failure.kind.as_str()));
    if !failure.stderr_tail.is_empty() {
        out.metadata
            .insert("agent_stderr_tail".into(), json!(failure.stderr_tail));
    }
    out
}

fn failure(kind: AgentFailureKind, message: String) -> AgentFailure {
    AgentFailure::new(kind, message)
}

/// Runs `agent` on `sample` through the session server and returns the assembled (merged)
/// sample; any failure (server unreachable, agent error or timeout, empty session,
/// undecodable samples) gives a FAILED copy of `sample` with `metadata.failure` and
/// `metadata.failure_kind`. The
/// session is always deleted. [`AgentDriverConfig::generate_multi_samples`] does not apply
/// here (see [`generate_samples`]); with a v2 session server use [`generate_samples`] (a tree
/// may keep several leaves, which fails the sample here).
pub async fn generate(
    agent: &dyn Agent,
    sample: &Sample,
    sampling: &SamplingParams,
    config: &AgentDriverConfig,
    http: &HttpClient,
) -> Sample {
    let mut samples = drive(agent, sample, sampling, config, http, false).await;
    match samples.pop() {
        Some(out) if samples.is_empty() => out,
        _ => failed(
            sample,
            failure(
                AgentFailureKind::Collect,
                "collect failed: expected one sample".into(),
            ),
        ),
    }
}

/// [`generate`], or with [`AgentDriverConfig::generate_multi_samples`] the per-turn samples
/// of the session (Miles' `--generate-multi-samples`): each turn's own tokens (the whole
/// context before it as prompt), response, loss mask, log-probs and routed experts, all with
/// `rollout_id` = the input's `rollout_id`, else its `index`. The agent's reward and metadata
/// go on every sibling, the session metadata on the last one (as Miles did). A failure is one
/// FAILED copy of `sample`.
pub async fn generate_samples(
    agent: &dyn Agent,
    sample: &Sample,
    sampling: &SamplingParams,
    config: &AgentDriverConfig,
    http: &HttpClient,
) -> Vec<Sample> {
    drive(
        agent,
        sample,
        sampling,
        config,
        http,
        config.generate_multi_samples,
    )
    .await
}

async fn drive(
    agent: &dyn Agent,
    sample: &Sample,
    sampling: &SamplingParams,
    config: &AgentDriverConfig,
    http: &HttpClient,
    per_turn: bool,
) -> Vec<Sample> {
    let one = |s: Sample| vec![s];
    let authed;
    let http = match &config.api_key {
        Some(key) => {
            authed = http.clone().with_api_key(Some(key));
            &authed
        }
        None => http,
    };
    let server = &config.server_url;
    let session_id = match create_session(http, server).await {
        Ok(id) => id,
        Err(e) => {
            tracing::debug!(%e, "agentic generate: cannot create a session");
            return one(failed(
                sample,
                failure(
                    AgentFailureKind::SessionCreate,
                    format!("session create failed: {e}"),
                ),
            ));
        }
    };
    let base_url = format!("{server}/sessions/{session_id}");
    let mut metadata = sample.metadata.clone();
    if let Some(max) = config.max_seq_len {
        metadata.insert("max_seq_len".into(), json!(max));
    }
    metadata.insert(
        "session_server_id".into(),
        json!(server.trim_start_matches("http://")),
    );
    let prompt = match &sample.prompt {
        Prompt::Messages(m) => m.clone(),
        Prompt::Text(t) => vec![Message::user(t.clone())],
    };
    let ctx = AgentContext {
        base_url: base_url.clone(),
        prompt,
        request_kwargs: request_kwargs(sampling),
        metadata,
        api_key: config.api_key.clone(),
    };
    let run = agent.run_classified(ctx);
    let agent_result = match config.agent_timeout {
        Some(limit) => match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(failure(
                AgentFailureKind::Timeout,
                format!("agent timed out after {} s", limit.as_secs_f64()),
            )),
        },
        None => run.await,
    };
    let v2 = config.session_version == SessionVersion::V2;
    // v2: the agent's metadata travels with the samples request, its reward as `reward` (a
    // reward that is neither a number nor an object is refused below, as for v1).
    let v2_metadata = match (&agent_result, v2) {
        (Ok(m), true) => {
            let mut m = m.clone();
            if let Some(reward) = m.remove(AGENT_REWARD_KEY)
                && (reward.is_number() || reward.is_object())
            {
                m.insert("reward".into(), reward);
            }
            Some(Value::Object(m))
        }
        _ => None,
    };
    let collected = collect(
        http,
        &base_url,
        config.max_seq_len,
        per_turn,
        sample,
        config.session_version,
        v2_metadata,
    )
    .await;
    if let Err(e) = http
        .send(Method::DELETE, &base_url, &[], None)
        .await
        .and_then(|r| {
            if r.status.is_success() {
                Ok(())
            } else {
                Err(Error::upstream(format!("delete answered {}", r.status)))
            }
        })
    {
        tracing::warn!(%e, session = session_id, "agentic generate: delete failed");
    }
    let mut agent_metadata = match agent_result {
        Ok(m) => m,
        Err(e) => {
            // Logged (rate-limited, with the stderr tail) by whoever counts the failures.
            tracing::debug!(error = %e, session = session_id, "agent failed");
            if config.abort_on_agent_error {
                let message = format!("agent failed: {}", e.message);
                return one(failed(sample, AgentFailure { message, ..e }));
            }
            Map::new()
        }
    };
    let (mut outs, session_metadata) = match collected {
        Ok(Some(v)) => v,
        Ok(None) => {
            return one(failed(
                sample,
                failure(AgentFailureKind::EmptySession, "empty session".into()),
            ));
        }
        Err(e) => {
            tracing::debug!(%e, session = session_id, "agentic generate: collecting samples failed");
            return one(failed(
                sample,
                failure(AgentFailureKind::Collect, format!("collect failed: {e}")),
            ));
        }
    };
    let reward = match agent_metadata.remove(AGENT_REWARD_KEY) {
        None => None,
        Some(value) => match serde_json::from_value::<Reward>(value) {
            Ok(reward) => Some(reward),
            Err(_) => {
                tracing::debug!(session = session_id, "agent returned an invalid reward");
                return one(failed(
                    sample,
                    failure(
                        AgentFailureKind::BadOutput,
                        format!("agent failed: {AGENT_REWARD_KEY} must be a number or an object"),
                    ),
                ));
            }
        },
    };
    let tool_time = agent_metadata
        .get("agent_metrics")
        .and_then(|m| m.get("total_tool_time"))
        .and_then(Value::as_f64);
    let rollout_id = sample.rollout_id();
    let siblings = outs.len();
    for out in &mut outs {
        if let Some(t) = tool_time {
            out.non_generation_time = t;
        }
        if (per_turn || v2) && siblings > 1 {
            out.rollout_id = rollout_id;
        }
        if v2 {
            // The server's post-processor applied the agent's metadata and reward.
            continue;
        }
        if let Some(reward) = &reward {
            out.reward = Some(reward.clone());
        }
        out.metadata.extend(agent_metadata.clone());
    }
    if !v2 && let Some(last) = outs.last_mut() {
        last.metadata.extend(session_metadata);
    }
    outs
}

/// A [`RewardFn`] that keeps the reward the agent gave ([`AGENT_REWARD_KEY`], e.g. a
/// [`crate::command_agent::CommandAgent`]'s `"reward"`), and asks `fallback` (or fails, when
/// there is none) for samples that came back without one.
#[derive(Clone, Default)]
pub struct AgentReward {
    fallback: Option<Arc<dyn RewardFn>>,
}

impl AgentReward {
    /// Keeps agents' rewards; a sample without one is a reward error.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scores samples without an agent reward with `fallback`.
    pub fn with_fallback(mut self, fallback: Arc<dyn RewardFn>) -> Self {
        self.fallback = Some(fallback);
        self
    }
}

impl std::fmt::Debug for AgentReward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentReward")
            .field("fallback", &self.fallback.is_some())
            .finish()
    }
}

#[async_trait]
impl RewardFn for AgentReward {
    async fn reward(&self, sample: &Sample) -> miles_core::Result<Reward> {
        match (&sample.reward, &self.fallback) {
            (Some(reward), _) => Ok(reward.clone()),
            (None, Some(fallback)) => fallback.reward(sample).await,
            (None, None) => Err(miles_core::Error::Reward(
                "the agent returned no reward".into(),
            )),
        }
    }
}

async fn create_session(http: &HttpClient, server: &str) -> Result<String> {
    let r = http
        .post_json(&format!("{server}/sessions"), &json!({}), &[])
        .await?;
    if !r.status.is_success() {
        return Err(Error::upstream(format!(
            "POST /sessions answered {}",
            r.status
        )));
    }
    let v: Value = r.json()?;
    v.get("session_id")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| Error::upstream("POST /sessions answered without session_id"))
}

/// Collects the session's samples (one merged sample, or with `per_turn` one per turn, or for
/// a v2 session one per kept leaf): `Ok(None)` when the session is empty.
async fn collect(
    http: &HttpClient,
    base_url: &str,
    max_seq_len: Option<usize>,
    per_turn: bool,
    sample: &Sample,
    version: SessionVersion,
    v2_metadata: Option<Value>,
) -> Result<Option<(Vec<Sample>, Map<String, Value>)>> {
    let v2 = version == SessionVersion::V2;
    let body = if v2 {
        match v2_metadata {
            Some(metadata) => json!({"max_seq_len": max_seq_len, "metadata": metadata}),
            None => json!({"max_seq_len": max_seq_len}),
        }
    } else if per_turn {
        json!({"max_seq_len": max_seq_len, "generate_multi_samples": true})
    } else {
        json!({"max_seq_len": max_seq_len})
    };
    let r = http
        .post_json(
            &format!("{base_url}/samples"),
            &body,
            &[("accept", "application/octet-stream")],
        )
        .await?;
    if !r.status.is_success() {
        return Err(Error::upstream(format!(
            "samples answered {}: {}",
            r.status,
            r.text()
        )));
    }
    let mut base = sample.clone();
    base.weight_versions.clear();
    base.prefix_cache_info = Default::default();
    base.spec_info = Default::default();
    base.teacher_log_probs = None;
    base.opd_reverse_kl = None;
    let payload = decode_samples_as(&r.body, &base, version.wire())?;
    if payload.empty_reason.is_some() {
        return Ok(None);
    }
    let samples = payload.samples;
    if samples.is_empty() || (!per_turn && !v2 && samples.len() != 1) {
        return Err(Error::assembly(format!(
            "expected one sample, got {}",
            samples.len()
        )));
    }
    Ok(Some((samples, payload.session_metadata)))
}
