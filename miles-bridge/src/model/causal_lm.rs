//! [`CausalLm`]: the decoder-only model shared by every [`Architecture`] — GLM-4.5 / 4.6 / 4.7
//! MoE (`glm4_moe`), Qwen3 (`qwen3`), Qwen3-MoE (`qwen3_moe`), Llama (`llama`), Qwen2
//! (`qwen2`), DeepSeek-V3 (`deepseek_v3`), GLM-4.7-Flash (`glm4_moe_lite`) and Qwen3.5
//! (`qwen3_5`, `qwen3_5_moe`). The architectures differ only in configuration
//! (their rows of the architecture table): attention bias, qk-norm, partial rotary and RoPE
//! scaling, grouped-query or latent attention, which layers are MoE, the router kind and
//! shared experts. This file builds the model (random or from HF-named tensors), casts it,
//! visits its parameters and exports them.
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Device, FloatDType, Tensor};
use miles_core::{DType, NamedTensors, TensorBytes};

use crate::config::{Architecture, ExpertKind, ModelConfig, RouterKind, SharedExpertKind};
use crate::error::BridgeError;
use crate::lora::LoraConfig;
use crate::names::{EXPERT_STACKS, hf_to_internal, internal_to_hf};
use crate::nn::attention::{Attention, AttentionShape};
use crate::nn::biased_moe::{BiasedMoeBlock, BiasedMoeShape};
use crate::nn::gated_delta::GatedDeltaNet;
use crate::nn::layer::{DecoderLayer, DecoderModel, FeedForward, SelfAttention};
use crate::nn::linear::{DecodeWeights, FusedLinear, Linear};
use crate::nn::mla::LatentAttention;
use crate::nn::mlp::Mlp;
use crate::nn::moe::{Experts, MoeBlock, MoeDispatch, PackedMoe, TopkRouter};
use crate::nn::norm::RmsNorm;
use crate::nn::param::{Builder, Init, ParamRef, ParamVisitor, WeightSource};
use crate::precision::Precision;

/// A causal LM of any [`Architecture`]: [`DecoderModel`] + `lm_head` (absent when tied to
/// the embeddings). Built by [`CausalLm::init`] (random), [`CausalLm::from_hf_tensors`] or
/// [`CausalLm::from_pretrained`] (the registry: the architecture comes from `model_type`).
#[derive(Module, Debug)]
pub struct CausalLm {
    /// `model`.
    pub model: DecoderModel,
    /// `lm_head` (no bias); `None` with `tie_word_embeddings`.
    pub lm_head: Option<Linear>,
    /// Hyper-parameters.
    #[module(skip)]
    pub config: ModelConfig,
    /// The LoRA configuration when adapters are attached ([`CausalLm::with_lora`]).
    #[module(skip)]
    pub lora: Option<LoraConfig>,
    /// Inference only: the output projection through [`FusedLinear`] (split over
    /// both cores on flex), set by [`CausalLm::fuse_projections`].
    #[module(skip)]
    pub packed_lm_head: Option<FusedLinear>,
    /// Checkpoint tensors that are not part of the text model, carried through untouched
    /// and written back byte for byte by [`CausalLm::to_hf_tensors`]: a vision-language
    /// checkpoint's vision tower (`model.visual.*`) and, for Qwen3.5, the
    /// multi-token-prediction layers (`mtp.*`), under their checkpoint names.
    #[module(skip)]
    pub passthrough: NamedTensors,
}

/// The prefix of the text model's weights in a vision-language checkpoint.
pub(crate) const LANGUAGE_MODEL: &str = "model.language_model.";

/// Splits checkpoint tensors into the text model's (renamed to `model.*` for a
/// vision-language checkpoint) and the ones carried through ([`CausalLm::passthrough`]).
fn split_passthrough(config: &ModelConfig, tensors: NamedTensors) -> (NamedTensors, NamedTensors) {
    let multimodal = config.multimodal.is_some();
    let hybrid = config.linear_attention.is_some();
    let mut text = NamedTensors::new();
    let mut carried = NamedTensors::new();
    for (name, tensor) in tensors {
        if multimodal {
            if let Some(rest) = name.strip_prefix(LANGUAGE_MODEL) {
                text.insert(format!("model.{rest}"), tensor);
            } else if name == "lm_head.weight" {
                text.insert(name, tensor);
            } else {
                carried.insert(name, tensor);
            }
        } else if hybrid && name.starts_with("mtp.") {
            carried.insert(name, tensor);
        } else {
            text.insert(name, tensor);
        }
    }
    (text, carried)
}

impl CausalLm {
    /// The model's architecture.
    pub fn architecture(&self) -> Architecture {
        self.config.architecture
    }

    /// The output projection `[vocab, hidden]`: `lm_head.weight` (with its LoRA adapter merged
    /// in, if any), or the embedding matrix when the embeddings are tied.
    pub fn lm_head_weight(&self) -> Tensor<2> {
        match &self.lm_head {
            Some(head) => head.effective_weight(),
            None => self.model.embed_tokens.val(),
        }
    }

    /// Prepares the model for inference on its current weights: each attention's q / k / v
    /// projections and each SwiGLU MLP's (dense and shared experts) gate / up projections
    /// become one matmul ([`FusedLinear`], adapters merged): on flex in `f32` packed once here
    /// into panels with AVX-512F ([`DecodeWeights::Packed`], what this method chooses), or
    /// over the layers' own buffers, read in place ([`miles_ops::rows`], `o` / `down` /
    /// `lm_head` too: no copy, see [`CausalLm::decode_copy_params`]) with AVX2 only or with
    /// [`DecodeWeights::InPlace`] ([`CausalLm::fuse_projections_with`]); elsewhere over
    /// weights stacked once here, run with the output / down projections and `lm_head` through [`miles_ops::linear()`] (small
    /// matmuls split over both cores on flex). The fused layers do not follow later changes
    /// to the parameters (an optimizer step writes shared buffers anew, copy-on-write): call
    /// this on a model whose weights no longer change (the embedded engine builds its step
    /// model anew from every weight version), never on one being trained. MoE layers get
    /// their routed experts packed for the sparse dispatch ([`PackedMoe`]). Grouped-query attention
    /// layers, and Gated DeltaNet layers (their four input projections as one matmul,
    /// `out_proj` through one); latent-attention layers keep their projections.
    pub fn fuse_projections(&mut self) {
        self.fuse_projections_with(DecodeWeights::default());
    }

    /// [`CausalLm::fuse_projections`] with the dense weights' decode layout chosen by `decode`.
    pub fn fuse_projections_with(&mut self, decode: DecodeWeights) {
        self.packed_lm_head = Some(FusedLinear::from_weight(self.lm_head_weight(), decode));
        for layer in &mut self.model.layers {
            match &mut layer.self_attn {
                SelfAttention::Grouped(a) => a.fuse(decode),
                SelfAttention::Linear(linear) => linear.fuse(decode),
                SelfAttention::Latent(_) => {}
            }
            match &mut layer.mlp {
                FeedForward::Dense(mlp) => mlp.fuse(decode),
                FeedForward::Moe(moe) => {
                    if let Some(shared) = &mut moe.shared_experts {
                        shared.fuse(decode);
                    }
                    moe.packed = Some(PackedMoe {
                        gate_up: miles_ops::PackedExperts::glu(
                            moe.experts.effective_gate_proj(),
                            moe.experts.effective_up_proj(),
                        ),
                        down: miles_ops::PackedExperts::new(moe.experts.effective_down_proj()),
                    });
                }
                // GPT-OSS's experts keep their dense dispatch (nothing packed).
                FeedForward::BiasedMoe(_) => {}
            }
        }
    }

    /// Parameters [`CausalLm::fuse_projections_with`]`(decode)` copies into decode layouts
    /// instead of reading them in place. Where the in-place kernels run (flex, `f32`, AVX2 and
    /// FMA or AVX-512F) and are chosen (always with AVX2 only; with AVX-512F for
    /// [`DecodeWeights::InPlace`]) the dense projections, linear attention's and `lm_head`
    /// are multiplied where they lie ([`miles_ops::rows`]), so only the routed experts of
    /// MoE layers are copied (strided per expert); elsewhere every parameter is counted
    /// (packed panels; an upper bound on other devices: projections stacked or stored
    /// transposed).
    pub fn decode_copy_params(&self, decode: DecodeWeights) -> usize {
        let w = self.lm_head_weight();
        let packs =
            decode == DecodeWeights::Packed && miles_ops::packed::applies(&w.device(), w.dtype());
        if packs || !miles_ops::rows::applies(&w.device(), w.dtype()) {
            return self.num_params();
        }
        let size = |p: &Param<Tensor<3>>| p.val().dims().iter().product::<usize>();
        self.model
            .layers
            .iter()
            .map(|layer| match &layer.mlp {
                FeedForward::Moe(moe) => {
                    let e = &moe.experts;
                    size(&e.gate_proj) + size(&e.up_proj) + size(&e.down_proj)
                }
                FeedForward::Dense(_) | FeedForward::BiasedMoe(_) => 0,
            })
            .sum()
    }

    /// Sets how every MoE layer applies its routed experts (default [`MoeDispatch::Auto`]).
    pub fn set_moe_dispatch(&mut self, dispatch: MoeDispatch) {
        for layer in &mut self.model.layers {
            if let FeedForward::Moe(block) = &mut layer.mlp {
                block.dispatch = dispatch;
            }
        }
    }

    fn build(
        config: &ModelConfig,
        device: &Device,
        source: WeightSource<'_>,
        precision: Precision,
    ) -> Result<Self, BridgeError> {
        config.validate()?;
        let c = config;
        let spec = c.architecture.spec();
        let offset = spec.norm_unit_offset;
        let mut b = Builder {
            device: device.clone(),
            source,
            dtype: precision.float_dtype(),
        };
        let embed_tokens = b.param(
            "model.embed_tokens.weight",
            [c.vocab_size, c.hidden_size],
            Init::Normal,
        )?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        let mut moe_index = 0;
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let shape = AttentionShape {
                hidden: c.hidden_size,
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                bias: c.attention_bias,
                qk_norm: c.use_qk_norm,
                eps: c.rms_norm_eps,
                output_gate: spec.attention_output_gate,
                norm_unit_offset: offset,
                o_bias: spec.o_proj_bias && c.attention_bias,
                sinks: spec.attention_sinks,
                rope_attention_factor: c.rope_attention_factor(),
            };
            let input_layernorm = RmsNorm::build_with(
                &mut b,
                &format!("{p}.input_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
                offset,
            )?;
            let self_attn = match (c.mla, c.linear_attention) {
                (_, Some(lin)) if c.is_linear_layer(l) => {
                    SelfAttention::Linear(GatedDeltaNet::build(
                        &mut b,
                        &format!("{p}.linear_attn"),
                        c.hidden_size,
                        lin,
                        c.rms_norm_eps,
                    )?)
                }
                (Some(mla), _) => SelfAttention::Latent(LatentAttention::build(
                    &mut b,
                    &format!("{p}.self_attn"),
                    c.hidden_size,
                    c.num_attention_heads,
                    mla,
                    c.attention_bias,
                    c.softmax_scale(),
                    c.rope_attention_factor(),
                )?),
                (None, _) => SelfAttention::Grouped(Attention::build(
                    &mut b,
                    &format!("{p}.self_attn"),
                    shape,
                )?),
            };
            let post_attention_layernorm = RmsNorm::build_with(
                &mut b,
                &format!("{p}.post_attention_layernorm"),
                c.hidden_size,
                c.rms_norm_eps,
                offset,
            )?;
            let mlp = if c.is_moe_layer(l) && spec.moe.experts == ExpertKind::ClampedSwiGluBiased {
                let block = BiasedMoeBlock::build(
                    &mut b,
                    &format!("{p}.mlp"),
                    BiasedMoeShape {
                        hidden: c.hidden_size,
                        intermediate: c.moe_intermediate_size,
                        experts: c.n_routed_experts,
                        top_k: c.num_experts_per_tok,
                        alpha: c.swiglu_alpha,
                        limit: c.swiglu_limit,
                        layer_index: l,
                        moe_index,
                    },
                )?;
                moe_index += 1;
                FeedForward::BiasedMoe(block)
            } else if c.is_moe_layer(l) {
                let (e, h, i) = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size);
                let gate = TopkRouter {
                    weight: b.param(&format!("{p}.mlp.gate.weight"), [e, h], Init::Normal)?,
                    e_score_correction_bias: match c.router {
                        RouterKind::SigmoidGrouped => Some(
                            b.param(
                                &format!("{p}.mlp.gate.e_score_correction_bias"),
                                [e],
                                Init::Zeros,
                            )?
                            .set_require_grad(false),
                        ),
                        RouterKind::Softmax => None,
                    },
                };
                let layer_prefix = format!("{p}.");
                let stack = |b: &mut Builder<'_>, k: usize, shape| {
                    b.param(
                        &EXPERT_STACKS[k].internal_name(&layer_prefix),
                        shape,
                        Init::Normal,
                    )
                };
                let experts = Experts {
                    gate_proj: stack(&mut b, 0, [e, i, h])?,
                    up_proj: stack(&mut b, 1, [e, i, h])?,
                    down_proj: stack(&mut b, 2, [e, h, i])?,
                    gate_proj_lora: None,
                    up_proj_lora: None,
                    down_proj_lora: None,
                };
                let (shared_experts, shared_expert_gate, shared_name) = match spec.moe.shared_expert
                {
                    SharedExpertKind::Gated => (
                        Some(Mlp::build(
                            &mut b,
                            &format!("{p}.mlp.shared_expert"),
                            h,
                            c.shared_expert_intermediate_size,
                        )?),
                        Some(Linear::build(
                            &mut b,
                            &format!("{p}.mlp.shared_expert_gate"),
                            h,
                            1,
                            false,
                        )?),
                        "shared_expert",
                    ),
                    SharedExpertKind::Summed if c.n_shared_experts > 0 => (
                        Some(Mlp::build(
                            &mut b,
                            &format!("{p}.mlp.shared_experts"),
                            h,
                            i * c.n_shared_experts,
                        )?),
                        None,
                        "shared_experts",
                    ),
                    SharedExpertKind::Summed => (None, None, "shared_experts"),
                };
                let block = MoeBlock {
                    router: c.router,
                    gate,
                    experts,
                    shared_experts,
                    shared_expert_gate,
                    shared_name,
                    layer_index: l,
                    moe_index,
                    top_k: c.num_experts_per_tok,
                    n_group: c.n_group,
                    topk_group: c.topk_group,
                    norm_topk_prob: c.norm_topk_prob,
                    routed_scaling_factor: c.routed_scaling_factor,
                    dispatch: MoeDispatch::default(),
                    packed: None,
                };
                moe_index += 1;
                FeedForward::Moe(block)
            } else {
                FeedForward::Dense(Mlp::build(
                    &mut b,
                    &format!("{p}.mlp"),
                    c.hidden_size,
                    c.intermediate_size,
                )?)
            };
            layers.push(DecoderLayer {
                input_layernorm,
                self_attn,
                post_attention_layernorm,
                mlp,
            });
        }
        let norm =
            RmsNorm::build_with(&mut b, "model.norm", c.hidden_size, c.rms_norm_eps, offset)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(Linear::build(
                &mut b,
                "lm_head",
                c.hidden_size,
                c.vocab_size,
                false,
            )?)
        };
        Ok(Self {
            model: DecoderModel {
                embed_tokens,
                layers,
                norm,
            },
            lm_head,
            config: c.clone(),
            lora: None,
            packed_lm_head: None,
            passthrough: NamedTensors::new(),
        })
    }

    /// A randomly initialised model (normal(0, `initializer_range`) weights, unit norms,
    /// zero biases) on `device`.
    pub fn init(config: &ModelConfig, device: &Device) -> Result<Self, BridgeError> {
        Self::build(
            config,
            device,
            WeightSource::Random {
                std: config.initializer_range,
            },
            Precision::F32,
        )
    }

    /// Builds the model from HF-named host tensors (per-expert keys, any float dtype).
    /// Missing, unexpected and wrongly shaped tensors are errors naming the tensor; DeepSeek-V3
    /// multi-token-prediction layers ([`mtp_tensor_names`]) and, with `n_shared_experts = 0`,
    /// the empty `mlp.shared_experts.*` tensors transformers saves are skipped.
    pub fn from_hf_tensors(
        config: &ModelConfig,
        tensors: NamedTensors,
        device: &Device,
    ) -> Result<Self, BridgeError> {
        Self::from_hf_tensors_in(config, tensors, device, Precision::F32)
    }

    /// [`CausalLm::from_hf_tensors`] with the weights held in `precision`: each tensor is
    /// converted once, from the file's dtype to the model's, as it is loaded (what
    /// [`CausalLm::to_precision`] gives for an `f32` model, without the `f32` copy).
    pub fn from_hf_tensors_in(
        config: &ModelConfig,
        tensors: NamedTensors,
        device: &Device,
        precision: Precision,
    ) -> Result<Self, BridgeError> {
        let (mut tensors, passthrough) = split_passthrough(config, tensors);
        for name in mtp_tensor_names(config, &tensors) {
            tensors.remove(&name);
        }
        if config.n_shared_experts == 0 {
            // transformers builds (and saves) a zero-width shared-expert MLP when
            // `n_shared_experts` is 0; its empty tensors hold nothing to load.
            tensors.retain(|name, t| !(t.numel() == 0 && name.contains(".mlp.shared_experts.")));
        }
        let mut internal = hf_to_internal(tensors, config.n_routed_experts)?;
        if config.tie_word_embeddings {
            internal.remove("lm_head.weight");
        }
        let mut model = Self::build(
            config,
            device,
            WeightSource::Loaded(&mut internal),
            precision,
        )?;
        if let Some(name) = internal_to_hf(internal).keys().next() {
            let name = match config.multimodal {
                Some(_) => name.replacen("model.", LANGUAGE_MODEL, 1),
                None => name.to_owned(),
            };
            return Err(BridgeError::UnexpectedTensor { name });
        }
        model.passthrough = passthrough;
        Ok(model)
    }

    /// Loads `dir/config.json` and its safetensors weights (single file or sharded).
    /// DeepSeek-V3 multi-token-prediction layers ([`mtp_tensor_names`]) are skipped.
    pub fn from_pretrained(dir: impl AsRef<Path>, device: &Device) -> Result<Self, BridgeError> {
        Self::from_pretrained_in(dir, device, Precision::F32)
    }

    /// [`CausalLm::from_pretrained`] with the weights held in `precision` (see
    /// [`CausalLm::from_hf_tensors_in`]).
    pub fn from_pretrained_in(
        dir: impl AsRef<Path>,
        device: &Device,
        precision: Precision,
    ) -> Result<Self, BridgeError> {
        let dir = dir.as_ref();
        let config = ModelConfig::from_file(dir.join("config.json"))?;
        let tensors = NamedTensors::read_hf_checkpoint(dir)?;
        Self::from_hf_tensors_in(&config, tensors, device, precision)
    }

    /// The model with every parameter cast to `precision`'s dtype (GLM's
    /// `e_score_correction_bias` stays `f32`), the inference-only fused / packed copies
    /// dropped (build them again with [`CausalLm::fuse_projections`]).
    ///
    /// On an autodiff device the cast is part of the graph: gradients of a forward through
    /// the cast model arrive on the original (`f32` master) parameters, in their dtype —
    /// mixed-precision training. The forward of a half-precision model computes in its
    /// dtype except where precision matters most, which stays in `f32`: RMSNorm statistics,
    /// attention scores / softmax / weighted sum, MoE router logits, scores and weights (then
    /// rounded to the compute dtype), and the RoPE tables (computed in `f32`, rounded like
    /// transformers does). Logits come out in the compute dtype; scoring code casts up
    /// (`token_logprobs` does).
    pub fn to_precision(self, precision: Precision) -> CausalLm {
        struct Cast(FloatDType);
        impl ModuleMapper for Cast {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let dtype = self.0;
                param.map(|t| t.cast(dtype))
            }
        }
        if self.precision() == Some(precision) && self.packed_lm_head.is_none() {
            return self;
        }
        let biases: Vec<Option<Param<Tensor<1>>>> = self
            .model
            .layers
            .iter()
            .map(|l| match &l.mlp {
                FeedForward::Moe(m) => m.gate.e_score_correction_bias.clone(),
                FeedForward::Dense(_) | FeedForward::BiasedMoe(_) => None,
            })
            .collect();
        let mut model = self.map(&mut Cast(precision.float_dtype()));
        model.packed_lm_head = None;
        for (layer, bias) in model.model.layers.iter_mut().zip(biases) {
            if let SelfAttention::Grouped(a) = &mut layer.self_attn {
                a.fused_qkv = None;
                a.packed_o = None;
            }
            match &mut layer.mlp {
                FeedForward::Dense(mlp) => mlp.unfuse(),
                FeedForward::BiasedMoe(_) => {}
                FeedForward::Moe(moe) => {
                    moe.gate.e_score_correction_bias = bias;
                    moe.packed = None;
                    if let Some(shared) = &mut moe.shared_experts {
                        shared.unfuse();
                    }
                }
            }
        }
        model
    }

    /// The precision the model's weights are held in (that of its embeddings); `None` for
    /// another dtype (f64).
    pub fn precision(&self) -> Option<Precision> {
        Precision::of_dtype(self.model.embed_tokens.val().dtype())
    }

    /// Calls `f(our name, parameter)` for every base parameter (the HF checkpoint's), in a
    /// fixed order; LoRA adapters are visited by [`CausalLm::visit_lora_params`].
    pub fn visit_params(&self, f: &mut ParamVisitor<'_>) {
        f(
            "model.embed_tokens.weight",
            ParamRef::R2(&self.model.embed_tokens),
        );
        for (l, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            layer
                .input_layernorm
                .visit(&format!("{p}.input_layernorm"), f);
            layer
                .self_attn
                .visit(&format!("{p}.{}", layer.self_attn.hf_name()), f);
            layer
                .post_attention_layernorm
                .visit(&format!("{p}.post_attention_layernorm"), f);
            match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.visit(&format!("{p}.mlp"), f),
                FeedForward::Moe(moe) => moe.visit(&format!("{p}.mlp"), f),
                FeedForward::BiasedMoe(moe) => moe.visit(&format!("{p}.mlp"), f),
            }
        }
        self.model.norm.visit("model.norm", f);
        if let Some(head) = &self.lm_head {
            head.visit("lm_head", f);
        }
    }

    /// Total number of parameter elements (buffers such as `e_score_correction_bias` included).
    pub fn num_params(&self) -> usize {
        let mut n = 0;
        self.visit_params(&mut |_, p| n += p.shape().iter().product::<usize>());
        n
    }

    /// All base weights as HF-named host tensors (per-expert keys), stored in `dtype`; LoRA
    /// adapters are not merged in (see [`CausalLm::to_hf_tensors_merged`]).
    pub fn to_hf_tensors(&self, dtype: DType) -> Result<NamedTensors, BridgeError> {
        let mut internal = NamedTensors::new();
        let mut failure = None;
        self.visit_params(&mut |name, p| {
            let data = p.to_data().convert::<f32>();
            let shape = data.shape().to_vec();
            let host = if dtype == DType::F32 && cfg!(target_endian = "little") {
                // f32 on a little-endian host: the tensor's bytes are already the file's.
                TensorBytes::new(DType::F32, shape, data.as_bytes().to_vec())
                    .map_err(BridgeError::from)
            } else {
                data.try_to_vec::<f32>()
                    .map_err(|e| BridgeError::UnsupportedDtype {
                        name: name.to_string(),
                        dtype: format!("{e:?}"),
                    })
                    .and_then(|values| Ok(TensorBytes::from_f32(shape, &values)?.cast(dtype)?))
            };
            match host {
                Ok(host) => {
                    internal.insert(name, host);
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        });
        match failure {
            Some(err) => Err(err),
            None => Ok(self.with_checkpoint_names(internal_to_hf(internal))),
        }
    }

    /// Our HF-named tensors under the checkpoint's names (`model.language_model.*` for a
    /// vision-language checkpoint), with the carried-through tensors added back.
    pub(crate) fn with_checkpoint_names(&self, tensors: NamedTensors) -> NamedTensors {
        let mut out: NamedTensors = match self.config.multimodal {
            Some(_) => tensors
                .into_iter()
                .map(|(name, t)| match name.strip_prefix("model.") {
                    Some(rest) => (format!("{LANGUAGE_MODEL}{rest}"), t),
                    None => (name, t),
                })
                .collect(),
            None => tensors,
        };
        out.extend(self.passthrough.clone());
        out
    }

    /// Writes `config.json` and the weights in `dtype` into `dir` (sharded when
    /// `max_shard_bytes` is exceeded).
    pub fn save_pretrained(
        &self,
        dir: impl AsRef<Path>,
        dtype: DType,
        max_shard_bytes: Option<usize>,
    ) -> Result<(), BridgeError> {
        let dir = dir.as_ref();
        let tensors = self.to_hf_tensors(dtype)?;
        let limit = max_shard_bytes.map_or(u64::MAX, |b| b as u64);
        tensors.write_hf_shards(dir, None, limit)?;
        let mut config = self.config.to_hf_json();
        config["torch_dtype"] = serde_json::Value::String(dtype.torch_name().to_string());
        let path = dir.join("config.json");
        let text = serde_json::to_string_pretty(&config).map_err(|e| BridgeError::Json {
            path: path.clone(),
            source: e,
        })?;
        std::fs::write(&path, text).map_err(|e| BridgeError::io(&path, e))
    }
}

/// The checkpoint tensors of DeepSeek-V3's multi-token-prediction layers
/// (`model.layers.{l}.*` for `num_hidden_layers <= l < num_hidden_layers +
/// num_nextn_predict_layers`), which [`CausalLm::from_hf_tensors`] skips: they are not part of
/// the causal LM (transformers does not load them either), are not trained and are not
/// exported. Empty for the other architectures.
pub fn mtp_tensor_names(config: &ModelConfig, tensors: &NamedTensors) -> Vec<String> {
    let first = config.num_hidden_layers;
    let end = first + config.num_nextn_predict_layers;
    tensors
        .keys()
        .filter(|name| {
            name.strip_prefix("model.layers.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|l| l.parse::<usize>().ok())
                .is_some_and(|l| (first..end).contains(&l))
        })
        .map(str::to_owned)
        .collect()
}
