//! [`Precision`]: the compute dtype of a run, Miles' (Megatron's) `--bf16` / `--fp16`.
//!
//! One setting for both sides of the RL loop, as in Miles: the trainer's forward computes in
//! it (master weights and AdamW state stay `f32`, see miles-train), the embedded engine holds
//! its weights, their fused / packed copies and the KV cache in it, and the weights exported
//! for the engines are written in it. `CausalLm::to_precision`
//! casts a model; what the forward keeps in `f32` regardless (RMSNorm statistics, attention
//! scores and softmax, MoE router scores, the log-prob / loss computation) is listed there.
//!
//! ```
//! use miles_bridge::Precision;
//! use miles_core::DType;
//!
//! assert_eq!(Precision::from_flags(false, false)?, Precision::F32); // the default
//! assert_eq!(Precision::from_flags(true, false)?, Precision::Bf16); // --bf16
//! assert!(Precision::from_flags(true, true).is_err()); // --bf16 --fp16
//! assert_eq!("bf16".parse::<Precision>()?.checkpoint_dtype(), DType::BF16);
//! assert_eq!(Precision::F16.served_name(), "float16");
//! # Ok::<(), miles_bridge::BridgeError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use burn::tensor::{DType, Device, FloatDType};
use serde::{Deserialize, Serialize};

use crate::error::BridgeError;

/// The dtype a model computes in (see the module docs): a policy over the storage dtype
/// ([`Precision::checkpoint_dtype`] is the [`miles_core::DType`] its weights are exported in),
/// not a storage dtype itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum Precision {
    /// `f32` everywhere (no flag): what miles-rs did before this setting existed.
    #[default]
    #[serde(rename = "fp32", alias = "f32", alias = "float32")]
    F32,
    /// bfloat16 (`--bf16`).
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
    /// IEEE binary16 (`--fp16`).
    #[serde(rename = "fp16", alias = "f16", alias = "float16")]
    F16,
}

impl Precision {
    /// The precision Miles' flags select: `--bf16` → bf16, `--fp16` → fp16, neither → f32;
    /// both is an error (Megatron rejects the combination too).
    pub fn from_flags(bf16: bool, fp16: bool) -> Result<Self, BridgeError> {
        match (bf16, fp16) {
            (false, false) => Ok(Self::F32),
            (true, false) => Ok(Self::Bf16),
            (false, true) => Ok(Self::F16),
            (true, true) => Err(BridgeError::Config {
                field: "--bf16 / --fp16".into(),
                message: "choose one compute dtype: --bf16 and --fp16 exclude each other".into(),
            }),
        }
    }

    /// The burn float dtype of tensors in this precision.
    pub fn float_dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16 => FloatDType::BF16,
            Self::F16 => FloatDType::F16,
        }
    }

    /// The same as a burn [`DType`].
    pub fn dtype(self) -> DType {
        self.float_dtype().into()
    }

    /// The dtype weights are exported / published in for engines serving this precision.
    pub fn checkpoint_dtype(self) -> miles_core::DType {
        match self {
            Self::F32 => miles_core::DType::F32,
            Self::Bf16 => miles_core::DType::BF16,
            Self::F16 => miles_core::DType::F16,
        }
    }

    /// SGLang's `--dtype` spelling (`/get_server_info`'s `dtype`): torch's name of
    /// [`Precision::checkpoint_dtype`].
    pub fn served_name(self) -> &'static str {
        self.checkpoint_dtype().torch_name()
    }

    /// The precision of tensors of `dtype`, if it is one of the three float dtypes.
    pub fn of_dtype(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Self::F32),
            DType::BF16 => Some(Self::Bf16),
            DType::F16 => Some(Self::F16),
            _ => None,
        }
    }

    /// Ok when `device` stores and computes in this precision's dtype (burn's
    /// `Device::supports_dtype`; f32 always is); a [`BridgeError::Config`] naming the device
    /// otherwise (e.g. bf16 on wgpu: WGSL has no bf16).
    pub fn check_device(self, device: &Device) -> Result<(), BridgeError> {
        if self == Self::F32 || device.supports_dtype(self.dtype()) {
            return Ok(());
        }
        Err(BridgeError::Config {
            field: "precision".into(),
            message: format!(
                "device {device:?} does not support {self} arithmetic; use another precision \
                 or device"
            ),
        })
    }

    /// Whether this is a half-precision setting.
    pub fn is_half(self) -> bool {
        self != Self::F32
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "fp32",
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
        })
    }
}

impl FromStr for Precision {
    type Err = BridgeError;

    /// A float dtype's name as [`miles_core::DType`] reads it: `fp32` / `f32` / `float32`,
    /// `bf16` / `bfloat16`, `fp16` / `f16` / `float16` / `half`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.parse::<miles_core::DType>() {
            Ok(miles_core::DType::F32) => Ok(Self::F32),
            Ok(miles_core::DType::BF16) => Ok(Self::Bf16),
            Ok(miles_core::DType::F16) => Ok(Self::F16),
            _ => Err(BridgeError::Config {
                field: "precision".into(),
                message: format!(
                    "`{}` is not one of fp32, bf16, fp16",
                    text.trim().to_ascii_lowercase()
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_names_and_serde() {
        assert_eq!(Precision::from_flags(false, true).unwrap(), Precision::F16);
        let err = Precision::from_flags(true, true).unwrap_err().to_string();
        assert!(err.contains("exclude each other"), "{err}");
        for p in [Precision::F32, Precision::Bf16, Precision::F16] {
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(json, format!("\"{p}\""));
            assert_eq!(serde_json::from_str::<Precision>(&json).unwrap(), p);
            assert_eq!(Precision::of_dtype(p.dtype()), Some(p));
        }
        assert!("fp8".parse::<Precision>().is_err());
        assert_eq!(
            serde_json::from_str::<Precision>("\"bfloat16\"").unwrap(),
            Precision::Bf16
        );
    }
}
