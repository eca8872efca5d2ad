//! What `miles serve` (miles-cli) runs: the options of the embedded engine's SGLang-protocol
//! server ([`ServeOptions`], whose `Default` gives the command's defaults), the
//! [`ServerInfo`] they describe ([`server_info`]) and its Prometheus metrics
//! ([`attach_metrics`]). The server itself is miles-session's
//! [`sglang_router`](miles_session::sglang::sglang_router) behind
//! [`miles_session::guard`].

use std::path::PathBuf;
use std::time::Duration;

use miles_session::guard::{ApiKey, GuardConfig};

use crate::error::{Error, Result};
use miles_session::sglang::{ServerInfo, load_chat_tokenizer};

/// Options of `miles serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeOptions {
    /// HF checkpoint directory.
    pub model: PathBuf,
    /// Tokenizer directory (default: the model directory).
    pub tokenizer: Option<PathBuf>,
    /// miles-tito family for chat (default: chosen from `model_type`).
    pub tito: Option<String>,
    /// Address to bind.
    pub host: String,
    /// Port to bind (0: any free port).
    pub port: u16,
    /// `model` of OpenAI answers.
    pub served_model_name: Option<String>,
    /// Engine: sequences decoded together.
    pub max_running_requests: Option<usize>,
    /// Engine: KV-cache budget in tokens.
    pub kv_token_budget: Option<usize>,
    /// Engine: the share of the memory available after the weights load that the KV pool may
    /// take (SGLang's `--mem-fraction-static`; `None`: the engine's default).
    pub mem_fraction_static: Option<f64>,
    /// Engine: seed for unseeded requests.
    pub seed: Option<u64>,
    /// Engine: recompute log-probs with a prefill pass after each sequence (Miles'
    /// `recompute_logprobs_via_prefill`).
    pub recompute_logprobs: bool,
    /// Largest `n` a request may ask for.
    pub max_n: Option<usize>,
    /// Largest request body in bytes.
    pub max_request_bytes: Option<usize>,
    /// The directory `update_weights_from_disk` is confined to (`None`: route disabled).
    pub weights_root: Option<PathBuf>,
    /// The bearer key every route but `/health` requires (`--api-key`, else
    /// `$MILES_API_KEY`).
    pub api_key: Option<ApiKey>,
    /// Connections served at once.
    pub max_connections: Option<usize>,
    /// Requests in progress at once.
    pub max_concurrent_requests: Option<usize>,
    /// Time to receive a request head, in seconds.
    pub header_read_timeout_s: Option<f64>,
    /// Time a request may run, in seconds.
    pub request_timeout_s: Option<f64>,
    /// Serve `GET /metrics` (`--enable-metrics`, SGLang's flag).
    pub enable_metrics: bool,
    /// The engine's device (`--device`, default `flex`): `flex | cpu | wgpu[:N] | wgpu-cpu |
    /// cuda[:N]`, parsed by `miles_ops::device`.
    pub device: String,
    /// The dtype the engine holds its weights and KV cache in and computes with: F32 (the
    /// default), BF16 (`--bf16`) or F16 (`--fp16`); both flags are an error.
    pub dtype: miles_core::DType,
}

impl ServeOptions {
    /// The guard of the server's HTTP front ([`miles_session::guard`]): key, JSON bodies,
    /// body size, connection / request limits and timeouts.
    pub fn guard_config(&self, info: &ServerInfo) -> GuardConfig {
        let secs = |s: Option<f64>| s.map(Duration::from_secs_f64);
        let mut guard = GuardConfig::default()
            .with_api_key(self.api_key.clone())
            .with_max_body_bytes(info.max_body_bytes)
            .with_request_timeout(secs(self.request_timeout_s));
        if let Some(n) = self.max_connections {
            guard = guard.with_max_connections(Some(n));
        }
        if let Some(n) = self.max_concurrent_requests {
            guard = guard.with_max_concurrent_requests(Some(n));
        }
        if let Some(s) = self.header_read_timeout_s {
            guard = guard.with_header_read_timeout(Some(Duration::from_secs_f64(s)));
        }
        guard
    }
}

impl Default for ServeOptions {
    /// No model yet, 127.0.0.1:30000, the engine's defaults, f32 on `flex`.
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            tokenizer: None,
            tito: None,
            host: "127.0.0.1".into(),
            port: 30000,
            served_model_name: None,
            max_running_requests: None,
            kv_token_budget: None,
            mem_fraction_static: None,
            seed: None,
            recompute_logprobs: true,
            max_n: None,
            max_request_bytes: None,
            weights_root: None,
            api_key: None,
            max_connections: None,
            max_concurrent_requests: None,
            header_read_timeout_s: None,
            request_timeout_s: None,
            enable_metrics: false,
            device: "flex".into(),
            dtype: miles_core::DType::F32,
        }
    }
}

impl ServeOptions {
    /// The defaults for `model`.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            ..Self::default()
        }
    }
}

/// What the server reports for `args`: the model's `config.json`, and the chat tokenizer of
/// the tokenizer directory when it has one.
pub fn server_info(args: &ServeOptions) -> Result<ServerInfo> {
    let mut info = ServerInfo::from_model_dir(&args.model)?;
    info.dtype = args.dtype;
    if let Some(name) = &args.served_model_name {
        info.served_model_name = name.clone();
    }
    if let Some(n) = args.max_n {
        info.limits = info.limits.clone().with_max_n(n);
        info.max_sequences = info.max_sequences.max(n);
    }
    if let Some(bytes) = args.max_request_bytes {
        info.max_body_bytes = bytes;
    }
    if let Some(root) = &args.weights_root {
        if !root.is_dir() {
            return Err(Error::Config(format!(
                "--weights-root {} is not a directory",
                root.display()
            )));
        }
        info.weights_root = Some(root.clone());
    }
    let tokenizer_dir = args.tokenizer.clone().unwrap_or_else(|| args.model.clone());
    if let Some(tokenizer) = load_chat_tokenizer(
        &tokenizer_dir,
        args.tito.as_deref(),
        info.model_type.as_deref(),
    )? {
        info = info.with_tokenizer(tokenizer, tokenizer_dir.to_string_lossy());
    } else if args.tokenizer.is_some() {
        return Err(Error::Config(format!(
            "no tokenizer.json in {}",
            tokenizer_dir.display()
        )));
    }
    Ok(info)
}

/// With `--enable-metrics`: a registry holding SGLang's engine metrics, kept current by
/// `engine` and served by the server of `info` at `GET /metrics`. Does nothing otherwise.
pub fn attach_metrics(
    args: &ServeOptions,
    engine: &crate::EmbeddedEngine,
    info: &mut ServerInfo,
) -> Result<()> {
    if !args.enable_metrics {
        return Ok(());
    }
    let registry = std::sync::Arc::new(miles_core::prometheus::Registry::new());
    let metrics =
        miles_core::prometheus::SglangMetrics::register(&registry, &info.served_model_name)
            .map_err(|e| Error::Config(format!("metrics: {e}")))?;
    engine.attach_metrics(std::sync::Arc::new(metrics));
    info.metrics = Some(registry);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_info_reads_the_checkpoint_and_its_tokenizer() {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/serve/qwen3-tiny-chat");
        let info = server_info(&ServeOptions::new(&dir)).unwrap();
        assert_eq!(info.model_type.as_deref(), Some("qwen3"));
        assert_eq!(info.vocab_size, Some(512));
        assert_eq!(info.context_length, Some(256));
        let tokenizer = info.tokenizer.unwrap();
        assert_eq!(tokenizer.family(), "qwen3");
        // <|im_end|> was re-numbered to 502 in the cut-down vocabulary.
        assert_eq!(tokenizer.stop_token_ids(), vec![502]);
        // No tokenizer.json next to the weights: ids only.
        let ids_only =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/models/glm4moe-tiny");
        let info = server_info(&ServeOptions::new(ids_only)).unwrap();
        assert!(info.tokenizer.is_none());
        assert_eq!(info.model_type.as_deref(), Some("glm4_moe"));
    }
}
