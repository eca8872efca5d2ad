//! [`LatentAttention`]: DeepSeek-V3's multi-head latent attention (MLA), as transformers
//! 5.24's `DeepseekV3Attention` computes it.
//!
//! Queries: `q_proj(x)`, or `q_b_proj(q_a_layernorm(q_a_proj(x)))` with `q_lora_rank`;
//! each head splits into `qk_nope_head_dim` plain and `qk_rope_head_dim` rotary channels.
//! Keys / values: `kv_a_proj_with_mqa(x)` gives a `kv_lora_rank` latent `c` (RMS-normalised
//! by `kv_a_layernorm`, eps 1e-6 whatever `rms_norm_eps` says, as in transformers) and one
//! rotary key `k_rot` shared by all heads; `kv_b_proj(c)` expands the latent into each head's
//! `k_nope` and `v`. RoPE (YaRN-scaled when configured, cos / sin times YaRN's attention
//! factor) rotates `q_rot` and `k_rot`; with `rope_interleave` the rotary channels are
//! de-interleaved first (pairs `(x0, x1), (x2, x3), …` → `x0, x2, …, x1, x3, …`), which is
//! what transformers' interleaved rotation computes. Softmax scale:
//! `ModelConfig::softmax_scale`.
//!
//! Two equivalent evaluations, both through miles-ops' fused attention op:
//!
//! - **expanded** (training, prefill): keys `[k_nope, k_rot]` and values per head; when
//!   `v_head_dim` differs from `qk_nope + qk_rope`, the narrower side is zero-padded (zero
//!   channels change neither the scores nor the kept output channels) and the output narrowed
//!   back to `v_head_dim`;
//! - **absorbed** (decode steps): `kv_b_proj`'s key half is folded into the query
//!   (`q_lat = q_nope · W_uk`, `[heads, kv_lora_rank]`), so every head attends over the cached
//!   latent itself as one shared key / value head (`[c, k_rot]` as key, the same tensor as
//!   value), and the value half `W_uv` is applied to the attended latent afterwards. Nothing
//!   per head is ever materialised for the cached positions.
//!
//! With a cache, each call picks the evaluation with fewer multiply-adds for its shapes
//! (a prefill expands, a one-token decode step absorbs); both agree to float rounding.
//!
//! The KV cache of an MLA layer ([`LayerCache`]) holds only the compressed latent
//! after `kv_a_layernorm` and the rotated rope key: `keys = [c, k_rot]`,
//! `[batch, 1, cached, kv_lora_rank + qk_rope_head_dim]`, and no separate values — per token
//! `kv_lora_rank + qk_rope_head_dim` floats per layer instead of
//! `heads · (qk_nope + qk_rope + v_head_dim)`.

use burn::module::Module;
use burn::tensor::{Bool, Tensor};

use crate::config::MlaConfig;
use crate::error::BridgeError;
use crate::kv_cache::LayerCache;
use crate::nn::attention::{KvTarget, attend};
use crate::nn::linear::Linear;
use crate::nn::norm::RmsNorm;
use crate::nn::param::{Builder, ParamVisitor};
use crate::nn::rope::Rope;
use crate::profile::{self, OpClass};

/// transformers builds `q_a_layernorm` / `kv_a_layernorm` with the RMSNorm default eps.
const LATENT_NORM_EPS: f64 = 1e-6;

/// Multi-head latent attention (see the module docs). Parameters keep HF's names.
#[derive(Module, Debug)]
pub struct LatentAttention {
    /// `q_proj` (absent with `q_lora_rank`).
    pub q_proj: Option<Linear>,
    /// `q_a_proj` (with `q_lora_rank`; bias with `attention_bias`).
    pub q_a_proj: Option<Linear>,
    /// `q_a_layernorm` (with `q_lora_rank`).
    pub q_a_layernorm: Option<RmsNorm>,
    /// `q_b_proj` (with `q_lora_rank`).
    pub q_b_proj: Option<Linear>,
    /// `kv_a_proj_with_mqa`: `hidden → kv_lora_rank + qk_rope_head_dim` (bias with
    /// `attention_bias`).
    pub kv_a_proj_with_mqa: Linear,
    /// `kv_a_layernorm` over the latent.
    pub kv_a_layernorm: RmsNorm,
    /// `kv_b_proj`: `kv_lora_rank → heads · (qk_nope_head_dim + v_head_dim)`.
    pub kv_b_proj: Linear,
    /// `o_proj`: `heads · v_head_dim → hidden` (bias with `attention_bias`).
    pub o_proj: Linear,
    /// Query heads.
    pub num_heads: usize,
    /// Shapes.
    #[module(skip)]
    pub shape: MlaConfig,
    /// Softmax scale.
    pub scale: f64,
    /// Factor of RoPE's cos / sin (YaRN's attention factor; 1 otherwise).
    pub rope_factor: f64,
}

/// Which evaluation a call uses (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Evaluation {
    Expanded,
    Absorbed,
}

impl LatentAttention {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        hidden: usize,
        num_heads: usize,
        shape: MlaConfig,
        bias: bool,
        scale: f64,
        rope_factor: f64,
    ) -> Result<Self, BridgeError> {
        let qk = shape.qk_head_dim();
        let (q_proj, q_a_proj, q_a_layernorm, q_b_proj) = match shape.q_lora_rank {
            None => (
                Some(Linear::build(
                    b,
                    &format!("{name}.q_proj"),
                    hidden,
                    num_heads * qk,
                    false,
                )?),
                None,
                None,
                None,
            ),
            Some(rank) => (
                None,
                Some(Linear::build(
                    b,
                    &format!("{name}.q_a_proj"),
                    hidden,
                    rank,
                    bias,
                )?),
                Some(RmsNorm::build(
                    b,
                    &format!("{name}.q_a_layernorm"),
                    rank,
                    LATENT_NORM_EPS,
                )?),
                Some(Linear::build(
                    b,
                    &format!("{name}.q_b_proj"),
                    rank,
                    num_heads * qk,
                    false,
                )?),
            ),
        };
        Ok(Self {
            q_proj,
            q_a_proj,
            q_a_layernorm,
            q_b_proj,
            kv_a_proj_with_mqa: Linear::build(
                b,
                &format!("{name}.kv_a_proj_with_mqa"),
                hidden,
                shape.kv_lora_rank + shape.qk_rope_head_dim,
                bias,
            )?,
            kv_a_layernorm: RmsNorm::build(
                b,
                &format!("{name}.kv_a_layernorm"),
                shape.kv_lora_rank,
                LATENT_NORM_EPS,
            )?,
            kv_b_proj: Linear::build(
                b,
                &format!("{name}.kv_b_proj"),
                shape.kv_lora_rank,
                num_heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                false,
            )?,
            o_proj: Linear::build(
                b,
                &format!("{name}.o_proj"),
                num_heads * shape.v_head_dim,
                hidden,
                bias,
            )?,
            num_heads,
            shape,
            scale,
            rope_factor,
        })
    }

    /// Every linear layer with its name relative to the attention module, in a fixed order.
    pub(crate) fn linears(&self) -> Vec<(&'static str, &Linear)> {
        let mut out = Vec::with_capacity(6);
        if let Some(q) = &self.q_proj {
            out.push(("q_proj", q));
        }
        if let Some(q) = &self.q_a_proj {
            out.push(("q_a_proj", q));
        }
        if let Some(q) = &self.q_b_proj {
            out.push(("q_b_proj", q));
        }
        out.push(("kv_a_proj_with_mqa", &self.kv_a_proj_with_mqa));
        out.push(("kv_b_proj", &self.kv_b_proj));
        out.push(("o_proj", &self.o_proj));
        out
    }

    /// Mutable twin of [`Self::linears`] (same order).
    pub(crate) fn linears_mut(&mut self) -> Vec<(&'static str, &mut Linear)> {
        let mut out = Vec::with_capacity(6);
        if let Some(q) = &mut self.q_proj {
            out.push(("q_proj", q));
        }
        if let Some(q) = &mut self.q_a_proj {
            out.push(("q_a_proj", q));
        }
        if let Some(q) = &mut self.q_b_proj {
            out.push(("q_b_proj", q));
        }
        out.push(("kv_a_proj_with_mqa", &mut self.kv_a_proj_with_mqa));
        out.push(("kv_b_proj", &mut self.kv_b_proj));
        out.push(("o_proj", &mut self.o_proj));
        out
    }

    /// Queries `[batch * seq, heads * qk_head_dim]`.
    fn queries(&self, rows: Tensor<2>) -> Tensor<2> {
        match (
            &self.q_proj,
            &self.q_a_proj,
            &self.q_a_layernorm,
            &self.q_b_proj,
        ) {
            (_, Some(a), Some(norm), Some(b)) => b.forward(norm.forward(a.forward(rows))),
            (Some(q), ..) => q.forward(rows),
            // `build` creates exactly one of the two query paths.
            _ => unreachable!("MLA layer without a query projection"),
        }
    }

    /// `(x0, x1), (x2, x3), …` → `x0, x2, …, x1, x3, …` on the last dim.
    fn deinterleave(x: Tensor<4>) -> Tensor<4> {
        let [b, h, s, d] = x.dims();
        x.reshape([b, h, s, d / 2, 2])
            .swap_dims(3, 4)
            .reshape([b, h, s, d])
    }

    fn rotate(&self, x: Tensor<4>, rope: &Rope) -> Tensor<4> {
        let x = if self.shape.rope_interleave {
            Self::deinterleave(x)
        } else {
            x
        };
        let y = rope.apply(x);
        if self.rope_factor == 1.0 {
            y
        } else {
            y * self.rope_factor
        }
    }

    /// Attends `x` (`[batch, seq, hidden]`); `mask` is `[batch, 1, seq, cached + seq]`. With a
    /// cache, this step's latent and rope key are appended to it first.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: Tensor<4, Bool>,
        cache: Option<&mut Option<LayerCache>>,
    ) -> Tensor<3> {
        self.forward_kv(x, rope, KvTarget::new(mask, cache))
    }

    /// Key columns a cached position takes: the latent and the rope key.
    pub(crate) fn cache_width(&self) -> usize {
        self.shape.kv_lora_rank + self.shape.qk_rope_head_dim
    }

    /// [`LatentAttention::forward`] with the latent kept where `target` says.
    pub(crate) fn forward_kv(&self, x: Tensor<3>, rope: &Rope, target: KvTarget<'_>) -> Tensor<3> {
        let [batch, seq, hidden] = x.dims();
        let MlaConfig {
            kv_lora_rank: r,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rot,
            v_head_dim: vd,
            ..
        } = self.shape;
        let heads = self.num_heads;
        let qk = nope + rot;
        let rows = x.reshape([batch * seq, hidden]);
        let (q, compressed) = profile::time(OpClass::QkvProj, || {
            (
                self.queries(rows.clone())
                    .reshape([batch, seq, heads, qk])
                    .swap_dims(1, 2),
                self.kv_a_proj_with_mqa.forward(rows),
            )
        });
        let (q_nope, q_rot, mut kv) = profile::time(OpClass::Rope, || {
            let q_nope = q.clone().narrow(3, 0, nope);
            let q_rot = self.rotate(q.narrow(3, nope, rot), rope);
            let latent = self
                .kv_a_layernorm
                .forward(compressed.clone().narrow(1, 0, r))
                .reshape([batch, 1, seq, r]);
            let k_rot = self.rotate(
                compressed.narrow(1, r, rot).reshape([batch, 1, seq, rot]),
                rope,
            );
            (q_nope, q_rot, Tensor::cat(vec![latent, k_rot], 3))
        });
        let (evaluation, mask) = match target {
            KvTarget::Plain(mask) => (Evaluation::Expanded, mask),
            KvTarget::Contiguous(mask, slot) => profile::time(OpClass::KvAppend, || {
                let past = mask.dims()[3] - seq;
                kv = LayerCache::append(slot, past, kv.clone(), None).keys;
                (self.cheaper(seq, kv.dims()[2]), mask)
            }),
            KvTarget::Paged(mut step) => profile::time(OpClass::KvAppend, || {
                step.write(kv.clone(), None);
                if let Some((latent, _)) = step.gather() {
                    kv = latent;
                }
                (self.cheaper(seq, kv.dims()[2]), step.mask())
            }),
        };
        let total = kv.dims()[2];
        let mask = mask.reshape([batch, seq, total]);
        let scale = self.scale as f32;
        let out = profile::time(OpClass::Attention, || match evaluation {
            Evaluation::Expanded => {
                self.expanded(Tensor::cat(vec![q_nope, q_rot], 3), kv, mask, scale)
            }
            Evaluation::Absorbed => self.absorbed(q_nope, q_rot, kv, mask, scale),
        });
        profile::time(OpClass::OProj, || {
            let out = out.swap_dims(1, 2).reshape([batch * seq, heads * vd]);
            self.o_proj.forward(out).reshape([batch, seq, hidden])
        })
    }

    /// The evaluation with fewer multiply-adds for `seq` queries over `total` keys.
    fn cheaper(&self, seq: usize, total: usize) -> Evaluation {
        let MlaConfig {
            kv_lora_rank: r,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rot,
            v_head_dim: vd,
            ..
        } = self.shape;
        let (s, t, h) = (seq as u128, total as u128, self.num_heads as u128);
        let (r, nope, rot, vd) = (r as u128, nope as u128, rot as u128, vd as u128);
        let width = (nope + rot).max(vd);
        let expanded = t * r * h * (nope + vd) + s * t * h * 2 * width;
        let absorbed = s * h * r * (nope + vd) + s * t * h * 2 * (r + rot);
        if absorbed < expanded {
            Evaluation::Absorbed
        } else {
            Evaluation::Expanded
        }
    }

    fn attend(
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        mask: Tensor<3, Bool>,
        scale: f32,
    ) -> Tensor<4> {
        attend(q, k, v, mask, scale)
    }

    /// Per-head keys and values expanded from the latent `kv` (`[batch, 1, keys, r + rope]`);
    /// `q` is `[batch, heads, seq, qk_head_dim]`. Returns `[batch, heads, seq, v_head_dim]`.
    fn expanded(
        &self,
        q: Tensor<4>,
        kv: Tensor<4>,
        mask: Tensor<3, Bool>,
        scale: f32,
    ) -> Tensor<4> {
        let MlaConfig {
            kv_lora_rank: r,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rot,
            v_head_dim: vd,
            ..
        } = self.shape;
        let [batch, heads, _, qk] = q.dims();
        let total = kv.dims()[2];
        let latent = kv.clone().narrow(3, 0, r).reshape([batch * total, r]);
        let expanded = self
            .kv_b_proj
            .forward(latent)
            .reshape([batch, total, heads, nope + vd])
            .swap_dims(1, 2);
        let k_nope = expanded.clone().narrow(3, 0, nope);
        let v = expanded.narrow(3, nope, vd);
        let k_rot = kv.narrow(3, r, rot).expand([batch, heads, total, rot]);
        let k = Tensor::cat(vec![k_nope, k_rot], 3);
        let width = qk.max(vd);
        let pad = |x: Tensor<4>| -> Tensor<4> {
            let [b, h, t, d] = x.dims();
            if d == width {
                return x;
            }
            let zeros = Tensor::<4>::zeros([b, h, t, width - d], (&x.device(), x.dtype()));
            Tensor::cat(vec![x, zeros], 3)
        };
        let out = Self::attend(pad(q), pad(k), pad(v), mask, scale);
        if width == vd {
            out
        } else {
            out.narrow(3, 0, vd)
        }
    }

    /// `kv_b_proj` folded into the query and output: every head attends over the latent `kv`
    /// (`[batch, 1, keys, r + rope]`) as one shared key / value head.
    fn absorbed(
        &self,
        q_nope: Tensor<4>,
        q_rot: Tensor<4>,
        kv: Tensor<4>,
        mask: Tensor<3, Bool>,
        scale: f32,
    ) -> Tensor<4> {
        let MlaConfig {
            kv_lora_rank: r,
            qk_nope_head_dim: nope,
            v_head_dim: vd,
            ..
        } = self.shape;
        let [batch, heads, _, _] = q_nope.dims();
        let w = self
            .kv_b_proj
            .effective_weight()
            .reshape([heads, nope + vd, r]);
        let w_uk = w
            .clone()
            .narrow(1, 0, nope)
            .unsqueeze_dim::<4>(0)
            .expand([batch, heads, nope, r]);
        let w_uv = w
            .narrow(1, nope, vd)
            .swap_dims(1, 2)
            .unsqueeze_dim::<4>(0)
            .expand([batch, heads, r, vd]);
        let q = Tensor::cat(vec![q_nope.matmul(w_uk), q_rot], 3);
        let out = Self::attend(q, kv.clone(), kv, mask, scale);
        out.narrow(3, 0, r).matmul(w_uv)
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        if let Some(q) = &self.q_proj {
            q.visit(&format!("{name}.q_proj"), f);
        }
        if let Some(q) = &self.q_a_proj {
            q.visit(&format!("{name}.q_a_proj"), f);
        }
        if let Some(n) = &self.q_a_layernorm {
            n.visit(&format!("{name}.q_a_layernorm"), f);
        }
        if let Some(q) = &self.q_b_proj {
            q.visit(&format!("{name}.q_b_proj"), f);
        }
        self.kv_a_proj_with_mqa
            .visit(&format!("{name}.kv_a_proj_with_mqa"), f);
        self.kv_a_layernorm
            .visit(&format!("{name}.kv_a_layernorm"), f);
        self.kv_b_proj.visit(&format!("{name}.kv_b_proj"), f);
        self.o_proj.visit(&format!("{name}.o_proj"), f);
    }
}
