//! miles-core (skeleton).
