//! Building blocks shared by the architectures: HF-layout linear layers, RMSNorm, SwiGLU MLP,
//! partial non-interleaved RoPE with per-token positions, attention masks and grouped-query
//! attention with an optional KV cache, plus the weight builder used by `init` and the
//! importers and the parameter visitor used by export and gradient checks.

use burn::module::{Module, Param};
use burn::tensor::{Bool, DType, Device, Distribution, FloatDType, Int, Tensor, TensorData};

use crate::BridgeError;
use crate::checkpoint::TensorMap;
use crate::lora::{LoraAdapter, LoraForward};
use crate::profile::{self, OpClass};

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
    Loaded(&'a mut TensorMap),
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
                if host.shape != shape {
                    return Err(BridgeError::ShapeMismatch {
                        name: name.to_string(),
                        expected: shape.to_vec(),
                        got: host.shape,
                    });
                }
                // One conversion from the file's dtype to the model's.
                Tensor::<D>::from_data(TensorData::new(host.to_f32(), shape), (&self.device, dtype))
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

/// `y = x W^T + b` with `W` in HF layout `[out, in]`, optionally with a LoRA adapter
/// (see [`crate::lora`]).
#[derive(Module, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`, if the layer has a bias.
    pub bias: Option<Param<Tensor<1>>>,
    /// LoRA adapter, if attached ([`crate::CausalLm::with_lora`]).
    pub lora: Option<LoraAdapter>,
}

impl Linear {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Self, BridgeError> {
        let weight = b.param(&format!("{name}.weight"), [d_out, d_in], Init::Normal)?;
        let bias = if bias {
            Some(b.param(&format!("{name}.bias"), [d_out], Init::Zeros)?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            lora: None,
        })
    }

    /// The weight the layer multiplies by: `W`, or `W + scaling·B·A` with an adapter (the
    /// tensor [`crate::CausalLm::to_hf_tensors_merged`] exports).
    pub fn effective_weight(&self) -> Tensor<2> {
        match &self.lora {
            Some(lora) => self.weight.val() + lora.delta(),
            None => self.weight.val(),
        }
    }

    /// Applies the layer to `[tokens, in]` rows.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let y = match &self.lora {
            Some(lora) if lora.mode == LoraForward::Factored => {
                let low = x.clone().matmul(lora.lora_a.val().transpose());
                x.matmul(self.weight.val().transpose())
                    + low.matmul(lora.lora_b.val().transpose()) * lora.scaling
            }
            _ => x.matmul(self.effective_weight().transpose()),
        };
        match &self.bias {
            Some(bias) => y + bias.val().unsqueeze_dim(0),
            None => y,
        }
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(&format!("{name}.weight"), ParamRef::R2(&self.weight));
        if let Some(bias) = &self.bias {
            f(&format!("{name}.bias"), ParamRef::R1(bias));
        }
    }
}

/// Several linear layers reading the same input as one: their weights (adapters merged)
/// stacked on the output axis, `[Σ out, in]`, and their biases (zeros for a layer without
/// one). Built once per weight version for inference ([`crate::CausalLm::fuse_projections`]);
/// one matmul then replaces one per layer, and no training code ever sees it. On flex the
/// stacked weight is packed into [`miles_ops::packed`]'s panels (`f32` on an AVX-512F CPU)
/// or else stored transposed, `[in, Σ out]` row-major, the layout `gemm` reads fastest at
/// decode row counts ([`miles_ops::linear_t`]).
#[derive(Debug, Clone)]
pub struct FusedLinear {
    /// The stacked weight.
    pub weight: FusedWeight,
    /// `[Σ out]`, when any of the layers has a bias.
    pub bias: Option<Tensor<1>>,
    /// Output width of each fused layer, in order.
    pub widths: Vec<usize>,
}

/// How a [`FusedLinear`] stores its stacked weight.
#[derive(Debug, Clone)]
pub enum FusedWeight {
    /// `[Σ out, in]` (devices other than flex).
    Hf(Tensor<2>),
    /// `[in, Σ out]` contiguous (flex without the packed kernels).
    Transposed(Tensor<2>),
    /// Panels for the packed decode kernel (flex, `f32`, AVX-512F).
    Packed(miles_ops::packed::PackedMatrix),
}

impl FusedLinear {
    /// Stacks `layers` (all with the same input width).
    pub fn new(layers: &[&Linear]) -> Self {
        let weights: Vec<Tensor<2>> = layers.iter().map(|l| l.effective_weight()).collect();
        let widths: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
        let bias = layers.iter().any(|l| l.bias.is_some()).then(|| {
            let parts = layers
                .iter()
                .zip(&widths)
                .map(|(l, &n)| match &l.bias {
                    Some(b) => b.val(),
                    None => {
                        let w = l.weight.val();
                        Tensor::<1>::zeros([n], (&w.device(), w.dtype()))
                    }
                })
                .collect();
            Tensor::cat(parts, 0)
        });
        let weight = if weights.len() == 1 {
            weights.into_iter().next().expect("one weight")
        } else {
            Tensor::cat(weights, 0)
        };
        let mut fused = Self::from_weight(weight);
        fused.bias = bias;
        fused.widths = widths;
        fused
    }

    /// A gate and an up projection as one SwiGLU product: on flex with AVX-512F (`f32`, no
    /// biases) [`FusedLinear::forward_all`] returns `silu(x · gateᵀ) ⊙ (x · upᵀ)` directly
    /// ([`miles_ops::packed::PackedMatrix::glu`]); elsewhere the two stacked as
    /// [`FusedLinear::new`] does ([`FusedLinear::is_glu`] tells which).
    pub fn glu(gate: &Linear, up: &Linear) -> Self {
        if gate.bias.is_none()
            && up.bias.is_none()
            && let Some(packed) =
                miles_ops::packed::PackedMatrix::glu(gate.effective_weight(), up.effective_weight())
        {
            return Self {
                widths: vec![packed.n],
                weight: FusedWeight::Packed(packed),
                bias: None,
            };
        }
        Self::new(&[gate, up])
    }

    /// Whether [`FusedLinear::forward_all`] returns SwiGLU activations ([`FusedLinear::glu`]).
    pub fn is_glu(&self) -> bool {
        matches!(&self.weight, FusedWeight::Packed(p) if p.product == miles_ops::packed::Product::Glu)
    }

    /// One layer without bias over `weight` `[out, in]` (e.g. tied embeddings as `lm_head`).
    pub fn from_weight(weight: Tensor<2>) -> Self {
        let widths = vec![weight.dims()[0]];
        let device = weight.device();
        let weight = if !miles_ops::device::is_flex(&device) {
            FusedWeight::Hf(weight)
        } else if let Some(packed) = miles_ops::packed::PackedMatrix::new(weight.clone()) {
            FusedWeight::Packed(packed)
        } else {
            // A contiguous copy of the transposed view (one per weight version), in the
            // weight's own dtype.
            let dtype = weight.dtype();
            FusedWeight::Transposed(Tensor::from_data(
                weight.transpose().into_data(),
                (&device, dtype),
            ))
        };
        Self {
            weight,
            bias: None,
            widths,
        }
    }

    /// All outputs side by side, `[tokens, Σ out]`, for `[tokens, in]` rows: one matmul
    /// (the packed kernel, or split over both cores on flex at decode row counts or when
    /// small, [`miles_ops::linear_t`]).
    pub fn forward_all(&self, x: Tensor<2>) -> Tensor<2> {
        let y = match &self.weight {
            FusedWeight::Packed(packed) => packed.matmul(x),
            FusedWeight::Transposed(wt) => miles_ops::linear_t(x, wt.clone()),
            FusedWeight::Hf(w) => miles_ops::linear(x, w.clone()),
        };
        match &self.bias {
            Some(bias) => y + bias.clone().unsqueeze_dim(0),
            None => y,
        }
    }

    /// The fused layers' outputs for `[tokens, in]` rows, one `[tokens, out_i]` each.
    pub fn forward(&self, x: Tensor<2>) -> Vec<Tensor<2>> {
        let y = self.forward_all(x);
        if self.widths.len() == 1 {
            return vec![y];
        }
        let mut start = 0;
        self.widths
            .iter()
            .map(|&n| {
                let part = y.clone().narrow(1, start, n);
                start += n;
                part
            })
            .collect()
    }
}

/// RMSNorm over the last dimension: `w * x / sqrt(mean(x²) + eps)`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Scale, `[d]`.
    pub weight: Param<Tensor<1>>,
    /// Epsilon.
    pub eps: f64,
}

impl RmsNorm {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        d: usize,
        eps: f64,
    ) -> Result<Self, BridgeError> {
        Ok(Self {
            weight: b.param(&format!("{name}.weight"), [d], Init::Ones)?,
            eps,
        })
    }

    /// Normalises the last dimension of `x`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let dtype = x.dtype();
        if dtype != DType::F32 {
            // Half precision: the statistics in f32 and the normalised values rounded to the
            // compute dtype before the scale, as transformers' RMSNorm does.
            let xf = x.cast(FloatDType::F32);
            let inv_rms = (xf.clone().square().mean_dim(D - 1) + self.eps)
                .sqrt()
                .recip();
            return (xf * inv_rms).cast(dtype) * weight.cast(dtype).unsqueeze();
        }
        // One fused op on flex, tensor ops elsewhere (the weight is `[d]` by construction).
        miles_ops::rms_norm(x.clone(), weight.clone(), self.eps)
            .unwrap_or_else(|_| miles_ops::rms_norm_reference(x, weight, self.eps))
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        f(&format!("{name}.weight"), ParamRef::R1(&self.weight));
    }
}

/// `silu(gate) * up`: one fused op on flex, tensor ops elsewhere (equal shapes by
/// construction; the fallback only re-raises burn's own shape panic).
pub(crate) fn swiglu(gate: Tensor<2>, up: Tensor<2>) -> Tensor<2> {
    miles_ops::swiglu(gate.clone(), up.clone())
        .unwrap_or_else(|_| miles_ops::swiglu_reference(gate, up))
}

/// SwiGLU MLP `down(silu(gate(x)) * up(x))` (no biases).
#[derive(Module, Debug)]
pub struct Mlp {
    /// `gate_proj`.
    pub gate_proj: Linear,
    /// `up_proj`.
    pub up_proj: Linear,
    /// `down_proj`.
    pub down_proj: Linear,
    /// Inference only: `gate_proj` and `up_proj` fused ([`FusedLinear`]); `None` runs them
    /// separately.
    #[module(skip)]
    pub fused_gate_up: Option<FusedLinear>,
    /// Inference only: `down_proj` through [`FusedLinear`] (split over both cores on flex).
    #[module(skip)]
    pub packed_down: Option<FusedLinear>,
}

impl Mlp {
    pub(crate) fn build(
        b: &mut Builder<'_>,
        name: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self, BridgeError> {
        Ok(Self {
            gate_proj: Linear::build(b, &format!("{name}.gate_proj"), hidden, intermediate, false)?,
            up_proj: Linear::build(b, &format!("{name}.up_proj"), hidden, intermediate, false)?,
            down_proj: Linear::build(b, &format!("{name}.down_proj"), intermediate, hidden, false)?,
            fused_gate_up: None,
            packed_down: None,
        })
    }

    /// Applies the MLP to `[tokens, hidden]` rows.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = match &self.fused_gate_up {
            Some(fused) if fused.is_glu() => fused.forward_all(x),
            Some(fused) => {
                let mut parts = fused.forward(x).into_iter();
                match (parts.next(), parts.next()) {
                    (Some(gate), Some(up)) => swiglu(gate, up),
                    // Built from exactly two layers (`fuse`), so this never runs.
                    _ => unreachable!("fused gate / up of two layers"),
                }
            }
            None => swiglu(self.gate_proj.forward(x.clone()), self.up_proj.forward(x)),
        };
        match &self.packed_down {
            Some(down) => down.forward_all(h),
            None => self.down_proj.forward(h),
        }
    }

    /// Fuses `gate_proj` and `up_proj` for inference (see [`FusedLinear::glu`]).
    pub fn fuse(&mut self) {
        self.fused_gate_up = Some(FusedLinear::glu(&self.gate_proj, &self.up_proj));
        self.packed_down = Some(FusedLinear::new(&[&self.down_proj]));
    }

    /// Drops the inference-only fused copies ([`Mlp::fuse`]).
    pub(crate) fn unfuse(&mut self) {
        self.fused_gate_up = None;
        self.packed_down = None;
    }

    pub(crate) fn visit(&self, name: &str, f: &mut ParamVisitor<'_>) {
        self.gate_proj.visit(&format!("{name}.gate_proj"), f);
        self.up_proj.visit(&format!("{name}.up_proj"), f);
        self.down_proj.visit(&format!("{name}.down_proj"), f);
    }
}

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
    /// frequencies (see [`crate::ModelConfig::inv_freq`]).
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

/// Builds the `[batch, 1, seq, past + seq]` mask (true = masked) for queries at cache
/// indices `past..past+seq` over keys `0..past+seq`: causal by index, keys with
/// `key_valid = false` hidden, and, for packed rows, keys of other segments hidden.
pub fn attention_mask(
    batch: usize,
    seq: usize,
    past: usize,
    key_valid: Option<Tensor<2, Bool>>,
    segment_ids: Option<Tensor<2, Int>>,
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
        masked = masked.bool_or(sq.equal(sk).bool_not());
    }
    masked.unsqueeze_dim(1)
}

/// Keys and values of one attention layer kept across decoding steps.
///
/// The tensors may hold more key columns than are in use (their capacity, see
/// [`LayerCache::capacity`]): a step writes its keys in place after the used ones and the
/// capacity grows geometrically, so decoding does not copy the whole cache every step. The
/// used length is the owning [`crate::KvCache`]'s [`crate::KvCache::len`];
/// [`crate::KvCache::layer`] returns the used part.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// `[batch, kv_heads, capacity, head_dim]`; for a multi-head latent attention layer
    /// ([`crate::mla::LatentAttention`]) the compressed latent after `kv_a_layernorm` and the
    /// rotated rope key, `[batch, 1, capacity, kv_lora_rank + qk_rope_head_dim]`.
    pub keys: Tensor<4>,
    /// `[batch, kv_heads, capacity, head_dim]`; `None` for a multi-head latent attention
    /// layer (its values are expanded from the latent in `keys`).
    pub values: Option<Tensor<4>>,
}

/// Key columns a layer cache's capacity is a multiple of.
pub(crate) const KV_BLOCK: usize = 64;

impl LayerCache {
    /// Key columns the tensors hold (used or not).
    pub fn capacity(&self) -> usize {
        self.keys.dims()[2]
    }

    /// The first `len` key columns (views; `len` at most the capacity).
    pub(crate) fn narrowed(&self, len: usize) -> LayerCache {
        if len == self.capacity() {
            return self.clone();
        }
        LayerCache {
            keys: self.keys.clone().narrow(2, 0, len),
            values: self.values.clone().map(|v| v.narrow(2, 0, len)),
        }
    }

    /// Writes `keys` / `values` (`[batch, heads, seq, dim]`) at key columns `past..past + seq`
    /// of the cache in `slot` (creating it when empty), in place when the capacity allows and
    /// the tensors are not shared (a shared one is copied first, so a cache cloned into a
    /// prefix cache never changes), growing the capacity to at least twice the old one
    /// otherwise. Returns the used part, `past + seq` columns, for the attention.
    pub(crate) fn append(
        slot: &mut Option<LayerCache>,
        past: usize,
        keys: Tensor<4>,
        values: Option<Tensor<4>>,
    ) -> LayerCache {
        let [batch, _, seq, _] = keys.dims();
        let need = past + seq;
        let write = |cache: Tensor<4>, new: Tensor<4>| -> Tensor<4> {
            let [_, h, _, d] = new.dims();
            cache.slice_assign([0..batch, 0..h, past..need, 0..d], new)
        };
        let cache = match slot.take() {
            // Nothing cached yet: the step's tensors are the cache (exact size).
            None if past == 0 => LayerCache { keys, values },
            Some(old) if old.capacity() >= need && old.keys.dims()[0] == batch => LayerCache {
                keys: write(old.keys, keys),
                values: match (old.values, values) {
                    (Some(old), Some(new)) => Some(write(old, new)),
                    _ => None,
                },
            },
            old => {
                let old_cap = old.as_ref().map_or(0, LayerCache::capacity);
                let cap = need.max(2 * old_cap).div_ceil(KV_BLOCK) * KV_BLOCK;
                let device = keys.device();
                let grown = |old: Option<Tensor<4>>, new: Tensor<4>| -> Tensor<4> {
                    let [_, h, _, d] = new.dims();
                    let mut t = Tensor::<4>::zeros([batch, h, cap, d], (&device, new.dtype()));
                    if let Some(old) = old
                        && past > 0
                    {
                        t = t.slice_assign([0..batch, 0..h, 0..past, 0..d], old.narrow(2, 0, past));
                    }
                    write(t, new)
                };
                let (old_keys, old_values) = match old {
                    Some(o) => (Some(o.keys), o.values),
                    None => (None, None),
                };
                LayerCache {
                    values: values.map(|v| grown(old_values, v)),
                    keys: grown(old_keys, keys),
                }
            }
        };
        let used = cache.narrowed(need);
        *slot = Some(cache);
        used
    }
}

/// Where an attention layer keeps this step's keys and values.
pub(crate) enum KvTarget<'a> {
    /// Nowhere (a training / scoring forward): `mask` `[batch, 1, seq, seq]`.
    Plain(Tensor<4, Bool>),
    /// Appended to a contiguous cache; `mask` `[batch, 1, seq, cached + seq]`.
    Contiguous(Tensor<4, Bool>, &'a mut Option<LayerCache>),
    /// Written into a paged pool ([`crate::paged`]), which also gives the mask.
    Paged(crate::paged::LayerStep<'a>),
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

/// Grouped-query self-attention with optional q/k bias, optional per-head qk RMSNorm and
/// partial RoPE; scale `1/sqrt(head_dim)`.
#[derive(Module, Debug)]
pub struct Attention {
    /// `q_proj`.
    pub q_proj: Linear,
    /// `k_proj`.
    pub k_proj: Linear,
    /// `v_proj`.
    pub v_proj: Linear,
    /// `o_proj` (no bias).
    pub o_proj: Linear,
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
            (
                Some(RmsNorm::build(
                    b,
                    &format!("{name}.q_norm"),
                    s.head_dim,
                    s.eps,
                )?),
                Some(RmsNorm::build(
                    b,
                    &format!("{name}.k_norm"),
                    s.head_dim,
                    s.eps,
                )?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            q_proj: Linear::build(b, &format!("{name}.q_proj"), s.hidden, q_out, s.bias)?,
            k_proj: Linear::build(b, &format!("{name}.k_proj"), s.hidden, kv_out, s.bias)?,
            v_proj: Linear::build(b, &format!("{name}.v_proj"), s.hidden, kv_out, s.bias)?,
            o_proj: Linear::build(b, &format!("{name}.o_proj"), q_out, s.hidden, false)?,
            q_norm,
            k_norm,
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            fused_qkv: None,
            packed_o: None,
        })
    }

    /// Fuses `q_proj`, `k_proj` and `v_proj` for inference (see [`FusedLinear`]).
    pub fn fuse(&mut self) {
        self.fused_qkv = Some(FusedLinear::new(&[
            &self.q_proj,
            &self.k_proj,
            &self.v_proj,
        ]));
        self.packed_o = Some(FusedLinear::new(&[&self.o_proj]));
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
        let (q, k, v) = profile::time(OpClass::QkvProj, || {
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
            (
                self.heads(q, batch, seq, self.num_heads),
                self.heads(k, batch, seq, self.num_kv_heads),
                self.heads(v, batch, seq, self.num_kv_heads),
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
        let scale = (1.0 / (self.head_dim as f64).sqrt()) as f32;
        // One fused op on flex (scores never materialised between ops); the same computation
        // with tensor ops elsewhere.
        let attend_all = |q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, mask: Tensor<4, Bool>| {
            let mask = mask.reshape([batch, seq, k.dims()[2]]);
            profile::time(OpClass::Attention, || attend(q, k, v, mask, scale))
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
            let out = out
                .swap_dims(1, 2)
                .reshape([batch * seq, self.num_heads * self.head_dim]);
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

#[cfg(test)]
mod tests {
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

    #[test]
    fn mask_is_causal_with_padding_and_segments() {
        let device = Device::flex();
        let seg = Tensor::<2, Int>::from_data([[0, 0, 1]], &device);
        let m = attention_mask(1, 3, 0, None, Some(seg), &device);
        let got = m.into_data().try_to_vec::<bool>().unwrap();
        #[rustfmt::skip]
        let want = [false, true, true,
                    false, false, true,
                    true, true, false];
        assert_eq!(got, want);
        let valid = Tensor::<2, Bool>::from_data([[true, false, true, true]], &device);
        let m = attention_mask(1, 1, 3, Some(valid), None, &device);
        assert_eq!(
            m.into_data().try_to_vec::<bool>().unwrap(),
            [false, true, false, false]
        );
    }
}
