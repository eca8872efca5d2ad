//! The command line of the `miles-engine` binary:
//!
//! ```text
//! miles-engine serve --model DIR [--host 127.0.0.1] [--port 30000] [--tokenizer DIR]
//!                     [--tito FAMILY] [--served-model-name NAME] [--max-running-requests N]
//!                     [--kv-token-budget TOKENS] [--seed N] [--no-recompute-logprobs]
//!                     [--device flex|wgpu[:N]|wgpu-cpu|cuda[:N]] [--bf16 | --fp16]
//!                     (and the limits of USAGE)
//! ```
//!
//! `serve` loads an HF checkpoint directory into the embedded engine and answers SGLang's HTTP
//! protocol on it (miles-session's [`sglang_router`](miles_session::sglang::sglang_router)). With `--port 0` the system picks a free port. Once the
//! socket is bound the binary prints one line, `listening on http://HOST:PORT`, to stdout.

use std::path::PathBuf;
use std::time::Duration;

use miles_session::guard::{ApiKey, GuardConfig};

use crate::error::{Error, Result};
use miles_session::sglang::{ServerInfo, load_chat_tokenizer};

/// The usage text.
pub const USAGE: &str = "\
usage: miles-engine serve --model DIR [options]

Serves an HF checkpoint with the embedded engine over SGLang's HTTP protocol.

options:
  --model DIR                 HF checkpoint directory (config.json + *.safetensors)
  --host HOST                 address to bind (default 127.0.0.1)
  --port PORT                 port to bind (default 30000; 0 = any free port)
  --tokenizer DIR             tokenizer directory for text prompts and chat (default: --model)
  --tito FAMILY               chat family of miles-tito (default: from config.json model_type)
  --served-model-name NAME    model name in OpenAI answers (default: the model path)
  --max-running-requests N    sequences decoded together
  --kv-token-budget TOKENS    KV-cache budget in tokens
  --seed N                    seed for requests without sampling_seed
  --no-recompute-logprobs     return decode-time log-probs (no prefill recompute)
  --max-n N                   largest n (samples per prompt) a request may ask for (default 64)
  --max-request-bytes BYTES   largest request body (default 67108864; larger → 413)
  --weights-root DIR          the only directory update_weights_from_disk may read from
                              (without it that route is disabled: 403)
  --api-key KEY               every route but /health needs `Authorization: Bearer KEY`
                              (default: $MILES_API_KEY; unset = no authentication)
  --max-connections N         connections served at once (default 1024)
  --max-concurrent-requests N requests in progress at once, /health excluded (default 4096; 503)
  --header-read-timeout-s S   time to send a request head (default 10)
  --request-timeout-s S       time a request may run (default: none; 504 after it)
  --enable-metrics            serve Prometheus metrics at GET /metrics (SGLang's names)
  --device DEV                the engine's device: flex (default) | cpu | wgpu[:N] | wgpu-cpu |
                              cuda[:N] (wgpu / cuda need the crate built with that feature)
  --bf16                      hold the weights and the KV cache and compute in bfloat16
                              (Miles' --bf16; default float32)
  --fp16                      the same in float16 (Miles' --fp16; not with --bf16)
";

/// Options of `miles-engine serve`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeArgs {
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

impl ServeArgs {
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

/// A parsed command line.
// Parsed once per process: boxing the large variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// `serve …`.
    Serve(ServeArgs),
    /// `--help` / `help`.
    Help,
}

fn usage_error(message: impl Into<String>) -> Error {
    Error::Config(format!("{}\n\n{USAGE}", message.into()))
}

fn number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T> {
    value
        .parse()
        .map_err(|_| usage_error(format!("{flag} expects a number, got {value:?}")))
}

fn seconds(flag: &str, value: &str) -> Result<f64> {
    match number::<f64>(flag, value)? {
        s if s.is_finite() && s > 0.0 && s < 1e9 => Ok(s),
        _ => Err(usage_error(format!(
            "{flag} must be a positive number of seconds"
        ))),
    }
}

fn positive(flag: &str, value: &str) -> Result<usize> {
    match number::<usize>(flag, value)? {
        0 => Err(usage_error(format!("{flag} must be at least 1"))),
        n => Ok(n),
    }
}

/// Parses the arguments after the program name.
pub fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command> {
    let mut args = args.into_iter();
    match args.next().as_deref() {
        Some("serve") => {}
        None | Some("help" | "--help" | "-h") => return Ok(Command::Help),
        Some(other) => return Err(usage_error(format!("unknown command {other:?}"))),
    }
    let mut model = None;
    let mut parsed = ServeArgs {
        model: PathBuf::new(),
        tokenizer: None,
        tito: None,
        host: "127.0.0.1".into(),
        port: 30000,
        served_model_name: None,
        max_running_requests: None,
        kv_token_budget: None,
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
    };
    let (mut bf16, mut fp16) = (false, false);
    while let Some(flag) = args.next() {
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (flag, None),
        };
        if matches!(flag.as_str(), "--help" | "-h") {
            return Ok(Command::Help);
        }
        if flag == "--no-recompute-logprobs" {
            parsed.recompute_logprobs = false;
            continue;
        }
        if flag == "--enable-metrics" {
            parsed.enable_metrics = true;
            continue;
        }
        if flag == "--bf16" || flag == "--fp16" {
            *(if flag == "--bf16" {
                &mut bf16
            } else {
                &mut fp16
            }) = true;
            continue;
        }
        let value = match inline.or_else(|| args.next()) {
            Some(v) => v,
            None => return Err(usage_error(format!("{flag} needs a value"))),
        };
        match flag.as_str() {
            "--model" | "--model-path" => model = Some(PathBuf::from(value)),
            "--tokenizer" | "--tokenizer-path" => parsed.tokenizer = Some(PathBuf::from(value)),
            "--tito" | "--tito-model" => parsed.tito = Some(value),
            "--host" => parsed.host = value,
            "--port" => parsed.port = number(&flag, &value)?,
            "--served-model-name" => parsed.served_model_name = Some(value),
            "--max-running-requests" => parsed.max_running_requests = Some(number(&flag, &value)?),
            "--kv-token-budget" => parsed.kv_token_budget = Some(number(&flag, &value)?),
            "--seed" => parsed.seed = Some(number(&flag, &value)?),
            "--max-n" => parsed.max_n = Some(positive(&flag, &value)?),
            "--max-request-bytes" => parsed.max_request_bytes = Some(positive(&flag, &value)?),
            "--weights-root" => parsed.weights_root = Some(PathBuf::from(value)),
            "--api-key" => {
                parsed.api_key = Some(ApiKey::new(value).map_err(|e| usage_error(e.to_string()))?)
            }
            "--max-connections" => parsed.max_connections = Some(positive(&flag, &value)?),
            "--max-concurrent-requests" => {
                parsed.max_concurrent_requests = Some(positive(&flag, &value)?)
            }
            "--header-read-timeout-s" => {
                parsed.header_read_timeout_s = Some(seconds(&flag, &value)?)
            }
            "--request-timeout-s" => parsed.request_timeout_s = Some(seconds(&flag, &value)?),
            "--device" => parsed.device = value,
            other => return Err(usage_error(format!("unknown option {other}"))),
        }
    }
    parsed.model = model.ok_or_else(|| usage_error("--model DIR is required"))?;
    parsed.dtype = match (bf16, fp16) {
        (false, false) => miles_core::DType::F32,
        (true, false) => miles_core::DType::BF16,
        (false, true) => miles_core::DType::F16,
        (true, true) => {
            return Err(usage_error(
                "--bf16 and --fp16 exclude each other: choose one compute dtype",
            ));
        }
    };
    if parsed.api_key.is_none() {
        parsed.api_key = ApiKey::from_env().map_err(|e| usage_error(e.to_string()))?;
    }
    Ok(Command::Serve(parsed))
}

/// What the server reports for `args`: the model's `config.json`, and the chat tokenizer of
/// the tokenizer directory when it has one.
pub fn server_info(args: &ServeArgs) -> Result<ServerInfo> {
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
    args: &ServeArgs,
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

    fn args(list: &[&str]) -> Result<Command> {
        parse_args(list.iter().map(|s| s.to_string()))
    }

    #[test]
    fn serve_flags_and_defaults() {
        let Command::Serve(parsed) = args(&["serve", "--model", "/m"]).unwrap() else {
            panic!("serve expected");
        };
        assert_eq!(parsed.model, PathBuf::from("/m"));
        assert_eq!(parsed.host, "127.0.0.1");
        assert_eq!(parsed.port, 30000);
        assert!(parsed.recompute_logprobs);
        assert_eq!(parsed.device, "flex");
        assert_eq!(parsed.dtype, miles_core::DType::F32);
        let Command::Serve(parsed) = args(&["serve", "--model=/m", "--bf16"]).unwrap() else {
            panic!("serve expected");
        };
        assert_eq!(parsed.dtype, miles_core::DType::BF16);
        let Command::Serve(parsed) = args(&["serve", "--fp16", "--model=/m"]).unwrap() else {
            panic!("serve expected");
        };
        assert_eq!(parsed.dtype, miles_core::DType::F16);
        let Command::Serve(parsed) = args(&[
            "serve",
            "--model=/m",
            "--port",
            "0",
            "--host",
            "0.0.0.0",
            "--tito",
            "qwen3",
            "--seed=5",
            "--no-recompute-logprobs",
            "--device",
            "wgpu-cpu",
        ])
        .unwrap() else {
            panic!("serve expected");
        };
        assert_eq!(parsed.port, 0);
        assert_eq!(parsed.host, "0.0.0.0");
        assert_eq!(parsed.tito.as_deref(), Some("qwen3"));
        assert_eq!(parsed.seed, Some(5));
        assert!(!parsed.recompute_logprobs);
        assert_eq!(parsed.device, "wgpu-cpu");
        assert_eq!(args(&["--help"]).unwrap(), Command::Help);
        assert_eq!(args(&[]).unwrap(), Command::Help);
    }

    #[test]
    fn bad_command_lines_are_config_errors() {
        for bad in [
            &["serve"][..],
            &["serve", "--model"],
            &["serve", "--model", "/m", "--port", "http"],
            &["serve", "--model", "/m", "--bogus", "1"],
            &["serve", "--model", "/m", "--bf16", "--fp16"],
            &["train"],
        ] {
            assert!(matches!(args(bad), Err(Error::Config(_))), "{bad:?}");
        }
    }

    #[test]
    fn server_info_reads_the_checkpoint_and_its_tokenizer() {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/serve/qwen3-tiny-chat");
        let Command::Serve(parsed) = parse_args([
            "serve".to_owned(),
            "--model".to_owned(),
            dir.to_string_lossy().into(),
        ])
        .unwrap() else {
            panic!("serve expected");
        };
        let info = server_info(&parsed).unwrap();
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
        let Command::Serve(parsed) = parse_args([
            "serve".to_owned(),
            "--model".to_owned(),
            ids_only.to_string_lossy().into(),
        ])
        .unwrap() else {
            panic!("serve expected");
        };
        let info = server_info(&parsed).unwrap();
        assert!(info.tokenizer.is_none());
        assert_eq!(info.model_type.as_deref(), Some("glm4_moe"));
    }
}
