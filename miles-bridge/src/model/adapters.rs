//! LoRA on a [`CausalLm`]: attaching adapters to the modules a [`LoraConfig`] targets (PEFT's
//! init from a seed, or a PEFT adapter's tensors) and freezing the base, merging them, and the
//! merged HF export and PEFT adapter export engines and PEFT read. The adapters themselves and
//! their configuration are [`crate::lora`]'s.

use std::collections::HashSet;
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};
use miles_core::rng::SplitMix64;
use miles_core::{DType, NamedTensors, TensorBytes};

use crate::error::BridgeError;
use crate::lora::{
    ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, ExpertLora, LoraAdapter, LoraConfig, LoraForward,
    PEFT_PREFIX, ParamLora,
};
use crate::model::causal_lm::{CausalLm, LANGUAGE_MODEL};
use crate::names::EXPERT_STACKS;
use crate::nn::layer::FeedForward;
use crate::nn::linear::Linear;
use crate::nn::param::{ParamRef, ParamVisitor};

/// `n` values uniform in `[-bound, bound)` from `rng`'s 24-bit floats: `lora_A`'s PEFT init
/// (deterministic; no global RNG state involved).
fn uniform(rng: &mut SplitMix64, n: usize, bound: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * bound)
        .collect()
}

/// Where adapter values come from while adapters are attached.
enum AdapterSource<'a> {
    /// PEFT init: `A` ~ Uniform(±1/√in), `B` = 0.
    Init(SplitMix64),
    /// PEFT-named host tensors (each removed when used).
    Peft(&'a mut NamedTensors),
}

fn tensor_from<const D: usize>(values: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

fn take_peft(map: &mut NamedTensors, name: &str, shape: &[usize]) -> Result<Vec<f32>, BridgeError> {
    let t = map.remove(name).ok_or_else(|| BridgeError::MissingTensor {
        name: name.to_string(),
    })?;
    if t.shape() != shape {
        return Err(BridgeError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            got: t.shape().to_vec(),
        });
    }
    Ok(t.to_f32()?)
}

impl AdapterSource<'_> {
    /// Whether adapters for the routed experts `projection` of the layer at `layer_prefix`
    /// can be attached: always for a fresh init; for a PEFT adapter only when it holds them
    /// (PEFT with transformers 5 never adapts fused expert stacks through `target_modules`:
    /// a `gate_proj` entry then reaches the shared expert only).
    fn has_experts(&self, layer_prefix: &str, projection: &str) -> bool {
        match self {
            Self::Init(_) => true,
            Self::Peft(map) => map.contains_key(&format!(
                "{PEFT_PREFIX}{layer_prefix}mlp.experts.0.{projection}.lora_A.weight"
            )),
        }
    }

    /// Whether the PEFT adapter holds tensors on the fused experts `experts`
    /// (`model.layers.{l}.mlp.experts`); always for a fresh init.
    fn has_parameter_adapters(&self, experts: &str) -> bool {
        match self {
            Self::Init(_) => true,
            Self::Peft(map) => {
                let prefix = format!("{PEFT_PREFIX}{experts}.");
                map.keys()
                    .any(|k| k.starts_with(&prefix) && k.contains(".lora_"))
            }
        }
    }

    /// The adapter of a fused expert parameter `[E, in, out]`, PEFT's tensors named after
    /// `module` (`model.layers.{l}.mlp.experts[.base_layer]`).
    fn parameter(
        &mut self,
        module: &str,
        [e, d_in, d_out]: [usize; 3],
        config: &LoraConfig,
        device: &Device,
    ) -> Result<ParamLora, BridgeError> {
        let r = config.r;
        let (a, b) = match self {
            // PEFT's `ParamWrapper` builds `lora_A` as `nn.Linear(in, r·E)`: the same
            // kaiming-uniform bound as a linear layer's.
            Self::Init(rng) => (
                uniform(rng, e * r * d_in, 1.0 / (d_in as f32).sqrt()),
                vec![0.0; d_out * r * e],
            ),
            Self::Peft(map) => (
                take_peft(
                    map,
                    &format!("{PEFT_PREFIX}{module}.lora_A.weight"),
                    &[e * r, d_in],
                )?,
                take_peft(
                    map,
                    &format!("{PEFT_PREFIX}{module}.lora_B.weight"),
                    &[d_out, r * e],
                )?,
            ),
        };
        Ok(ParamLora {
            lora_a: Param::from_tensor(tensor_from(a, [e * r, d_in], device)),
            lora_b: Param::from_tensor(tensor_from(b, [d_out, r * e], device)),
            experts: e,
            scaling: config.scaling(),
        })
    }

    fn linear(
        &mut self,
        module: &str,
        [d_out, d_in]: [usize; 2],
        config: &LoraConfig,
        device: &Device,
    ) -> Result<LoraAdapter, BridgeError> {
        let r = config.r;
        let (a, b) = match self {
            Self::Init(rng) => (
                uniform(rng, r * d_in, 1.0 / (d_in as f32).sqrt()),
                vec![0.0; d_out * r],
            ),
            Self::Peft(map) => (
                take_peft(
                    map,
                    &format!("{PEFT_PREFIX}{module}.lora_A.weight"),
                    &[r, d_in],
                )?,
                take_peft(
                    map,
                    &format!("{PEFT_PREFIX}{module}.lora_B.weight"),
                    &[d_out, r],
                )?,
            ),
        };
        Ok(LoraAdapter {
            lora_a: Param::from_tensor(tensor_from(a, [r, d_in], device)),
            lora_b: Param::from_tensor(tensor_from(b, [d_out, r], device)),
            scaling: config.scaling(),
            mode: config.forward,
        })
    }

    fn experts(
        &mut self,
        layer_prefix: &str,
        projection: &str,
        [e, d_out, d_in]: [usize; 3],
        config: &LoraConfig,
        device: &Device,
    ) -> Result<ExpertLora, BridgeError> {
        let r = config.r;
        let (a, b) = match self {
            Self::Init(rng) => (
                uniform(rng, e * r * d_in, 1.0 / (d_in as f32).sqrt()),
                vec![0.0; e * d_out * r],
            ),
            Self::Peft(map) => {
                let mut a = Vec::with_capacity(e * r * d_in);
                let mut b = Vec::with_capacity(e * d_out * r);
                for x in 0..e {
                    let m = format!("{PEFT_PREFIX}{layer_prefix}mlp.experts.{x}.{projection}");
                    a.extend(take_peft(map, &format!("{m}.lora_A.weight"), &[r, d_in])?);
                    b.extend(take_peft(map, &format!("{m}.lora_B.weight"), &[d_out, r])?);
                }
                (a, b)
            }
        };
        Ok(ExpertLora {
            lora_a: Param::from_tensor(tensor_from(a, [e, r, d_in], device)),
            lora_b: Param::from_tensor(tensor_from(b, [e, d_out, r], device)),
            scaling: config.scaling(),
        })
    }
}

/// GPT-OSS's adaptable fused expert parameters, in the order `GptOssExperts` registers them
/// (PEFT nests its wrappers in that order), with the projections fused into each (the
/// `target_modules` names that reach it).
const FUSED_EXPERT_PARAMETERS: [(&str, &[&str]); 2] = [
    ("gate_up_proj", &["gate_proj", "up_proj"]),
    ("down_proj", &[]),
];

/// The module PEFT names the adapter of the fused parameter `index` of
/// [`FUSED_EXPERT_PARAMETERS`] after, given which of them are adapted: each later adapted
/// parameter wraps it once more, so its name gains a `.base_layer` per wrapper above it.
fn peft_wrapper_module(experts: &str, adapted: [bool; 2], index: usize) -> String {
    let above = adapted[index + 1..].iter().filter(|a| **a).count();
    format!("{experts}{}", ".base_layer".repeat(above))
}

/// Sets `require_grad` of the parameters in `ids`.
struct SetRequireGrad {
    ids: HashSet<ParamId>,
    value: bool,
}

impl ModuleMapper for SetRequireGrad {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.ids.contains(&param.id) {
            param.set_require_grad(self.value)
        } else {
            param
        }
    }
}

fn param_id(p: ParamRef<'_>) -> ParamId {
    match p {
        ParamRef::R1(p) => p.id,
        ParamRef::R2(p) => p.id,
        ParamRef::R3(p) => p.id,
    }
}

/// `p + delta` as a new leaf with `p`'s id and gradient setting.
fn merged_param<const D: usize>(p: &Param<Tensor<D>>, delta: Tensor<D>) -> Param<Tensor<D>> {
    p.clone().map(|w| {
        let require = w.is_require_grad();
        let merged = (w + delta).detach();
        if require {
            merged.require_grad()
        } else {
            merged
        }
    })
}

fn host(name: &str, data: TensorData, dtype: DType) -> Result<TensorBytes, BridgeError> {
    let shape = data.shape().to_vec();
    let values =
        data.convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| BridgeError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{e:?}"),
            })?;
    Ok(TensorBytes::from_f32(shape, &values)?.cast(dtype)?)
}

impl CausalLm {
    /// Every dense linear layer with its module name, in a fixed order (attention, dense MLP,
    /// shared experts per layer, then `lm_head`).
    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            let attn = layer.self_attn.hf_name();
            for (n, lin) in layer.self_attn.linears() {
                out.push((format!("{p}.{attn}.{n}"), lin));
            }
            let mlp = match &layer.mlp {
                FeedForward::Dense(m) => Some((format!("{p}.mlp"), m)),
                FeedForward::Moe(moe) => moe
                    .shared_experts
                    .as_ref()
                    .map(|m| (format!("{p}.mlp.{}", moe.shared_name), m)),
                // GPT-OSS's experts are fused parameters (adapted in `attach_lora`).
                FeedForward::BiasedMoe(_) => None,
            };
            if let Some((q, m)) = mlp {
                for (n, lin) in [
                    ("gate_proj", &m.gate_proj),
                    ("up_proj", &m.up_proj),
                    ("down_proj", &m.down_proj),
                ] {
                    out.push((format!("{q}.{n}"), lin));
                }
            }
            if let FeedForward::Moe(moe) = &layer.mlp
                && let Some(gate) = &moe.shared_expert_gate
            {
                out.push((format!("{p}.mlp.shared_expert_gate"), gate));
            }
        }
        if let Some(head) = &self.lm_head {
            out.push(("lm_head".to_string(), head));
        }
        out
    }

    /// Mutable twin of [`Self::linears`] (same order).
    fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{l}");
            let attn = layer.self_attn.hf_name();
            for (n, lin) in layer.self_attn.linears_mut() {
                out.push((format!("{p}.{attn}.{n}"), lin));
            }
            let (mlp, shared_gate) = match &mut layer.mlp {
                FeedForward::Dense(m) => (Some((format!("{p}.mlp"), m)), None),
                FeedForward::Moe(moe) => {
                    let name = moe.shared_name;
                    (
                        moe.shared_experts
                            .as_mut()
                            .map(|m| (format!("{p}.mlp.{name}"), m)),
                        moe.shared_expert_gate.as_mut(),
                    )
                }
                FeedForward::BiasedMoe(_) => (None, None),
            };
            if let Some((q, m)) = mlp {
                out.push((format!("{q}.gate_proj"), &mut m.gate_proj));
                out.push((format!("{q}.up_proj"), &mut m.up_proj));
                out.push((format!("{q}.down_proj"), &mut m.down_proj));
            }
            if let Some(gate) = shared_gate {
                out.push((format!("{p}.mlp.shared_expert_gate"), gate));
            }
        }
        if let Some(head) = &mut self.lm_head {
            out.push(("lm_head".to_string(), head));
        }
        out
    }

    /// Attaches adapters to every targeted module, values from `source`, and freezes the base.
    fn attach_lora(
        mut self,
        config: &LoraConfig,
        mut source: AdapterSource<'_>,
    ) -> Result<Self, BridgeError> {
        config.validate()?;
        if self.lora.is_some() {
            return Err(BridgeError::config(
                "lora",
                "the model already has adapters (merge_lora first)",
            ));
        }
        let device = self.model.embed_tokens.val().device();
        let mut base_ids = HashSet::new();
        self.visit_params(&mut |_, p| {
            base_ids.insert(param_id(p));
        });
        let mut attached = 0usize;
        for (name, linear) in self.linears_mut() {
            if config.targets(&name) {
                let dims = linear.weight.val().dims();
                linear.lora = Some(source.linear(&name, dims, config, &device)?);
                attached += 1;
            }
        }
        for (l, layer) in self.model.layers.iter_mut().enumerate() {
            let FeedForward::Moe(moe) = &mut layer.mlp else {
                continue;
            };
            let prefix = format!("model.layers.{l}.");
            let ex = &mut moe.experts;
            let slots = [
                (&ex.gate_proj, &mut ex.gate_proj_lora),
                (&ex.up_proj, &mut ex.up_proj_lora),
                (&ex.down_proj, &mut ex.down_proj_lora),
            ];
            for (stack, (weight, slot)) in EXPERT_STACKS.iter().zip(slots) {
                let module = format!("{prefix}mlp.experts.{}", stack.projection);
                if config.targets(&module) && source.has_experts(&prefix, stack.projection) {
                    let dims = weight.val().dims();
                    *slot =
                        Some(source.experts(&prefix, stack.projection, dims, config, &device)?);
                    attached += 1;
                }
            }
        }
        let mut parameters = Vec::new();
        for (l, layer) in self.model.layers.iter_mut().enumerate() {
            let FeedForward::BiasedMoe(moe) = &mut layer.mlp else {
                continue;
            };
            let experts = format!("model.layers.{l}.mlp.experts");
            let present = source.has_parameter_adapters(&experts);
            let adapted = FUSED_EXPERT_PARAMETERS.map(|(parameter, fused)| {
                let name = format!("{experts}.{parameter}");
                config.names_parameter(&name)
                    || (present && config.targets_parameter(&experts, parameter, fused))
            });
            let slots = [
                (&moe.gate_up_proj, &mut moe.gate_up_proj_lora),
                (&moe.down_proj, &mut moe.down_proj_lora),
            ];
            for (index, (weight, slot)) in slots.into_iter().enumerate() {
                if adapted[index] {
                    let module = peft_wrapper_module(&experts, adapted, index);
                    let dims = weight.val().dims();
                    *slot = Some(source.parameter(&module, dims, config, &device)?);
                    parameters.push(format!("{experts}.{}", FUSED_EXPERT_PARAMETERS[index].0));
                    attached += 1;
                }
            }
        }
        if let Some(entry) = config.target_parameters.iter().find(|t| {
            !parameters
                .iter()
                .any(|p| p == *t || p.ends_with(&format!(".{t}")))
        }) {
            return Err(BridgeError::config(
                "target_parameters",
                format!(
                    "{entry:?} matches no adaptable parameter of this model (only GPT-OSS's \
                     fused experts mlp.experts.gate_up_proj / mlp.experts.down_proj are \
                     adapted as parameters)"
                ),
            ));
        }
        if attached == 0 {
            return Err(BridgeError::config(
                "target_modules",
                format!(
                    "{:?} (excluding {:?}) matches no linear module of this model",
                    config.target_modules, config.exclude_modules
                ),
            ));
        }
        if let AdapterSource::Peft(map) = source
            && let Some(name) = map.keys().next()
        {
            return Err(BridgeError::UnexpectedTensor {
                name: name.to_owned(),
            });
        }
        self.lora = Some(config.clone());
        Ok(self.map(&mut SetRequireGrad {
            ids: base_ids,
            value: false,
        }))
    }

    /// Attaches LoRA adapters (PEFT's default init: `A` ~ Uniform(±1/√in) from
    /// `config.seed`, `B` = 0) to every module `config` targets, and freezes every base
    /// parameter, so only the adapters receive gradients. The output is unchanged until `B`
    /// is trained. Errors when nothing matches or the config is invalid.
    pub fn with_lora(self, config: &LoraConfig) -> Result<Self, BridgeError> {
        let rng = SplitMix64::new(config.seed);
        self.attach_lora(config, AdapterSource::Init(rng))
    }

    /// Attaches adapters with the values of PEFT-named tensors
    /// (`base_model.model.<module>.lora_A.weight`, routed experts per expert, GPT-OSS's fused
    /// experts under PEFT's wrapper names) to the modules `config` targets (GPT-OSS's fused
    /// experts: those `target_parameters` names, and those `target_modules` reaches when the
    /// tensors hold adapters on that layer's experts); every targeted module needs its tensors and every tensor a targeted
    /// module (else [`BridgeError::MissingTensor`] / [`BridgeError::UnexpectedTensor`]).
    ///
    /// For a vision-language checkpoint (Qwen3.5's release layout) the text model's modules
    /// are accepted under both names PEFT gives them: `base_model.model.model.language_model.*`
    /// (PEFT on the checkpoint's own class, what [`Self::lora_to_peft_tensors`] writes) and
    /// `base_model.model.model.*` (PEFT on the text-only class `AutoModelForCausalLM` loads).
    pub fn with_lora_tensors(
        self,
        config: &LoraConfig,
        tensors: NamedTensors,
    ) -> Result<Self, BridgeError> {
        let mut tensors = if self.config.multimodal.is_some() {
            let wrapped = format!("{PEFT_PREFIX}{LANGUAGE_MODEL}");
            let text = format!("{PEFT_PREFIX}model.");
            let mut renamed = NamedTensors::new();
            for (name, t) in tensors {
                let name = match name.strip_prefix(&wrapped) {
                    Some(rest) => format!("{text}{rest}"),
                    None => name,
                };
                renamed.insert(name, t);
            }
            renamed
        } else {
            tensors
        };
        self.attach_lora(config, AdapterSource::Peft(&mut tensors))
    }

    /// Reads a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
    /// and attaches it (see [`Self::with_lora_tensors`]) with the forward formulation
    /// `forward`.
    pub fn load_lora_adapter(
        self,
        dir: impl AsRef<Path>,
        forward: LoraForward,
    ) -> Result<Self, BridgeError> {
        let dir = dir.as_ref();
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| BridgeError::io(&path, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| BridgeError::Json {
                path: path.clone(),
                source: e,
            })?;
        let mut config = LoraConfig::from_peft_json(&json)?;
        config.forward = forward;
        let tensors = NamedTensors::from_safetensors_file(&dir.join(ADAPTER_WEIGHTS_FILE))?;
        self.with_lora_tensors(&config, tensors)
    }

    /// The adapter configuration, when adapters are attached.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// GPT-OSS's adapted fused expert parameters
    /// (`model.layers.{l}.mlp.experts.{gate_up_proj,down_proj}`), in a fixed order.
    pub fn lora_parameters(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter().enumerate() {
            if let FeedForward::BiasedMoe(moe) = &layer.mlp {
                let slots = [
                    moe.gate_up_proj_lora.is_some(),
                    moe.down_proj_lora.is_some(),
                ];
                for ((parameter, _), adapted) in FUSED_EXPERT_PARAMETERS.iter().zip(slots) {
                    if adapted {
                        out.push(format!("model.layers.{l}.mlp.experts.{parameter}"));
                    }
                }
            }
        }
        out
    }

    /// PEFT's key of the adapter tensor `name` (as [`Self::visit_lora_params`] names a 2-D
    /// one): `base_model.model.<name>`, for GPT-OSS's fused experts the name of PEFT's
    /// wrapper on `mlp.experts` (see [`crate::lora`]). Stacked routed-expert tensors are split
    /// per expert and a vision-language checkpoint's text modules renamed by
    /// [`Self::lora_to_peft_tensors`], not here.
    pub fn peft_tensor_name(&self, name: &str) -> String {
        let fused = (|| {
            let (module, tensor) = name.rsplit_once(".lora_")?;
            let (experts, parameter) = module.rsplit_once('.')?;
            let index = FUSED_EXPERT_PARAMETERS
                .iter()
                .position(|(p, _)| *p == parameter)?;
            let layer: usize = experts
                .strip_prefix("model.layers.")?
                .strip_suffix(".mlp.experts")?
                .parse()
                .ok()?;
            let FeedForward::BiasedMoe(moe) = &self.model.layers.get(layer)?.mlp else {
                return None;
            };
            let adapted = [
                moe.gate_up_proj_lora.is_some(),
                moe.down_proj_lora.is_some(),
            ];
            let wrapper = peft_wrapper_module(experts, adapted, index);
            Some(format!("{PEFT_PREFIX}{wrapper}.lora_{tensor}"))
        })();
        fused.unwrap_or_else(|| format!("{PEFT_PREFIX}{name}"))
    }

    /// Names of the adapted modules, in a fixed order (GPT-OSS's adapted fused expert
    /// parameters among them, as `model.layers.{l}.mlp.experts.<parameter>`).
    pub fn lora_modules(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit_lora_params(&mut |name, _| {
            if let Some(m) = name.strip_suffix(".lora_A.weight") {
                out.push(m.to_string());
            }
        });
        out
    }

    /// Calls `f(name, parameter)` for every adapter tensor, in a fixed order; names are
    /// `<module>.lora_A.weight` / `<module>.lora_B.weight` (routed experts stacked:
    /// `model.layers.{l}.mlp.experts.<proj>.lora_A.weight`, `[E, r, in]`; GPT-OSS's fused
    /// experts `model.layers.{l}.mlp.experts.{gate_up_proj,down_proj}.lora_A.weight` in PEFT's
    /// layout, `[E·r, in]` / `[out, r·E]`, which PEFT's file names after its wrappers: see
    /// [`crate::lora`]).
    pub fn visit_lora_params(&self, f: &mut ParamVisitor<'_>) {
        for (name, linear) in self.linears() {
            if let Some(lora) = &linear.lora {
                f(&format!("{name}.lora_A.weight"), ParamRef::R2(&lora.lora_a));
                f(&format!("{name}.lora_B.weight"), ParamRef::R2(&lora.lora_b));
            }
        }
        for (l, layer) in self.model.layers.iter().enumerate() {
            if let FeedForward::BiasedMoe(moe) = &layer.mlp {
                let slots = [&moe.gate_up_proj_lora, &moe.down_proj_lora];
                for ((parameter, _), slot) in FUSED_EXPERT_PARAMETERS.iter().zip(slots) {
                    if let Some(lora) = slot {
                        let m = format!("model.layers.{l}.mlp.experts.{parameter}");
                        f(&format!("{m}.lora_A.weight"), ParamRef::R2(&lora.lora_a));
                        f(&format!("{m}.lora_B.weight"), ParamRef::R2(&lora.lora_b));
                    }
                }
            }
            let FeedForward::Moe(moe) = &layer.mlp else {
                continue;
            };
            let ex = &moe.experts;
            let slots = [&ex.gate_proj_lora, &ex.up_proj_lora, &ex.down_proj_lora];
            for (stack, slot) in EXPERT_STACKS.iter().zip(slots) {
                if let Some(lora) = slot {
                    let m = format!("model.layers.{l}.mlp.experts.{}", stack.projection);
                    f(&format!("{m}.lora_A.weight"), ParamRef::R3(&lora.lora_a));
                    f(&format!("{m}.lora_B.weight"), ParamRef::R3(&lora.lora_b));
                }
            }
        }
    }

    /// Number of adapter parameter elements.
    pub fn num_lora_params(&self) -> usize {
        let mut n = 0;
        self.visit_lora_params(&mut |_, p| n += p.shape().iter().product::<usize>());
        n
    }

    /// Folds every adapter into its base weight (`W ← W + scaling·B·A`, the exact tensor the
    /// `Merged` forward uses) and removes the adapters. Base parameters keep their
    /// `require_grad` setting (frozen after [`Self::with_lora`]).
    pub fn merge_lora(mut self) -> Self {
        for (_, linear) in self.linears_mut() {
            if let Some(lora) = linear.lora.take() {
                linear.weight = merged_param(&linear.weight, lora.delta());
            }
        }
        for layer in &mut self.model.layers {
            if let FeedForward::BiasedMoe(moe) = &mut layer.mlp {
                for (weight, slot) in [
                    (&mut moe.gate_up_proj, &mut moe.gate_up_proj_lora),
                    (&mut moe.down_proj, &mut moe.down_proj_lora),
                ] {
                    if let Some(lora) = slot.take() {
                        *weight = merged_param(weight, lora.delta());
                    }
                }
            }
            let FeedForward::Moe(moe) = &mut layer.mlp else {
                continue;
            };
            let ex = &mut moe.experts;
            for (weight, slot) in [
                (&mut ex.gate_proj, &mut ex.gate_proj_lora),
                (&mut ex.up_proj, &mut ex.up_proj_lora),
                (&mut ex.down_proj, &mut ex.down_proj_lora),
            ] {
                if let Some(lora) = slot.take() {
                    *weight = merged_param(weight, lora.delta());
                }
            }
        }
        self.lora = None;
        self
    }

    /// HF-named weights with every adapter merged in (`W + scaling·B·A`), in `dtype`: what an
    /// inference engine that knows only the base model's names loads. Equal to
    /// [`Self::to_hf_tensors`] when no adapter is attached. The model is not modified.
    pub fn to_hf_tensors_merged(&self, dtype: DType) -> Result<NamedTensors, BridgeError> {
        if self.lora.is_none() {
            return self.to_hf_tensors(dtype);
        }
        self.valid().merge_lora().to_hf_tensors(dtype)
    }

    /// The adapters as PEFT-named host tensors in `dtype`
    /// (`base_model.model.<module>.lora_A.weight` `[r, in]` / `lora_B.weight` `[out, r]`;
    /// routed experts split into `…mlp.experts.{e}.<proj>.lora_A.weight`; GPT-OSS's fused
    /// experts under PEFT's wrapper names, [`Self::peft_tensor_name`]; a vision-language
    /// checkpoint's text modules under `base_model.model.model.language_model.*`, the names
    /// PEFT gives them on the checkpoint's own class). Empty without adapters.
    pub fn lora_to_peft_tensors(&self, dtype: DType) -> Result<NamedTensors, BridgeError> {
        let mut out = NamedTensors::new();
        let mut failure = None;
        self.visit_lora_params(&mut |name, p| {
            let result = (|| -> Result<(), BridgeError> {
                match p {
                    ParamRef::R3(_) => {
                        // `model.layers.{l}.mlp.experts.<proj>.lora_X.weight` → per expert.
                        let (module, which) = name
                            .rsplit_once(".lora_")
                            .ok_or_else(|| BridgeError::input(format!("bad name {name}")))?;
                        let (prefix, projection) = module
                            .rsplit_once('.')
                            .ok_or_else(|| BridgeError::input(format!("bad name {name}")))?;
                        let data = p.to_data();
                        let shape = data.shape().to_vec();
                        let values = data.convert::<f32>().try_to_vec::<f32>().map_err(|e| {
                            BridgeError::UnsupportedDtype {
                                name: name.to_string(),
                                dtype: format!("{e:?}"),
                            }
                        })?;
                        let per = shape[1] * shape[2];
                        for e in 0..shape[0] {
                            let key =
                                format!("{PEFT_PREFIX}{prefix}.{e}.{projection}.lora_{which}");
                            let t = TensorBytes::from_f32(
                                vec![shape[1], shape[2]],
                                &values[e * per..(e + 1) * per],
                            )?;
                            out.insert(key, t.cast(dtype)?);
                        }
                    }
                    _ => {
                        out.insert(self.peft_tensor_name(name), host(name, p.to_data(), dtype)?);
                    }
                }
                Ok(())
            })();
            if let Err(e) = result {
                failure.get_or_insert(e);
            }
        });
        if let Some(e) = failure {
            return Err(e);
        }
        if self.config.multimodal.is_none() {
            return Ok(out);
        }
        // A vision-language checkpoint: the text model's modules under
        // `model.language_model.*`, as PEFT names them on the checkpoint's own class.
        let text = format!("{PEFT_PREFIX}model.");
        let mut renamed = NamedTensors::new();
        for (name, t) in out {
            let name = match name.strip_prefix(&text) {
                Some(rest) => format!("{PEFT_PREFIX}{LANGUAGE_MODEL}{rest}"),
                None => name,
            };
            renamed.insert(name, t);
        }
        Ok(renamed)
    }

    /// PEFT's `adapter_config.json` for the attached adapters (`None` without adapters).
    pub fn peft_adapter_config(&self) -> Option<serde_json::Value> {
        let config = self.lora.as_ref()?;
        let parameters = self.lora_parameters();
        let mut modules = self.lora_modules();
        modules.retain(|m| !parameters.contains(m));
        Some(config.to_peft_json(&modules, &parameters))
    }

    /// Writes the adapters as a PEFT adapter directory (`adapter_model.safetensors` in `dtype`
    /// and `adapter_config.json`), loadable by PEFT's `PeftModel.from_pretrained` and by
    /// [`Self::load_lora_adapter`].
    pub fn save_lora_adapter(
        &self,
        dir: impl AsRef<Path>,
        dtype: DType,
    ) -> Result<(), BridgeError> {
        let dir = dir.as_ref();
        let Some(config) = self.peft_adapter_config() else {
            return Err(BridgeError::config("lora", "the model has no adapters"));
        };
        std::fs::create_dir_all(dir).map_err(|e| BridgeError::io(dir, e))?;
        let mut tensors = self.lora_to_peft_tensors(dtype)?;
        tensors.set_metadata("format", "pt");
        tensors.write_safetensors_file(&dir.join(ADAPTER_WEIGHTS_FILE))?;
        let path = dir.join(ADAPTER_CONFIG_FILE);
        let text = serde_json::to_string_pretty(&config).map_err(|e| BridgeError::Json {
            path: path.clone(),
            source: e,
        })?;
        std::fs::write(&path, text).map_err(|e| BridgeError::io(&path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_uniform_in_kaiming_bound() {
        let mut rng = SplitMix64::new(7);
        let v = uniform(&mut rng, 10_000, 0.125);
        assert!(v.iter().all(|x| (-0.125..0.125).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32;
        // Uniform(±b): mean 0, variance b²/3.
        assert!(mean.abs() < 0.005, "{mean}");
        assert!((var - 0.125f32.powi(2) / 3.0).abs() < 2e-4, "{var}");
    }
}
