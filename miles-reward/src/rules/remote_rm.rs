//! `remote_rm`: the answer of the hub's reward model (Miles' `--rm-url`), reached through the
//! [`miles_core::RewardFn`] seam — [`crate::RemoteReward`] over HTTP, or any other
//! implementation given to [`crate::RmHubReward::with_remote`].

use miles_core::Error as CoreError;

use crate::rule::{RewardFuture, RuleInput};

/// The rule's scoring function.
pub(crate) fn score(input: RuleInput<'_>) -> RewardFuture<'_> {
    Box::pin(async move {
        match input.remote {
            Some(remote) => remote.reward(input.sample).await,
            None => Err(CoreError::Reward(
                "rm_type remote_rm needs a reward model URL (--rm-url)".into(),
            )),
        }
    })
}
