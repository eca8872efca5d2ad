//! miles-rollout (skeleton).
