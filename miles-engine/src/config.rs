//! Engine configuration and what the engine reads from a model directory.

use std::path::Path;

use miles_bridge::Precision;
use miles_core::WeightVersion;
use serde_json::Value;

/// SGLang's default `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// Configuration of an [`EmbeddedEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences decoded together in one step.
    pub max_running_requests: usize,
    /// KV-cache budget in tokens: a request reserves `prompt + max_new_tokens` while it runs;
    /// requests that do not fit wait. A request larger than the whole budget is rejected. The
    /// engine allocates its KV pool for this many tokens (plus one 16-token block per running
    /// sequence for partly used last blocks, at most doubling it) once, when it starts: size it
    /// to the memory the cache may take (the engine logs the pool's size).
    pub kv_token_budget: usize,
    /// Tokens of finished / prefilled sequences kept for prefix reuse (0 disables reuse).
    pub prefix_cache_tokens: usize,
    /// After a sequence ends (stop or length; not abort), recompute its log-probs with the
    /// [`SequenceScorer`] over the whole sequence (Miles' `recompute_logprobs_via_prefill`).
    pub recompute_logprobs_via_prefill: bool,
    /// `max_new_tokens` when a request does not set it.
    pub default_max_new_tokens: usize,
    /// Token ids that end generation besides a request's `stop_token_ids` (the model's EOS).
    pub eos_token_ids: Vec<u32>,
    /// Seed for requests without `sampling_seed` (mixed with a per-request counter).
    pub seed: u64,
    /// Version the initial weights carry.
    pub initial_version: WeightVersion,
    /// Threads the engine computes with: its scheduler runs in a rayon pool of this size of
    /// its own (`None`: as many threads as the process-wide pool has; the pool's threads
    /// sleep while the engine is idle, and during a decode step poll for the step's parallel
    /// ops, yielding their core when there is nothing to take). Sizing the engine's and the trainer's pools to split
    /// the cores keeps generation and training from competing for them when they overlap,
    /// the in-process counterpart of giving rollout and training separate GPUs.
    pub compute_threads: Option<usize>,
    /// Runs the forward steps on the path specialised for inference and the device: q / k / v
    /// and gate / up projections fused into one matmul each over weights stacked once per
    /// weight version (`CausalLm::fuse_projections`; on flex, small matmuls split over both
    /// cores), and on flex MoE layers apply only the chosen experts at every step (decode
    /// included, where the generic `Auto` dispatch runs every expert on every token). Log-prob recompute
    /// (the [`super::SequenceScorer`]) always sees the model as loaded, so recomputed
    /// log-probs stay the trainer's. `false`: the generic path every device runs; both give
    /// the same greedy tokens and log-probs equal to float rounding (tested on every
    /// architecture).
    pub specialised_path: bool,
    /// The dtype the engine holds its weights in and computes with (Miles' `--bf16` /
    /// `--fp16`; default f32): the model handed to the builder is cast once, every weight
    /// update is loaded straight into it, and the fused / packed copies and the KV cache
    /// follow. Logits are read back as f32 for sampling; the log-prob scorer sees the model in
    /// this precision, so with the trainer's scoring and the same precision on the trainer,
    /// recomputed log-probs equal the trainer's.
    pub precision: Precision,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running_requests: 32,
            kv_token_budget: 65_536,
            prefix_cache_tokens: 16_384,
            recompute_logprobs_via_prefill: true,
            default_max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            eos_token_ids: Vec::new(),
            seed: 0,
            initial_version: WeightVersion(0),
            compute_threads: None,
            specialised_path: true,
            precision: Precision::F32,
        }
    }
}

/// EOS ids from `generation_config.json`, else `config.json` (an id or a list).
pub fn read_eos_ids(dir: &Path) -> Vec<u32> {
    for file in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
            continue;
        };
        let Ok(json) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        let ids: Vec<u32> = match json.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| v as u32).into_iter().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => Vec::new(),
        };
        if !ids.is_empty() {
            return ids;
        }
    }
    Vec::new()
}

/// The id of `tokenizer_config.json`'s `eos_token` (a string or `{"content": …}`) in the
/// directory's `tokenizer.json`: the end of a turn for checkpoints whose configs leave
/// `eos_token_id` null (what [`read_eos_ids`] reads). Training and rollout code that needs
/// an end-of-turn id falls back to it; the engine's own stop rule stays the config's.
pub fn eos_from_tokenizer_config(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let json: Value = serde_json::from_str(&text).ok()?;
    let token = match json.get("eos_token")? {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content")?.as_str()?.to_owned(),
        _ => return None,
    };
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).ok()?;
    tokenizer.token_to_id(&token)
}

/// Temperature ≥ 0, top-p in (0, 1], min-p in [0, 1] (NaN fails every check).
pub(super) fn valid_sampling(params: &miles_core::SamplingParams) -> bool {
    params.temperature >= 0.0
        && params.top_p > 0.0
        && params.top_p <= 1.0
        && (0.0..=1.0).contains(&params.min_p)
}
