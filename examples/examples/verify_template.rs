//! Checks a model directory for TITO safety before multi-turn RL: tokenizer checks, the chat
//! template's append-only property, and TITO incremental tokenization against the standard
//! render on Miles' verifier trajectories (miles-tito's verifier).
//!
//! ```text
//! cargo run --release --example verify_template -- --model fixtures/tokenizers/qwen3
//! cargo run --release --example verify_template -- --model DIR --tito default --thinking both
//! ```
//!
//! Exit status: 0 TITO-safe, 1 not TITO-safe (the report says which check failed), 2 bad
//! arguments or an unreadable directory.

use std::process::ExitCode;

use miles_examples::Error;
use miles_examples::args::{Cli, Parse};
use miles_examples::template_check::{CheckOptions, check_model_dir};
use miles_tito::{ThinkingMode, TitoFamily};
use serde_json::Value;

fn cli() -> Cli {
    Cli::new(
        "verify_template",
        "Checks a model directory (tokenizer.json, tokenizer_config.json / chat_template.jinja) \
         for token-in-token-out safety: tokenizer round trips, the template's append-only \
         property (raw mode) and TITO incremental tokenization (TITO mode) on Miles' verifier \
         trajectories. Exit status 0: TITO-safe; 1: not; 2: bad arguments or files.",
    )
    .option(
        "--model",
        "DIR",
        None,
        "the model directory to check (required)",
    )
    .option(
        "--tito",
        "FAMILY",
        None,
        "TITO family: default, qwen3, qwen35, qwennext, glm47, nemotron3, kimi25, kimi26, \
         minimax_m25, minimax_m27, gpt_oss (detected from config.json and the special tokens \
         when absent; the DeepSeek families are checked with \
         `miles tito verify --tito deepseekv32|deepseekv4`)",
    )
    .option(
        "--template",
        "FILE",
        None,
        "a chat template file to use instead of the directory's and the family's",
    )
    .option(
        "--thinking",
        "MODE",
        Some("on"),
        "trajectories to run: on (thinking, Miles' default), off, or both",
    )
    .option(
        "--kwargs",
        "JSON",
        None,
        "extra chat-template kwargs as a JSON object, e.g. '{\"enable_thinking\": false}'",
    )
    .option(
        "--trajectories",
        "FILE",
        None,
        "a trajectories JSON file instead of Miles' 17 (43 cases)",
    )
}

fn options(argv: Vec<String>) -> Result<Option<CheckOptions>, Error> {
    let args = match cli().parse(argv)? {
        Parse::Help(text) => {
            println!("{text}");
            return Ok(None);
        }
        Parse::Args(args) => args,
    };
    let mut options = CheckOptions::new(args.required("--model")?);
    options.family = args
        .get("--tito")
        .map(TitoFamily::parse)
        .transpose()
        .map_err(|e| Error::Args(e.to_string()))?;
    options.template = args.get("--template").map(Into::into);
    options.thinking = ThinkingMode::parse(args.required("--thinking")?)
        .map_err(|e| Error::Args(e.to_string()))?;
    options.trajectories = args.get("--trajectories").map(Into::into);
    if let Some(text) = args.get("--kwargs") {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => options.kwargs = map,
            _ => return Err(Error::Args("--kwargs must be a JSON object".into())),
        }
    }
    Ok(Some(options))
}

/// Runs the check and prints the report; the exit status as described in the crate docs.
fn run(argv: Vec<String>) -> ExitCode {
    let options = match options(argv) {
        Ok(Some(options)) => options,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("verify_template: {e}");
            return ExitCode::from(2);
        }
    };
    match check_model_dir(&options) {
        Ok(check) => {
            print!("{}", check.render());
            if check.tito_safe() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("verify_template: {e}");
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    run(std::env::args().skip(1).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3() -> String {
        miles_examples::fixture_path("tokenizers/qwen3")
            .unwrap()
            .display()
            .to_string()
    }

    fn argv(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn exit_status_follows_the_verdict() {
        let dir = qwen3();
        assert_eq!(run(argv(&["--model", &dir])), ExitCode::SUCCESS);
        assert_eq!(
            run(argv(&["--model", &dir, "--tito", "default"])),
            ExitCode::from(1)
        );
        assert_eq!(run(argv(&["--model", "/no/such/dir"])), ExitCode::from(2));
        assert_eq!(run(argv(&["--tito", "qwen3"])), ExitCode::from(2)); // no --model
        assert_eq!(
            run(argv(&["--model", &dir, "--tito", "nope"])),
            ExitCode::from(2)
        );
        assert_eq!(run(argv(&["--help"])), ExitCode::SUCCESS);
    }

    #[test]
    fn flags_reach_the_options() {
        let o = options(argv(&[
            "--model",
            "m",
            "--tito",
            "glm47",
            "--thinking",
            "both",
            "--kwargs",
            "{\"a\": 1}",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.family, Some(TitoFamily::Glm47));
        assert_eq!(o.thinking, ThinkingMode::Both);
        assert_eq!(o.kwargs["a"], 1);
        assert!(options(argv(&["--model", "m", "--kwargs", "[1]"])).is_err());
        assert!(options(argv(&["--model", "m", "--thinking", "maybe"])).is_err());
        let help = cli().help();
        for flag in [
            "--model",
            "--tito",
            "--template",
            "--thinking",
            "--kwargs",
            "--trajectories",
        ] {
            assert!(help.contains(flag), "{flag}");
        }
    }
}
