//! `miles session`: the OpenAI-compatible session server in front of an SGLang-compatible
//! engine (miles-session's [`miles_session::cli`]). Prints `miles-session listening on
//! http://ADDR …` once bound; on SIGINT / SIGTERM it stops accepting, lets the requests in
//! flight finish (up to `--shutdown-timeout-s`) and exits 0.

use std::time::Duration;

use miles_session::cli::CliArgs;
use miles_session::guard::ApiKey;

use crate::args::SessionArgs;
use crate::shutdown::Signals;

/// The session server's options from the command line (`--api-key`, else `$MILES_API_KEY`;
/// `0` turns a limit off).
pub fn options(args: &SessionArgs) -> Result<CliArgs, String> {
    if args.model.is_none() && args.tito != "byte_chatml" {
        return Err(format!(
            "--model is required for --tito {} (only byte_chatml needs no model)",
            args.tito
        ));
    }
    let api_key = match &args.api_key {
        Some(key) => Some(ApiKey::new(key.clone()).map_err(|e| format!("--api-key: {e}"))?),
        None => ApiKey::from_env().map_err(|e| e.to_string())?,
    };
    let count = |n: usize| (n > 0).then_some(n);
    let seconds = |s: f64| (s > 0.0).then(|| Duration::from_secs_f64(s));
    Ok(CliArgs {
        engine_url: args.engine_url.clone(),
        model: args
            .model
            .as_deref()
            .map(|m| crate::hub::resolve(m, "--model"))
            .transpose()?,
        tito: args.tito.clone(),
        host: args.host.clone(),
        port: args.port,
        max_body_bytes: args.max_request_bytes,
        routed_experts: args.routed_experts,
        num_layers: args.num_layers,
        max_context_len: args.max_context_len,
        default_max_tokens: args.default_max_tokens,
        engine_timeout_s: args.engine_timeout_s,
        instance_id: args.instance_id.clone(),
        worker_threads: args.worker_threads,
        api_key,
        max_n: args.max_n,
        max_sessions: count(args.max_sessions),
        session_idle_timeout: seconds(args.session_idle_timeout),
        max_records_per_session: count(args.max_records_per_session),
        max_tokens_per_session: count(args.max_tokens_per_session),
        request_timeout: seconds(args.request_timeout_s),
        header_read_timeout: seconds(args.header_read_timeout_s),
        max_connections: count(args.max_connections),
        max_concurrent_requests: count(args.max_concurrent_requests),
        message_matcher: miles_tito::MessageMatcher::parse(&args.session_message_matcher)
            .map_err(|e| format!("--session-message-matcher: {e}"))?,
        save_debug_trajectory_data: args.save_debug_trajectory_data.is_some(),
        session_version: crate::args::session_version(args.use_session_server.as_deref()),
    })
}

/// Runs `miles session` until a signal; the error is one line for the user.
pub fn run(args: &SessionArgs) -> Result<(), String> {
    let options = options(args)?;
    let server = miles_session::cli::build(&options, None).map_err(|e| e.to_string())?;
    // Loading the tokenizer parses a large JSON document: give that memory back now.
    #[cfg(feature = "mimalloc")]
    crate::alloc::collect_now();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    #[cfg(feature = "mimalloc")]
    builder.on_thread_park(crate::alloc::collect_when_idle);
    if let Some(n) = options.worker_threads {
        builder.worker_threads(n);
    }
    let runtime = builder
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    #[cfg(feature = "mimalloc")]
    {
        let (handle, workers) = (runtime.handle().clone(), runtime.metrics().num_workers());
        if let Err(e) = std::thread::Builder::new()
            .name("miles-session-nudge".into())
            .spawn(move || crate::alloc::nudge_workers(handle, workers))
        {
            tracing::warn!(error = %e, "cannot start the idle-memory thread");
        }
    }
    let drain = Duration::from_secs_f64(args.shutdown_timeout_s);
    // The accept loop runs on a worker too (its allocations are collected like the rest).
    let served = runtime.spawn(async move {
        // Before the listening line: a signal from then on is a clean stop.
        let mut signals = Signals::install();
        let listener = miles_session::cli::bind(&options)
            .await
            .map_err(|e| e.to_string())?;
        crate::shutdown::serve_until_signal(
            listener,
            server.router(),
            options.guard_config(),
            &mut signals,
            drain,
        )
        .await?;
        Ok::<(), String>(())
    });
    runtime
        .block_on(served)
        .map_err(|e| format!("the server task failed: {e}"))?
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::args::{Cli, Command};
    use miles_session::server::SessionServerConfig;

    fn parse(line: &str) -> Result<CliArgs, String> {
        let argv = ["miles", "session"]
            .into_iter()
            .chain(line.split_whitespace());
        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
        let Command::Session(args) = cli.command else {
            panic!("session expected")
        };
        options(&args)
    }

    #[test]
    fn defaults_are_the_server_config_defaults() {
        let a = parse("--engine-url toy --tito byte_chatml").unwrap();
        let defaults = SessionServerConfig::default();
        let config = a.server_config();
        assert_eq!(config.max_sessions, defaults.max_sessions);
        assert_eq!(config.session_idle_timeout, defaults.session_idle_timeout);
        assert_eq!(
            config.max_records_per_session,
            defaults.max_records_per_session
        );
        assert_eq!(
            config.max_tokens_per_session,
            defaults.max_tokens_per_session
        );
        assert_eq!(config.limits, defaults.limits);
        assert_eq!(config.max_body_bytes, defaults.max_body_bytes);
        assert_eq!(config.engine_timeout, defaults.engine_timeout);
        let guard = a.guard_config();
        assert_eq!(
            guard.header_read_timeout,
            defaults.guard.header_read_timeout
        );
        assert_eq!(guard.max_connections, defaults.guard.max_connections);
        assert_eq!(
            guard.max_concurrent_requests,
            defaults.guard.max_concurrent_requests
        );
        assert_eq!((a.host.as_str(), a.port), ("127.0.0.1", 30010));
    }

    #[test]
    fn flags_and_limits() {
        let a = parse(
            "--engine-url toy --tito byte_chatml --api-key k3y --max-request-bytes 1000 --max-n 4 \
             --max-sessions 0 --session-idle-timeout 2.5 --max-records-per-session 7 \
             --max-tokens-per-session 0 --request-timeout-s 30 --header-read-timeout-s 0 \
             --max-connections 9 --max-concurrent-requests 0 --routed-experts --num-layers 48",
        )
        .unwrap();
        assert_eq!(a.api_key, Some(ApiKey::new("k3y").unwrap()));
        let config = a.server_config();
        assert_eq!(config.max_body_bytes, 1000);
        assert_eq!(config.limits.max_n, 4);
        assert_eq!(config.max_sessions, None);
        assert_eq!(
            config.session_idle_timeout,
            Some(Duration::from_millis(2500))
        );
        assert_eq!(config.max_records_per_session, Some(7));
        assert_eq!(config.max_tokens_per_session, None);
        assert!(config.return_routed_experts);
        assert_eq!(a.num_layers, Some(48));
        let guard = a.guard_config();
        assert_eq!(guard.request_timeout, Some(Duration::from_secs(30)));
        assert_eq!(guard.header_read_timeout, None);
        assert_eq!(guard.max_connections, Some(9));
        assert_eq!(guard.max_concurrent_requests, None);
        assert_eq!(config.message_matcher, miles_tito::MessageMatcher::Strict);
        let loose =
            parse("--engine-url toy --tito byte_chatml --session-message-matcher loose_tool_call")
                .unwrap();
        assert_eq!(
            loose.server_config().message_matcher,
            miles_tito::MessageMatcher::LooseToolCall
        );
        for bad in [
            "--session-message-matcher loose",
            "--max-n 0",
            "--max-request-bytes 0",
            "--api-key clé",
            "--session-idle-timeout -1",
            "--session-idle-timeout inf",
            "--request-timeout-s NaN",
            "--engine-timeout-s 1e300",
            "--max-sessions -3",
            "--worker-threads 0",
            "--port nine",
            "--bogus 1",
        ] {
            let line = format!("--engine-url toy --tito byte_chatml {bad}");
            assert!(parse(&line).is_err(), "{bad}");
        }
        let err = parse("--engine-url x --tito qwen3").unwrap_err();
        assert!(err.contains("--model is required"), "{err}");
    }
}
