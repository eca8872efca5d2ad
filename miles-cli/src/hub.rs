//! Model ids such as `Qwen/Qwen3-0.6B` resolved from the local Hugging Face cache: the hub is
//! never contacted. The cache is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub` (huggingface_hub's order); a model `org/name` lives in
//! `models--org--name/snapshots/<revision>`, the revision of `refs/main`.

use std::path::{Path, PathBuf};

/// The Hugging Face hub cache folder of this environment.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("HF_HUB_CACHE")
        .or_else(|| env("HF_HOME").map(|home| home.join("hub")))
        .or_else(|| env("HOME").map(|home| home.join(".cache/huggingface/hub")))
}

/// Whether `spec` has the shape of a hub model id (`org/name`, no other separators).
pub fn is_model_id(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| {
            !p.is_empty()
                && !p.starts_with('.')
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        })
    };
    ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

/// The snapshot folder of `model_id` in the cache at `cache`, if it is there.
pub fn snapshot(cache: &Path, model_id: &str) -> Option<PathBuf> {
    let repo = cache.join(format!("models--{}", model_id.replace('/', "--")));
    let revision = std::fs::read_to_string(repo.join("refs/main")).ok()?;
    let dir = repo.join("snapshots").join(revision.trim());
    dir.is_dir().then_some(dir)
}

/// `spec` as a model directory: an existing path as it is; a hub id found in the local cache
/// as its snapshot folder; anything else is an error naming `flag`, the cache folder looked
/// in and what to pass instead.
pub fn resolve(spec: &str, flag: &str) -> Result<PathBuf, String> {
    let path = Path::new(spec);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    if !is_model_id(spec) {
        return Err(format!("{flag} {spec}: no such directory"));
    }
    let cache = cache_dir();
    if let Some(dir) = cache.as_deref().and_then(|c| snapshot(c, spec)) {
        return Ok(dir);
    }
    let looked = cache.map_or_else(
        || "no cache folder ($HF_HUB_CACHE, $HF_HOME and $HOME are unset)".to_owned(),
        |c| {
            format!(
                "{}",
                c.join(format!("models--{}", spec.replace('/', "--")))
                    .display()
            )
        },
    );
    Err(format!(
        "{flag} {spec}: not a directory, and not in the local Hugging Face cache ({looked}); \
         the hub is not contacted: download it first (e.g. `hf download {spec}`) or pass the \
         model's directory"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_ids_resolve_to_their_main_snapshot() {
        assert!(is_model_id("Qwen/Qwen3-0.6B"));
        assert!(!is_model_id("/abs/dir"));
        assert!(!is_model_id("runs/a/b"));
        assert!(!is_model_id("./Qwen3"));
        assert!(!is_model_id("../x/y"));
        let cache = std::env::temp_dir().join(format!("miles-hub-{}", std::process::id()));
        let repo = cache.join("models--Qwen--Qwen3-0.6B");
        std::fs::create_dir_all(repo.join("snapshots/abc123")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        assert_eq!(snapshot(&cache, "Qwen/Qwen3-0.6B"), None, "no refs/main");
        std::fs::write(repo.join("refs/main"), "abc123\n").unwrap();
        assert_eq!(
            snapshot(&cache, "Qwen/Qwen3-0.6B"),
            Some(repo.join("snapshots/abc123"))
        );
        assert_eq!(snapshot(&cache, "Qwen/Qwen3-8B"), None);
        std::fs::remove_dir_all(&cache).ok();
    }

    #[test]
    fn a_missing_model_says_the_hub_is_not_contacted() {
        let err = resolve("NoSuchOrg/no-such-model-here", "--hf-checkpoint").unwrap_err();
        assert!(
            err.starts_with("--hf-checkpoint NoSuchOrg/no-such-model-here"),
            "{err}"
        );
        assert!(err.contains("hub is not contacted"), "{err}");
        assert!(
            err.contains("models--NoSuchOrg--no-such-model-here"),
            "{err}"
        );
        let err = resolve("/no/such/dir", "--model").unwrap_err();
        assert_eq!(err, "--model /no/such/dir: no such directory");
    }
}
