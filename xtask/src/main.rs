//! Project automation: `cargo xtask test | ci | bench`.
//!
//! * `test`  — the one test command: `cargo test --workspace --release` with the kernel
//!   features on (one build of burn), kernel tests on the software Vulkan adapter.
//! * `ci`    — `cargo fmt --check`, clippy with warnings denied, then `test`.
//! * `bench` — runs every bench of the workspace and prints one table, with each bench's
//!   ratio to the baseline measured in the same run (the function named `baseline` in its
//!   group).

use std::collections::BTreeMap;
use std::env;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

/// Cargo features that turn the CubeCL kernel code and its tests on.
const KERNEL_FEATURES: &str = "miles-ops/wgpu";

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let (task, rest) = match args.split_first() {
        Some((task, rest)) => (task.as_str(), rest),
        None => ("help", &[][..]),
    };
    let result = match task {
        "test" => test(rest),
        "ci" => ci(rest),
        "bench" => bench(rest),
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
       ci     cargo fmt --check, cargo clippy -D warnings, then test\n  \
       bench  run all benches and print one table with ratios to each group's baseline"
}

fn cargo() -> Command {
    let mut command = Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.current_dir(workspace_root());
    command
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
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

fn run(mut command: Command) -> Result<(), String> {
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

fn test(extra: &[String]) -> Result<(), String> {
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
    run(command)
}

fn ci(extra: &[String]) -> Result<(), String> {
    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--", "--check"]);
    run(fmt)?;
    let mut clippy = cargo();
    clippy
        .args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--release",
            "--features",
            KERNEL_FEATURES,
            "--",
            "-D",
            "warnings",
        ])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(clippy)?;
    test(extra)
}

/// One measured bench: criterion's id and its point estimate in nanoseconds.
#[derive(Debug, Clone, PartialEq)]
struct Measurement {
    id: String,
    nanos: f64,
}

fn bench(extra: &[String]) -> Result<(), String> {
    let mut command = cargo();
    command
        .args(["bench", "--workspace", "--features", KERNEL_FEATURES])
        .args(extra)
        .env("XDG_RUNTIME_DIR", xdg_runtime_dir()?)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!("xtask: running {command:?}");
    let output = command
        .output()
        .map_err(|e| format!("cannot start cargo bench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    if !output.status.success() {
        return Err(format!("cargo bench failed with {}", output.status));
    }
    println!("\n{}", render_table(&parse_criterion(&stdout)));
    Ok(())
}

/// Extracts `<id> time: [low mid high]` lines from criterion's output (the id may be on the
/// line before when it is long).
fn parse_criterion(output: &str) -> Vec<Measurement> {
    let mut out = Vec::new();
    let mut previous = "";
    for line in output.lines() {
        if let Some(at) = line.find("time:") {
            let head = line[..at].trim();
            let id = if head.is_empty() {
                previous.trim()
            } else {
                head
            };
            let inside = line[at + 5..]
                .trim()
                .trim_start_matches('[')
                .trim_end_matches(']');
            let parts: Vec<&str> = inside.split_whitespace().collect();
            // [low unit mid unit high unit]
            if parts.len() == 6
                && let Some(nanos) = to_nanos(parts[2], parts[3])
            {
                out.push(Measurement {
                    id: id.to_string(),
                    nanos,
                });
            }
        }
        if !line.trim().is_empty() {
            previous = line;
        }
    }
    out
}

fn to_nanos(value: &str, unit: &str) -> Option<f64> {
    let v: f64 = value.parse().ok()?;
    let scale = match unit {
        "ps" => 1e-3,
        "ns" => 1.0,
        "µs" | "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    };
    Some(v * scale)
}

fn human(nanos: f64) -> String {
    match nanos {
        n if n >= 1e9 => format!("{:.3} s", n / 1e9),
        n if n >= 1e6 => format!("{:.3} ms", n / 1e6),
        n if n >= 1e3 => format!("{:.3} µs", n / 1e3),
        n => format!("{n:.1} ns"),
    }
}

/// A Markdown table; `ratio` = time / time of the group's `baseline` (lower is faster).
fn render_table(measurements: &[Measurement]) -> String {
    let mut baselines = BTreeMap::new();
    for m in measurements {
        if let Some((group, "baseline")) = m.id.rsplit_once('/') {
            baselines.insert(group.to_string(), m.nanos);
        }
    }
    let mut table = String::from("| bench | time | ratio to baseline |\n|---|---|---|\n");
    if measurements.is_empty() {
        table.push_str("| (no benches yet) | | |\n");
    }
    for m in measurements {
        let ratio =
            m.id.rsplit_once('/')
                .and_then(|(group, _)| baselines.get(group))
                .map_or_else(|| "-".to_string(), |b| format!("{:.2}x", m.nanos / b));
        table.push_str(&format!("| {} | {} | {ratio} |\n", m.id, human(m.nanos)));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_criterion_output_and_computes_ratios() {
        let output = "\
Benchmarking logprobs/baseline
logprobs/baseline       time:   [10.000 ms 12.000 ms 14.000 ms]
logprobs/fused          time:   [5.0000 ms 6.0000 ms 7.0000 ms]
                        change: [-1.0% +0.5% +2.0%] (p = 0.50 > 0.05)
a/very/long/bench/name/that/wraps
                        time:   [900.00 µs 1.0000 ms 1.1000 ms]
";
        let m = parse_criterion(output);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].nanos, 12e6);
        assert_eq!(m[2].id, "a/very/long/bench/name/that/wraps");
        assert_eq!(m[2].nanos, 1e6);
        let table = render_table(&m);
        assert!(
            table.contains("| logprobs/fused | 6.000 ms | 0.50x |"),
            "{table}"
        );
        assert!(table.contains("| logprobs/baseline | 12.000 ms | 1.00x |"));
        assert!(table.contains("| a/very/long/bench/name/that/wraps | 1.000 ms | - |"));
    }

    #[test]
    fn empty_run_prints_an_empty_table() {
        assert!(render_table(&[]).contains("(no benches yet)"));
    }
}
