//! How parameters are made and visited: the weight [`Builder`] used by `init` and the
//! importers (random or loaded by name, in the model's dtype), and the parameter visitors
//! ([`ParamRef`], [`ParamVisitor`]) used by export, optimizers and gradient checks.

use burn::module::Param;
use burn::tensor::{DType, Device, Distribution, FloatDType, Tensor, TensorData};

use miles_core::NamedTensors;

use crate::error::BridgeError;

/// How a freshly initialised parameter is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Init {
    /// Normal(0, initializer_range).
    Normal,
    /// All ones (norm weights).
    Ones,
    /// All zeros (biases).
    Zeros,
}

/// Where parameter values come from while a model is being built.
pub(crate) enum WeightSource<'a> {
    /// Random initialisation with the given standard deviation.
    Random {
        /// Standard deviation of `Init::Normal` parameters.
        std: f64,
    },
    /// Tensors by our name (see [`crate::names`]); each one is removed when used.
    Loaded(&'a mut NamedTensors),
}

/// Creates parameters by name on one device.
pub(crate) struct Builder<'a> {
    pub(crate) device: Device,
    pub(crate) source: WeightSource<'a>,
    /// The dtype parameters are created in (cast once, as they are made); buffers that stay
    /// `f32` in every precision ([`keeps_f32`]) ignore it.
    pub(crate) dtype: FloatDType,
}

/// Whether the parameter `name` stays `f32` whatever the model's precision: GLM's
/// `e_score_correction_bias`, which only ranks experts (transformers keeps it in `f32` too).
pub(crate) fn keeps_f32(name: &str) -> bool {
    name.ends_with("e_score_correction_bias")
}

impl Builder<'_> {
    /// A trainable parameter `name` of `shape`.
    pub(crate) fn param<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        init: Init,
    ) -> Result<Param<Tensor<D>>, BridgeError> {
        let dtype: DType = if keeps_f32(name) {
            DType::F32
        } else {
            self.dtype.into()
        };
        let tensor = match &mut self.source {
            WeightSource::Random { std } => match init {
                Init::Normal => {
                    Tensor::<D>::random(shape, Distribution::Normal(0.0, *std), &self.device)
                }
                Init::Ones => Tensor::<D>::ones(shape, &self.device),
                Init::Zeros => Tensor::<D>::zeros(shape, &self.device),
            }
            .cast(dtype),
            WeightSource::Loaded(map) => {
                let host = map.remove(name).ok_or_else(|| BridgeError::MissingTensor {
                    name: name.to_string(),
                })?;
                if host.shape() != shape {
                    return Err(BridgeError::ShapeMismatch {
                        name: name.to_string(),
                        expected: shape.to_vec(),
                        got: host.shape().to_vec(),
                    });
                }
                // One conversion from the file's dtype to the model's.
                let values = host.to_f32().map_err(|_| BridgeError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: host.dtype().name().to_string(),
                })?;
                Tensor::<D>::from_data(TensorData::new(values, shape), (&self.device, dtype))
            }
        };
        Ok(Param::from_tensor(tensor))
    }
}

/// A borrowed parameter of any rank, as handed out by the parameter visitors.
#[derive(Debug, Clone, Copy)]
pub enum ParamRef<'a> {
    /// A vector (norm weights, biases).
    R1(&'a Param<Tensor<1>>),
    /// A matrix (projections, embeddings).
    R2(&'a Param<Tensor<2>>),
    /// A stack of matrices (routed experts).
    R3(&'a Param<Tensor<3>>),
}

impl ParamRef<'_> {
    /// Shape of the parameter.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Self::R1(p) => p.val().dims().to_vec(),
            Self::R2(p) => p.val().dims().to_vec(),
            Self::R3(p) => p.val().dims().to_vec(),
        }
    }

    /// Current value, copied to the host.
    pub fn to_data(&self) -> TensorData {
        match self {
            Self::R1(p) => p.val().into_data(),
            Self::R2(p) => p.val().into_data(),
            Self::R3(p) => p.val().into_data(),
        }
    }

    /// Its gradient in `grads`, copied to the host (`None` when it received none).
    pub fn grad(&self, grads: &burn::tensor::Gradients) -> Option<TensorData> {
        match self {
            Self::R1(p) => p.val().grad(grads).map(Tensor::into_data),
            Self::R2(p) => p.val().grad(grads).map(Tensor::into_data),
            Self::R3(p) => p.val().grad(grads).map(Tensor::into_data),
        }
    }
}

/// Callback type of the parameter visitors: `(our parameter name, parameter)`.
pub type ParamVisitor<'v> = dyn FnMut(&str, ParamRef<'_>) + 'v;
