//! Engine configuration and what the engine reads from a model directory.

use std::path::Path;

use miles_bridge::{DecodeWeights, Precision};
use miles_core::WeightVersion;
use serde_json::Value;

/// SGLang's default `max_new_tokens`.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// The default [`EngineConfig::kv_memory_fraction`]: a pool that leaves most of the memory to
/// the trainer beside the engine (its weights, gradients, optimizer state and activations).
pub const DEFAULT_KV_MEMORY_FRACTION: f64 = 0.3;

/// The KV budget an engine runs with, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBudget {
    /// Tokens the pool holds (before the per-sequence spare blocks).
    pub tokens: usize,
    /// Whether the memory bound, not `kv_token_budget`, set it.
    pub limited_by_memory: bool,
}

impl KvBudget {
    /// The budget for `config` when one cached position takes `bytes_per_token` bytes and
    /// `available` bytes of memory are free (`None`: unknown or not the pool's memory, no
    /// memory bound). A fraction outside (0, 1] or a bound below one 16-token block is a
    /// configuration error naming the numbers.
    pub fn resolve(
        config: &EngineConfig,
        bytes_per_token: usize,
        available: Option<u64>,
    ) -> crate::Result<Self> {
        let tokens = config.kv_token_budget;
        let available = available.map(|a| a.saturating_sub(config.kv_reserved_bytes));
        let (Some(fraction), Some(available)) = (config.kv_memory_fraction, available) else {
            return Ok(Self {
                tokens,
                limited_by_memory: false,
            });
        };
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(crate::Error::Config(format!(
                "kv_memory_fraction {fraction} must be in (0, 1]"
            )));
        }
        let allowed_bytes = (available as f64 * fraction) as u64;
        let allowed = (allowed_bytes / bytes_per_token.max(1) as u64) as usize;
        if allowed < 16 {
            return Err(crate::Error::Config(format!(
                "the KV pool may take {fraction} of the {} MiB available ({} MiB left to the \
                 rest of the process first), {} MiB, less than one 16-token block \
                 ({bytes_per_token} bytes per token): raise the fraction or free memory",
                available >> 20,
                config.kv_reserved_bytes >> 20,
                allowed_bytes >> 20
            )));
        }
        Ok(Self {
            tokens: tokens.min(allowed),
            limited_by_memory: allowed < tokens,
        })
    }
}

/// The KV pool a rollout can need, the default budget of `miles train` / `train-async` when
/// neither `--sglang-max-total-tokens` nor `--sglang-mem-fraction-static` is given (SGLang sizes
/// its pool from the memory fraction alone; a pool larger than the rollout can fill costs its
/// allocation and, with `--offload-rollout`, taking it back at every weight push).
///
/// Every sequence the rollout runs at once reserves its prompt plus its `max_new_tokens` (the
/// engine admits a request only when its whole reservation fits), so a pool of
/// [`RolloutKvNeed::concurrent`] × [`RolloutKvNeed::sequence_tokens`] positions runs them all
/// together, and one of at least one sequence never rejects a request of the rollout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutKvNeed {
    /// Sequences the rollout submits at once (prompts × samples per prompt).
    pub requests: usize,
    /// Sequences the engine decodes together (`max_running_requests`).
    pub max_running_requests: usize,
    /// Positions one sequence reserves: the longest prompt in tokens plus `max_new_tokens`.
    pub sequence_tokens: usize,
    /// Budget positions one linear-attention state slot is charged as (a hybrid model's
    /// [`StateBudget::tokens_per_slot`]; 0 for models without linear attention).
    pub state_tokens_per_slot: usize,
}

impl RolloutKvNeed {
    /// Sequences that run at once: the rollout's requests, at most `max_running_requests`, at
    /// least one.
    pub fn concurrent(&self) -> usize {
        self.requests.min(self.max_running_requests).max(1)
    }

    /// The token budget: `concurrent × sequence_tokens` rounded up to 16-token blocks, plus
    /// each running sequence's state slot for a hybrid model (and at least twice the slots'
    /// share, as [`StateBudget::split`] gives the slots at most half the budget).
    pub fn tokens(&self) -> usize {
        let concurrent = self.concurrent();
        let kv = concurrent
            .saturating_mul(self.sequence_tokens.max(1))
            .div_ceil(16)
            .saturating_mul(16);
        let states = concurrent.saturating_mul(self.state_tokens_per_slot);
        kv.saturating_add(states).max(states.saturating_mul(2))
    }
}

/// How a hybrid model's linear-attention states (Qwen3.5's Gated DeltaNet layers: a conv
/// window and a delta-rule state per sequence and layer, of a fixed size) share the KV budget
/// with the full-attention layers' cached positions.
///
/// Each state slot is charged as [`StateBudget::tokens_per_slot`] positions' worth of the
/// budget (its bytes over the bytes of one cached position, rounded up), so the states' memory
/// counts against `kv_token_budget` and, through it, `kv_memory_fraction`. The slots are
/// allocated once, when the engine starts: as many as `max_running_requests`, but at most as
/// many as half the budget pays for; the rest of the budget holds cached positions
/// ([`StateBudget::kv_tokens`]). A request is admitted only with a free slot (it waits
/// otherwise, like a request waiting for KV budget) and returns it when it finishes, is
/// aborted or retracted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateBudget {
    /// State slots (sequences with linear-attention state at once).
    pub slots: usize,
    /// Budget positions one slot is charged as.
    pub tokens_per_slot: usize,
    /// What is left of the budget for cached positions.
    pub kv_tokens: usize,
}

impl StateBudget {
    /// The split of a budget of `tokens` positions (of `bytes_per_token` bytes each) for a
    /// model whose linear layers take `state_bytes` per sequence, with at most `max_running`
    /// sequences at once. A budget that cannot pay for one slot from its half is a
    /// configuration error naming the numbers.
    pub fn split(
        tokens: usize,
        bytes_per_token: usize,
        state_bytes: usize,
        max_running: usize,
    ) -> crate::Result<Self> {
        let tokens_per_slot = state_bytes.div_ceil(bytes_per_token.max(1)).max(1);
        let slots = max_running.min(tokens / 2 / tokens_per_slot);
        if slots == 0 {
            return Err(crate::Error::Config(format!(
                "a KV budget of {tokens} tokens cannot hold one sequence's linear-attention \
                 state ({state_bytes} bytes, {tokens_per_slot} tokens' worth) in half of it: \
                 raise kv_token_budget"
            )));
        }
        Ok(Self {
            slots,
            tokens_per_slot,
            kv_tokens: tokens - slots * tokens_per_slot,
        })
    }
}

/// The host memory available now (Linux `/proc/meminfo` `MemAvailable`), `None` elsewhere.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Configuration of an [`EmbeddedEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences decoded together in one step.
    pub max_running_requests: usize,
    /// KV-cache budget in tokens: a request reserves `prompt + max_new_tokens` while it runs;
    /// requests that do not fit wait. A request larger than the whole budget is rejected. The
    /// engine allocates its KV pool for this many tokens (plus one 16-token block per running
    /// sequence for partly used last blocks, at most doubling it) once, when it starts: size it
    /// to the memory the cache may take (the engine logs the pool's size). On the CPU the
    /// budget is also bounded by [`EngineConfig::kv_memory_fraction`].
    pub kv_token_budget: usize,
    /// The share of the host memory available when the engine starts (Linux `MemAvailable`,
    /// read after the weights are loaded) that the KV pool may take on the CPU, in (0, 1]:
    /// the budget used is the smaller of `kv_token_budget` and what this share holds, as
    /// SGLang's `--mem-fraction-static` bounds its pool (Miles passes it as
    /// `--sglang-mem-fraction-static`; SGLang's share is of the whole GPU memory and includes
    /// the weights, ours is of what is left after them). `None`: no bound but
    /// `kv_token_budget`. Not applied on GPU devices, whose memory the host cannot see.
    pub kv_memory_fraction: Option<f64>,
    /// Bytes of the available memory the KV pool leaves to the rest of the process before
    /// `kv_memory_fraction` applies: what a trainer beside the engine still allocates after
    /// the engine starts (its gradients, optimizer moments and activations; `miles train`
    /// sets it from its memory plan). Default 0.
    pub kv_reserved_bytes: u64,
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
    /// and gate / up projections fused into one matmul each (`CausalLm::fuse_projections`: on
    /// flex in `f32` packed into panels once per weight version with AVX-512F or read in place,
    /// as [`EngineConfig::decode_weights`] says, over the served weights in place with AVX2
    /// only, elsewhere stacked once per weight version; on flex,
    /// small matmuls split over both cores), and on
    /// flex MoE layers apply only the chosen experts at every step (decode
    /// included, where the generic `Auto` dispatch runs every expert on every token). Log-prob recompute
    /// (the [`super::SequenceScorer`]) always sees the model as loaded, so recomputed
    /// log-probs stay the trainer's. `false`: the generic path every device runs; both give
    /// the same greedy tokens and log-probs equal to float rounding (tested on every
    /// architecture).
    pub specialised_path: bool,
    /// Where the specialised path's decode matmuls read dense weights from on flex in `f32`
    /// (`CausalLm::fuse_projections_with`): [`DecodeWeights::Packed`] (default) packs them
    /// into panels with AVX-512F, one more copy of every dense weight, rebuilt at every
    /// update, the faster decode above a few rows; [`DecodeWeights::InPlace`] multiplies
    /// the served weights where they lie (AVX-512F or AVX2), what an engine sharing the
    /// trainer's buffers wants (`miles train` / `train-async` set it: no weight copy held
    /// while the trainer trains, and a weight update rebuilds nothing). With AVX2 only both
    /// read in place.
    pub decode_weights: DecodeWeights,
    /// The dtype the engine holds its weights in and computes with (Miles' `--bf16` /
    /// `--fp16`; default f32): the model handed to the builder is cast once, every weight
    /// update is loaded straight into it, and the fused / packed copies and the KV cache
    /// follow. Logits are read back as f32 for sampling; the log-prob scorer sees the model in
    /// this precision, so with the trainer's scoring and the same precision on the trainer,
    /// recomputed log-probs equal the trainer's.
    pub precision: Precision,
}

impl EngineConfig {
    /// The specialised path's decode layout, `None` for the generic path.
    pub(crate) fn specialised(&self) -> Option<DecodeWeights> {
        self.specialised_path.then_some(self.decode_weights)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running_requests: 32,
            kv_token_budget: 65_536,
            kv_memory_fraction: Some(DEFAULT_KV_MEMORY_FRACTION),
            kv_reserved_bytes: 0,
            prefix_cache_tokens: 16_384,
            recompute_logprobs_via_prefill: true,
            default_max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            eos_token_ids: Vec::new(),
            seed: 0,
            initial_version: WeightVersion(0),
            compute_threads: None,
            specialised_path: true,
            decode_weights: DecodeWeights::Packed,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3-0.6B's pool: 28 layers × 8 KV heads × 128 channels × keys and values × f32.
    const QWEN3_06B_BYTES_PER_TOKEN: usize = 28 * 8 * 128 * 2 * 4;

    #[test]
    fn the_memory_fraction_bounds_the_token_budget() {
        let config = EngineConfig::default();
        assert_eq!(QWEN3_06B_BYTES_PER_TOKEN, 229_376);
        // 0.3 of 1 GiB = 322,122,547 bytes = 1,404 positions of 229,376 bytes.
        let budget = KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, Some(1 << 30)).unwrap();
        assert_eq!(
            budget,
            KvBudget {
                tokens: 1_404,
                limited_by_memory: true
            }
        );
        // 0.3 of 64 GiB holds more than the 65,536-token budget: the budget stands.
        let budget = KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, Some(64 << 30)).unwrap();
        assert_eq!(
            budget,
            KvBudget {
                tokens: 65_536,
                limited_by_memory: false
            }
        );
        // Unknown memory (another OS, a GPU device) or no fraction: the token budget alone.
        for (fraction, available) in [(Some(0.3), None), (None, Some(1 << 20))] {
            let config = EngineConfig {
                kv_memory_fraction: fraction,
                ..EngineConfig::default()
            };
            let budget = KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, available).unwrap();
            assert_eq!(budget.tokens, 65_536);
        }
    }

    #[test]
    fn the_reserved_bytes_come_off_the_available_memory_first() {
        // 21 GiB available, 13 GiB reserved for a trainer's gradients, moments and
        // activations: 0.3 of the 8 GiB left = 2,576,980,377 bytes = 11,234 positions.
        let config = EngineConfig {
            kv_reserved_bytes: 13 << 30,
            ..EngineConfig::default()
        };
        let budget = KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, Some(21 << 30)).unwrap();
        assert_eq!(budget.tokens, 11_234);
        assert!(budget.limited_by_memory);
        // Reserving all of it leaves less than one block: a configuration error.
        let config = EngineConfig {
            kv_reserved_bytes: 21 << 30,
            ..EngineConfig::default()
        };
        assert!(KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, Some(21 << 30)).is_err());
    }

    #[test]
    fn linear_attention_states_take_their_share_of_the_budget() {
        // qwen35-tiny: one full layer (2 KV heads × 16 × keys and values × f32 = 256 bytes
        // per position); three Gated DeltaNet layers of conv window 3 × 64 f32 (768 bytes)
        // and state 4 × 8 × 8 f32 (1,024 bytes): 5,376 bytes, 21 positions' worth.
        let split = StateBudget::split(65_536, 256, 5_376, 32).unwrap();
        assert_eq!(
            split,
            StateBudget {
                slots: 32,
                tokens_per_slot: 21,
                kv_tokens: 65_536 - 32 * 21
            }
        );
        // A small budget: half of 100 positions pays for 2 slots.
        let split = StateBudget::split(100, 256, 5_376, 32).unwrap();
        assert_eq!((split.slots, split.kv_tokens), (2, 58));
        let err = StateBudget::split(41, 256, 5_376, 32).unwrap_err();
        assert!(err.to_string().contains("linear-attention state"), "{err}");
    }

    #[test]
    fn the_rollout_sizes_the_default_pool() {
        // The 88 M GLM-4-MoE bench shape: 32 prompts × 8 samples, all running together, prompts
        // of at most 40 tokens and 24 new tokens: 256 × 64 = 16,384 positions (what the bench
        // passed by hand as --sglang-max-total-tokens).
        let need = RolloutKvNeed {
            requests: 32 * 8,
            max_running_requests: 256,
            sequence_tokens: 40 + 24,
            state_tokens_per_slot: 0,
        };
        assert_eq!((need.concurrent(), need.tokens()), (256, 16_384));
        // Qwen3-0.6B's shape under the engine's default of 32 running sequences: 4 × 8
        // sequences of a 75-token prompt + 48 new tokens = 123, 3,936 positions, rounded up to
        // 16-token blocks: 3,936 is 246 blocks exactly.
        let need = RolloutKvNeed {
            requests: 4 * 8,
            max_running_requests: 32,
            sequence_tokens: 75 + 48,
            state_tokens_per_slot: 0,
        };
        assert_eq!(need.tokens(), 3_936);
        // More requests than run at once: only the running ones need room (the rest wait);
        // 32 × (130 + 1,024) = 36,928 positions = 2,308 blocks.
        let need = RolloutKvNeed {
            requests: 64 * 16,
            sequence_tokens: 130 + 1_024,
            ..need
        };
        assert_eq!((need.concurrent(), need.tokens()), (32, 36_928));
        // One sequence of 17 positions still takes two whole blocks.
        let one = RolloutKvNeed {
            requests: 1,
            max_running_requests: 32,
            sequence_tokens: 17,
            state_tokens_per_slot: 0,
        };
        assert_eq!(one.tokens(), 32);
        // A budget resolved from it keeps the memory bound: 0.3 of 1 GiB holds 1,404
        // positions of Qwen3-0.6B, fewer than the 36,928 the rollout could fill.
        let config = EngineConfig {
            kv_token_budget: need.tokens(),
            ..EngineConfig::default()
        };
        let budget = KvBudget::resolve(&config, QWEN3_06B_BYTES_PER_TOKEN, Some(1 << 30)).unwrap();
        assert_eq!(budget.tokens, 1_404);
        // qwen35-tiny (21 positions per state slot): 32 sequences of 64 positions need 2,048
        // positions for their caches and 32 × 21 = 672 for their states, and the split gives
        // every running sequence its slot.
        let hybrid = RolloutKvNeed {
            requests: 32,
            max_running_requests: 32,
            sequence_tokens: 64,
            state_tokens_per_slot: 21,
        };
        assert_eq!(hybrid.tokens(), 2_048 + 672);
        let split = StateBudget::split(hybrid.tokens(), 256, 5_376, 32).unwrap();
        assert_eq!((split.slots, split.kv_tokens), (32, 2_048));
        // Short sequences: the slots' share sets the floor (twice it, as the split uses half).
        let short = RolloutKvNeed {
            sequence_tokens: 4,
            ..hybrid
        };
        assert_eq!(short.tokens(), 2 * 672);
        let split = StateBudget::split(short.tokens(), 256, 5_376, 32).unwrap();
        assert_eq!(split.slots, 32);
    }

    #[test]
    fn a_bad_fraction_or_too_little_memory_is_a_config_error() {
        for fraction in [0.0, -0.5, 1.5, f64::NAN] {
            let config = EngineConfig {
                kv_memory_fraction: Some(fraction),
                ..EngineConfig::default()
            };
            let err = KvBudget::resolve(&config, 1024, Some(1 << 30)).unwrap_err();
            assert!(err.to_string().contains("kv_memory_fraction"), "{err}");
        }
        let err = KvBudget::resolve(
            &EngineConfig::default(),
            QWEN3_06B_BYTES_PER_TOKEN,
            Some(1 << 20),
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("less than one 16-token block"),
            "{err}"
        );
    }
}
