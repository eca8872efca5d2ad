//! What an SGLang-protocol server reports about the model it serves ([`ServerInfo`]), and
//! the chat tokenizer it loads for text prompts and chat.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::openai::RequestLimits;
use miles_tito::{ChatTokenizer, HfChat, TitoChat, TitoFamily};
use serde_json::Value;

use crate::error::{Error, Result};

/// SGLang's default `max_new_tokens` for `/generate` when the request sets none.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// What the server reports about the model it serves, and the tokenizer it uses for text
/// prompts and chat.
#[derive(Clone)]
pub struct ServerInfo {
    /// The checkpoint directory (`model_path` in `/model_info`).
    pub model_path: String,
    /// The tokenizer directory, when one is loaded.
    pub tokenizer_path: Option<String>,
    /// The `model` reported by the OpenAI routes when a request names none.
    pub served_model_name: String,
    /// HF `model_type` (`qwen3`, `glm4_moe`, …).
    pub model_type: Option<String>,
    /// HF `architectures`.
    pub architectures: Vec<String>,
    /// Vocabulary size: prompt ids at or above it are rejected with 400.
    pub vocab_size: Option<usize>,
    /// Context length: prompt + `max_new_tokens` beyond it is rejected with 400.
    pub context_length: Option<usize>,
    /// Chat template + tokenizer (miles-tito through miles-session's adapter); `None` serves
    /// token ids only (`text` prompts and chat are then rejected with 400).
    pub tokenizer: Option<Arc<dyn ChatTokenizer>>,
    /// `max_new_tokens` of `/generate` requests that set none.
    pub default_max_new_tokens: usize,
    /// Largest accepted request body, in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// Bounds on `n`, stop strings and stop ids (the session server's type:
    /// `--max-n`, …), checked on the parsed request before anything is allocated.
    pub limits: RequestLimits,
    /// Largest number of sequences one `/generate` request may expand to (prompts × `n`).
    pub max_sequences: usize,
    /// The only directory tree `/update_weights_from_disk` may read from (canonicalised; a
    /// path outside it, through `..` or a symlink, is 403). `None` disables the route (403):
    /// a server reads the file system only where its operator said it may.
    pub weights_root: Option<PathBuf>,
    /// Served at `GET /metrics` in Prometheus' text format when set (`--enable-metrics`;
    /// `EmbeddedEngine::attach_metrics` keeps SGLang's engine metrics in it).
    pub metrics: Option<Arc<miles_core::prometheus::Registry>>,
    /// The dtype the engine computes in, reported as SGLang's `--dtype` by
    /// `/get_server_info` (SGLang clients publish weight updates in it).
    /// (F32, BF16 or F16; `float32` unless the engine was started with `--bf16` / `--fp16`.)
    pub dtype: miles_core::DType,
}

impl std::fmt::Debug for ServerInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerInfo")
            .field("model_path", &self.model_path)
            .field("tokenizer_path", &self.tokenizer_path)
            .field("served_model_name", &self.served_model_name)
            .field("model_type", &self.model_type)
            .field("vocab_size", &self.vocab_size)
            .field("context_length", &self.context_length)
            .field("tokenizer", &self.tokenizer.as_ref().map(|t| t.family()))
            .finish()
    }
}

impl ServerInfo {
    /// Info for a model at `model_path` with nothing else known (no tokenizer, no limits).
    pub fn new(model_path: impl Into<String>) -> Self {
        let model_path = model_path.into();
        Self {
            served_model_name: model_path.clone(),
            model_path,
            tokenizer_path: None,
            model_type: None,
            architectures: Vec::new(),
            vocab_size: None,
            context_length: None,
            tokenizer: None,
            default_max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            max_body_bytes: 64 << 20,
            limits: RequestLimits::default(),
            max_sequences: 1024,
            weights_root: None,
            metrics: None,
            dtype: miles_core::DType::F32,
        }
    }

    /// Lets `/update_weights_from_disk` read checkpoints under `root` (and nowhere else).
    pub fn with_weights_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.weights_root = Some(root.into());
        self
    }

    /// Reads `dir/config.json` (HF layout) for `model_type`, `architectures`, `vocab_size`
    /// and `max_position_embeddings`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Config(format!("cannot read {}: {e}", path.display())))?;
        let config: Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?;
        let mut info = Self::new(dir.to_string_lossy());
        info.model_type = config
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_owned);
        info.architectures = config
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        info.vocab_size = config
            .get("vocab_size")
            .and_then(Value::as_u64)
            .map(|v| v as usize);
        info.context_length = config
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|v| v as usize);
        Ok(info)
    }

    /// Serves text prompts and chat with `tokenizer`, loaded from `path`.
    pub fn with_tokenizer(
        mut self,
        tokenizer: Arc<dyn ChatTokenizer>,
        path: impl Into<String>,
    ) -> Self {
        self.tokenizer = Some(tokenizer);
        self.tokenizer_path = Some(path.into());
        self
    }
}

/// Loads the chat tokenizer of `dir` (a `tokenizer.json` next to `tokenizer_config.json` or
/// `chat_template.jinja`) as miles-tito family `family` (Miles' `--tito-model`), or, without
/// one, as the family miles-tito detects from `model_type` and the vocabulary
/// ([`TitoFamily::detect`]). `Ok(None)` when `dir` has no `tokenizer.json` (the server then
/// speaks token ids only).
pub fn load_chat_tokenizer(
    dir: &Path,
    family: Option<&str>,
    model_type: Option<&str>,
) -> Result<Option<Arc<dyn ChatTokenizer>>> {
    if !dir.join("tokenizer.json").is_file() {
        return Ok(None);
    }
    let failed =
        |e: miles_tito::Error| Error::Config(format!("tokenizer in {}: {e}", dir.display()));
    let chat = HfChat::load(dir).map_err(failed)?;
    let family = match family {
        Some(name) => TitoFamily::parse(name).map_err(failed)?,
        None => TitoFamily::detect(model_type, chat.tokenizer().map(|t| &**t)),
    };
    Ok(Some(Arc::new(
        TitoChat::new(&chat, family).map_err(failed)?,
    )))
}
