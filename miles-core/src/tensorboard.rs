//! TensorBoard event files, written (and read back) without TensorFlow, torch or protobuf.
//!
//! A TensorBoard log directory holds files named `events.out.tfevents.<secs>.<hostname>…`.
//! Each is a sequence of TFRecords:
//!
//! ```text
//! u64 length (LE) | u32 masked CRC32C(length bytes) | data | u32 masked CRC32C(data)
//! ```
//!
//! with `mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8`. Each record's data is a
//! protobuf `tensorflow.Event`; the first carries `file_version: "brain.Event:2"`, the others a
//! `Summary` of scalar `Summary.Value { tag, simple_value }` with the step and wall time.
//! [`TensorBoardSink`] writes such files; [`read_event_file`] decodes them (both CRCs
//! checked), which is what the format tests and any tool inspecting a run can use.
//!
//! ```
//! use miles_core::{Metrics, MetricsSink, tensorboard::{TensorBoardSink, read_event_file}};
//!
//! let dir = std::env::temp_dir().join(format!("miles-tb-doc-{}", std::process::id()));
//! let sink = TensorBoardSink::create(&dir)?;
//! sink.log(3, &Metrics::from([("train/pg_loss".to_string(), 0.25)]))?;
//! let events = read_event_file(sink.path())?;
//! assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
//! assert_eq!(events[1].step, 3);
//! assert_eq!(events[1].scalars, [("train/pg_loss".to_string(), 0.25f32)]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok::<(), miles_core::Error>(())
//! ```

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use crate::metrics::{Metrics, MetricsSink};

/// The `file_version` of the first event of every file (what TensorBoard expects).
pub const FILE_VERSION: &str = "brain.Event:2";

/// Writes every logged metric as a TensorBoard scalar, under its own name as the tag
/// (`rollout/raw_reward`, `train/pg_loss`, `eval/<name>/...`), at the step given to
/// [`MetricsSink::log`].
///
/// * One event per `log` call holds all of that step's scalars, stamped with the wall time.
/// * Values are stored as `simple_value` (f32, as TensorBoard does): NaN and ±infinity are
///   written as such (TensorBoard shows them as non-finite points), and finite values beyond
///   f32's range become ±infinity.
/// * The file is flushed after each `log`, so a live TensorBoard sees every step, and a
///   crashed run keeps what it logged.
/// * Each sink writes a new file in the directory, never touching existing ones; TensorBoard
///   reads every event file of a directory in name (time) order, so resuming a run with
///   [`TensorBoardSink::append`] continues the same curves (and TensorBoard drops points a
///   resumed run overwrites, since it purges steps that go backwards).
pub struct TensorBoardSink {
    dir: PathBuf,
    path: PathBuf,
    writer: Mutex<BufWriter<File>>,
}

/// Distinguishes files created by one process within the same second.
static FILE_COUNTER: AtomicU64 = AtomicU64::new(0);

impl TensorBoardSink {
    /// Creates `dir` (and its parents) if needed and starts a new event file in it,
    /// named `events.out.tfevents.<unix secs>.<hostname>.<pid>.<n>`.
    pub fn create(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let host = hostname();
        let pid = std::process::id();
        let (path, file) = loop {
            let n = FILE_COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = dir.join(format!("events.out.tfevents.{secs}.{host}.{pid}.{n}"));
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io(path, e)),
            }
        };
        let sink = Self {
            dir: dir.to_path_buf(),
            path,
            writer: Mutex::new(BufWriter::new(file)),
        };
        sink.write_event(&encode_event(wall_time(), 0, Some(FILE_VERSION), &[]))?;
        Ok(sink)
    }

    /// Resumes logging into `dir`: the same as [`TensorBoardSink::create`] (a new file beside
    /// the earlier ones, which TensorBoard reads together), named so for symmetry with
    /// [`crate::JsonlMetricsSink::append`].
    pub fn append(dir: impl AsRef<Path>) -> Result<Self> {
        Self::create(dir)
    }

    /// The log directory (what `tensorboard --logdir` is pointed at).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The event file this sink writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_event(&self, event: &[u8]) -> Result<()> {
        let record = encode_record(event);
        let mut writer = self
            .writer
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?;
        writer
            .write_all(&record)
            .and_then(|()| writer.flush())
            .map_err(|e| Error::io(&self.path, e))
    }
}

impl MetricsSink for TensorBoardSink {
    fn log(&self, step: u64, metrics: &Metrics) -> Result<()> {
        if metrics.is_empty() {
            return Ok(());
        }
        let scalars: Vec<(&str, f32)> = metrics
            .iter()
            .map(|(name, value)| (name.as_str(), *value as f32))
            .collect();
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.write_event(&encode_event(wall_time(), step, None, &scalars))
    }

    fn flush(&self) -> Result<()> {
        self.writer
            .lock()
            .map_err(|_| Error::Metrics("sink lock poisoned".into()))?
            .flush()
            .map_err(|e| Error::io(&self.path, e))
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The machine's host name (Linux: `/proc/sys/kernel/hostname`; else `$HOSTNAME`), reduced
/// to characters safe in a file name; `localhost` when unknown.
fn hostname() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let clean: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

// ---------------------------------------------------------------------------------------
// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) and TFRecord framing.

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
}

static CRC32C_TABLE: [u32; 256] = crc32c_table();

/// CRC-32C (Castagnoli) of `data`, as used by TFRecord (`crc32c(b"123456789") == 0xE3069283`).
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc = CRC32C_TABLE[((crc ^ u32::from(byte)) & 0xFF) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: `((crc >> 15) | (crc << 17)) + 0xa282ead8` (wrapping).
pub fn masked_crc32c(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Frames `data` as one TFRecord: length, masked CRC of the length, data, masked CRC of it.
pub fn encode_record(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 16);
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Splits a TFRecord stream into its records' data, checking both CRCs of every record.
/// A truncated or corrupt record is an error (naming its byte offset).
pub fn decode_records(bytes: &[u8]) -> Result<Vec<&[u8]>> {
    let corrupt = |at: usize, what: &str| Error::Metrics(format!("TFRecord at byte {at}: {what}"));
    let mut records = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| corrupt(at, "truncated header"))?;
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes) != u32::from_le_bytes(len_crc.try_into().unwrap_or_default()) {
            return Err(corrupt(at, "length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default());
        let len = usize::try_from(len).map_err(|_| corrupt(at, "length too large"))?;
        let start = at + 12;
        let end = start
            .checked_add(len)
            .filter(|end| end + 4 <= bytes.len())
            .ok_or_else(|| corrupt(at, "truncated data"))?;
        let data = &bytes[start..end];
        let crc = u32::from_le_bytes(bytes[end..end + 4].try_into().unwrap_or_default());
        if masked_crc32c(data) != crc {
            return Err(corrupt(at, "data CRC mismatch"));
        }
        records.push(data);
        at = end + 4;
    }
    Ok(records)
}

// ---------------------------------------------------------------------------------------
// The protobuf messages, by hand. Field numbers from tensorflow/core/util/event.proto and
// tensorflow/core/framework/summary.proto:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LEN: u8 = 2;
const WIRE_FIXED32: u8 = 5;

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_key(out: &mut Vec<u8>, field: u8, wire: u8) {
    out.push((field << 3) | wire);
}

fn put_bytes(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    put_key(out, field, WIRE_LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Encodes one `tensorflow.Event`: wall time, step, an optional `file_version` and the
/// scalars as a `Summary` of `simple_value`s (omitted when empty).
pub fn encode_event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut event = Vec::with_capacity(32 + scalars.len() * 32);
    put_key(&mut event, 1, WIRE_FIXED64);
    event.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        put_key(&mut event, 2, WIRE_VARINT);
        put_varint(&mut event, step as u64);
    }
    if let Some(version) = file_version {
        put_bytes(&mut event, 3, version.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        let mut value = Vec::new();
        for (tag, simple_value) in scalars {
            value.clear();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_key(&mut value, 2, WIRE_FIXED32);
            value.extend_from_slice(&simple_value.to_le_bytes());
            put_bytes(&mut summary, 1, &value);
        }
        put_bytes(&mut event, 5, &summary);
    }
    event
}

/// One decoded event: what [`TensorBoardSink`] writes.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorBoardEvent {
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
    /// The step.
    pub step: i64,
    /// `Some("brain.Event:2")` on a file's first event.
    pub file_version: Option<String>,
    /// `(tag, simple_value)` of each scalar in the event's summary, in order. Summary values
    /// of other kinds (images, tensors) are skipped.
    pub scalars: Vec<(String, f32)>,
}

struct ProtoReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ProtoReader<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    fn error(&self, what: &str) -> Error {
        Error::Metrics(format!("protobuf at byte {}: {what}", self.at))
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.bytes.get(self.at).ok_or_else(|| self.error("eof"))?;
            self.at += 1;
            value |= u64::from(byte & 0x7F) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(self.error("varint too long"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| self.error("truncated field"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    /// The next `(field, wire type)`, or `None` at the end.
    fn key(&mut self) -> Result<Option<(u64, u8)>> {
        if self.at >= self.bytes.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        Ok(Some((key >> 3, (key & 7) as u8)))
    }

    fn len_delimited(&mut self) -> Result<&'a [u8]> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| self.error("length too large"))?;
        self.take(n)
    }

    fn skip(&mut self, wire: u8) -> Result<()> {
        match wire {
            WIRE_VARINT => self.varint().map(drop),
            WIRE_FIXED64 => self.take(8).map(drop),
            WIRE_LEN => self.len_delimited().map(drop),
            WIRE_FIXED32 => self.take(4).map(drop),
            _ => Err(self.error("unsupported wire type")),
        }
    }
}

fn utf8(bytes: &[u8]) -> Result<String> {
    String::from_utf8(bytes.to_vec()).map_err(|_| Error::Metrics("tag is not UTF-8".into()))
}

/// Decodes one `tensorflow.Event` (the fields [`TensorBoardEvent`] has; others skipped).
pub fn decode_event(bytes: &[u8]) -> Result<TensorBoardEvent> {
    let mut event = TensorBoardEvent {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        scalars: Vec::new(),
    };
    let mut reader = ProtoReader::new(bytes);
    while let Some((field, wire)) = reader.key()? {
        match (field, wire) {
            (1, WIRE_FIXED64) => {
                event.wall_time = f64::from_le_bytes(reader.take(8)?.try_into().unwrap_or_default())
            }
            (2, WIRE_VARINT) => event.step = reader.varint()? as i64,
            (3, WIRE_LEN) => event.file_version = Some(utf8(reader.len_delimited()?)?),
            (5, WIRE_LEN) => {
                let mut summary = ProtoReader::new(reader.len_delimited()?);
                while let Some((field, wire)) = summary.key()? {
                    if (field, wire) != (1, WIRE_LEN) {
                        summary.skip(wire)?;
                        continue;
                    }
                    let mut value = ProtoReader::new(summary.len_delimited()?);
                    let (mut tag, mut simple) = (None, None);
                    while let Some((field, wire)) = value.key()? {
                        match (field, wire) {
                            (1, WIRE_LEN) => tag = Some(utf8(value.len_delimited()?)?),
                            (2, WIRE_FIXED32) => {
                                simple = Some(f32::from_le_bytes(
                                    value.take(4)?.try_into().unwrap_or_default(),
                                ))
                            }
                            (_, wire) => value.skip(wire)?,
                        }
                    }
                    if let (Some(tag), Some(simple)) = (tag, simple) {
                        event.scalars.push((tag, simple));
                    }
                }
            }
            (_, wire) => reader.skip(wire)?,
        }
    }
    Ok(event)
}

/// Reads and decodes every event of one event file (both CRCs of each record checked).
pub fn read_event_file(path: impl AsRef<Path>) -> Result<Vec<TensorBoardEvent>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    decode_records(&bytes)?
        .into_iter()
        .map(decode_event)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_known_vectors() {
        // RFC 3720 B.4 and the common check value.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn masked_crc_matches_tensorboards_own() {
        // Values from tensorboard.compat.tensorflow_stub.pywrap_tensorflow.masked_crc32c.
        assert_eq!(masked_crc32c(&24u64.to_le_bytes()), 0x224b_7fa3);
        assert_eq!(masked_crc32c(b"brain.Event:2"), 0x7c06_01ee);
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
    }

    #[test]
    fn records_round_trip_and_corruption_is_caught() {
        let mut stream = encode_record(b"hello");
        stream.extend(encode_record(b""));
        stream.extend(encode_record(&[7u8; 300]));
        let records = decode_records(&stream).unwrap();
        assert_eq!(records, [&b"hello"[..], &b""[..], &[7u8; 300][..]]);
        let mut bad = stream.clone();
        bad[13] ^= 1; // a data byte of the first record
        assert!(
            decode_records(&bad)
                .unwrap_err()
                .to_string()
                .contains("data CRC")
        );
        let mut bad = stream.clone();
        bad[0] ^= 1; // its length
        assert!(
            decode_records(&bad)
                .unwrap_err()
                .to_string()
                .contains("length CRC")
        );
        assert!(decode_records(&stream[..stream.len() - 1]).is_err());
    }

    #[test]
    fn event_encoding_round_trips() {
        let bytes = encode_event(
            1.5,
            300,
            None,
            &[("train/pg_loss", 0.25), ("eval/gsm8k/acc", f32::NAN)],
        );
        let event = decode_event(&bytes).unwrap();
        assert_eq!(event.wall_time, 1.5);
        assert_eq!(event.step, 300);
        assert_eq!(event.file_version, None);
        assert_eq!(event.scalars[0], ("train/pg_loss".to_string(), 0.25));
        assert_eq!(event.scalars[1].0, "eval/gsm8k/acc");
        assert!(event.scalars[1].1.is_nan());
        // The exact bytes of a version event (fields 1 and 3).
        let version = encode_event(0.0, 0, Some(FILE_VERSION), &[]);
        let mut expected = vec![0x09];
        expected.extend_from_slice(&0f64.to_le_bytes());
        expected.extend_from_slice(&[0x1a, 13]);
        expected.extend_from_slice(b"brain.Event:2");
        assert_eq!(version, expected);
    }

    #[test]
    fn sink_writes_a_readable_file_per_sink() {
        let dir = std::env::temp_dir().join(format!("miles-core-tb-{}", std::process::id()));
        let sink = TensorBoardSink::create(&dir).unwrap();
        let mut m = Metrics::new();
        m.insert("rollout/raw_reward".into(), 0.5);
        m.insert("train/grad_norm".into(), f64::INFINITY);
        m.insert("perf/step_time".into(), 1e300);
        sink.log(1, &m).unwrap();
        sink.log(2, &Metrics::new()).unwrap(); // nothing to write
        sink.log(u64::MAX, &Metrics::from([("x".to_string(), -2.0)]))
            .unwrap();
        // Flushed per log: readable while the sink is still open.
        let events = read_event_file(sink.path()).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
        assert_eq!(events[1].step, 1);
        assert_eq!(
            events[1].scalars,
            [
                ("perf/step_time".to_string(), f32::INFINITY),
                ("rollout/raw_reward".to_string(), 0.5),
                ("train/grad_norm".to_string(), f32::INFINITY),
            ]
        );
        assert_eq!(events[2].step, i64::MAX);
        assert!(events[1].wall_time > 1.6e9);
        let name = sink
            .path()
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let resumed = TensorBoardSink::append(&dir).unwrap();
        assert_ne!(resumed.path(), sink.path());
        assert_eq!(resumed.dir(), sink.dir());
        assert_eq!(read_event_file(sink.path()).unwrap().len(), 3);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
