//! # miles-rollout
//!
//! Rollout orchestration for RL post-training: the rollout manager (groups, rewards, dynamic
//! filters, over-sampling with abort, staleness control, partial rollout), prompt data and the
//! synchronous / fully-asynchronous RL loops. It drives any [`miles_core::InferenceEngine`]
//! (the embedded engine of miles-engine, SGLang servers through miles-session's client, a
//! miles-session `Router` over a fleet) and any [`miles_core::PolicyTrainer`] through
//! miles-core's traits, and never imports miles-train, miles-engine or burn: it is burn-free
//! with every feature set.
//!
//! Available now:
//! * data: JSONL / Parquet prompt datasets ([`load_dataset`], [`DataSource`]), epochs,
//!   seeded shuffling, a resumable cursor and a buffer of returned groups;
//! * the [`RolloutManager`] — groups of `n_samples_per_prompt`, bounded
//!   concurrency, rewards (any [`miles_core::RewardFn`]; Miles' rules and a reward model over
//!   HTTP are in miles-reward), dynamic filters, over-sampling with abort of the surplus, partial
//!   rollout — with three generation modes: single-turn (one engine call per sample, the
//!   default), agentic ([`AgentGenerator`]: a user agent talks to a session server over
//!   HTTP) and the token-level multi-turn tool loop ([`MultiTurnGenerator`] with a user
//!   [`ToolExecutor`]); any [`SampleGenerator`] plugs in
//!   with [`RolloutManager::with_generator`];
//! * the synchronous and fully-asynchronous [`RlLoop`] with versioned weight updates
//!   (pause → flush → update → resume → version check), staleness control and resumable
//!   checkpoints;
//! * the group-level checks: the staleness bound ([`group_staleness`],
//!   `--max-weight-staleness`) and the dynamic-sampling filters ([`DynamicFilter`]);
//! * on-policy distillation with an SGLang-compatible teacher ([`opd::OpdTeacher`], Miles'
//!   `--use-opd --opd-type sglang`: teacher log-probs or the top-k reverse KL per sample,
//!   teachers routed by `--opd-teacher-urls`), plugged in with
//!   [`RolloutManager::with_opd_teacher`];
//! * evaluation as Miles runs it: datasets from an `--eval-config` document or
//!   `--eval-prompt-data` pairs merged with the eval flags ([`EvalFlags::resolve`],
//!   [`EvalDatasetConfig`]), each an [`EvalSet`] with its own sampling, logged under Miles'
//!   names ([`eval_metrics`]: `eval/<name>`, `eval/<name>-truncated_ratio`, `eval/<name>-pass@k`);
//! * pass@k as Miles' `--log-passrate` computes it ([`pass_rate`], [`pass_rate_of_samples`]:
//!   the unbiased estimator averaged over complete groups).
//!
//! ```
//! use miles_core::{Prompt, Sample, WeightVersion};
//! use miles_rollout::{DynamicFilter, FilterVerdict, group_staleness};
//!
//! let mut group: Vec<Sample> = (0..2)
//!     .map(|_| Sample::builder(Prompt::Text("q".into())).build().unwrap())
//!     .collect();
//! group[0].weight_versions = vec!["3".into()];
//! group[1].weight_versions = vec!["5".into(), "6".into()];
//! // Generated with weights as old as version 3, the trainer is at 7: 4 versions stale.
//! assert_eq!(group_staleness(&group, WeightVersion(7)), Some(4));
//!
//! group[0].reward = Some(1.0.into());
//! group[1].reward = Some(1.0.into());
//! // Equal rewards carry no GRPO signal: the group is dropped.
//! assert_eq!(
//!     DynamicFilter::CheckRewardNonzeroStd.apply(&group, None),
//!     FilterVerdict::Drop { reason: "zero_std_1.0".into() }
//! );
//! ```

pub mod checkpoint;
mod data;
mod encoder;
mod error;
mod eval;
mod eval_config;
mod failures;
mod group;
mod loops;
mod manager;
mod multi_turn;
pub mod opd;
mod passrate;

pub use data::{
    DEFAULT_MAX_ROW_BYTES, DataCursor, DataSource, DataSourceState, DatasetFormat, DatasetKeys,
    DatasetOptions, LoadedDataset, PromptDataPath, PromptRecord, REPORTED_BAD_ROWS, RowRange,
    SkippedRows, collapse_siblings, load_dataset, load_jsonl, parse_jsonl,
};
pub use encoder::ChatPromptEncoder;
pub use error::{Error, Result, RowError, RowErrorKind};
pub use eval::{EvalSet, eval_metrics, filter_long_prompts};
pub use eval_config::{
    EvalDatasetConfig, EvalFlags, eval_datasets_from_document, parse_document, read_file_arg,
};
pub use failures::{
    FAILURE_RETRIES_KEY, FailurePolicy, FailureTracker, failure_kind, retry_failed_group,
};
pub use group::{DynamicFilter, FilterVerdict, group_staleness, within_staleness};
pub use loops::{
    LoopConfig, RlLoop, RolloutCheckpoint, SharedTrainer, UnusedSamplesHandler, compute_pool,
    latest_checkpoint, sample_perf_metrics, update_weights,
};
pub use manager::{
    AgentGenerator, PromptEncoder, RolloutBatch, RolloutConfig, RolloutManager, SampleGenerator,
    TITO_MISMATCH_TYPES, mask_unusable, passrate_metrics, rollout_metrics, tito_mismatch_metrics,
};
pub use multi_turn::{MultiTurnGenerator, ToolExecutor};
pub use passrate::{pass_at_k, pass_rate, pass_rate_of_samples};
