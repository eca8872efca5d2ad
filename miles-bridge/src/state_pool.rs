//! The per-sequence state of a hybrid model's linear-attention layers in a paged cache:
//! [`StateLayer`] holds, for one Gated DeltaNet layer (Qwen3.5), the conv window and the
//! delta-rule state of every slot of the pool, allocated once; a sequence owns one slot (the
//! same index in every layer) while it runs.
//!
//! A slot's state is what the layer carries from one token to the next, so unlike keys it
//! has no per-position part: the slot's size does not depend on the sequence's length. A
//! decode step gathers the slots of its rows, runs the layer's recurrent form from them and
//! writes the states after the step back in place.
//!
//! The slots are stored flat (`[slots, window]` and `[slots, state]`, reshaped to a batch of
//! states on read): flex assigns rows of a 2-d tensor by whole-row copies, but assigns into a
//! tensor of more dimensions element by element with a division per dimension, which at 32
//! decode rows cost more than the delta rule itself.

use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};

use crate::nn::gated_delta::{GatedDeltaNet, LinearState};

/// One linear-attention layer's state slots.
#[derive(Debug)]
pub(crate) struct StateLayer {
    /// `[slots, (kernel - 1) · conv_dim]` in the layer's compute dtype; `None` only while a
    /// write holds it.
    conv: Option<Tensor<2>>,
    /// `[slots, value_heads · key_head_dim · value_head_dim]`, f32; `None` only while a write
    /// holds it.
    recurrent: Option<Tensor<2>>,
    /// One slot's conv window `[kernel - 1, conv_dim]`.
    conv_shape: [usize; 2],
    /// One slot's recurrent state `[value_heads, key_head_dim, value_head_dim]`.
    state_shape: [usize; 3],
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
            conv: Some(Tensor::zeros([slots, a * b], (device, dtype))),
            recurrent: Some(Tensor::zeros([slots, h * k * v], (device, DType::F32))),
            conv_shape: [a, b],
            state_shape: [h, k, v],
        }
    }

    /// Whether the slots have `layer`'s shapes.
    pub(crate) fn fits(&self, layer: &GatedDeltaNet) -> bool {
        let (conv, state) = slot_shape(layer);
        self.conv.is_some()
            && self.recurrent.is_some()
            && (conv, state) == (self.conv_shape, self.state_shape)
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
        let n = index.dims()[0];
        let ([a, b], [h, k, v]) = (self.conv_shape, self.state_shape);
        Some(LinearState {
            conv: self
                .conv
                .as_ref()?
                .clone()
                .select(0, index.clone())
                .reshape([n, a, b]),
            recurrent: self
                .recurrent
                .as_ref()?
                .clone()
                .select(0, index)
                .reshape([n, h, k, v]),
        })
    }

    /// Writes `state` (a batch of `index.len()` rows) into the slots `index`, in place.
    pub(crate) fn write(&mut self, index: Tensor<1, Int>, state: LinearState) {
        // Taken out so the pool is the only handle: burn then assigns in place.
        let n = index.dims()[0];
        if let Some(t) = self.conv.take() {
            let conv = state.conv.cast(t.dtype()).reshape([n, t.dims()[1]]);
            self.conv = Some(t.select_assign(0, index.clone(), conv, IndexingUpdateOp::Assign));
        }
        if let Some(t) = self.recurrent.take() {
            let recurrent = state.recurrent.cast(t.dtype()).reshape([n, t.dims()[1]]);
            self.recurrent = Some(t.select_assign(0, index, recurrent, IndexingUpdateOp::Assign));
        }
    }

    /// Zeroes the slots `index` (a sequence that has seen no token yet).
    pub(crate) fn zero(&mut self, index: Tensor<1, Int>) {
        let (Some(conv), Some(_)) = (&self.conv, &self.recurrent) else {
            return;
        };
        let n = index.dims()[0];
        let ([a, b], [h, k, v]) = (self.conv_shape, self.state_shape);
        let device = conv.device();
        let state = LinearState {
            conv: Tensor::zeros([n, a, b], (&device, conv.dtype())),
            recurrent: Tensor::zeros([n, h, k, v], (&device, DType::F32)),
        };
        self.write(index, state);
    }
}
