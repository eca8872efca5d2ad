//! Small helpers shared by the native flex kernels of the fused model ops.

use std::borrow::Cow;

use burn::backend::{DType, Flex, TensorMetadata, tensor::FloatTensor};
use burn::tensor::TensorData;

/// The contiguous `f32` data of `t` in logical order (copied when `t` is a strided view).
pub(crate) fn f32_data(t: &FloatTensor<Flex>) -> Cow<'_, [f32]> {
    match t.as_slice::<f32>() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(
            t.to_contiguous()
                .as_slice::<f32>()
                .map(<[f32]>::to_vec)
                .unwrap_or_default(),
        ),
    }
}

/// `t` as `f32` (cast when it holds another float dtype).
pub(crate) fn as_f32(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    if t.dtype() == DType::F32 {
        t
    } else {
        <Flex as burn::backend::ops::FloatTensorOps<Flex>>::float_cast(
            t,
            burn::backend::FloatDType::F32,
        )
    }
}

/// A contiguous tensor of `shape` holding `data`.
pub(crate) fn tensor(data: Vec<f32>, shape: &[usize]) -> FloatTensor<Flex> {
    FloatTensor::<Flex>::from_data(TensorData::new(data, shape.to_vec()))
}

/// The dims of `t`.
pub(crate) fn dims(t: &FloatTensor<Flex>) -> Vec<usize> {
    t.shape().iter().copied().collect()
}

/// Whether the fused ops take tensors of these dtypes on `device`: `f32` on flex and, with
/// the `wgpu` / `cuda` feature, on CubeCL devices (with or without autodiff).
pub(crate) fn takes_fused(dtypes: &[burn::tensor::DType], device: &burn::tensor::Device) -> bool {
    dtypes.iter().all(|d| *d == burn::tensor::DType::F32) && crate::runs_fused(device)
}
