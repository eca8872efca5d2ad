//! What happens to the command line before clap parses it: Miles' flags that do not apply
//! here are taken out (and named in one warning), and a `--config FILE` is read and its keys
//! put in as flags, under the command line (a flag given on the command line wins).

use std::path::Path;

use clap::{ArgAction, CommandFactory, error::ErrorKind};

use crate::args::Cli;
use crate::miles_flags::{Arity, NOT_APPLICABLE};

/// Most bytes of a `--config` file.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Miles' prefixes for SGLang's own server arguments (`--sglang-mem-fraction-static 0.7`).
pub const SGLANG_PREFIXES: [&str; 2] = ["--sglang-", "--eval-sglang-"];

/// The SGLang server arguments the embedded engine reads (kept for clap, not ignored).
pub const SGLANG_READ: [&str; 2] = ["--sglang-mem-fraction-static", "--sglang-max-total-tokens"];

/// The subcommands that take Miles' training flags (and `--config`).
const TRAINING: [&str; 4] = ["train", "train-async", "sft", "eval"];

/// The command line to hand to clap, and the Miles flags taken out of it (in order, each once).
#[derive(Debug, Clone, PartialEq)]
pub struct Expanded {
    /// The arguments, program name first.
    pub argv: Vec<String>,
    /// Miles flags accepted but ignored (they configure what does not exist here).
    pub ignored: Vec<String>,
}

fn usage_error(kind: ErrorKind, message: impl std::fmt::Display) -> clap::Error {
    Cli::command().error(kind, message)
}

/// Prepares `argv` (program name first) for [`Cli`]'s parser.
pub fn expand(argv: Vec<String>) -> Result<Expanded, clap::Error> {
    let Some(at) = subcommand_index(&argv) else {
        return Ok(Expanded {
            argv,
            ignored: Vec::new(),
        });
    };
    if !TRAINING.contains(&argv[at].as_str()) {
        return Ok(Expanded {
            argv,
            ignored: Vec::new(),
        });
    }
    let (rest, mut ignored) = strip_not_applicable(&argv[at + 1..]);
    let mut out: Vec<String> = argv[..=at].to_vec();
    if let Some(path) = config_path(&rest)? {
        let command = Cli::command();
        let sub = command
            .find_subcommand(&argv[at])
            .ok_or_else(|| usage_error(ErrorKind::InvalidSubcommand, &argv[at]))?;
        out.extend(config_tokens(sub, Path::new(&path), &rest, &mut ignored)?);
    }
    out.extend(rest);
    let mut seen = Vec::new();
    ignored.retain(|f| {
        let new = !seen.contains(f);
        seen.push(f.clone());
        new
    });
    Ok(Expanded { argv: out, ignored })
}

/// Where the subcommand is: after the program name and any global logging options.
fn subcommand_index(argv: &[String]) -> Option<usize> {
    let mut i = 1;
    while i < argv.len() {
        let arg = argv[i].as_str();
        if arg == "--log-level" || arg == "--log-format" {
            i += 2;
        } else if arg.starts_with("--log-level=") || arg.starts_with("--log-format=") {
            i += 1;
        } else if arg.starts_with('-') {
            return None;
        } else {
            return Some(i);
        }
    }
    None
}

/// Removes Miles' not-applicable flags (with their values) from `args`.
fn strip_not_applicable(args: &[String]) -> (Vec<String>, Vec<String>) {
    let mut kept = Vec::with_capacity(args.len());
    let mut ignored = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let (name, inline) = match arg.split_once('=') {
            Some((n, _)) if n.starts_with("--") => (n, true),
            _ => (arg.as_str(), false),
        };
        let found = NOT_APPLICABLE
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(flag, arity)| (flag.to_owned(), arity))
            .or_else(|| {
                // SGLang's server arguments, passed through by Miles under its prefixes: their
                // values run up to the next flag.
                (SGLANG_PREFIXES.iter().any(|p| name.starts_with(p))
                    && !SGLANG_READ.contains(&name))
                .then(|| (name.to_owned(), Arity::Values))
            });
        let Some((flag, arity)) = found else {
            kept.push(arg.clone());
            continue;
        };
        ignored.push(flag);
        if inline {
            continue;
        }
        match arity {
            Arity::Switch => {}
            Arity::Value => {
                if i < args.len() {
                    i += 1;
                }
            }
            Arity::Values => {
                while i < args.len() && !args[i].starts_with("--") {
                    i += 1;
                }
            }
        }
    }
    (kept, ignored)
}

fn config_path(args: &[String]) -> Result<Option<String>, clap::Error> {
    let mut found = None;
    let mut i = 0;
    while i < args.len() {
        if args[i] == "--config" {
            let path = args.get(i + 1).ok_or_else(|| {
                usage_error(ErrorKind::InvalidValue, "--config needs a FILE (TOML)")
            })?;
            found = Some(path.clone());
            i += 2;
        } else {
            if let Some(path) = args[i].strip_prefix("--config=") {
                found = Some(path.to_owned());
            }
            i += 1;
        }
    }
    Ok(found)
}

/// Every long name of `arg` (its own and its aliases).
fn names(arg: &clap::Arg) -> Vec<String> {
    let mut out: Vec<String> = arg.get_long().map(str::to_owned).into_iter().collect();
    out.extend(
        arg.get_all_aliases()
            .into_iter()
            .flatten()
            .map(str::to_owned),
    );
    out
}

fn given_on_command_line(arg: &clap::Arg, args: &[String]) -> bool {
    names(arg).iter().any(|name| {
        let flag = format!("--{name}");
        args.iter()
            .any(|a| *a == flag || a.starts_with(&format!("{flag}=")))
    })
}

/// The flags `--config FILE` holds for `sub`, except those `args` (the command line) gives.
fn config_tokens(
    sub: &clap::Command,
    path: &Path,
    args: &[String],
    ignored: &mut Vec<String>,
) -> Result<Vec<String>, clap::Error> {
    let shown = path.display();
    let size = std::fs::metadata(path)
        .map_err(|e| usage_error(ErrorKind::Io, format!("--config {shown}: {e}")))?
        .len();
    if size > MAX_CONFIG_BYTES {
        return Err(usage_error(
            ErrorKind::InvalidValue,
            format!("--config {shown}: {size} bytes, more than {MAX_CONFIG_BYTES}"),
        ));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| usage_error(ErrorKind::Io, format!("--config {shown}: {e}")))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        usage_error(
            ErrorKind::InvalidValue,
            format!("--config {shown}: {}", one_line(&e.to_string())),
        )
    })?;
    let mut tokens = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        if name == "config" {
            return Err(usage_error(
                ErrorKind::ArgumentConflict,
                format!("--config {shown}: a config file cannot name another (key {key})"),
            ));
        }
        let Some(arg) = sub.get_arguments().find(|a| names(a).contains(&name)) else {
            let flag = format!("--{name}");
            if NOT_APPLICABLE.iter().any(|(n, _)| *n == flag) {
                ignored.push(flag);
                continue;
            }
            let hint = closest(sub, &name)
                .map(|c| format!("; did you mean {c}?"))
                .unwrap_or_default();
            return Err(usage_error(
                ErrorKind::UnknownArgument,
                format!("unknown key {key} in --config {shown}{hint}"),
            ));
        };
        if given_on_command_line(arg, args) {
            continue;
        }
        let flag = format!("--{}", arg.get_long().unwrap_or(&name));
        let bad = |want: &str| {
            usage_error(
                ErrorKind::InvalidValue,
                format!("--config {shown}: {key} must be {want}, got {value}"),
            )
        };
        match arg.get_action() {
            ArgAction::SetTrue => {
                if value.as_bool().ok_or_else(|| bad("true or false"))? {
                    tokens.push(flag);
                }
            }
            ArgAction::Append => {
                for item in list(&value).ok_or_else(|| bad("a list of strings or numbers"))? {
                    tokens.push(flag.clone());
                    tokens.push(item);
                }
            }
            _ if arg.get_num_args().is_some_and(|n| n.max_values() > 1) => {
                tokens.push(flag);
                tokens.extend(list(&value).ok_or_else(|| bad("a list of strings or numbers"))?);
            }
            _ => {
                tokens.push(format!(
                    "{flag}={}",
                    scalar(&value).ok_or_else(|| bad("a string, number or boolean"))?
                ));
            }
        }
    }
    Ok(tokens)
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn list(value: &toml::Value) -> Option<Vec<String>> {
    match value {
        toml::Value::Array(items) => items.iter().map(scalar).collect(),
        other => scalar(other).map(|s| vec![s]),
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

/// The closest long flag of `sub` to `name` (edit distance at most a third of its length, ≥ 2).
fn closest(sub: &clap::Command, name: &str) -> Option<String> {
    let budget = (name.len() / 3).max(2);
    sub.get_arguments()
        .flat_map(|a| names(a).into_iter().map(move |n| (n, a.get_long())))
        .map(|(n, long)| (edit_distance(name, &n), long.unwrap_or(&n).to_owned()))
        .filter(|(d, _)| *d <= budget)
        .min()
        .map(|(_, c)| format!("--{c}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(list: &[&str]) -> Vec<String> {
        std::iter::once("miles")
            .chain(list.iter().copied())
            .map(str::to_owned)
            .collect()
    }

    fn config(text: &str) -> std::path::PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "miles-argv-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn not_applicable_flags_are_taken_out_with_their_values() {
        let e = expand(argv(&[
            "--log-level",
            "debug",
            "train",
            "--colocate",
            "--actor-num-nodes",
            "1",
            "--lr",
            "1e-5",
            "--tensor-model-parallel-size=2",
            "--colocate",
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-enable-dp-attention",
            "--n-samples-per-prompt",
            "8",
        ]))
        .unwrap();
        assert_eq!(
            e.argv,
            argv(&[
                "--log-level",
                "debug",
                "train",
                "--lr",
                "1e-5",
                "--sglang-mem-fraction-static",
                "0.7",
                "--n-samples-per-prompt",
                "8"
            ])
        );
        // The KV pool's memory share is read (the embedded engine's); SGLang's other
        // arguments are ignored.
        assert_eq!(
            e.ignored,
            [
                "--colocate",
                "--actor-num-nodes",
                "--tensor-model-parallel-size",
                "--sglang-enable-dp-attention",
            ]
        );
        // Other subcommands are left alone: clap rejects the flag.
        let e = expand(argv(&["serve", "--colocate"])).unwrap();
        assert_eq!(e.argv, argv(&["serve", "--colocate"]));
        assert!(e.ignored.is_empty());
    }

    #[test]
    fn config_keys_go_under_the_command_line() {
        let path = config(
            "hf_checkpoint = \"m\"\nlr = 2e-5\nuse-kl-loss = true\nuse-tis = false\nengine-url = [\"a\", \"b\"]\neval-prompt-data = [\"x\", \"x.jsonl\"]\napply-chat-template-kwargs = { enable_thinking = false }\ncolocate = true\n",
        );
        let p = path.to_str().unwrap().to_owned();
        let e = expand(argv(&["train", "--config", &p, "--lr", "1e-3"])).unwrap();
        assert_eq!(
            e.argv,
            argv(&[
                "train",
                "--apply-chat-template-kwargs={\"enable_thinking\":false}",
                "--engine-url",
                "a",
                "--engine-url",
                "b",
                "--eval-prompt-data",
                "x",
                "--eval-prompt-data",
                "x.jsonl",
                "--hf-checkpoint=m",
                "--use-kl-loss",
                "--config",
                &p,
                "--lr",
                "1e-3",
            ])
        );
        assert_eq!(e.ignored, ["--colocate"]);
        let bad = config("lrr = 1\n");
        let err = expand(argv(&["train", &format!("--config={}", bad.display())]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("did you mean --lr?"), "{err}");
        let bad = config("use-kl-loss = \"yes\"\n");
        assert!(expand(argv(&["train", "--config", bad.to_str().unwrap()])).is_err());
        let bad = config("lr = [1\n");
        assert!(expand(argv(&["train", "--config", bad.to_str().unwrap()])).is_err());
        assert!(expand(argv(&["train", "--config", "/nonexistent/miles.toml"])).is_err());
        assert!(expand(argv(&["train", "--config"])).is_err());
    }

    #[test]
    fn edit_distances() {
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
