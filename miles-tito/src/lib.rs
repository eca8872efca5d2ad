//! miles-tito (skeleton).
