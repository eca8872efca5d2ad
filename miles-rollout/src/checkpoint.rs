//! Durable RL-loop checkpoints: `iter_NNNNNNN/` folders under `--save`, each holding the
//! trainer's part (`trainer/`), the rollout side (`rollout_state.json`) and a manifest
//! (`manifest.json`: every file's size and CRC-32), published atomically.
//!
//! A checkpoint is written into `.iter_NNNNNNN.partial/`; every file and folder in it is
//! fsynced, the manifest is written and fsynced last, the folder is renamed into place and
//! the parent folder fsynced, so after a crash or power loss a checkpoint is either absent
//! or complete. On resume, [`latest_valid_checkpoint`] checks each candidate against its
//! manifest, newest first, and falls back past truncated or corrupt ones, saying why.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Name of the manifest file in a checkpoint folder.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Name of the rollout side's state file in a checkpoint folder.
pub const ROLLOUT_STATE_FILE: &str = "rollout_state.json";
const FORMAT: u32 = 1;

/// One file of a checkpoint, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Path relative to the checkpoint folder, `/`-separated.
    pub path: String,
    /// Size in bytes.
    pub bytes: u64,
    /// CRC-32 (IEEE) of the contents, as 8 hex digits.
    pub crc32: String,
}

/// The manifest of a checkpoint folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Manifest format version.
    pub format_version: u32,
    /// Every file of the checkpoint but the manifest, sorted by path.
    pub files: Vec<ManifestEntry>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// CRC-32 and size of a file, read in 1 MiB chunks.
fn file_crc(path: &Path) -> Result<(u64, u32)> {
    let mut file = fs::File::open(path).map_err(io(path))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let read = file.read(&mut buffer).map_err(io(path))?;
        if read == 0 {
            break;
        }
        total += read as u64;
        hasher.update(&buffer[..read]);
    }
    Ok((total, hasher.finalize()))
}

/// Every regular file under `dir` (relative, `/`-separated, sorted), symlinks excluded.
fn files_under(dir: &Path) -> Result<Vec<String>> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
        for entry in fs::read_dir(dir).map_err(io(dir))? {
            let entry = entry.map_err(io(dir))?;
            let path = entry.path();
            let kind = entry.file_type().map_err(io(&path))?;
            if kind.is_dir() {
                walk(root, &path, out)?;
            } else if kind.is_file() {
                let relative = path.strip_prefix(root).unwrap_or(&path);
                let parts: Vec<String> = relative
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                out.push(parts.join("/"));
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out)?;
    out.sort();
    Ok(out)
}

/// fsyncs a file or a folder (a folder's fsync makes the names in it durable).
pub fn fsync(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(io(path))
}

/// fsyncs every file and folder under `dir`, and `dir` itself.
fn fsync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(io(&path))?;
        if kind.is_dir() {
            fsync_tree(&path)?;
        } else if kind.is_file() {
            fsync(&path)?;
        }
    }
    fsync(dir)
}

/// Writes `manifest.json` for the files of `dir` (the manifest itself excluded), after
/// fsyncing all of them, and fsyncs the manifest and `dir`.
pub fn write_manifest(dir: &Path) -> Result<Manifest> {
    fsync_tree(dir)?;
    let mut files = Vec::new();
    for relative in files_under(dir)? {
        if relative == MANIFEST_FILE {
            continue;
        }
        let (bytes, crc) = file_crc(&dir.join(&relative))?;
        files.push(ManifestEntry {
            path: relative,
            bytes,
            crc32: format!("{crc:08x}"),
        });
    }
    let manifest = Manifest {
        format_version: FORMAT,
        files,
    };
    let path = dir.join(MANIFEST_FILE);
    let text = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| Error::Config(format!("cannot serialise the manifest: {e}")))?;
    fs::write(&path, text).map_err(io(&path))?;
    fsync(&path)?;
    fsync(dir)?;
    Ok(manifest)
}

/// Checks a checkpoint folder against its manifest: every listed file present with its size
/// and CRC-32, and no file missing from the list (a manifest-less folder is not complete).
/// The error says what is wrong.
pub fn verify_checkpoint(dir: &Path) -> Result<()> {
    let path = dir.join(MANIFEST_FILE);
    let text = fs::read(&path).map_err(|e| {
        Error::Config(format!(
            "{}: no readable manifest ({e}): the checkpoint is incomplete",
            dir.display()
        ))
    })?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| Error::Config(format!("{}: corrupt manifest: {e}", path.display())))?;
    if manifest.format_version != FORMAT {
        return Err(Error::Config(format!(
            "{}: manifest format {} (this build reads {FORMAT})",
            path.display(),
            manifest.format_version
        )));
    }
    let present: Vec<String> = files_under(dir)?
        .into_iter()
        .filter(|f| f != MANIFEST_FILE)
        .collect();
    let listed: Vec<&str> = manifest.files.iter().map(|e| e.path.as_str()).collect();
    if let Some(extra) = present.iter().find(|f| !listed.contains(&f.as_str())) {
        return Err(Error::Config(format!(
            "{}: {extra} is not in the manifest",
            dir.display()
        )));
    }
    for entry in &manifest.files {
        if entry
            .path
            .split('/')
            .any(|part| part == ".." || part.is_empty())
        {
            return Err(Error::Config(format!(
                "{}: manifest entry {:?} is not a path inside the checkpoint",
                dir.display(),
                entry.path
            )));
        }
        let file = dir.join(&entry.path);
        let size = fs::metadata(&file)
            .map(|m| m.len())
            .map_err(|_| Error::Config(format!("{}: {} is missing", dir.display(), entry.path)))?;
        if size != entry.bytes {
            return Err(Error::Config(format!(
                "{}: {} has {size} bytes, the manifest says {}",
                dir.display(),
                entry.path,
                entry.bytes
            )));
        }
        let (_, crc) = file_crc(&file)?;
        if format!("{crc:08x}") != entry.crc32 {
            return Err(Error::Config(format!(
                "{}: {} fails its checksum (CRC-32 {crc:08x}, the manifest says {})",
                dir.display(),
                entry.path,
                entry.crc32
            )));
        }
    }
    Ok(())
}

/// Complete-looking `iter_NNNNNNN` folders under `root` (step, path), newest first.
pub fn checkpoints(root: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step: u64 = name.strip_prefix("iter_")?.parse().ok()?;
            e.path().is_dir().then_some((step, e.path()))
        })
        .collect();
    found.sort_by_key(|entry| std::cmp::Reverse(entry.0));
    found
}

/// The newest checkpoint under `root` that passes [`verify_checkpoint`], and one line for
/// each newer checkpoint skipped and why.
pub fn latest_valid_checkpoint(root: &Path) -> (Option<PathBuf>, Vec<String>) {
    let mut skipped = Vec::new();
    for (_, dir) in checkpoints(root) {
        match verify_checkpoint(&dir) {
            Ok(()) => return (Some(dir), skipped),
            Err(error) => skipped.push(format!("skipped {}: {error}", dir.display())),
        }
    }
    (None, skipped)
}

/// The HF model directory that a `--ref-load` / `--opd-teacher-load` path names, with Miles'
/// `--ref-ckpt-step` / `--opd-teacher-ckpt-step` as `step`: `root` itself when it is an HF
/// checkpoint (it has a `config.json`; a step is then an error, such a folder has none);
/// otherwise `root` is an RL run's `--save` folder and the answer is the `trainer/model/` of
/// its checkpoint `iter_{step}` (which must pass its manifest), or of the newest checkpoint
/// that does when `step` is `None` (as Megatron reads `latest_checkpointed_iteration.txt`).
pub fn model_dir(root: &Path, step: Option<u64>) -> Result<PathBuf> {
    if root.join("config.json").is_file() {
        return match step {
            None => Ok(root.to_path_buf()),
            Some(step) => Err(Error::Config(format!(
                "{} is an HF checkpoint (it has a config.json), not a --save folder of \
                 iter_NNNNNNN checkpoints: it has no step {step}; drop the step or point at \
                 the run's --save folder",
                root.display()
            ))),
        };
    }
    let found = checkpoints(root);
    let dir = match step {
        Some(step) => {
            let Some((_, dir)) = found.iter().find(|(s, _)| *s == step) else {
                let steps: Vec<String> = found.iter().rev().map(|(s, _)| s.to_string()).collect();
                return Err(Error::Config(format!(
                    "{}: no checkpoint of step {step} (iter_{step:07}); steps there: [{}]",
                    root.display(),
                    steps.join(", ")
                )));
            };
            verify_checkpoint(dir)?;
            dir.clone()
        }
        None => match latest_valid_checkpoint(root) {
            (Some(dir), _) => dir,
            (None, skipped) => {
                return Err(Error::Config(format!(
                    "{}: neither an HF checkpoint (no config.json) nor a --save folder with a \
                     complete iter_NNNNNNN checkpoint{}",
                    root.display(),
                    if skipped.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", skipped.join("; "))
                    }
                )));
            }
        },
    };
    let model = dir.join("trainer").join("model");
    if !model.join("config.json").is_file() {
        return Err(Error::Config(format!(
            "{}: no trainer/model/config.json in this checkpoint",
            dir.display()
        )));
    }
    Ok(model)
}

/// Publishes the checkpoint written in `partial` as `dir`: manifest (after fsyncing every
/// file), atomic rename, fsync of the parent folder.
pub fn publish(partial: &Path, dir: &Path) -> Result<()> {
    write_manifest(partial)?;
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    fs::rename(partial, dir).map_err(io(dir))?;
    if let Some(parent) = dir.parent() {
        fsync(parent)?;
    }
    Ok(())
}

/// Keeps the newest `keep` checkpoints under `root` (`--keep-checkpoints`) and removes the
/// older ones, and any `.partial` folder a killed save left behind. Returns the removed
/// folders.
pub fn prune(root: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    for (_, dir) in checkpoints(root).into_iter().skip(keep.max(1)) {
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
        removed.push(dir);
    }
    if let Ok(entries) = fs::read_dir(root) {
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".iter_") && name.ends_with(".partial") {
                let path = entry.path();
                fs::remove_dir_all(&path).map_err(io(&path))?;
                removed.push(path);
            }
        }
    }
    if !removed.is_empty() {
        fsync(root)?;
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("miles-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn model_dir_names_a_step_or_the_newest_valid_checkpoint() {
        let root = scratch("model-dir");
        for step in [3, 5, 7] {
            let partial = root.join(format!(".iter_{step:07}.partial"));
            fs::create_dir_all(partial.join("trainer/model")).unwrap();
            fs::write(partial.join("trainer/model/config.json"), b"{}").unwrap();
            fs::write(
                partial.join("trainer/model/model.safetensors"),
                [step as u8; 8],
            )
            .unwrap();
            publish(&partial, &root.join(format!("iter_{step:07}"))).unwrap();
        }
        let model = |step| model_dir(&root, step);
        assert_eq!(
            model(Some(5)).unwrap(),
            root.join("iter_0000005/trainer/model")
        );
        assert_eq!(
            model(None).unwrap(),
            root.join("iter_0000007/trainer/model")
        );
        // A corrupt newest checkpoint: the newest valid one; the step itself is refused.
        fs::write(
            root.join("iter_0000007/trainer/model/model.safetensors"),
            [0u8; 8],
        )
        .unwrap();
        assert_eq!(
            model(None).unwrap(),
            root.join("iter_0000005/trainer/model")
        );
        let err = model(Some(7)).unwrap_err().to_string();
        assert!(err.contains("checksum"), "{err}");
        let err = model(Some(4)).unwrap_err().to_string();
        assert!(
            err.contains("no checkpoint of step 4") && err.contains("[3, 5, 7]"),
            "{err}"
        );
        // An HF checkpoint is its own model, and has no step.
        let hf = root.join("iter_0000003/trainer/model");
        assert_eq!(model_dir(&hf, None).unwrap(), hf);
        let err = model_dir(&hf, Some(3)).unwrap_err().to_string();
        assert!(err.contains("has no step 3"), "{err}");
        let empty = scratch("model-dir-empty");
        assert!(
            model_dir(&empty, None)
                .unwrap_err()
                .to_string()
                .contains("neither")
        );
        fs::remove_dir_all(&root).unwrap();
        fs::remove_dir_all(&empty).unwrap();
    }

    fn fake_checkpoint(root: &Path, step: u64, payload: &[u8]) -> PathBuf {
        let partial = root.join(format!(".iter_{step:07}.partial"));
        fs::create_dir_all(partial.join("trainer/model")).unwrap();
        fs::write(partial.join("trainer/model/model.safetensors"), payload).unwrap();
        fs::write(partial.join(ROLLOUT_STATE_FILE), b"{}").unwrap();
        let dir = root.join(format!("iter_{step:07}"));
        publish(&partial, &dir).unwrap();
        dir
    }

    #[test]
    fn manifest_lists_sizes_and_crcs_and_detects_damage() {
        let root = scratch("manifest");
        let dir = fake_checkpoint(&root, 3, b"hello world");
        let manifest: Manifest =
            serde_json::from_slice(&fs::read(dir.join(MANIFEST_FILE)).unwrap()).unwrap();
        let paths: Vec<&str> = manifest.files.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [ROLLOUT_STATE_FILE, "trainer/model/model.safetensors"]
        );
        // CRC-32 (IEEE) of "hello world" is 0x0d4a1185.
        assert_eq!(manifest.files[1].crc32, "0d4a1185");
        assert_eq!(manifest.files[1].bytes, 11);
        verify_checkpoint(&dir).unwrap();

        let weights = dir.join("trainer/model/model.safetensors");
        fs::write(&weights, b"hello").unwrap();
        let err = verify_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("has 5 bytes"), "{err}");
        fs::write(&weights, b"hello worlD").unwrap();
        let err = verify_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("fails its checksum"), "{err}");
        fs::write(&weights, b"hello world").unwrap();
        fs::write(dir.join("stray"), b"x").unwrap();
        let err = verify_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("stray is not in the manifest"), "{err}");
        fs::remove_file(dir.join("stray")).unwrap();
        fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        let err = verify_checkpoint(&dir).unwrap_err().to_string();
        assert!(err.contains("incomplete"), "{err}");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn resume_falls_back_past_corrupt_checkpoints_and_prune_keeps_the_newest() {
        let root = scratch("fallback");
        for step in [1, 3, 5, 7] {
            fake_checkpoint(&root, step, format!("weights {step}").as_bytes());
        }
        // The newest is truncated, the one before lost its manifest (killed mid-publish).
        let newest = root.join("iter_0000007/trainer/model/model.safetensors");
        fs::write(&newest, b"wei").unwrap();
        fs::remove_file(root.join("iter_0000005").join(MANIFEST_FILE)).unwrap();
        let (found, skipped) = latest_valid_checkpoint(&root);
        assert_eq!(found, Some(root.join("iter_0000003")));
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        assert!(skipped[0].contains("iter_0000007") && skipped[0].contains("bytes"));
        assert!(skipped[1].contains("iter_0000005") && skipped[1].contains("incomplete"));

        fs::create_dir_all(root.join(".iter_0000009.partial")).unwrap();
        let removed = prune(&root, 2).unwrap();
        assert_eq!(removed.len(), 3, "{removed:?}");
        let left: Vec<u64> = checkpoints(&root).into_iter().map(|(s, _)| s).collect();
        assert_eq!(left, [7, 5]);
        assert!(!root.join(".iter_0000009.partial").exists());
        fs::remove_dir_all(&root).unwrap();
    }
}
