//! miles-ops (skeleton).
