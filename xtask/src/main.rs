//! Project automation: `cargo xtask test | ci | bench`.
//!
//! * `test`  — the one test command: `cargo test --workspace --release` with the kernel
//!   features on (one build of burn), kernel tests on the software Vulkan adapter.
//! * `ci`    — the dependency rule (no burn / CubeCL under miles-core, miles-tito,
//!   miles-session), `cargo fmt --check`, clippy with warnings denied, then `test`.
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

/// Crates that must never pull burn or CubeCL (DESIGN.md: `cargo add miles-tito` stays light).
const LIGHT_CRATES: [&str; 3] = ["miles-core", "miles-tito", "miles-session"];

/// Fails when a light crate's normal dependency tree contains burn or CubeCL.
fn check_light_crates() -> Result<(), String> {
    for krate in LIGHT_CRATES {
        let mut tree = cargo();
        tree.args(["tree", "-p", krate, "-e", "normal", "--prefix", "none"]);
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

fn ci(extra: &[String]) -> Result<(), String> {
    check_light_crates()?;
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

/// A target a bench declares by printing `xtask-target: <bench id> <= <ratio>` (or `>=`): its
/// time divided by its group's baseline must satisfy the comparison.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    id: String,
    at_most: bool,
    ratio: f64,
}

impl Target {
    fn met(&self, ratio: f64) -> bool {
        if self.at_most {
            ratio <= self.ratio
        } else {
            ratio >= self.ratio
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} {:.3}x",
            if self.at_most { "≤" } else { "≥" },
            self.ratio
        )
    }
}

fn parse_targets(output: &str) -> Vec<Target> {
    output
        .lines()
        .filter_map(|line| line.trim().strip_prefix("xtask-target:"))
        .filter_map(|rest| {
            let parts: Vec<&str> = rest.split_whitespace().collect();
            let [id, op, ratio] = parts.as_slice() else {
                return None;
            };
            let at_most = match *op {
                "<=" => true,
                ">=" => false,
                _ => return None,
            };
            Some(Target {
                id: (*id).to_string(),
                at_most,
                ratio: ratio.parse().ok()?,
            })
        })
        .collect()
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
    let table = render_table(&parse_criterion(&stdout), &parse_targets(&stdout));
    println!("\n{table}");
    let path = workspace_root().join("BENCHMARKS.md");
    let document = format!(
        "# Benchmarks\n\nWritten by `cargo xtask bench` (criterion point estimates; ratio = time / \
         the group's `baseline` measured in the same run; lower is faster).\n\n{table}"
    );
    std::fs::write(&path, document).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    eprintln!("xtask: wrote {}", path.display());
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

/// A Markdown table: bench, time, baseline time, ratio = time / time of the group's
/// `baseline` (lower is faster), the declared target and whether it is met.
fn render_table(measurements: &[Measurement], targets: &[Target]) -> String {
    let mut baselines = BTreeMap::new();
    for m in measurements {
        if let Some((group, "baseline")) = m.id.rsplit_once('/') {
            baselines.insert(group.to_string(), m.nanos);
        }
    }
    let mut table = String::from(
        "| bench | ours | baseline | ratio | target | met? |\n|---|---|---|---|---|---|\n",
    );
    if measurements.is_empty() {
        table.push_str("| (no benches yet) | | | | | |\n");
    }
    for m in measurements {
        let baseline =
            m.id.rsplit_once('/')
                .and_then(|(group, _)| baselines.get(group))
                .copied();
        let ratio = baseline.map(|b| m.nanos / b);
        let target = targets.iter().find(|t| t.id == m.id);
        let met = match (target, ratio) {
            (Some(t), Some(r)) => {
                if t.met(r) {
                    "yes"
                } else {
                    "NO"
                }
            }
            _ => "-",
        };
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {met} |\n",
            m.id,
            human(m.nanos),
            baseline.map_or_else(|| "-".to_string(), human),
            ratio.map_or_else(|| "-".to_string(), |r| format!("{r:.2}x")),
            target.map_or_else(|| "-".to_string(), Target::describe),
        ));
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
        let targets =
            parse_targets("xtask-target: logprobs/fused <= 0.6\nxtask-target: bad line\n");
        assert_eq!(targets.len(), 1);
        let table = render_table(&m, &targets);
        assert!(
            table.contains("| logprobs/fused | 6.000 ms | 12.000 ms | 0.50x | ≤ 0.600x | yes |"),
            "{table}"
        );
        assert!(table.contains("| logprobs/baseline | 12.000 ms | 12.000 ms | 1.00x | - | - |"));
        assert!(table.contains("| a/very/long/bench/name/that/wraps | 1.000 ms | - | - | - | - |"));
        let strict = parse_targets("xtask-target: logprobs/fused <= 0.4");
        assert!(render_table(&m, &strict).contains("| NO |"));
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

    #[test]
    fn empty_run_prints_an_empty_table() {
        assert!(render_table(&[], &[]).contains("(no benches yet)"));
    }
}
