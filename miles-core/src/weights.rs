//! Weight versions and named tensors: what weight export, checkpoints and engine weight
//! updates carry.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// A monotonically increasing version of the policy weights.
///
/// Trainers bump it at every weight export; engines stamp every output with the version it was
/// generated with. On the SGLang wire it is a string (`"7"`); it deserialises from a string or
/// a number and serialises as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WeightVersion(pub u64);

impl WeightVersion {
    /// The next version.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// How many versions `self` is behind `current` (0 if not behind).
    pub fn staleness(self, current: WeightVersion) -> u64 {
        current.0.saturating_sub(self.0)
    }
}

impl fmt::Display for WeightVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for WeightVersion {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        s.trim().parse::<u64>().map(Self).map_err(|_| Error::Parse {
            what: "weight version",
            input: s.to_owned(),
        })
    }
}

impl Serialize for WeightVersion {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for WeightVersion {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(s) => s.parse().map_err(serde::de::Error::custom),
            Value::Number(n) => n
                .as_u64()
                .map(Self)
                .ok_or_else(|| serde::de::Error::custom(format!("invalid weight version {n}"))),
            other => Err(serde::de::Error::custom(format!(
                "invalid weight version {other}"
            ))),
        }
    }
}

/// Element type of a tensor, with safetensors' names (`"F32"`, `"BF16"`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// IEEE f64.
    F64,
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
    /// i64.
    I64,
    /// i32.
    I32,
    /// i16.
    I16,
    /// i8.
    I8,
    /// u64.
    U64,
    /// u32.
    U32,
    /// u16.
    U16,
    /// u8.
    U8,
    /// bool (one byte).
    BOOL,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 | Self::U64 => 8,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::I8 | Self::U8 | Self::BOOL => 1,
        }
    }

    /// The position in the safetensors library's `Dtype` enum (BOOL, U8, I8, I16, U16, F16,
    /// BF16, I32, U32, F32, F64, I64, U64 among ours), which orders serialised tensors.
    fn safetensors_rank(self) -> u8 {
        match self {
            Self::BOOL => 0,
            Self::U8 => 1,
            Self::I8 => 2,
            Self::I16 => 3,
            Self::U16 => 4,
            Self::F16 => 5,
            Self::BF16 => 6,
            Self::I32 => 7,
            Self::U32 => 8,
            Self::F32 => 9,
            Self::F64 => 10,
            Self::I64 => 11,
            Self::U64 => 12,
        }
    }

    /// Whether this is a floating-point type (the types [`TensorBytes::cast`] converts
    /// between).
    pub fn is_float(self) -> bool {
        matches!(self, Self::F64 | Self::F32 | Self::F16 | Self::BF16)
    }

    /// The safetensors name.
    pub fn name(self) -> &'static str {
        match self {
            Self::F64 => "F64",
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::I64 => "I64",
            Self::I32 => "I32",
            Self::I16 => "I16",
            Self::I8 => "I8",
            Self::U64 => "U64",
            Self::U32 => "U32",
            Self::U16 => "U16",
            Self::U8 => "U8",
            Self::BOOL => "BOOL",
        }
    }
}

impl FromStr for DType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "F64" => Self::F64,
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "I64" => Self::I64,
            "I32" => Self::I32,
            "I16" => Self::I16,
            "I8" => Self::I8,
            "U64" => Self::U64,
            "U32" => Self::U32,
            "U16" => Self::U16,
            "U8" => Self::U8,
            "BOOL" => Self::BOOL,
            _ => {
                return Err(Error::Parse {
                    what: "dtype",
                    input: s.to_owned(),
                });
            }
        })
    }
}

/// One tensor: dtype, shape and little-endian bytes (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorBytes {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl TensorBytes {
    /// A tensor from its parts; `data.len()` must equal `numel × dtype.size()`.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let expected = shape
            .iter()
            .try_fold(dtype.size(), |acc, d| acc.checked_mul(*d))
            .ok_or_else(|| Error::Tensor {
                name: String::new(),
                reason: format!("shape {shape:?} overflows"),
            })?;
        if data.len() != expected {
            return Err(Error::Tensor {
                name: String::new(),
                reason: format!(
                    "{} bytes for {dtype:?} {shape:?}, expected {expected}",
                    data.len()
                ),
            });
        }
        Ok(Self { dtype, shape, data })
    }

    /// An f32 tensor from values.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<Self> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Self::new(DType::F32, shape, data)
    }

    /// The values as f32 (only for `F32` tensors).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        if self.dtype != DType::F32 {
            return Err(Error::Tensor {
                name: String::new(),
                reason: format!("expected F32, found {:?}", self.dtype),
            });
        }
        Ok(self
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Little-endian bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// This tensor converted to the float type `to`, rounding to nearest, ties to even, as
    /// torch's `Tensor.to(dtype)` does (NaN stays NaN, overflow becomes ±inf). Non-float
    /// tensors (ids, masks) and tensors already of type `to` are returned unchanged; `to`
    /// must be a float type.
    pub fn cast(&self, to: DType) -> Result<Self> {
        let target = self.cast_target(to)?;
        if target == self.dtype {
            return Ok(self.clone());
        }
        let mut data = Vec::with_capacity(self.numel() * target.size());
        self.write_as(target, &mut data)
            .map_err(|e| Error::Tensor {
                name: String::new(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            dtype: target,
            shape: self.shape.clone(),
            data,
        })
    }

    /// The dtype this tensor takes when cast to `to`: `to` for float tensors, its own dtype
    /// for the others.
    fn cast_target(&self, to: DType) -> Result<DType> {
        if !to.is_float() {
            return Err(Error::Tensor {
                name: String::new(),
                reason: format!("cannot cast to {to:?}: only float targets"),
            });
        }
        Ok(if self.dtype.is_float() {
            to
        } else {
            self.dtype
        })
    }

    /// Writes this tensor's bytes converted to `to` (a float type, or the tensor's own dtype),
    /// element by element in bounded chunks, without a second copy of the tensor.
    fn write_as(&self, to: DType, out: &mut impl Write) -> std::io::Result<()> {
        if to == self.dtype {
            return out.write_all(&self.data);
        }
        const CHUNK: usize = 16 * 1024;
        let from = self.dtype;
        let mut buf = Vec::with_capacity(CHUNK * to.size());
        for chunk in self.data.chunks(CHUNK * from.size()) {
            buf.clear();
            for elem in chunk.chunks_exact(from.size()) {
                // f16, bf16 and f32 values widen to f32 exactly, so each element is rounded
                // once, from its own precision, as torch rounds.
                let wide = match from {
                    DType::F64 => {
                        let x = f64::from_le_bytes(elem.try_into().unwrap_or_default());
                        match to {
                            DType::F32 => buf.extend_from_slice(&(x as f32).to_le_bytes()),
                            DType::F16 => {
                                buf.extend_from_slice(&half::f16::from_f64(x).to_le_bytes())
                            }
                            DType::BF16 => {
                                buf.extend_from_slice(&half::bf16::from_f64(x).to_le_bytes())
                            }
                            _ => unreachable!("cast targets are float types"),
                        }
                        continue;
                    }
                    DType::F32 => f32::from_le_bytes(elem.try_into().unwrap_or_default()),
                    DType::F16 => half::f16::from_le_bytes([elem[0], elem[1]]).to_f32(),
                    DType::BF16 => half::bf16::from_le_bytes([elem[0], elem[1]]).to_f32(),
                    _ => unreachable!("write_as is only called with float tensors"),
                };
                match to {
                    DType::F64 => buf.extend_from_slice(&f64::from(wide).to_le_bytes()),
                    DType::F32 => buf.extend_from_slice(&wide.to_le_bytes()),
                    DType::F16 => buf.extend_from_slice(&half::f16::from_f32(wide).to_le_bytes()),
                    DType::BF16 => buf.extend_from_slice(&half::bf16::from_f32(wide).to_le_bytes()),
                    _ => unreachable!("cast targets are float types"),
                }
            }
            out.write_all(&buf)?;
        }
        Ok(())
    }
}

/// HF-named tensors (`model.layers.0.self_attn.q_proj.weight` → tensor), in name order, plus
/// optional string metadata: the unit of weight export, checkpoints and engine weight updates.
/// Converts to and from the safetensors format byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NamedTensors {
    tensors: BTreeMap<String, TensorBytes>,
    metadata: BTreeMap<String, String>,
}

impl NamedTensors {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: TensorBytes) -> Option<TensorBytes> {
        self.tensors.insert(name.into(), tensor)
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorBytes> {
        self.tensors.get(name)
    }

    /// Removes a tensor by name.
    pub fn remove(&mut self, name: &str) -> Option<TensorBytes> {
        self.tensors.remove(name)
    }

    /// Iterates `(name, tensor)` in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TensorBytes)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.data.len()).sum()
    }

    /// String metadata (safetensors `__metadata__`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Sets one metadata entry.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

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
                None => tensor.dtype,
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
                "model.safetensors".to_owned()
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
            let path = dir.join("model.safetensors.index.json");
            let mut file = fs::File::create(&path).map_err(io(&path))?;
            file.write_all(text.as_bytes()).map_err(io(&path))?;
            file.sync_all().map_err(io(&path))?;
            written.push(path);
        }
        Ok(written)
    }

    /// Parses a safetensors buffer. Truncated buffers, bad headers, unknown dtypes, offsets
    /// out of range or sizes that disagree with dtype × shape are [`Error::Tensor`] errors
    /// naming the tensor.
    pub fn from_safetensors_bytes(bytes: &[u8]) -> Result<Self> {
        let blob_error = |reason: String| Error::Tensor {
            name: String::new(),
            reason,
        };
        if bytes.len() < 8 {
            return Err(blob_error(format!("{} bytes is too short", bytes.len())));
        }
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
        let header_end = 8usize
            .checked_add(usize::try_from(header_len).unwrap_or(usize::MAX))
            .filter(|end| *end <= bytes.len())
            .ok_or_else(|| blob_error(format!("header length {header_len} exceeds the buffer")))?;
        let header: Map<String, Value> = serde_json::from_slice(&bytes[8..header_end])
            .map_err(|e| blob_error(format!("header is not a JSON object: {e}")))?;
        let body = &bytes[header_end..];
        let mut out = Self::new();
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
                    out.metadata.insert(k, v);
                }
                continue;
            }
            let dtype: DType = entry
                .get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| tensor_error("missing dtype".into()))?
                .parse()
                .map_err(|_| tensor_error(format!("unknown dtype {}", entry["dtype"])))?;
            let shape = entry
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| tensor_error("missing shape".into()))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| tensor_error("shape is not a list of sizes".into()))?;
            let offsets = entry
                .get("data_offsets")
                .and_then(Value::as_array)
                .filter(|o| o.len() == 2)
                .and_then(|o| Some((o[0].as_u64()? as usize, o[1].as_u64()? as usize)))
                .ok_or_else(|| tensor_error("missing data_offsets".into()))?;
            if offsets.0 > offsets.1 || offsets.1 > body.len() {
                return Err(tensor_error(format!(
                    "data_offsets {offsets:?} outside a body of {} bytes",
                    body.len()
                )));
            }
            let tensor = TensorBytes::new(dtype, shape, body[offsets.0..offsets.1].to_vec())
                .map_err(|e| match e {
                    Error::Tensor { reason, .. } => tensor_error(reason),
                    other => other,
                })?;
            out.tensors.insert(name, tensor);
        }
        Ok(out)
    }
}

impl FromIterator<(String, TensorBytes)> for NamedTensors {
    fn from_iter<I: IntoIterator<Item = (String, TensorBytes)>>(iter: I) -> Self {
        Self {
            tensors: iter.into_iter().collect(),
            metadata: BTreeMap::new(),
        }
    }
}

/// Writes `entries` (each float tensor cast to `cast` when given) in the safetensors format,
/// byte for byte as the safetensors library serialises (see
/// [`NamedTensors::to_safetensors_bytes`]): tensors ordered by their written dtype, widest
/// first in the library's order, then by name. Returns the bytes written.
fn write_safetensors(
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
            None => tensor.dtype,
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
        let shape: Vec<String> = tensor.shape.iter().map(ToString::to_string).collect();
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
    fn weight_version_wire_form() {
        let v: WeightVersion = serde_json::from_str("\"12\"").unwrap();
        assert_eq!(v, WeightVersion(12));
        let n: WeightVersion = serde_json::from_str("3").unwrap();
        assert_eq!(n.next(), WeightVersion(4));
        assert_eq!(serde_json::to_string(&v).unwrap(), "\"12\"");
        assert!(serde_json::from_str::<WeightVersion>("\"default\"").is_err());
        assert_eq!(WeightVersion(3).staleness(WeightVersion(5)), 2);
        assert_eq!(WeightVersion(6).staleness(WeightVersion(5)), 0);
    }

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

    fn u16s(t: &TensorBytes) -> Vec<u16> {
        t.data()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    #[test]
    fn casts_round_as_torch_does() {
        // torch 2.15: torch.tensor(VALUES, dtype=torch.float32).to(dtype).view(torch.int16)
        // (as unsigned). Ties go to even (1 + 2^-8 → 1.0 in bf16), overflow to inf (70000 in
        // f16), underflow to zero (1e-8 in f16). torch writes a float32 NaN as 0xFFFF in bf16
        // on its vector path and 0x7E00 in f16; only NaN-ness is compared.
        let values = [
            1.0f32,
            1.003_906_3,
            1.011_718_8,
            -2.5,
            65504.0,
            70000.0,
            1e-8,
            f32::NAN,
            3.0e38,
            -0.0,
            0.1,
        ];
        let t = TensorBytes::from_f32(vec![values.len()], &values).unwrap();
        let bf16 = t.cast(DType::BF16).unwrap();
        assert_eq!(bf16.dtype(), DType::BF16);
        assert_eq!(bf16.shape(), &[11]);
        let want_bf16 = [
            16256u16, 16256, 16258, 49184, 18304, 18313, 12844, 0, 32610, 32768, 15821,
        ];
        let f16 = t.cast(DType::F16).unwrap();
        let want_f16 = [
            15360u16, 15364, 15372, 49408, 31743, 31744, 0, 0, 31744, 32768, 11878,
        ];
        for (got, want, nan) in [
            (u16s(&bf16), want_bf16, (0x7f80u16, 0x7fu16)),
            (u16s(&f16), want_f16, (0x7c00, 0x3ff)),
        ] {
            let (exponent, mantissa) = nan;
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                if i == 7 {
                    let is_nan = g & exponent == exponent && g & mantissa != 0;
                    assert!(is_nan, "NaN stays NaN: {g:#x}");
                } else {
                    assert_eq!(*g, w, "element {i}");
                }
            }
        }
        // Back to f32: exact widening.
        let back = bf16.cast(DType::F32).unwrap().to_f32().unwrap();
        assert_eq!(back[2], 1.015_625);
        // f64 sources round once: torch.tensor([0.1, 1.0000000001, 1e300], dtype=float64).
        let f64s: Vec<u8> = [0.1f64, 1.000_000_000_1, 1e300]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let t64 = TensorBytes::new(DType::F64, vec![3], f64s).unwrap();
        assert_eq!(u16s(&t64.cast(DType::BF16).unwrap()), [15821, 16256, 32640]);
        assert_eq!(u16s(&t64.cast(DType::F16).unwrap()), [11878, 15360, 31744]);
        let f32s: Vec<u32> = t64
            .cast(DType::F32)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(f32s, [1_036_831_949, 1_065_353_216, 2_139_095_040]);
        // f16 → bf16: torch.tensor([1.0009765625, 0.0001, 65504.0], dtype=float16).
        let h = TensorBytes::new(
            DType::F16,
            vec![3],
            [15361u16, 1678, 31743]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        )
        .unwrap();
        assert_eq!(u16s(&h.cast(DType::BF16).unwrap()), [16256, 14546, 18304]);
        // Ids keep their dtype; integer targets are refused.
        let ids = TensorBytes::new(DType::I64, vec![1], 5i64.to_le_bytes().to_vec()).unwrap();
        assert_eq!(ids.cast(DType::BF16).unwrap(), ids);
        assert!(t.cast(DType::I32).is_err());
    }

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
}
