//! `miles router`: SGLang's HTTP protocol in front of several SGLang-compatible servers
//! (`miles serve` processes or SGLang itself), miles-session's [`Router`] on its own: a
//! request goes to the engine with the fewest requests in flight (sticky by
//! `X-SMG-Routing-Key`), an engine that fails is taken out of rotation and health-checked
//! every `--rollout-health-check-interval` seconds until it answers again, and pause /
//! weight-update calls reach every engine. `GET /list_workers` lists the engines (Miles'
//! router route). Prints `listening on http://ADDR` once bound; on SIGINT / SIGTERM it stops
//! accepting, lets the requests in flight finish (up to `--shutdown-timeout-s`) and exits 0.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::routing::get;
use miles_session::guard::{ApiKey, GuardConfig};
use miles_session::sglang::{Router, ServerInfo, load_chat_tokenizer, sglang_router};
use serde_json::json;

use crate::args::RouterArgs;
use crate::shutdown::Signals;

/// What the router serves as `/get_model_info` and how it reads text prompts: the model
/// directory's config and tokenizer when `--model` is given, else token ids only.
fn server_info(args: &RouterArgs) -> Result<ServerInfo, String> {
    let mut info = match &args.model {
        Some(model) => {
            let dir = crate::hub::resolve(model, "--model")?;
            let info = ServerInfo::from_model_dir(&dir).map_err(|e| format!("--model: {e}"))?;
            let tokenizer_dir = args.tokenizer.clone().unwrap_or(dir);
            match load_chat_tokenizer(
                &tokenizer_dir,
                args.tito.as_deref(),
                info.model_type.as_deref(),
            )
            .map_err(|e| e.to_string())?
            {
                Some(tokenizer) => info.with_tokenizer(tokenizer, tokenizer_dir.to_string_lossy()),
                None => info,
            }
        }
        None => ServerInfo::new("miles-router"),
    };
    if let Some(name) = &args.served_model_name {
        info.served_model_name = name.clone();
    }
    if let Some(root) = &args.weights_root {
        info = info.with_weights_root(root);
    }
    Ok(info)
}

/// Runs `miles router` until a signal; the error is one line for the user.
pub fn run(args: &RouterArgs) -> Result<(), String> {
    let info = server_info(args)?;
    let api_key = match &args.api_key {
        Some(key) => Some(ApiKey::new(key.clone()).map_err(|e| format!("--api-key: {e}"))?),
        None => ApiKey::from_env().map_err(|e| e.to_string())?,
    };
    let engine_key = args
        .engine_api_key
        .as_ref()
        .map(|key| ApiKey::new(key.clone()).map_err(|e| format!("--engine-api-key: {e}")))
        .transpose()?;
    for url in &args.engine_url {
        if !url.starts_with("http://") {
            return Err(format!(
                "--engine-url {url}: expected an http:// base URL (the engines' client speaks \
                 plain HTTP/1.1)"
            ));
        }
    }
    let urls = args.engine_url.clone();
    let timeout = Duration::from_secs_f64(args.miles_router_timeout);
    let num_layers = args.num_layers;
    let router = Arc::new(Router::over_http(&urls, |config| {
        config.generate_timeout = timeout;
        config.num_layers = num_layers;
        config.api_key = engine_key.clone();
    }));
    let guard = GuardConfig::default()
        .with_api_key(api_key)
        .with_max_body_bytes(info.max_body_bytes);
    let drain = Duration::from_secs_f64(args.shutdown_timeout_s);
    let interval = Duration::from_secs_f64(args.rollout_health_check_interval);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    runtime.block_on(async move {
        let mut signals = Signals::install();
        let listener = miles_session::guard::bind(&args.host, args.port)
            .await
            .map_err(|e| format!("cannot bind {}:{}: {e}", args.host, args.port))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let _checker = router.spawn_health_checker(interval);
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = writeln!(
                out,
                "listening on http://{addr} (routing over {} engine(s))",
                urls.len()
            );
            let _ = out.flush();
        }
        if guard.api_key.is_none() && !addr.ip().is_loopback() {
            tracing::warn!(
                %addr,
                "routing without --api-key: anyone who can reach it can generate and update the engines' weights"
            );
        }
        let workers = {
            let router = Arc::clone(&router);
            let urls = urls.clone();
            move || {
                let healthy = router.healthy_engines();
                async move { Json(json!({"urls": urls, "healthy": healthy})) }
            }
        };
        let app = sglang_router(Arc::clone(&router) as _, info).route("/list_workers", get(workers));
        let app = miles_session::guard::harden(app, &guard);
        crate::shutdown::serve_until_signal(listener, app, guard, &mut signals, drain).await
    })
}
