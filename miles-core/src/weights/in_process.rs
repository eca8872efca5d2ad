//! [`InProcessWeights`]: a trainer's weights handed to an engine of the same process as they
//! are, without a host copy.

use std::any::Any;
use std::sync::Arc;

/// A trainer's current weights as an opaque in-process value (for the embedded engine: the
/// trainer's `miles_bridge::CausalLm` in the dtype its host export would have, sharing the
/// trainer's buffers), handed to an engine of the same process by
/// [`crate::InferenceEngine::update_weights_in_process`] instead of HF-named host tensors.
///
/// The value is immutable once exported: a trainer that updates a buffer the engine still
/// holds writes a copy (copy-on-write), so the engine keeps serving exactly the version it
/// was given. Engines that cannot take the value (another type, another device, a remote
/// server) say so and the caller pushes [`crate::NamedTensors`] instead.
#[derive(Clone)]
pub struct InProcessWeights(Arc<dyn Any + Send + Sync>);

impl InProcessWeights {
    /// Wraps `value`.
    pub fn new<T: Any + Send + Sync>(value: T) -> Self {
        Self(Arc::new(value))
    }

    /// The value, when it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref::<T>()
    }
}

impl std::fmt::Debug for InProcessWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InProcessWeights(..)")
    }
}
