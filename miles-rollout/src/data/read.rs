//! Reading prompt datasets as Miles' `--prompt-data` does: JSONL or Parquet, chosen by the file
//! extension, an optional `@[start:end]` row slice, every row turned into a [`PromptRecord`].

use std::fmt;
use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use miles_core::{Message, Prompt, Sample};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result, RowError, RowErrorKind};

/// Default bound on one row: 16 MiB.
pub const DEFAULT_MAX_ROW_BYTES: usize = 16 << 20;

/// How many skipped rows [`SkippedRows`] keeps the reason of.
pub const REPORTED_BAD_ROWS: usize = 5;

/// Which keys of a dataset row hold what (Miles' `--input-key`, `--label-key`,
/// `--metadata-key`, `--tool-key`). A dotted key also reaches into nested objects when no
/// column has that exact name (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DatasetKeys {
    /// The prompt: a string, or a list of chat messages.
    pub input_key: String,
    /// The reference answer (any JSON scalar; kept as text). `None`: no labels.
    pub label_key: Option<String>,
    /// An object merged into the sample's metadata.
    pub metadata_key: String,
    /// The tool list for the prompt, stored as `metadata["tools"]`.
    pub tool_key: String,
}

impl Default for DatasetKeys {
    fn default() -> Self {
        Self {
            input_key: "input".into(),
            label_key: Some("label".into()),
            metadata_key: "metadata".into(),
            tool_key: "tools".into(),
        }
    }
}

/// One prompt of a dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// Text or chat messages.
    pub prompt: Prompt,
    /// Reference answer.
    pub label: Option<String>,
    /// Metadata (including `tools` when the line had them).
    pub metadata: Map<String, Value>,
}

impl PromptRecord {
    /// A fresh sample of this prompt: its prompt, label and metadata, nothing generated.
    pub fn to_sample(&self) -> Sample {
        Sample {
            prompt: self.prompt.clone(),
            label: self.label.clone(),
            metadata: self.metadata.clone(),
            ..Sample::default()
        }
    }

    /// A text prompt with a label.
    pub fn text(prompt: impl Into<String>, label: impl Into<String>) -> Self {
        Self {
            prompt: Prompt::Text(prompt.into()),
            label: Some(label.into()),
            metadata: Map::new(),
        }
    }
}

/// How to read a prompt dataset: the keys, what to do with bad rows, the row bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DatasetOptions {
    /// Which keys hold prompt, label, metadata and tools.
    pub keys: DatasetKeys,
    /// Skip rows that cannot be used (and count them) instead of failing on the first
    /// (`--skip-bad-rows`).
    pub skip_bad_rows: bool,
    /// Largest row in bytes (`--max-row-bytes`): a JSONL line is refused before it is read into
    /// memory, a Parquet row once decoded.
    pub max_row_bytes: usize,
}

impl Default for DatasetOptions {
    fn default() -> Self {
        Self {
            keys: DatasetKeys::default(),
            skip_bad_rows: false,
            max_row_bytes: DEFAULT_MAX_ROW_BYTES,
        }
    }
}

impl DatasetOptions {
    /// Options with these keys, strict, and the default row bound.
    pub fn with_keys(keys: DatasetKeys) -> Self {
        Self {
            keys,
            ..Self::default()
        }
    }

    /// Applies one command-line flag if it is a dataset flag: `--input-key K`, `--label-key K`,
    /// `--metadata-key K`, `--tool-key K`, `--skip-bad-rows`, `--max-row-bytes N`. Values are
    /// taken from `rest`. Returns whether the flag was one of these.
    pub fn apply_flag(
        &mut self,
        flag: &str,
        rest: &mut impl Iterator<Item = String>,
    ) -> Result<bool> {
        let mut value = || {
            rest.next()
                .ok_or_else(|| Error::Config(format!("{flag} needs a value")))
        };
        match flag {
            "--input-key" => self.keys.input_key = value()?,
            "--label-key" => self.keys.label_key = Some(value()?),
            "--metadata-key" => self.keys.metadata_key = value()?,
            "--tool-key" => self.keys.tool_key = value()?,
            "--skip-bad-rows" => self.skip_bad_rows = true,
            "--max-row-bytes" => {
                let text = value()?;
                self.max_row_bytes =
                    text.parse::<usize>()
                        .ok()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| {
                            Error::Config(format!(
                                "--max-row-bytes: {text:?} is not a positive size"
                            ))
                        })?;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// The file formats of a prompt dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DatasetFormat {
    /// One JSON object per line (`.jsonl`, and `.json` read as JSON Lines).
    JsonLines,
    /// Apache Parquet (`.parquet`).
    Parquet,
}

impl DatasetFormat {
    /// The format of `path`, from its extension; anything else is an [`Error::DatasetFile`].
    pub fn from_path(path: &Path) -> Result<Self> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "json") => Ok(Self::JsonLines),
            Some("parquet") => Ok(Self::Parquet),
            _ => Err(Error::DatasetFile {
                path: path.to_path_buf(),
                reason: "unknown format: the extension must be .jsonl, .json (JSON Lines) or \
                         .parquet"
                    .into(),
            }),
        }
    }
}

/// Rows `start..end` of a dataset (Miles' `path@[start:end]`), counted over the rows that decode
/// to an object; either end may be open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RowRange {
    /// First row kept (0-based).
    pub start: Option<usize>,
    /// One past the last row kept.
    pub end: Option<usize>,
}

impl RowRange {
    fn contains(&self, index: usize) -> bool {
        self.start.is_none_or(|s| index >= s) && self.end.is_none_or(|e| index < e)
    }

    fn past_end(&self, index: usize) -> bool {
        self.end.is_some_and(|e| index >= e)
    }
}

/// A `--prompt-data` value: a path, optionally followed by `@[start:end]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptDataPath {
    /// The file.
    pub path: PathBuf,
    /// The rows to keep (all when `None`).
    pub rows: Option<RowRange>,
}

impl From<&Path> for PromptDataPath {
    fn from(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            rows: None,
        }
    }
}

impl FromStr for PromptDataPath {
    type Err = Error;

    /// Parses `path` or `path@[start:end]` (start and end optional, non-negative: Miles slices
    /// with `itertools.islice`, which refuses negative bounds).
    fn from_str(spec: &str) -> Result<Self> {
        let Some(body) = spec.strip_suffix(']') else {
            return Ok(Self {
                path: spec.into(),
                rows: None,
            });
        };
        let Some((path, range)) = body.rsplit_once("@[") else {
            return Ok(Self {
                path: spec.into(),
                rows: None,
            });
        };
        let Some((start, end)) = range.split_once(':') else {
            return Ok(Self {
                path: spec.into(),
                rows: None,
            });
        };
        let bound = |text: &str| -> Result<Option<usize>> {
            if text.is_empty() {
                return Ok(None);
            }
            text.parse::<usize>().map(Some).map_err(|_| {
                Error::Config(format!(
                    "prompt data {spec:?}: row bound {text:?} must be a non-negative integer"
                ))
            })
        };
        let looks_like_slice = |t: &str| t.chars().all(|c| c.is_ascii_digit() || c == '-');
        if !looks_like_slice(start) || !looks_like_slice(end) {
            return Ok(Self {
                path: spec.into(),
                rows: None,
            });
        }
        Ok(Self {
            path: path.into(),
            rows: Some(RowRange {
                start: bound(start)?,
                end: bound(end)?,
            }),
        })
    }
}

/// Rows skipped with [`DatasetOptions::skip_bad_rows`]: how many, and why the first few were.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SkippedRows {
    /// Rows skipped.
    pub count: usize,
    /// The first [`REPORTED_BAD_ROWS`] reasons.
    pub first: Vec<RowError>,
}

impl SkippedRows {
    fn push(&mut self, error: RowError) {
        self.count += 1;
        if self.first.len() < REPORTED_BAD_ROWS {
            tracing::warn!(%error, "skipping a bad dataset row");
            self.first.push(error);
        }
    }
}

impl fmt::Display for SkippedRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bad row(s) skipped", self.count)?;
        for error in &self.first {
            write!(f, "\n  {error}")?;
        }
        if self.count > self.first.len() {
            write!(f, "\n  … and {} more", self.count - self.first.len())?;
        }
        Ok(())
    }
}

/// A dataset read into memory.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadedDataset {
    /// The usable rows, in file order.
    pub records: Vec<PromptRecord>,
    /// The rows skipped (always empty unless [`DatasetOptions::skip_bad_rows`]).
    pub skipped: SkippedRows,
}

/// Collects rows, applying the row slice and the bad-row policy.
pub(super) struct RowSink<'a> {
    file: &'a Path,
    options: &'a DatasetOptions,
    rows: Option<RowRange>,
    decoded: usize,
    out: LoadedDataset,
}

/// What a reader should do next.
pub(super) enum Flow {
    Continue,
    Stop,
}

impl<'a> RowSink<'a> {
    pub(super) fn new(file: &'a Path, options: &'a DatasetOptions, rows: Option<RowRange>) -> Self {
        Self {
            file,
            options,
            rows,
            decoded: 0,
            out: LoadedDataset::default(),
        }
    }

    pub(super) fn options(&self) -> &DatasetOptions {
        self.options
    }

    fn error(&self, row: usize, key: Option<String>, kind: RowErrorKind) -> RowError {
        RowError {
            file: self.file.to_path_buf(),
            row,
            key,
            kind,
        }
    }

    /// A row that could not be decoded (it does not count towards the row slice).
    pub(super) fn bad(
        &mut self,
        row: usize,
        key: Option<String>,
        kind: RowErrorKind,
    ) -> Result<Flow> {
        let error = self.error(row, key, kind);
        if self.options.skip_bad_rows {
            self.out.skipped.push(error);
            Ok(Flow::Continue)
        } else {
            Err(Error::DatasetRow(Box::new(error)))
        }
    }

    /// A row decoded to an object.
    pub(super) fn object(&mut self, row: usize, object: Map<String, Value>) -> Result<Flow> {
        let index = self.decoded;
        self.decoded += 1;
        if let Some(range) = self.rows {
            if range.past_end(index) {
                return Ok(Flow::Stop);
            }
            if !range.contains(index) {
                return Ok(Flow::Continue);
            }
        }
        match record_from_object(object, &self.options.keys) {
            Ok(record) => {
                self.out.records.push(record);
                Ok(Flow::Continue)
            }
            Err((key, kind)) => self.bad(row, Some(key), kind),
        }
    }

    /// Whether the slice is exhausted (readers may stop before reading the next row).
    pub(super) fn done(&self) -> bool {
        self.rows.is_some_and(|r| r.past_end(self.decoded))
    }

    pub(super) fn finish(self) -> LoadedDataset {
        self.out
    }
}

pub(super) enum ReadError {
    Io(std::io::Error),
    Other(Error),
}

impl From<Error> for ReadError {
    fn from(e: Error) -> Self {
        Self::Other(e)
    }
}

/// Reads JSON Lines from `reader`: each line bounded by `max_row_bytes` before it is buffered,
/// UTF-8 checked, blank lines skipped (Miles strips each line and skips empty ones).
pub(super) fn read_json_lines(
    mut reader: impl BufRead,
    sink: &mut RowSink<'_>,
) -> Result<(), ReadError> {
    let limit = sink.options().max_row_bytes;
    let mut line = Vec::new();
    let mut row = 0usize;
    loop {
        if sink.done() {
            return Ok(());
        }
        line.clear();
        let read = reader
            .by_ref()
            .take(limit as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(ReadError::Io)?;
        if read == 0 {
            return Ok(());
        }
        row += 1;
        let ended = line.last() == Some(&b'\n');
        if ended {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        }
        if line.len() > limit {
            // Discard the rest of the line without keeping it.
            let mut seen = line.len() as u64;
            if !ended {
                seen += skip_line(&mut reader).map_err(ReadError::Io)?;
            }
            line.clear();
            line.shrink_to(1 << 16);
            if let Flow::Stop =
                sink.bad(row, None, RowErrorKind::Oversized { bytes: seen, limit })?
            {
                return Ok(());
            }
            continue;
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            sink.bad(row, None, RowErrorKind::NotUtf8)?;
            continue;
        };
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let flow = match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(object)) => sink.object(row, object)?,
            Ok(_) => sink.bad(row, None, RowErrorKind::NotAnObject)?,
            Err(e) => sink.bad(row, None, RowErrorKind::InvalidJson(e.to_string()))?,
        };
        if let Flow::Stop = flow {
            return Ok(());
        }
    }
}

/// Consumes bytes up to and including the next newline; returns how many were consumed.
fn skip_line(reader: &mut impl BufRead) -> std::io::Result<u64> {
    let mut skipped = 0u64;
    loop {
        let buffer = reader.fill_buf()?;
        if buffer.is_empty() {
            return Ok(skipped);
        }
        if let Some(at) = buffer.iter().position(|b| *b == b'\n') {
            reader.consume(at + 1);
            return Ok(skipped + at as u64);
        }
        let n = buffer.len();
        reader.consume(n);
        skipped += n as u64;
    }
}

/// The value of `key` in `object`: the key itself if present (as Miles looks it up), else, for a
/// dotted key such as `reward_model.ground_truth`, the path through nested objects.
fn lookup<'v>(object: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    if let Some(value) = object.get(key) {
        return Some(value);
    }
    if !key.contains('.') {
        return None;
    }
    let mut parts = key.split('.');
    let mut value = object.get(parts.next()?)?;
    for part in parts {
        value = value.as_object()?.get(part)?;
    }
    Some(value)
}

/// The top-level column a key reads (for Parquet projection): the key itself and, for a dotted
/// key, its first segment.
pub(super) fn key_columns(key: &str) -> impl Iterator<Item = &str> {
    let first = key.split('.').next().filter(|f| *f != key);
    std::iter::once(key).chain(first)
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Python truthiness of a JSON value (Miles' `data.get(metadata_key) or {}`).
fn is_falsy(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

type KeyedError = (String, RowErrorKind);

/// Builds a record from a decoded row object, as Miles' `Dataset` does (see the module docs of
/// [`crate::data`] for the differences).
pub(super) fn record_from_object(
    object: Map<String, Value>,
    keys: &DatasetKeys,
) -> Result<PromptRecord, KeyedError> {
    let at = |kind: RowErrorKind| (keys.input_key.clone(), kind);
    let prompt = match lookup(&object, &keys.input_key) {
        None | Some(Value::Null) => return Err(at(RowErrorKind::MissingKey)),
        Some(Value::String(text)) => Prompt::Text(text.clone()),
        Some(Value::Array(items)) => {
            let mut messages = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                if !item.is_object() {
                    return Err(at(RowErrorKind::BadMessage {
                        index,
                        reason: format!("expected an object, found {}", type_name(item)),
                    }));
                }
                let message = Message::deserialize(item).map_err(|e| {
                    at(RowErrorKind::BadMessage {
                        index,
                        reason: e.to_string(),
                    })
                })?;
                messages.push(message);
            }
            Prompt::Messages(messages)
        }
        Some(other) => {
            return Err(at(RowErrorKind::WrongType {
                expected: "a string or a list of messages",
                found: type_name(other),
            }));
        }
    };

    let label = match keys.label_key.as_deref().and_then(|k| lookup(&object, k)) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };

    let meta_err = |kind| (keys.metadata_key.clone(), kind);
    let mut metadata = match lookup(&object, &keys.metadata_key) {
        None => Map::new(),
        Some(v) if is_falsy(v) => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => map,
            Ok(other) => {
                return Err(meta_err(RowErrorKind::WrongType {
                    expected: "an object (or a JSON string of one)",
                    found: type_name(&other),
                }));
            }
            Err(e) => return Err(meta_err(RowErrorKind::InvalidJson(e.to_string()))),
        },
        Some(other) => {
            return Err(meta_err(RowErrorKind::WrongType {
                expected: "an object (or a JSON string of one)",
                found: type_name(other),
            }));
        }
    };

    let tool_err = |kind| (keys.tool_key.clone(), kind);
    let tools = match lookup(&object, &keys.tool_key) {
        None | Some(Value::Null) => None,
        Some(list @ Value::Array(_)) => Some(list.clone()),
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(list @ Value::Array(_)) => Some(list),
            Ok(other) => {
                return Err(tool_err(RowErrorKind::WrongType {
                    expected: "a list of tools (or a JSON string of one)",
                    found: type_name(&other),
                }));
            }
            Err(e) => return Err(tool_err(RowErrorKind::InvalidJson(e.to_string()))),
        },
        Some(other) => {
            return Err(tool_err(RowErrorKind::WrongType {
                expected: "a list of tools (or a JSON string of one)",
                found: type_name(other),
            }));
        }
    };
    if let Some(tools) = tools {
        metadata.insert("tools".into(), tools);
    }
    Ok(PromptRecord {
        prompt,
        label,
        metadata,
    })
}
