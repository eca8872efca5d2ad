//! miles-r3 (skeleton).
