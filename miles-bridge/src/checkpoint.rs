//! HF safetensors checkpoints on the host: reading (single file or sharded through
//! `model.safetensors.index.json`; f32 / bf16 / f16) and writing (single or sharded, chosen
//! dtype), without any model knowledge.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::error::BridgeError;
use crate::host::{FloatDtype, HostTensor, TensorMap};

/// The safetensors dtype of `dtype`.
fn safetensors_dtype(dtype: FloatDtype) -> Dtype {
    match dtype {
        FloatDtype::F32 => Dtype::F32,
        FloatDtype::Bf16 => Dtype::BF16,
        FloatDtype::F16 => Dtype::F16,
    }
}

/// The float dtype of a safetensors dtype, if it is one this crate reads.
fn float_dtype(dtype: Dtype) -> Option<FloatDtype> {
    match dtype {
        Dtype::F32 => Some(FloatDtype::F32),
        Dtype::BF16 => Some(FloatDtype::Bf16),
        Dtype::F16 => Some(FloatDtype::F16),
        _ => None,
    }
}

fn safetensors_error(path: &Path, err: impl fmt::Display) -> BridgeError {
    BridgeError::Safetensors {
        path: path.to_path_buf(),
        message: err.to_string(),
    }
}

/// Largest safetensors JSON header accepted (the safetensors format's own limit: 100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks a `.safetensors` file's size against its header before anything else is read: the
/// 8-byte header length must be within [`MAX_HEADER_BYTES`] and the file, the header JSON
/// must parse, and the file must be exactly as long as the header's largest data offset says
/// (a truncated or padded file is an error). Returns that length.
pub fn check_safetensors_size(path: &Path) -> Result<u64, BridgeError> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| BridgeError::io(path, e))?;
    let file_len = file.metadata().map_err(|e| BridgeError::io(path, e))?.len();
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .map_err(|_| safetensors_error(path, format!("file of {file_len} bytes has no header")))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > MAX_HEADER_BYTES || header_len > file_len - 8 {
        return Err(safetensors_error(
            path,
            format!("header length {header_len} does not fit a file of {file_len} bytes"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| BridgeError::io(path, e))?;
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| safetensors_error(path, format!("header is not JSON: {e}")))?;
    let entries = header
        .as_object()
        .ok_or_else(|| safetensors_error(path, "header is not a JSON object"))?;
    let mut data_end = 0u64;
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let offsets = entry
            .get("data_offsets")
            .and_then(serde_json::Value::as_array)
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| {
                safetensors_error(path, format!("tensor `{name}` has no data_offsets"))
            })?;
        if offsets.0 > offsets.1 {
            return Err(safetensors_error(
                path,
                format!("tensor `{name}` has data_offsets {offsets:?} out of order"),
            ));
        }
        data_end = data_end.max(offsets.1);
    }
    let expected = 8 + header_len + data_end;
    if expected != file_len {
        return Err(safetensors_error(
            path,
            format!("the header describes {expected} bytes but the file has {file_len}"),
        ));
    }
    Ok(file_len)
}

/// Reads every tensor of one `.safetensors` file. The file's size is checked against its
/// header first ([`check_safetensors_size`]), so a truncated file or a hostile header is an
/// error before the data is read.
pub fn read_safetensors_file(path: &Path) -> Result<TensorMap, BridgeError> {
    check_safetensors_size(path)?;
    let bytes = std::fs::read(path).map_err(|e| BridgeError::io(path, e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| safetensors_error(path, e))?;
    let mut out = TensorMap::new();
    for (name, view) in file.iter() {
        let dtype = float_dtype(view.dtype()).ok_or_else(|| BridgeError::UnsupportedDtype {
            name: name.to_string(),
            dtype: format!("{:?}", view.dtype()),
        })?;
        out.insert(
            name.to_string(),
            HostTensor {
                dtype,
                shape: view.shape().to_vec(),
                bytes: view.data().to_vec(),
            },
        );
    }
    Ok(out)
}

/// Name of the index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Reads all weights of an HF checkpoint directory: `model.safetensors.index.json` (sharded)
/// if present, else `model.safetensors`.
pub fn read_checkpoint_dir(dir: &Path) -> Result<TensorMap, BridgeError> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        let text =
            std::fs::read_to_string(&index_path).map_err(|e| BridgeError::io(&index_path, e))?;
        let index: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| BridgeError::Json {
                path: index_path.clone(),
                source: e,
            })?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| safetensors_error(&index_path, "index has no `weight_map` object"))?;
        let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                safetensors_error(&index_path, format!("weight_map[{name}] is not a string"))
            })?;
            files
                .entry(file.to_string())
                .or_default()
                .push(name.clone());
        }
        let root = dir.canonicalize().map_err(|e| BridgeError::io(dir, e))?;
        let mut out = TensorMap::new();
        for (file, names) in files {
            let shard_path = shard_inside(&root, &index_path, &file)?;
            let mut shard = read_safetensors_file(&shard_path)?;
            for name in names {
                let tensor = shard
                    .remove(&name)
                    .ok_or_else(|| BridgeError::MissingTensor {
                        name: format!("{name} (in {file})"),
                    })?;
                out.insert(name, tensor);
            }
        }
        Ok(out)
    } else {
        read_safetensors_file(&dir.join(SINGLE_FILE))
    }
}

/// The path of shard `file` of the index at `index_path`: a plain file name whose canonical
/// path (symlinks resolved) stays inside the checkpoint directory `root` (canonical).
fn shard_inside(root: &Path, index_path: &Path, file: &str) -> Result<PathBuf, BridgeError> {
    let plain = Path::new(file);
    let mut components = plain.components();
    let is_plain = matches!(
        (components.next(), components.next()),
        (Some(std::path::Component::Normal(_)), None)
    );
    if !is_plain {
        return Err(safetensors_error(
            index_path,
            format!("shard {file:?} is not a file name inside the checkpoint directory"),
        ));
    }
    let path = root.join(plain);
    let canonical = path.canonicalize().map_err(|e| BridgeError::io(&path, e))?;
    if !canonical.starts_with(root) {
        return Err(safetensors_error(
            index_path,
            format!("shard {file:?} resolves outside the checkpoint directory"),
        ));
    }
    Ok(canonical)
}

/// Serialises `tensors` (converted to `dtype`) into safetensors bytes with
/// `{"format": "pt"}` metadata, as HF writes them.
pub fn serialize_safetensors(
    tensors: &TensorMap,
    dtype: Option<FloatDtype>,
) -> Result<Vec<u8>, BridgeError> {
    let converted: Vec<(String, HostTensor)> = tensors
        .iter()
        .map(|(name, t)| {
            (
                name.clone(),
                dtype.map_or_else(|| t.clone(), |d| t.to_dtype(d)),
            )
        })
        .collect();
    let mut views = Vec::with_capacity(converted.len());
    for (name, t) in &converted {
        let view = TensorView::new(safetensors_dtype(t.dtype), t.shape.clone(), &t.bytes)
            .map_err(|e| safetensors_error(Path::new(name), e))?;
        views.push((name.as_str(), view));
    }
    let metadata = [("format".to_string(), "pt".to_string())]
        .into_iter()
        .collect();
    safetensors::serialize(views, Some(metadata))
        .map_err(|e| safetensors_error(Path::new("<serialize>"), e))
}

/// Writes `tensors` into `dir` as `model.safetensors` (when `max_shard_bytes` is `None` or
/// everything fits) or as `model-0000i-of-0000n.safetensors` shards plus
/// `model.safetensors.index.json`, split and indexed as `save_pretrained` does
/// ([`miles_core::NamedTensors::write_hf_shards`]), each file synced to disk. Returns the files
/// written.
pub fn write_checkpoint_dir(
    dir: &Path,
    tensors: &TensorMap,
    dtype: Option<FloatDtype>,
    max_shard_bytes: Option<usize>,
) -> Result<Vec<PathBuf>, BridgeError> {
    let mut named = miles_core::NamedTensors::new();
    for (name, tensor) in tensors {
        let bytes = miles_core::TensorBytes::new(
            tensor.dtype.core(),
            tensor.shape.clone(),
            tensor.bytes.clone(),
        )
        .map_err(|e| safetensors_error(Path::new(name), e))?;
        named.insert(name.clone(), bytes);
    }
    let limit = max_shard_bytes.map_or(u64::MAX, |b| b as u64);
    named
        .write_hf_shards(dir, dtype.map(FloatDtype::core), limit)
        .map_err(|e| match e {
            miles_core::Error::Io { path, source } => BridgeError::io(&path, source),
            other => safetensors_error(dir, other),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_conversion_is_exact_where_representable() {
        let t = HostTensor::from_f32(vec![4], &[1.0, -2.5, 0.15625, 65504.0]);
        for d in [FloatDtype::Bf16, FloatDtype::F16] {
            let back = t.to_dtype(d).to_dtype(FloatDtype::F32);
            assert_eq!(back.to_f32()[..3], [1.0, -2.5, 0.15625]);
        }
        // bf16 of 1 + 2^-9 rounds to 1 (8 mantissa bits), f16 keeps it.
        let fine = HostTensor::from_f32(vec![1], &[1.0 + 1.0 / 512.0]);
        assert_eq!(fine.to_dtype(FloatDtype::Bf16).to_f32(), vec![1.0]);
        assert_eq!(
            fine.to_dtype(FloatDtype::F16).to_f32(),
            vec![1.0 + 1.0 / 512.0]
        );
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("miles-bridge-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        dir
    }

    fn two_tensors() -> TensorMap {
        let mut tensors = TensorMap::new();
        tensors.insert("a".into(), HostTensor::from_f32(vec![2, 3], &[1.0; 6]));
        tensors.insert("b".into(), HostTensor::from_f32(vec![4], &[2.0; 4]));
        tensors
    }

    #[test]
    fn truncated_padded_and_hostile_files_are_errors_before_reading() {
        let dir = scratch("corrupt");
        write_checkpoint_dir(&dir, &two_tensors(), None, None).unwrap();
        let file = dir.join(SINGLE_FILE);
        let good = std::fs::read(&file).unwrap();
        assert_eq!(check_safetensors_size(&file).unwrap(), good.len() as u64);
        let expect_err = |bytes: &[u8], needle: &str| {
            std::fs::write(&file, bytes).unwrap();
            let err = read_checkpoint_dir(&dir).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} (wanted {needle:?})");
        };
        // Truncated by one byte, padded by one byte.
        expect_err(&good[..good.len() - 1], "but the file has");
        let mut padded = good.clone();
        padded.push(0);
        expect_err(&padded, "but the file has");
        // A header length of 2^63 and one past the file.
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&(1u64 << 63).to_le_bytes());
        expect_err(&huge, "does not fit");
        let mut past = good.clone();
        past[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
        expect_err(&past, "does not fit");
        // Fewer than 8 bytes; a header that is not JSON.
        expect_err(&good[..5], "has no header");
        let mut garbage = good.clone();
        garbage[8] = b'!';
        expect_err(&garbage, "not JSON");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn index_entries_cannot_point_outside_the_directory() {
        let dir = scratch("escape");
        write_checkpoint_dir(&dir, &two_tensors(), None, Some(30)).unwrap();
        let outside = scratch("escape-target");
        std::fs::create_dir_all(&outside).unwrap();
        write_checkpoint_dir(&outside, &two_tensors(), None, None).unwrap();
        let index_path = dir.join(INDEX_FILE);
        let index = std::fs::read_to_string(&index_path).unwrap();
        let shard: serde_json::Value = serde_json::from_str(&index).unwrap();
        let first = shard["weight_map"]["a"].as_str().unwrap().to_owned();
        let escape = format!(
            "../{}/{SINGLE_FILE}",
            outside.file_name().unwrap().to_string_lossy()
        );
        for bad in [escape.as_str(), "/etc/passwd", "sub/../x.safetensors"] {
            std::fs::write(&index_path, index.replace(&first, bad)).unwrap();
            let err = read_checkpoint_dir(&dir).unwrap_err().to_string();
            assert!(err.contains("not a file name inside"), "{bad}: {err}");
        }
        // A symlinked shard that resolves outside.
        #[cfg(unix)]
        {
            std::fs::write(&index_path, index.replace(&first, "link.safetensors")).unwrap();
            std::os::unix::fs::symlink(outside.join(SINGLE_FILE), dir.join("link.safetensors"))
                .unwrap();
            let err = read_checkpoint_dir(&dir).unwrap_err().to_string();
            assert!(err.contains("resolves outside"), "{err}");
        }
        std::fs::write(&index_path, &index).unwrap();
        assert_eq!(read_checkpoint_dir(&dir).unwrap(), two_tensors());
        std::fs::remove_dir_all(&dir).ok();
        std::fs::remove_dir_all(&outside).ok();
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// A file whose JSON header is `header` followed by `data`.
        fn file_with_header(header: &serde_json::Value, data: &[u8]) -> Vec<u8> {
            let text = header.to_string();
            let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(text.as_bytes());
            bytes.extend_from_slice(data);
            bytes
        }

        fn offsets() -> impl Strategy<Value = serde_json::Value> {
            prop_oneof![
                (0u64..64, 0u64..64).prop_map(|(a, b)| serde_json::json!([a, b])),
                (any::<u64>(), any::<u64>()).prop_map(|(a, b)| serde_json::json!([a, b])),
                Just(serde_json::json!([])),
                Just(serde_json::json!("0")),
            ]
        }

        fn shape() -> impl Strategy<Value = serde_json::Value> {
            prop_oneof![
                prop::collection::vec(0u64..8, 0..3).prop_map(|s| serde_json::json!(s)),
                prop::collection::vec(any::<u64>(), 1..4).prop_map(|s| serde_json::json!(s)),
                Just(serde_json::json!(-1)),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1500))]

            /// Hostile headers (any dtype, shape, offsets, overlapping or huge) and any data
            /// length: a typed error or tensors whose sizes match their shapes, never a panic.
            #[test]
            fn hostile_headers_are_errors_not_panics(
                entries in prop::collection::vec(
                    (
                        "[a-z]{1,3}",
                        prop::sample::select(vec!["F32", "BF16", "F16", "I64", "U8", "X"]),
                        shape(),
                        offsets(),
                    ),
                    0..4,
                ),
                data_len in 0usize..96,
            ) {
                let mut header = serde_json::Map::new();
                for (name, dtype, shape, offsets) in entries {
                    header.insert(
                        name,
                        serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": offsets}),
                    );
                }
                let bytes = file_with_header(&serde_json::Value::Object(header), &vec![7u8; data_len]);
                let dir = scratch(&format!("fuzz-{}", data_len));
                std::fs::create_dir_all(&dir).unwrap();
                let path = dir.join(SINGLE_FILE);
                std::fs::write(&path, &bytes).unwrap();
                if let Ok(tensors) = read_safetensors_file(&path) {
                    for t in tensors.values() {
                        prop_assert_eq!(t.bytes.len(), t.numel() * t.dtype.size());
                    }
                }
                std::fs::remove_dir_all(&dir).ok();
            }

            /// Arbitrary bytes as a checkpoint file.
            #[test]
            fn random_files_are_errors_not_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
                let dir = scratch("fuzz-raw");
                std::fs::create_dir_all(&dir).unwrap();
                let path = dir.join(SINGLE_FILE);
                std::fs::write(&path, &bytes).unwrap();
                let _ = read_safetensors_file(&path);
                std::fs::remove_dir_all(&dir).ok();
            }
        }
    }

    #[test]
    fn sharded_write_read_round_trip() {
        let dir = std::env::temp_dir().join(format!("miles-bridge-shard-{}", std::process::id()));
        let mut tensors = TensorMap::new();
        for i in 0..5 {
            let values: Vec<f32> = (0..10).map(|j| (i * 10 + j) as f32 * 0.5).collect();
            tensors.insert(format!("t{i}"), HostTensor::from_f32(vec![2, 5], &values));
        }
        let files = write_checkpoint_dir(&dir, &tensors, None, Some(90)).unwrap();
        assert_eq!(files.len(), 4); // 3 shards of <= 2 tensors + index
        assert_eq!(read_checkpoint_dir(&dir).unwrap(), tensors);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_file_is_io_error() {
        let err = read_checkpoint_dir(Path::new("/nonexistent/dir")).unwrap_err();
        assert!(matches!(err, BridgeError::Io { .. }));
    }
}
