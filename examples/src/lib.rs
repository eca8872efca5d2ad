//! # miles-examples
//!
//! Runnable examples of miles-rs and the cross-crate integration tests that need more than one
//! crate (e.g. embedded-engine log-probs against the trainer's). The reference binary
//! `glm_moe_grpo` lands here (`cargo run --release --example glm_moe_grpo`).
//!
//! This library holds what the examples and tests share, starting with fixture lookup:
//! fixtures committed in the repository's `fixtures/` win; otherwise the shared reference
//! fixtures beside the checkout (`../shared/fixtures`) are used; a fixture found in neither is
//! a loud error naming both places, never a silent skip.
//!
//! ```
//! use miles_examples::{FixtureError, fixture_path};
//!
//! let missing = fixture_path("no/such/fixture.json").unwrap_err();
//! assert!(matches!(missing, FixtureError::Missing { ref searched, .. } if searched.len() == 2));
//! ```

use std::path::{Path, PathBuf};

/// A fixture that could not be found.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FixtureError {
    /// The fixture is in none of the searched folders.
    #[error(
        "fixture {relative:?} not found; searched {searched:?} (copy it into the repo's fixtures/ or check out ../shared beside the repo)"
    )]
    Missing {
        /// The path asked for, relative to a fixtures folder.
        relative: PathBuf,
        /// The folders searched, in order.
        searched: Vec<PathBuf>,
    },
}

/// The fixture folders, in search order: `<repo>/fixtures`, then `<repo>/../shared/fixtures`.
pub fn fixture_roots() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    vec![repo.join("fixtures"), repo.join("../shared/fixtures")]
}

/// The path of a fixture, from the first folder of [`fixture_roots`] that has it.
pub fn fixture_path(relative: impl AsRef<Path>) -> Result<PathBuf, FixtureError> {
    let relative = relative.as_ref();
    let searched = fixture_roots();
    searched
        .iter()
        .map(|root| root.join(relative))
        .find(|path| path.exists())
        .ok_or_else(|| FixtureError::Missing {
            relative: relative.to_path_buf(),
            searched,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_fixtures_come_first() {
        let roots = fixture_roots();
        assert!(roots[0].ends_with("fixtures"));
        assert!(roots[1].ends_with("shared/fixtures"));
        let err = fixture_path("missing.bin").unwrap_err();
        assert!(err.to_string().contains("missing.bin"));
    }
}
