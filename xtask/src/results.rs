//! The `xtask-result:` line every bench prints, and the table built from them.
//!
//! # Line format
//!
//! One line per compared figure, on the bench's standard output:
//!
//! ```text
//! xtask-result: <name> ours=<quantity> [baseline=<quantity>] [ratio=<r>] [target=<op><t>] [note=<free text>]
//! ```
//!
//! * `<name>` — the row's name, unique within the bench (no spaces).
//! * `<quantity>` — `<number><unit>` (`12.5ms`, `0.93ms`, `812MiB`, `5311turns/s`, `1.2x`, a
//!   bare number), or `@<criterion id>`: the point estimate criterion printed for that bench
//!   id in the same run (`@loop_overlap/async`). `baseline=-` (or no `baseline`) means none.
//! * Time units `ps ns us µs ms s` and size units `B KiB MiB GiB` convert into each other;
//!   any other unit (`turns/s`, `tok/s`) compares only with the same unit.
//! * `ratio` — `ours / baseline`, computed by xtask when absent (both quantities must then be
//!   of one kind); give it explicitly when the comparison is something else.
//! * `target` — `<=R` or `>=R`, a bound on the ratio; `met?` says whether it holds.
//! * `note` — free text to the end of the line (where the baseline comes from, sizes); it
//!   must come last.
//!
//! Lines that start with `xtask-result:` but do not follow the format are reported as
//! errors, never dropped silently.

use std::collections::BTreeMap;
use std::fmt;

/// The prefix of a result line.
pub const PREFIX: &str = "xtask-result:";

/// A quantity as the bench printed it.
#[derive(Debug, Clone, PartialEq)]
pub enum Quantity {
    /// A number with its unit (possibly empty).
    Value {
        /// The number.
        value: f64,
        /// The unit as printed (`ms`, `MiB`, `turns/s`, ``).
        unit: String,
    },
    /// The criterion point estimate of this bench id in the same run.
    Criterion(String),
}

/// A bound on the ratio `ours / baseline`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    /// `true` for `<=`, `false` for `>=`.
    pub at_most: bool,
    /// The bound.
    pub bound: f64,
}

impl Target {
    /// Whether `ratio` satisfies the bound.
    pub fn met(&self, ratio: f64) -> bool {
        if self.at_most {
            ratio <= self.bound
        } else {
            ratio >= self.bound
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = if self.at_most { "≤" } else { "≥" };
        write!(f, "{op} {}x", trim_number(self.bound))
    }
}

/// One parsed `xtask-result:` line.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultLine {
    /// The row's name.
    pub name: String,
    /// Our figure.
    pub ours: Quantity,
    /// The baseline figure, if any.
    pub baseline: Option<Quantity>,
    /// An explicit ratio.
    pub ratio: Option<f64>,
    /// The declared target on the ratio.
    pub target: Option<Target>,
    /// Free text.
    pub note: Option<String>,
}

/// Parses one line (without requiring the prefix to be at column 0: leading spaces are
/// allowed). `Ok(None)` for lines that are not result lines.
pub fn parse_line(line: &str) -> Result<Option<ResultLine>, String> {
    let Some(rest) = line.trim_start().strip_prefix(PREFIX) else {
        return Ok(None);
    };
    let (fields, note) = match rest.find(" note=") {
        Some(at) => (&rest[..at], Some(rest[at + 6..].trim().to_string())),
        None => (rest, None),
    };
    let mut words = fields.split_whitespace();
    let name = words
        .next()
        .filter(|n| !n.contains('='))
        .ok_or_else(|| format!("{line:?}: missing the result name"))?
        .to_string();
    let mut ours = None;
    let mut baseline = None;
    let mut ratio = None;
    let mut target = None;
    for word in words {
        let (key, value) = word
            .split_once('=')
            .ok_or_else(|| format!("{line:?}: {word:?} is not key=value"))?;
        match key {
            "ours" => ours = Some(parse_quantity(value).map_err(|e| format!("{line:?}: {e}"))?),
            "baseline" if value == "-" => baseline = None,
            "baseline" => {
                baseline = Some(parse_quantity(value).map_err(|e| format!("{line:?}: {e}"))?)
            }
            "ratio" => {
                ratio = Some(
                    value
                        .parse::<f64>()
                        .map_err(|_| format!("{line:?}: ratio {value:?} is not a number"))?,
                )
            }
            "target" if value == "-" => target = None,
            "target" => target = Some(parse_target(value).map_err(|e| format!("{line:?}: {e}"))?),
            other => return Err(format!("{line:?}: unknown key {other:?}")),
        }
    }
    let ours = ours.ok_or_else(|| format!("{line:?}: missing ours=…"))?;
    Ok(Some(ResultLine {
        name,
        ours,
        baseline,
        ratio,
        target,
        note: note.filter(|n| !n.is_empty()),
    }))
}

/// All result lines of a bench's output, and the malformed ones as errors.
pub fn parse_results(output: &str) -> (Vec<ResultLine>, Vec<String>) {
    let mut results = Vec::new();
    let mut errors = Vec::new();
    for line in output.lines() {
        match parse_line(line) {
            Ok(Some(result)) => results.push(result),
            Ok(None) => {}
            Err(error) => errors.push(error),
        }
    }
    (results, errors)
}

fn parse_quantity(text: &str) -> Result<Quantity, String> {
    if let Some(id) = text.strip_prefix('@') {
        if id.is_empty() {
            return Err("empty criterion id after @".into());
        }
        return Ok(Quantity::Criterion(id.to_string()));
    }
    let split = text
        .char_indices()
        .find(|&(i, c)| {
            !(c.is_ascii_digit()
                || c == '.'
                || ((c == '-' || c == '+') && (i == 0 || text[..i].ends_with(['e', 'E'])))
                || ((c == 'e' || c == 'E')
                    && i > 0
                    && text[i + 1..]
                        .starts_with(|n: char| n.is_ascii_digit() || n == '-' || n == '+')))
        })
        .map_or(text.len(), |(i, _)| i);
    let (number, unit) = text.split_at(split);
    let value = number
        .parse::<f64>()
        .map_err(|_| format!("{text:?} is not <number><unit> or @<criterion id>"))?;
    Ok(Quantity::Value {
        value,
        unit: unit.to_string(),
    })
}

fn parse_target(text: &str) -> Result<Target, String> {
    let (at_most, bound) = if let Some(b) = text.strip_prefix("<=") {
        (true, b)
    } else if let Some(b) = text.strip_prefix(">=") {
        (false, b)
    } else {
        return Err(format!("target {text:?} must be <=R or >=R"));
    };
    let bound = bound
        .parse::<f64>()
        .map_err(|_| format!("target bound {bound:?} is not a number"))?;
    Ok(Target { at_most, bound })
}

/// One criterion measurement: its id and point estimate in nanoseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// Criterion's bench id (`group/function`).
    pub id: String,
    /// The middle of criterion's `time: [low mid high]`.
    pub nanos: f64,
}

/// Extracts `<id> time: [low mid high]` lines from criterion's output (the id may be on the
/// line before when it is long).
pub fn parse_criterion(output: &str) -> Vec<Measurement> {
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
                && let Some(nanos) = time_nanos(parts[2], parts[3])
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

fn time_nanos(value: &str, unit: &str) -> Option<f64> {
    let v: f64 = value.parse().ok()?;
    Some(v * time_scale(unit)?)
}

fn time_scale(unit: &str) -> Option<f64> {
    Some(match unit {
        "ps" => 1e-3,
        "ns" => 1.0,
        "µs" | "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return None,
    })
}

fn size_scale(unit: &str) -> Option<f64> {
    Some(match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    })
}

/// A quantity in a base unit, for comparison: (value, kind).
#[derive(Debug, Clone, PartialEq)]
enum Resolved {
    /// Nanoseconds.
    Time(f64),
    /// Bytes.
    Size(f64),
    /// Any other unit: compared only with the same unit.
    Other(f64, String),
}

impl Resolved {
    fn of(value: f64, unit: &str) -> Self {
        if let Some(s) = time_scale(unit) {
            Self::Time(value * s)
        } else if let Some(s) = size_scale(unit) {
            Self::Size(value * s)
        } else {
            Self::Other(value, unit.to_string())
        }
    }

    fn ratio_to(&self, other: &Self) -> Option<f64> {
        match (self, other) {
            (Self::Time(a), Self::Time(b)) | (Self::Size(a), Self::Size(b)) => Some(a / b),
            (Self::Other(a, ua), Self::Other(b, ub)) if ua == ub => Some(a / b),
            _ => None,
        }
    }

    fn human(&self) -> String {
        match self {
            Self::Time(n) => human_time(*n),
            Self::Size(b) => human_size(*b),
            Self::Other(v, unit) if unit.is_empty() => trim_number(*v),
            Self::Other(v, unit) => format!("{} {unit}", trim_number(*v)),
        }
    }
}

fn resolve(q: &Quantity, criterion: &BTreeMap<String, f64>) -> Result<Resolved, String> {
    match q {
        Quantity::Value { value, unit } => Ok(Resolved::of(*value, unit)),
        Quantity::Criterion(id) => criterion
            .get(id)
            .map(|n| Resolved::Time(*n))
            .ok_or_else(|| format!("no criterion figure for {id}")),
    }
}

/// One row of the table, as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    /// `crate/bench` that printed it.
    pub suite: String,
    /// The result's name.
    pub name: String,
    /// Our figure.
    pub ours: String,
    /// The baseline figure (`-` when none).
    pub baseline: String,
    /// `ours / baseline` (`-` when none).
    pub ratio: String,
    /// The target (`-` when none).
    pub target: String,
    /// `yes`, `NO` or `-`.
    pub met: String,
    /// Notes.
    pub notes: String,
}

impl Row {
    /// A row saying a whole suite produced nothing usable.
    pub fn failed(suite: &str, why: &str) -> Self {
        Self {
            suite: suite.into(),
            name: "(bench failed)".into(),
            ours: "-".into(),
            baseline: "-".into(),
            ratio: "-".into(),
            target: "-".into(),
            met: "NO".into(),
            notes: why.replace('|', "/"),
        }
    }

    fn cells(&self) -> [&str; 8] {
        [
            &self.suite,
            &self.name,
            &self.ours,
            &self.baseline,
            &self.ratio,
            &self.target,
            &self.met,
            &self.notes,
        ]
    }

    /// The Markdown table line.
    pub fn markdown(&self) -> String {
        format!("| {} |", self.cells().join(" | "))
    }

    /// Parses a line written by [`Row::markdown`] (for merging a partial run into an existing
    /// `BENCHMARKS.md`). `None` for the header, the rule and anything else.
    pub fn parse_markdown(line: &str) -> Option<Self> {
        let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
        let cells: Vec<String> = inner.split('|').map(|c| c.trim().to_string()).collect();
        let [suite, name, ours, baseline, ratio, target, met, notes] =
            <[String; 8]>::try_from(cells).ok()?;
        if suite == "suite" || suite.starts_with("---") {
            return None;
        }
        Some(Self {
            suite,
            name,
            ours,
            baseline,
            ratio,
            target,
            met,
            notes,
        })
    }
}

/// The table's header and rule.
pub const TABLE_HEAD: &str = "| suite | bench | ours | baseline | ratio | target | met? | notes |\n\
                              |---|---|---|---|---|---|---|---|";

/// Turns one suite's output into rows: its result lines, with criterion references resolved
/// against the criterion lines of the same output. Errors (malformed lines, missing
/// references) become visible rows.
pub fn rows_for(suite: &str, output: &str) -> Vec<Row> {
    let criterion: BTreeMap<String, f64> = parse_criterion(output)
        .into_iter()
        .map(|m| (m.id, m.nanos))
        .collect();
    let (results, errors) = parse_results(output);
    let mut rows: Vec<Row> = results.iter().map(|r| row(suite, r, &criterion)).collect();
    for error in errors {
        rows.push(Row {
            suite: suite.into(),
            name: "(malformed result line)".into(),
            ours: "-".into(),
            baseline: "-".into(),
            ratio: "-".into(),
            target: "-".into(),
            met: "NO".into(),
            notes: error.replace('|', "/"),
        });
    }
    if rows.is_empty() {
        rows.push(Row::failed(
            suite,
            "the bench printed no xtask-result lines",
        ));
    }
    rows
}

fn row(suite: &str, r: &ResultLine, criterion: &BTreeMap<String, f64>) -> Row {
    let mut notes: Vec<String> = r.note.iter().cloned().collect();
    let ours = resolve(&r.ours, criterion);
    let baseline = r.baseline.as_ref().map(|b| resolve(b, criterion));
    if let Err(e) = &ours {
        notes.push(e.clone());
    }
    if let Some(Err(e)) = &baseline {
        notes.push(e.clone());
    }
    let ratio = r.ratio.or_else(|| match (&ours, &baseline) {
        (Ok(o), Some(Ok(b))) => o.ratio_to(b),
        _ => None,
    });
    let met = match (r.target, ratio) {
        (Some(t), Some(x)) if t.met(x) => "yes",
        (Some(_), Some(_)) => "NO",
        (Some(_), None) => "?",
        (None, _) => "-",
    };
    Row {
        suite: suite.into(),
        name: r.name.clone(),
        ours: ours.map_or_else(|_| "missing".into(), |o| o.human()),
        baseline: match baseline {
            None => "-".into(),
            Some(Ok(b)) => b.human(),
            Some(Err(_)) => "missing".into(),
        },
        ratio: ratio.map_or_else(|| "-".into(), |x| format!("{}x", trim_number(x))),
        target: r.target.map_or_else(|| "-".into(), |t| t.to_string()),
        met: met.into(),
        notes: notes.join("; ").replace('|', "/"),
    }
}

/// The table: header, then the rows in the given order.
pub fn render_table(rows: &[Row]) -> String {
    let mut table = format!("{TABLE_HEAD}\n");
    if rows.is_empty() {
        table.push_str("| (no benches run) | | | | | | | |\n");
    }
    for r in rows {
        table.push_str(&r.markdown());
        table.push('\n');
    }
    table
}

/// A number with about four significant digits and no trailing zeros.
pub fn trim_number(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let digits = if v == 0.0 {
        0
    } else {
        (3 - v.abs().log10().floor() as i32).clamp(0, 6) as usize
    };
    let text = format!("{v:.digits$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

fn human_time(nanos: f64) -> String {
    match nanos {
        n if n >= 1e9 => format!("{} s", trim_number(n / 1e9)),
        n if n >= 1e6 => format!("{} ms", trim_number(n / 1e6)),
        n if n >= 1e3 => format!("{} µs", trim_number(n / 1e3)),
        n => format!("{} ns", trim_number(n)),
    }
}

fn human_size(bytes: f64) -> String {
    const KIB: f64 = 1024.0;
    match bytes {
        b if b >= KIB * KIB * KIB => format!("{} GiB", trim_number(b / (KIB * KIB * KIB))),
        b if b >= KIB * KIB => format!("{} MiB", trim_number(b / (KIB * KIB))),
        b if b >= KIB => format!("{} KiB", trim_number(b / KIB)),
        b => format!("{} B", trim_number(b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_field() {
        let line = "xtask-result: r3_replay ours=@r3_replay/replay baseline=@r3_replay/baseline \
                    target=<=1.05 note=forward + backward, flex f32";
        let r = parse_line(line).unwrap().unwrap();
        assert_eq!(r.name, "r3_replay");
        assert_eq!(r.ours, Quantity::Criterion("r3_replay/replay".into()));
        assert_eq!(
            r.baseline,
            Some(Quantity::Criterion("r3_replay/baseline".into()))
        );
        assert_eq!(
            r.target,
            Some(Target {
                at_most: true,
                bound: 1.05
            })
        );
        assert_eq!(r.note.as_deref(), Some("forward + backward, flex f32"));
        assert_eq!(r.ratio, None);
    }

    #[test]
    fn parses_numbers_with_units() {
        for (text, value, unit) in [
            ("12.5ms", 12.5, "ms"),
            ("5311turns/s", 5311.0, "turns/s"),
            ("1e-3s", 1e-3, "s"),
            ("2.5E+2MiB", 250.0, "MiB"),
            ("-0.25", -0.25, ""),
            ("7x", 7.0, "x"),
        ] {
            assert_eq!(
                parse_quantity(text).unwrap(),
                Quantity::Value {
                    value,
                    unit: unit.into()
                },
                "{text}"
            );
        }
        assert!(parse_quantity("ms").is_err());
        assert!(parse_quantity("@").is_err());
    }

    #[test]
    fn rejects_malformed_lines_loudly() {
        assert_eq!(parse_line("plain output").unwrap(), None);
        assert!(parse_line("xtask-result: ").is_err());
        assert!(parse_line("xtask-result: x baseline=1ms").is_err()); // no ours
        assert!(parse_line("xtask-result: x ours=1ms target=<1").is_err());
        assert!(parse_line("xtask-result: x ours=1ms speed=3").is_err());
        assert!(parse_line("xtask-result: x ours=1ms ratio=fast").is_err());
        let (ok, errors) = parse_results("xtask-result: a ours=1ms\nxtask-result: b ours=?\n");
        assert_eq!(ok.len(), 1);
        assert_eq!(errors.len(), 1);
    }

    #[test]
    fn parses_criterion_output() {
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
    }

    #[test]
    fn rows_resolve_criterion_references_and_compute_ratios() {
        let output = "\
logprobs/baseline       time:   [10.000 ms 12.000 ms 14.000 ms]
logprobs/fused          time:   [5.0000 ms 6.0000 ms 7.0000 ms]
xtask-result: logprobs ours=@logprobs/fused baseline=@logprobs/baseline target=<=0.6
xtask-result: strict ours=@logprobs/fused baseline=@logprobs/baseline target=<=0.4
xtask-result: memory ours=512MiB baseline=2GiB target=<=0.25 note=peak heap
xtask-result: turns ours=5000turns/s baseline=153turns/s target=>=32.6
xtask-result: mixed ours=3ms baseline=4MiB target=<=1
xtask-result: explicit ours=3ms baseline=4MiB ratio=0.5 target=<=1
xtask-result: gone ours=@logprobs/missing baseline=1ms target=<=1
xtask-result: alone ours=1500000ns
xtask-result: broken ours=fast
";
        let rows = rows_for("miles-ops/fused_logprobs", output);
        let table = render_table(&rows);
        let expect = [
            "| miles-ops/fused_logprobs | logprobs | 6 ms | 12 ms | 0.5x | ≤ 0.6x | yes |  |",
            "| miles-ops/fused_logprobs | strict | 6 ms | 12 ms | 0.5x | ≤ 0.4x | NO |  |",
            "| miles-ops/fused_logprobs | memory | 512 MiB | 2 GiB | 0.25x | ≤ 0.25x | yes | peak heap |",
            "| miles-ops/fused_logprobs | turns | 5000 turns/s | 153 turns/s | 32.68x | ≥ 32.6x | yes |  |",
            "| miles-ops/fused_logprobs | mixed | 3 ms | 4 MiB | - | ≤ 1x | ? |  |",
            "| miles-ops/fused_logprobs | explicit | 3 ms | 4 MiB | 0.5x | ≤ 1x | yes |  |",
            "| miles-ops/fused_logprobs | gone | missing | 1 ms | - | ≤ 1x | ? | no criterion figure for logprobs/missing |",
            "| miles-ops/fused_logprobs | alone | 1.5 ms | - | - | - | - |  |",
        ];
        for line in expect {
            assert!(table.contains(line), "missing {line}\n{table}");
        }
        assert_eq!(rows.len(), expect.len() + 1);
        assert_eq!(rows.last().unwrap().name, "(malformed result line)");
        assert_eq!(rows.last().unwrap().met, "NO");
    }

    #[test]
    fn a_silent_bench_is_a_failed_row() {
        let rows = rows_for("x/y", "criterion chatter only\n");
        assert_eq!(
            rows,
            [Row::failed(
                "x/y",
                "the bench printed no xtask-result lines"
            )]
        );
        assert!(render_table(&[]).contains("(no benches run)"));
    }

    #[test]
    fn markdown_rows_round_trip() {
        let rows = rows_for(
            "s/b",
            "xtask-result: a ours=2ms baseline=4ms target=<=1 note=n\n",
        );
        let line = rows[0].markdown();
        assert_eq!(Row::parse_markdown(&line), Some(rows[0].clone()));
        assert_eq!(
            Row::parse_markdown(TABLE_HEAD.lines().next().unwrap()),
            None
        );
        assert_eq!(
            Row::parse_markdown(TABLE_HEAD.lines().nth(1).unwrap()),
            None
        );
        assert_eq!(Row::parse_markdown("text"), None);
    }

    #[test]
    fn numbers_are_short() {
        assert_eq!(trim_number(12.0), "12");
        assert_eq!(trim_number(0.5754), "0.5754");
        assert_eq!(trim_number(1234.5678), "1235");
        assert_eq!(trim_number(0.000123456), "0.000123");
    }
}
