//! [`DType`]: the element type of a host tensor, the one dtype enum of the workspace.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Element type of a tensor, with safetensors' names (`"F32"`, `"BF16"`, …).
///
/// The one storage dtype of the workspace: checkpoints, exports, weight updates and the
/// engines' served dtype all speak it. Policies over it (miles-bridge's compute `Precision`,
/// miles-session's `WeightDtype`) are separate types that name a `DType`.
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

/// Every dtype with its safetensors name, torch's name (`torch.<name>`) and the other
/// spellings [`DType::from_str`] accepts (torch's aliases and the short forms of CLIs).
const NAMES: &[(DType, &str, &str, &[&str])] = &[
    (DType::F64, "F64", "float64", &["f64", "double", "fp64"]),
    (DType::F32, "F32", "float32", &["f32", "float", "fp32"]),
    (DType::F16, "F16", "float16", &["f16", "half", "fp16"]),
    (DType::BF16, "BF16", "bfloat16", &["bf16"]),
    (DType::I64, "I64", "int64", &["i64", "long"]),
    (DType::I32, "I32", "int32", &["i32", "int"]),
    (DType::I16, "I16", "int16", &["i16", "short"]),
    (DType::I8, "I8", "int8", &["i8"]),
    (DType::U64, "U64", "uint64", &["u64"]),
    (DType::U32, "U32", "uint32", &["u32"]),
    (DType::U16, "U16", "uint16", &["u16"]),
    (DType::U8, "U8", "uint8", &["u8"]),
    (DType::BOOL, "BOOL", "bool", &[]),
];

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
    pub(super) fn safetensors_rank(self) -> u8 {
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

    /// Whether this is a floating-point type (the types [`crate::TensorBytes::cast`]
    /// converts between).
    pub fn is_float(self) -> bool {
        matches!(self, Self::F64 | Self::F32 | Self::F16 | Self::BF16)
    }

    fn names(self) -> &'static (DType, &'static str, &'static str, &'static [&'static str]) {
        // Every variant has its row.
        NAMES.iter().find(|row| row.0 == self).unwrap_or(&NAMES[0])
    }

    /// The safetensors name (`"BF16"`).
    pub fn name(self) -> &'static str {
        self.names().1
    }

    /// torch's name (`"bfloat16"`, as in `torch.bfloat16` and HF's `torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        self.names().2
    }

    /// The dtype of a safetensors header's `"dtype"` (exactly its name: `"BF16"`).
    pub fn from_safetensors_name(name: &str) -> Option<Self> {
        NAMES.iter().find(|row| row.1 == name).map(|row| row.0)
    }
}

impl fmt::Display for DType {
    /// The short lower-case name (`bf16`, `f32`, `i64`, `bool`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = self.names().3.first().copied().unwrap_or(self.torch_name());
        f.write_str(short)
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Any case of the safetensors name (`BF16`), torch's name (`bfloat16`), a torch alias
    /// (`half`, `float`, `double`, `long`, `int`, `short`) or a short form (`bf16`, `f32`,
    /// `fp16`, `i64`, `u8`).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        NAMES
            .iter()
            .find(|(_, name, torch, aliases)| {
                name.eq_ignore_ascii_case(&lower) || *torch == lower || aliases.contains(&&*lower)
            })
            .map(|row| row.0)
            .ok_or_else(|| Error::Parse {
                what: "dtype",
                input: s.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for (dtype, name, torch, aliases) in NAMES {
            assert_eq!(dtype.name(), *name);
            assert_eq!(DType::from_safetensors_name(name), Some(*dtype));
            for text in [name, torch].into_iter().chain(aliases.iter()) {
                assert_eq!(text.parse::<DType>().unwrap(), *dtype, "{text}");
                assert_eq!(text.to_uppercase().parse::<DType>().unwrap(), *dtype);
            }
            assert_eq!(dtype.to_string().parse::<DType>().unwrap(), *dtype);
        }
        assert_eq!(DType::BF16.to_string(), "bf16");
        assert_eq!(DType::BF16.torch_name(), "bfloat16");
        assert_eq!(DType::BOOL.to_string(), "bool");
        assert_eq!(DType::from_safetensors_name("bf16"), None);
        assert!("Q8".parse::<DType>().is_err());
    }
}
