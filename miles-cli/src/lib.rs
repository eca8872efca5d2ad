//! # miles-cli
//!
//! The `miles` command of miles-rs (`cargo install --path miles-cli`): one binary for every
//! job, with Miles' flag names.
//!
//! ```text
//! miles train        --hf-checkpoint DIR --prompt-data train.jsonl --rm-type math ...   # synchronous loop
//! miles train-async  --config run.toml --num-rollout 200                             # fully asynchronous
//! miles sft          --hf-checkpoint DIR --prompt-data conversations.jsonl --save-hf out/sft
//! miles eval         --hf-checkpoint DIR --eval-prompt-data aime aime.jsonl --rm-type math
//! miles serve        --model DIR --port 30000        # the embedded engine behind SGLang's protocol
//! miles session      --engine-url URL --model DIR --tito qwen3   # the session server
//! miles router       --engine-url URL1 --engine-url URL2 --model DIR   # one address over several engines
//! miles bridge       inspect DIR | convert ... | logprobs ...
//! miles tito         render ... | incremental ... | verify ... | check ...
//! miles completions  bash
//! ```
//!
//! The library holds the parser ([`args::Cli`], clap derive) and the wiring of each
//! subcommand over the library crates; every flag maps onto a field of a library config type
//! ([`miles_rollout::RolloutConfig`], [`miles_rollout::LoopConfig`],
//! [`miles_train::TrainConfig`], [`miles_engine::EngineConfig`], …) whose `Default` gives the
//! flag's default, so a Rust user gets the same run without the CLI.
//!
//! ```
//! use clap::Parser;
//! use miles_cli::args::{Cli, Command};
//!
//! let cli = Cli::try_parse_from(["miles", "train", "--lr", "2e-5", "--use-kl-loss"])?;
//! let Command::Train(args) = cli.command else { unreachable!() };
//! assert_eq!(args.train.lr, 2e-5);
//! assert!(args.train.use_kl_loss);
//! // Defaults come from the library's config types.
//! assert_eq!(args.train.clip_grad, miles_train::TrainConfig::default().clip_grad);
//! # Ok::<(), clap::Error>(())
//! ```

#[cfg(feature = "mimalloc")]
pub mod alloc;
pub mod app;
pub mod args;
pub mod argv;
pub mod bridge;
pub mod error;
pub mod hub;
pub mod logging;
pub mod memory;
pub mod miles_flags;
pub mod plot;
pub mod router;
pub mod serve;
pub mod session;
pub mod sft;
pub mod shutdown;
pub mod template_check;
pub mod tito;
pub mod train;
pub mod wiring;

pub use error::Error;
