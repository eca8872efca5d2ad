//! The `miles` command line: Miles-style long flags in named groups, a TOML config file whose
//! keys are the flag names, and mistakes that name the closest valid flag.
//!
//! * `--name VALUE` / `--name=VALUE`; switches (`store_true` in Miles) take no value;
//!   repeatable flags collect every occurrence; `nargs` flags (`--eval-prompt-data NAME PATH
//!   [NAME PATH …]`) take every value up to the next `--flag`.
//! * `--config FILE` (TOML): `lr = 1e-5`, `use-kl-loss = true`, `engine-url = ["a", "b"]`;
//!   keys may use `-` or `_`; a table value is passed on as JSON (for the JSON-valued flags).
//!   Flags given on the command line override the file (a list on the command line replaces
//!   the file's list).
//! * An unknown flag (or config key) is an error naming the closest valid one.
//!
//! ```
//! use miles_examples::flags::{FlagSet, Parsed};
//!
//! let set = FlagSet::new("demo", "Does a demo.")
//!     .group("Training")
//!     .value("--lr", "LR", Some("1e-6"), "learning rate")
//!     .switch("--use-kl-loss", "add a KL loss")
//!     .nargs("--eval-prompt-data", "NAME PATH", "evaluation sets");
//! let Parsed::Args(args) = set.parse(["--lr", "2e-5", "--eval-prompt-data", "a", "a.jsonl"])? else {
//!     unreachable!()
//! };
//! assert_eq!(args.parse::<f64>("--lr")?, Some(2e-5));
//! assert!(!args.switch("--use-kl-loss"));
//! assert_eq!(args.all("--eval-prompt-data"), ["a", "a.jsonl"]);
//! let err = set.parse(["--use-kl-los"]).unwrap_err().to_string();
//! assert!(err.contains("did you mean --use-kl-loss"), "{err}");
//! # Ok::<(), miles_examples::Error>(())
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::str::FromStr;

use crate::Error;

/// What a flag takes.
#[derive(Debug, Clone, PartialEq)]
pub enum FlagKind {
    /// No value (Miles' `action="store_true"`).
    Switch,
    /// One value, with an optional default.
    Value {
        /// Placeholder in the help.
        metavar: &'static str,
        /// Default when not given.
        default: Option<&'static str>,
    },
    /// One value per occurrence, repeatable.
    Repeat {
        /// Placeholder in the help.
        metavar: &'static str,
    },
    /// Every value up to the next flag (Miles' `nargs="+"`).
    Nargs {
        /// Placeholder in the help.
        metavar: &'static str,
    },
}

/// One flag.
#[derive(Debug, Clone)]
pub struct Flag {
    /// `--name`.
    pub name: &'static str,
    /// Other spellings accepted for it (Miles' names where ours differ).
    pub aliases: Vec<&'static str>,
    /// The help group it is listed under.
    pub group: &'static str,
    /// What it takes.
    pub kind: FlagKind,
    /// One line of help.
    pub help: &'static str,
}

/// A program's flags, in groups.
#[derive(Debug, Clone)]
pub struct FlagSet {
    program: &'static str,
    about: &'static str,
    current_group: &'static str,
    flags: Vec<Flag>,
}

/// The outcome of parsing.
#[derive(Debug, Clone)]
pub enum Parsed {
    /// `--help` / `-h`: print this and exit successfully.
    Help(String),
    /// The arguments.
    Args(FlagValues),
}

/// Parsed values (defaults filled in), switches that are on, and which flags were given.
#[derive(Debug, Clone, Default)]
pub struct FlagValues {
    values: BTreeMap<&'static str, Vec<String>>,
    switches: BTreeSet<&'static str>,
    given: BTreeSet<&'static str>,
}

/// Most bytes of a `--config` file.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

impl FlagSet {
    /// A program with a one-paragraph description.
    pub fn new(program: &'static str, about: &'static str) -> Self {
        Self {
            program,
            about,
            current_group: "Options",
            flags: Vec::new(),
        }
    }

    /// Flags added after this call are listed under `name`.
    pub fn group(mut self, name: &'static str) -> Self {
        self.current_group = name;
        self
    }

    fn push(mut self, name: &'static str, kind: FlagKind, help: &'static str) -> Self {
        debug_assert!(name.starts_with("--"), "{name}");
        self.flags.push(Flag {
            name,
            aliases: Vec::new(),
            group: self.current_group,
            kind,
            help,
        });
        self
    }

    /// A switch (no value).
    pub fn switch(self, name: &'static str, help: &'static str) -> Self {
        self.push(name, FlagKind::Switch, help)
    }

    /// A flag taking one value.
    pub fn value(
        self,
        name: &'static str,
        metavar: &'static str,
        default: Option<&'static str>,
        help: &'static str,
    ) -> Self {
        self.push(name, FlagKind::Value { metavar, default }, help)
    }

    /// A repeatable flag.
    pub fn repeat(self, name: &'static str, metavar: &'static str, help: &'static str) -> Self {
        self.push(name, FlagKind::Repeat { metavar }, help)
    }

    /// A flag taking every value up to the next flag.
    pub fn nargs(self, name: &'static str, metavar: &'static str, help: &'static str) -> Self {
        self.push(name, FlagKind::Nargs { metavar }, help)
    }

    /// Also accepts `alias` for the flag added last.
    pub fn alias(mut self, alias: &'static str) -> Self {
        if let Some(last) = self.flags.last_mut() {
            last.aliases.push(alias);
        }
        self
    }

    /// Every flag, in the order added.
    pub fn flags(&self) -> &[Flag] {
        &self.flags
    }

    fn find(&self, name: &str) -> Option<&Flag> {
        self.flags
            .iter()
            .find(|f| f.name == name || f.aliases.contains(&name))
    }

    /// The closest flag name to `name` (edit distance at most a third of its length, ≥ 2).
    pub fn closest(&self, name: &str) -> Option<&'static str> {
        let budget = (name.len() / 3).max(2);
        self.flags
            .iter()
            .flat_map(|f| std::iter::once(f.name).chain(f.aliases.iter().copied()))
            .map(|candidate| (edit_distance(name, candidate), candidate))
            .filter(|(d, _)| *d <= budget)
            .min()
            .map(|(_, c)| self.find(c).map_or(c, |f| f.name))
    }

    fn unknown(&self, what: &str, name: &str) -> Error {
        let hint = match self.closest(name) {
            Some(c) => format!("; did you mean {c}?"),
            None => format!(" (see {} --help)", self.program),
        };
        Error::Args(format!("unknown {what} {name}{hint}"))
    }

    /// The `--help` text: the description, then each group's flags.
    pub fn help(&self) -> String {
        let mut out = format!("{}\n\nUsage: {} [FLAGS]\n", self.about, self.program);
        let head = |f: &Flag| match &f.kind {
            FlagKind::Switch => f.name.to_string(),
            FlagKind::Value { metavar, .. } | FlagKind::Repeat { metavar } => {
                format!("{} {metavar}", f.name)
            }
            FlagKind::Nargs { metavar } => format!("{} {metavar} [...]", f.name),
        };
        let width = self
            .flags
            .iter()
            .map(|f| head(f).len())
            .max()
            .unwrap_or(0)
            .clamp(10, 40);
        let mut groups: Vec<&'static str> = Vec::new();
        for f in &self.flags {
            if !groups.contains(&f.group) {
                groups.push(f.group);
            }
        }
        for group in groups {
            out.push_str(&format!("\n{group}:\n"));
            for f in self.flags.iter().filter(|f| f.group == group) {
                let mut help = f.help.to_string();
                match &f.kind {
                    FlagKind::Value {
                        default: Some(d), ..
                    } => help.push_str(&format!(" [default: {d}]")),
                    FlagKind::Repeat { .. } => help.push_str(" (repeatable)"),
                    _ => {}
                }
                if !f.aliases.is_empty() {
                    help.push_str(&format!(" (also: {})", f.aliases.join(", ")));
                }
                let h = head(f);
                if h.len() > width {
                    out.push_str(&format!("  {h}\n  {:width$}  {help}\n", ""));
                } else {
                    out.push_str(&format!("  {h:width$}  {help}\n"));
                }
            }
        }
        out.push_str(&format!(
            "\nGeneral:\n  {:width$}  read flags from a TOML file (keys = flag names; the command line overrides it)\n  {:width$}  print this help\n",
            "--config FILE", "-h, --help"
        ));
        out
    }

    /// Parses `args` (without the program name); `--config FILE` is read first and the
    /// command line applied over it.
    pub fn parse<I, S>(&self, args: I) -> Result<Parsed, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let args: Vec<String> = args.into_iter().map(Into::into).collect();
        if args.iter().any(|a| a == "--help" || a == "-h") {
            return Ok(Parsed::Help(self.help()));
        }
        let mut values = FlagValues::default();
        for f in &self.flags {
            if let FlagKind::Value {
                default: Some(d), ..
            } = f.kind
            {
                values.values.insert(f.name, vec![d.to_owned()]);
            }
        }
        // The config file first.
        let mut rest: Vec<String> = Vec::with_capacity(args.len());
        let mut config: Option<String> = None;
        let mut iter = args.into_iter();
        while let Some(arg) = iter.next() {
            if arg == "--config" {
                config = Some(
                    iter.next()
                        .ok_or_else(|| Error::Args("--config needs a file".into()))?,
                );
            } else if let Some(path) = arg.strip_prefix("--config=") {
                config = Some(path.to_owned());
            } else {
                rest.push(arg);
            }
        }
        if let Some(path) = config {
            self.apply_config(Path::new(&path), &mut values)?;
        }
        // Then the command line, over it.
        let mut from_cli: BTreeSet<&'static str> = BTreeSet::new();
        let mut i = 0;
        while i < rest.len() {
            let arg = &rest[i];
            i += 1;
            if !arg.starts_with("--") {
                return Err(Error::Args(format!(
                    "unexpected argument {arg:?} (flags start with --; see {} --help)",
                    self.program
                )));
            }
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (arg.as_str(), None),
            };
            let flag = self.find(name).ok_or_else(|| self.unknown("flag", name))?;
            let first = from_cli.insert(flag.name);
            values.given.insert(flag.name);
            match &flag.kind {
                FlagKind::Switch => {
                    match inline.as_deref() {
                        None => {
                            values.switches.insert(flag.name);
                        }
                        Some(v) => set_switch(&mut values, flag.name, parse_bool(flag.name, v)?),
                    };
                }
                FlagKind::Value { .. } => {
                    if !first {
                        return Err(Error::Args(format!("{} given twice", flag.name)));
                    }
                    let value = match inline {
                        Some(v) => v,
                        None => take_value(&rest, &mut i, flag.name)?,
                    };
                    values.values.insert(flag.name, vec![value]);
                }
                FlagKind::Repeat { .. } => {
                    let value = match inline {
                        Some(v) => v,
                        None => take_value(&rest, &mut i, flag.name)?,
                    };
                    let slot = values.values.entry(flag.name).or_default();
                    if first {
                        slot.clear();
                    }
                    slot.push(value);
                }
                FlagKind::Nargs { .. } => {
                    let slot = values.values.entry(flag.name).or_default();
                    if first {
                        slot.clear();
                    }
                    let before = slot.len();
                    slot.extend(inline);
                    while i < rest.len() && !rest[i].starts_with("--") {
                        slot.push(rest[i].clone());
                        i += 1;
                    }
                    if slot.len() == before {
                        return Err(Error::Args(format!("{} needs values", flag.name)));
                    }
                }
            }
        }
        Ok(Parsed::Args(values))
    }

    fn apply_config(&self, path: &Path, values: &mut FlagValues) -> Result<(), Error> {
        let io = |e| Error::io(path, e);
        let size = std::fs::metadata(path).map_err(io)?.len();
        if size > MAX_CONFIG_BYTES {
            return Err(Error::Args(format!(
                "--config {}: {size} bytes, more than {MAX_CONFIG_BYTES}",
                path.display()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let table: toml::Table = text
            .parse()
            .map_err(|e| Error::Args(format!("--config {}: {e}", path.display())))?;
        for (key, value) in table {
            let name = format!("--{}", key.replace('_', "-"));
            let flag = self
                .find(&name)
                .ok_or_else(|| self.unknown(&format!("key in {}:", path.display()), &name))?;
            let bad = |want: &str| {
                Error::Args(format!(
                    "--config {}: {key} must be {want}, got {value}",
                    path.display()
                ))
            };
            values.given.insert(flag.name);
            match &flag.kind {
                FlagKind::Switch => {
                    let on = value.as_bool().ok_or_else(|| bad("true or false"))?;
                    set_switch(values, flag.name, on);
                }
                FlagKind::Value { .. } => {
                    let v = scalar(&value).ok_or_else(|| bad("a string, number or boolean"))?;
                    values.values.insert(flag.name, vec![v]);
                }
                FlagKind::Repeat { .. } | FlagKind::Nargs { .. } => {
                    let list = match &value {
                        toml::Value::Array(items) => items
                            .iter()
                            .map(scalar)
                            .collect::<Option<Vec<_>>>()
                            .ok_or_else(|| bad("a list of strings or numbers"))?,
                        other => vec![scalar(other).ok_or_else(|| bad("a list"))?],
                    };
                    values.values.insert(flag.name, list);
                }
            }
        }
        Ok(())
    }
}

fn set_switch(values: &mut FlagValues, name: &'static str, on: bool) {
    if on {
        values.switches.insert(name);
    } else {
        values.switches.remove(name);
    }
}

fn take_value(rest: &[String], i: &mut usize, name: &str) -> Result<String, Error> {
    let value = rest
        .get(*i)
        .ok_or_else(|| Error::Args(format!("{name} needs a value")))?;
    *i += 1;
    Ok(value.clone())
}

fn parse_bool(name: &str, text: &str) -> Result<bool, Error> {
    match text {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        other => Err(Error::Args(format!(
            "{name}: expected true or false, got {other:?}"
        ))),
    }
}

fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(x) => Some(x.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        // A table is handed on as JSON (`apply-chat-template-kwargs = { enable_thinking = false }`).
        toml::Value::Table(_) => serde_json::to_string(value).ok(),
        _ => None,
    }
}

/// Levenshtein distance over bytes (flag names are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != cb);
            cur[j + 1] = (prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

impl FlagValues {
    /// The value of a flag (its default when not given).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .get(name)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    /// The value of a flag that must be present.
    pub fn required(&self, name: &str) -> Result<&str, Error> {
        self.get(name)
            .ok_or_else(|| Error::Args(format!("{name} is required")))
    }

    /// The value parsed as `T`, if present.
    pub fn parse<T: FromStr>(&self, name: &str) -> Result<Option<T>, Error>
    where
        T::Err: std::fmt::Display,
    {
        self.get(name)
            .map(|text| {
                text.parse::<T>()
                    .map_err(|e| Error::Args(format!("{name} {text:?}: {e}")))
            })
            .transpose()
    }

    /// The value parsed as `T`; it must be present (given or defaulted).
    pub fn parse_required<T: FromStr>(&self, name: &str) -> Result<T, Error>
    where
        T::Err: std::fmt::Display,
    {
        self.parse(name)?
            .ok_or_else(|| Error::Args(format!("{name} is required")))
    }

    /// Every value of a repeatable / nargs flag.
    pub fn all(&self, name: &str) -> &[String] {
        self.values.get(name).map_or(&[], Vec::as_slice)
    }

    /// Whether a switch is on.
    pub fn switch(&self, name: &str) -> bool {
        self.switches.contains(name)
    }

    /// Whether the flag was given (command line or config file), not defaulted.
    pub fn given(&self, name: &str) -> bool {
        self.given.contains(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> FlagSet {
        FlagSet::new("t", "Test.")
            .group("Model")
            .value("--hf-checkpoint", "DIR", None, "model")
            .group("Training")
            .value("--lr", "LR", Some("1e-6"), "learning rate")
            .switch("--use-kl-loss", "KL")
            .repeat("--engine-url", "URL", "engines")
            .nargs("--eval-prompt-data", "NAME PATH", "eval sets")
            .value("--tensorboard-dir", "DIR", None, "tb")
            .alias("--tb-project-name")
    }

    fn args(list: &[&str]) -> Result<FlagValues, Error> {
        match set().parse(list.iter().copied())? {
            Parsed::Args(a) => Ok(a),
            Parsed::Help(_) => panic!("help"),
        }
    }

    fn config(text: &str) -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "miles-flags-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn values_switches_lists_and_aliases() {
        let a = args(&[]).unwrap();
        assert_eq!(a.get("--lr"), Some("1e-6"));
        assert!(!a.given("--lr"));
        assert_eq!(a.get("--hf-checkpoint"), None);
        let a = args(&[
            "--lr=3e-4",
            "--use-kl-loss",
            "--engine-url",
            "a",
            "--engine-url=b",
            "--eval-prompt-data",
            "x",
            "x.jsonl",
            "y",
            "y.parquet",
            "--tb-project-name",
            "tb",
        ])
        .unwrap();
        assert_eq!(a.parse::<f64>("--lr").unwrap(), Some(3e-4));
        assert!(a.given("--lr") && a.switch("--use-kl-loss"));
        assert_eq!(a.all("--engine-url"), ["a", "b"]);
        assert_eq!(
            a.all("--eval-prompt-data"),
            ["x", "x.jsonl", "y", "y.parquet"]
        );
        assert_eq!(a.get("--tensorboard-dir"), Some("tb"));
    }

    #[test]
    fn mistakes_name_the_closest_flag() {
        let e = args(&["--lr-rate", "1"]).unwrap_err().to_string();
        assert!(e.contains("unknown flag --lr-rate"), "{e}");
        let e = args(&["--use-kl-los"]).unwrap_err().to_string();
        assert!(e.contains("did you mean --use-kl-loss?"), "{e}");
        let e = args(&["--hf-chekpoint", "d"]).unwrap_err().to_string();
        assert!(e.contains("did you mean --hf-checkpoint?"), "{e}");
        let e = args(&["--zzzzzz"]).unwrap_err().to_string();
        assert!(
            e.contains("see t --help") && !e.contains("did you mean"),
            "{e}"
        );
        assert!(args(&["--lr"]).is_err());
        assert!(args(&["--lr", "1", "--lr", "2"]).is_err());
        assert!(args(&["--eval-prompt-data"]).is_err());
        assert!(args(&["stray"]).is_err());
        assert!(args(&["--use-kl-loss=maybe"]).is_err());
        let e = args(&["--lr", "fast"])
            .unwrap()
            .parse::<f64>("--lr")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--lr") && e.contains("fast"), "{e}");
    }

    #[test]
    fn config_file_under_the_command_line() {
        let path = config(
            "hf_checkpoint = \"m\"\nlr = 2e-5\nuse-kl-loss = true\nengine-url = [\"a\", \"b\"]\ntensorboard-dir = { enable_thinking = false }\n",
        );
        let p = path.to_str().unwrap();
        let a = args(&["--config", p]).unwrap();
        assert_eq!(a.get("--hf-checkpoint"), Some("m"));
        assert_eq!(a.parse::<f64>("--lr").unwrap(), Some(2e-5));
        assert!(a.switch("--use-kl-loss") && a.given("--lr"));
        assert_eq!(a.all("--engine-url"), ["a", "b"]);
        assert_eq!(
            a.get("--tensorboard-dir"),
            Some(r#"{"enable_thinking":false}"#)
        );
        let a = args(&[
            "--lr",
            "1e-3",
            &format!("--config={p}"),
            "--engine-url",
            "c",
            "--use-kl-loss=false",
        ])
        .unwrap();
        assert_eq!(a.get("--lr"), Some("1e-3"), "the command line wins");
        assert_eq!(
            a.all("--engine-url"),
            ["c"],
            "a list on the command line replaces"
        );
        assert!(!a.switch("--use-kl-loss"));
        let bad = config("lrr = 1\n");
        let e = args(&["--config", bad.to_str().unwrap()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("did you mean --lr?"), "{e}");
        let bad = config("use-kl-loss = \"yes\"\n");
        assert!(args(&["--config", bad.to_str().unwrap()]).is_err());
        let bad = config("lr = [1\n");
        assert!(args(&["--config", bad.to_str().unwrap()]).is_err());
        assert!(args(&["--config", "/nonexistent/miles.toml"]).is_err());
        assert!(args(&["--config"]).is_err());
        for p in [path, bad] {
            std::fs::remove_file(p).ok();
        }
    }

    #[test]
    fn help_groups_flags() {
        let Parsed::Help(text) = set().parse(["--help"]).unwrap() else {
            panic!("no help")
        };
        let model = text.find("\nModel:\n").expect("Model group");
        let training = text.find("\nTraining:\n").expect("Training group");
        assert!(model < training);
        assert!(text.find("--hf-checkpoint DIR").unwrap() < training);
        assert!(text.find("--lr LR").unwrap() > training);
        for needle in [
            "[default: 1e-6]",
            "(repeatable)",
            "--eval-prompt-data NAME PATH [...]",
            "(also: --tb-project-name)",
            "--config FILE",
        ] {
            assert!(text.contains(needle), "{needle} missing:\n{text}");
        }
    }

    #[test]
    fn edit_distances() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("--lr", "--lr"), 0);
    }
}
