//! Hugging Face checkpoint directories: `model.safetensors`, or shards plus
//! `model.safetensors.index.json`, written as `save_pretrained` writes them and read back
//! (shard names from the index must stay inside the directory).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Component, Path, PathBuf};

use serde_json::{Map, Value};

use super::dtype::DType;
use super::named::NamedTensors;
use super::safetensors::write_safetensors;
use super::tensor::TensorBytes;
use crate::error::{Error, Result};

/// Name of the index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// An [`Error::Safetensors`] about the file at `path`.
fn bad_file(path: &Path, reason: String) -> Error {
    Error::Safetensors {
        path: path.to_path_buf(),
        reason,
    }
}

impl NamedTensors {
    /// Writes the set as a Hugging Face checkpoint's weight files into `dir` (created if
    /// missing), each float tensor cast to `cast` when given (ids and masks keep their
    /// dtype), the way `save_pretrained` / `huggingface_hub.split_torch_state_dict_into_shards`
    /// lay them out:
    ///
    /// - tensors are taken in name order and packed into shards of at most
    ///   `max_shard_bytes` bytes of tensor data: a tensor that would tip the current shard
    ///   over the limit starts a new one, and a tensor larger than the limit gets a shard of
    ///   its own;
    /// - one shard is `model.safetensors`; several are
    ///   `model-00001-of-0000N.safetensors` … plus `model.safetensors.index.json`
    ///   (`{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}`,
    ///   keys sorted, two-space indent, as transformers writes it);
    /// - each shard's header carries the set's metadata and `"format": "pt"`.
    ///
    /// The data is streamed (at most one chunk of a tensor is held converted) and every file
    /// is synced to disk before this returns. Returns the files written, shards first.
    pub fn write_hf_shards(
        &self,
        dir: &Path,
        cast: Option<DType>,
        max_shard_bytes: u64,
    ) -> Result<Vec<PathBuf>> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        // The size of every tensor as written, checking the cast up front.
        let mut sized = Vec::with_capacity(self.tensors.len());
        let mut total_size = 0u64;
        let mut total_parameters = 0u64;
        for (name, tensor) in self.iter() {
            let dtype = match cast {
                Some(to) => tensor.cast_target(to)?,
                None => tensor.dtype(),
            };
            let bytes = (tensor.numel() * dtype.size()) as u64;
            total_size += bytes;
            total_parameters += tensor.numel() as u64;
            sized.push((name, tensor, bytes));
        }
        let mut shards: Vec<Vec<(&str, &TensorBytes)>> = Vec::new();
        let mut current: Vec<(&str, &TensorBytes)> = Vec::new();
        let mut current_bytes = 0u64;
        for (name, tensor, bytes) in sized {
            if bytes > max_shard_bytes {
                shards.push(vec![(name, tensor)]);
                continue;
            }
            if current_bytes + bytes > max_shard_bytes {
                shards.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            current.push((name, tensor));
            current_bytes += bytes;
        }
        if !current.is_empty() || shards.is_empty() {
            shards.push(current);
        }
        fs::create_dir_all(dir).map_err(io(dir))?;
        let mut metadata = self.metadata.clone();
        metadata
            .entry("format".to_owned())
            .or_insert_with(|| "pt".to_owned());
        let count = shards.len();
        let file_name = |i: usize| {
            if count == 1 {
                SINGLE_FILE.to_owned()
            } else {
                format!("model-{:05}-of-{count:05}.safetensors", i + 1)
            }
        };
        let mut written = Vec::with_capacity(count + 1);
        let mut weight_map = BTreeMap::new();
        for (i, shard) in shards.iter().enumerate() {
            let name = file_name(i);
            let path = dir.join(&name);
            let file = fs::File::create(&path).map_err(io(&path))?;
            let mut out = BufWriter::with_capacity(1 << 20, file);
            write_safetensors(shard, cast, &metadata, &mut out).map_err(io(&path))?;
            let file = out.into_inner().map_err(|e| io(&path)(e.into_error()))?;
            file.sync_all().map_err(io(&path))?;
            for (tensor, _) in shard {
                weight_map.insert(tensor.to_string(), Value::String(name.clone()));
            }
            written.push(path);
        }
        if count > 1 {
            let mut meta = Map::new();
            meta.insert("total_parameters".into(), total_parameters.into());
            meta.insert("total_size".into(), total_size.into());
            let mut index = BTreeMap::new();
            index.insert("metadata", Value::Object(meta));
            index.insert(
                "weight_map",
                Value::Object(weight_map.into_iter().collect()),
            );
            let mut text = serde_json::to_string_pretty(&index)?;
            text.push('\n');
            let path = dir.join(INDEX_FILE);
            let mut file = fs::File::create(&path).map_err(io(&path))?;
            file.write_all(text.as_bytes()).map_err(io(&path))?;
            file.sync_all().map_err(io(&path))?;
            written.push(path);
        }
        Ok(written)
    }

    /// Reads the weights of a Hugging Face checkpoint directory: through
    /// `model.safetensors.index.json` when present (every shard it names, each tensor from
    /// the shard the index gives), else `model.safetensors`. Tensors of every dtype are read
    /// byte for byte. Only the tensors are returned: the shards' metadata (`"format": "pt"`)
    /// is dropped, as transformers' loaders drop it. Each file is checked as
    /// [`NamedTensors::from_safetensors_file`] checks it, and an index that names a file
    /// outside the directory (a path, or a link that resolves outside) is an error.
    pub fn read_hf_checkpoint(dir: &Path) -> Result<Self> {
        let index_path = dir.join(INDEX_FILE);
        if !index_path.is_file() {
            return Ok(Self::from_safetensors_file(&dir.join(SINGLE_FILE))?.without_metadata());
        }
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { path, source }
        };
        let text = fs::read_to_string(&index_path).map_err(io(&index_path))?;
        let index: Value = serde_json::from_str(&text)
            .map_err(|e| bad_file(&index_path, format!("index is not JSON: {e}")))?;
        let map = index
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad_file(&index_path, "index has no `weight_map` object".into()))?;
        let mut files: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                bad_file(&index_path, format!("weight_map[{name}] is not a string"))
            })?;
            files.entry(file).or_default().push(name);
        }
        let root = dir.canonicalize().map_err(io(dir))?;
        let mut out = Self::new();
        for (file, names) in files {
            let shard_path = shard_inside(&root, &index_path, file)?;
            let mut shard = Self::from_safetensors_file(&shard_path)?;
            for name in names {
                let tensor = shard.remove(name).ok_or_else(|| Error::Tensor {
                    name: name.to_owned(),
                    reason: format!("listed in {INDEX_FILE} but missing from {file}"),
                })?;
                out.insert(name, tensor);
            }
        }
        Ok(out)
    }
}

/// The path of shard `file` of the index at `index_path`: a plain file name whose canonical
/// path (symlinks resolved) stays inside the checkpoint directory `root` (canonical).
fn shard_inside(root: &Path, index_path: &Path, file: &str) -> Result<PathBuf> {
    let plain = Path::new(file);
    let mut components = plain.components();
    let is_plain = matches!(
        (components.next(), components.next()),
        (Some(Component::Normal(_)), None)
    );
    if !is_plain {
        return Err(bad_file(
            index_path,
            format!("shard {file:?} is not a file name inside the checkpoint directory"),
        ));
    }
    let path = root.join(plain);
    let canonical = path.canonicalize().map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    if !canonical.starts_with(root) {
        return Err(bad_file(
            index_path,
            format!("shard {file:?} resolves outside the checkpoint directory"),
        ));
    }
    Ok(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::tensor::tests::u16s;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "miles-core-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// The shard plan of `huggingface_hub` 2.4.0 (`split_state_dict_into_shards_factory`,
    /// behind `split_torch_state_dict_into_shards` and `save_pretrained`) for tensors of
    /// a 40, b 30, c 100, d 10, e 50, f 0, g 60 bytes:
    /// max 60 → [a] [c] [b d] [e f] [g]; max 99 → [c] [a b d] [e f] [g]; max 1000 → one
    /// `model.safetensors`, no index.
    #[test]
    fn shards_split_as_huggingface_hub_splits_them() {
        let sizes = [
            ("a.weight", 40),
            ("b.weight", 30),
            ("c.weight", 100),
            ("d.weight", 10),
            ("e.weight", 50),
            ("f.weight", 0),
            ("g.weight", 60),
        ];
        let mut set = NamedTensors::new();
        for (i, (name, bytes)) in sizes.iter().enumerate() {
            set.insert(
                *name,
                TensorBytes::new(DType::U8, vec![*bytes], vec![i as u8; *bytes]).unwrap(),
            );
        }
        let plans: [(u64, &[&[&str]]); 3] = [
            (
                60,
                &[
                    &["a.weight"],
                    &["c.weight"],
                    &["b.weight", "d.weight"],
                    &["e.weight", "f.weight"],
                    &["g.weight"],
                ],
            ),
            (
                99,
                &[
                    &["c.weight"],
                    &["a.weight", "b.weight", "d.weight"],
                    &["e.weight", "f.weight"],
                    &["g.weight"],
                ],
            ),
            (
                1000,
                &[&[
                    "a.weight", "b.weight", "c.weight", "d.weight", "e.weight", "f.weight",
                    "g.weight",
                ]],
            ),
        ];
        for (max, plan) in plans {
            let dir = scratch(&format!("shards-{max}"));
            let files = set.write_hf_shards(&dir, None, max).unwrap();
            let n = plan.len();
            let mut merged = NamedTensors::new();
            for (i, names) in plan.iter().enumerate() {
                let file = if n == 1 {
                    "model.safetensors".to_owned()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                };
                assert_eq!(files[i], dir.join(&file));
                let shard =
                    NamedTensors::from_safetensors_bytes(&fs::read(dir.join(&file)).unwrap())
                        .unwrap();
                assert_eq!(shard.metadata()["format"], "pt");
                let got: Vec<&str> = shard.iter().map(|(k, _)| k).collect();
                assert_eq!(got, *names, "shard {i} of max {max}");
                for (k, v) in shard.iter() {
                    merged.insert(k, v.clone());
                }
            }
            assert_eq!(merged.tensors, set.tensors);
            let index = dir.join("model.safetensors.index.json");
            if n == 1 {
                assert_eq!(files.len(), 1);
                assert!(!index.exists());
            } else {
                assert_eq!(files.last(), Some(&index));
                let text = fs::read_to_string(&index).unwrap();
                // json.dumps(index, indent=2, sort_keys=True) + "\n", as transformers writes.
                assert!(text.starts_with(
                    "{\n  \"metadata\": {\n    \"total_parameters\": 290,\n    \"total_size\": 290\n  },\n  \"weight_map\": {\n    \"a.weight\": \"model-"
                ), "{text}");
                assert!(text.ends_with("}\n}\n"));
                let index: Value = serde_json::from_str(&text).unwrap();
                for (i, names) in plan.iter().enumerate() {
                    for name in *names {
                        assert_eq!(
                            index["weight_map"][*name],
                            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                        );
                    }
                }
            }
            fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn shards_are_written_in_the_cast_dtype() {
        let mut set = NamedTensors::new();
        set.insert(
            "w",
            TensorBytes::from_f32(vec![2, 2], &[1.0, 1.003_906_3, -2.5, 0.1]).unwrap(),
        );
        set.insert(
            "ids",
            TensorBytes::new(DType::I64, vec![1], 9i64.to_le_bytes().to_vec()).unwrap(),
        );
        set.set_metadata("weight_version", "4");
        let dir = scratch("cast");
        // Sizes as written: w 8 bytes in bf16, ids 8: two shards at max 8.
        set.write_hf_shards(&dir, Some(DType::BF16), 8).unwrap();
        let first = NamedTensors::from_safetensors_bytes(
            &fs::read(dir.join("model-00001-of-00002.safetensors")).unwrap(),
        )
        .unwrap();
        assert_eq!(first.get("ids"), set.get("ids"));
        assert_eq!(first.metadata()["weight_version"], "4");
        let second = NamedTensors::from_safetensors_bytes(
            &fs::read(dir.join("model-00002-of-00002.safetensors")).unwrap(),
        )
        .unwrap();
        let w = second.get("w").unwrap();
        assert_eq!(w.dtype(), DType::BF16);
        assert_eq!(u16s(w), [16256, 16256, 49184, 15821]);
        let index: Value = serde_json::from_str(
            &fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["metadata"]["total_size"], 16);
        assert_eq!(index["metadata"]["total_parameters"], 5);
        fs::remove_dir_all(&dir).unwrap();
        // A bad target writes nothing.
        let dir = scratch("bad-cast");
        assert!(set.write_hf_shards(&dir, Some(DType::U8), 100).is_err());
        assert!(!dir.join("model.safetensors").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    fn two_tensors() -> NamedTensors {
        let mut tensors = NamedTensors::new();
        tensors.insert("a", TensorBytes::from_f32(vec![2, 3], &[1.0; 6]).unwrap());
        tensors.insert("b", TensorBytes::from_f32(vec![4], &[2.0; 4]).unwrap());
        tensors
    }

    #[test]
    fn truncated_padded_and_hostile_files_are_errors_before_reading() {
        let dir = scratch("corrupt");
        two_tensors().write_hf_shards(&dir, None, u64::MAX).unwrap();
        let file = dir.join(SINGLE_FILE);
        let good = std::fs::read(&file).unwrap();
        assert_eq!(
            NamedTensors::from_safetensors_file(&file)
                .unwrap()
                .without_metadata(),
            two_tensors()
        );
        let expect_err = |bytes: &[u8], needle: &str| {
            std::fs::write(&file, bytes).unwrap();
            let err = NamedTensors::read_hf_checkpoint(&dir)
                .unwrap_err()
                .to_string();
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
        two_tensors().write_hf_shards(&dir, None, 30).unwrap();
        let outside = scratch("escape-target");
        std::fs::create_dir_all(&outside).unwrap();
        two_tensors()
            .write_hf_shards(&outside, None, u64::MAX)
            .unwrap();
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
            let err = NamedTensors::read_hf_checkpoint(&dir)
                .unwrap_err()
                .to_string();
            assert!(err.contains("not a file name inside"), "{bad}: {err}");
        }
        // A symlinked shard that resolves outside.
        #[cfg(unix)]
        {
            std::fs::write(&index_path, index.replace(&first, "link.safetensors")).unwrap();
            std::os::unix::fs::symlink(outside.join(SINGLE_FILE), dir.join("link.safetensors"))
                .unwrap();
            let err = NamedTensors::read_hf_checkpoint(&dir)
                .unwrap_err()
                .to_string();
            assert!(err.contains("resolves outside"), "{err}");
        }
        std::fs::write(&index_path, &index).unwrap();
        assert_eq!(
            NamedTensors::read_hf_checkpoint(&dir).unwrap(),
            two_tensors()
        );
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
                if let Ok(tensors) = NamedTensors::from_safetensors_file(&path) {
                    for t in tensors.values() {
                        prop_assert_eq!(t.data().len(), t.numel() * t.dtype().size());
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
                let _ = NamedTensors::from_safetensors_file(&path);
                std::fs::remove_dir_all(&dir).ok();
            }
        }
    }

    #[test]
    fn sharded_write_read_round_trip() {
        let dir = scratch("shard");
        let mut tensors = NamedTensors::new();
        for i in 0..5 {
            let values: Vec<f32> = (0..10).map(|j| (i * 10 + j) as f32 * 0.5).collect();
            tensors.insert(
                format!("t{i}"),
                TensorBytes::from_f32(vec![2, 5], &values).unwrap(),
            );
        }
        let files = tensors.write_hf_shards(&dir, None, 90).unwrap();
        assert_eq!(files.len(), 4); // 3 shards of <= 2 tensors + index
        assert_eq!(NamedTensors::read_hf_checkpoint(&dir).unwrap(), tensors);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_file_is_io_error() {
        let err = NamedTensors::read_hf_checkpoint(Path::new("/nonexistent/dir")).unwrap_err();
        assert!(matches!(err, Error::Io { .. }));
    }
}
