//! Parquet prompt datasets through the `parquet` crate's record API: only the columns the keys
//! name are decoded, each row becomes a JSON object (structs → objects, lists → arrays), as
//! pyarrow's `to_pylist()` gives Miles.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::Arc;

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use parquet::schema::types::Type;
use serde_json::{Map, Number, Value};

use super::read::{Flow, RowSink, key_columns};
use crate::error::{Error, Result, RowErrorKind};

/// Deepest nesting converted.
const MAX_DEPTH: usize = 128;

fn file_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::DatasetFile {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads every row of a Parquet file into `sink`. A file the decoder cannot read (bad magic, a
/// truncated footer, a corrupt page, and, as a last resort, a panic inside the decoder) is an
/// [`Error::DatasetFile`].
pub(super) fn read_parquet(path: &Path, sink: &mut RowSink<'_>) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    match catch_unwind(AssertUnwindSafe(|| read_rows(path, file, sink))) {
        Ok(result) => result,
        Err(_) => Err(file_error(
            path,
            "the Parquet decoder failed on this file (corrupt data)",
        )),
    }
}

fn read_rows(path: &Path, file: std::fs::File, sink: &mut RowSink<'_>) -> Result<()> {
    let reader = SerializedFileReader::new(file)
        .map_err(|e| file_error(path, format!("not a readable Parquet file: {e}")))?;
    let metadata = reader.metadata();
    let root = metadata.file_metadata().schema();

    // The top-level columns the keys read: a key itself, or the first segment of a dotted key.
    let keys = &sink.options().keys;
    let mut wanted: Vec<&str> = Vec::new();
    let key_list = [
        Some(keys.input_key.as_str()),
        keys.label_key.as_deref(),
        Some(keys.metadata_key.as_str()),
        Some(keys.tool_key.as_str()),
    ];
    for key in key_list.into_iter().flatten() {
        wanted.extend(key_columns(key));
    }
    let fields: Vec<Arc<Type>> = root
        .get_fields()
        .iter()
        .filter(|f| wanted.contains(&f.name()))
        .cloned()
        .collect();
    for field in &fields {
        check_schema(path, field, 0)?;
    }

    let total_rows: i64 = metadata.row_groups().iter().map(|g| g.num_rows()).sum();
    if fields.is_empty() {
        // None of the key columns exist: every row is an empty object (the record reader cannot
        // project onto no columns).
        for row in 1..=usize::try_from(total_rows.max(0)).unwrap_or(usize::MAX) {
            if sink.done() {
                break;
            }
            if let Flow::Stop = sink.object(row, Map::new())? {
                break;
            }
        }
        return Ok(());
    }
    let projection = Type::group_type_builder(root.name())
        .with_fields(fields)
        .build()
        .map_err(|e| file_error(path, format!("bad schema: {e}")))?;
    let rows = RowIter::from_file(Some(projection), &reader)
        .map_err(|e| file_error(path, format!("bad schema: {e}")))?;

    let limit = sink.options().max_row_bytes;
    for (index, row) in rows.enumerate() {
        if sink.done() {
            break;
        }
        let number = index + 1;
        let row = row.map_err(|e| file_error(path, format!("row {number}: {e}")))?;
        let flow = match row_to_object(&row, limit) {
            Ok(object) => sink.object(number, object)?,
            Err((key, kind)) => sink.bad(number, key, kind)?,
        };
        if let Flow::Stop = flow {
            break;
        }
    }
    Ok(())
}

/// Refuses schemas the record reader cannot handle (a group without fields) or nests too
/// deeply, before any row is read.
fn check_schema(path: &Path, field: &Type, depth: usize) -> Result<()> {
    if depth > MAX_DEPTH {
        return Err(file_error(
            path,
            format!("column {:?} nests deeper than {MAX_DEPTH}", field.name()),
        ));
    }
    if field.is_group() {
        if field.get_fields().is_empty() {
            return Err(file_error(
                path,
                format!("group {:?} has no fields", field.name()),
            ));
        }
        for child in field.get_fields() {
            check_schema(path, child, depth + 1)?;
        }
    }
    Ok(())
}

type RowFailure = (Option<String>, RowErrorKind);

/// A decoded row as a JSON object, refusing rows larger than `limit` bytes (string and byte
/// lengths plus 8 bytes per other value).
fn row_to_object(row: &Row, limit: usize) -> Result<Map<String, Value>, RowFailure> {
    let mut budget = Budget { used: 0, limit };
    let mut object = Map::new();
    for (name, field) in row.get_column_iter() {
        let value =
            field_to_value(field, 0, &mut budget).map_err(|kind| (Some(name.clone()), kind))?;
        object.insert(name.clone(), value);
    }
    Ok(object)
}

struct Budget {
    used: u64,
    limit: usize,
}

impl Budget {
    fn spend(&mut self, bytes: usize) -> Result<(), RowErrorKind> {
        self.used += bytes as u64 + 8;
        if self.used > self.limit as u64 {
            Err(RowErrorKind::Oversized {
                bytes: self.used,
                limit: self.limit,
            })
        } else {
            Ok(())
        }
    }
}

fn unsupported(what: &str) -> RowErrorKind {
    RowErrorKind::UnsupportedValue(what.into())
}

fn float(value: f64) -> Result<Value, RowErrorKind> {
    Number::from_f64(value)
        .map(Value::Number)
        .ok_or_else(|| unsupported("a non-finite float"))
}

fn field_to_value(field: &Field, depth: usize, budget: &mut Budget) -> Result<Value, RowErrorKind> {
    if depth > MAX_DEPTH {
        return Err(unsupported("nesting deeper than 128"));
    }
    let value = match field {
        Field::Null => {
            budget.spend(0)?;
            Value::Null
        }
        Field::Bool(b) => {
            budget.spend(0)?;
            Value::Bool(*b)
        }
        Field::Byte(v) => int(i64::from(*v), budget)?,
        Field::Short(v) => int(i64::from(*v), budget)?,
        Field::Int(v) => int(i64::from(*v), budget)?,
        Field::Long(v) => int(*v, budget)?,
        Field::UByte(v) => int(i64::from(*v), budget)?,
        Field::UShort(v) => int(i64::from(*v), budget)?,
        Field::UInt(v) => int(i64::from(*v), budget)?,
        Field::ULong(v) => {
            budget.spend(0)?;
            Value::Number(Number::from(*v))
        }
        Field::Float16(v) => {
            budget.spend(0)?;
            float(f64::from(*v))?
        }
        Field::Float(v) => {
            budget.spend(0)?;
            float(f64::from(*v))?
        }
        Field::Double(v) => {
            budget.spend(0)?;
            float(*v)?
        }
        Field::Str(s) => {
            budget.spend(s.len())?;
            Value::String(s.clone())
        }
        Field::Bytes(bytes) => {
            budget.spend(bytes.data().len())?;
            let text = std::str::from_utf8(bytes.data()).map_err(|_| RowErrorKind::NotUtf8)?;
            Value::String(text.to_owned())
        }
        Field::Group(row) => {
            budget.spend(0)?;
            let mut object = Map::new();
            for (name, child) in row.get_column_iter() {
                object.insert(name.clone(), field_to_value(child, depth + 1, budget)?);
            }
            Value::Object(object)
        }
        Field::ListInternal(list) => {
            budget.spend(0)?;
            let mut items = Vec::with_capacity(list.len());
            for element in list.elements() {
                items.push(field_to_value(element, depth + 1, budget)?);
            }
            Value::Array(items)
        }
        Field::MapInternal(map) => {
            budget.spend(0)?;
            let mut object = Map::new();
            for (key, value) in map.entries() {
                let key = match key {
                    Field::Str(s) => s.clone(),
                    Field::Bytes(b) => std::str::from_utf8(b.data())
                        .map_err(|_| RowErrorKind::NotUtf8)?
                        .to_owned(),
                    _ => return Err(unsupported("a map with non-string keys")),
                };
                budget.spend(key.len())?;
                object.insert(key, field_to_value(value, depth + 1, budget)?);
            }
            Value::Object(object)
        }
        Field::Decimal(_) => return Err(unsupported("a decimal")),
        Field::Date(_) => return Err(unsupported("a date")),
        Field::TimeMillis(_) | Field::TimeMicros(_) => return Err(unsupported("a time of day")),
        Field::TimestampMillis(_) | Field::TimestampMicros(_) => {
            return Err(unsupported("a timestamp"));
        }
    };
    Ok(value)
}

fn int(value: i64, budget: &mut Budget) -> Result<Value, RowErrorKind> {
    budget.spend(0)?;
    Ok(Value::Number(Number::from(value)))
}
