//! `CommandAgent`: agents as subprocesses, driven by `agent::generate` against a real session
//! server on loopback.
//!
//! The success case runs `fixtures/session/agents/weather_agent.py` (Python standard library
//! only: urllib + json) with `python3` from PATH, on the real Qwen3 tokenizer and template
//! (`fixtures/tokenizers/qwen3`, family `qwen3`). The engine plays a model that writes Miles'
//! session server's rendering of the conversation `single_tool_string_args@miles`
//! (`fixtures/session/miles_tool_renders.json`, as in `tests/it/tito_qwen3.rs`): the assembled
//! sample must hold those ids exactly. The failure cases use small `sh` agents on the byte-level
//! tokenizer.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::hf_replay::{HfReplayEngine, logprob, miles_reference};
use crate::common::{ByteChatml, ToyEngine, serve};
use miles_core::{
    Message, Prompt, Reward, RewardFn, Sample, SampleStatus, SamplingParams, WeightVersion,
};
use miles_session::agent::{AgentDriverConfig, AgentReward, generate};
use miles_session::command_agent::{CommandAgent, CommandAgentConfig};
use miles_session::http::HttpClient;
use miles_session::server::{SessionServer, SessionServerConfig};
use miles_tito::TitoChat;
use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `python3` from PATH; the test fails (never skips) without it.
fn python3() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("python3"))
        .find(|p| p.is_file())
        .expect(
            "python3 not found on PATH: tests/it/command_agent.rs runs a Python agent and needs it",
        )
}

#[tokio::test]
async fn python_agent_with_a_tool_call_becomes_one_rewarded_sample() {
    let (conversation, hf_ids) = miles_reference();
    let messages: Vec<Message> = serde_json::from_value(conversation["messages"].clone()).unwrap();
    let chat =
        Arc::new(TitoChat::load(&repo().join("fixtures/tokenizers/qwen3"), "qwen3").unwrap());
    let engine = Arc::new(HfReplayEngine::new(hf_ids.clone(), WeightVersion(4)));
    let server = SessionServer::new(engine.clone(), chat, SessionServerConfig::default());
    let url = serve(server.router()).await;

    let mut input = Sample::builder(Prompt::Messages(messages[..2].to_vec()))
        .ids(1, 5)
        .build()
        .unwrap();
    input
        .metadata
        .insert("tools".into(), conversation["tools"].clone());
    input.metadata.insert("answer".into(), json!("21.5"));
    input.metadata.insert("task".into(), json!("weather"));
    let agent = CommandAgent::new(
        CommandAgentConfig::new(
            python3().to_string_lossy(),
            [repo()
                .join("fixtures/session/agents/weather_agent.py")
                .to_string_lossy()
                .into_owned()],
        )
        .with_timeout(Some(Duration::from_secs(60))),
    )
    .unwrap();
    let params = SamplingParams {
        max_new_tokens: Some(256),
        ..SamplingParams::default()
    };
    let http = HttpClient::new(Duration::from_secs(30));
    let out = generate(
        &agent,
        &input,
        &params,
        &AgentDriverConfig::new(&url),
        &http,
    )
    .await;
    assert_eq!(
        out.status,
        SampleStatus::Completed,
        "{:?}",
        out.metadata.get("failure")
    );
    assert_eq!(out.reward, Some(Reward::Scalar(1.0)));
    assert_eq!(out.metadata["turns"], json!(2), "agent metadata merged");
    assert_eq!(
        out.metadata["task"],
        json!("weather"),
        "sample metadata kept"
    );
    assert!(!out.metadata.contains_key("agent_reward"));
    assert_eq!(out.metadata["tito_session_mismatch"], json!([]));
    assert_eq!((out.group_index, out.index), (Some(1), Some(5)));
    assert_eq!(out.weight_versions, vec!["4", "4"]);

    // Both turns, HF's ids exactly (the model stopped at <|im_end|>, before the final "\n").
    assert_eq!(out.tokens, hf_ids[..hf_ids.len() - 1]);
    let seen = engine.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    let (prompt1, out1) = &seen[0];
    let (prompt2, out2) = &seen[1];
    let observation = prompt2.len() - prompt1.len() - out1.len();
    assert_eq!(out.tokens.len() - out.response_length, prompt1.len());
    assert_eq!(out.response_length, out1.len() + observation + out2.len());
    let mut mask = vec![1u8; out1.len()];
    mask.extend(vec![0u8; observation]);
    mask.extend(vec![1u8; out2.len()]);
    assert_eq!(out.loss_mask, Some(mask));
    let mut log_probs: Vec<f64> = (0..out1.len()).map(logprob).collect();
    log_probs.extend(vec![0.0; observation]);
    log_probs.extend((0..out2.len()).map(logprob));
    assert_eq!(out.rollout_log_probs, Some(log_probs));
    assert_eq!(server.sessions_open(), 0, "session deleted");

    // The rollout manager's reward step keeps the agent's reward.
    assert_eq!(
        AgentReward::new().reward(&out).await.unwrap(),
        Reward::Scalar(1.0)
    );
    assert!(AgentReward::new().reward(&input).await.is_err());
}

async fn toy_server() -> (String, SessionServer) {
    let server = SessionServer::new(
        ToyEngine::new(),
        Arc::new(ByteChatml::default()),
        SessionServerConfig::default(),
    );
    (serve(server.router()).await, server)
}

fn toy_sample() -> Sample {
    let mut s = Sample::builder(Prompt::Messages(vec![Message::user("hello")]))
        .build()
        .unwrap();
    s.metadata.insert("task".into(), json!("toy"));
    s
}

/// Runs `agent` on a toy sample; returns the sample, its abort reason and the time taken.
async fn run(url: &str, agent: &CommandAgent, input: &Sample) -> (Sample, String, Duration) {
    let http = HttpClient::new(Duration::from_secs(10));
    let start = Instant::now();
    let out = generate(
        agent,
        input,
        &SamplingParams::default(),
        &AgentDriverConfig::new(url),
        &http,
    )
    .await;
    let took = start.elapsed();
    let text = |key: &str| {
        out.metadata
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    // What failed, then (for a subprocess) the tail of its stderr.
    let mut reason = text("failure");
    let tail = text("agent_stderr_tail");
    if !tail.is_empty() {
        reason = format!("{reason}; stderr tail: {tail}");
    }
    (out, reason, took)
}

fn shell(line: &str) -> CommandAgent {
    CommandAgent::new(CommandAgentConfig::shell(line).with_timeout(Some(Duration::from_secs(20))))
        .unwrap()
}

fn assert_failed(out: &Sample, input: &Sample, reason: &str, expected: &[&str]) {
    assert_eq!(out.status, SampleStatus::Failed, "{reason}");
    for part in expected {
        assert!(reason.contains(part), "{reason:?} lacks {part:?}");
    }
    assert_eq!(out.tokens, input.tokens);
    assert_eq!(out.reward, None);
    assert_eq!(out.metadata["task"], json!("toy"));
}

/// The state letter of a process (`/proc/PID/stat`), `None` when it no longer exists.
fn process_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next())
}

fn read_pid(path: &Path) -> i32 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

/// Gone, or a zombie of a parent that is not us (the agent's orphans belong to init). Waits
/// asynchronously: the reaping of an agent whose future was dropped happens in a task of this
/// (single-threaded) test runtime, which a blocking sleep would starve.
async fn assert_gone(pid: i32, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match process_state(pid) {
            None => return,
            Some('Z') if what != "agent" => return,
            Some(state) if Instant::now() > deadline => {
                panic!("{what} (pid {pid}) still exists in state {state}")
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

#[tokio::test]
async fn failing_agents_give_failed_samples_with_reasons() {
    let (url, server) = toy_server().await;
    let input = toy_sample();

    // Non-zero exit: the code and the stderr tail are in the reason.
    let (out, reason, _) = run(
        &url,
        &shell("echo 'tool crashed: boom' >&2; exit 3"),
        &input,
    )
    .await;
    assert_failed(
        &out,
        &input,
        &reason,
        &[
            "agent failed: agent command \"echo 'tool crashed: boom' >&2; exit 3\" exited with code 3",
            "tool crashed: boom",
        ],
    );
    assert_eq!(out.metadata["failure_kind"], json!("exit"));
    assert_eq!(
        out.metadata["agent_stderr_tail"],
        json!("tool crashed: boom\n")
    );

    // Death by a signal.
    let (out, reason, _) = run(&url, &shell("kill -SEGV $$"), &input).await;
    assert_failed(&out, &input, &reason, &["killed by signal 11 (SIGSEGV)"]);
    assert_eq!(out.metadata["failure_kind"], json!("signal"));

    // Garbage on the last line of stdout.
    let (out, reason, _) = run(&url, &shell("echo '{\"reward\": 1'"), &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["the last line of stdout is not JSON"],
    );
    assert_eq!(out.metadata["failure_kind"], json!("bad_output"));
    let (out, reason, _) = run(&url, &shell("echo '{\"reward\": \"high\"}'"), &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["\"reward\" must be a number or an object"],
    );

    // Endless stdout: killed once past the limit, not read into memory.
    let agent = CommandAgent::new(
        CommandAgentConfig::shell("yes 'all work and no play'")
            .with_max_stdout_bytes(64 << 10)
            .with_timeout(Some(Duration::from_secs(20))),
    )
    .unwrap();
    let (out, reason, took) = run(&url, &agent, &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["printed more than 65536 bytes on stdout"],
    );
    assert!(took < Duration::from_secs(10), "{took:?}");

    // Command not found, with and without a shell.
    let (out, reason, _) = run(&url, &shell("definitely-not-an-agent-7f3a --x"), &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["exited with code 127", "definitely-not-an-agent-7f3a"],
    );
    let agent = CommandAgent::new(CommandAgentConfig::new(
        "/nonexistent/definitely-not-an-agent",
        ["--x"],
    ))
    .unwrap();
    let (out, reason, _) = run(&url, &agent, &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["could not start \"/nonexistent/definitely-not-an-agent\""],
    );

    // An agent that never reads stdin, while a 4 MiB input fills the pipe: no hang, no
    // stdin error; it talked to nobody, so the session is empty.
    let mut big = toy_sample();
    big.metadata
        .insert("document".into(), json!("x".repeat(4 << 20)));
    let (out, reason, took) = run(&url, &shell("sleep 0.2"), &big).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert_eq!(reason, "empty session");
    assert!(took < Duration::from_secs(10), "{took:?}");
    // The same, closing stdin at once and failing.
    let (out, reason, _) = run(&url, &shell("exec 0<&-; echo closed >&2; exit 4"), &big).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert!(
        reason.contains("exited with code 4") && reason.contains("closed"),
        "{reason}"
    );

    // A well-behaved agent that never calls the model: its output is fine, the session empty.
    let (out, reason, _) = run(&url, &shell("echo '{\"reward\": 1.0}'"), &input).await;
    assert_eq!(
        (out.status, reason.as_str()),
        (SampleStatus::Failed, "empty session")
    );

    assert_eq!(server.sessions_open(), 0, "every session deleted");
}

#[tokio::test]
async fn timeouts_kill_the_whole_process_group() {
    let (url, server) = toy_server().await;
    let input = toy_sample();
    let dir = std::env::temp_dir().join(format!("miles-command-agent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // A shell that starts a background sleeper and waits: SIGTERM ends both.
    let config = |script: &str, name: &str| {
        CommandAgentConfig::shell(script)
            .with_env("PIDS", dir.join(name).to_string_lossy())
            .with_timeout(Some(Duration::from_millis(500)))
            .with_kill_grace(Duration::from_millis(700))
    };
    let agent = CommandAgent::new(config(
        "echo $$ > \"$PIDS.leader\"; sleep 30 & echo $! > \"$PIDS.child\"; echo waiting >&2; wait",
        "polite",
    ))
    .unwrap();
    let (out, reason, took) = run(&url, &agent, &input).await;
    assert_failed(
        &out,
        &input,
        &reason,
        &["timed out after 0.5 s (process group killed)", "waiting"],
    );
    assert!(took >= Duration::from_millis(500), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_gone(read_pid(&dir.join("polite.leader")), "agent").await;
    assert_gone(read_pid(&dir.join("polite.child")), "the agent's child").await;

    // One that ignores SIGTERM (its child inherits that): SIGKILL after the grace period.
    let agent = CommandAgent::new(config(
        "trap '' TERM; echo $$ > \"$PIDS.leader\"; sleep 30 & echo $! > \"$PIDS.child\"; wait",
        "stubborn",
    ))
    .unwrap();
    let (out, reason, took) = run(&url, &agent, &input).await;
    assert_failed(&out, &input, &reason, &["timed out after 0.5 s"]);
    assert_eq!(out.metadata["failure_kind"], json!("timeout"));
    assert!(
        took >= Duration::from_millis(1200),
        "killed before the grace: {took:?}"
    );
    assert!(took < Duration::from_secs(6), "{took:?}");
    assert_gone(read_pid(&dir.join("stubborn.leader")), "agent").await;
    assert_gone(read_pid(&dir.join("stubborn.child")), "the agent's child").await;

    // The driver's own timeout drops the agent's future: the group is killed all the same.
    let agent = CommandAgent::new(
        config(
            "echo $$ > \"$PIDS.leader\"; sleep 30 & echo $! > \"$PIDS.child\"; wait",
            "dropped",
        )
        .with_timeout(None),
    )
    .unwrap();
    let mut driver = AgentDriverConfig::new(&url);
    driver.agent_timeout = Some(Duration::from_millis(500));
    let http = HttpClient::new(Duration::from_secs(10));
    let out = generate(&agent, &input, &SamplingParams::default(), &driver, &http).await;
    assert_eq!(out.status, SampleStatus::Failed);
    assert_gone(read_pid(&dir.join("dropped.child")), "the agent's child").await;
    // Killed and reaped (no zombie) although its future was dropped.
    assert_gone(read_pid(&dir.join("dropped.leader")), "agent").await;

    assert_eq!(server.sessions_open(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn agent_sees_the_session_through_env_and_stdin() {
    let (url, _server) = toy_server().await;
    let mut input = toy_sample();
    input
        .metadata
        .insert("quote".into(), json!("'; rm -rf / #"));
    // The agent echoes what it got back as metadata (sample data never on its command line).
    let script = r#"import json, os, sys
task = json.load(sys.stdin)
print("log line")
print(json.dumps({"metadata": {"env_base": os.environ["OPENAI_BASE_URL"], "env_key": os.environ["OPENAI_API_KEY"], "extra": os.environ["EXTRA"], "stdin_base": task["base_url"], "session_url": task["session_url"], "session_id": task["session_id"], "prompt": task["prompt"], "quote": task["metadata"]["quote"], "server": task["metadata"]["session_server_id"], "max_tokens": task["sampling_params"].get("max_tokens")}}))"#;
    let agent = CommandAgent::new(
        CommandAgentConfig::new(python3().to_string_lossy(), ["-c", script])
            .with_env("EXTRA", "x=y"),
    )
    .unwrap();
    let mut ctx = miles_session::agent::AgentContext {
        base_url: format!("{url}/sessions/abc123"),
        prompt: vec![Message::user("hello")],
        request_kwargs: miles_session::agent::request_kwargs(&SamplingParams {
            max_new_tokens: Some(17),
            ..SamplingParams::default()
        }),
        metadata: input.metadata.clone(),
        api_key: None,
    };
    ctx.metadata
        .insert("session_server_id".into(), json!("127.0.0.1:1"));
    let out = agent.run_command(&ctx).await.unwrap();
    let m = &out.metadata;
    assert_eq!(m["env_base"], json!(format!("{url}/sessions/abc123/v1")));
    assert_eq!(m["stdin_base"], m["env_base"]);
    assert_eq!(m["session_url"], json!(format!("{url}/sessions/abc123")));
    assert_eq!(m["session_id"], json!("abc123"));
    assert_eq!(m["env_key"], json!("EMPTY"));
    assert_eq!(m["extra"], json!("x=y"));
    assert_eq!(m["prompt"], json!([{"role": "user", "content": "hello"}]));
    assert_eq!(m["quote"], json!("'; rm -rf / #"));
    assert_eq!(m["server"], json!("127.0.0.1:1"));
    assert_eq!(m["max_tokens"], json!(17));
    assert_eq!(out.reward, None);

    // With a server key, the agent gets it.
    ctx.api_key = Some(miles_session::guard::ApiKey::new("sk-test-123").unwrap());
    let out = agent.run_command(&ctx).await.unwrap();
    assert_eq!(out.metadata["env_key"], json!("sk-test-123"));
}
