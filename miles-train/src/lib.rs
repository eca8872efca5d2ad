//! miles-train (skeleton).
