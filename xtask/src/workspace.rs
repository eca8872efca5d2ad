//! The workspace and the cargo commands xtask runs in it.

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// Cargo features that turn the CubeCL kernel code and its tests on.
pub(crate) const KERNEL_FEATURES: &str = "miles-ops/wgpu";

/// `cargo` (the one running xtask) in the workspace root.
pub(crate) fn cargo() -> Command {
    let mut command = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.current_dir(workspace_root());
    command
}

/// The workspace root: xtask's parent folder.
pub(crate) fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Runs `command`, failing with its status.
pub(crate) fn run(mut command: Command) -> Result<(), String> {
    eprintln!("xtask: running {command:?}");
    let status = command
        .status()
        .map_err(|e| format!("cannot start {command:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{command:?} failed with {status}"))
    }
}
