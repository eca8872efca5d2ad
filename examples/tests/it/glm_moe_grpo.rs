//! The RL examples end to end, as a user runs them: the reference binary for a few GRPO steps
//! at tiny size (reward, loss and version bookkeeping), a run of it killed mid-way (SIGKILL)
//! then resumed with `--resume` (it finishes every step exactly once), the same binary on an
//! HF checkpoint directory (`--hf-checkpoint`: a Qwen3, a DeepSeek-V3, GLM-4.7-Flash, Qwen3.5
//! dense and MoE, GPT-OSS) and rolling out on a `miles serve` process (`--engine-url`), and
//! the agentic example (GRPO through a session server, TITO mismatch rate 0).
//!
//! `cargo test` builds the examples before the tests, so the binaries sit next to the test
//! executable (`target/<profile>/examples/<name>`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} missing: run through `cargo test`, which builds the examples",
        path.display()
    );
    path
}

/// Tiny, fast settings: a small model, 4 prompts × 4 samples per step.
fn tiny_args(out: &Path, steps: u64) -> Vec<String> {
    [
        "--output-dir",
        out.to_str().unwrap(),
        "--num-rollout",
        &steps.to_string(),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--sft-steps",
        "20",
        "--sft-batch-size",
        "16",
        "--num-sft-prompts",
        "100",
        "--num-train-prompts",
        "200",
        "--num-eval-prompts",
        "16",
        "--hidden-size",
        "32",
        "--num-layers",
        "2",
        "--eval-interval",
        "2",
        "--save-interval",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn metrics(out: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).expect("JSON line");
            let step = v["step"].as_u64().expect("step");
            let m = v
                .as_object()
                .unwrap()
                .iter()
                .filter_map(|(k, v)| v.as_f64().map(|x| (k.clone(), x)))
                .collect();
            (step, m)
        })
        .collect()
}

/// The metrics of the steps that trained (those with `train/pg_loss`), in order.
fn training_records(out: &Path) -> Vec<BTreeMap<String, f64>> {
    metrics(out)
        .into_iter()
        .filter(|(_, m)| m.contains_key("train/pg_loss"))
        .map(|(_, m)| m)
        .collect()
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("miles-grpo-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Four synchronous steps log finite metrics, push one weight version each and write every
/// artefact; TensorBoard files carry the same values as `metrics.jsonl`. (That GRPO raises
/// the reward is `grpo_learns.rs`' job: four tiny steps are too few to assert it.)
#[test]
fn a_few_grpo_steps_log_metrics_versions_and_tensorboard_files() {
    let out = fresh_dir("e2e");
    let status = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, 4))
        .args(["--sync", "--use-tensorboard"])
        .status()
        .expect("run the example");
    assert!(status.success());
    // Every JSONL value is in the TensorBoard files at the same step (as f32).
    let mut scalars = BTreeMap::new();
    for entry in std::fs::read_dir(out.join("tensorboard")).unwrap() {
        let path = entry.unwrap().path();
        for event in miles_core::tensorboard::read_event_file(&path).unwrap() {
            for (tag, value) in event.scalars {
                scalars.insert((event.step, tag), value);
            }
        }
    }
    let logged = metrics(&out);
    assert!(!logged.is_empty());
    for (step, m) in &logged {
        for (name, value) in m.iter().filter(|(name, _)| name.as_str() != "step") {
            let key = (*step as i64, name.clone());
            assert_eq!(scalars.get(&key), Some(&(*value as f32)), "{key:?}");
        }
    }
    let train = training_records(&out);
    assert_eq!(train.len(), 4, "one training record per step");
    for m in &train {
        for key in [
            "rollout/raw_reward",
            "train/grad_norm",
            "train/ppo_kl",
            "perf/rollout_time",
        ] {
            assert!(m[key].is_finite(), "{key}");
        }
        assert!((0.0..=1.0).contains(&m["rollout/raw_reward"]));
        // Embedded engine + trainer scoring: rollout log-probs are the trainer's.
        assert_eq!(m["train/train_rollout_logprob_abs_diff"], 0.0);
    }
    // Held-out evaluation before training and at the eval interval.
    assert!(
        metrics(&out)
            .iter()
            .any(|(_, m)| m.contains_key("eval/addition/raw_reward"))
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    // Four steps, one weight update each.
    assert_eq!(summary["weight_version"], 4);
    for key in ["reward_initial", "reward_after_warm_start", "reward_final"] {
        let r = summary[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&r), "{key} = {r}");
    }
    assert!(out.join("final/model.safetensors").exists());
    // The warm-start is saved as an HF checkpoint of its own.
    assert!(out.join("warm_start/model.safetensors").exists());
    assert!(out.join("warm_start/config.json").exists());
    assert!(out.join("curves.svg").exists());
    let svg = std::fs::read_to_string(out.join("curves.svg")).unwrap();
    assert!(svg.contains("<svg"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_killed_run_resumes_and_trains_every_step_once() {
    let out = fresh_dir("kill");
    let steps = 6;
    let mut child = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, steps))
        .stdout(Stdio::null())
        .spawn()
        .expect("start the example");
    // Kill it once two checkpoints exist.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let saved = std::fs::read_dir(out.join("checkpoints"))
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.path().join("rollout_state.json").exists())
                    .count()
            })
            .unwrap_or(0);
        if saved >= 2 {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before it could be killed");
        }
        assert!(Instant::now() < deadline, "no checkpoint in time");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
    let killed_at: Vec<u64> = metrics(&out)
        .iter()
        .filter(|(_, m)| m.contains_key("train/pg_loss"))
        .map(|(s, _)| *s)
        .collect();
    assert!((killed_at.len() as u64) < steps, "killed before the end");

    let status = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, steps))
        .args(["--resume", out.to_str().unwrap()])
        .stdout(Stdio::null())
        .status()
        .expect("resume");
    assert!(status.success());
    // Every step trained; a step logged before the kill but not checkpointed may be logged
    // again, never a checkpointed one.
    let mut trained: Vec<u64> = metrics(&out)
        .iter()
        .filter(|(_, m)| m.contains_key("train/pg_loss"))
        .map(|(s, _)| *s)
        .collect();
    trained.dedup();
    let mut unique = trained.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique, (0..steps).collect::<Vec<_>>());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["weight_version"], steps);
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn the_agentic_example_trains_through_sessions_without_tito_mismatches() {
    let out = fresh_dir("agentic");
    let args = [
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--sft-steps",
        "30",
        "--sft-batch-size",
        "16",
        "--num-train-prompts",
        "200",
        "--num-eval-prompts",
        "8",
        "--hidden-size",
        "32",
        "--num-layers",
        "2",
        "--eval-interval",
        "2",
        "--sync",
    ];
    let status = Command::new(binary("agentic_tool_call"))
        .arg("--output-dir")
        .arg(&out)
        .args(args)
        .stdout(Stdio::null())
        .status()
        .expect("run the example");
    // The example exits non-zero when no session was checked or any had a hard mismatch.
    assert!(status.success());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["weight_version"], 3);
    assert_eq!(summary["tito_mismatch_rate"], 0.0);
    assert!(summary["tito_sessions_checked"].as_u64().unwrap() > 0);
    for key in ["reward_initial", "reward_after_warm_start", "reward_final"] {
        let r = summary[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&r), "{key} = {r}");
    }
    let train = training_records(&out);
    assert_eq!(train.len(), 3, "one training record per step");
    for m in &train {
        assert!(m["train/grad_norm"].is_finite());
        assert!((0.0..=1.0).contains(&m["rollout/raw_reward"]));
        // Miles' session-mismatch metrics are there. They count every session, also those
        // no template can render back (a last turn cut at the token limit, a barely trained
        // model generating `<|im_start|>`), which the summary's rate leaves out.
        for kind in [
            "",
            "/special_token_count",
            "/non_assistant_text",
            "/assistant_text",
        ] {
            let rate = m[&format!("rollout/tito_session_mismatch_rate/v1{kind}")];
            assert!((0.0..=1.0).contains(&rate), "{kind}: {rate}");
        }
    }
    assert!(out.join("final/model.safetensors").exists());
    assert!(out.join("warm_start/model.safetensors").exists());
    let _ = std::fs::remove_dir_all(&out);
}

/// The HF model directory of the serving fixture (a tiny Qwen3 with tokenizer and template).
fn served_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/serve/qwen3-tiny-chat")
}

/// `--hf-checkpoint`: the reference binary trains a checkpoint directory it did not build
/// (a dense Qwen3, so without R3) and writes it back with a version per step.
#[test]
fn the_reference_binary_trains_an_hf_checkpoint() {
    let out = fresh_dir("hf");
    let status = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, 2))
        .arg("--hf-checkpoint")
        .arg(served_fixture())
        .args(["--sync", "--use-rollout-routing-replay", "false"])
        .stdout(Stdio::null())
        .status()
        .expect("run the example");
    assert!(status.success());
    assert_trained_checkpoint(&out, &served_fixture());
    let _ = std::fs::remove_dir_all(&out);
}

/// A two-step `--hf-checkpoint` run: two versions pushed, finite losses and gradient norms,
/// and the trained weights keep the checkpoint's tensor names and shapes. Returns the two
/// training records.
fn assert_trained_checkpoint(out: &Path, checkpoint: &Path) -> Vec<BTreeMap<String, f64>> {
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["weight_version"], 2, "{summary}");
    let train = training_records(out);
    assert_eq!(train.len(), 2);
    for m in &train {
        assert!(m["train/pg_loss"].is_finite() && m["train/grad_norm"].is_finite());
    }
    assert_eq!(
        tensor_shapes(&out.join("final/model.safetensors")),
        tensor_shapes(&checkpoint.join("model.safetensors"))
    );
    train
}

/// Tensor names and shapes of a safetensors file, sorted by name.
fn tensor_shapes(path: &Path) -> Vec<(String, Value)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut v: Vec<(String, Value)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| (k.clone(), v["shape"].clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// `--hf-checkpoint` on a DeepSeek-V3 (MLA, latent KV cache in the engine, group-limited
/// sigmoid routing): the shapes of `fixtures/models/dsv3-tiny` with the vocabulary of the
/// served Qwen3 fixture's tokenizer, random weights written by miles-bridge. Trained with
/// rollout routing replay on: routed experts recorded by the engine and replayed.
#[test]
fn the_reference_binary_trains_a_deepseek_v3_checkpoint() {
    trains_a_checkpoint_shaped_as("dsv3-tiny", "deepseek_v3");
}

/// The same on GLM-4.7-Flash (`glm4_moe_lite`: latent attention, GLM's router, MoE layers from
/// `mlp_layer_types`), the shapes of `fixtures/models/glm47flash-tiny`.
#[test]
fn the_reference_binary_trains_a_glm47_flash_checkpoint() {
    trains_a_checkpoint_shaped_as("glm47flash-tiny", "glm4_moe_lite");
}

/// The same on the other architectures of issue 43: Qwen3.5 dense and MoE (Gated DeltaNet
/// state slots beside the paged pool; the releases' `text_config` layout) and GPT-OSS
/// (attention sinks, a sliding window on alternate layers), with routing replay on the MoE ones.
#[test]
fn the_reference_binary_trains_qwen3_5_and_gpt_oss_checkpoints() {
    for (fixture, model_type) in [
        ("qwen35-tiny", "qwen3_5"),
        ("qwen35moe-tiny", "qwen3_5_moe"),
        ("gptoss-tiny", "gpt_oss"),
    ] {
        trains_a_checkpoint_shaped_as(fixture, model_type);
    }
}

/// Two GRPO steps of the reference binary with `--hf-checkpoint` on a checkpoint with the
/// shapes of `fixtures/models/<fixture>` (random weights, the served fixture's tokenizer; the
/// vocabulary set in `text_config` where the config has one), with routing replay when the
/// model has MoE layers.
fn trains_a_checkpoint_shaped_as(fixture: &str, model_type: &str) {
    use burn::tensor::Device;
    use miles_bridge::{CausalLm, ModelConfig};
    use miles_core::DType;

    let out = fresh_dir(fixture);
    let model_dir = fresh_dir(&format!("{fixture}-model"));
    std::fs::create_dir_all(&model_dir).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join(format!("models/{fixture}/config.json"))).unwrap(),
    )
    .unwrap();
    assert_eq!(config["model_type"], model_type);
    match config.get_mut("text_config") {
        Some(text) => text["vocab_size"] = 512.into(),
        None => config["vocab_size"] = 512.into(),
    }
    std::fs::write(model_dir.join("config.json"), config.to_string()).unwrap();
    let config = ModelConfig::from_file(model_dir.join("config.json")).unwrap();
    let moe = config.has_moe();
    CausalLm::init(&config, &Device::flex())
        .unwrap()
        .save_pretrained(&model_dir, DType::F32, None)
        .unwrap();
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ] {
        std::fs::copy(served_fixture().join(file), model_dir.join(file)).unwrap();
    }
    let status = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, 2))
        .arg("--hf-checkpoint")
        .arg(&model_dir)
        .arg("--sync")
        .args([
            "--use-rollout-routing-replay",
            if moe { "true" } else { "false" },
        ])
        .stdout(Stdio::null())
        .status()
        .expect("run the example");
    assert!(status.success());
    for m in assert_trained_checkpoint(&out, &model_dir) {
        if !moe {
            continue;
        }
        // Routing replay compared the trainer's routing with the recorded one on the
        // response tokens of the MoE layers.
        assert!(
            m.get("r3/compared_tokens").is_some_and(|&n| n > 0.0),
            "{m:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_dir_all(&model_dir);
}

/// `--engine-url`: the reference binary rolls out on a `miles serve` process over
/// loopback and pushes each new version to it through `update_weights_from_disk`.
#[test]
fn the_reference_binary_rolls_out_on_a_served_engine() {
    use std::io::{BufRead, BufReader, Read, Write};
    let out = fresh_dir("served");
    std::fs::create_dir_all(&out).unwrap();
    let exe = std::env::current_exe().unwrap();
    let server_bin = exe.parent().and_then(Path::parent).unwrap().join("miles");
    assert!(
        server_bin.exists(),
        "{} missing (built by `cargo test --workspace`)",
        server_bin.display()
    );
    let mut server = Command::new(server_bin)
        .args(["serve", "--port", "0", "--model"])
        .arg(served_fixture())
        .arg("--weights-root")
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_owned();
    let status = Command::new(binary("glm_moe_grpo"))
        .args(tiny_args(&out, 2))
        .arg("--hf-checkpoint")
        .arg(served_fixture())
        .args(["--engine-url", &url])
        .args(["--sync", "--use-rollout-routing-replay", "false"])
        .stdout(Stdio::null())
        .status()
        .expect("run the example");
    // The server's version, asked over plain HTTP.
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /get_weight_version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(status.success());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["weight_version"], 2, "{summary}");
    // The warm-start is version 0; the two GRPO steps pushed versions 1 and 2.
    assert!(answer.contains(r#""weight_version":"2""#), "{answer}");
    assert!(
        out.join("weights").exists(),
        "no weights written for the server"
    );
    let train = training_records(&out);
    assert_eq!(train.len(), 2);
    for m in &train {
        assert!((0.0..=1.0).contains(&m["rollout/raw_reward"]));
    }
    let _ = std::fs::remove_dir_all(&out);
}
