//! One parser of `--device` strings into a burn [`Device`], used by every binary.
//!
//! | spec | device |
//! |---|---|
//! | `flex` (alias `cpu`) | burn's CPU backend; the fused flex kernels run |
//! | `wgpu` | the wgpu runtime on its default adapter (a high-power GPU when there is one) |
//! | `wgpu:N` | the wgpu runtime on the `N`-th discrete GPU |
//! | `wgpu-cpu` | the wgpu runtime on a CPU adapter (Mesa lavapipe): CubeCL kernels without a GPU |
//! | `cuda` / `cuda:N` | burn's CUDA runtime (feature `cuda`, which needs network access to build) |
//!
//! `wgpu*` needs the crate feature `wgpu`, `cuda*` the feature `cuda`; without it the spec is
//! a [`DeviceError::NotBuilt`] naming the feature, never a silent fallback to the CPU.
//!
//! ```
//! use miles_ops::device::DeviceSpec;
//!
//! let spec: DeviceSpec = "wgpu:1".parse()?;
//! assert_eq!(spec, DeviceSpec::Wgpu(Some(1)));
//! assert_eq!(spec.to_string(), "wgpu:1");
//! let cpu = miles_ops::device::parse_device("cpu")?;
//! assert_eq!(cpu, burn::tensor::Device::flex());
//! assert!("tpu".parse::<DeviceSpec>().is_err());
//! # Ok::<(), miles_ops::device::DeviceError>(())
//! ```

use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;

/// Why a `--device` string gives no device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Not one of the accepted spellings.
    #[error(
        "unknown device {spec:?}: expected flex | cpu | wgpu[:INDEX] | wgpu-cpu | cuda[:INDEX]"
    )]
    Unknown {
        /// What was given.
        spec: String,
    },
    /// A runtime this build does not contain.
    #[error("device {spec:?} needs miles-rs built with the `{feature}` feature")]
    NotBuilt {
        /// What was given.
        spec: String,
        /// The cargo feature that adds it.
        feature: &'static str,
    },
    /// The runtime is built but found no such adapter.
    #[error("device {spec:?} is not available: {reason}")]
    Unavailable {
        /// What was given.
        spec: String,
        /// The runtime's message.
        reason: String,
    },
}

/// A parsed `--device` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// burn's CPU backend (`flex`, `cpu`).
    #[default]
    Flex,
    /// The wgpu runtime: default adapter (`None`) or the `N`-th discrete GPU.
    Wgpu(Option<usize>),
    /// The wgpu runtime on a CPU adapter (lavapipe).
    WgpuCpu,
    /// burn's CUDA runtime on GPU `N`.
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let unknown = || DeviceError::Unknown { spec: s.to_owned() };
        let spec = s.trim().to_ascii_lowercase();
        let (kind, index) = match spec.split_once(':') {
            Some((kind, index)) => {
                let index: usize = index.parse().map_err(|_| unknown())?;
                (kind.to_owned(), Some(index))
            }
            None => (spec, None),
        };
        match (kind.as_str(), index) {
            ("flex" | "cpu", None) => Ok(Self::Flex),
            ("wgpu", index) => Ok(Self::Wgpu(index)),
            ("wgpu-cpu", None) => Ok(Self::WgpuCpu),
            ("cuda", index) => Ok(Self::Cuda(index.unwrap_or(0))),
            _ => Err(unknown()),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Flex => f.write_str("flex"),
            Self::Wgpu(None) => f.write_str("wgpu"),
            Self::Wgpu(Some(i)) => write!(f, "wgpu:{i}"),
            Self::WgpuCpu => f.write_str("wgpu-cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl DeviceSpec {
    /// Whether this build can create the device (its runtime feature is on).
    pub fn is_built(&self) -> bool {
        match self {
            Self::Flex => true,
            Self::Wgpu(_) | Self::WgpuCpu => cfg!(feature = "wgpu"),
            Self::Cuda(_) => cfg!(feature = "cuda"),
        }
    }

    /// Creates the device (initialising its runtime once per process for wgpu).
    pub fn init(&self) -> Result<Device, DeviceError> {
        let spec = self.to_string();
        match *self {
            Self::Flex => Ok(Device::flex()),
            Self::Wgpu(index) => wgpu(spec, index.map_or(WgpuKind::Default, WgpuKind::Discrete)),
            Self::WgpuCpu => wgpu(spec, WgpuKind::Cpu),
            Self::Cuda(index) => cuda(spec, index),
        }
    }
}

/// Whether tensors on `device` (with or without autodiff) live in host memory (flex), so
/// reading one back is a copy with no device synchronisation. Callers that read several
/// tensors per step batch them into one read where this is false.
pub fn reads_are_free(device: &Device) -> bool {
    matches!(
        device.clone().without_autodiff().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    )
}

/// Parses and creates a device in one call (`--device` values).
pub fn parse_device(spec: &str) -> Result<Device, DeviceError> {
    spec.parse::<DeviceSpec>()?.init()
}

#[allow(dead_code)]
enum WgpuKind {
    Default,
    Discrete(usize),
    Cpu,
}

#[cfg(feature = "wgpu")]
fn wgpu(spec: String, kind: WgpuKind) -> Result<Device, DeviceError> {
    use burn::tensor::DeviceKind;
    if matches!(kind, WgpuKind::Cpu) {
        // One CPU adapter per process, shared with the kernel tests.
        return crate::kernels::kernel_device()
            .map_err(|reason| DeviceError::Unavailable { spec, reason });
    }
    let kind = match kind {
        WgpuKind::Discrete(i) => DeviceKind::DiscreteGpu(i),
        _ => DeviceKind::DefaultDevice,
    };
    Device::wgpu_options()
        .device_kind(kind)
        .init()
        .map_err(|e| DeviceError::Unavailable {
            spec,
            reason: e.to_string(),
        })
}

#[cfg(not(feature = "wgpu"))]
fn wgpu(spec: String, _kind: WgpuKind) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt {
        spec,
        feature: "wgpu",
    })
}

#[cfg(feature = "cuda")]
fn cuda(_spec: String, index: usize) -> Result<Device, DeviceError> {
    Ok(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn cuda(spec: String, _index: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt {
        spec,
        feature: "cuda",
    })
}

/// Whether `device` is burn's flex CPU backend (with or without autodiff): host and device
/// memory are the same, so reading a tensor back (e.g. MoE routing ids for sparse dispatch)
/// is a copy, not a device-to-host round trip.
pub fn is_flex(device: &Device) -> bool {
    matches!(
        device.clone().without_autodiff().as_dispatch(),
        burn::backend::DispatchDevice::Flex(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_mistakes_are_typed() {
        for (text, spec) in [
            ("flex", DeviceSpec::Flex),
            ("CPU", DeviceSpec::Flex),
            ("wgpu", DeviceSpec::Wgpu(None)),
            ("wgpu:2", DeviceSpec::Wgpu(Some(2))),
            ("wgpu-cpu", DeviceSpec::WgpuCpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec, "{text}");
        }
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap().to_string(), "cuda:0");
        for bad in [
            "",
            "gpu",
            "wgpu:",
            "wgpu:x",
            "flex:1",
            "wgpu-cpu:0",
            "cuda:-1",
        ] {
            assert!(
                matches!(bad.parse::<DeviceSpec>(), Err(DeviceError::Unknown { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_runtime_that_is_not_built_names_its_feature() {
        if !cfg!(feature = "cuda") {
            let err = parse_device("cuda:1").unwrap_err();
            assert_eq!(
                err,
                DeviceError::NotBuilt {
                    spec: "cuda:1".into(),
                    feature: "cuda"
                }
            );
            assert!(err.to_string().contains("`cuda` feature"), "{err}");
        }
        if !cfg!(feature = "wgpu") {
            assert!(matches!(
                parse_device("wgpu-cpu"),
                Err(DeviceError::NotBuilt {
                    feature: "wgpu",
                    ..
                })
            ));
        }
        assert_eq!(parse_device("flex").unwrap(), Device::flex());
    }
}
