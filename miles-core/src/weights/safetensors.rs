//! The safetensors codec: [`NamedTensors`] to and from safetensors bytes and files, byte for
//! byte as the safetensors library writes them, and robust against untrusted files (the
//! header length is bounded before anything is allocated, every offset and size is checked
//! against the header and the file, and every failure is a typed error, never a panic).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use serde_json::Value;

use super::dtype::DType;
use super::named::NamedTensors;
use super::tensor::TensorBytes;
use crate::error::{Error, Result};

/// Largest safetensors JSON header accepted (the safetensors format's own limit: 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of a parsed header: where its bytes lie in the data section.
struct HeaderEntry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// A parsed safetensors header: metadata and the tensors in data order.
struct Header {
    metadata: BTreeMap<String, String>,
    entries: Vec<HeaderEntry>,
}

fn blob_error(reason: String) -> Error {
    Error::Tensor {
        name: String::new(),
        reason,
    }
}

/// The codec's `error` said of the file at `path` ([`Error::Safetensors`]; I/O errors pass
/// through).
pub(super) fn file_error(path: &Path, error: Error) -> Error {
    let reason = match error {
        Error::Tensor { name, reason } if name.is_empty() => reason,
        Error::Tensor { name, reason } => format!("tensor {name:?}: {reason}"),
        other => return other,
    };
    Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    }
}

/// The header length of a safetensors image of `total` bytes whose first bytes are
/// `prefix` (`None` when it has fewer than 8): at most [`MAX_HEADER_BYTES`] and within the
/// image.
fn header_length(prefix: Option<[u8; 8]>, total: u64) -> Result<u64> {
    let prefix =
        prefix.ok_or_else(|| blob_error(format!("an image of {total} bytes has no header")))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES || header_len > total.saturating_sub(8) {
        return Err(blob_error(format!(
            "header length {header_len} does not fit an image of {total} bytes"
        )));
    }
    Ok(header_len)
}

/// Parses the JSON header `header_bytes` of an image of `total` bytes:
/// each tensor's dtype, shape and offsets are checked (its size must be `numel × dtype
/// size`), and the tensors must tile the data section exactly, as the safetensors library
/// requires (no gap, no overlap, nothing after the last one).
fn parse_header(header_bytes: &[u8], total: u64) -> Result<Header> {
    let header: Value = serde_json::from_slice(header_bytes)
        .map_err(|e| blob_error(format!("header is not JSON: {e}")))?;
    let Value::Object(header) = header else {
        return Err(blob_error("header is not a JSON object".into()));
    };
    let mut metadata = BTreeMap::new();
    let mut entries = Vec::with_capacity(header.len());
    for (name, entry) in header {
        let tensor_error = |reason: String| Error::Tensor {
            name: name.clone(),
            reason,
        };
        if name == "__metadata__" {
            let Value::Object(meta) = entry else {
                return Err(tensor_error("metadata is not an object".into()));
            };
            for (k, v) in meta {
                let Value::String(v) = v else {
                    return Err(tensor_error(format!(
                        "metadata value {k:?} is not a string"
                    )));
                };
                metadata.insert(k, v);
            }
            continue;
        }
        let dtype_name = entry
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| tensor_error("missing dtype".into()))?;
        let dtype = DType::from_safetensors_name(dtype_name)
            .ok_or_else(|| tensor_error(format!("unknown dtype {dtype_name:?}")))?;
        let shape = entry
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| tensor_error("missing shape".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| tensor_error("shape is not a list of sizes".into()))?;
        let (start, end) = entry
            .get("data_offsets")
            .and_then(Value::as_array)
            .filter(|o| o.len() == 2)
            .and_then(|o| {
                let offset = |v: &Value| v.as_u64().and_then(|v| usize::try_from(v).ok());
                Some((offset(&o[0])?, offset(&o[1])?))
            })
            .ok_or_else(|| tensor_error("missing data_offsets".into()))?;
        if start > end {
            return Err(tensor_error(format!(
                "data_offsets {:?} out of order",
                (start, end)
            )));
        }
        let expected = shape
            .iter()
            .try_fold(dtype.size(), |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| tensor_error(format!("shape {shape:?} overflows")))?;
        if end - start != expected {
            return Err(tensor_error(format!(
                "{} bytes for {dtype:?} {shape:?}, expected {expected}",
                end - start
            )));
        }
        entries.push(HeaderEntry {
            name,
            dtype,
            shape,
            start,
            end,
        });
    }
    entries.sort_by_key(|e| (e.start, e.end));
    let mut data_end = 0usize;
    for entry in &entries {
        if entry.start != data_end {
            return Err(Error::Tensor {
                name: entry.name.clone(),
                reason: format!(
                    "data_offsets {:?} leave a gap or overlap (the data before ends at {data_end})",
                    (entry.start, entry.end)
                ),
            });
        }
        data_end = entry.end;
    }
    let expected = (8 + header_bytes.len() as u64).saturating_add(data_end as u64);
    if expected != total {
        return Err(blob_error(format!(
            "the header describes {expected} bytes but the file has {total}"
        )));
    }
    Ok(Header { metadata, entries })
}

impl NamedTensors {
    /// Serialises in the safetensors format, byte for byte as the safetensors library writes it
    /// (its Rust `serialize`, behind `safetensors.numpy.save` / `save_file`; measured with
    /// 0.8.0): an 8-byte little-endian header length, a compact JSON header
    /// (`{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets"}}`, padded with spaces
    /// to a multiple of 8 bytes), then the tensors' bytes. Tensors are ordered by dtype, widest
    /// first in the library's `Dtype` order (… I64, F64, … I32, … U8, BOOL), then by name, so
    /// every tensor starts aligned to its element size; the header lists them in that order.
    pub fn to_safetensors_bytes(&self) -> Vec<u8> {
        let entries: Vec<(&str, &TensorBytes)> = self.iter().collect();
        let mut out = Vec::with_capacity(self.total_bytes() + 64 * (entries.len() + 1));
        // Writing into a Vec cannot fail, and these dtypes need no cast.
        let _ = write_safetensors(&entries, None, &self.metadata, &mut out);
        out
    }

    /// Parses a safetensors image. Truncated or padded images, bad headers, unknown dtypes,
    /// offsets out of range, overlapping or leaving gaps, or sizes that disagree with dtype ×
    /// shape are [`Error::Tensor`] errors, naming the tensor where one is at fault.
    pub fn from_safetensors_bytes(bytes: &[u8]) -> Result<Self> {
        let total = bytes.len() as u64;
        let prefix = bytes.get(..8).and_then(|p| p.try_into().ok());
        let header_len = header_length(prefix, total)? as usize;
        let header = parse_header(&bytes[8..8 + header_len], total)?;
        let body = &bytes[8 + header_len..];
        let mut out = Self::new();
        out.metadata = header.metadata;
        for entry in header.entries {
            let data = body[entry.start..entry.end].to_vec();
            out.tensors.insert(
                entry.name,
                TensorBytes::new(entry.dtype, entry.shape, data)?,
            );
        }
        Ok(out)
    }

    /// Reads one `.safetensors` file, metadata included. The file's size is checked against
    /// its header before any tensor is read: the 8-byte header length must be within
    /// [`super::MAX_HEADER_BYTES`] and the file, the header JSON must parse, and the file must
    /// be exactly as long as the header says (a truncated or padded file is an error). Errors
    /// are [`Error::Safetensors`] naming the file ([`Error::Io`] when it cannot be read).
    pub fn from_safetensors_file(path: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = fs::File::open(path).map_err(io)?;
        let total = file.metadata().map_err(io)?.len();
        let mut prefix = [0u8; 8];
        let prefix = file.read_exact(&mut prefix).ok().map(|()| prefix);
        let header_len = header_length(prefix, total).map_err(|e| file_error(path, e))?;
        let mut header = vec![0u8; header_len as usize];
        file.read_exact(&mut header).map_err(io)?;
        let header = parse_header(&header, total).map_err(|e| file_error(path, e))?;
        let mut out = Self::new();
        out.metadata = header.metadata;
        // The tensors tile the data section in this order, and the file's length is checked.
        for entry in header.entries {
            let mut data = vec![0u8; entry.end - entry.start];
            file.read_exact(&mut data).map_err(io)?;
            let tensor = TensorBytes::new(entry.dtype, entry.shape, data)
                .map_err(|e| file_error(path, e))?;
            out.tensors.insert(entry.name, tensor);
        }
        Ok(out)
    }

    /// Writes the set as one `.safetensors` file at `path` (as
    /// [`NamedTensors::to_safetensors_bytes`], streamed), synced to disk before this returns.
    pub fn write_safetensors_file(&self, path: &Path) -> Result<()> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let entries: Vec<(&str, &TensorBytes)> = self.iter().collect();
        let file = fs::File::create(path).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        write_safetensors(&entries, None, &self.metadata, &mut out).map_err(io)?;
        let file = out.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)
    }
}

/// Writes `entries` (each float tensor cast to `cast` when given) in the safetensors format,
/// byte for byte as the safetensors library serialises (see
/// [`NamedTensors::to_safetensors_bytes`]): tensors ordered by their written dtype, widest
/// first in the library's order, then by name. Returns the bytes written.
pub(super) fn write_safetensors(
    entries: &[(&str, &TensorBytes)],
    cast: Option<DType>,
    metadata: &BTreeMap<String, String>,
    out: &mut impl Write,
) -> std::io::Result<u64> {
    // The header is written entry by entry, in the library's order, rather than through a
    // `serde_json::Map` (whose order depends on serde_json's `preserve_order` feature).
    let json_string = |s: &str| Value::String(s.to_owned()).to_string();
    let mut order = Vec::with_capacity(entries.len());
    for (name, tensor) in entries {
        let dtype = match cast {
            Some(to) => tensor
                .cast_target(to)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
            None => tensor.dtype(),
        };
        order.push((*name, *tensor, dtype));
    }
    // Stable: names stay in the given order within a dtype.
    order.sort_by_key(|(_, _, dtype)| std::cmp::Reverse(dtype.safetensors_rank()));
    let mut header = Vec::with_capacity(order.len() + 1);
    if !metadata.is_empty() {
        let meta: Vec<String> = metadata
            .iter()
            .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
            .collect();
        header.push(format!("\"__metadata__\":{{{}}}", meta.join(",")));
    }
    let mut offset = 0usize;
    for (name, tensor, dtype) in &order {
        let end = offset + tensor.numel() * dtype.size();
        let shape: Vec<String> = tensor.shape().iter().map(ToString::to_string).collect();
        header.push(format!(
            "{}:{{\"dtype\":{},\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            json_string(name),
            json_string(dtype.name()),
            shape.join(","),
        ));
        offset = end;
    }
    let mut header_bytes = format!("{{{}}}", header.join(",")).into_bytes();
    while !header_bytes.len().is_multiple_of(8) {
        header_bytes.push(b' ');
    }
    out.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
    out.write_all(&header_bytes)?;
    for (_, tensor, dtype) in order {
        tensor.write_as(dtype, out)?;
    }
    Ok((8 + header_bytes.len() + offset) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safetensors_tensors_are_ordered_as_the_library_orders_them() {
        // Python (safetensors 0.8.0): safetensors.numpy.save({"a": u8 [1, 2, 3], "b": f32
        // [1.5], "c": i64 [7], "d": i32 [2]}, metadata={"k": "v"}) — these exact bytes.
        let mut t = NamedTensors::new();
        t.insert(
            "a",
            TensorBytes::new(DType::U8, vec![3], vec![1, 2, 3]).unwrap(),
        );
        t.insert("b", TensorBytes::from_f32(vec![1], &[1.5]).unwrap());
        t.insert(
            "c",
            TensorBytes::new(DType::I64, vec![1], 7i64.to_le_bytes().to_vec()).unwrap(),
        );
        t.insert(
            "d",
            TensorBytes::new(DType::I32, vec![1], 2i32.to_le_bytes().to_vec()).unwrap(),
        );
        t.set_metadata("k", "v");
        let header = concat!(
            r#"{"__metadata__":{"k":"v"},"c":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"#,
            r#""b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"#,
            r#""d":{"dtype":"I32","shape":[1],"data_offsets":[12,16]},"#,
            r#""a":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}}      "#
        );
        let mut want = (header.len() as u64).to_le_bytes().to_vec();
        want.extend_from_slice(header.as_bytes());
        want.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 192, 63, 2, 0, 0, 0, 1, 2, 3]);
        assert_eq!(t.to_safetensors_bytes(), want);
        assert_eq!(NamedTensors::from_safetensors_bytes(&want).unwrap(), t);
    }

    #[test]
    fn safetensors_bytes_match_the_reference_layout() {
        // Python: safetensors.numpy.save({"a": np.array([1.0, 2.0], dtype=np.float32)})
        // header {"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} padded to 8 bytes.
        let mut t = NamedTensors::new();
        t.insert("a", TensorBytes::from_f32(vec![2], &[1.0, 2.0]).unwrap());
        let bytes = t.to_safetensors_bytes();
        let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        let padded = header.len().div_ceil(8) * 8;
        assert_eq!(&bytes[..8], &(padded as u64).to_le_bytes());
        assert_eq!(&bytes[8..8 + header.len()], header.as_bytes());
        assert_eq!(&bytes[8 + padded..], &[0, 0, 128, 63, 0, 0, 0, 64]);
        let back = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.get("a").unwrap().to_f32().unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn round_trip_with_metadata_and_dtypes() {
        let mut t = NamedTensors::new();
        t.set_metadata("weight_version", "7");
        t.insert(
            "model.embed_tokens.weight",
            TensorBytes::new(DType::BF16, vec![2, 3], vec![1; 12]).unwrap(),
        );
        t.insert(
            "ids",
            TensorBytes::new(DType::I64, vec![1], vec![2; 8]).unwrap(),
        );
        let back = NamedTensors::from_safetensors_bytes(&t.to_safetensors_bytes()).unwrap();
        assert_eq!(back, t);
        assert_eq!(back.metadata()["weight_version"], "7");
        assert_eq!(back.total_bytes(), 20);
    }

    #[test]
    fn corrupt_blobs_are_typed_errors() {
        assert!(NamedTensors::from_safetensors_bytes(&[1, 2]).is_err());
        let mut bytes = 100u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        assert!(NamedTensors::from_safetensors_bytes(&bytes).is_err());
        let header = br#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0; 8]);
        match NamedTensors::from_safetensors_bytes(&bytes) {
            Err(Error::Tensor { name, .. }) => assert_eq!(name, "w"),
            other => panic!("expected a tensor error, got {other:?}"),
        }
        assert!(TensorBytes::new(DType::F16, vec![2], vec![0; 3]).is_err());
        assert!("Q8".parse::<DType>().is_err());
    }
}
