//! The [`RewardFn`] seam.

use async_trait::async_trait;

use crate::error::Result;
use crate::sample::{Reward, Sample};

/// Scores generated samples. Object-safe, used as `Arc<dyn RewardFn>`.
///
/// A failure for one sample is returned as an error for that sample only; the rollout
/// manager marks it failed with the reason and carries on.
#[async_trait]
pub trait RewardFn: Send + Sync {
    /// Scores one sample.
    async fn reward(&self, sample: &Sample) -> Result<Reward>;

    /// Scores a group of samples of the same prompt (for rewards that compare within the
    /// group). The default scores each sample on its own, in order.
    async fn reward_group(&self, samples: &[Sample]) -> Vec<Result<Reward>> {
        let mut out = Vec::with_capacity(samples.len());
        for sample in samples {
            out.push(self.reward(sample).await);
        }
        out
    }
}
