//! Prompt datasets as Miles reads them: JSONL and Parquet (snappy / zstd / gzip, nested
//! message lists and structs) give the records Miles' own `Dataset` gives
//! (`fixtures/data/*.expected.json`, written by `gen_data_fixtures.py` running Miles' code);
//! bad rows are typed errors naming file, row and key, or are skipped and counted; corrupt
//! files are typed errors, never panics.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use miles_core::Prompt;
use miles_rollout::{
    DatasetKeys, DatasetOptions, PromptDataPath, PromptRecord, REPORTED_BAD_ROWS, RowRange,
    load_dataset, parse_jsonl,
};
use miles_rollout::{Error, RowError, RowErrorKind};
use proptest::prelude::*;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/data")
        .join(name)
}

/// A fresh file under the target's scratch directory.
fn scratch(name: &str, bytes: &[u8]) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "data_formats_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn load(path: &Path, options: &DatasetOptions) -> miles_rollout::Result<Vec<PromptRecord>> {
    load_dataset(&PromptDataPath::from(path), options).map(|d| d.records)
}

fn row_error(result: miles_rollout::Result<impl std::fmt::Debug>) -> RowError {
    match result {
        Err(Error::DatasetRow(e)) => *e,
        other => panic!("expected a row error, got {other:?}"),
    }
}

/// The keys and records of an `*.expected.json` written from Miles' `Dataset`.
fn expected(stem: &str) -> (DatasetKeys, Vec<Value>) {
    let text = std::fs::read_to_string(fixture(&format!("{stem}.expected.json"))).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let key = |k: &str| v["keys"][k].as_str().unwrap().to_owned();
    let keys = DatasetKeys {
        input_key: key("prompt_key"),
        label_key: Some(key("label_key")),
        metadata_key: key("metadata_key"),
        tool_key: key("tool_key"),
    };
    (keys, v["records"].as_array().unwrap().clone())
}

/// Asserts our records equal Miles' samples: the same prompt (text, or the same messages), the
/// label as text (a non-string label as its JSON text), the same metadata (tools included).
fn assert_matches_miles(file: &str, ours: &[PromptRecord], miles: &[Value]) {
    assert_eq!(ours.len(), miles.len(), "{file}: row count");
    for (i, (record, sample)) in ours.iter().zip(miles).enumerate() {
        match (&record.prompt, &sample["prompt"]) {
            (Prompt::Text(t), Value::String(s)) => assert_eq!(t, s, "{file} row {i}"),
            (Prompt::Messages(m), Value::Array(expected)) => {
                assert_eq!(
                    &serde_json::to_value(m).unwrap(),
                    &Value::Array(expected.clone()),
                    "{file} row {i}"
                );
            }
            (p, s) => panic!("{file} row {i}: prompt {p:?} vs Miles' {s}"),
        }
        let label = match &sample["label"] {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            other => Some(other.to_string()),
        };
        assert_eq!(record.label, label, "{file} row {i}: label");
        assert_eq!(
            Value::Object(record.metadata.clone()),
            sample["metadata"],
            "{file} row {i}: metadata"
        );
    }
}

#[test]
fn parquet_and_jsonl_give_mileses_records() {
    for (stem, files) in [
        (
            "dapo_math",
            &[
                "dapo_math.jsonl",
                "dapo_math.snappy.parquet",
                "dapo_math.zstd.parquet",
                "dapo_math.gzip.parquet",
            ][..],
        ),
        (
            "plain",
            &["plain.jsonl", "plain.snappy.parquet", "plain.zstd.parquet"][..],
        ),
    ] {
        let (keys, miles) = expected(stem);
        let options = DatasetOptions::with_keys(keys);
        let first = load(&fixture(files[0]), &options).unwrap();
        for file in files {
            let records = load(&fixture(file), &options).unwrap();
            assert_matches_miles(file, &records, &miles);
            assert_eq!(records, first, "{file} and {} differ", files[0]);
        }
    }
}

#[test]
fn message_lists_and_struct_values_decode() {
    let (keys, _) = expected("dapo_math");
    let records = load(
        &fixture("dapo_math.zstd.parquet"),
        &DatasetOptions::with_keys(keys),
    )
    .unwrap();
    let Prompt::Messages(messages) = &records[1].prompt else {
        panic!("expected messages")
    };
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0].role.as_str(), "system");
    assert_eq!(
        records[1].label.as_deref(),
        Some(r#"{"ground_truth":"4","style":"rule-lighteval/MATH_v2"}"#)
    );
    assert_eq!(records[2].metadata["split"], "train");
    let (plain_keys, _) = expected("plain");
    let plain = load(
        &fixture("plain.snappy.parquet"),
        &DatasetOptions::with_keys(plain_keys),
    )
    .unwrap();
    assert_eq!(plain[0].label.as_deref(), Some("5"));
    assert_eq!(plain[3].label.as_deref(), Some("-4"));
    assert_eq!(
        plain[0].metadata["tools"][0]["function"]["name"],
        "calculator"
    );
    assert_eq!(plain[2].metadata["tools"], serde_json::json!([]));
}

#[test]
fn dotted_label_key_reaches_into_structs() {
    let (mut keys, miles) = expected("dapo_math");
    keys.label_key = Some("reward_model.ground_truth".into());
    let options = DatasetOptions::with_keys(keys);
    for file in ["dapo_math.jsonl", "dapo_math.snappy.parquet"] {
        let labels: Vec<_> = load(&fixture(file), &options)
            .unwrap()
            .into_iter()
            .map(|r| r.label.unwrap())
            .collect();
        let expected: Vec<_> = miles
            .iter()
            .map(|s| s["label"]["ground_truth"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(labels, expected, "{file}");
    }
    // A column whose name has a dot is found as is, before any nested lookup.
    let text = r#"{"input": "q", "a.b": "flat", "a": {"b": "nested"}}"#;
    let keys = DatasetKeys {
        label_key: Some("a.b".into()),
        ..DatasetKeys::default()
    };
    assert_eq!(
        parse_jsonl(text, &keys).unwrap()[0].label.as_deref(),
        Some("flat")
    );
}

#[test]
fn row_slices_and_json_extension() {
    let (keys, miles) = expected("dapo_math");
    let options = DatasetOptions::with_keys(keys);
    for file in [
        "dapo_math.jsonl",
        "dapo_math.snappy.parquet",
        "dapo_math.zstd.parquet",
    ] {
        let spec = format!("{}@[1:3]", fixture(file).display());
        let source: PromptDataPath = spec.parse().unwrap();
        assert_eq!(
            source.rows,
            Some(RowRange {
                start: Some(1),
                end: Some(3)
            })
        );
        let records = load_dataset(&source, &options).unwrap().records;
        assert_matches_miles(file, &records, &miles[1..3]);
        let tail: PromptDataPath = format!("{}@[3:]", fixture(file).display()).parse().unwrap();
        assert_eq!(load_dataset(&tail, &options).unwrap().records.len(), 2);
    }
    assert!("x.jsonl@[-1:]".parse::<PromptDataPath>().is_err());
    assert_eq!(
        "dir@v2/x.jsonl".parse::<PromptDataPath>().unwrap().path,
        PathBuf::from("dir@v2/x.jsonl")
    );

    let text = std::fs::read(fixture("plain.jsonl")).unwrap();
    let (plain_keys, plain) = expected("plain");
    let json = scratch("plain.json", &text);
    let records = load(&json, &DatasetOptions::with_keys(plain_keys)).unwrap();
    assert_matches_miles("plain.json", &records, &plain);

    for name in ["plain.csv", "plain", "plain.jsonl.gz"] {
        let path = scratch(name, &text);
        let err = load(&path, &DatasetOptions::default()).unwrap_err();
        assert!(
            matches!(&err, Error::DatasetFile { path: p, .. } if *p == path),
            "{name}: {err}"
        );
    }
}

/// One bad line after a good line and a blank line (so the bad row is line 3).
fn bad_jsonl_cases() -> Vec<(&'static str, Vec<u8>, Option<&'static str>, RowErrorKind)> {
    let wrong = |expected, found| RowErrorKind::WrongType { expected, found };
    vec![
        (
            "missing input",
            br#"{"label": "1"}"#.to_vec(),
            Some("input"),
            RowErrorKind::MissingKey,
        ),
        (
            "null input",
            br#"{"input": null}"#.to_vec(),
            Some("input"),
            RowErrorKind::MissingKey,
        ),
        (
            "wrong input type",
            br#"{"input": 5}"#.to_vec(),
            Some("input"),
            wrong("a string or a list of messages", "a number"),
        ),
        (
            "invalid JSON",
            br#"{"input": "a""#.to_vec(),
            None,
            RowErrorKind::InvalidJson("EOF while parsing an object at line 1 column 13".into()),
        ),
        (
            "not an object",
            b"[1, 2]".to_vec(),
            None,
            RowErrorKind::NotAnObject,
        ),
        (
            "non-UTF-8",
            b"{\"input\": \"\xff\xfe\"}".to_vec(),
            None,
            RowErrorKind::NotUtf8,
        ),
        (
            "metadata wrong type",
            br#"{"input": "a", "metadata": [1]}"#.to_vec(),
            Some("metadata"),
            wrong("an object (or a JSON string of one)", "a list"),
        ),
        (
            "tools not a list",
            br#"{"input": "a", "tools": {"name": "f"}}"#.to_vec(),
            Some("tools"),
            wrong("a list of tools (or a JSON string of one)", "an object"),
        ),
        (
            "tools bad JSON string",
            br#"{"input": "a", "tools": "[{"}"#.to_vec(),
            Some("tools"),
            RowErrorKind::InvalidJson("EOF while parsing an object at line 1 column 2".into()),
        ),
    ]
}

#[test]
fn malformed_jsonl_rows_name_file_row_and_key() {
    for (case, line, key, kind) in bad_jsonl_cases() {
        let mut bytes = b"{\"input\": \"ok\", \"label\": \"1\"}\n\n".to_vec();
        bytes.extend_from_slice(&line);
        bytes.extend_from_slice(b"\n{\"input\": \"after\"}\n");
        let path = scratch("bad.jsonl", &bytes);
        let err = row_error(load(&path, &DatasetOptions::default()));
        assert_eq!(err.file, path, "{case}");
        assert_eq!(err.row, 3, "{case}");
        assert_eq!(err.key.as_deref(), key, "{case}");
        assert_eq!(err.kind, kind, "{case}");
        let text = err.to_string();
        assert!(
            text.contains("row 3") && text.contains("bad.jsonl"),
            "{text}"
        );
    }
}

#[test]
fn bad_roles_and_oversized_rows() {
    let line =
        br#"{"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}"#;
    let err = row_error(load(
        &scratch("roles.jsonl", line),
        &DatasetOptions::default(),
    ));
    assert_eq!((err.row, err.key.as_deref()), (1, Some("input")));
    assert!(
        matches!(&err.kind, RowErrorKind::BadMessage { index: 1, reason } if reason.contains("robot")),
        "{err}"
    );
    let line = br#"{"input": ["hi"]}"#;
    let err = row_error(load(
        &scratch("roles.jsonl", line),
        &DatasetOptions::default(),
    ));
    assert!(
        matches!(err.kind, RowErrorKind::BadMessage { index: 0, .. }),
        "{err}"
    );

    // A 1000-byte line with a 100-byte bound: refused, the rest of the file still read.
    let mut bytes = format!("{{\"input\": \"{}\"}}\n", "x".repeat(986)).into_bytes();
    assert_eq!(bytes.len(), 1000);
    bytes.extend_from_slice(b"{\"input\": \"short\"}\n");
    let path = scratch("big.jsonl", &bytes);
    let options = DatasetOptions {
        max_row_bytes: 100,
        ..DatasetOptions::default()
    };
    let err = row_error(load(&path, &options));
    assert_eq!(err.row, 1);
    assert_eq!(
        err.kind,
        RowErrorKind::Oversized {
            bytes: 999,
            limit: 100
        }
    );
    let skipping = DatasetOptions {
        skip_bad_rows: true,
        ..options.clone()
    };
    let loaded = load_dataset(&PromptDataPath::from(path.as_path()), &skipping).unwrap();
    assert_eq!(loaded.records.len(), 1);
    assert_eq!(loaded.records[0].prompt, Prompt::Text("short".into()));
    assert_eq!(loaded.skipped.count, 1);

    // Parquet rows are bounded once decoded.
    let (keys, _) = expected("dapo_math");
    let options = DatasetOptions {
        keys,
        max_row_bytes: 100,
        ..DatasetOptions::default()
    };
    let err = row_error(load(&fixture("dapo_math.snappy.parquet"), &options));
    assert_eq!(err.row, 1);
    assert!(
        matches!(err.kind, RowErrorKind::Oversized { limit: 100, .. }),
        "{err}"
    );
}

#[test]
fn skip_mode_counts_bad_rows_and_keeps_the_first_reasons() {
    let cases = bad_jsonl_cases();
    let mut bytes = Vec::new();
    for (i, (_, line, _, _)) in cases.iter().enumerate() {
        bytes.extend_from_slice(format!("{{\"input\": \"good {i}\"}}\n").as_bytes());
        bytes.extend_from_slice(line);
        bytes.push(b'\n');
    }
    let path = scratch("mixed.jsonl", &bytes);
    let options = DatasetOptions {
        skip_bad_rows: true,
        ..DatasetOptions::default()
    };
    let loaded = load_dataset(&PromptDataPath::from(path.as_path()), &options).unwrap();
    let prompts: Vec<_> = loaded.records.iter().map(|r| r.prompt.clone()).collect();
    let expected: Vec<_> = (0..cases.len())
        .map(|i| Prompt::Text(format!("good {i}")))
        .collect();
    assert_eq!(prompts, expected);
    assert_eq!(loaded.skipped.count, cases.len());
    assert_eq!(loaded.skipped.first.len(), REPORTED_BAD_ROWS);
    let rows: Vec<_> = loaded.skipped.first.iter().map(|e| e.row).collect();
    assert_eq!(rows, vec![2, 4, 6, 8, 10]);
    assert_eq!(loaded.skipped.first[0].kind, RowErrorKind::MissingKey);
    let summary = loaded.skipped.to_string();
    assert!(summary.starts_with(&format!("{} bad row(s) skipped", cases.len())));
    assert!(summary.contains(&format!("and {} more", cases.len() - REPORTED_BAD_ROWS)));
}

#[test]
fn malformed_parquet_rows() {
    let options = DatasetOptions::default();
    let path = fixture("bad_rows.parquet");
    let err = row_error(load(&path, &options));
    assert_eq!((err.file.clone(), err.row), (path.clone(), 2));
    assert_eq!(err.key.as_deref(), Some("input"));
    assert!(
        matches!(&err.kind, RowErrorKind::BadMessage { index: 0, reason } if reason.contains("robot")),
        "{err}"
    );

    let skipping = DatasetOptions {
        skip_bad_rows: true,
        ..DatasetOptions::default()
    };
    let loaded = load_dataset(&PromptDataPath::from(path.as_path()), &skipping).unwrap();
    let labels: Vec<_> = loaded
        .records
        .iter()
        .map(|r| r.label.clone().unwrap())
        .collect();
    assert_eq!(labels, ["1", "4"]);
    assert_eq!(loaded.skipped.count, 2);
    assert_eq!(loaded.skipped.first[1].row, 3);
    assert_eq!(loaded.skipped.first[1].kind, RowErrorKind::MissingKey);

    let err = row_error(load(&fixture("bad_types.parquet"), &options));
    assert_eq!((err.row, err.key.as_deref()), (1, Some("input")));
    assert_eq!(
        err.kind,
        RowErrorKind::WrongType {
            expected: "a string or a list of messages",
            found: "a number"
        }
    );

    // No input column at all: every row misses the key.
    let keys = DatasetKeys {
        input_key: "question".into(),
        label_key: None,
        ..DatasetKeys::default()
    };
    let err = row_error(load(&path, &DatasetOptions::with_keys(keys.clone())));
    assert_eq!((err.row, err.kind), (1, RowErrorKind::MissingKey));
    let loaded = load_dataset(
        &PromptDataPath::from(path.as_path()),
        &DatasetOptions {
            keys,
            skip_bad_rows: true,
            ..DatasetOptions::default()
        },
    )
    .unwrap();
    assert_eq!((loaded.records.len(), loaded.skipped.count), (0, 4));
}

#[test]
fn corrupt_parquet_files_are_typed_errors() {
    let bytes = std::fs::read(fixture("dapo_math.snappy.parquet")).unwrap();
    let (keys, _) = expected("dapo_math");
    let options = DatasetOptions::with_keys(keys);
    let mut zeroed_pages = bytes.clone();
    zeroed_pages[4..bytes.len() / 2].fill(0);
    let mut bad_magic = bytes.clone();
    bad_magic[bytes.len() - 1] = b'X';
    let mut huge_footer = bytes.clone();
    let n = bytes.len();
    huge_footer[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("magic only", b"PAR1".to_vec()),
        ("truncated half", bytes[..n / 2].to_vec()),
        ("truncated tail", bytes[..n - 3].to_vec()),
        ("no head", bytes[n / 2..].to_vec()),
        ("zeroed pages", zeroed_pages),
        ("bad magic", bad_magic),
        ("huge footer length", huge_footer),
        (
            "jsonl renamed",
            std::fs::read(fixture("dapo_math.jsonl")).unwrap(),
        ),
    ];
    for (case, data) in cases {
        let path = scratch("corrupt.parquet", &data);
        match load(&path, &options) {
            Err(Error::DatasetFile { path: p, reason }) => {
                assert_eq!(p, path, "{case}");
                assert!(!reason.is_empty());
            }
            other => panic!("{case}: expected a file error, got {other:?}"),
        }
    }
}

#[test]
fn cli_flags() {
    let mut options = DatasetOptions::default();
    let mut args = [
        "--input-key",
        "prompt",
        "--label-key",
        "reward_model.ground_truth",
        "--skip-bad-rows",
        "--max-row-bytes",
        "1024",
        "--tool-key",
        "tools_json",
        "--metadata-key",
        "extra_info",
        "--rollout-shuffle",
    ]
    .into_iter()
    .map(String::from);
    let mut unknown = Vec::new();
    while let Some(flag) = args.next() {
        if !options.apply_flag(&flag, &mut args).unwrap() {
            unknown.push(flag);
        }
    }
    assert_eq!(unknown, ["--rollout-shuffle"]);
    assert_eq!(
        options,
        DatasetOptions {
            keys: DatasetKeys {
                input_key: "prompt".into(),
                label_key: Some("reward_model.ground_truth".into()),
                metadata_key: "extra_info".into(),
                tool_key: "tools_json".into(),
            },
            skip_bad_rows: true,
            max_row_bytes: 1024,
        }
    );
    let mut none = std::iter::empty();
    assert!(options.apply_flag("--input-key", &mut none).is_err());
    let mut zero = std::iter::once("0".to_string());
    assert!(options.apply_flag("--max-row-bytes", &mut zero).is_err());
}

fn never_panics(name: &str, bytes: &[u8], skip_bad_rows: bool) {
    let path = scratch(name, bytes);
    let options = DatasetOptions {
        skip_bad_rows,
        max_row_bytes: 4096,
        ..DatasetOptions::default()
    };
    let result =
        std::panic::catch_unwind(|| load_dataset(&PromptDataPath::from(path.as_path()), &options));
    assert!(result.is_ok(), "{name}: a panic escaped");
    let _ = std::fs::remove_file(&path);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), skip in any::<bool>()) {
        never_panics("random.jsonl", &bytes, skip);
        never_panics("random.parquet", &bytes, skip);
        // With the magic at both ends the footer parser sees the random bytes.
        let mut framed = b"PAR1".to_vec();
        framed.extend_from_slice(&bytes);
        framed.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        framed.extend_from_slice(b"PAR1");
        never_panics("framed.parquet", &framed, skip);
    }

    #[test]
    fn mutated_parquet_never_panics(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        file in 0usize..3,
    ) {
        let name = ["dapo_math.snappy.parquet", "dapo_math.zstd.parquet", "plain.snappy.parquet"][file];
        let mut bytes = std::fs::read(fixture(name)).unwrap();
        for (at, value) in &edits {
            let i = at.index(bytes.len());
            bytes[i] = *value;
        }
        never_panics("mutated.parquet", &bytes, true);
    }
}
