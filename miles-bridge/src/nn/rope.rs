//! [`Rope`]: rotary position embedding tables for per-token positions.

use burn::tensor::{Int, Tensor, TensorData};

/// cos / sin tables of partial, non-interleaved ("rotate half") RoPE for one batch.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `[batch, 1, seq, rotary_dim]`.
    cos: Tensor<4>,
    /// `[batch, 1, seq, rotary_dim]`.
    sin: Tensor<4>,
    rotary_dim: usize,
}

impl Rope {
    /// Tables for per-token `positions` (`[batch, seq]`) and the `rotary_dim / 2` inverse
    /// frequencies (see `ModelConfig::inv_freq`).
    pub fn new(positions: Tensor<2, Int>, inv_freq: Vec<f32>) -> Self {
        let device = positions.device();
        let [batch, seq] = positions.dims();
        let half = inv_freq.len();
        let rotary_dim = 2 * half;
        let inv_freq = Tensor::<1>::from_data(TensorData::new(inv_freq, [half]), &device)
            .reshape([1, 1, half]);
        let freqs = positions.float().reshape([batch, seq, 1]) * inv_freq;
        let emb = Tensor::cat(vec![freqs.clone(), freqs], 2).unsqueeze_dim::<4>(1);
        Self {
            cos: emb.clone().cos(),
            sin: emb.sin(),
            rotary_dim,
        }
    }

    /// Rotates the first `rotary_dim` channels of `x` (`[batch, heads, seq, head_dim]`).
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        if self.rotary_dim == 0 {
            return x;
        }
        let [batch, _, seq, _] = x.dims();
        // The tables are f32; in half precision they are rounded to the compute dtype
        // first, as transformers does.
        let dtype = x.dtype();
        let table = |t: &Tensor<4>| t.clone().reshape([batch, seq, self.rotary_dim]).cast(dtype);
        let (cos, sin) = (table(&self.cos), table(&self.sin));
        // One fused op on flex, tensor ops elsewhere (the tables match `x` by construction).
        miles_ops::rope(x.clone(), cos.clone(), sin.clone())
            .unwrap_or_else(|_| miles_ops::rope_reference(x, cos, sin))
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::Device;

    use super::*;

    #[test]
    fn rope_rotates_halves_by_hand_computed_angles() {
        let device = Device::flex();
        // head_dim 6, rotary 4: channels (0,2) and (1,3) rotate, 4..6 pass through.
        let x = Tensor::<4>::from_data([[[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]]], &device);
        let pos = Tensor::<2, Int>::from_data([[3]], &device);
        let y = Rope::new(pos, vec![1.0, 0.1])
            .apply(x)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let (a0, a1) = (3.0f64, 3.0f64 * 0.1f32 as f64);
        let expect = [
            1.0 * a0.cos() - 3.0 * a0.sin(),
            2.0 * a1.cos() - 4.0 * a1.sin(),
            3.0 * a0.cos() + 1.0 * a0.sin(),
            4.0 * a1.cos() + 2.0 * a1.sin(),
            5.0,
            6.0,
        ];
        for (got, want) in y.iter().zip(expect) {
            assert!((*got as f64 - want).abs() < 1e-5, "{y:?}");
        }
    }
}
