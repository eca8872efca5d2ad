//! Agents that fail, run as a user runs them (issue 45): the `miles` binary on the tiny Qwen3
//! chat checkpoint with a python3 agent that exits 3 — always, or on half of its runs (at
//! random) —, hangs past `--agent-timeout-s`, or prints garbage. A run whose every agent fails
//! stops with a non-zero exit whose message names the command, the cause and the agent's
//! stderr; the half-failing one finishes its rollouts, the failures counted.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use crate::process::{python, scratch, sum_prompts, tiny_chat_checkpoint};

fn train_async(dir: &Path, agent: &Path) -> Output {
    train_async_with(dir, agent, &["--agent-timeout-s", "60"])
}

fn train_async_with(dir: &Path, agent: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_miles"))
        .arg("train-async")
        .arg("--hf-checkpoint")
        .arg(tiny_chat_checkpoint())
        .arg("--prompt-data")
        .arg(sum_prompts(dir))
        .args([
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "8",
            "--rollout-max-response-len",
            "4",
            "--tito",
            "qwen3",
        ])
        .args(extra)
        .arg("--output-dir")
        .arg(dir.join("run"))
        .arg("--agent-cmd")
        .arg(format!("{} {}", python(), agent.display()))
        .output()
        .expect("miles runs")
}

#[test]
fn an_agent_that_always_fails_stops_the_run_with_its_stderr() {
    let dir = scratch("agent-always");
    let agent = dir.join("agent.py");
    std::fs::write(
        &agent,
        "import sys; sys.stdin.read(); sys.stderr.write('boom\\n'); sys.exit(3)\n",
    )
    .unwrap();
    let out = train_async(&dir, &agent);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr:\n{stderr}");
    assert!(stderr.contains("16 samples in a row failed"), "{stderr}");
    assert!(
        stderr.contains("exited with code 3") && stderr.contains(&agent.display().to_string()),
        "the command is named: {stderr}"
    );
    assert!(
        stderr.contains("boom"),
        "the agent's stderr is shown: {stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_agent_that_fails_half_of_its_runs_finishes_the_run() {
    let dir = scratch("agent-half");
    let agent = dir.join("agent.py");
    // Each run fails with probability 1/2, as the issue's agent does (a run of 16 failures in
    // a row, which stops a run, has a chance of about 2^-16 per sample here).
    let script = r#"
import json, os, random, sys, urllib.request
sample = json.load(sys.stdin)
n = random.randrange(1000)
if n % 2 == 1:
    sys.stderr.write("boom %d\n" % n)
    sys.exit(3)
body = dict(sample["sampling_params"])
body["model"] = "default"
body["messages"] = sample["prompt"]
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json",
             "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
)
with urllib.request.urlopen(request, timeout=60) as response:
    json.load(response)
print(json.dumps({"reward": 1.0}))
"#;
    std::fs::write(&agent, script).unwrap();
    let out = train_async(&dir, &agent);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr:\n{stderr}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("run/summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["weight_version"], 2, "{summary}");
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let failed: f64 = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|row| row["rollout/failed_samples/exit"].as_f64())
        .sum();
    assert!(failed >= 1.0, "the failures are counted: {metrics}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_agent_that_hangs_or_prints_garbage_stops_the_run_naming_the_cause() {
    let cases = [
        (
            "hang",
            "import sys, time; sys.stdin.read(); sys.stderr.write('thinking\\n'); sys.stderr.flush(); time.sleep(600)\n",
            "timed out after 3 s",
            "3",
        ),
        (
            "garbage",
            "import sys; sys.stdin.read(); print('{\"reward\": 1.0')\n",
            "the last line of stdout is not JSON",
            "60",
        ),
    ];
    for (name, script, cause, timeout) in cases {
        let dir = scratch(&format!("agent-{name}"));
        let agent = dir.join("agent.py");
        std::fs::write(&agent, script).unwrap();
        let started = std::time::Instant::now();
        let out = train_async_with(
            &dir,
            &agent,
            &[
                "--agent-timeout-s",
                timeout,
                "--max-consecutive-failures",
                "4",
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: stderr:\n{stderr}");
        assert!(
            stderr.contains("4 samples in a row failed") && stderr.contains(cause),
            "{name}: the cause is named: {stderr}"
        );
        assert!(
            stderr.contains(&agent.display().to_string()),
            "{name}: the command is named: {stderr}"
        );
        if name == "hang" {
            assert!(stderr.contains("thinking"), "its stderr is shown: {stderr}");
        }
        // A hung agent's process group is killed at its limit: the run ends well within the
        // bound, not after the agent's 600 s.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(120),
            "{name}: took {:?}",
            started.elapsed()
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
