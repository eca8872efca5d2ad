//! A small command-line parser for the examples (the workspace has no `clap`): long options
//! `--name VALUE` / `--name=VALUE`, boolean flags, repeatable options, defaults, and a
//! generated `--help` listing every option.
//!
//! ```
//! use miles_examples::args::{Cli, Parse};
//!
//! let cli = Cli::new("demo", "Does a demo.")
//!     .option("--lr", "LR", Some("1e-3"), "learning rate")
//!     .multi("--engine-url", "URL", "an engine (repeatable)")
//!     .flag("--sync", "synchronous loop");
//! let Parse::Args(args) = cli.parse(["--lr=0.5", "--engine-url", "a", "--engine-url", "b", "--sync"])? else {
//!     unreachable!()
//! };
//! assert_eq!(args.parsed::<f64>("--lr")?, 0.5);
//! assert_eq!(args.all("--engine-url"), ["a", "b"]);
//! assert!(args.flag("--sync"));
//! assert!(matches!(cli.parse(["--help"])?, Parse::Help(text) if text.contains("--engine-url URL")));
//! # Ok::<(), miles_examples::Error>(())
//! ```

use std::collections::BTreeMap;
use std::str::FromStr;

use crate::Error;

#[derive(Debug, Clone)]
enum Kind {
    Flag,
    Value {
        metavar: &'static str,
        default: Option<String>,
    },
    Multi {
        metavar: &'static str,
    },
}

#[derive(Debug, Clone)]
struct Spec {
    name: &'static str,
    help: &'static str,
    kind: Kind,
}

/// The options a program accepts.
#[derive(Debug, Clone)]
pub struct Cli {
    program: &'static str,
    about: &'static str,
    specs: Vec<Spec>,
}

/// The outcome of parsing: the help text (for `--help` / `-h`) or the arguments.
#[derive(Debug, Clone)]
pub enum Parse {
    /// `--help` was given: print this and exit successfully.
    Help(String),
    /// The parsed arguments.
    Args(Args),
}

/// Parsed arguments: values by option name (defaults filled in) and the flags given.
#[derive(Debug, Clone, Default)]
pub struct Args {
    values: BTreeMap<&'static str, Vec<String>>,
    flags: Vec<&'static str>,
}

impl Cli {
    /// A program with a one-paragraph description.
    pub fn new(program: &'static str, about: &'static str) -> Self {
        Self {
            program,
            about,
            specs: Vec::new(),
        }
    }

    /// A boolean flag (`--sync`).
    pub fn flag(mut self, name: &'static str, help: &'static str) -> Self {
        self.specs.push(Spec {
            name,
            help,
            kind: Kind::Flag,
        });
        self
    }

    /// An option taking one value, with an optional default.
    pub fn option(
        mut self,
        name: &'static str,
        metavar: &'static str,
        default: Option<&str>,
        help: &'static str,
    ) -> Self {
        self.specs.push(Spec {
            name,
            help,
            kind: Kind::Value {
                metavar,
                default: default.map(str::to_owned),
            },
        });
        self
    }

    /// An option that may be given several times.
    pub fn multi(mut self, name: &'static str, metavar: &'static str, help: &'static str) -> Self {
        self.specs.push(Spec {
            name,
            help,
            kind: Kind::Multi { metavar },
        });
        self
    }

    /// The `--help` text.
    pub fn help(&self) -> String {
        let mut out = format!(
            "{}\n\nUsage: {} [OPTIONS]\n\nOptions:\n",
            self.about, self.program
        );
        let heads: Vec<String> = self
            .specs
            .iter()
            .map(|s| match &s.kind {
                Kind::Flag => s.name.to_string(),
                Kind::Value { metavar, .. } | Kind::Multi { metavar } => {
                    format!("{} {metavar}", s.name)
                }
            })
            .collect();
        let width = heads.iter().map(String::len).max().unwrap_or(0).max(10);
        for (spec, head) in self.specs.iter().zip(heads) {
            let extra = match &spec.kind {
                Kind::Value {
                    default: Some(d), ..
                } => format!(" [default: {d}]"),
                Kind::Multi { .. } => " (repeatable)".to_string(),
                _ => String::new(),
            };
            out.push_str(&format!("  {head:width$}  {}{extra}\n", spec.help));
        }
        out.push_str(&format!("  {:width$}  print this help\n", "-h, --help"));
        out
    }

    /// Parses `args` (without the program name).
    pub fn parse<I, S>(&self, args: I) -> Result<Parse, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut parsed = Args::default();
        for spec in &self.specs {
            if let Kind::Value {
                default: Some(d), ..
            } = &spec.kind
            {
                parsed.values.insert(spec.name, vec![d.clone()]);
            }
        }
        let mut given: Vec<&'static str> = Vec::new();
        let mut iter = args.into_iter().map(Into::into);
        while let Some(arg) = iter.next() {
            if arg == "--help" || arg == "-h" {
                return Ok(Parse::Help(self.help()));
            }
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
                _ => (arg.clone(), None),
            };
            let spec = self.specs.iter().find(|s| s.name == name).ok_or_else(|| {
                Error::Args(format!(
                    "unknown argument {arg:?} (see {} --help)",
                    self.program
                ))
            })?;
            match &spec.kind {
                Kind::Flag => {
                    if inline.is_some() {
                        return Err(Error::Args(format!("{} takes no value", spec.name)));
                    }
                    parsed.flags.push(spec.name);
                }
                Kind::Value { .. } | Kind::Multi { .. } => {
                    let value = match inline {
                        Some(v) => v,
                        None => iter
                            .next()
                            .ok_or_else(|| Error::Args(format!("{} needs a value", spec.name)))?,
                    };
                    let single = matches!(spec.kind, Kind::Value { .. });
                    if single && given.contains(&spec.name) {
                        return Err(Error::Args(format!("{} given twice", spec.name)));
                    }
                    given.push(spec.name);
                    let slot = parsed.values.entry(spec.name).or_default();
                    if single {
                        slot.clear();
                    }
                    slot.push(value);
                }
            }
        }
        Ok(Parse::Args(parsed))
    }
}

/// Parses the process's arguments with `cli`: the arguments, or the exit code after printing
/// the help (0) or the error (2).
pub fn parse_env(cli: &Cli) -> Result<Args, std::process::ExitCode> {
    match cli.parse(std::env::args().skip(1)) {
        Ok(Parse::Help(text)) => {
            println!("{text}");
            Err(std::process::ExitCode::SUCCESS)
        }
        Ok(Parse::Args(args)) => Ok(args),
        Err(e) => {
            eprintln!("error: {e}\n(see --help)");
            Err(std::process::ExitCode::from(2))
        }
    }
}

/// The exit code of a run: 0, or 1 after printing the error.
pub fn exit_code<E: std::fmt::Display>(result: Result<(), E>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

impl Args {
    /// The value of an option (its default when not given), if any.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .get(name)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    /// The value of an option that must be present.
    pub fn required(&self, name: &str) -> Result<&str, Error> {
        self.get(name)
            .ok_or_else(|| Error::Args(format!("{name} is required")))
    }

    /// The value of an option parsed as `T` (it must be present or have a default).
    pub fn parsed<T: FromStr>(&self, name: &str) -> Result<T, Error>
    where
        T::Err: std::fmt::Display,
    {
        let text = self.required(name)?;
        text.parse::<T>()
            .map_err(|e| Error::Args(format!("{name} {text:?}: {e}")))
    }

    /// The value of an optional option parsed as `T`.
    pub fn parsed_opt<T: FromStr>(&self, name: &str) -> Result<Option<T>, Error>
    where
        T::Err: std::fmt::Display,
    {
        self.get(name).map(|_| self.parsed(name)).transpose()
    }

    /// Every value of a repeatable option, in order.
    pub fn all(&self, name: &str) -> &[String] {
        self.values.get(name).map_or(&[], Vec::as_slice)
    }

    /// Whether a flag was given.
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(&name)
    }

    /// A boolean option (`true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`; absent = false),
    /// for Miles' `--use-*` options that take a value.
    pub fn boolean(&self, name: &str) -> Result<bool, Error> {
        match self.get(name).unwrap_or("false") {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            other => Err(Error::Args(format!(
                "{name}: expected true or false, got {other:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli() -> Cli {
        Cli::new("t", "Test program.")
            .option("--model", "DIR", None, "model directory")
            .option("--lr", "LR", Some("0.001"), "learning rate")
            .flag("--sync", "synchronous")
            .multi("--url", "URL", "engines")
    }

    fn args(list: &[&str]) -> Result<Args, Error> {
        match cli().parse(list.iter().copied())? {
            Parse::Args(a) => Ok(a),
            Parse::Help(_) => panic!("help"),
        }
    }

    #[test]
    fn defaults_values_and_flags() {
        let a = args(&[]).unwrap();
        assert_eq!(a.get("--lr"), Some("0.001"));
        assert_eq!(a.get("--model"), None);
        assert!(!a.flag("--sync"));
        assert!(a.required("--model").is_err());
        assert_eq!(a.parsed_opt::<f64>("--model").unwrap(), None);
        let a = args(&[
            "--model", "m", "--lr", "2", "--sync", "--url=x", "--url", "y",
        ])
        .unwrap();
        assert_eq!(a.required("--model").unwrap(), "m");
        assert_eq!(a.parsed::<f32>("--lr").unwrap(), 2.0);
        assert!(a.flag("--sync"));
        assert_eq!(a.all("--url"), ["x", "y"]);
    }

    #[test]
    fn mistakes_are_errors() {
        assert!(args(&["--nope"]).is_err());
        assert!(args(&["--model"]).is_err());
        assert!(args(&["--model", "a", "--model", "b"]).is_err());
        assert!(args(&["--sync=1"]).is_err());
        let a = args(&["--lr", "fast"]).unwrap();
        let err = a.parsed::<f64>("--lr").unwrap_err().to_string();
        assert!(err.contains("--lr") && err.contains("fast"), "{err}");
    }

    #[test]
    fn help_lists_every_option() {
        let Parse::Help(text) = cli().parse(["-h"]).unwrap() else {
            panic!("no help");
        };
        for needle in [
            "Test program.",
            "--model DIR",
            "--lr LR",
            "[default: 0.001]",
            "--sync",
            "--url URL",
            "(repeatable)",
            "--help",
        ] {
            assert!(text.contains(needle), "{needle} missing:\n{text}");
        }
    }
}
