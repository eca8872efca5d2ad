//! Weight versions and named tensors: what weight export, checkpoints and engine weight
//! updates carry.

use std::collections::BTreeMap;
use std::fmt;
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
        // The header is written entry by entry, in the library's order, rather than through a
        // `serde_json::Map` (whose order depends on serde_json's `preserve_order` feature).
        let json_string = |s: &str| Value::String(s.to_owned()).to_string();
        let mut entries = Vec::with_capacity(self.tensors.len() + 1);
        if !self.metadata.is_empty() {
            let meta: Vec<String> = self
                .metadata
                .iter()
                .map(|(k, v)| format!("{}:{}", json_string(k), json_string(v)))
                .collect();
            entries.push(format!("\"__metadata__\":{{{}}}", meta.join(",")));
        }
        let mut order: Vec<(&String, &TensorBytes)> = self.tensors.iter().collect();
        // Stable: names stay in order within a dtype.
        order.sort_by_key(|(_, t)| std::cmp::Reverse(t.dtype.safetensors_rank()));
        let mut offset = 0usize;
        for (name, tensor) in &order {
            let end = offset + tensor.data.len();
            let shape: Vec<String> = tensor.shape.iter().map(ToString::to_string).collect();
            entries.push(format!(
                "{}:{{\"dtype\":{},\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
                json_string(name),
                json_string(tensor.dtype.name()),
                shape.join(","),
            ));
            offset = end;
        }
        let mut header_bytes = format!("{{{}}}", entries.join(",")).into_bytes();
        while !header_bytes.len().is_multiple_of(8) {
            header_bytes.push(b' ');
        }
        let mut out = Vec::with_capacity(8 + header_bytes.len() + offset);
        out.extend_from_slice(&(header_bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&header_bytes);
        for (_, tensor) in order {
            out.extend_from_slice(&tensor.data);
        }
        out
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
}
