//! `cargo package`'s verification, within CI's time: every library crate is built from the
//! files of its package alone, as a user who `cargo add`s it would build it.
//!
//! `cargo package` verifies each crate by building it, in the dev profile, in a fresh
//! workspace: one more full build of burn and CubeCL per run, longer than the whole test
//! suite. Here the packages are made with `cargo package --no-verify`, unpacked side by side
//! into `target/package-check/`, joined into one workspace whose `[patch.crates-io]` points each
//! crate's registry dependency on another of ours at its unpacked package (what publishing
//! them together resolves to), and built with `cargo build --release --lib` into the same target
//! folder, starting from the workspace's `Cargo.lock`: the registry dependencies the test build compiled
//! are reused, and only our crates compile again, from their packaged sources (at `opt-level = 0`:
//! this build checks that they compile, nothing runs them). For the reuse, the check workspace
//! resolves features as the test build does: a `feature-mirror` member depends on what the
//! test build adds to the libraries' dependency graph (every crate's dev-dependencies, the
//! unpublished crates' dependencies, as `cargo metadata` lists them), else one feature of a
//! low-level dependency would rebuild all of burn above it. A file a crate needs that its
//! package lacks (a template, a fixture, a licence) fails here.

use std::fs;
use std::path::{Path, PathBuf};

use crate::workspace::{KERNEL_FEATURES, cargo, run, workspace_root};

/// Packages `crates`, unpacks them and builds them from the unpacked files.
pub fn verify(crates: &[&str]) -> Result<(), String> {
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                root.join(dir)
            }
        })
        .unwrap_or_else(|| root.join("target"));

    let mut package = cargo();
    package.args(["package", "--no-verify", "--allow-dirty"]);
    for krate in crates {
        package.args(["-p", krate]);
    }
    run(package)?;

    let check = target.join("package-check");
    if check.exists() {
        fs::remove_dir_all(&check).map_err(|e| format!("cannot clear {}: {e}", check.display()))?;
    }
    fs::create_dir_all(&check).map_err(|e| format!("cannot create {}: {e}", check.display()))?;

    let mut members = Vec::new();
    for krate in crates {
        let archive = newest_package(&target.join("package"), krate)?;
        let mut untar = std::process::Command::new("tar");
        // `-m`: the files get the extraction time, not the archive's (cargo packages with a
        // fixed old mtime), so a rerun in a used target dir never takes a previous check's
        // build of the same path for fresh.
        untar.arg("-xzmf").arg(&archive).arg("-C").arg(&check);
        run(untar)?;
        let folder = archive
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.strip_suffix(".crate"))
            .ok_or_else(|| format!("odd package name {}", archive.display()))?
            .to_owned();
        if !check.join(&folder).join("Cargo.toml").is_file() {
            return Err(format!(
                "{} did not unpack into {folder}/",
                archive.display()
            ));
        }
        members.push(((*krate).to_owned(), folder));
    }

    let mirror = check.join(MIRROR);
    fs::create_dir_all(mirror.join("src"))
        .map_err(|e| format!("cannot create {}: {e}", mirror.display()))?;
    fs::write(
        mirror.join("Cargo.toml"),
        mirror_manifest(&test_build_extras()?),
    )
    .map_err(|e| format!("cannot write the feature mirror: {e}"))?;
    fs::write(
        mirror.join("src").join("lib.rs"),
        "//! Dependencies only: the test build's feature resolution.\n",
    )
    .map_err(|e| format!("cannot write the feature mirror: {e}"))?;

    let inherited = release_overrides(&root.join("Cargo.toml"))?;
    fs::write(check.join("Cargo.toml"), manifest(&members, &inherited)?)
        .map_err(|e| format!("cannot write the package-check manifest: {e}"))?;
    fs::copy(root.join("Cargo.lock"), check.join("Cargo.lock"))
        .map_err(|e| format!("cannot copy Cargo.lock: {e}"))?;

    let mut build = cargo();
    build
        .current_dir(&check)
        .env("CARGO_TARGET_DIR", &target)
        .args([
            "build",
            "--release",
            "--workspace",
            "--lib",
            "--features",
            KERNEL_FEATURES,
        ]);
    run(build)?;
    for (krate, folder) in &members {
        eprintln!("xtask: {krate}: builds from its package ({folder}.crate)");
    }
    Ok(())
}

/// The workspace's `[profile.release.package.*]` overrides (of dependencies: the check
/// workspace must compile them as the test build did, or it rebuilds them and all above).
pub fn release_overrides(manifest: &Path) -> Result<toml::Table, String> {
    let text = fs::read_to_string(manifest)
        .map_err(|e| format!("cannot read {}: {e}", manifest.display()))?;
    let parsed: toml::Table = text
        .parse()
        .map_err(|e| format!("{}: {e}", manifest.display()))?;
    Ok(parsed
        .get("profile")
        .and_then(|p| p.get("release"))
        .and_then(|r| r.get("package"))
        .and_then(toml::Value::as_table)
        .cloned()
        .unwrap_or_default())
}

/// The workspace of unpacked packages: each crate a member, each registry dependency on one
/// of them patched to its folder, our crates compiled without optimisation, and the test
/// build's release overrides of dependencies (`inherited`) kept.
pub fn manifest(members: &[(String, String)], inherited: &toml::Table) -> Result<String, String> {
    let mut text = String::from(
        "# Written by `cargo xtask ci`: the library crates as their packages hold them.\n\
         [workspace]\nresolver = \"3\"\nmembers = [\n",
    );
    for (_, folder) in members {
        text.push_str(&format!("    \"{folder}\",\n"));
    }
    text.push_str(&format!("    \"{MIRROR}\",\n"));
    text.push_str("]\n\n[patch.crates-io]\n");
    for (krate, folder) in members {
        text.push_str(&format!("{krate} = {{ path = \"{folder}\" }}\n"));
    }
    for (krate, _) in members {
        text.push_str(&format!(
            "\n[profile.release.package.{krate}]\nopt-level = 0\n"
        ));
    }
    for (krate, settings) in inherited {
        if members.iter().any(|(member, _)| member == krate) {
            continue;
        }
        text.push_str(&format!("\n[profile.release.package.{krate}]\n"));
        for (key, value) in settings.as_table().into_iter().flatten() {
            let value = match value {
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                toml::Value::String(s) => format!("{s:?}"),
                other => {
                    return Err(format!(
                        "profile.release.package.{krate}.{key}: unsupported value {other:?}"
                    ));
                }
            };
            text.push_str(&format!("{key} = {value}\n"));
        }
    }
    Ok(text)
}

/// The check workspace's member that reproduces the test build's feature resolution.
const MIRROR: &str = "feature-mirror";

/// One registry dependency the test build adds to the libraries' graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extra {
    /// The name the dependency is declared under (a `rename`, else the crate's name).
    pub key: String,
    /// The crate's name.
    pub package: String,
    /// The version requirement.
    pub req: String,
    /// Features requested (the union over every declaration).
    pub features: Vec<String>,
    /// Whether any declaration keeps the default features.
    pub default_features: bool,
}

/// The registry dependencies of the workspace's dev-dependencies and of its unpublished
/// packages (examples, xtask), merged by name, from `cargo metadata`.
fn test_build_extras() -> Result<Vec<Extra>, String> {
    let mut metadata = cargo();
    metadata.args(["metadata", "--format-version", "1", "--no-deps"]);
    let output = metadata
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    extras_from_metadata(&String::from_utf8_lossy(&output.stdout))
}

/// [`test_build_extras`] over `cargo metadata`'s JSON.
pub fn extras_from_metadata(json: &str) -> Result<Vec<Extra>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("cargo metadata: {e}"))?;
    let packages = value["packages"]
        .as_array()
        .ok_or("cargo metadata: no packages")?;
    let mut extras: Vec<Extra> = Vec::new();
    for package in packages {
        let unpublished = package["publish"]
            .as_array()
            .is_some_and(|registries| registries.is_empty());
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            let is_dev = dep["kind"].as_str() == Some("dev");
            let from_registry = !dep["source"].is_null();
            if !(from_registry && (is_dev || unpublished)) || !dep["target"].is_null() {
                continue;
            }
            let package_name = dep["name"].as_str().ok_or("dependency without a name")?;
            let key = dep["rename"].as_str().unwrap_or(package_name).to_owned();
            let features: Vec<String> = dep["features"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f.as_str().map(str::to_owned))
                .collect();
            let default_features = dep["uses_default_features"].as_bool().unwrap_or(true);
            match extras.iter_mut().find(|e| e.key == key) {
                Some(known) => {
                    known.default_features |= default_features;
                    known.features.extend(features);
                    known.features.sort();
                    known.features.dedup();
                }
                None => {
                    let mut features = features;
                    features.sort();
                    features.dedup();
                    extras.push(Extra {
                        key,
                        package: package_name.to_owned(),
                        req: dep["req"].as_str().unwrap_or("*").to_owned(),
                        features,
                        default_features,
                    })
                }
            }
        }
    }
    extras.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(extras)
}

/// The feature mirror's manifest.
pub fn mirror_manifest(extras: &[Extra]) -> String {
    let mut text = format!(
        "[package]\nname = \"{MIRROR}\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n[dependencies]\n"
    );
    for extra in extras {
        let features: Vec<String> = extra.features.iter().map(|f| format!("{f:?}")).collect();
        text.push_str(&format!(
            "{} = {{ package = {:?}, version = {:?}, default-features = {}, features = [{}] }}\n",
            extra.key,
            extra.package,
            extra.req,
            extra.default_features,
            features.join(", ")
        ));
    }
    text
}

/// The newest `target/package/<crate>-<version>.crate`.
fn newest_package(dir: &Path, krate: &str) -> Result<PathBuf, String> {
    let prefix = format!("{krate}-");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let is_ours = name
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(".crate"))
            .is_some_and(|version| version.starts_with(|c: char| c.is_ascii_digit()));
        if is_ours {
            let modified = entry
                .metadata()
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            found.push((modified, path));
        }
    }
    found.sort();
    found
        .pop()
        .map(|(_, path)| path)
        .ok_or_else(|| format!("no {krate}-<version>.crate in {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_manifest_patches_every_crate_to_its_package() {
        let inherited: toml::Table = "[naga]\nopt-level = 1\n[miles-r3]\nopt-level = 3\n"
            .parse()
            .unwrap();
        let text = manifest(
            &[
                ("miles-core".into(), "miles-core-0.1.0".into()),
                ("miles-r3".into(), "miles-r3-0.1.0".into()),
            ],
            &inherited,
        )
        .unwrap();
        let parsed: toml::Table = text.parse().expect("valid TOML");
        let members = parsed["workspace"]["members"].as_array().unwrap();
        assert_eq!(members.len(), 3);
        assert_eq!(members[2].as_str(), Some(MIRROR));
        assert_eq!(members[1].as_str(), Some("miles-r3-0.1.0"));
        let patch = parsed["patch"]["crates-io"].as_table().unwrap();
        assert_eq!(
            patch["miles-core"]["path"].as_str(),
            Some("miles-core-0.1.0")
        );
        let profiles = &parsed["profile"]["release"]["package"];
        assert_eq!(profiles["miles-r3"]["opt-level"].as_integer(), Some(0));
        // A dependency's override carries over; ours stay unoptimised.
        assert_eq!(profiles["naga"]["opt-level"].as_integer(), Some(1));
    }

    #[test]
    fn the_release_overrides_come_from_the_workspace_manifest() {
        let root = workspace_root().join("Cargo.toml");
        let overrides = release_overrides(&root).unwrap();
        assert_eq!(overrides["cubek-matmul"]["opt-level"].as_integer(), Some(1));
        assert!(!overrides.contains_key("burn-flex"));
    }

    #[test]
    fn the_mirror_takes_dev_dependencies_and_the_unpublished_crates_dependencies() {
        let json = r#"{"packages": [
          {"name": "lib", "publish": null, "dependencies": [
            {"name": "serde", "rename": null, "kind": null, "req": "^1", "features": ["derive"],
             "uses_default_features": true, "target": null, "source": "registry+https://x"},
            {"name": "tokio", "rename": null, "kind": "dev", "req": "^1.45", "features": ["macros"],
             "uses_default_features": false, "target": null, "source": "registry+https://x"}]},
          {"name": "examples", "publish": [], "dependencies": [
            {"name": "tokio", "rename": null, "kind": null, "req": "^1.45", "features": ["net", "macros"],
             "uses_default_features": false, "target": null, "source": "registry+https://x"},
            {"name": "lib", "rename": null, "kind": null, "req": "^0.1", "features": [],
             "uses_default_features": true, "target": null, "source": null},
            {"name": "libc", "rename": null, "kind": null, "req": "^0.2", "features": [],
             "uses_default_features": true, "target": "cfg(unix)", "source": "registry+https://x"}]}
        ]}"#;
        let extras = extras_from_metadata(json).unwrap();
        assert_eq!(extras.len(), 1, "{extras:?}");
        assert_eq!(extras[0].key, "tokio");
        assert_eq!(extras[0].features, ["macros", "net"]);
        assert!(!extras[0].default_features);
        let text = mirror_manifest(&extras);
        let parsed: toml::Table = text.parse().expect("valid TOML");
        let tokio = &parsed["dependencies"]["tokio"];
        assert_eq!(tokio["version"].as_str(), Some("^1.45"));
        assert_eq!(tokio["default-features"].as_bool(), Some(false));
        assert_eq!(tokio["features"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn the_newest_package_of_a_crate_is_found_and_prefixes_do_not_collide() {
        let dir = std::env::temp_dir().join(format!("xtask-pkg-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for name in [
            "miles-r3-0.1.0.crate",
            "miles-rollout-0.1.0.crate",
            "miles-r3-notes.txt",
        ] {
            fs::write(dir.join(name), b"x").unwrap();
        }
        let found = newest_package(&dir, "miles-r3").unwrap();
        assert_eq!(found.file_name().unwrap(), "miles-r3-0.1.0.crate");
        assert!(newest_package(&dir, "miles-core").is_err());
        fs::remove_dir_all(&dir).unwrap();
    }
}
