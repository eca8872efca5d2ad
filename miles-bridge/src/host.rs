//! Tensors on the host: [`HostTensor`] (little-endian bytes in a [`FloatDtype`], row-major
//! shape) and [`TensorMap`], what checkpoints are read into and written from.

use std::collections::BTreeMap;
use std::fmt;

use half::{bf16, f16};

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

    /// The same dtype in miles-core's vocabulary.
    pub(crate) fn core(self) -> miles_core::DType {
        match self {
            Self::F32 => miles_core::DType::F32,
            Self::Bf16 => miles_core::DType::BF16,
            Self::F16 => miles_core::DType::F16,
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
