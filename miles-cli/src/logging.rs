//! The log output of `miles`: a `tracing` subscriber on stderr, filtered by `--log-level` or
//! `RUST_LOG` (default: warnings from every crate, `info` from miles-cli itself), as
//! human-readable lines or one JSON object a line (`--log-format json`). While a progress bar
//! is drawn, each line is written with the bar suspended, so neither garbles the other.

use std::io::Write;
use std::sync::{Mutex, PoisonError};

use indicatif::ProgressBar;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use crate::args::LogFormat;

/// The filter when neither `--log-level` nor `RUST_LOG` is given: warnings, the CLI's own
/// progress lines, the embedded engine's one start-up line (its KV pool's size and which
/// bound set it), and the engine router's rotation changes (an `--engine-url` server removed,
/// still unavailable at a health check, re-admitted).
pub const DEFAULT_FILTER: &str =
    "warn,miles_cli=info,miles_engine=info,miles_session::sglang::router=info";

/// The progress bar on screen, if any (log lines suspend it while they are written).
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Log lines suspend `bar` while it is drawn (until [`clear_progress_bar`]).
pub fn set_progress_bar(bar: ProgressBar) {
    *BAR.lock().unwrap_or_else(PoisonError::into_inner) = Some(bar);
}

/// Log lines no longer wait for a progress bar.
pub fn clear_progress_bar() {
    *BAR.lock().unwrap_or_else(PoisonError::into_inner) = None;
}

/// Writes each log line to stderr, with the progress bar (if any) suspended.
#[derive(Debug, Clone, Copy, Default)]
pub struct StderrBelowBar;

impl Write for StderrBelowBar {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let bar = BAR.lock().unwrap_or_else(PoisonError::into_inner).clone();
        match bar {
            Some(bar) if !bar.is_hidden() => {
                bar.suspend(|| std::io::stderr().lock().write_all(buf))?
            }
            _ => std::io::stderr().lock().write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for StderrBelowBar {
    type Writer = StderrBelowBar;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// The filter of `--log-level` (an env-filter directive), else `RUST_LOG`, else
/// [`DEFAULT_FILTER`].
pub fn filter(level: Option<&str>) -> Result<EnvFilter, String> {
    match level {
        Some(directive) => {
            EnvFilter::try_new(directive).map_err(|e| format!("--log-level {directive:?}: {e}"))
        }
        None => match std::env::var("RUST_LOG") {
            Ok(directive) if !directive.trim().is_empty() => {
                EnvFilter::try_new(&directive).map_err(|e| format!("RUST_LOG={directive:?}: {e}"))
            }
            _ => Ok(EnvFilter::new(DEFAULT_FILTER)),
        },
    }
}

/// Installs the process's subscriber. Fails on a bad filter; a second call does nothing.
pub fn install(level: Option<&str>, format: LogFormat) -> Result<(), String> {
    let filter = filter(level)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(StderrBelowBar);
    let result = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
    // Already installed (a second `run` in one process, as in tests): keep the first.
    let _ = result;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_from_the_flag_or_the_default() {
        assert!(filter(Some("debug")).is_ok());
        assert!(filter(Some("miles_session=debug,info")).is_ok());
        let err = filter(Some("miles_session=loud")).unwrap_err();
        assert!(err.contains("--log-level"), "{err}");
    }
}
