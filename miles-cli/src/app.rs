//! `miles` from its arguments to its exit status: the command line is prepared
//! ([`crate::argv::expand`]: Miles' not-applicable flags out, `--config` in) and parsed, the
//! log subscriber installed, and the subcommand run.
//!
//! Exit status: 0 success (and `--help`, `--version`); 1 a failed run (one line on stderr,
//! `error: …`, naming the file, row, flag or URL at fault); 2 a usage mistake (clap's message,
//! with a did-you-mean where one is close); 130 / 143 a training run stopped by SIGINT /
//! SIGTERM (after its checkpoint); `tito verify` / `tito check` 1 when a case fails.

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::train::TrainCommand;

/// One line for stderr: the error with its line breaks folded.
pub fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn failed(message: &str) -> ExitCode {
    tracing::debug!(error = message, "miles failed");
    eprintln!("error: {}", one_line(message));
    ExitCode::FAILURE
}

fn usage(error: &clap::Error) -> ExitCode {
    // `--help` / `--version` print to stdout and exit 0; mistakes print to stderr and exit 2.
    let _ = error.print();
    ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2))
}

/// Runs `miles` with `argv` (program name first).
pub fn run(argv: Vec<String>) -> ExitCode {
    let expanded = match crate::argv::expand(argv) {
        Ok(expanded) => expanded,
        Err(error) => return usage(&error),
    };
    let cli = match Cli::try_parse_from(&expanded.argv) {
        Ok(cli) => cli,
        Err(error) => return usage(&error),
    };
    if let Err(message) = crate::logging::install(cli.log.log_level.as_deref(), cli.log.log_format)
    {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    if !expanded.ignored.is_empty() {
        tracing::warn!(
            "ignored {} Miles flag(s) that configure what does not exist here (see docs/miles-flags.md): {}",
            expanded.ignored.len(),
            expanded.ignored.join(" ")
        );
    }
    let training = |command: TrainCommand, args: &crate::args::TrainArgs| {
        // Training allocates and frees large tensors every step: keep freed memory for reuse.
        miles_train::retain_freed_memory();
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => return failed(&format!("cannot start the runtime: {e}")),
        };
        match runtime.block_on(crate::train::run(command, args)) {
            Ok(outcome) => match outcome.stopped_by {
                Some(code) => ExitCode::from(code),
                None => ExitCode::SUCCESS,
            },
            Err(e) => failed(&e.to_string()),
        }
    };
    match &cli.command {
        Command::Train(args) => training(TrainCommand::Train, args),
        Command::TrainAsync(args) => training(TrainCommand::TrainAsync, args),
        Command::Sft(args) => training(TrainCommand::Sft, args),
        Command::Eval(args) => training(TrainCommand::Eval, args),
        Command::Serve(args) => match crate::serve::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(&e),
        },
        Command::Session(args) => match crate::session::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(&e),
        },
        Command::Router(args) => match crate::router::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(&e),
        },
        Command::Bridge { command } => match crate::bridge::run(command) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(&e),
        },
        Command::Tito { command } => match crate::tito::run(command) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("error: {}", one_line(&e));
                ExitCode::from(2)
            }
        },
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut command, "miles", &mut std::io::stdout());
            ExitCode::SUCCESS
        }
    }
}
