//! The miles-tito loader of `miles session`: [`load_tokenizer`] builds miles-tito's
//! [`TitoChat`] (the [`ChatTokenizer`] of a TITO family over a model directory) and has the
//! shape of [`crate::cli::TokenizerLoader`], so `miles session` serves `--model DIR --tito FAMILY`
//! for every family of miles-tito's table.

use std::path::Path;
use std::sync::Arc;

use miles_tito::{ChatTokenizer, TitoChat};

use crate::error::{Error, Result};

/// Loads `dir` as family `family` (a [`crate::cli::TokenizerLoader`]). An unknown family, a
/// directory that does not load, or a tokenizer the family cannot use is
/// [`Error::Config`].
pub fn load_tokenizer(dir: &Path, family: &str) -> Result<Arc<dyn ChatTokenizer>> {
    let chat = TitoChat::load(dir, family).map_err(|e| Error::Config(e.to_string()))?;
    Ok(Arc::new(chat))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3")
    }

    #[test]
    fn unknown_family_and_missing_dir_are_config_errors() {
        assert!(matches!(
            load_tokenizer(&qwen3_dir(), "qwen9"),
            Err(Error::Config(_))
        ));
        assert!(matches!(
            load_tokenizer(Path::new("/nonexistent/model"), "qwen3"),
            Err(Error::Config(_))
        ));
    }
}
