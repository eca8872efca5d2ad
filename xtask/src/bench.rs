//! `cargo xtask bench`: runs the workspace's benches one suite at a time, gathers their
//! `xtask-result:` lines (see [`crate::results`]) and prints / writes one table.

use std::path::Path;
use std::process::{Command, Stdio};

use crate::results::{Row, render_table, rows_for};
use crate::workspace::{cargo, workspace_root};

/// One bench target: the package that owns it and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Suite {
    /// Package name (`miles-rollout`).
    pub package: String,
    /// Bench target name (`loop_overlap`).
    pub bench: String,
}

impl Suite {
    /// `package/bench`, the suite column of the table.
    pub fn id(&self) -> String {
        format!("{}/{}", self.package, self.bench)
    }
}

/// Options of `cargo xtask bench`.
#[derive(Debug, Default, PartialEq)]
pub struct BenchOptions {
    /// Run only suites whose bench name or `package/bench` id equals one of these.
    pub only: Vec<String>,
    /// Small sizes and short measurement (smoke run; figures are not the issue's).
    pub quick: bool,
    /// List the suites and exit.
    pub list: bool,
    /// Extra arguments for `cargo bench` (before its `--`).
    pub cargo_args: Vec<String>,
    /// `(suite, log file)`: record the output of a bench run by hand instead of running it
    /// (for suites that take too long to rerun as a whole).
    pub record: Vec<(String, String)>,
    /// `(suite, log file)`: like `record`, for a run of part of a suite (one model): the
    /// log's rows replace the suite's rows of the same name, its other rows and run notes stay.
    pub add: Vec<(String, String)>,
}

/// Usage of the `bench` task.
pub const USAGE: &str = "usage: cargo xtask bench [--only NAME]... [--quick] [--list] [-- CARGO_BENCH_ARGS]\n  \
     --only NAME   run only this suite (bench name like loop_overlap, or package/bench); repeatable\n  \
     --quick       small sizes, short measurement (MILES_BENCH_QUICK=1, criterion --quick): a smoke run\n  \
     --list        list the suites and exit\n  \
     --record SUITE=LOG  take SUITE's rows from LOG (the output of `cargo bench` run by hand)\n  \
     --add SUITE=LOG     as --record for a run of part of SUITE (MILES_BENCH_ONLY): LOG's rows replace\n                         the rows of the same name, SUITE's other rows and run notes are kept\n\
     Each suite runs as `cargo bench -p PACKAGE --bench NAME`; its xtask-result lines become rows of\n\
     one table, printed and merged into BENCHMARKS.md (rows of suites not run this time are kept).";

/// Parses the arguments after `bench`.
pub fn parse_options(args: &[String]) -> Result<BenchOptions, String> {
    let mut options = BenchOptions::default();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--only" => options.only.push(
                iter.next()
                    .ok_or_else(|| format!("--only needs a bench name\n{USAGE}"))?
                    .clone(),
            ),
            "--quick" => options.quick = true,
            "--list" => options.list = true,
            flag @ ("--record" | "--add") => {
                let spec = iter
                    .next()
                    .ok_or_else(|| format!("{flag} needs SUITE=LOG\n{USAGE}"))?;
                let (suite, log) = spec
                    .split_once('=')
                    .ok_or_else(|| format!("{flag} {spec:?}: expected SUITE=LOG\n{USAGE}"))?;
                let list = if flag == "--add" {
                    &mut options.add
                } else {
                    &mut options.record
                };
                list.push((suite.to_string(), log.to_string()));
            }
            "--" => {
                options.cargo_args.extend(iter.by_ref().cloned());
            }
            other => {
                if let Some(name) = other.strip_prefix("--only=") {
                    options.only.push(name.to_string());
                } else {
                    return Err(format!("unknown bench option {other:?}\n{USAGE}"));
                }
            }
        }
    }
    Ok(options)
}

/// Every `[[bench]]` target of the workspace members, from `cargo metadata`.
pub fn discover() -> Result<Vec<Suite>, String> {
    let mut command = cargo();
    command.args(["metadata", "--no-deps", "--format-version", "1"]);
    let output = command
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    suites_from_metadata(&String::from_utf8_lossy(&output.stdout))
}

/// The bench targets listed in `cargo metadata --format-version 1` output, sorted.
pub fn suites_from_metadata(json: &str) -> Result<Vec<Suite>, String> {
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("cargo metadata: {e}"))?;
    let packages = value["packages"]
        .as_array()
        .ok_or("cargo metadata: no packages array")?;
    let mut suites = Vec::new();
    for package in packages {
        let name = package["name"].as_str().unwrap_or_default();
        for target in package["targets"].as_array().into_iter().flatten() {
            let is_bench = target["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "bench"));
            if is_bench && let Some(bench) = target["name"].as_str() {
                suites.push(Suite {
                    package: name.to_string(),
                    bench: bench.to_string(),
                });
            }
        }
    }
    suites.sort_by_key(Suite::id);
    Ok(suites)
}

/// The suites `--only` selects (all when empty); an unknown name is an error.
pub fn select(suites: &[Suite], only: &[String]) -> Result<Vec<Suite>, String> {
    if only.is_empty() {
        return Ok(suites.to_vec());
    }
    let mut chosen = Vec::new();
    for name in only {
        let found: Vec<&Suite> = suites
            .iter()
            .filter(|s| s.bench == *name || s.id() == *name)
            .collect();
        if found.is_empty() {
            let known: Vec<String> = suites.iter().map(Suite::id).collect();
            return Err(format!("no bench named {name:?}; known: {known:?}"));
        }
        chosen.extend(found.into_iter().cloned());
    }
    chosen.dedup();
    Ok(chosen)
}

/// Runs `cargo xtask bench`.
pub fn bench(args: &[String]) -> Result<(), String> {
    let options = parse_options(args)?;
    let suites = discover()?;
    if options.list {
        for s in &suites {
            println!("{}", s.id());
        }
        return Ok(());
    }
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let mut runs = Vec::new();
    if !options.record.is_empty() || !options.add.is_empty() {
        let mut recorded = Vec::new();
        let mut partial = Vec::new();
        let logs = options
            .record
            .iter()
            .map(|spec| (spec, false))
            .chain(options.add.iter().map(|spec| (spec, true)));
        for ((name, log), adding) in logs {
            let suite = select(&suites, std::slice::from_ref(name))?
                .pop()
                .ok_or_else(|| format!("--record: no suite {name:?}"))?;
            let output = std::fs::read_to_string(log)
                .map_err(|e| format!("--record: cannot read {log}: {e}"))?;
            let new_rows = rows_for(&suite.id(), &output);
            let names: Vec<&str> = new_rows.iter().map(|r| r.name.as_str()).collect();
            runs.push(RunNote {
                suite: suite.id(),
                text: format!(
                    "{}recorded {} UTC from a log of `cargo bench` run by hand; commit {} when recorded",
                    if adding {
                        format!("rows {} ", names.join(", "))
                    } else {
                        String::new()
                    },
                    utc_now(),
                    git_head()
                ),
            });
            if adding {
                partial.push(suite.id());
            }
            rows.extend(new_rows);
            recorded.push(suite);
        }
        return write_document(rows, runs, &suites, &recorded, &[], &partial);
    }
    let chosen = select(&suites, &options.only)?;
    for suite in &chosen {
        let load = load_average();
        match run_suite(suite, &options) {
            Ok(output) => rows.extend(rows_for(&suite.id(), &output)),
            Err(why) => {
                rows.push(Row::failed(&suite.id(), &why));
                failures.push(suite.id());
            }
        }
        runs.push(RunNote {
            suite: suite.id(),
            text: format!(
                "{} UTC, commit {}, {}, 1-min load average {} at start, {} cores ({})",
                utc_now(),
                git_head(),
                if options.quick { "quick" } else { "full" },
                load.map_or_else(|| "?".into(), |l| format!("{l:.2}")),
                std::thread::available_parallelism().map_or(0, |n| n.get()),
                cpu_model()
            ),
        });
    }
    write_document(rows, runs, &suites, &chosen, &failures, &[])
}

/// Merges this run's rows into `BENCHMARKS.md`, prints the table, and reports failures and
/// unmet targets of the `chosen` suites.
fn write_document(
    rows: Vec<Row>,
    runs: Vec<RunNote>,
    suites: &[Suite],
    chosen: &[Suite],
    failures: &[String],
    partial: &[String],
) -> Result<(), String> {
    let path = workspace_root().join("BENCHMARKS.md");
    let previous = std::fs::read_to_string(&path).unwrap_or_default();
    let (all_rows, all_runs) = merge_partial(&previous, rows, runs, suites, partial);
    let table = render_table(&all_rows);
    println!("\n{table}");
    std::fs::write(&path, document(&table, &all_runs))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    eprintln!("xtask: wrote {}", path.display());
    let not_met = all_rows
        .iter()
        .filter(|r| chosen.iter().any(|s| s.id() == r.suite) && r.met == "NO")
        .count();
    if !failures.is_empty() {
        return Err(format!("benches failed: {failures:?}"));
    }
    if not_met > 0 {
        eprintln!("xtask: {not_met} target(s) of this run not met (see the met? column)");
    }
    Ok(())
}

/// When and how a suite was last run (one line under the table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunNote {
    /// The suite id.
    pub suite: String,
    /// Date, mode, load.
    pub text: String,
}

const RUNS_HEADING: &str = "## Runs";

/// Keeps the rows and run notes of suites not run this time from the previous document, and
/// orders everything by the workspace's suite order (the tests' entry; the bench runs
/// [`merge_partial`]).
#[cfg(test)]
pub fn merge(
    previous: &str,
    rows: Vec<Row>,
    runs: Vec<RunNote>,
    suites: &[Suite],
) -> (Vec<Row>, Vec<RunNote>) {
    merge_partial(previous, rows, runs, suites, &[])
}

/// [`merge`], where the suites in `partial` ran in part: their previous rows not rerun (by
/// name) and their previous run notes are kept too.
pub fn merge_partial(
    previous: &str,
    rows: Vec<Row>,
    runs: Vec<RunNote>,
    suites: &[Suite],
    partial: &[String],
) -> (Vec<Row>, Vec<RunNote>) {
    let fresh: Vec<String> = runs
        .iter()
        .map(|r| r.suite.clone())
        .filter(|suite| !partial.contains(suite))
        .collect();
    let known: Vec<String> = suites.iter().map(Suite::id).collect();
    let keep = |suite: &str| !fresh.iter().any(|f| f == suite) && known.iter().any(|k| k == suite);
    let rerun = |row: &Row| {
        partial.contains(&row.suite)
            && rows
                .iter()
                .any(|r| r.suite == row.suite && r.name == row.name)
    };
    let mut all_rows: Vec<Row> = previous
        .lines()
        .filter_map(Row::parse_markdown)
        .filter(|r| keep(&r.suite) && !rerun(r))
        .collect();
    all_rows.extend(rows);
    let mut all_runs: Vec<RunNote> = previous
        .split_once(RUNS_HEADING)
        .map(|(_, tail)| tail)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (suite, text) = l.strip_prefix("- `")?.split_once("`: ")?;
            Some(RunNote {
                suite: suite.to_string(),
                text: text.to_string(),
            })
        })
        .filter(|r| keep(&r.suite))
        .collect();
    all_runs.extend(runs);
    let order = |suite: &str| known.iter().position(|k| k == suite).unwrap_or(usize::MAX);
    // Stable sorts: rows keep their printed order within a suite.
    all_rows.sort_by_key(|r| order(&r.suite));
    all_runs.sort_by_key(|r| order(&r.suite));
    (all_rows, all_runs)
}

/// The whole `BENCHMARKS.md`.
pub fn document(table: &str, runs: &[RunNote]) -> String {
    let mut text = String::from(
        "# Benchmarks\n\n\
         Written by `cargo xtask bench` (`--only NAME` reruns one suite and keeps the other rows; \
         `--quick` is a smoke run at small sizes whose figures are not the targets' sizes). \
         Each row is one `xtask-result:` line a bench printed: `ours` and `baseline` are \
         measured in the same run unless the notes say the baseline is a reference constant; \
         `ratio` = ours / baseline; `target` bounds the ratio; `met?` says whether it holds \
         (`?`: no ratio; `-`: no target). Time figures from criterion are its point \
         estimates. The line format is documented in `xtask/src/results.rs`.\n\n",
    );
    text.push_str(table);
    text.push_str(&format!("\n{RUNS_HEADING}\n\n"));
    for r in runs {
        text.push_str(&format!("- `{}`: {}\n", r.suite, r.text));
    }
    text
}

fn run_suite(suite: &Suite, options: &BenchOptions) -> Result<String, String> {
    let mut command = cargo();
    command
        .args(["bench", "-p", &suite.package, "--bench", &suite.bench])
        .args(&options.cargo_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if options.quick {
        quick_env(&mut command);
        command.args(["--", "--quick"]);
    }
    eprintln!("xtask: running {command:?}");
    let output = command
        .output()
        .map_err(|e| format!("cannot start cargo bench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    print!("{stdout}");
    if output.status.success() {
        Ok(stdout)
    } else {
        Err(format!("cargo bench exited with {}", output.status))
    }
}

/// The environment of a quick run: each bench's own small-size switch.
fn quick_env(command: &mut Command) {
    command
        .env("MILES_BENCH_QUICK", "1")
        .env("MILES_BENCH_SMALL", "1")
        .env("MILES_BENCH_ITERS", "1")
        .env("MILES_SESSION_BENCH_MEMORY_SESSIONS", "256");
}

fn load_average() -> Option<f64> {
    std::fs::read_to_string(Path::new("/proc/loadavg"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The CPU model (`model name` of `/proc/cpuinfo`), named in each run's note.
fn cpu_model() -> String {
    std::fs::read_to_string(Path::new("/proc/cpuinfo"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// The current time as `YYYY-MM-DD HH:MM` (UTC).
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs)
}

/// `YYYY-MM-DD HH:MM` of a Unix time (days-to-civil conversion of the proleptic Gregorian
/// calendar).
pub fn format_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}",
        rem / 3_600,
        (rem % 3_600) / 60
    )
}

/// The commit the benches run on (`git rev-parse --short HEAD`, `+dirty` with uncommitted
/// changes), or `?` outside a git checkout.
fn git_head() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(workspace_root())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty { format!("{head}+dirty") } else { head }
        }
        None => "?".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suites() -> Vec<Suite> {
        vec![
            Suite {
                package: "miles-ops".into(),
                bench: "fused_logprobs".into(),
            },
            Suite {
                package: "miles-rollout".into(),
                bench: "loop_overlap".into(),
            },
        ]
    }

    #[test]
    fn options_parse() {
        let args: Vec<String> = [
            "--only",
            "loop_overlap",
            "--quick",
            "--only=a/b",
            "--",
            "-v",
        ]
        .map(String::from)
        .to_vec();
        let o = parse_options(&args).unwrap();
        assert_eq!(o.only, ["loop_overlap", "a/b"]);
        assert!(o.quick);
        assert_eq!(o.cargo_args, ["-v"]);
        assert!(parse_options(&["--only".into()]).is_err());
        assert!(parse_options(&["--fast".into()]).is_err());
        let o = parse_options(&["--record".into(), "fused_logprobs=/tmp/f.log".into()]).unwrap();
        assert_eq!(
            o.record,
            [("fused_logprobs".to_string(), "/tmp/f.log".to_string())]
        );
        assert!(parse_options(&["--record".into(), "no-equals".into()]).is_err());
        assert!(parse_options(&["--record".into()]).is_err());
        let o = parse_options(&["--add".into(), "train_step=/tmp/t.log".into()]).unwrap();
        assert_eq!(
            o.add,
            [("train_step".to_string(), "/tmp/t.log".to_string())]
        );
        assert!(o.record.is_empty());
        assert!(parse_options(&["--add".into(), "no-equals".into()]).is_err());
    }

    #[test]
    fn metadata_benches_are_found() {
        let json = r#"{"packages":[
            {"name":"miles-rollout","targets":[{"kind":["lib"],"name":"miles_rollout"},
                                              {"kind":["bench"],"name":"loop_overlap"}]},
            {"name":"miles-ops","targets":[{"kind":["bench"],"name":"fused_logprobs"},
                                          {"kind":["test"],"name":"grads"}]}]}"#;
        assert_eq!(suites_from_metadata(json).unwrap(), suites());
        assert!(suites_from_metadata("{}").is_err());
    }

    #[test]
    fn only_selects_by_name_or_id() {
        let s = suites();
        assert_eq!(select(&s, &[]).unwrap(), s);
        assert_eq!(
            select(&s, &["loop_overlap".into()]).unwrap(),
            [s[1].clone()]
        );
        assert_eq!(
            select(&s, &["miles-ops/fused_logprobs".into()]).unwrap(),
            [s[0].clone()]
        );
        assert!(select(&s, &["nope".into()]).is_err());
    }

    #[test]
    fn a_partial_run_keeps_the_other_suites() {
        let s = suites();
        let first = rows_for(
            "miles-ops/fused_logprobs",
            "xtask-result: old ours=2ms baseline=4ms target=<=1\n",
        );
        let stale = rows_for(
            "miles-rollout/loop_overlap",
            "xtask-result: stale ours=1ms\n",
        );
        let runs = vec![
            RunNote {
                suite: "miles-rollout/loop_overlap".into(),
                text: "yesterday".into(),
            },
            RunNote {
                suite: "miles-ops/fused_logprobs".into(),
                text: "yesterday".into(),
            },
        ];
        let mut rows = stale.clone();
        rows.extend(first.clone());
        let previous = document(&render_table(&rows), &runs);
        let fresh = rows_for(
            "miles-rollout/loop_overlap",
            "xtask-result: new ours=1ms baseline=2ms\n",
        );
        let (rows, runs) = merge(
            &previous,
            fresh.clone(),
            vec![RunNote {
                suite: "miles-rollout/loop_overlap".into(),
                text: "today".into(),
            }],
            &s,
        );
        assert_eq!(rows, [first[0].clone(), fresh[0].clone()]);
        assert_eq!(
            runs.iter().map(|r| r.text.as_str()).collect::<Vec<_>>(),
            ["yesterday", "today"]
        );
    }

    #[test]
    fn a_partial_record_keeps_the_suite_s_other_rows_and_notes() {
        let s = suites();
        let suite = "miles-rollout/loop_overlap";
        let old = rows_for(
            suite,
            "xtask-result: glm ours=1ms baseline=2ms\nxtask-result: dsv3 ours=5ms baseline=6ms\n",
        );
        let runs = vec![RunNote {
            suite: suite.into(),
            text: "yesterday".into(),
        }];
        let previous = document(&render_table(&old), &runs);
        let fresh = rows_for(suite, "xtask-result: dsv3 ours=3ms baseline=6ms\n");
        let today = vec![RunNote {
            suite: suite.into(),
            text: "today".into(),
        }];
        let (rows, notes) =
            merge_partial(&previous, fresh.clone(), today.clone(), &s, &[suite.into()]);
        assert_eq!(rows, [old[0].clone(), fresh[0].clone()]);
        assert_eq!(
            notes.iter().map(|r| r.text.as_str()).collect::<Vec<_>>(),
            ["yesterday", "today"]
        );
        // A whole-suite record replaces both.
        let (rows, notes) = merge(&previous, fresh.clone(), today, &s);
        assert_eq!(rows, fresh);
        assert_eq!(notes.len(), 1);
    }

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(0), "1970-01-01 00:00");
        assert_eq!(format_utc(951_782_400), "2000-02-29 00:00");
        assert_eq!(format_utc(1_795_952_400 + 3_660), "2026-11-29 12:41");
    }
}
