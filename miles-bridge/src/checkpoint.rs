//! HF safetensors checkpoints on the host: reading (single file or sharded through
//! `model.safetensors.index.json`; f32 / bf16 / f16) and writing (single or sharded, chosen
//! dtype), without any model knowledge.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::BridgeError;

/// Floating-point dtypes a checkpoint can be read from or written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FloatDtype {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl FloatDtype {
    /// Parses `f32`, `bf16` / `bfloat16` or `f16` / `float16`.
    pub fn parse(text: &str) -> Option<Self> {
        match text.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Self::F32),
            "bf16" | "bfloat16" => Some(Self::Bf16),
            "f16" | "float16" => Some(Self::F16),
            _ => None,
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::Bf16 => Dtype::BF16,
            Self::F16 => Dtype::F16,
        }
    }

    fn from_safetensors(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(Self::F32),
            Dtype::BF16 => Some(Self::Bf16),
            Dtype::F16 => Some(Self::F16),
            _ => None,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

impl fmt::Display for FloatDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

/// One tensor on the host: little-endian bytes in `dtype`, row-major `shape`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Storage dtype.
    pub dtype: FloatDtype,
    /// Row-major shape.
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Wraps f32 values.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self {
            dtype: FloatDtype::F32,
            shape,
            bytes,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The values widened to f32 (exact for bf16 / f16).
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            FloatDtype::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            FloatDtype::Bf16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            FloatDtype::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        }
    }

    /// The same values stored in `dtype` (round to nearest even when narrowing).
    pub fn to_dtype(&self, dtype: FloatDtype) -> Self {
        if dtype == self.dtype {
            return self.clone();
        }
        let values = self.to_f32();
        let bytes = match dtype {
            FloatDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            FloatDtype::Bf16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            FloatDtype::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        Self {
            dtype,
            shape: self.shape.clone(),
            bytes,
        }
    }
}

/// A set of named host tensors, sorted by name.
pub type TensorMap = BTreeMap<String, HostTensor>;

fn safetensors_error(path: &Path, err: impl fmt::Display) -> BridgeError {
    BridgeError::Safetensors {
        path: path.to_path_buf(),
        message: err.to_string(),
    }
}

/// Reads every tensor of one `.safetensors` file.
pub fn read_safetensors_file(path: &Path) -> Result<TensorMap, BridgeError> {
    let bytes = std::fs::read(path).map_err(|e| BridgeError::io(path, e))?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| safetensors_error(path, e))?;
    let mut out = TensorMap::new();
    for (name, view) in file.iter() {
        let dtype = FloatDtype::from_safetensors(view.dtype()).ok_or_else(|| {
            BridgeError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{:?}", view.dtype()),
            }
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
        let mut out = TensorMap::new();
        for (file, names) in files {
            let shard_path = dir.join(&file);
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
        let view = TensorView::new(t.dtype.safetensors(), t.shape.clone(), &t.bytes)
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
/// `model.safetensors.index.json`. Returns the files written.
pub fn write_checkpoint_dir(
    dir: &Path,
    tensors: &TensorMap,
    dtype: Option<FloatDtype>,
    max_shard_bytes: Option<usize>,
) -> Result<Vec<PathBuf>, BridgeError> {
    std::fs::create_dir_all(dir).map_err(|e| BridgeError::io(dir, e))?;
    let size_of =
        |t: &HostTensor| t.numel() * dtype.map_or_else(|| t.dtype.size(), FloatDtype::size);
    let mut shards: Vec<TensorMap> = vec![TensorMap::new()];
    let mut current = 0usize;
    for (name, tensor) in tensors {
        let size = size_of(tensor);
        if let Some(limit) = max_shard_bytes
            && current > 0
            && current + size > limit
        {
            shards.push(TensorMap::new());
            current = 0;
        }
        current += size;
        if let Some(last) = shards.last_mut() {
            last.insert(name.clone(), tensor.clone());
        }
    }
    let mut written = Vec::new();
    if shards.len() == 1 {
        let path = dir.join(SINGLE_FILE);
        let bytes = serialize_safetensors(&shards[0], dtype)?;
        std::fs::write(&path, bytes).map_err(|e| BridgeError::io(&path, e))?;
        written.push(path);
        return Ok(written);
    }
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        for (name, tensor) in shard {
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
            total += size_of(tensor);
        }
        let path = dir.join(&file);
        let bytes = serialize_safetensors(shard, dtype)?;
        std::fs::write(&path, bytes).map_err(|e| BridgeError::io(&path, e))?;
        written.push(path);
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    let path = dir.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).map_err(|e| BridgeError::Json {
        path: path.clone(),
        source: e,
    })?;
    std::fs::write(&path, text).map_err(|e| BridgeError::io(&path, e))?;
    written.push(path);
    Ok(written)
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
