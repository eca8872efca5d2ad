//! [`RmHubReward`]: Miles' rm_hub as one [`RewardFn`] — the global `--rm-type`, a sample's
//! `metadata["rm_type"]` overriding it, the `boxed_` prefix, and dispatch to the rule's row
//! of the registry.

use std::fmt;
use std::sync::{Arc, Mutex};

use miles_core::rng::SplitMix64;
use miles_core::{Error as CoreError, Result as CoreResult, Reward, RewardFn, Sample, async_trait};

use crate::math_utils::extract_answer;
use crate::rm_type::{RmType, resolve_rm_type};
use crate::rule::RuleInput;

/// Miles' rm_hub as one reward: the global `--rm-type` (optional), a sample's
/// `metadata["rm_type"]` overriding it, the `boxed_` prefix, every rule of the registry
/// ([`crate::RmRule::all`]), and `remote_rm` through the reward model given to
/// [`RmHubReward::with_remote`] (any [`RewardFn`]; [`crate::RemoteReward`] over HTTP).
pub struct RmHubReward {
    rm_type: Option<RmType>,
    remote: Option<Arc<dyn RewardFn>>,
    /// The stream of `random`.
    rng: Mutex<SplitMix64>,
}

impl fmt::Debug for RmHubReward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RmHubReward")
            .field("rm_type", &self.rm_type)
            .field("remote", &self.remote.as_ref().map(|_| "dyn RewardFn"))
            .finish_non_exhaustive()
    }
}

impl RmHubReward {
    /// A hub with the global `--rm-type` (`None`: every sample must name its own).
    pub fn new(rm_type: Option<RmType>) -> Self {
        Self {
            rm_type,
            remote: None,
            rng: Mutex::new(SplitMix64::new(0x9E37_79B9_7F4A_7C15)),
        }
    }

    /// The reward model used for `remote_rm` (Miles' `--rm-url`: a [`crate::RemoteReward`]),
    /// reached through the [`RewardFn`] seam.
    pub fn with_remote(mut self, remote: Arc<dyn RewardFn>) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Seeds `random` (Miles draws from Python's global `random`; here each hub has its own
    /// SplitMix64 stream).
    pub fn with_seed(self, seed: u64) -> Self {
        Self {
            rng: Mutex::new(SplitMix64::new(seed)),
            ..self
        }
    }

    /// The global `--rm-type`.
    pub fn rm_type(&self) -> Option<RmType> {
        self.rm_type
    }

    /// Scores `sample` with an explicit rm_type (no metadata lookup).
    pub async fn score_with(&self, rm_type: RmType, sample: &Sample) -> CoreResult<Reward> {
        let response: &str = if rm_type.boxed {
            extract_answer(&sample.response).unwrap_or("")
        } else {
            &sample.response
        };
        let input = RuleInput {
            sample,
            response,
            label: sample.label.as_deref(),
            remote: self.remote.as_deref(),
            rng: &self.rng,
        };
        rm_type.rule.rule().score(input).await
    }
}

#[async_trait]
impl RewardFn for RmHubReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let global = self.rm_type.map(|t| t.to_string());
        let rm_type = resolve_rm_type(&sample.metadata, global.as_deref())?
            .ok_or_else(|| CoreError::Reward("rule-based RM type is not specified".into()))?;
        self.score_with(rm_type, sample).await
    }
}

#[async_trait]
impl RewardFn for RmType {
    /// Scores as an [`RmHubReward`] with this global rm_type and no remote model (a sample's
    /// `metadata["rm_type"]` still overrides it, as in Miles).
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        RmHubReward::new(Some(*self)).reward(sample).await
    }
}
