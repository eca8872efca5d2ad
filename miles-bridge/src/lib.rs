//! miles-bridge (skeleton).
