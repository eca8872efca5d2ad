//! `miles-engine serve --model DIR [--host 127.0.0.1] [--port 30000]`: the embedded engine
//! behind SGLang's HTTP protocol. See [`miles_engine::cli`] for every option.

use std::process::ExitCode;
use std::sync::Arc;

use miles_engine::cli::{self, Command, ServeArgs};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_session::sglang::{serve as serve_http, sglang_router};

fn serve(args: ServeArgs) -> miles_engine::Result<()> {
    let mut info = cli::server_info(&args)?;
    let mut config = EngineConfig::default();
    if let Some(n) = args.max_running_requests {
        config.max_running_requests = n;
    }
    if let Some(n) = args.kv_token_budget {
        config.kv_token_budget = n;
    }
    if let Some(seed) = args.seed {
        config.seed = seed;
    }
    config.recompute_logprobs_via_prefill = args.recompute_logprobs;
    config.precision = match args.dtype {
        miles_core::DType::BF16 => miles_bridge::Precision::Bf16,
        miles_core::DType::F16 => miles_bridge::Precision::F16,
        _ => miles_bridge::Precision::F32,
    };
    let device = miles_ops::device::parse_device(&args.device)
        .map_err(|e| miles_engine::Error::Config(format!("--device: {e}")))?;
    let engine = EmbeddedEngine::from_pretrained(&args.model, &device, config)?;
    cli::attach_metrics(&args, &engine, &mut info)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| miles_engine::Error::Task(format!("cannot start the runtime: {e}")))?;
    let guard = args.guard_config(&info);
    runtime.block_on(serve_http(
        sglang_router(Arc::new(engine), info),
        &args.host,
        args.port,
        guard,
    ))?;
    Ok(())
}

fn main() -> ExitCode {
    match cli::parse_args(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            print!("{}", cli::USAGE);
            ExitCode::SUCCESS
        }
        Ok(Command::Serve(args)) => match serve(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("miles-engine: {error}");
                ExitCode::FAILURE
            }
        },
        Err(error) => {
            eprintln!("miles-engine: {error}");
            ExitCode::from(2)
        }
    }
}
