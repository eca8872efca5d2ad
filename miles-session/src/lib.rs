//! miles-session (skeleton).
