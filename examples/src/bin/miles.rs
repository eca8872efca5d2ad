//! `miles`: RL post-training from one command, with Miles' flags. See
//! [`miles_examples::miles_cli`] and `miles --help`.

use std::process::ExitCode;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    // Training allocates and frees large tensors every step: keep freed memory for reuse.
    miles_train::retain_freed_memory();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    match miles_examples::miles_cli::run(argv).await {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            // A usage mistake (unknown flag, bad value) exits 2, as argparse does; a failed
            // run exits 1.
            let usage = matches!(
                e.downcast_ref::<miles_examples::Error>(),
                Some(miles_examples::Error::Args(_))
            );
            ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}
