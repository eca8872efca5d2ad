//! `miles tito` as a subprocess: render / incremental / verify against HF transformers'
//! renders and Miles' DeepSeek encoders (the fixtures miles-tito's own tests use), and its
//! errors (one line, exit 2; verify failures exit 1).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn reference() -> &'static Value {
    static DATA: OnceLock<Value> = OnceLock::new();
    DATA.get_or_init(|| {
        let path = fixtures().join("tito/deepseek_reference.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("missing fixture {}: {e}", path.display()));
        serde_json::from_str(&text).unwrap()
    })
}

fn conversation(name: &str) -> &'static Value {
    &reference()["conversations"][name]
}

fn hf_case(
    template: &str,
    conversation: &str,
    kwargs: &Value,
    gen_prompt: bool,
) -> (Value, String) {
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizers/hf_renders.json")).unwrap(),
    )
    .unwrap();
    let entry = data["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == template)
        .unwrap();
    let case = entry["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["conversation"] == conversation
                && &c["kwargs"] == kwargs
                && c["add_generation_prompt"] == gen_prompt
        })
        .unwrap();
    (
        data["conversations"][conversation].clone(),
        case["text"].as_str().unwrap().to_owned(),
    )
}

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_miles"))
        .arg("tito")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn cli_render_incremental_verify_and_errors() {
    let dir = std::env::temp_dir().join(format!("miles-tito-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kwargs = json!({"date_string": "26 Jul 2024"});
    let (conv, hf_text) = hf_case("qwen3", "miles_multi_turn_no_tool", &kwargs, true);
    let messages = dir.join("m.json");
    std::fs::write(&messages, conv["messages"].to_string()).unwrap();
    let model = fixtures().join("tokenizers/qwen3");
    let (code, out, _) = cli(&[
        "render",
        "--model",
        model.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
        "--kwargs",
        &kwargs.to_string(),
        "--add-generation-prompt",
    ]);
    assert_eq!(code, 0);
    let out: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["text"], json!(hf_text));
    assert!(out["ids"].as_array().unwrap().len() > 10);

    let text_only = fixtures().join("tokenizers/minimax-m2");
    let (code, out, _) = cli(&[
        "render",
        "--model",
        text_only.to_str().unwrap(),
        "--messages",
        messages.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["ids"],
        Value::Null
    );

    let (code, out, _) = cli(&[
        "incremental",
        "--model",
        model.to_str().unwrap(),
        "--tito",
        "qwen3",
        "--messages",
        messages.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    let out: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        out["ids"].as_array().unwrap().len(),
        out["loss_mask"].as_array().unwrap().len()
    );
    assert_eq!(out["turns"].as_array().unwrap().len(), 1);

    let (code, out, _) = cli(&[
        "verify",
        "--model",
        model.to_str().unwrap(),
        "--tito",
        "qwen3",
        "--thinking",
        "both",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.ends_with("Verdict: PASS - TITO incremental tokenization matched standard render\n")
    );
    let (code, out, _) = cli(&[
        "verify",
        "--model",
        model.to_str().unwrap(),
        "--thinking",
        "both",
    ]);
    assert_eq!(code, 1);
    assert!(out.contains("Verdict: FAIL - template is NOT append-only"));

    for bad in [
        vec![
            "render",
            "--model",
            "/definitely/missing",
            "--messages",
            messages.to_str().unwrap(),
        ],
        vec![
            "render",
            "--model",
            model.to_str().unwrap(),
            "--messages",
            "/definitely/missing.json",
        ],
        vec![
            "render",
            "--model",
            model.to_str().unwrap(),
            "--messages",
            messages.to_str().unwrap(),
            "--kwargs",
            "[1]",
        ],
        vec![
            "verify",
            "--model",
            model.to_str().unwrap(),
            "--tito",
            "nope",
        ],
    ] {
        let (code, out, err) = cli(&bad);
        assert_eq!(code, 2, "{bad:?}");
        assert!(out.is_empty());
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // Usage mistakes: clap's message with the closest name, exit 2.
    for (bad, near) in [
        (vec!["rendr"], "'render'"),
        (vec!["render", "--messags", "m.json"], "'--messages'"),
    ] {
        let (code, out, err) = cli(&bad);
        assert_eq!(code, 2, "{bad:?}");
        assert!(out.is_empty());
        assert!(err.contains(near), "{err}");
    }
}

fn cli_json(args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_miles"))
        .arg("tito")
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    (
        out.status.code().unwrap_or(-1),
        serde_json::from_str(&stdout).unwrap_or(Value::String(stdout)),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// The render case of the reference for these coordinates.
fn render_case(conv: &str, model_type: &str, kwargs: Value, gen_prompt: bool) -> &'static Value {
    reference()["renders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["conversation"] == conv
                && c["model_type"] == model_type
                && c["kwargs"] == kwargs
                && c["add_generation_prompt"] == gen_prompt
        })
        .unwrap()
}

#[test]
fn cli_renders_with_the_deepseek_families_and_checkpoints() {
    let dir = std::env::temp_dir().join(format!("miles-tito-dsv-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let conv = conversation("parallel_tools");
    let messages = dir.join("messages.json");
    let tools = dir.join("tools.json");
    std::fs::write(&messages, conv["messages"].to_string()).unwrap();
    std::fs::write(&tools, conv["tools"].to_string()).unwrap();
    for (model_type, name) in [
        ("deepseek_v32", "deepseekv32"),
        ("deepseek_v4", "deepseekv4"),
    ] {
        let model = fixtures()
            .join("tokenizers")
            .join(reference()["model_dirs"][model_type].as_str().unwrap());
        let model = model.to_str().unwrap();
        // --tito FAMILY: the family's kwargs (drop_thinking=False, thinking from the kwargs).
        for thinking in [true, false] {
            let kwargs = json!({"enable_thinking": thinking}).to_string();
            let (code, out, err) = cli_json(&[
                "render",
                "--model",
                model,
                "--tito",
                name,
                "--messages",
                messages.to_str().unwrap(),
                "--tools",
                tools.to_str().unwrap(),
                "--kwargs",
                &kwargs,
                "--add-generation-prompt",
            ]);
            assert_eq!(code, 0, "{err}");
            let case = render_case(
                "parallel_tools",
                model_type,
                json!({"drop_thinking": false, "thinking": thinking}),
                true,
            );
            assert_eq!(out["text"], case["text"]);
            assert_eq!(out["ids"], case["ids"]);
        }
        // No --tito: the checkpoint's config.json model_type picks the encoder, with the
        // caller's kwargs only (the encoder's defaults: drop_thinking=True).
        let (code, out, err) = cli_json(&[
            "render",
            "--model",
            model,
            "--messages",
            messages.to_str().unwrap(),
            "--tools",
            tools.to_str().unwrap(),
            "--kwargs",
            r#"{"enable_thinking": false}"#,
        ]);
        assert_eq!(code, 0, "{err}");
        let case = render_case(
            "parallel_tools",
            model_type,
            json!({"enable_thinking": false}),
            false,
        );
        assert_eq!(out["text"], case["text"]);
        assert_eq!(out["ids"], case["ids"]);
        // A conflicting forced kwarg, a template override and encoder errors are errors.
        let (code, _, err) = cli_json(&[
            "render",
            "--model",
            model,
            "--tito",
            name,
            "--messages",
            messages.to_str().unwrap(),
            "--kwargs",
            r#"{"drop_thinking": true}"#,
        ]);
        assert_eq!(code, 2);
        assert!(err.contains("conflicts with the value registered"), "{err}");
        let template = dir.join("t.jinja");
        std::fs::write(&template, "{{ messages }}").unwrap();
        let (code, _, err) = cli_json(&[
            "render",
            "--model",
            model,
            "--tito",
            name,
            "--template",
            template.to_str().unwrap(),
            "--messages",
            messages.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{err}");
        let bad = dir.join("bad.json");
        std::fs::write(
            &bad,
            conversation("error_bad_arguments_json")["messages"].to_string(),
        )
        .unwrap();
        let (code, _, err) = cli_json(&[
            "render",
            "--model",
            model,
            "--tito",
            name,
            "--messages",
            bad.to_str().unwrap(),
        ]);
        assert_eq!(code, 2);
        assert!(err.contains("JSONDecodeError"), "{err}");
        // incremental: a session replay over the conversation.
        let (code, out, err) = cli_json(&[
            "incremental",
            "--model",
            model,
            "--tito",
            name,
            "--messages",
            messages.to_str().unwrap(),
            "--tools",
            tools.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let replay = reference()["replays"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| {
                r["model_type"] == model_type
                    && r["name"] == "parallel_tools"
                    && r["enable_thinking"] == true
            })
            .unwrap();
        assert_eq!(out["ids"], replay["ids"]);
    }
    // verify: V4 passes Miles' trajectories it selects; V3.2 fails where Miles' V3.2 does.
    let v4 = fixtures().join("tokenizers/deepseek-v4");
    let (code, out, _) = cli_json(&[
        "verify",
        "--model",
        v4.to_str().unwrap(),
        "--tito",
        "deepseekv4",
        "--thinking",
        "both",
    ]);
    let out = out.as_str().unwrap_or_default().to_owned();
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("Template source: deepseek_v4 encoder (--tito deepseekv4)"),
        "{out}"
    );
    assert!(out.contains("Verdict: PASS - TITO incremental tokenization matched standard render"));
    let v32 = fixtures().join("tokenizers/deepseek-v32");
    let (code, out, _) = cli_json(&[
        "verify",
        "--model",
        v32.to_str().unwrap(),
        "--tito",
        "deepseekv32",
    ]);
    let out = out.as_str().unwrap_or_default().to_owned();
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] single_tool_thinking-N4-drop_thinking_off-enable_thinking_on"),
        "{out}"
    );
}

#[test]
fn the_cli_exits_2_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("miles-tito-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("loop.jinja");
    std::fs::write(
        &template,
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    )
    .unwrap();
    let messages = dir.join("messages.json");
    std::fs::write(&messages, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(["tito", "render"])
        .arg("--model")
        .arg(&model)
        .arg("--template")
        .arg(&template)
        .arg("--messages")
        .arg(&messages)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("chat template exceeded its fuel limit"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    std::fs::remove_dir_all(&dir).ok();
}
