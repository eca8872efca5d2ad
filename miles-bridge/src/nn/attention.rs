//! Grouped-query attention ([`Attention`]), its masks ([`attention_mask`]) and where a layer
//! keeps its keys and values in a step (`KvTarget`: nowhere, a contiguous cache or a paged
//! pool).

use burn::module::{Module, Param};
use burn::tensor::{Bool, DType, Device, FloatDType, Int, Tensor};

use crate::error::BridgeError;
use crate::kv_cache::LayerCache;
use crate::kv_pool::LayerStep;
use crate::nn::linear::{DecodeWeights, FusedLinear, Linear};
use crate::nn::norm::RmsNorm;
use crate::nn::param::{Builder, ParamVisitor};
use crate::nn::rope::Rope;
use crate::profile::{self, OpClass};

/// Builds the `[batch, 1, seq, past + seq]` mask (true = masked) for queries at cache
/// indices `past..past+seq` over keys `0..past+seq`: causal by index, keys with
/// `key_valid = false` hidden, and, for packed rows, keys of other segments hidden. With
/// `parent_ids` too (shared-prefix rows, no cache: `past = 0`), a query also sees the keys of
/// its parent segment (a response its prompt): a key is visible when its segment is the
/// query's or the query's parent.
pub fn attention_mask(
    batch: usize,
    seq: usize,
    past: usize,
    key_valid: Option<Tensor<2, Bool>>,
    segment_ids: Option<Tensor<2, Int>>,
    parent_ids: Option<Tensor<2, Int>>,
    device: &Device,
) -> Tensor<4, Bool> {
    let total = past + seq;
    let q = Tensor::<1, Int>::arange(past as i64..total as i64, device).reshape([1, seq, 1]);
    let k = Tensor::<1, Int>::arange(0..total as i64, device).reshape([1, 1, total]);
    let mut masked = k
        .expand([batch, seq, total])
        .greater(q.expand([batch, seq, total]));
    if let Some(valid) = key_valid {
        let hidden = valid
            .bool_not()
            .reshape([batch, 1, total])
            .expand([batch, seq, total]);
        masked = masked.bool_or(hidden);
    }
    if let Some(seg) = segment_ids {
        let sq = seg
            .clone()
            .reshape([batch, seq, 1])
            .expand([batch, seq, total]);
        let sk = seg.reshape([batch, 1, total]).expand([batch, seq, total]);
        let mut visible = sq.equal(sk.clone());
        if let Some(parent) = parent_ids {
            let pq = parent.reshape([batch, seq, 1]).expand([batch, seq, total]);
            visible = visible.bool_or(pq.equal(sk));
        }
        masked = masked.bool_or(visible.bool_not());
    }
    masked.unsqueeze_dim(1)
}

/// `mask` (`[batch, 1, seq, past + seq]`, queries at cache indices `past..past+seq`) with
/// the keys outside a sliding window of `window` also hidden: a query at index `i` sees keys
/// `i - window < j <= i` (transformers' sliding-window mask, by cache index).
pub fn sliding_window_mask(mask: Tensor<4, Bool>, past: usize, window: usize) -> Tensor<4, Bool> {
    let [batch, _, seq, total] = mask.dims();
    let device = mask.device();
    let q = Tensor::<1, Int>::arange(past as i64..(past + seq) as i64, &device)
        .reshape([1, 1, seq, 1])
        .expand([batch, 1, seq, total]);
    let k = Tensor::<1, Int>::arange(0..total as i64, &device)
        .reshape([1, 1, 1, total])
        .expand([batch, 1, seq, total]);
    mask.bool_or((q - k).greater_equal_elem(window as i64))
}

/// `mask` (`[batch, 1, seq, seq]`, no cache) with the keys outside a sliding window of
/// `window` also hidden, measured by position (`positions`, `[batch, seq]`): a query at
/// position `p` sees keys at positions `p - window < q <= p`. For shared-prefix rows, where a
/// response continues its prompt's positions after other responses in the row, so that the
/// distance by index is not the distance in its own sequence.
pub fn sliding_window_mask_by_position(
    mask: Tensor<4, Bool>,
    positions: Tensor<2, Int>,
    window: usize,
) -> Tensor<4, Bool> {
    let [batch, _, seq, total] = mask.dims();
    let q = positions
        .clone()
        .reshape([batch, 1, seq, 1])
        .expand([batch, 1, seq, total]);
    let k = positions
        .reshape([batch, 1, 1, total])
        .expand([batch, 1, seq, total]);
    mask.bool_or((q - k).greater_equal_elem(window as i64))
}

/// Where an attention layer keeps this step's keys and values.
pub(crate) enum KvTarget<'a> {
    /// Nowhere (a training / scoring forward): `mask` `[batch, 1, seq, seq]`.
    Plain(Tensor<4, Bool>),
    /// Appended to a contiguous cache; `mask` `[batch, 1, seq, cached + seq]`.
    Contiguous(Tensor<4, Bool>, &'a mut Option<LayerCache>),
    /// Written into a paged pool (one layer's view of a paged step), which also gives the
    /// mask.
    Paged(LayerStep<'a>),
}

impl<'a> KvTarget<'a> {
    /// The target of the public `forward(x, rope, mask, cache)` signatures.
    pub(crate) fn new(mask: Tensor<4, Bool>, cache: Option<&'a mut Option<LayerCache>>) -> Self {
        match cache {
            Some(slot) => Self::Contiguous(mask, slot),
            None => Self::Plain(mask),
        }
    }
}

/// Grouped-query self-attention with optional q/k/v (and GPT-OSS's o) biases, optional
/// per-head qk RMSNorm, partial RoPE and optional attention sinks; scale `1/sqrt(head_dim)`.
#[derive(Module, Debug)]
pub struct Attention {
    /// `q_proj`.
    pub q_proj: Linear,
    /// `k_proj`.
    pub k_proj: Linear,
    /// `v_proj`.
    pub v_proj: Linear,
    /// `o_proj` (a bias only for GPT-OSS with `attention_bias`).
    pub o_proj: Linear,
    /// GPT-OSS: `sinks`, `[num_heads]`, one logit per head in every query's softmax
    /// denominator (its probability is dropped).
    pub sinks: Option<Param<Tensor<1>>>,
    /// Per-head RMSNorm of queries (`use_qk_norm`).
    pub q_norm: Option<RmsNorm>,
    /// Per-head RMSNorm of keys (`use_qk_norm`).
    pub k_norm: Option<RmsNorm>,
    /// Query heads.
    pub num_heads: usize,
    /// Key / value heads.
    pub num_kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Qwen3.5's output gate: `q_proj` gives, per head, the queries then as many gate
    /// channels; the attention output is multiplied by their sigmoid before `o_proj`.
    pub output_gate: bool,
    /// The factor RoPE's cos / sin tables carry (YaRN's attention factor, 1 otherwise): it
    /// scales queries and keys, so the softmax scale is multiplied by its square.
    pub rope_attention_factor: f64,
    /// Inference only: `q_proj`, `k_proj` and `v_proj` fused ([`FusedLinear`]); `None` runs
    /// them separately.
    #[module(skip)]
    pub fused_qkv: Option<FusedLinear>,
    /// Inference only: `o_proj` through [`FusedLinear`] (split over both cores on flex).
    #[module(skip)]
    pub packed_o: Option<FusedLinear>,
}

/// Shape parameters of an [`Attention`] layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub bias: bool,
    pub qk_norm: bool,
    pub eps: f64,
    /// Gated output (`q_proj` twice as wide).
    pub output_gate: bool,
    /// Zero-centred q / k norms (`1 + weight`).
    pub norm_unit_offset: bool,
    /// `o_proj` has a bias.
    pub o_bias: bool,
    /// A learned sink logit per head.
    pub sinks: bool,
    /// YaRN's attention factor (1 without YaRN).
    pub rope_attention_factor: f64,
}

impl Attention {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        s: AttentionShape,
    ) -> Result<Self, BridgeError> {
        let q_out = s.num_heads * s.head_dim;
        let kv_out = s.num_kv_heads * s.head_dim;
        let (q_norm, k_norm) = if s.qk_norm {
            let norm = |b: &mut Builder<'_>, which: &str| {
                RmsNorm::build_with(
                    b,
                    &format!("{name}.{which}"),
                    s.head_dim,
                    s.eps,
                    s.norm_unit_offset,
                )
            };
            (Some(norm(b, "q_norm")?), Some(norm(b, "k_norm")?))
        } else {
            (None, None)
        };
        let q_width = if s.output_gate { 2 * q_out } else { q_out };
        Ok(Self {
            q_proj: Linear::build(b, &format!("{name}.q_proj"), s.hidden, q_width, s.bias)?,
            k_proj: Linear::build(b, &format!("{name}.k_proj"), s.hidden, kv_out, s.bias)?,
            v_proj: Linear::build(b, &format!("{name}.v_proj"), s.hidden, kv_out, s.bias)?,
            o_proj: Linear::build(b, &format!("{name}.o_proj"), q_out, s.hidden, s.o_bias)?,
            sinks: if s.sinks {
                Some(b.param(
                    &format!("{name}.sinks"),
                    [s.num_heads],
                    crate::nn::param::Init::Normal,
                )?)
            } else {
                None
            },
            q_norm,
            k_norm,
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            output_gate: s.output_gate,
            rope_attention_factor: s.rope_attention_factor,
            fused_qkv: None,
            packed_o: None,
        })
    }

    /// Fuses `q_proj`, `k_proj` and `v_proj` for inference (see [`FusedLinear`]).
    pub fn fuse(&mut self, decode: DecodeWeights) {
        self.fused_qkv = Some(FusedLinear::new(
            &[&self.q_proj, &self.k_proj, &self.v_proj],
            decode,
        ));
        self.packed_o = Some(FusedLinear::new(&[&self.o_proj], decode));
    }

    fn heads(&self, x: Tensor<2>, batch: usize, seq: usize, heads: usize) -> Tensor<4> {
        x.reshape([batch, seq, heads, self.head_dim])
            .swap_dims(1, 2)
    }

    /// Attends `x` (`[batch, seq, hidden]`); `mask` is `[batch, 1, seq, cached + seq]`.
    /// With a cache, the new keys / values are appended to it first.
    pub fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        mask: Tensor<4, Bool>,
        cache: Option<&mut Option<LayerCache>>,
    ) -> Tensor<3> {
        self.forward_kv(x, rope, KvTarget::new(mask, cache))
    }

    /// [`Attention::forward`] with the keys / values kept where `target` says.
    pub(crate) fn forward_kv(&self, x: Tensor<3>, rope: &Rope, target: KvTarget<'_>) -> Tensor<3> {
        let [batch, seq, hidden] = x.dims();
        let rows = x.reshape([batch * seq, hidden]);
        let ((q, k, v), gate) = profile::time(OpClass::QkvProj, || {
            let (q, k, v) = match &self.fused_qkv {
                Some(fused) => {
                    let mut parts = fused.forward(rows).into_iter();
                    match (parts.next(), parts.next(), parts.next()) {
                        (Some(q), Some(k), Some(v)) => (q, k, v),
                        // Built from exactly three layers (`fuse`), so this never runs.
                        _ => unreachable!("fused q / k / v of three layers"),
                    }
                }
                None => (
                    self.q_proj.forward(rows.clone()),
                    self.k_proj.forward(rows.clone()),
                    self.v_proj.forward(rows),
                ),
            };
            // With the output gate each head's `q_proj` channels are its queries then its
            // gate channels.
            let (q, gate) = if self.output_gate {
                let both = q.reshape([batch * seq, self.num_heads, 2 * self.head_dim]);
                let hd = self.head_dim;
                (
                    both.clone()
                        .narrow(2, 0, hd)
                        .reshape([batch * seq, self.num_heads * hd]),
                    Some(
                        both.narrow(2, hd, hd)
                            .reshape([batch * seq, self.num_heads * hd]),
                    ),
                )
            } else {
                (q, None)
            };
            (
                (
                    self.heads(q, batch, seq, self.num_heads),
                    self.heads(k, batch, seq, self.num_kv_heads),
                    self.heads(v, batch, seq, self.num_kv_heads),
                ),
                gate,
            )
        });
        let (q, k) = profile::time(OpClass::Rope, || {
            let (mut q, mut k) = (q, k);
            if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
                q = qn.forward(q);
                k = kn.forward(k);
            }
            (rope.apply(q), rope.apply(k))
        });
        let scale = (self.rope_attention_factor * self.rope_attention_factor
            / (self.head_dim as f64).sqrt()) as f32;
        // One fused op on flex (scores never materialised between ops); the same computation
        // with tensor ops elsewhere.
        let attend_all = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4, Bool>| {
            let mask = mask.reshape([batch, seq, k.dims()[2]]);
            profile::time(OpClass::Attention, || match &self.sinks {
                Some(sinks) => attend_sinks(q, k, v, mask, scale, sinks.val()),
                None => attend(q, k, v, mask, scale),
            })
        };
        let out = match target {
            KvTarget::Plain(mask) => attend_all(q, k, v, mask),
            KvTarget::Contiguous(mask, slot) => {
                // A grouped-query layer always stores its values.
                let used = profile::time(OpClass::KvAppend, || {
                    let past = mask.dims()[3] - seq;
                    LayerCache::append(slot, past, k.clone(), Some(v.clone()))
                });
                attend_all(q, used.keys, used.values.unwrap_or(v), mask)
            }
            KvTarget::Paged(mut step) => {
                profile::time(OpClass::KvAppend, || step.write(k.clone(), Some(v.clone())));
                match profile::time(OpClass::Attention, || step.decode(&q, scale)) {
                    Some(out) => out,
                    None => match profile::time(OpClass::KvAppend, || step.gather()) {
                        Some((keys, Some(values))) => attend_all(q, keys, values, step.mask()),
                        // A grouped-query pool always has values.
                        _ => unreachable!("a grouped-query pool without values"),
                    },
                }
            }
        };
        profile::time(OpClass::OProj, || {
            let mut out = out
                .swap_dims(1, 2)
                .reshape([batch * seq, self.num_heads * self.head_dim]);
            if let Some(gate) = gate {
                out = out * burn::tensor::activation::sigmoid(gate);
            }
            match &self.packed_o {
                Some(o) => o.forward_all(out),
                None => self.o_proj.forward(out),
            }
            .reshape([batch, seq, hidden])
        })
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        self.q_proj.visit(&format!("{name}.q_proj"), f);
        self.k_proj.visit(&format!("{name}.k_proj"), f);
        self.v_proj.visit(&format!("{name}.v_proj"), f);
        self.o_proj.visit(&format!("{name}.o_proj"), f);
        if let Some(n) = &self.q_norm {
            n.visit(&format!("{name}.q_norm"), f);
        }
        if let Some(sinks) = &self.sinks {
            f(
                &format!("{name}.sinks"),
                crate::nn::param::ParamRef::R1(sinks),
            );
        }
        if let Some(n) = &self.k_norm {
            n.visit(&format!("{name}.k_norm"), f);
        }
    }
}

/// Masked softmax attention over `[batch, heads, seq, head_dim]` queries and the cache's keys
/// and values: one fused op on flex (scores never materialised between ops), the same
/// computation with tensor ops elsewhere. In half precision the scores, softmax and weighted
/// sum run in f32 (as flash-attention kernels accumulate) and the output is rounded to the
/// compute dtype. Shapes are ours, so the fallback on an error only re-raises burn's own
/// shape panic.
pub(crate) fn attend(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
) -> Tensor<4> {
    let dtype = q.dtype();
    let f32 = |t: Tensor<4>| t.cast(FloatDType::F32);
    let (q, k, v) = if dtype == DType::F32 {
        (q, k, v)
    } else {
        (f32(q), f32(k), f32(v))
    };
    miles_ops::attention(q.clone(), k.clone(), v.clone(), mask.clone(), scale)
        .unwrap_or_else(|_| miles_ops::attention_reference(q, k, v, mask, scale))
        .cast(dtype)
}

/// [`attend`] with attention sinks (GPT-OSS, transformers' `eager_attention_forward`): per
/// head `h`, the softmax of each query's masked scores runs over one more logit, `sinks[h]`,
/// whose probability is then dropped, so the weights sum to less than one; a query with
/// every key masked attends to nothing (zero output). The sliding window is in `mask`. One
/// fused op ([`miles_ops::attention_with_sinks`]: flex loops or CubeCL kernels, forward and
/// backward, the sinks' gradient included) in f32 in every precision, rounded to the compute
/// dtype; its tensor-op form elsewhere.
pub(crate) fn attend_sinks(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
    sinks: Tensor<1>,
) -> Tensor<4> {
    let dtype = q.dtype();
    let f32 = |t: Tensor<4>| t.cast(FloatDType::F32);
    let (q, k, v) = (f32(q), f32(k), f32(v));
    let sinks = sinks.cast(FloatDType::F32);
    miles_ops::attention_with_sinks(
        q.clone(),
        k.clone(),
        v.clone(),
        mask.clone(),
        scale,
        sinks.clone(),
    )
    .unwrap_or_else(|_| miles_ops::attention_with_sinks_reference(q, k, v, mask, scale, sinks))
    .cast(dtype)
}

/// The tensor-op form [`attend_sinks`] replaced (transformers' eager attention: `−∞` masked
/// scores, the sink column concatenated), kept as its test oracle.
#[cfg(test)]
pub(crate) fn attend_with_sinks(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: Tensor<3, Bool>,
    scale: f32,
    sinks: Tensor<1>,
) -> Tensor<4> {
    let dtype = q.dtype();
    let f32 = |t: Tensor<4>| t.cast(FloatDType::F32);
    let (q, k, v) = (f32(q), f32(k), f32(v));
    let [batch, heads, seq, _] = q.dims();
    let [_, kv_heads, total, _] = k.dims();
    let group = heads / kv_heads.max(1);
    let repeat = |x: Tensor<4>| {
        if group == 1 {
            return x;
        }
        let d = x.dims()[3];
        x.reshape([batch, kv_heads, 1, total, d])
            .expand([batch, kv_heads, group, total, d])
            .reshape([batch, heads, total, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q.matmul(k.swap_dims(2, 3)) * scale;
    let mask = mask
        .reshape([batch, 1, seq, total])
        .expand([batch, heads, seq, total]);
    let scores = scores.mask_fill(mask, f32::NEG_INFINITY);
    let sink = sinks
        .cast(FloatDType::F32)
        .reshape([1, heads, 1, 1])
        .expand([batch, heads, seq, 1]);
    let probs = burn::tensor::activation::softmax(Tensor::cat(vec![scores, sink], 3), 3)
        .narrow(3, 0, total);
    probs.matmul(v).cast(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap()
    }

    fn max_diff(a: Vec<f32>, b: Vec<f32>) -> f32 {
        a.iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    /// The fused sink attention against the tensor-op form it replaced, over a sliding
    /// window crossed by the sequence, left padding (rows with no key) and grouped heads:
    /// outputs and the gradients of q, k, v and the sinks.
    #[test]
    fn fused_sink_attention_matches_the_tensor_op_form() {
        use burn::tensor::Distribution;
        let device = Device::flex().autodiff();
        let (batch, heads, kv_heads, seq, d) = (2, 4, 2, 40, 16);
        let normal = |shape: [usize; 4]| {
            Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device).require_grad()
        };
        let q = normal([batch, heads, seq, d]);
        let k = normal([batch, kv_heads, seq, d]);
        let v = normal([batch, kv_heads, seq, d]);
        let sinks =
            Tensor::<1>::random([heads], Distribution::Normal(0.0, 1.0), &device).require_grad();
        let valid = Tensor::<2, Bool>::from_data(
            burn::tensor::TensorData::new(
                (0..batch * seq)
                    .map(|i| i % seq >= 3 * (i / seq))
                    .collect::<Vec<_>>(),
                [batch, seq],
            ),
            &device,
        );
        let mask = sliding_window_mask(
            attention_mask(batch, seq, 0, Some(valid), None, None, &device),
            0,
            9,
        )
        .reshape([batch, seq, seq]);
        let w = Tensor::<4>::random(
            [batch, heads, seq, d],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let run = |fused: bool| {
            let (a, b, c, s) = (q.clone(), k.clone(), v.clone(), sinks.clone());
            let out = if fused {
                attend_sinks(a, b, c, mask.clone(), 0.25, s)
            } else {
                attend_with_sinks(a, b, c, mask.clone(), 0.25, s)
            };
            let grads = (out.clone() * w.clone()).sum().backward();
            [
                host(out),
                host(q.grad(&grads).unwrap()),
                host(k.grad(&grads).unwrap()),
                host(v.grad(&grads).unwrap()),
                host(sinks.grad(&grads).unwrap()),
            ]
        };
        let (fused, reference) = (run(true), run(false));
        for (i, (a, b)) in fused.into_iter().zip(reference).enumerate() {
            let diff = max_diff(a, b);
            assert!(diff < 1e-4, "part {i}: {diff}");
        }
    }

    #[test]
    fn mask_is_causal_with_padding_and_segments() {
        let device = Device::flex();
        let seg = Tensor::<2, Int>::from_data([[0, 0, 1]], &device);
        let m = attention_mask(1, 3, 0, None, Some(seg), None, &device);
        let got = m.into_data().try_to_vec::<bool>().unwrap();
        #[rustfmt::skip]
        let want = [false, true, true,
                    false, false, true,
                    true, true, false];
        assert_eq!(got, want);
        let valid = Tensor::<2, Bool>::from_data([[true, false, true, true]], &device);
        let m = attention_mask(1, 1, 3, Some(valid), None, None, &device);
        assert_eq!(
            m.into_data().try_to_vec::<bool>().unwrap(),
            [false, true, false, false]
        );
    }

    #[test]
    fn shared_prefix_mask_shows_the_prompt_and_hides_other_responses() {
        let device = Device::flex();
        // [prompt p0 p1 | response a0 a1 | response b0 | pad]: segments 0, 1, 2, 3;
        // parents: the prompt its own, the responses the prompt.
        let seg = Tensor::<2, Int>::from_data([[0, 0, 1, 1, 2, 3]], &device);
        let parent = Tensor::<2, Int>::from_data([[0, 0, 0, 0, 0, 3]], &device);
        let valid = Tensor::<2, Bool>::from_data([[true, true, true, true, true, false]], &device);
        let m = attention_mask(1, 6, 0, Some(valid), Some(seg), Some(parent), &device);
        let got = m.clone().into_data().try_to_vec::<bool>().unwrap();
        #[rustfmt::skip]
        let want = [
            false, true,  true,  true,  true,  true,  // p0
            false, false, true,  true,  true,  true,  // p1
            false, false, false, true,  true,  true,  // a0
            false, false, false, false, true,  true,  // a1
            false, false, true,  true,  false, true,  // b0: the prompt and itself
            true,  true,  true,  true,  true,  true,  // pad
        ];
        assert_eq!(got, want);
        // Positions p 0 1, a 2 3, b 2: with a window of 2, b0 (position 2) sees p1 and
        // itself, though p1 is 3 indices back; a1 (position 3) sees a0 and itself only.
        let pos = Tensor::<2, Int>::from_data([[0, 1, 2, 3, 2, 0]], &device);
        let w = sliding_window_mask_by_position(m, pos, 2);
        let got = w.into_data().try_to_vec::<bool>().unwrap();
        assert_eq!(&got[18..24], &[true, true, false, false, true, true]);
        assert_eq!(&got[24..30], &[true, false, true, true, false, true]);
    }
}
