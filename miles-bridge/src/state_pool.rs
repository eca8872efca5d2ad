//! The per-sequence state of a hybrid model's linear-attention layers in a paged cache:
//! [`StateLayer`] holds, for one Gated DeltaNet layer (Qwen3.5), the conv window and the
//! delta-rule state of every slot of the pool, allocated once; a sequence owns one slot (the
//! same index in every layer) while it runs.
//!
//! A slot's state is what the layer carries from one token to the next, so unlike keys it
//! has no per-position part: the slot's size does not depend on the sequence's length. A
//! decode step gathers the slots of its rows, runs the layer's recurrent form from them and
//! writes the states after the step back in place.

use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::nn::gated_delta::{GatedDeltaNet, LinearState};

/// One linear-attention layer's state slots.
#[derive(Debug)]
pub(crate) struct StateLayer {
    /// `[slots, kernel - 1, conv_dim]` in the layer's compute dtype; `None` only while a
    /// write holds it.
    conv: Option<Tensor<3>>,
    /// `[slots, value_heads, key_head_dim, value_head_dim]`, f32; `None` only while a write
    /// holds it.
    recurrent: Option<Tensor<4>>,
}

/// The shapes of one slot of `layer`: the conv window `[kernel - 1, conv_dim]` and the
/// recurrent state `[value_heads, key_head_dim, value_head_dim]`.
pub(crate) fn slot_shape(layer: &GatedDeltaNet) -> ([usize; 2], [usize; 3]) {
    let conv_dim =
        2 * layer.num_key_heads * layer.key_head_dim + layer.num_value_heads * layer.value_head_dim;
    (
        [layer.kernel - 1, conv_dim],
        [
            layer.num_value_heads,
            layer.key_head_dim,
            layer.value_head_dim,
        ],
    )
}

/// Bytes one slot of `layer` takes (its conv window in `dtype`, its recurrent state in f32).
pub(crate) fn slot_bytes(layer: &GatedDeltaNet, dtype: DType) -> usize {
    let ([a, b], [h, k, v]) = slot_shape(layer);
    a * b * dtype.size() + h * k * v * DType::F32.size()
}

/// Slot numbers as an index tensor.
pub(crate) fn slot_index(slots: &[u32], device: &Device) -> Tensor<1, Int> {
    let index: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
    Tensor::from_data(TensorData::new(index, [slots.len()]), device)
}

impl StateLayer {
    /// `slots` zeroed slots for `layer`, conv windows in `dtype`, on `device`.
    pub(crate) fn new(layer: &GatedDeltaNet, slots: usize, dtype: DType, device: &Device) -> Self {
        let ([a, b], [h, k, v]) = slot_shape(layer);
        Self {
            conv: Some(Tensor::zeros([slots, a, b], (device, dtype))),
            recurrent: Some(Tensor::zeros([slots, h, k, v], (device, DType::F32))),
        }
    }

    /// Whether the slots have `layer`'s shapes.
    pub(crate) fn fits(&self, layer: &GatedDeltaNet) -> bool {
        let ([a, b], [h, k, v]) = slot_shape(layer);
        let conv = self.conv.as_ref().map(|t| t.dims());
        let recurrent = self.recurrent.as_ref().map(|t| t.dims());
        conv.is_some_and(|[_, x, y]| [x, y] == [a, b])
            && recurrent.is_some_and(|[_, x, y, z]| [x, y, z] == [h, k, v])
    }

    /// Bytes of every slot.
    pub(crate) fn bytes(&self) -> usize {
        let size = |dims: &[usize], dtype: DType| dims.iter().product::<usize>() * dtype.size();
        self.conv.as_ref().map_or(0, |t| size(&t.dims(), t.dtype()))
            + self
                .recurrent
                .as_ref()
                .map_or(0, |t| size(&t.dims(), t.dtype()))
    }

    /// The states of the slots `index` (in that order), as a batch.
    pub(crate) fn read(&self, index: Tensor<1, Int>) -> Option<LinearState> {
        Some(LinearState {
            conv: self.conv.as_ref()?.clone().select(0, index.clone()),
            recurrent: self.recurrent.as_ref()?.clone().select(0, index),
        })
    }

    /// Writes `state` (a batch of `index.len()` rows) into the slots `index`, in place.
    pub(crate) fn write(&mut self, index: Tensor<1, Int>, state: LinearState) {
        // Taken out so the pool is the only handle: burn then assigns in place.
        if let Some(t) = self.conv.take() {
            let conv = state.conv.cast(t.dtype());
            self.conv = Some(t.select_assign(0, index.clone(), conv, IndexingUpdateOp::Assign));
        }
        if let Some(t) = self.recurrent.take() {
            let recurrent = state.recurrent.cast(t.dtype());
            self.recurrent = Some(t.select_assign(0, index, recurrent, IndexingUpdateOp::Assign));
        }
    }

    /// Zeroes the slots `index` (a sequence that has seen no token yet).
    pub(crate) fn zero(&mut self, index: Tensor<1, Int>) {
        let (Some(conv), Some(recurrent)) = (&self.conv, &self.recurrent) else {
            return;
        };
        let n = index.dims()[0];
        let [_, a, b] = conv.dims();
        let [_, h, k, v] = recurrent.dims();
        let device = conv.device();
        let state = LinearState {
            conv: Tensor::zeros([n, a, b], (&device, conv.dtype())),
            recurrent: Tensor::zeros([n, h, k, v], (&device, DType::F32)),
        };
        self.write(index, state);
    }
}
