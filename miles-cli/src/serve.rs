//! `miles serve`: an HF checkpoint in the embedded engine, behind SGLang's HTTP protocol
//! (miles-session's [`sglang_router`] and [`miles_session::guard`]). Prints
//! `listening on http://ADDR` once bound; on SIGINT / SIGTERM it stops accepting, lets the
//! requests in flight finish (up to `--shutdown-timeout-s`) and exits 0.

use std::sync::Arc;
use std::time::Duration;

use miles_engine::serve::{ServeOptions, attach_metrics, server_info};
use miles_engine::{EmbeddedEngine, EngineConfig};
use miles_session::guard::ApiKey;
use miles_session::sglang::sglang_router;

use crate::args::ServeArgs;
use crate::shutdown::Signals;

/// The engine server's options from the command line (`--model` resolved, `--api-key` else
/// `$MILES_API_KEY`).
pub fn options(args: &ServeArgs) -> Result<ServeOptions, String> {
    let api_key = match &args.api_key {
        Some(key) => Some(ApiKey::new(key.clone()).map_err(|e| format!("--api-key: {e}"))?),
        None => ApiKey::from_env().map_err(|e| e.to_string())?,
    };
    let usize_of = |n: Option<u64>| n.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    Ok(ServeOptions {
        model: crate::hub::resolve(&args.model, "--model")?,
        tokenizer: args.tokenizer.clone(),
        tito: args.tito.clone(),
        host: args.host.clone(),
        port: args.port,
        served_model_name: args.served_model_name.clone(),
        max_running_requests: Some(args.max_running_requests),
        kv_token_budget: Some(args.kv_token_budget),
        mem_fraction_static: Some(args.mem_fraction_static),
        seed: Some(args.seed),
        recompute_logprobs: !args.no_recompute_logprobs,
        max_n: usize_of(args.max_n),
        max_request_bytes: usize_of(args.max_request_bytes),
        weights_root: args.weights_root.clone(),
        api_key,
        max_connections: usize_of(args.max_connections),
        max_concurrent_requests: usize_of(args.max_concurrent_requests),
        header_read_timeout_s: args.header_read_timeout_s,
        request_timeout_s: args.request_timeout_s,
        enable_metrics: args.enable_metrics,
        device: args.device.clone(),
        dtype: match (args.bf16, args.fp16) {
            (true, _) => miles_core::DType::BF16,
            (false, true) => miles_core::DType::F16,
            (false, false) => miles_core::DType::F32,
        },
    })
}

/// Runs `miles serve` until a signal; the error is one line for the user.
pub fn run(args: &ServeArgs) -> Result<(), String> {
    let options = options(args)?;
    let mut info = server_info(&options).map_err(|e| e.to_string())?;
    let defaults = EngineConfig::default();
    let config = EngineConfig {
        max_running_requests: options
            .max_running_requests
            .unwrap_or(defaults.max_running_requests),
        kv_token_budget: options.kv_token_budget.unwrap_or(defaults.kv_token_budget),
        kv_memory_fraction: options.mem_fraction_static.or(defaults.kv_memory_fraction),
        seed: options.seed.unwrap_or(defaults.seed),
        recompute_logprobs_via_prefill: options.recompute_logprobs,
        precision: match options.dtype {
            miles_core::DType::BF16 => miles_bridge::Precision::Bf16,
            miles_core::DType::F16 => miles_bridge::Precision::F16,
            _ => miles_bridge::Precision::F32,
        },
        ..defaults
    };
    let device =
        miles_ops::device::parse_device(&options.device).map_err(|e| format!("--device: {e}"))?;
    let engine = EmbeddedEngine::from_pretrained(&options.model, &device, config)
        .map_err(|e| format!("--model {}: {e}", options.model.display()))?;
    attach_metrics(&options, &engine, &mut info).map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let guard = options.guard_config(&info);
    let drain = Duration::from_secs_f64(args.shutdown_timeout_s);
    runtime.block_on(async move {
        // Before the listening line: a signal from then on is a clean stop.
        let mut signals = Signals::install();
        let listener = miles_session::guard::bind(&options.host, options.port)
            .await
            .map_err(|e| format!("cannot bind {}:{}: {e}", options.host, options.port))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            // A closed stdout is not fatal.
            let _ = writeln!(out, "listening on http://{addr}");
            let _ = out.flush();
        }
        if guard.api_key.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(
                %addr,
                "serving without --api-key: anyone who can reach it can generate and (with --weights-root) load weights"
            );
        }
        let app = miles_session::guard::harden(sglang_router(Arc::new(engine), info), &guard);
        crate::shutdown::serve_until_signal(listener, app, guard, &mut signals, drain).await
    })
}
