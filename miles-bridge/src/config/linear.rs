//! [`LinearAttentionConfig`]: the shapes of Qwen3.5's Gated DeltaNet layers.

/// The shapes of a Gated DeltaNet layer (Qwen3.5's `linear_*` config fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearAttentionConfig {
    /// `linear_conv_kernel_dim`: taps of the causal depthwise conv.
    pub conv_kernel_dim: usize,
    /// `linear_key_head_dim`.
    pub key_head_dim: usize,
    /// `linear_value_head_dim`.
    pub value_head_dim: usize,
    /// `linear_num_key_heads` (query and key heads).
    pub num_key_heads: usize,
    /// `linear_num_value_heads` (a multiple of the key heads).
    pub num_value_heads: usize,
}

impl LinearAttentionConfig {
    /// Channels of the fused q / k / v projection and of the conv: `2·keys + values`.
    pub fn conv_dim(&self) -> usize {
        2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim
    }
}
