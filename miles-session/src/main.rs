//! `miles-session`: the session server in front of an SGLang-compatible engine.
//! See [`miles_session::cli`] for the command line.

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let args = match miles_session::cli::CliArgs::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match miles_session::cli::run(&args, None).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("miles-session: {e}");
            ExitCode::FAILURE
        }
    }
}
