//! Project automation: `cargo xtask test | lint | package | ci | bench`.
//!
//! * `test`  — the one test command: `cargo test --workspace --release` with the kernel
//!   features on (one build of burn), kernel tests on the software Vulkan adapter.
//! * `lint`  — no import cycle between the files of a crate ([`cycles`]: `a.rs` and `b.rs`
//!   never use each other, directly or through other files; crates in `CYCLE_CHECK_PENDING`
//!   are reported, not enforced), the dependency rule (each crate depends only on crates below
//!   it in [`LAYERS`]; no burn / CubeCL under miles-core, miles-tito, miles-session,
//!   miles-reward and miles-rollout with any feature set), the library
//!   crates' packages (`cargo package --list` holds both licences and every file `src/`
//!   includes) and `cargo fmt --check`: no build, seconds; `.ci/run` runs it before the tests.
//! * `package` — every library crate built from its packaged files alone ([`package`]).
//! * `ci`    — what `.ci/run` runs: `lint`; `test` built with clippy as the workspace's
//!   compiler wrapper (warnings denied); the benches compiled; `package`.
//! * `bench` — runs every bench of the workspace (one `cargo bench -p P --bench B` per
//!   suite; `--only NAME`, `--quick`, `--list`), collects the `xtask-result:` lines each bench
//!   prints (format in [`results`]) and prints one table (ours, baseline, ratio, target,
//!   met?), merged into `BENCHMARKS.md` at the workspace root.

use std::env;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

mod bench;
mod cycles;
mod package;
mod results;
mod workspace;

use workspace::{KERNEL_FEATURES, cargo, run, workspace_root};

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((task, rest)) => (task.as_str(), rest),
        None => ("help", &[][..]),
    };
    let result = match task {
        "test" => test(rest),
        "ci" => ci(rest),
        "lint" => lint(),
        "package" => package::verify(&LAYERS),
        "bench" => bench::bench(rest),
        "help" | "--help" | "-h" => {
            println!("{}", usage());
            Ok(())
        }
        other => Err(format!("unknown task {other:?}\n{}", usage())),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::FAILURE
        }
    }
}

fn usage() -> &'static str {
    "usage: cargo xtask <task> [extra cargo args]\n\
     tasks:\n  \
       test   cargo test --workspace --release --features miles-ops/wgpu (kernel tests on lavapipe)\n  \
       ci     what .ci/run runs: lint, the tests built with clippy -D warnings, the benches compiled, package\n  \
       lint   no file import cycles, the dependency rule, the library packages' files and cargo fmt --check (seconds; .ci/run runs it)\n  \
       package  every library crate built from its packaged files alone (after a test build: minutes)\n  \
       bench  [--only NAME]... [--quick] [--list]: run the benches, print one table, write BENCHMARKS.md"
}

/// A private runtime folder for wgpu / Vulkan (silences their warnings when unset).
fn xdg_runtime_dir() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("XDG_RUNTIME_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let dir = env::temp_dir().join("miles-xdg-runtime");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700));
    }
    Ok(dir)
}

fn test(extra: &[String]) -> Result<(), String> {
    run(test_command(extra)?)
}

/// README's test command.
fn test_command(extra: &[String]) -> Result<Command, String> {
    let mut command = cargo();
    command
        .args([
            "test",
            "--workspace",
            "--release",
            "--features",
            KERNEL_FEATURES,
        ])
        .args(extra)
        .env("XDG_RUNTIME_DIR", xdg_runtime_dir()?);
    Ok(command)
}

/// Crates that must never pull burn or CubeCL (DESIGN.md: `cargo add miles-tito` stays light),
/// with the extra `cargo tree` flags that select their build. miles-rollout is light with
/// every feature set (the engine lives in miles-engine).
const LIGHT_CRATES: [(&str, &[&str]); 5] = [
    ("miles-core", &[]),
    ("miles-tito", &[]),
    ("miles-session", &[]),
    ("miles-reward", &[]),
    ("miles-rollout", &["--all-features"]),
];

/// The workspace's library crates from the bottom of the stack up (DESIGN.md's map): a
/// crate's normal and build dependencies among them must come earlier in this list, and every
/// library crate of the workspace must be in it (they are the crates a user would `cargo add`:
/// each must build from its packaged files). `miles-cli` (the `miles` binary over all of them)
/// is the top layer; only `miles-examples` and `xtask` sit above.
const LAYERS: [&str; 11] = [
    "miles-core",
    "miles-tito",
    "miles-session",
    "miles-reward",
    "miles-r3",
    "miles-ops",
    "miles-bridge",
    "miles-engine",
    "miles-train",
    "miles-rollout",
    "miles-cli",
];

/// Workspace members outside [`LAYERS`]: they may depend on any crate.
const TOP_OF_STACK: [&str; 2] = ["miles-examples", "xtask"];

/// Fails when a crate depends on one at or above its own layer, or a workspace crate is in
/// no layer (`cargo metadata`).
fn check_layers() -> Result<(), String> {
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
    let violations = layer_violations(&String::from_utf8_lossy(&output.stdout), &LAYERS)?;
    if !violations.is_empty() {
        return Err(format!(
            "the dependency rule is broken (a crate may depend only on crates below it: {}):\n  {}",
            LAYERS.join(" < "),
            violations.join("\n  ")
        ));
    }
    eprintln!(
        "xtask: every crate depends only on crates below it ({})",
        LAYERS.join(" < ")
    );
    Ok(())
}

/// The broken rules in `cargo metadata` JSON for `layers` (bottom first).
fn layer_violations(json: &str, layers: &[&str]) -> Result<Vec<String>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("cargo metadata: {e}"))?;
    let packages = value["packages"]
        .as_array()
        .ok_or("cargo metadata: no packages")?;
    let members: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut violations = Vec::new();
    for package in packages {
        let name = package["name"].as_str().ok_or("a package without a name")?;
        let Some(level) = layers.iter().position(|l| *l == name) else {
            if !TOP_OF_STACK.contains(&name) {
                violations.push(format!("{name} is in no layer (add it to xtask's LAYERS)"));
            }
            continue;
        };
        for dep in package["dependencies"].as_array().into_iter().flatten() {
            if dep["kind"].as_str() == Some("dev") {
                continue;
            }
            let Some(dep_name) = dep["name"].as_str() else {
                continue;
            };
            if !members.contains(&dep_name) {
                continue;
            }
            match layers.iter().position(|l| *l == dep_name) {
                Some(dep_level) if dep_level < level => {}
                _ => violations.push(format!("{name} depends on {dep_name}")),
            }
        }
    }
    Ok(violations)
}

/// Fails when a light crate's normal dependency tree contains burn or CubeCL.
fn check_light_crates() -> Result<(), String> {
    for (krate, flags) in LIGHT_CRATES {
        let mut tree = cargo();
        tree.args(["tree", "-p", krate, "-e", "normal", "--prefix", "none"])
            .args(flags);
        let output = tree
            .output()
            .map_err(|e| format!("cannot run cargo tree: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "cargo tree -p {krate} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let heavy = heavy_dependencies(&String::from_utf8_lossy(&output.stdout));
        if !heavy.is_empty() {
            return Err(format!(
                "{krate} must not depend on burn / cubecl, found {heavy:?}"
            ));
        }
        eprintln!("xtask: {krate}: no burn / cubecl in its dependency tree");
    }
    Ok(())
}

/// Names of burn / CubeCL crates in `cargo tree --prefix none` output.
fn heavy_dependencies(tree: &str) -> Vec<String> {
    let mut found: Vec<String> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| {
            *name == "burn"
                || name.starts_with("burn-")
                || *name == "cubecl"
                || name.starts_with("cubecl-")
        })
        .map(str::to_owned)
        .collect();
    found.sort();
    found.dedup();
    found
}

/// Fails when a library crate's package (`cargo package --list`) lacks a file its sources
/// compile in (`include_str!` / `include_bytes!` in `src/`, which may not reach outside the
/// crate) or either licence file. The cheap part of `cargo package`'s verification, which
/// would rebuild burn once per crate.
fn check_packages() -> Result<(), String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or("xtask has no parent folder")?
        .to_path_buf();
    for krate in LAYERS {
        let dir = root.join(krate);
        let mut list = cargo();
        list.args(["package", "--list", "--allow-dirty", "-p", krate])
            .current_dir(&root);
        let output = list
            .output()
            .map_err(|e| format!("cannot run cargo package: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "cargo package --list -p {krate} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        let packaged: std::collections::BTreeSet<String> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        let mut needed = vec!["LICENSE-MIT".to_owned(), "LICENSE-APACHE".to_owned()];
        needed.extend(included_files(&dir)?);
        let missing: Vec<&String> = needed.iter().filter(|f| !packaged.contains(*f)).collect();
        if !missing.is_empty() {
            return Err(format!(
                "{krate}: its package lacks {missing:?} (a file outside the crate, or excluded)"
            ));
        }
        eprintln!(
            "xtask: {krate}: package has its licences and the {} file(s) its sources include",
            needed.len() - 2
        );
    }
    Ok(())
}

/// Files that `include_str!` / `include_bytes!` in `crate_dir/src` compile in, relative to
/// the crate (`..` resolved; a path that leaves the crate is kept with its `..`, so it can
/// never be in the package list).
fn included_files(crate_dir: &std::path::Path) -> Result<Vec<String>, String> {
    let mut files = Vec::new();
    let mut stack = vec![crate_dir.join("src")];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| e.to_string())?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                for target in include_targets(&text) {
                    let from = path.parent().unwrap_or(crate_dir).strip_prefix(crate_dir);
                    let from = from.map_err(|e| e.to_string())?;
                    files.push(normalize(&from.join(target)));
                }
            }
        }
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// The string literals of `include_str!("…")` / `include_bytes!("…")` outside line comments.
fn include_targets(source: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in source.lines() {
        let code = line.split("//").next().unwrap_or_default();
        for mac in ["include_str!(", "include_bytes!("] {
            let mut rest = code;
            while let Some(at) = rest.find(mac) {
                rest = &rest[at + mac.len()..];
                let Some(open) = rest.find('"') else { break };
                let Some(len) = rest[open + 1..].find('"') else {
                    break;
                };
                out.push(rest[open + 1..open + 1 + len].to_owned());
                rest = &rest[open + 1 + len..];
            }
        }
    }
    out
}

/// `a/b/../c` → `a/c`; leading `..` are kept; `/` separators.
fn normalize(path: &std::path::Path) -> String {
    let mut parts: Vec<String> = Vec::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                if parts.last().is_some_and(|p| p != "..") {
                    parts.pop();
                } else {
                    parts.push("..".into());
                }
            }
            std::path::Component::CurDir => {}
            other => parts.push(other.as_os_str().to_string_lossy().into_owned()),
        }
    }
    parts.join("/")
}

/// The checks that need no build: no import cycle between the files of a crate
/// ([`cycles`]), the dependency rule, the library crates' packages and formatting.
fn lint() -> Result<(), String> {
    cycles::check(&workspace_root())?;
    check_layers()?;
    check_light_crates()?;
    check_packages()?;
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt)
}

/// What `.ci/run` runs, in one pass over one build:
///
/// 1. [`lint`]: the import cycles, the dependency rule, the packages' file lists,
///    `cargo fmt --check`.
/// 2. The tests (README's test command, [`test`]) built with clippy as the workspace's compiler
///    wrapper and warnings denied: `cargo clippy --all-targets -D warnings` and the test build
///    are one compile of each workspace crate (lib, unit tests, bins, examples, integration
///    tests), instead of a second, check-mode build of every dependency. Doctests run as usual.
/// 3. The benches compiled (`cargo bench --no-run`, same wrapper, the test build's
///    dependencies reused).
/// 4. Every library crate built from its packaged files alone ([`package::verify`]).
fn ci(extra: &[String]) -> Result<(), String> {
    lint()?;
    let clippy = clippy_wrapper()?;
    let started = std::time::Instant::now();
    let mut tests = test_command(extra)?;
    clippy.apply(&mut tests);
    run(tests)?;
    eprintln!(
        "xtask: clippy (-D warnings) and the tests: {} s",
        started.elapsed().as_secs()
    );
    let started = std::time::Instant::now();
    let mut benches = cargo();
    benches.args([
        "bench",
        "--workspace",
        "--features",
        KERNEL_FEATURES,
        "--no-run",
    ]);
    clippy.apply(&mut benches);
    run(benches)?;
    eprintln!(
        "xtask: benches compiled (clippy -D warnings): {} s",
        started.elapsed().as_secs()
    );
    let started = std::time::Instant::now();
    package::verify(&LAYERS)?;
    eprintln!(
        "xtask: library crates built from their packages: {} s",
        started.elapsed().as_secs()
    );
    Ok(())
}

/// Clippy as `RUSTC_WORKSPACE_WRAPPER` (what `cargo clippy` does over `cargo check`), here over
/// a real build: the workspace's crates are linted with warnings denied while they compile, and
/// dependencies are built once, by plain rustc, for both.
struct ClippyWrapper {
    driver: PathBuf,
}

impl ClippyWrapper {
    fn apply(&self, command: &mut Command) {
        command
            .env("RUSTC_WORKSPACE_WRAPPER", &self.driver)
            // clippy-driver's own argument list (as `cargo clippy -- -D warnings` sets it).
            .env(
                "CLIPPY_ARGS",
                "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
            );
    }
}

/// Finds the toolchain's `clippy-driver` (rust-toolchain.toml installs the clippy component).
fn clippy_wrapper() -> Result<ClippyWrapper, String> {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let output = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .current_dir(workspace_root())
        .output()
        .map_err(|e| format!("cannot run {rustc} --print sysroot: {e}"))?;
    if !output.status.success() {
        return Err(format!("{rustc} --print sysroot failed"));
    }
    let sysroot = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    let driver = sysroot
        .join("bin")
        .join(format!("clippy-driver{}", env::consts::EXE_SUFFIX));
    if !driver.is_file() {
        return Err(format!(
            "{} not found: install the clippy component (rustup component add clippy)",
            driver.display()
        ));
    }
    Ok(ClippyWrapper { driver })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn include_targets_are_found_outside_comments_and_resolved() {
        let src = "const A: &str = include_str!(\"../templates/a.jinja\");\n\
                   // include_str!(\"../commented.txt\")\n\
                   static B: &[u8] = include_bytes!( \"data/b.bin\" ); let c = include_str!(\"c\");";
        // Per line, `include_str!` targets first, then `include_bytes!`.
        assert_eq!(
            include_targets(src),
            ["../templates/a.jinja", "c", "data/b.bin"]
        );
        assert_eq!(
            normalize(std::path::Path::new("src/../templates/a.jinja")),
            "templates/a.jinja"
        );
        assert_eq!(
            normalize(std::path::Path::new("src/../../fixtures/x.json")),
            "../fixtures/x.json"
        );
    }

    #[test]
    fn layer_violations_name_upward_and_unplaced_crates() {
        let json = r#"{"packages": [
            {"name": "low", "dependencies": [{"name": "serde", "kind": null}]},
            {"name": "mid", "dependencies": [{"name": "low", "kind": null},
                                             {"name": "high", "kind": "dev"}]},
            {"name": "high", "dependencies": [{"name": "mid", "kind": null},
                                              {"name": "high2", "kind": "build"}]},
            {"name": "high2", "dependencies": []},
            {"name": "stray", "dependencies": []},
            {"name": "xtask", "dependencies": [{"name": "high", "kind": null}]}
        ]}"#;
        assert_eq!(
            layer_violations(json, &["low", "mid", "high", "high2"]).unwrap(),
            [
                "high depends on high2",
                "stray is in no layer (add it to xtask's LAYERS)"
            ]
        );
        let clean = r#"{"packages": [
            {"name": "low", "dependencies": []},
            {"name": "mid", "dependencies": [{"name": "low", "kind": null}]}
        ]}"#;
        assert!(layer_violations(clean, &["low", "mid"]).unwrap().is_empty());
    }

    #[test]
    fn heavy_dependencies_are_detected() {
        let light = "miles-tito v0.1.0 (/w/miles-tito)\nminijinja v2.24.0\nserde v1.0.0\n";
        assert!(heavy_dependencies(light).is_empty());
        let heavy = "miles-x v0.1.0\nburn v0.22.1\nburn-flex v0.22.1\ncubecl-wgpu v0.11.3\nburnish v1.0.0\n";
        assert_eq!(
            heavy_dependencies(heavy),
            ["burn", "burn-flex", "cubecl-wgpu"]
        );
    }
}
