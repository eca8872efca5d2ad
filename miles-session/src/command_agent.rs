//! Agents in any language: [`CommandAgent`] runs one subprocess per sample and implements
//! [`Agent`], so [`crate::agent::generate`] drives it like any in-process agent.
//!
//! # Protocol
//!
//! For each sample the driver opens a session; the command then starts, in its own process
//! group, with
//!
//! * the environment: the trainer's (unless [`CommandAgentConfig::inherit_env`] is off), then
//!   [`CommandAgentConfig::env`], then
//!   * `OPENAI_BASE_URL` = `http://host:port/sessions/<id>/v1` (so an OpenAI client's
//!     `chat.completions.create` posts to `<OPENAI_BASE_URL>/chat/completions`),
//!   * `OPENAI_API_KEY` = the session server's key, or `EMPTY` when it has none (OpenAI
//!     clients insist on one);
//! * on **stdin**, one JSON object, then end of file:
//!
//!   ```json
//!   {"base_url": "http://127.0.0.1:30010/sessions/3f…/v1",
//!    "session_url": "http://127.0.0.1:30010/sessions/3f…",
//!    "session_id": "3f…",
//!    "prompt": [{"role": "system", "content": "…"}, {"role": "user", "content": "…"}],
//!    "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 512, …},
//!    "metadata": {"…": "the sample's metadata", "max_seq_len": 4096, "session_server_id": "127.0.0.1:30010"}}
//!   ```
//!
//!   `base_url` equals `OPENAI_BASE_URL`; `sampling_params` are chat-completion fields
//!   ([`crate::agent::request_kwargs`]) to pass with every request. An agent may ignore stdin
//!   or close it early.
//!
//! The agent talks to the session with any OpenAI-compatible client (sending each assistant
//! message back as it came) and exits. Exit code 0 is success. Its **stdout** may end with a
//! JSON object on its last non-empty line (earlier lines are ignored; log to stderr):
//!
//! ```json
//! {"reward": 1.0, "metadata": {"turns": 2}}
//! ```
//!
//! Both keys are optional and no other key is allowed. `metadata` (an object) is merged into
//! the sample's metadata (`agent_metrics.total_tool_time` becomes `non_generation_time`);
//! `reward` (a number, or an object of named components) becomes [`miles_core::Sample::reward`]
//! (through [`crate::agent::AGENT_REWARD_KEY`]). Empty stdout is a success without either.
//!
//! The sample is FAILED, with `metadata.failure` saying why (the command line quoted),
//! `metadata.failure_kind` ([`crate::agent::AgentFailureKind`]: `spawn`, `exit`, `signal`,
//! `timeout`, `bad_output`) and `metadata.agent_stderr_tail` the tail of the agent's stderr,
//! when the command cannot start, exits non-zero, dies of a signal, runs past
//! [`CommandAgentConfig::timeout`] (the group gets SIGTERM, then SIGKILL after
//! [`CommandAgentConfig::kill_grace`]), prints more than
//! [`CommandAgentConfig::max_stdout_bytes`] (killed at once) or prints a last line that is not
//! the object above. Whatever the outcome, the whole process group is killed once the agent
//! has exited (background processes it left behind included) and the agent is reaped: no
//! zombies. Sample data reaches the agent only through stdin and the environment, never its
//! command line.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use miles_session::agent::{AgentDriverConfig, generate};
//! use miles_session::command_agent::{CommandAgent, CommandAgentConfig};
//!
//! # async fn run(sample: miles_core::Sample) -> miles_session::Result<()> {
//! let agent = CommandAgent::new(
//!     CommandAgentConfig::shell("python3 my_agent.py --tools calculator")
//!         .with_timeout(Some(Duration::from_secs(300))),
//! )?;
//! let driver = AgentDriverConfig::new("http://127.0.0.1:30010");
//! let http = miles_session::http::HttpClient::new(driver.http_timeout);
//! let out = generate(&agent, &sample, &Default::default(), &driver, &http).await;
//! println!("{:?} reward {:?}", out.status, out.reward);
//! # Ok(()) }
//! ```

use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::pin::pin;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use miles_core::async_trait;
use serde_json::{Map, Value, json};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin};

use crate::agent::{AGENT_REWARD_KEY, Agent, AgentContext, AgentFailure, AgentFailureKind};
use crate::error::{Error, Result};

/// `OPENAI_API_KEY` when the session server has no key.
pub const PLACEHOLDER_API_KEY: &str = "EMPTY";

/// How a [`CommandAgent`] runs its command.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandAgentConfig {
    /// The program (a path, or a name looked up in `PATH`).
    pub program: String,
    /// Its arguments, passed as they are (no shell).
    pub args: Vec<String>,
    /// Working directory (default: the trainer's).
    pub working_dir: Option<PathBuf>,
    /// Extra environment variables, set after the inherited ones and before `OPENAI_*`.
    pub env: Vec<(String, String)>,
    /// Pass the trainer's environment on (default `true`); `false` starts from an empty one.
    pub inherit_env: bool,
    /// Wall-clock limit per sample (default 1 hour; `None`: none).
    pub timeout: Option<Duration>,
    /// Time between SIGTERM and SIGKILL of the process group on timeout (default 5 s).
    pub kill_grace: Duration,
    /// Most stdout bytes read; more ABORTS the sample (default 1 MiB).
    pub max_stdout_bytes: usize,
    /// Stderr bytes kept (the tail) for the abort reason (default 4 KiB).
    pub max_stderr_bytes: usize,
}

impl CommandAgentConfig {
    /// Runs `program` with `args` directly (no shell).
    pub fn new(
        program: impl Into<String>,
        args: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            working_dir: None,
            env: Vec::new(),
            inherit_env: true,
            timeout: Some(Duration::from_secs(3600)),
            kill_grace: Duration::from_secs(5),
            max_stdout_bytes: 1 << 20,
            max_stderr_bytes: 4 << 10,
        }
    }

    /// Runs a command line through `sh -c LINE` (shell syntax: quoting, `cd dir && …`,
    /// variables). The line comes from the operator; sample data never enters it.
    pub fn shell(line: impl Into<String>) -> Self {
        Self::new("sh", ["-c".to_owned(), line.into()])
    }

    /// Sets [`CommandAgentConfig::working_dir`].
    pub fn with_working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Adds an environment variable.
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets [`CommandAgentConfig::timeout`].
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets [`CommandAgentConfig::kill_grace`].
    pub fn with_kill_grace(mut self, grace: Duration) -> Self {
        self.kill_grace = grace;
        self
    }

    /// Sets [`CommandAgentConfig::max_stdout_bytes`].
    pub fn with_max_stdout_bytes(mut self, n: usize) -> Self {
        self.max_stdout_bytes = n;
        self
    }

    /// Sets [`CommandAgentConfig::max_stderr_bytes`].
    pub fn with_max_stderr_bytes(mut self, n: usize) -> Self {
        self.max_stderr_bytes = n;
        self
    }

    /// Checks the values once: a program, environment names without `=` or NUL, no NUL in
    /// any string, limits of at least one byte, a positive timeout.
    pub fn validate(self) -> Result<Self> {
        let bad = |what: String| Err(Error::Config(what));
        if self.program.is_empty() {
            return bad("the agent command is empty".into());
        }
        if self.program.contains('\0') || self.args.iter().any(|a| a.contains('\0')) {
            return bad("the agent command contains a NUL byte".into());
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains(['=', '\0']) || value.contains('\0') {
                return bad(format!(
                    "agent environment variable {key:?}: a name must be non-empty without '=' or NUL, a value without NUL"
                ));
            }
        }
        if self.max_stdout_bytes == 0 || self.max_stderr_bytes == 0 {
            return bad("agent stdout / stderr limits must be at least 1 byte".into());
        }
        if self.timeout.is_some_and(|t| t.is_zero()) {
            return bad("the agent timeout must be positive (None: no timeout)".into());
        }
        Ok(self)
    }

    /// Takes the `--agent-*` flags ([`AGENT_CMD_USAGE`]) out of `args`, leaving the others
    /// in order for the caller's own parser. `Ok(None)` when there is no `--agent-cmd`;
    /// another `--agent-*` flag without it, a flag without its value, or a bad value is an
    /// error. The returned configuration is validated.
    pub fn take_cli_flags(args: &mut Vec<String>) -> Result<Option<Self>> {
        let mut rest = Vec::with_capacity(args.len());
        let mut line = None;
        let mut set: Vec<(String, String)> = Vec::new();
        let mut it = std::mem::take(args).into_iter();
        while let Some(flag) = it.next() {
            if !AGENT_FLAGS.contains(&flag.as_str()) {
                rest.push(flag);
                continue;
            }
            let value = it
                .next()
                .ok_or_else(|| Error::Config(format!("{flag} needs a value\n{AGENT_CMD_USAGE}")))?;
            if flag == "--agent-cmd" {
                line = Some(value);
            } else {
                set.push((flag, value));
            }
        }
        *args = rest;
        let Some(line) = line else {
            return match set.first() {
                Some((flag, _)) => Err(Error::Config(format!(
                    "{flag} needs --agent-cmd\n{AGENT_CMD_USAGE}"
                ))),
                None => Ok(None),
            };
        };
        if line.trim().is_empty() {
            return Err(Error::Config("--agent-cmd is empty".into()));
        }
        let mut config = Self::shell(line);
        for (flag, value) in set {
            match flag.as_str() {
                "--agent-cwd" => config.working_dir = Some(PathBuf::from(value)),
                "--agent-env" => {
                    let (key, v) = value.split_once('=').ok_or_else(|| {
                        Error::Config(format!("--agent-env expects KEY=VALUE, got {value:?}"))
                    })?;
                    config.env.push((key.to_owned(), v.to_owned()));
                }
                "--agent-timeout-s" => {
                    let s = seconds(&flag, &value)?;
                    config.timeout = (s > 0.0).then(|| Duration::from_secs_f64(s));
                }
                "--agent-kill-grace-s" => {
                    config.kill_grace = Duration::from_secs_f64(seconds(&flag, &value)?);
                }
                "--agent-max-stdout-bytes" => config.max_stdout_bytes = count(&flag, &value)?,
                "--agent-max-stderr-bytes" => config.max_stderr_bytes = count(&flag, &value)?,
                _ => unreachable!("AGENT_FLAGS lists the flags handled here"),
            }
        }
        config.validate().map(Some)
    }
}

/// The flags [`CommandAgentConfig::take_cli_flags`] understands, for a CLI's usage text.
pub const AGENT_CMD_USAGE: &str = "[--agent-cmd 'CMD' (run with sh -c per sample) [--agent-cwd DIR] \
[--agent-env KEY=VALUE]... [--agent-timeout-s S (0: none; default 3600)] [--agent-kill-grace-s S (5)] \
[--agent-max-stdout-bytes N (1048576)] [--agent-max-stderr-bytes N (4096)]]";

const AGENT_FLAGS: [&str; 7] = [
    "--agent-cmd",
    "--agent-cwd",
    "--agent-env",
    "--agent-timeout-s",
    "--agent-kill-grace-s",
    "--agent-max-stdout-bytes",
    "--agent-max-stderr-bytes",
];

fn seconds(flag: &str, value: &str) -> Result<f64> {
    match value.parse::<f64>() {
        Ok(s) if (0.0..1e9).contains(&s) => Ok(s),
        _ => Err(Error::Config(format!(
            "{flag} expects seconds, got {value:?}"
        ))),
    }
}

fn count(flag: &str, value: &str) -> Result<usize> {
    value
        .parse()
        .map_err(|_| Error::Config(format!("{flag} expects a number, got {value:?}")))
}

/// What an agent printed: its reward and metadata.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentOutput {
    /// `"reward"`, if given (a number or an object).
    pub reward: Option<Value>,
    /// `"metadata"` (empty when not given).
    pub metadata: Map<String, Value>,
}

impl AgentOutput {
    /// Reads the protocol's object from the last non-empty line of `stdout`; empty stdout is
    /// an empty output.
    pub fn parse(stdout: &[u8]) -> std::result::Result<Self, String> {
        let text = std::str::from_utf8(stdout).map_err(|_| "stdout is not UTF-8".to_owned())?;
        let Some(line) = text.lines().map(str::trim).rfind(|l| !l.is_empty()) else {
            return Ok(Self::default());
        };
        let value: Value = serde_json::from_str(line).map_err(|e| {
            format!(
                "the last line of stdout is not JSON ({e}): {}",
                clip(line, 200)
            )
        })?;
        let Value::Object(mut object) = value else {
            return Err(format!(
                "the last line of stdout is not a JSON object: {}",
                clip(line, 200)
            ));
        };
        let reward = object.remove("reward");
        if let Some(r) = &reward
            && !(r.is_number() || r.is_object())
        {
            return Err(format!("\"reward\" must be a number or an object, got {r}"));
        }
        let metadata = match object.remove("metadata") {
            None => Map::new(),
            Some(Value::Object(m)) => m,
            Some(other) => {
                return Err(format!(
                    "\"metadata\" must be an object, got {}",
                    clip(&other.to_string(), 200)
                ));
            }
        };
        if metadata.contains_key(AGENT_REWARD_KEY) {
            return Err(format!(
                "\"metadata\" may not use the reserved key {AGENT_REWARD_KEY:?}; return \"reward\""
            ));
        }
        if let Some(key) = object.keys().next() {
            return Err(format!(
                "unknown key {key:?} in the agent's output (allowed: \"reward\", \"metadata\")"
            ));
        }
        Ok(Self { reward, metadata })
    }
}

fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// An [`Agent`] that runs a command per sample (see the [module](self) for the protocol).
#[derive(Debug, Clone)]
pub struct CommandAgent {
    config: Arc<CommandAgentConfig>,
}

impl CommandAgent {
    /// An agent running `config` (validated here).
    pub fn new(config: CommandAgentConfig) -> Result<Self> {
        Ok(Self {
            config: Arc::new(config.validate()?),
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &CommandAgentConfig {
        &self.config
    }

    /// The JSON the command reads on stdin for `ctx`.
    pub fn stdin_payload(ctx: &AgentContext) -> Value {
        let session_url = ctx.base_url.trim_end_matches('/');
        json!({
            "base_url": format!("{session_url}/v1"),
            "session_url": session_url,
            "session_id": session_url.rsplit('/').next().unwrap_or_default(),
            "prompt": ctx.prompt,
            "sampling_params": ctx.request_kwargs,
            "metadata": ctx.metadata,
        })
    }

    /// Runs the command once for `ctx` and reads its output; every failure is an
    /// [`Error::AgentCommand`].
    pub async fn run_command(&self, ctx: &AgentContext) -> Result<AgentOutput> {
        self.run_once(ctx).await.map_err(|f| Error::AgentCommand {
            failure: f
                .message
                .strip_prefix("agent command ")
                .unwrap_or(&f.message)
                .to_owned(),
            stderr_tail: f.stderr_tail,
        })
    }

    /// The command line as the operator wrote it (`sh -c LINE` shows `LINE`).
    pub fn command_line(&self) -> String {
        let c = &self.config;
        match c.args.as_slice() {
            [flag, line] if c.program == "sh" && flag == "-c" => line.clone(),
            args => std::iter::once(c.program.as_str())
                .chain(args.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(" "),
        }
    }

    /// [`CommandAgent::run_command`] with the failure classified.
    async fn run_once(&self, ctx: &AgentContext) -> std::result::Result<AgentOutput, AgentFailure> {
        let c = &self.config;
        let command_line = self.command_line();
        let failure = |kind: AgentFailureKind, what: String, tail: Vec<u8>| {
            AgentFailure::new(kind, format!("agent command {command_line:?} {what}"))
                .with_stderr_tail(String::from_utf8_lossy(&tail).into_owned())
        };
        let session_url = ctx.base_url.trim_end_matches('/');
        let input = serde_json::to_vec(&Self::stdin_payload(ctx)).map_err(|e| {
            failure(
                AgentFailureKind::Spawn,
                format!("cannot encode its input: {e}"),
                Vec::new(),
            )
        })?;
        let mut command = tokio::process::Command::new(&c.program);
        command
            .args(&c.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        if !c.inherit_env {
            command.env_clear();
        }
        command.envs(c.env.iter().map(|(k, v)| (k, v)));
        command.env("OPENAI_BASE_URL", format!("{session_url}/v1"));
        command.env(
            "OPENAI_API_KEY",
            ctx.api_key
                .as_ref()
                .map_or(PLACEHOLDER_API_KEY, |k| k.expose()),
        );
        if let Some(dir) = &c.working_dir {
            command.current_dir(dir);
        }
        let mut child = command.spawn().map_err(|e| {
            failure(
                AgentFailureKind::Spawn,
                format!("could not start {:?}: {e}", c.program),
                Vec::new(),
            )
        })?;
        // The child leads its own group (pgid = pid). A task of its own supervises it, so that
        // when this future is dropped (the driver's timeout) the guard below kills the group
        // and the task still reaps the leader and closes the pipes.
        let pgid = child.id().and_then(|id| i32::try_from(id).ok());
        let config = Arc::clone(&self.config);
        let supervisor = tokio::spawn(async move {
            let stdin = child.stdin.take();
            let stdout = child.stdout.take();
            let stderr = child.stderr.take();
            let mut group = ProcessGroup(pgid);
            let outcome =
                supervise(&mut child, &group, &config, input, stdin, stdout, stderr).await;
            // The group is killed and the leader reaped: disarm (the id may be reused).
            group.0 = None;
            outcome
        });
        let mut on_drop = ProcessGroup(pgid);
        let joined = supervisor.await;
        on_drop.0 = None;
        let (end, stdout, tail) = joined.map_err(|e| {
            failure(
                AgentFailureKind::Spawn,
                format!("supervision failed: {e}"),
                Vec::new(),
            )
        })?;
        match end {
            End::Exited(status) => match (status.code(), status.signal()) {
                (Some(0), _) => {}
                (Some(code), _) => {
                    return Err(failure(
                        AgentFailureKind::Exit,
                        format!("exited with code {code}"),
                        tail,
                    ));
                }
                (None, Some(signal)) => {
                    return Err(failure(
                        AgentFailureKind::Signal,
                        format!("was killed by signal {signal} ({})", signal_name(signal)),
                        tail,
                    ));
                }
                (None, None) => {
                    return Err(failure(
                        AgentFailureKind::Exit,
                        format!("ended with {status}"),
                        tail,
                    ));
                }
            },
            End::TimedOut(limit) => {
                return Err(failure(
                    AgentFailureKind::Timeout,
                    format!(
                        "timed out after {} s (process group killed)",
                        limit.as_secs_f64()
                    ),
                    tail,
                ));
            }
            End::StdoutTooLarge => {
                return Err(failure(
                    AgentFailureKind::BadOutput,
                    format!(
                        "printed more than {} bytes on stdout (killed; log to stderr)",
                        c.max_stdout_bytes
                    ),
                    tail,
                ));
            }
            End::Wait(e) => {
                return Err(failure(
                    AgentFailureKind::Signal,
                    format!("could not be waited for: {e}"),
                    tail,
                ));
            }
        }
        AgentOutput::parse(&stdout)
            .map_err(|reason| failure(AgentFailureKind::BadOutput, reason, tail))
    }
}

#[async_trait]
impl Agent for CommandAgent {
    async fn run(&self, ctx: AgentContext) -> std::result::Result<Map<String, Value>, String> {
        let output = self.run_command(&ctx).await.map_err(|e| e.to_string())?;
        let mut metadata = output.metadata;
        if let Some(reward) = output.reward {
            metadata.insert(AGENT_REWARD_KEY.into(), reward);
        }
        Ok(metadata)
    }

    async fn run_classified(
        &self,
        ctx: AgentContext,
    ) -> std::result::Result<Map<String, Value>, AgentFailure> {
        let output = self.run_once(&ctx).await?;
        let mut metadata = output.metadata;
        if let Some(reward) = output.reward {
            metadata.insert(AGENT_REWARD_KEY.into(), reward);
        }
        Ok(metadata)
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGINT => "SIGINT",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGHUP => "SIGHUP",
        _ => "other",
    }
}

/// A process group killed (SIGKILL) on drop.
struct ProcessGroup(Option<i32>);

impl ProcessGroup {
    fn signal(&self, signal: i32) {
        if let Some(pgid) = self.0.filter(|&p| p > 1) {
            // SAFETY: kill(2) with a negative pid signals the group; no memory is involved.
            // ESRCH (the group is gone) is the expected answer once everything has exited.
            unsafe {
                libc::kill(-pgid, signal);
            }
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

enum End {
    Exited(ExitStatus),
    TimedOut(Duration),
    StdoutTooLarge,
    Wait(std::io::Error),
}

/// After the group is killed, how long the pipes may take to reach end of file (a process
/// that left the group could hold them open).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Feeds stdin, reads stdout (bounded) and stderr (tail) while waiting for the child, then
/// kills the group and reaps the child. Returns how it ended, stdout and the stderr tail.
async fn supervise(
    child: &mut Child,
    group: &ProcessGroup,
    c: &CommandAgentConfig,
    input: Vec<u8>,
    stdin: Option<ChildStdin>,
    stdout: Option<impl AsyncRead + Unpin>,
    stderr: Option<impl AsyncRead + Unpin>,
) -> (End, Vec<u8>, Vec<u8>) {
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let end = {
        let mut writer = pin!(write_stdin(stdin, input));
        let mut out_reader = pin!(read_bounded(stdout, c.max_stdout_bytes, &mut out));
        let mut err_reader = pin!(read_tail(stderr, c.max_stderr_bytes, &mut err));
        let deadline = c.timeout.map(|t| tokio::time::Instant::now() + t);
        let mut timer = pin!(async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        });
        let (mut written, mut out_done, mut err_done) = (false, false, false);
        let end = loop {
            tokio::select! {
                status = child.wait() => break match status {
                    Ok(s) => End::Exited(s),
                    Err(e) => End::Wait(e),
                },
                () = &mut timer => break End::TimedOut(c.timeout.unwrap_or_default()),
                () = &mut writer, if !written => written = true,
                too_large = &mut out_reader, if !out_done => {
                    out_done = true;
                    if too_large {
                        break End::StdoutTooLarge;
                    }
                }
                () = &mut err_reader, if !err_done => err_done = true,
            }
        };
        match &end {
            End::Exited(_) | End::Wait(_) => group.signal(libc::SIGKILL),
            End::StdoutTooLarge => {
                group.signal(libc::SIGKILL);
                let _ = child.wait().await;
            }
            End::TimedOut(_) => {
                group.signal(libc::SIGTERM);
                if tokio::time::timeout(c.kill_grace, child.wait())
                    .await
                    .is_err()
                {
                    group.signal(libc::SIGKILL);
                    let _ = child.wait().await;
                }
                // Whatever the leader did on SIGTERM, nothing of the group survives.
                group.signal(libc::SIGKILL);
            }
        }
        // Every writer of the pipes in the group is dead now: they reach end of file at once,
        // unless a process left the group and holds them; the drain limit covers that (what
        // was read until then is kept).
        let drain = async {
            if !out_done {
                out_reader.await;
            }
            if !err_done {
                err_reader.await;
            }
        };
        let _ = tokio::time::timeout(DRAIN_LIMIT, drain).await;
        end
    };
    if err.len() > c.max_stderr_bytes {
        err.drain(..err.len() - c.max_stderr_bytes);
    }
    (end, out, err)
}

/// Writes `input` and closes stdin; a reader that went away (EPIPE) or never reads is not an
/// error here (the exit status and output decide).
async fn write_stdin(stdin: Option<ChildStdin>, input: Vec<u8>) {
    if let Some(mut stdin) = stdin
        && stdin.write_all(&input).await.is_ok()
    {
        let _ = stdin.shutdown().await;
    }
}

/// Reads into `buf` up to `limit` bytes; `true` when the stream had more.
async fn read_bounded(
    stream: Option<impl AsyncRead + Unpin>,
    limit: usize,
    buf: &mut Vec<u8>,
) -> bool {
    let Some(mut stream) = stream else {
        return false;
    };
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => {
                if buf.len() + n > limit {
                    return true;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
        }
    }
}

/// Reads to end of file into `buf`, keeping at most the last `2 × limit` bytes (the caller
/// trims to `limit`).
async fn read_tail(stream: Option<impl AsyncRead + Unpin>, limit: usize, buf: &mut Vec<u8>) {
    let Some(mut stream) = stream else {
        return;
    };
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                if buf.len() > 2 * limit {
                    buf.drain(..buf.len() - limit);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_the_last_non_empty_line() {
        let out = AgentOutput::parse(b"log line\n{\"reward\": 0.5, \"metadata\": {\"a\": 1}}\n\n")
            .unwrap();
        assert_eq!(out.reward, Some(json!(0.5)));
        assert_eq!(out.metadata["a"], json!(1));
        assert_eq!(AgentOutput::parse(b"").unwrap(), AgentOutput::default());
        assert_eq!(
            AgentOutput::parse(b" \n\n").unwrap(),
            AgentOutput::default()
        );
        let out = AgentOutput::parse(b"{\"reward\": {\"acc\": 1, \"len\": 0.2}}").unwrap();
        assert_eq!(out.reward, Some(json!({"acc": 1, "len": 0.2})));
    }

    #[test]
    fn malformed_output_is_rejected() {
        for (bad, why) in [
            (&b"{\"reward\": 1.0"[..], "not JSON"),
            (b"[1, 2]", "not a JSON object"),
            (b"{\"reward\": \"high\"}", "number or an object"),
            (b"{\"reward\": null}", "number or an object"),
            (b"{\"metadata\": 3}", "must be an object"),
            (b"{\"rewards\": 1}", "unknown key"),
            (b"{\"metadata\": {\"agent_reward\": 1}}", "reserved"),
            (b"\xff\xfe", "UTF-8"),
        ] {
            let e = AgentOutput::parse(bad).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn cli_flags_are_taken_out() {
        let mut args: Vec<String> = [
            "--port",
            "1",
            "--agent-cmd",
            "python3 a.py --x 'y z'",
            "--agent-env",
            "A=b=c",
            "--agent-timeout-s",
            "0",
            "--agent-kill-grace-s",
            "0.5",
            "--agent-max-stdout-bytes",
            "100",
            "--agent-cwd",
            "/tmp",
            "--other",
        ]
        .map(String::from)
        .to_vec();
        let config = CommandAgentConfig::take_cli_flags(&mut args)
            .unwrap()
            .unwrap();
        assert_eq!(args, ["--port", "1", "--other"]);
        assert_eq!(config.program, "sh");
        assert_eq!(config.args, ["-c", "python3 a.py --x 'y z'"]);
        assert_eq!(config.env, [("A".to_owned(), "b=c".to_owned())]);
        assert_eq!(config.timeout, None);
        assert_eq!(config.kill_grace, Duration::from_millis(500));
        assert_eq!(config.max_stdout_bytes, 100);
        assert_eq!(config.max_stderr_bytes, 4096);
        assert_eq!(config.working_dir, Some(PathBuf::from("/tmp")));

        let mut none: Vec<String> = vec!["--port".into(), "1".into()];
        assert_eq!(CommandAgentConfig::take_cli_flags(&mut none).unwrap(), None);
        assert_eq!(none.len(), 2);
        for bad in [
            &["--agent-timeout-s", "5"][..],
            &["--agent-cmd"],
            &["--agent-cmd", "x", "--agent-env", "NOEQUALS"],
            &["--agent-cmd", "x", "--agent-timeout-s", "-1"],
            &["--agent-cmd", "x", "--agent-max-stdout-bytes", "0"],
            &["--agent-cmd", ""],
        ] {
            let mut args: Vec<String> = bad.iter().map(|s| s.to_string()).collect();
            assert!(
                matches!(
                    CommandAgentConfig::take_cli_flags(&mut args),
                    Err(Error::Config(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn stdin_payload_has_the_openai_base() {
        let ctx = AgentContext {
            base_url: "http://127.0.0.1:9/sessions/abc".into(),
            prompt: vec![miles_core::Message::user("hi")],
            request_kwargs: Map::from_iter([("max_tokens".to_owned(), json!(8))]),
            metadata: Map::from_iter([("k".to_owned(), json!("v"))]),
            api_key: None,
        };
        let p = CommandAgent::stdin_payload(&ctx);
        assert_eq!(p["base_url"], json!("http://127.0.0.1:9/sessions/abc/v1"));
        assert_eq!(p["session_url"], json!("http://127.0.0.1:9/sessions/abc"));
        assert_eq!(p["session_id"], json!("abc"));
        assert_eq!(p["prompt"][0]["content"], json!("hi"));
        assert_eq!(p["sampling_params"]["max_tokens"], json!(8));
        assert_eq!(p["metadata"]["k"], json!("v"));
    }
}
