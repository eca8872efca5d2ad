//! [`TensorBytes`]: one host tensor (dtype, shape, little-endian bytes), with torch's
//! float casts.

use std::io::Write;

use super::dtype::DType;
use crate::error::{Error, Result};

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

    /// The values as f32: exact for `F32`, `BF16` and `F16` (widening), rounded to nearest,
    /// ties to even, for `F64`. Non-float tensors (ids, masks) are an error.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let data = &self.data;
        Ok(match self.dtype {
            DType::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DType::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DType::F64 => data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap_or_default()) as f32)
                .collect(),
            other => {
                return Err(Error::Tensor {
                    name: String::new(),
                    reason: format!("expected a float tensor, found {other:?}"),
                });
            }
        })
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

    /// The little-endian bytes, by value.
    pub fn into_data(self) -> Vec<u8> {
        self.data
    }

    /// The slices along the first dimension (`t[0]`, `t[1]`, …), each of shape
    /// `shape[1..]`; none for a scalar.
    pub fn unstack(&self) -> Vec<Self> {
        let Some((&outer, inner)) = self.shape.split_first() else {
            return Vec::new();
        };
        let per = self.data.len() / outer.max(1);
        (0..outer)
            .map(|i| Self {
                dtype: self.dtype,
                shape: inner.to_vec(),
                data: self.data[i * per..(i + 1) * per].to_vec(),
            })
            .collect()
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
    pub(super) fn cast_target(&self, to: DType) -> Result<DType> {
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
    pub(super) fn write_as(&self, to: DType, out: &mut impl Write) -> std::io::Result<()> {
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The elements of a 2-byte tensor as `u16` bit patterns.
    pub(in crate::weights) fn u16s(t: &TensorBytes) -> Vec<u16> {
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

    #[test]
    fn dtype_conversion_is_exact_where_representable() {
        let t = TensorBytes::from_f32(vec![4], &[1.0, -2.5, 0.15625, 65504.0]).unwrap();
        for d in [DType::BF16, DType::F16] {
            let back = t.cast(d).unwrap().cast(DType::F32).unwrap();
            assert_eq!(back.to_f32().unwrap()[..3], [1.0, -2.5, 0.15625]);
        }
        // bf16 of 1 + 2^-9 rounds to 1 (8 mantissa bits), f16 keeps it.
        let fine = TensorBytes::from_f32(vec![1], &[1.0 + 1.0 / 512.0]).unwrap();
        assert_eq!(fine.cast(DType::BF16).unwrap().to_f32().unwrap(), vec![1.0]);
        assert_eq!(
            fine.cast(DType::F16).unwrap().to_f32().unwrap(),
            vec![1.0 + 1.0 / 512.0]
        );
    }

    #[test]
    fn f64_narrows_and_ids_are_not_floats() {
        let f64s = TensorBytes::new(DType::F64, vec![1], 0.1f64.to_le_bytes().to_vec()).unwrap();
        assert_eq!(f64s.to_f32().unwrap(), vec![0.1f32]);
        let ids = TensorBytes::new(DType::I64, vec![1], 5i64.to_le_bytes().to_vec()).unwrap();
        assert!(ids.to_f32().is_err());
        // Slices along dim 0 keep the dtype and the bytes.
        let stacked = TensorBytes::new(DType::I16, vec![3, 1], vec![1, 0, 2, 0, 3, 0]).unwrap();
        let parts = stacked.unstack();
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts[2],
            TensorBytes::new(DType::I16, vec![1], vec![3, 0]).unwrap()
        );
        assert!(ids.unstack()[0].shape().is_empty());
        assert_eq!(ids.clone().into_data(), 5i64.to_le_bytes().to_vec());
    }
}
