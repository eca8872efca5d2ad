//! The crate's error type.

use crate::rules;

/// What miles-reward reports outside a reward (a reward failure is a
/// [`miles_core::Error::Reward`], which the rollout turns into a failed sample).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An `--rm-type` that the rm_hub (as re-created here) does not know. The message lists
    /// every rule of the registry.
    #[error(
        "unknown rm_type {name:?}: expected one of {}, optionally prefixed with boxed_{}",
        rules::name_list(),
        not_implemented_note(name)
    )]
    UnknownRmType {
        /// The name given (after Miles' whitespace strip).
        name: String,
    },
}

/// `" (NAME is not implemented in miles-rs)"` for a rule of Miles that is not here.
fn not_implemented_note(name: &str) -> String {
    let rule = name.trim_start_matches("boxed_");
    if rules::NOT_IMPLEMENTED.contains(&rule) {
        format!(" ({rule} is not implemented in miles-rs)")
    } else {
        String::new()
    }
}
