//! The `miles` binary end to end at tiny size, as a user runs it: a small GLM-4-MoE HF
//! directory, prompt files, a config file, each subcommand as a real subprocess, and the
//! figures a user reads (reward, loss, KL, weight version, evaluation rows, `/metrics`); two GRPO
//! steps on each architecture of `fixtures/models` issue 43 added.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use burn::tensor::Device;
use miles_examples::addition::{AdditionTask, write_jsonl};
use miles_examples::toy::{ToyModelSpec, write_model_dir};
use serde_json::Value;

use crate::process::{send_signal, wait_exit};

fn miles() -> Command {
    Command::new(env!("CARGO_BIN_EXE_miles"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("miles-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tiny GLM-4-MoE directory and addition prompts (train / held-out JSONL).
fn setup(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let model = dir.join("model");
    let spec = ToyModelSpec {
        hidden_size: 32,
        num_hidden_layers: 2,
        intermediate_size: 64,
        ..ToyModelSpec::default()
    };
    write_model_dir(&model, &spec, 7, &Device::flex()).unwrap();
    let task = AdditionTask {
        min_digits: 1,
        max_digits: 1,
        seed: 7,
    };
    let split = task.split(16, 4).unwrap();
    let train = dir.join("train.jsonl");
    let held_out = dir.join("held_out.jsonl");
    write_jsonl(&train, &split.train).unwrap();
    write_jsonl(&held_out, &split.held_out).unwrap();
    (model, train, held_out)
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("miles runs");
    assert!(
        out.status.success(),
        "miles failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json_file(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn metric_rows(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .enumerate()
        // A killed run may leave its last line unfinished; every other line must parse.
        .filter_map(|(i, l)| match serde_json::from_str(l) {
            Ok(v) => Some(v),
            Err(e) if i + 1 == lines.len() && !text.ends_with('\n') => {
                eprintln!("unfinished last line skipped: {e}");
                None
            }
            Err(e) => panic!("{}:{}: {e}: {l}", path.display(), i + 1),
        })
        .collect()
}

/// The flags every training run here shares.
fn train_flags(model: &Path, train: &Path, held_out: &Path, out: &Path) -> Vec<String> {
    [
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        train.to_str().unwrap(),
        "--label-key",
        "label",
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
        "--rm-type",
        "math",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "6",
        "--global-batch-size",
        "16",
        "--micro-batch-size",
        "16",
        "--lr",
        "1e-4",
        "--use-tis",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--use-rollout-routing-replay",
        "--eval-prompt-data",
        "sums",
        held_out.to_str().unwrap(),
        "--eval-interval",
        "2",
        "--n-samples-per-eval-prompt",
        "2",
        "--output-dir",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn finite(row: &Value, key: &str) -> f64 {
    let v = row[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {row}"));
    assert!(v.is_finite(), "{key} = {v}");
    v
}

#[test]
fn train_sync_reports_what_a_user_reads() {
    let dir = scratch("train");
    let (model, train, held_out) = setup(&dir);
    let out = dir.join("run");
    // Half of the flags from a config file, the command line overriding one of them.
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        "num-rollout = 3\nrollout_temperature = 1.0\nlr = 5e-5\n",
    )
    .unwrap();
    // Two evaluation sets from Miles' --eval-config (it overrides --eval-prompt-data): `sums`
    // with the eval flags' settings, `greedy` with its own.
    let eval_config = dir.join("eval.yaml");
    std::fs::write(
        &eval_config,
        format!(
            "eval:\n  datasets:\n    sums: {{path: {0}}}\n    \
             greedy: {{path: {0}, temperature: 0.0, n_samples_per_eval_prompt: 1}}\n",
            held_out.display()
        ),
    )
    .unwrap();
    let mut cmd = miles();
    cmd.arg("train")
        .args(train_flags(&model, &train, &held_out, &out))
        .args(["--sglang-mem-fraction-static", "0.25"])
        .arg("--eval-config")
        .arg(&eval_config)
        .arg("--config")
        .arg(&config);
    let output = run(&mut cmd);
    // The embedded engine's start-up line gives its KV pool and the bound that set it; Miles'
    // --sglang-mem-fraction-static is read, not ignored.
    let stderr = String::from_utf8_lossy(&output.stderr);
    let pool = stderr
        .lines()
        .find(|l| l.contains("KV pool allocated: "))
        .unwrap_or_else(|| panic!("no KV pool line:\n{stderr}"));
    assert!(pool.contains("kv_memory_fraction=0.25"), "{pool}");
    let tokens: usize = pool
        .split("KV pool allocated: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{pool}"));
    assert!((16..=65_536).contains(&tokens), "{pool}");
    assert!(!stderr.contains("--sglang-mem-fraction-static"), "{stderr}");
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["command"], "train");
    assert_eq!(summary["weight_version"], 3, "{summary}");
    let before = summary["eval_before"]["eval/sums/raw_reward"]
        .as_f64()
        .unwrap();
    let after = summary["eval_after"]["eval/sums/raw_reward"]
        .as_f64()
        .unwrap();
    assert!((0.0..=1.0).contains(&before) && (0.0..=1.0).contains(&after));
    // 4 prompts × 2 samples evaluated each time.
    assert_eq!(summary["eval_after"]["eval/sums/samples"], 8.0, "{summary}");
    let rows = metric_rows(&out.join("metrics.jsonl"));
    let train_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| r.get("train/pg_loss").is_some())
        .collect();
    assert_eq!(train_rows.len(), 3, "one row per rollout");
    for row in &train_rows {
        let reward = finite(row, "rollout/raw_reward");
        assert!((0.0..=1.0).contains(&reward));
        finite(row, "train/pg_loss");
        finite(row, "train/kl_loss");
        finite(row, "perf/train_time");
        finite(row, "perf/tokens_per_gpu_per_sec");
        finite(row, "perf/actor_train_tok_per_s");
        let ratio = finite(row, "perf/wait_time_ratio");
        assert!((0.0..=1.0).contains(&ratio));
        // The lr of the command line, not the config file's 5e-5.
        assert!(
            (finite(row, "train/lr") - 1e-4).abs() < 1e-12 || row["step"] == 0,
            "{row}"
        );
    }
    // Evaluated before training (step 0), at step 1 (interval 2) and after the last step,
    // both sets each time (Miles' `eval/NAME` keys, `eval/step` the step evaluated after).
    let evals: Vec<&Value> = rows
        .iter()
        .filter(|r| r.get("eval/sums/raw_reward").is_some())
        .collect();
    let steps: Vec<f64> = evals.iter().map(|r| finite(r, "eval/step")).collect();
    assert_eq!(steps, [0.0, 1.0, 2.0], "{evals:?}");
    for row in &evals {
        assert_eq!(row["eval/sums"], row["eval/sums/raw_reward"], "{row}");
        assert_eq!(row["eval/sums/samples"], 8.0, "{row}");
        assert_eq!(row["eval/greedy/samples"], 4.0, "{row}");
        finite(row, "eval/greedy-truncated_ratio");
    }
    assert!(out.join("final/model.safetensors").exists());
    assert!(out.join("curves.svg").exists());
    // The trained checkpoint evaluates with `miles eval`.
    let eval_out = dir.join("eval");
    run(miles().args([
        "eval",
        "--hf-checkpoint",
        out.join("final").to_str().unwrap(),
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
        "--rm-type",
        "math",
        "--rollout-max-response-len",
        "6",
        "--eval-prompt-data",
        "sums",
        held_out.to_str().unwrap(),
        "--n-samples-per-eval-prompt",
        "3",
        "--log-passrate",
        "--output-dir",
        eval_out.to_str().unwrap(),
    ]));
    let eval = json_file(&eval_out.join("eval.json"));
    assert_eq!(eval["eval"]["sums"]["eval/sums/samples"], 12.0, "{eval}");
    let r = eval["eval"]["sums"]["eval/sums/raw_reward"]
        .as_f64()
        .unwrap();
    assert!((0.0..=1.0).contains(&r));
    // --log-passrate (Miles' keys `eval/NAME-pass@k`, k = 1, 2 for groups of 3): with 0 / 1
    // rewards pass@1 is the mean reward; pass@2 = mean over prompts of 1 - C(3-c, 2) / C(3, 2).
    let pass1 = eval["eval"]["sums"]["eval/sums-pass@1"].as_f64().unwrap();
    let pass2 = eval["eval"]["sums"]["eval/sums-pass@2"].as_f64().unwrap();
    assert!((pass1 - r).abs() < 1e-12, "{eval}");
    assert!(pass2 >= pass1 && pass2 <= 1.0, "{eval}");
    assert_eq!(eval["eval"]["sums"].get("eval/sums-pass@4"), None, "{eval}");
    // A Parquet set in DAPO-Math's schema (message-list prompts, the label in a struct) and
    // the same rows as JSONL, scored with Miles' `dapo` rule.
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/data");
    let parquet_out = dir.join("eval_parquet");
    run(miles().args([
        "eval",
        "--hf-checkpoint",
        out.join("final").to_str().unwrap(),
        "--apply-chat-template",
        "--input-key",
        "prompt",
        "--label-key",
        "reward_model.ground_truth",
        "--rm-type",
        "dapo",
        // Miles' dapo rule returns {score, acc, pred}; training reads `score`.
        "--reward-key",
        "score",
        "--rollout-max-response-len",
        "4",
        "--eval-prompt-data",
        "dapo",
        fixtures.join("dapo_math.snappy.parquet").to_str().unwrap(),
        "jsonl",
        fixtures.join("dapo_math.jsonl").to_str().unwrap(),
        "--output-dir",
        parquet_out.to_str().unwrap(),
    ]));
    let eval = json_file(&parquet_out.join("eval.json"));
    // The five rows of each file, one sample each; four response tokens hold no
    // `Answer: …` line, which Miles' dapo rule scores −1.
    for set in ["dapo", "jsonl"] {
        assert_eq!(
            eval["eval"][set][format!("eval/{set}/samples")],
            5.0,
            "{eval}"
        );
        let r = eval["eval"][set][format!("eval/{set}/raw_reward")].as_f64();
        assert_eq!(r, Some(-1.0), "{eval}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn train_async_resumes_after_a_kill_and_serves_metrics() {
    let dir = scratch("async");
    let (model, train, held_out) = setup(&dir);
    let out = dir.join("run");
    let save = dir.join("ckpt");
    let flags = train_flags(&model, &train, &held_out, &out);
    let common = |num_rollout: &str| {
        let mut cmd = miles();
        cmd.arg("train-async")
            .args(&flags)
            .args(["--num-rollout", num_rollout, "--save-interval", "1"])
            .arg("--save")
            .arg(&save);
        cmd
    };
    // A long run, killed once its first checkpoint is written.
    let mut child = common("60")
        .args(["--metrics-port", "0", "--use-tensorboard"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut scraped = None;
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no checkpoint in 10 min"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended early: {status}");
        }
        if scraped.is_none()
            && let Ok(addr) = std::fs::read_to_string(out.join("metrics_addr"))
            && let Some(body) = scrape(&addr)
            && body.contains("miles_trainer_steps_total 1")
        {
            scraped = Some(body);
        }
        let checkpoints = std::fs::read_dir(&save)
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().join("manifest.json").exists())
                    .count()
            })
            .unwrap_or(0);
        if checkpoints >= 2 && scraped.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let body = scraped.unwrap();
    for needle in [
        "# TYPE miles_trainer_steps_total counter",
        "miles_trainer_weight_version ",
        "miles_metric_train_pg_loss ",
        "miles_metric_rollout_raw_reward ",
    ] {
        assert!(
            body.contains(needle),
            "{needle} missing from /metrics:\n{body}"
        );
    }
    parse_with_prometheus_client(&body);
    assert!(
        out.join("tensorboard").read_dir().unwrap().next().is_some(),
        "no event file"
    );
    // TensorBoard's reader sees the steps of metrics.jsonl with the same values (the last
    // step may be missing if the kill fell between the two sinks).
    if let Some(scalars) = tensorboard_scalars(&out.join("tensorboard")) {
        let rows = metric_rows(&out.join("metrics.jsonl"));
        let points = scalars["rollout/raw_reward"]
            .as_array()
            .expect("rollout/raw_reward");
        assert!(!points.is_empty());
        for point in points {
            let step = point[0].as_u64().unwrap();
            let row = rows
                .iter()
                .find(|r| r["step"] == step && r.get("rollout/raw_reward").is_some())
                .unwrap_or_else(|| panic!("step {step} not in metrics.jsonl"));
            let want = row["rollout/raw_reward"].as_f64().unwrap();
            assert!(
                (point[1].as_f64().unwrap() - want).abs() < 1e-6,
                "{point:?} vs {want}"
            );
        }
        assert!(scalars.get("train/pg_loss").is_some(), "{scalars}");
    }
    // Resume from the same directory: it continues, and ends at the full count.
    let resumed = run(common("60").arg("--load").arg(&save));
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(stdout.contains("resumed at step"), "{stdout}");
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["command"], "train-async");
    let at = summary["resumed_at"].as_u64().unwrap();
    assert!((1..60).contains(&at), "{summary}");
    assert_eq!(summary["weight_version"], 60, "{summary}");
    // The run's checkpoints as an on-policy-distillation teacher (Miles' --opd-type megatron
    // with --opd-teacher-ckpt-step) and as the reference model (--ref-load: the newest one).
    let opd_out = dir.join("opd");
    let mut opd_flags = train_flags(&model, &train, &held_out, &opd_out);
    opd_flags.retain(|f| f != "--use-rollout-routing-replay");
    let opd = |step: &str| {
        let mut cmd = miles();
        cmd.arg("train").args(&opd_flags).args([
            "--num-rollout",
            "1",
            "--use-opd",
            "--opd-type",
            "megatron",
            "--opd-teacher-ckpt-step",
            step,
        ]);
        cmd.arg("--opd-teacher-load")
            .arg(&save)
            .arg("--ref-load")
            .arg(&save);
        cmd
    };
    let output = run(&mut opd("1"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    let teacher = save.join("iter_0000001/trainer/model");
    // The newest checkpoint: the last of the 60 rollouts (ids 0 to 59).
    let reference = save.join("iter_0000059/trainer/model");
    assert!(
        stderr.contains(&format!("OPD teacher: {}", teacher.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("reference model: {}", reference.display())),
        "{stderr}"
    );
    let rows = metric_rows(&opd_out.join("metrics.jsonl"));
    let row = rows
        .iter()
        .find(|r| r.get("train/pg_loss").is_some())
        .expect("a training row");
    finite(row, "train/opd_reverse_kl");
    let output = opd("999").output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no checkpoint of step 999 (iter_0000999)"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn train_async_with_an_agent_in_python() {
    let dir = scratch("agent");
    let (model, train, held_out) = setup(&dir);
    let out = dir.join("run");
    let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/agents/sum_agent.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    // No --rm-type: the agent's own reward is trained on.
    let flags: Vec<String> = train_flags(&model, &train, &held_out, &out)
        .into_iter()
        .filter(|f| f != "--rm-type" && f != "math")
        .collect();
    run(miles()
        .arg("train-async")
        .args(&flags)
        .args([
            "--num-rollout",
            "3",
            "--tito",
            "qwen3",
            "--agent-timeout-s",
            "120",
        ])
        .arg("--save-debug-trajectory-data")
        .arg(dir.join("trajectory/{rollout_id}.jsonl"))
        .arg("--agent-cmd")
        .arg(format!("{python} {}", agent.display())));
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["weight_version"], 3, "{summary}");
    // Miles' trajectory rows, one per sample (4 prompts × 4 samples), keys in Miles' order,
    // the conversation the agent had: the prompt's messages, then the model's answer.
    for rollout in 0..3 {
        let path = dir.join(format!("trajectory/{rollout}.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
        let rows: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 16, "{text}");
        for row in &rows {
            let keys: Vec<&str> = row
                .as_object()
                .unwrap()
                .keys()
                .map(String::as_str)
                .collect();
            assert_eq!(
                keys,
                [
                    "sample_index",
                    "group_index",
                    "status",
                    "reward",
                    "prompt",
                    "messages"
                ]
            );
            let messages = row["messages"].as_array().unwrap();
            assert!(messages.iter().any(|m| m["role"] == "user"), "{row}");
            assert_eq!(messages.last().unwrap()["role"], "assistant", "{row}");
            assert!(row["reward"].is_number(), "{row}");
        }
    }
    let rows = metric_rows(&out.join("metrics.jsonl"));
    let train_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| r.get("train/pg_loss").is_some())
        .collect();
    assert_eq!(train_rows.len(), 3);
    for row in train_rows {
        let reward = finite(row, "rollout/raw_reward");
        assert!((0.0..=1.0).contains(&reward), "{row}");
        // The async loop's throughput: the batch's response tokens over the step.
        assert!(finite(row, "perf/tokens_per_gpu_per_sec") > 0.0, "{row}");
        finite(row, "perf/wait_time_ratio");
        // Every session went through the session server's TITO comparison. (With six response
        // tokens nearly every session ends on the token limit, mid-message; a fresh render
        // closes that message, so Miles' rate counts it: the example's summary keeps those
        // apart, see the agentic example's test.)
        let rate = finite(row, "rollout/tito_session_mismatch_rate/v1");
        assert!((0.0..=1.0).contains(&rate), "{row}");
        assert_eq!(
            finite(
                row,
                "rollout/tito_session_mismatch_rate/v1/non_assistant_text"
            ),
            0.0,
            "{row}"
        );
    }
    // The agent ran once per sample (its answer is in the samples' metadata) and the held-out
    // evaluation went through it too.
    assert!(
        summary["eval_after"]["eval/sums/raw_reward"].is_number(),
        "{summary}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn train_with_generate_multi_samples_trains_one_sample_per_turn() {
    let dir = scratch("multi");
    let (model, train, held_out) = setup(&dir);
    let out = dir.join("run");
    let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/agents/sum_agent.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    // No --rm-type (the agent's reward), no evaluation; 16 rollouts of two turns per step.
    let mut flags: Vec<String> = train_flags(&model, &train, &held_out, &out);
    for drop in [
        "--rm-type",
        "--eval-prompt-data",
        "--eval-interval",
        "--n-samples-per-eval-prompt",
    ] {
        let at = flags.iter().position(|f| f == drop).unwrap();
        let n = if drop == "--eval-prompt-data" { 3 } else { 2 };
        flags.drain(at..at + n);
    }
    let debug = out.join("debug");
    run(miles()
        .arg("train")
        .args(&flags)
        .args([
            "--num-rollout",
            "2",
            "--tito",
            "qwen3",
            "--agent-timeout-s",
            "120",
            "--generate-multi-samples",
            "--save-debug-rollout-data",
        ])
        .arg(debug.join("{rollout_id}.json"))
        .arg("--agent-cmd")
        .arg(format!("{python} {} 2", agent.display())));
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["weight_version"], 2, "{summary}");

    // The samples trained at rollout 0: one per turn, siblings sharing a rollout id and reward.
    let samples = json_file(&debug.join("0.json"));
    let samples = samples.as_array().unwrap();
    let mut rollouts: std::collections::BTreeMap<u64, Vec<&Value>> = Default::default();
    for s in samples {
        let id = s["rollout_id"].as_u64().or(s["index"].as_u64()).unwrap();
        rollouts.entry(id).or_default().push(s);
    }
    assert_eq!(rollouts.len(), 16, "4 prompts × 4 rollouts");
    assert!(samples.len() > rollouts.len(), "{} samples", samples.len());
    let mut two_turn = 0;
    for (id, siblings) in &rollouts {
        let reward = &siblings[0]["reward"];
        assert!(reward.is_number(), "rollout {id}: {reward}");
        let mut previous: Option<Vec<u64>> = None;
        for s in siblings {
            assert_eq!(&s["reward"], reward, "one reward per rollout");
            let tokens: Vec<u64> = serde_json::from_value(s["tokens"].clone()).unwrap();
            let len = s["response_length"].as_u64().unwrap() as usize;
            let mask: Vec<u8> = serde_json::from_value(s["loss_mask"].clone()).unwrap();
            // This turn's response, and only it, is trained on.
            assert_eq!(mask, vec![1u8; len], "rollout {id}");
            let log_probs = s["rollout_log_probs"].as_array().unwrap();
            assert_eq!(log_probs.len(), len);
            if let Some(prev) = &previous {
                // The next turn's prompt holds the previous turn and the user's follow-up.
                assert!(tokens.len() - len > prev.len(), "rollout {id}");
                assert_eq!(&tokens[..prev.len()], &prev[..], "rollout {id}");
            }
            previous = Some(tokens);
        }
        if siblings.len() == 2 {
            two_turn += 1;
        }
    }
    assert!(
        two_turn >= 8,
        "{two_turn} of 16 rollouts came back with both turns"
    );

    let rows = metric_rows(&out.join("metrics.jsonl"));
    let train_rows: Vec<&Value> = rows
        .iter()
        .filter(|r| r.get("train/pg_loss").is_some())
        .collect();
    assert_eq!(train_rows.len(), 2);
    for row in &train_rows {
        assert!(finite(row, "rollout/samples") > 16.0, "{row}");
        let reward = finite(row, "rollout/raw_reward");
        assert!((0.0..=1.0).contains(&reward), "{row}");
        finite(row, "train/pg_loss");
        assert!(finite(row, "train/grad_norm") > 0.0, "{row}");
        // --global-batch-size 16 counts rollouts: one optimizer step per rollout.
        assert_eq!(finite(row, "train/steps"), 1.0, "{row}");
    }
    // The policy moved: the KL to the reference (the initial policy; k1, signed) is no longer
    // zero after the first update.
    let kl = |row: &Value| finite(row, "train/kl_loss").abs();
    assert!(
        kl(train_rows[1]) > kl(train_rows[0]).max(1e-9),
        "{} then {}",
        train_rows[0],
        train_rows[1]
    );

    // The fully async loop takes the variable-size groups too.
    let out = dir.join("run-async");
    let mut flags: Vec<String> = flags;
    let at = flags.iter().position(|f| f == "--output-dir").unwrap();
    flags[at + 1] = out.to_str().unwrap().to_owned();
    run(miles()
        .arg("train-async")
        .args(&flags)
        .args([
            "--num-rollout",
            "2",
            "--tito",
            "qwen3",
            "--agent-timeout-s",
            "120",
            "--generate-multi-samples",
        ])
        .arg("--agent-cmd")
        .arg(format!("{python} {} 2", agent.display())));
    assert_eq!(json_file(&out.join("summary.json"))["weight_version"], 2);
    let rows = metric_rows(&out.join("metrics.jsonl"));
    let samples: Vec<f64> = rows
        .iter()
        .filter(|r| r.get("train/pg_loss").is_some())
        .map(|r| finite(r, "rollout/samples"))
        .collect();
    assert_eq!(samples.len(), 2);
    assert!(samples.iter().all(|&n| n > 16.0), "{samples:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The first Python (`MILES_TORCH_PYTHON`, then `.venv-ref`, as `.ci/run` makes it) that
/// imports `module`. Without one: a failure in CI, a loud NOT RUN line elsewhere.
fn python_with(module: &str) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-ref/bin/python");
    let python = std::env::var_os("MILES_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([venv])
        .find(|p| {
            Command::new(p)
                .args(["-c", &format!("import {module}")])
                .output()
                .is_ok_and(|o| o.status.success())
        });
    if python.is_none() {
        let msg = format!("no Python with {module} (MILES_TORCH_PYTHON or .venv-ref)");
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("\n######## NOT RUN: a check through {module}: {msg} ########\n");
    }
    python
}

/// The TensorBoard files of a run, read by TensorBoard's own reader: `tag → [[step, value]]`.
fn tensorboard_scalars(dir: &Path) -> Option<Value> {
    let python = python_with("tensorboard")?;
    let script = "import json, sys\nfrom tensorboard.backend.event_processing import event_accumulator\n\
                  acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
                  acc.Reload()\n\
                  print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()['scalars']}))";
    let out = Command::new(python)
        .args(["-c", script])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// Parses the scraped text with the real Prometheus parser (`prometheus_client`, from
/// `MILES_TORCH_PYTHON` or `.venv-ref`, as `.ci/run` makes it) and checks the trainer's
/// families. Without such a Python: a failure in CI, a loud NOT RUN line elsewhere.
fn parse_with_prometheus_client(response: &str) {
    let text = response
        .split_once("\r\n\r\n")
        .map_or(response, |(_, body)| body);
    let Some(python) = python_with("prometheus_client") else {
        return;
    };
    let script = "import json, sys\nfrom prometheus_client.parser import text_string_to_metric_families\n\
                  fams = {f.name: [f.type, [[s.name, s.value] for s in f.samples]] for f in text_string_to_metric_families(sys.stdin.read())}\n\
                  print(json.dumps(fams))";
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let families: Value = serde_json::from_slice(&out.stdout).unwrap();
    // prometheus_client names a counter family without its `_total` suffix.
    assert_eq!(families["miles_trainer_steps"][0], "counter", "{families}");
    assert!(families["miles_trainer_steps"][1][0][1].as_f64().unwrap() >= 1.0);
    assert_eq!(families["miles_trainer_step_seconds"][0], "histogram");
    for gauge in [
        "miles_trainer_weight_version",
        "miles_trainer_tokens_per_second",
        "miles_trainer_staleness",
        "miles_metric_train_pg_loss",
        "miles_metric_rollout_raw_reward",
    ] {
        assert_eq!(families[gauge][0], "gauge", "{gauge}: {families}");
    }
}

/// `GET /metrics` over loopback with a bare HTTP/1.1 request.
fn scrape(addr: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr.trim()).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.starts_with("HTTP/1.1 200").then_some(text)
}

#[test]
fn sft_lowers_the_loss_of_its_conversations() {
    let dir = scratch("sft");
    let (model, _, _) = setup(&dir);
    let data = dir.join("conversations.jsonl");
    let lines: Vec<String> = (0..8)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("{i}+1=")},
                {"role": "assistant", "content": format!("{}", i + 1)},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    let out = dir.join("run");
    run(miles().args([
        "sft",
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        data.to_str().unwrap(),
        "--tito",
        "qwen3",
        "--num-epoch",
        "4",
        "--global-batch-size",
        "4",
        "--lr",
        "3e-3",
        "--output-dir",
        out.to_str().unwrap(),
    ]));
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["conversations"], 8);
    assert_eq!(summary["steps"], 8);
    let (before, after) = (
        summary["nll_before"].as_f64().unwrap(),
        summary["nll_after"].as_f64().unwrap(),
    );
    assert!(after < before * 0.8, "NLL {before} → {after}");
    assert!(out.join("final/model.safetensors").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mistakes_are_usage_errors_naming_the_fix() {
    let out = miles()
        .args(["train", "--rollout-batch-szie", "4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("'--rollout-batch-size'"),
        "did you mean: {err}"
    );
    let out = miles().args(["trian"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unrecognized subcommand 'trian'"), "{err}");
    assert!(err.contains("'train'"), "did you mean: {err}");
    let out = miles().args(["train", "--help"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let help = String::from_utf8_lossy(&out.stdout);
    for group in [
        "Model and checkpoints:",
        "Data:",
        "Rollout:",
        "Training:",
        "Evaluation:",
        "Reward:",
        "Agents:",
        "Logging and metrics:",
    ] {
        assert!(help.contains(group), "{group} missing:\n{help}");
    }
    // Defaults in the help are the library's.
    let clip = miles_train::TrainConfig::default().clip_grad;
    assert!(help.contains(&format!("[default: {clip}]")), "{help}");
    let out = miles().args(["train", "--use-wandb"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("wandb sync --sync-tensorboard"));
    let out = miles()
        .args([
            "train",
            "--hf-checkpoint",
            "/nonexistent",
            "--device",
            "tpu",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("--hf-checkpoint /nonexistent"), "{err}");
    // A hub id that is not in the local cache: the hub is not contacted.
    let cache = scratch("hub-cache");
    let out = miles()
        .args(["train", "--hf-checkpoint", "Qwen/Qwen3-0.6B"])
        .env("HF_HUB_CACHE", &cache)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("hub is not contacted"), "{err}");
    assert!(err.contains("models--Qwen--Qwen3-0.6B"), "{err}");
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn a_dict_reward_without_reward_key_names_its_keys_and_the_flag() {
    // Miles' dapo rule returns {score, acc, pred}: training needs --reward-key to pick one.
    let dir = scratch("dict-reward");
    let (model, train, held_out) = setup(&dir);
    let flags: Vec<String> = train_flags(&model, &train, &held_out, &dir.join("run"))
        .into_iter()
        .map(|f| if f == "math" { "dapo".to_owned() } else { f })
        .collect();
    let out = miles()
        .arg("train")
        .args(&flags)
        .args(["--num-rollout", "1", "--skip-eval-before-train"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.starts_with("error: "), "{err}");
    assert!(last.contains("--reward-key"), "{last}");
    for key in ["score", "acc", "pred"] {
        assert!(last.contains(key), "{key} not named: {last}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn help_and_version_exit_0_on_stdout() {
    for args in [
        &["--help"][..],
        &["--version"],
        &["serve", "--help"],
        &["session", "--help"],
        &["bridge", "--help"],
        &["tito", "verify", "--help"],
    ] {
        let out = miles().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(!out.stdout.is_empty(), "{args:?}");
        assert!(out.stderr.is_empty(), "{args:?}");
    }
    let out = miles().arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(
        version.starts_with(&format!("miles {}", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
    let out = miles().args(["completions", "bash"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(script.contains("train-async") && script.contains("--hf-checkpoint"));
}

#[test]
fn miles_flags_that_do_not_apply_are_ignored_with_one_warning() {
    // Ray placement and Megatron parallelism flags from a Miles launch script: accepted, named
    // in one warning; the run then fails on what matters here (no model), not on them.
    let out = miles()
        .args([
            "train",
            "--colocate",
            "--actor-num-nodes",
            "1",
            "--actor-num-gpus-per-node",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--hf-checkpoint",
            "/nonexistent/model",
        ])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    for flag in [
        "--colocate",
        "--actor-num-nodes",
        "--actor-num-gpus-per-node",
        "--tensor-model-parallel-size",
        "--sequence-parallel",
    ] {
        assert!(warnings[0].contains(flag), "{flag}: {err}");
    }
    assert!(err.contains("--hf-checkpoint /nonexistent/model"), "{err}");
    // A flag Miles does not have is still an error.
    let out = miles().args(["train", "--colocat"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn train_stops_on_sigint_with_a_checkpoint_and_resumes() {
    stops_with_a_checkpoint_and_resumes("train", libc::SIGINT, 130);
}

#[test]
fn train_async_stops_on_sigterm_with_a_checkpoint_and_resumes() {
    stops_with_a_checkpoint_and_resumes("train-async", libc::SIGTERM, 143);
}

/// `miles COMMAND` gets `signal` once a step is trained: it exits with `code` within a
/// bounded time, after the last finished step's checkpoint, its metrics and TensorBoard
/// files; `--load` resumes at the next step.
fn stops_with_a_checkpoint_and_resumes(command: &str, signal: i32, code: i32) {
    let dir = scratch(&format!("stop-{command}"));
    let (model, train, held_out) = setup(&dir);
    let out = dir.join("run");
    let save = dir.join("ckpt");
    let flags = train_flags(&model, &train, &held_out, &out);
    let log = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let mut child = miles()
        .arg(command)
        .args(&flags)
        .args(["--num-rollout", "50", "--use-tensorboard"])
        .arg("--save")
        .arg(&save)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    // Once a step is trained, interrupt the run.
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no step in 10 min"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended early: {status}");
        }
        let trained = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|t| t.lines().filter(|l| l.contains("train/pg_loss")).count())
            .unwrap_or(0);
        if trained >= 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    send_signal(&child, signal);
    let status = wait_exit(&mut child, Duration::from_secs(600));
    let stderr = std::fs::read_to_string(dir.join("stderr.log")).unwrap();
    assert_eq!(status.code(), Some(code), "{stderr}");
    assert!(stderr.contains("stopping"), "{stderr}");
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["stopped_by_signal"], code, "{summary}");
    let steps = summary["stopped_at"].as_u64().unwrap();
    assert!((1..50).contains(&steps), "{summary}");
    // The checkpoint of the last finished step, the metrics of every finished step flushed.
    let last = save.join(format!("iter_{:07}", steps - 1));
    assert!(last.join("manifest.json").exists(), "{}", last.display());
    let trained = metric_rows(&out.join("metrics.jsonl"))
        .iter()
        .filter(|r| r.get("train/pg_loss").is_some())
        .count();
    assert_eq!(trained as u64, steps);
    assert!(
        out.join("tensorboard").read_dir().unwrap().next().is_some(),
        "no event file"
    );
    // --load resumes at the step after it and runs to the end.
    let total = (steps + 1).to_string();
    let resumed = run(miles()
        .arg(command)
        .args(&flags)
        .args(["--num-rollout", &total])
        .arg("--load")
        .arg(&save)
        .arg("--save")
        .arg(&save));
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        stdout.contains(&format!("resumed at step {steps}")),
        "{stdout}"
    );
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["weight_version"], steps + 1, "{summary}");
    assert_eq!(summary.get("stopped_by_signal"), None, "{summary}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_miles_launch_script_is_accepted() {
    // Miles' scripts/run_qwen3_0_6b_fsdp.py, its argument list adapted only in paths (the
    // fixture says where it comes from). Every flag parses: the Ray / FSDP / SGLang ones are
    // named in one warning, and the run stops at the first thing that matters here, the model
    // directory that this machine does not have.
    let dir = scratch("script");
    let model = dir.join("models/Qwen3-0.6B");
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/miles_scripts/run_qwen3_0_6b_fsdp.args"),
    )
    .unwrap();
    let args: Vec<String> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            l.replace("$MODEL_DIR", model.to_str().unwrap())
                .replace("$DATA_DIR", dir.to_str().unwrap())
        })
        .collect();
    assert!(args.len() > 80, "{} arguments", args.len());
    let out = miles()
        .arg("train")
        .args(&args)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "not a usage error: {err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 1, "{err}");
    // --sglang-mem-fraction-static sizes the embedded engine's KV pool: read, not ignored.
    assert!(
        !warnings[0].contains("--sglang-mem-fraction-static"),
        "{err}"
    );
    for flag in [
        "--balance-data",
        "--rollout-num-gpus-per-engine",
        "--sglang-attention-backend",
        "--train-backend",
        "--gradient-checkpointing",
        "--train-env-vars",
        "--colocate",
        "--use-fault-tolerance",
    ] {
        assert!(warnings[0].contains(flag), "{flag}: {err}");
    }
    let last = err.lines().last().unwrap();
    assert_eq!(
        last,
        format!(
            "error: --hf-checkpoint {}: no such directory",
            model.display()
        )
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `miles eval --eval-config` over two datasets in one run, each with its own settings from
/// Miles' schema: samples per prompt, response limit (its own, or `eval.defaults`'), prompt and
/// label keys, reward rule and metadata; results under Miles' names in summary.json, one
/// metrics.jsonl row and TensorBoard.
#[test]
fn eval_config_evaluates_several_datasets_in_one_run() {
    let dir = scratch("evalcfg");
    let (model, _, held_out) = setup(&dir);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/data");
    let config = dir.join("eval.yaml");
    std::fs::write(
        &config,
        format!(
            "eval:\n  defaults:\n    max_response_len: 5\n  datasets:\n    \
             - name: sums\n      path: {}\n      rm_type: math\n      n_samples_per_eval_prompt: 3\n    \
             - name: dapo\n      path: {}\n      input_key: prompt\n      \
             label_key: reward_model.ground_truth\n      rm_type: dapo\n      max_response_len: 4\n      \
             metadata_overrides: {{source: fixture}}\n",
            held_out.display(),
            fixtures.join("dapo_math.jsonl").display()
        ),
    )
    .unwrap();
    let out = dir.join("eval");
    // No --rm-type: each dataset names its rule. Miles' dapo rule returns {score, acc, pred}.
    run(miles().args([
        "eval",
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
        "--eval-config",
        config.to_str().unwrap(),
        "--eval-reward-key",
        "score",
        "--log-passrate",
        "--use-tensorboard",
        "--output-dir",
        out.to_str().unwrap(),
    ]));
    let summary = json_file(&out.join("summary.json"));
    assert_eq!(summary["command"], "eval");
    let sums = &summary["eval"]["sums"];
    // 4 prompts × 3 samples, at most 5 tokens each (eval.defaults).
    assert_eq!(sums["eval/sums/samples"], 12.0, "{summary}");
    assert!(sums["eval/sums/response_len/max"].as_f64().unwrap() <= 5.0);
    let reward = sums["eval/sums"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&reward), "{summary}");
    assert_eq!(sums["eval/sums/raw_reward"].as_f64(), Some(reward));
    assert_eq!(sums["eval/sums-none_reward_ratio"], 0.0, "{summary}");
    let truncated = sums["eval/sums-truncated_ratio"].as_f64().unwrap();
    assert_eq!(sums["eval/sums/truncated_ratio"].as_f64(), Some(truncated));
    // pass@1 of 0/1 rewards is the mean reward; groups of 3: pass@1 and pass@2 only.
    let pass1 = sums["eval/sums-pass@1"].as_f64().unwrap();
    assert!((pass1 - reward).abs() < 1e-12, "{summary}");
    assert!(sums["eval/sums-pass@2"].as_f64().unwrap() >= pass1);
    assert_eq!(sums.get("eval/sums-pass@4"), None, "{summary}");
    // The five DAPO rows, one sample each (no pass@k), at most 4 tokens: no `Answer:` line,
    // which Miles' dapo rule scores -1 (read with --eval-reward-key score).
    let dapo = &summary["eval"]["dapo"];
    assert_eq!(dapo["eval/dapo/samples"], 5.0, "{summary}");
    assert_eq!(dapo["eval/dapo"], -1.0, "{summary}");
    assert!(dapo["eval/dapo/response_len/max"].as_f64().unwrap() <= 4.0);
    assert_eq!(dapo.get("eval/dapo-pass@1"), None, "{summary}");
    // metrics.jsonl: one row at step 0 with both sets.
    let rows = metric_rows(&out.join("metrics.jsonl"));
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["step"], 0);
    assert_eq!(rows[0]["eval/step"], 0.0);
    assert_eq!(rows[0]["eval/sums"].as_f64(), Some(reward));
    assert_eq!(rows[0]["eval/dapo"], -1.0);
    if let Some(scalars) = tensorboard_scalars(&out.join("tensorboard")) {
        let point = &scalars["eval/dapo"][0];
        assert_eq!(point[0], 0, "{scalars}");
        assert_eq!(point[1].as_f64(), Some(-1.0), "{scalars}");
        assert!(scalars.get("eval/sums-pass@2").is_some(), "{scalars}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `fixtures/models/<fixture>` as a trainable HF directory: its config and weights, the
/// vocabulary widened to the served Qwen3 fixture's tokenizer (512 ids; the embedding and
/// `lm_head` rows past the fixture's repeat its rows cyclically, every other tensor, a vision
/// tower included, as it is), and that fixture's tokenizer, chat template and generation config.
fn trainable_fixture(fixture: &str, dir: &Path) -> PathBuf {
    use safetensors::tensor::TensorView;
    const VOCAB: usize = 512;
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let source = fixtures.join("models").join(fixture);
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let mut config = json_file(&source.join("config.json"));
    let text = if config.get("text_config").is_some() {
        &mut config["text_config"]
    } else {
        &mut config
    };
    let old = text["vocab_size"].as_u64().unwrap() as usize;
    assert!(old < VOCAB, "{fixture}: vocab {old}");
    text["vocab_size"] = VOCAB.into();
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(source.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let (dtype, mut shape, mut data) =
            (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        let vocab_rows = name.ends_with("embed_tokens.weight") || name == "lm_head.weight";
        if vocab_rows && shape[0] == old {
            let row = data.len() / old;
            data = (0..VOCAB)
                .flat_map(|r| data[(r % old) * row..(r % old + 1) * row].to_vec())
                .collect();
            shape[0] = VOCAB;
        }
        tensors.push((name, dtype, shape, data));
    }
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect::<Vec<_>>();
    safetensors::tensor::serialize_to_file(views, None, &model.join("model.safetensors")).unwrap();
    let served = fixtures.join("serve/qwen3-tiny-chat");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::fs::copy(served.join(file), model.join(file)).unwrap();
    }
    model
}

/// The tensors of a safetensors file: name → (shape, bytes).
fn tensors_of(path: &Path) -> std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| (name, (v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

/// Two GRPO steps of `miles train` on each architecture of issue 43's fixtures (Qwen3.5 dense
/// and MoE with Gated DeltaNet layers, GLM-4.7-Flash's latent attention, GPT-OSS' sinks and
/// sliding window; their configs and weights with the served Qwen3 fixture's tokenizer): the
/// checkpoint loads, the embedded engine rolls out (state slots, latent or windowed KV
/// pool), every step's loss is finite with a positive gradient norm (an entropy term: the
/// fixtures' random weights earn few rewards), the engine's re-scored
/// rollout log-probs equal the trainer's (`train/train_rollout_logprob_abs_diff` = 0 at the
/// first step, before any update), and the saved checkpoint keeps every tensor name and shape
/// (a vision tower byte for byte), differs from the start and loads again.
#[test]
fn train_two_grpo_steps_on_each_new_architecture() {
    let task = AdditionTask {
        min_digits: 1,
        max_digits: 1,
        seed: 3,
    };
    let split = task.split(8, 2).unwrap();
    for fixture in [
        "qwen35-tiny",
        "qwen35moe-tiny",
        "glm47flash-tiny",
        "gptoss-tiny",
    ] {
        let dir = scratch(&format!("arch-{fixture}"));
        let model = trainable_fixture(fixture, &dir);
        let train = dir.join("train.jsonl");
        write_jsonl(&train, &split.train).unwrap();
        let out = dir.join("run");
        let mut cmd = miles();
        cmd.arg("train")
            .arg("--hf-checkpoint")
            .arg(&model)
            .arg("--prompt-data")
            .arg(&train)
            .args([
                "--label-key",
                "label",
                "--apply-chat-template",
                "--apply-chat-template-kwargs",
                r#"{"enable_thinking": false}"#,
                "--rm-type",
                "math",
                "--num-rollout",
                "2",
                "--rollout-batch-size",
                "2",
                "--n-samples-per-prompt",
                "4",
                "--rollout-max-response-len",
                "8",
                "--global-batch-size",
                "8",
                "--micro-batch-size",
                "8",
                "--lr",
                "1e-3",
                "--use-tis",
                // The random models rarely earn a reward (all-zero advantages): the entropy
                // term gives every step a gradient.
                "--entropy-coef",
                "0.01",
            ])
            .arg("--output-dir")
            .arg(&out);
        run(&mut cmd);
        let summary = json_file(&out.join("summary.json"));
        assert_eq!(summary["weight_version"], 2, "{fixture}: {summary}");
        let rows = metric_rows(&out.join("metrics.jsonl"));
        let train_rows: Vec<&Value> = rows
            .iter()
            .filter(|r| r.get("train/pg_loss").is_some())
            .collect();
        assert_eq!(train_rows.len(), 2, "{fixture}");
        for row in &train_rows {
            finite(row, "train/pg_loss");
            assert!(finite(row, "train/grad_norm") > 0.0, "{fixture}: {row}");
        }
        assert_eq!(
            finite(train_rows[0], "train/train_rollout_logprob_abs_diff"),
            0.0,
            "{fixture}: {}",
            train_rows[0]
        );
        let start = tensors_of(&model.join("model.safetensors"));
        let saved = tensors_of(&out.join("final/model.safetensors"));
        assert_eq!(
            start.iter().map(|(n, (s, _))| (n, s)).collect::<Vec<_>>(),
            saved.iter().map(|(n, (s, _))| (n, s)).collect::<Vec<_>>(),
            "{fixture}"
        );
        let changed = start.iter().filter(|(n, t)| saved[*n].1 != t.1).count();
        assert!(changed > 0, "{fixture}: training changed no weight");
        for (name, (_, data)) in start.iter().filter(|(n, _)| n.contains("visual")) {
            assert_eq!(
                &saved[name].1, data,
                "{fixture}: {name} not written back as read"
            );
        }
        let reloaded =
            miles_bridge::CausalLm::from_pretrained(out.join("final"), &Device::flex()).unwrap();
        assert_eq!(reloaded.config.vocab_size, 512, "{fixture}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn recompute_flags_are_checked_as_megatron_checks_them() {
    let dir = scratch("recompute");
    let (model, train, held_out) = setup(&dir);
    let mut flags = train_flags(&model, &train, &held_out, &dir.join("run"));
    flags.extend(["--num-rollout".to_string(), "1".to_string()]);
    let cases: [(&[&str], &str); 3] = [
        (&["--recompute-granularity", "full"], "--recompute-method"),
        (
            &[
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "block",
                "--recompute-num-layers",
                "99",
            ],
            "between 1 and",
        ),
        (
            &["--recompute-granularity", "all"],
            "--recompute-granularity",
        ),
    ];
    for (extra, needle) in cases {
        let out = miles()
            .arg("train")
            .args(&flags)
            .args(extra)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Miles' `--offload-rollout` (on by default for `train`, as Miles' `--colocate` sets it): the
/// embedded engine releases its weights and KV cache while the trainer trains and takes them
/// back at each push, and nothing else changes: the trained checkpoint is byte for byte the
/// one `--no-offload-rollout` trains, every step's losses, rewards and rollout / train
/// log-prob difference equal. `train-async` generates while it trains: it refuses the flag.
#[test]
fn offload_rollout_changes_no_result() {
    let dir = scratch("offload");
    let (model, train, held_out) = setup(&dir);
    let mut finals = Vec::new();
    let mut results = Vec::new();
    for (name, flag) in [
        ("offload", "--offload-rollout"),
        ("keep", "--no-offload-rollout"),
    ] {
        let out = dir.join(name);
        let output = run(miles()
            .arg("train")
            .args(train_flags(&model, &train, &held_out, &out))
            .args(["--num-rollout", "2", flag]));
        // Without --sglang-max-total-tokens / --sglang-mem-fraction-static the pool is what
        // the rollout can fill: 4 prompts × 4 samples at once (under 32 running) × the longest
        // sequence, in 16-token blocks; the engine allocates that budget.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let line = stderr
            .lines()
            .find(|l| l.contains("KV pool budget: "))
            .unwrap_or_else(|| panic!("no KV pool budget line:\n{stderr}"));
        let number_after = |text: &str, key: &str| -> usize {
            text.split(key)
                .nth(1)
                .and_then(|rest| rest.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{key} in {text}"))
        };
        assert!(
            line.contains("sized to the rollout: 16 sequences at once"),
            "{line}"
        );
        let sequence = number_after(line, "at once (16 requests, --max-running-requests 32) × ");
        let budget = number_after(line, "KV pool budget: ");
        assert_eq!(budget, (16 * sequence).div_ceil(16) * 16, "{line}");
        assert!(sequence > 6, "{line}");
        let pool = stderr
            .lines()
            .find(|l| l.contains("KV pool allocated: "))
            .unwrap_or_else(|| panic!("no KV pool line:\n{stderr}"));
        assert_eq!(number_after(pool, "KV pool allocated: "), budget, "{pool}");
        finals.push(tensors_of(&out.join("final/model.safetensors")));
        let keys = [
            "rollout/raw_reward",
            "train/pg_loss",
            "train/kl_loss",
            "train/grad_norm",
            "train/train_rollout_logprob_abs_diff",
            "weight_version",
        ];
        results.push(
            metric_rows(&out.join("metrics.jsonl"))
                .iter()
                .filter(|r| r.get("train/pg_loss").is_some())
                .map(|r| keys.map(|k| r.get(k).cloned()))
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(results[0].len(), 2);
    assert_eq!(results[0], results[1]);
    assert!(finals[0] == finals[1], "the trained weights differ");
    let out = miles()
        .arg("train-async")
        .args(train_flags(&model, &train, &held_out, &dir.join("async")))
        .args(["--num-rollout", "1", "--offload-rollout"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("needs the synchronous loop"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `miles` tunes mimalloc before `main` (arena memory committed on demand, freed pages purged
/// after 500 ms), unless the user set mimalloc's own variable: `MIMALLOC_PURGE_DELAY=-1`
/// (keep freed pages) must reach mimalloc. Read from mimalloc's option listing
/// (`MIMALLOC_VERBOSE=1`, printed when it initialises).
#[test]
#[cfg(target_os = "linux")]
fn the_allocator_tuning_yields_to_mimalloc_environment_variables() {
    let options = |env: &[(&str, &str)]| {
        let out = run(miles()
            .arg("--help")
            .env("MIMALLOC_VERBOSE", "1")
            .env_remove("MIMALLOC_PURGE_DELAY")
            .env_remove("MIMALLOC_ARENA_EAGER_COMMIT")
            .envs(env.iter().copied()));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let default = options(&[]);
    assert!(default.contains("option 'purge_delay': 500"), "{default}");
    assert!(
        default.contains("option 'arena_eager_commit': 0"),
        "{default}"
    );
    let user = options(&[
        ("MIMALLOC_PURGE_DELAY", "-1"),
        ("MIMALLOC_ARENA_EAGER_COMMIT", "1"),
    ]);
    assert!(user.contains("option 'purge_delay': -1"), "{user}");
    assert!(user.contains("option 'arena_eager_commit': 1"), "{user}");
}
