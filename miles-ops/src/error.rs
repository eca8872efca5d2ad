//! The crate's error type.

/// Everything that can go wrong in `miles-ops`: invalid configuration and malformed input.
///
/// Every variant carries the structured facts needed to act on it; nothing in this crate
/// panics on user input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A configuration value (named after its Miles CLI flag) is out of range.
    #[error("invalid value for `--{flag}`: {reason}")]
    InvalidConfig {
        /// The Miles flag name, with dashes (`eps-clip-c`).
        flag: &'static str,
        /// Why the value is rejected.
        reason: String,
    },
    /// Two inputs that must have the same length do not.
    #[error("length mismatch for `{what}`: expected {expected}, got {got}")]
    LengthMismatch {
        /// Which input.
        what: &'static str,
        /// The expected length.
        expected: usize,
        /// The length found.
        got: usize,
    },
    /// A tensor does not have the expected shape.
    #[error("shape mismatch for `{what}`: expected {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// Which tensor.
        what: &'static str,
        /// The expected shape.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// An input that the chosen estimator or loss needs was not supplied.
    #[error("`{what}` is required by {required_by}")]
    MissingInput {
        /// The missing input.
        what: &'static str,
        /// The feature (flag or estimator) that needs it.
        required_by: &'static str,
    },
    /// A sample has no trainable token where the estimator needs one
    /// (`reinforce_plus_plus` places the reward on the last trainable token).
    #[error("sample {index} is fully masked (loss_mask has no trainable token)")]
    FullyMasked {
        /// Index of the sample in the batch.
        index: usize,
    },
    /// Samples of one rollout (same `rollout_id`) carry different rewards.
    #[error("rollout {rollout_id} has samples with different rewards ({first} vs {other})")]
    InconsistentRolloutReward {
        /// The rollout id.
        rollout_id: u64,
        /// Reward of the first sample of the rollout.
        first: f32,
        /// A differing reward of a later sibling.
        other: f32,
    },
    /// The batch size is not a multiple of `n_samples_per_prompt` when grouping by fan-out.
    #[error("{samples} samples cannot be split into groups of n_samples_per_prompt={group_size}")]
    UnevenGroups {
        /// Number of samples.
        samples: usize,
        /// The fan-out.
        group_size: usize,
    },
    /// Advantage whitening over a batch whose loss masks sum to zero.
    #[error("cannot whiten advantages: the loss masks of the whole batch sum to zero")]
    EmptyMask,
    /// A target token id lies outside the vocabulary.
    #[error(
        "target token {token} at position {position} is outside the vocabulary of size {vocab}"
    )]
    TokenOutOfRange {
        /// Token position.
        position: usize,
        /// The token id.
        token: i64,
        /// Vocabulary size.
        vocab: usize,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, OpsError>;
