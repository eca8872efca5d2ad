//! [`MlaConfig`]: the shapes of multi-head latent attention.

/// Multi-head latent attention shapes (DeepSeek-V3): queries through `q_proj`, or the
/// low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj` when `q_lora_rank` is set; keys and
/// values from one compressed latent (`kv_a_proj_with_mqa` → `kv_lora_rank` latent channels,
/// RMS-normalised by `kv_a_layernorm`, plus `qk_rope_head_dim` shared rotary key channels),
/// expanded per head by `kv_b_proj` into `qk_nope_head_dim` key and `v_head_dim` value
/// channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Rank of the query compression (`None`: a full `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Rank of the key / value latent.
    pub kv_lora_rank: usize,
    /// Per-head query / key channels without position encoding.
    pub qk_nope_head_dim: usize,
    /// Per-head query / key channels with RoPE (the rotary key is shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Per-head value channels.
    pub v_head_dim: usize,
    /// Whether the rotary channels are stored as interleaved pairs (DeepSeek's layout;
    /// `rope_interleave`, default true).
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// Query / key channels per head (`qk_nope_head_dim + qk_rope_head_dim`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}
