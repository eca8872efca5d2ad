//! Supervised fine-tuning of an HF checkpoint on a JSONL of chat conversations, with the loss
//! on the assistant's tokens only (tokens and loss mask from miles-tito's session replay, so
//! they are the ids a TITO rollout would hold), trained with miles-train's `sft_loss`.
//!
//! ```text
//! cargo run --release --example sft -- --hf-checkpoint DIR --data conversations.jsonl \
//!     --tito qwen3 --num-epoch 3 --global-batch-size 8 --lr 1e-4 --save out/sft
//! ```
//!
//! Each line of the data: `{"messages": [{"role": "user", "content": "…"}, {"role":
//! "assistant", "content": "…"}, …], "tools": [...]}` (`tools` optional). Prints the mean
//! negative log-likelihood per trained token before and after, and the loss per step.

use std::process::ExitCode;

use miles_examples::Error;
use miles_examples::args::{Cli, Parse};
use miles_examples::sft::{SftOptions, SftReport, run_sft};
use miles_tito::TitoFamily;
use serde_json::Value;

fn cli() -> Cli {
    Cli::new(
        "sft",
        "Supervised fine-tuning on a JSONL of conversations ({\"messages\": [...], \"tools\": \
         [...]} per line) with the loss on assistant tokens only. Loads an HF checkpoint \
         directory (config.json, safetensors, tokenizer.json, chat template), trains with \
         miles-train's sft_loss and AdamW, and writes the fine-tuned HF directory.",
    )
    .option(
        "--hf-checkpoint",
        "DIR",
        None,
        "the HF model directory to fine-tune (required)",
    )
    .option(
        "--data",
        "FILE",
        None,
        "the conversations, one JSON object per line (required)",
    )
    .option(
        "--tito",
        "FAMILY",
        Some("default"),
        "TITO family whose template and boundary rules tokenize the conversations (default: \
         the directory's own template; qwen3 for Qwen3-style models)",
    )
    .option(
        "--chat-template-kwargs",
        "JSON",
        None,
        "extra chat-template kwargs as a JSON object",
    )
    .option("--num-epoch", "N", Some("3"), "passes over the data")
    .option(
        "--global-batch-size",
        "N",
        Some("8"),
        "conversations per optimizer step",
    )
    .option("--lr", "LR", Some("1e-4"), "learning rate (constant)")
    .option(
        "--clip-grad",
        "X",
        Some("1.0"),
        "global gradient-norm clip (0: off)",
    )
    .option("--seed", "N", Some("0"), "shuffle seed")
    .option(
        "--save",
        "DIR",
        None,
        "write the fine-tuned HF directory here (weights, config, tokenizer files)",
    )
    .option(
        "--metrics",
        "FILE",
        None,
        "write per-step metrics as JSONL here",
    )
}

fn options(argv: Vec<String>) -> Result<Option<SftOptions>, Error> {
    let args = match cli().parse(argv)? {
        Parse::Help(text) => {
            println!("{text}");
            return Ok(None);
        }
        Parse::Args(args) => args,
    };
    let mut o = SftOptions::new(args.required("--hf-checkpoint")?, args.required("--data")?);
    o.family =
        TitoFamily::parse(args.required("--tito")?).map_err(|e| Error::Args(e.to_string()))?;
    if let Some(text) = args.get("--chat-template-kwargs") {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => o.kwargs = map,
            _ => {
                return Err(Error::Args(
                    "--chat-template-kwargs must be a JSON object".into(),
                ));
            }
        }
    }
    o.epochs = args.parsed("--num-epoch")?;
    o.global_batch_size = args.parsed("--global-batch-size")?;
    o.lr = args.parsed("--lr")?;
    o.clip_grad = args.parsed("--clip-grad")?;
    o.seed = args.parsed("--seed")?;
    o.save = args.get("--save").map(Into::into);
    o.metrics = args.get("--metrics").map(Into::into);
    Ok(Some(o))
}

fn report(r: &SftReport) {
    println!(
        "sft: {} conversations, {} trained tokens, {} steps; mean NLL per trained token {:.4} -> {:.4}",
        r.conversations, r.trained_tokens, r.steps, r.nll_before, r.nll_after
    );
}

/// Parses, trains, prints; returns the exit status (0 done, 2 bad arguments or failure).
fn run(argv: Vec<String>) -> ExitCode {
    let options = match options(argv) {
        Ok(Some(o)) => o,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sft: {e}");
            return ExitCode::from(2);
        }
    };
    let result = run_sft(&options, |step, m| {
        println!(
            "step {step:>4}: loss {:.4}  grad_norm {:.3}  lr {:.2e}",
            m.get("train/loss").copied().unwrap_or(f64::NAN),
            m.get("train/grad_norm").copied().unwrap_or(f64::NAN),
            m.get("train/lr").copied().unwrap_or(f64::NAN),
        );
    });
    match result {
        Ok(r) => {
            report(&r);
            if let Some(dir) = &options.save {
                println!("sft: wrote {}", dir.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sft: {e}");
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

    fn argv(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_reach_the_options() {
        let o = options(argv(&[
            "--hf-checkpoint",
            "m",
            "--data",
            "d.jsonl",
            "--tito",
            "qwen3",
            "--num-epoch",
            "2",
            "--global-batch-size",
            "4",
            "--lr",
            "0.01",
            "--save",
            "out",
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(o.family, TitoFamily::Qwen3);
        assert_eq!((o.epochs, o.global_batch_size, o.lr), (2, 4, 0.01));
        assert_eq!(o.save.as_deref(), Some(std::path::Path::new("out")));
        assert!(options(argv(&["--data", "d"])).is_err()); // no checkpoint
        assert!(options(argv(&["--hf-checkpoint", "m", "--data", "d", "--lr", "x"])).is_err());
        assert!(options(argv(&["--help"])).unwrap().is_none());
    }

    #[test]
    fn bad_inputs_exit_with_2() {
        assert_eq!(
            run(argv(&["--hf-checkpoint", "/no/such", "--data", "/no/data"])),
            ExitCode::from(2)
        );
        assert_eq!(run(argv(&["--bogus"])), ExitCode::from(2));
    }
}
