//! # miles-examples
//!
//! Runnable examples of miles-rs and the cross-crate integration tests that need more than one
//! crate (e.g. embedded-engine log-probs against the trainer's). The reference binary
//! `glm_moe_grpo` lives here (`cargo run --release --example glm_moe_grpo`).
//!
//! The library is the toolkit the examples share:
//!
//! * [`toy`] — a complete tiny HF model directory built from nothing: a byte-level BPE
//!   tokenizer made with the `tokenizers` crate (digits one token each, Qwen3's special
//!   tokens), `tokenizer_config.json` with Qwen3's real chat template, a small GLM-4-MoE
//!   `config.json` and random safetensors weights; miles-tito and miles-bridge load it like
//!   any HF directory.
//! * [`addition`] — the synthetic task: seeded multi-digit addition problems (`12+35=` →
//!   `47`), disjoint train / held-out splits, JSONL in miles-rollout's dataset format, and
//!   [`addition::AdditionReward`], a [`miles_core::RewardFn`].
//! * [`plot`] — reward / KL / entropy curves from the metrics JSONL of
//!   [`miles_core::JsonlMetricsSink`] to SVG (`plotters`).
//! * [`sft`] — chat conversations (JSONL) to SFT samples whose loss mask covers exactly the
//!   assistant's tokens, built with miles-tito's session replay.
//! * [`template_check`] — is a model directory TITO-safe? Tokenizer checks plus miles-tito's
//!   verifier in raw and TITO mode (the `verify_template` example).
//! * [`grpo_step`] — one synchronous GRPO step on one device (engine rollout with routed
//!   experts, trainer step with R3 and TIS, in-place weight update), shared by the flex-vs-wgpu
//!   test and the `wgpu_step` bench.
//! * [`args`] — the small command-line parser of the examples (`--help` lists every flag).
//! * [`fixture_path`] — fixture lookup: fixtures committed in the repository's `fixtures/`
//!   win; otherwise the shared reference fixtures beside the checkout (`../shared/fixtures`)
//!   are used; a fixture found in neither is a loud error naming both places.
//!
//! Examples: `verify_template` (is a model directory's chat template TITO-safe?) and `sft`
//! (supervised fine-tuning on a JSONL of conversations), each with `--help`.
//!
//! ```
//! use miles_examples::{FixtureError, fixture_path};
//! use miles_examples::addition::{AdditionReward, AdditionTask};
//!
//! let missing = fixture_path("no/such/fixture.json").unwrap_err();
//! assert!(matches!(missing, FixtureError::Missing { ref searched, .. } if searched.len() == 2));
//!
//! let split = AdditionTask { min_digits: 2, max_digits: 3, seed: 1 }.split(64, 16)?;
//! let p = split.held_out[0];
//! let reward = AdditionReward::default();
//! assert_eq!(reward.score(&p.answer(), &p.answer()), 1.0);
//! # Ok::<(), miles_examples::Error>(())
//! ```

use std::path::{Path, PathBuf};

pub mod addition;
pub mod args;
pub mod calculator;
pub mod fleet;
pub mod grpo_step;
pub mod toy;

// The `miles` command's building blocks, shared with the examples (they live in miles-cli).
pub use miles_cli::{plot, sft, template_check, wiring};

pub use miles_cli::Error;

/// The fixture lookup error (the same type as [`Error`]).
pub type FixtureError = Error;

/// The fixture folders, in search order: `<repo>/fixtures`, then `<repo>/../shared/fixtures`.
pub fn fixture_roots() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    vec![repo.join("fixtures"), repo.join("../shared/fixtures")]
}

/// The path of a fixture, from the first folder of [`fixture_roots`] that has it.
pub fn fixture_path(relative: impl AsRef<Path>) -> Result<PathBuf, FixtureError> {
    let relative = relative.as_ref();
    let searched = fixture_roots();
    searched
        .iter()
        .map(|root| root.join(relative))
        .find(|path| path.exists())
        .ok_or_else(|| FixtureError::Missing {
            relative: relative.to_path_buf(),
            searched,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_fixtures_come_first() {
        let roots = fixture_roots();
        assert!(roots[0].ends_with("fixtures"));
        assert!(roots[1].ends_with("shared/fixtures"));
        let err = fixture_path("missing.bin").unwrap_err();
        assert!(err.to_string().contains("missing.bin"));
    }
}
