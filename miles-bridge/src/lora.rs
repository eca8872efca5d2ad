//! LoRA adapters on the HF-layout [`Linear`] layers and the stacked routed experts, with
//! PEFT's naming, initialisation and `target_modules` semantics.
//!
//! burn's own `apply_lora` works on `burn::nn::Linear` only; this crate's layers keep HF's
//! `[out, in]` layout and names, so the adapters are written here:
//!
//! - an adapter on a linear layer `W: [out, in]` is `A: [r, in]`, `B: [out, r]` and
//!   `scaling = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`); the layer computes
//!   `y = x (W + scaling·B·A)^T + b` ([`LoraForward::Merged`], the default) or
//!   `y = x W^T + b + scaling·(x A^T) B^T` ([`LoraForward::Factored`], PEFT's formulation);
//! - `A` is initialised like PEFT's default (`kaiming_uniform_(a=√5)` = Uniform(±1/√in)) from a
//!   seeded generator, `B` with zeros, so a freshly attached adapter leaves the model's output
//!   unchanged (bit for bit in `Merged` mode: `W + 0 = W`);
//! - routed experts (stacked `[E, out, in]`) get per-expert adapters `A: [E, r, in]`,
//!   `B: [E, out, r]`, always applied in merged form;
//! - targets follow PEFT: a module is adapted when its name equals a `target_modules` entry or
//!   ends with `.<entry>`; `all-linear` means every linear layer except `lm_head` (attention,
//!   dense MLP, shared experts, routed experts); `exclude_modules` uses the same rule. Megatron's
//!   names are accepted too (`linear_qkv` → `q_proj,k_proj,v_proj`, `linear_proj` → `o_proj`,
//!   `linear_fc1` → `gate_proj,up_proj`, `linear_fc2` → `down_proj`), as Miles' flag does.
//!   Module names are this crate's: routed experts are `model.layers.{l}.mlp.experts.<proj>`;
//! - [`CausalLm::with_lora`] attaches and freezes every base parameter (only `lora_A` /
//!   `lora_B` require gradients); [`CausalLm::merge_lora`] folds the adapters into the base
//!   weights; [`CausalLm::to_hf_tensors_merged`] exports merged HF weights (what an inference
//!   engine that only knows HF names loads); [`CausalLm::lora_to_peft_tensors`] /
//!   [`CausalLm::save_lora_adapter`] write a PEFT adapter (`adapter_model.safetensors` with
//!   `base_model.model.<module>.lora_A.weight` / `lora_B.weight`, routed experts split per
//!   expert, and `adapter_config.json`) that [`CausalLm::load_lora_adapter`] reads back — as it
//!   reads adapters saved by PEFT.
//!
//! In `Merged` mode the trainer's forward multiplies by exactly the tensor
//! [`CausalLm::to_hf_tensors_merged`] exports, so an engine loaded with the merged weights
//! reproduces the LoRA model's log-probs bit for bit.

use std::collections::{BTreeSet, HashSet};
use std::path::Path;

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::BridgeError;
use crate::checkpoint::{FloatDtype, HostTensor, TensorMap, read_safetensors_file};
use crate::model::{CausalLm, FeedForward};
use crate::names::EXPERT_STACKS;
use crate::nn::{Linear, ParamRef, ParamVisitor};

/// Prefix PEFT puts before every module name in `adapter_model.safetensors`.
pub const PEFT_PREFIX: &str = "base_model.model.";
/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// PEFT's adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The `target_modules` shorthand for every linear layer except the output layer.
pub const ALL_LINEAR: &str = "all-linear";

/// How an adapted [`Linear`] applies its adapter in the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraForward {
    /// `x (W + s·B·A)^T`: the effective weight is formed first, exactly as
    /// [`CausalLm::to_hf_tensors_merged`] forms it, so the merged export reproduces the
    /// forward bit for bit (true on-policy sync). Costs an `[out, in]` temporary per layer and
    /// a full-size weight gradient in the backward pass.
    #[default]
    Merged,
    /// `x W^T + s·(x A^T) B^T` (PEFT): no `[out, in]` temporaries, no weight-sized gradient;
    /// equal to the merged forward up to float rounding (≈1e-6), not bit for bit.
    Factored,
}

/// LoRA hyper-parameters (PEFT's `LoraConfig` fields; Miles' `--lora-rank`, `--lora-alpha`,
/// `--lora-dropout`, `--target-modules`, `--exclude-modules`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank `r` (>= 1).
    pub r: usize,
    /// `lora_alpha`: the adapter output is scaled by `lora_alpha / r`.
    pub lora_alpha: f64,
    /// `lora_dropout`: only 0 is supported (dropout would make the trainer's forward differ
    /// from the merged weights the engine samples with).
    pub lora_dropout: f64,
    /// Module names or suffixes to adapt, or `["all-linear"]`.
    pub target_modules: Vec<String>,
    /// Module names or suffixes never adapted.
    pub exclude_modules: Vec<String>,
    /// Rank-stabilised scaling `lora_alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// How adapted dense layers run their forward.
    pub forward: LoraForward,
    /// Seed of the `lora_A` initialisation.
    pub seed: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: 8,
            lora_alpha: 16.0,
            lora_dropout: 0.0,
            target_modules: vec![ALL_LINEAR.to_string()],
            exclude_modules: Vec::new(),
            use_rslora: false,
            forward: LoraForward::Merged,
            seed: 1234,
        }
    }
}

/// Megatron module names and the HF projections they stand for.
const MEGATRON_NAMES: &[(&str, &[&str])] = &[
    ("linear_qkv", &["q_proj", "k_proj", "v_proj"]),
    ("linear_proj", &["o_proj"]),
    ("linear_fc1", &["gate_proj", "up_proj"]),
    ("linear_fc2", &["down_proj"]),
    // Megatron's multi-head latent attention (DeepSeek-V3).
    ("linear_q_proj", &["q_proj"]),
    ("linear_q_down_proj", &["q_a_proj"]),
    ("linear_q_up_proj", &["q_b_proj"]),
    ("linear_kv_down_proj", &["kv_a_proj_with_mqa"]),
    ("linear_kv_up_proj", &["kv_b_proj"]),
];

fn expand_names(names: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for n in names {
        match MEGATRON_NAMES.iter().find(|(m, _)| m == n) {
            Some((_, hf)) => out.extend(hf.iter().map(|s| s.to_string())),
            None => out.push(n.clone()),
        }
    }
    out
}

fn suffix_match(module: &str, entries: &[String]) -> bool {
    entries.iter().any(|t| {
        module == t
            || (module.len() > t.len()
                && module.ends_with(t.as_str())
                && module.as_bytes()[module.len() - t.len() - 1] == b'.')
    })
}

impl LoraConfig {
    /// A config of rank `r`, `lora_alpha` and the given targets (other fields default).
    pub fn new(r: usize, lora_alpha: f64, target_modules: &[&str]) -> Self {
        Self {
            r,
            lora_alpha,
            target_modules: target_modules.iter().map(|s| s.to_string()).collect(),
            ..Self::default()
        }
    }

    /// Splits a comma-separated flag value (`"q_proj,v_proj"`, `"all-linear"`) into entries.
    pub fn parse_list(value: &str) -> Vec<String> {
        value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), BridgeError> {
        if self.r == 0 {
            return Err(BridgeError::config("lora_rank", "must be >= 1"));
        }
        if !self.lora_alpha.is_finite() {
            return Err(BridgeError::config("lora_alpha", "must be finite"));
        }
        if self.lora_dropout != 0.0 {
            return Err(BridgeError::config(
                "lora_dropout",
                format!(
                    "{} is not supported (only 0): dropout would make the trainer's forward \
                     differ from the merged weights the rollout engine samples with",
                    self.lora_dropout
                ),
            ));
        }
        if self.target_modules.is_empty() {
            return Err(BridgeError::config(
                "target_modules",
                "empty: name modules (q_proj,v_proj,...) or all-linear",
            ));
        }
        Ok(())
    }

    /// The factor applied to `B·A`: `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
    /// `use_rslora`.
    pub fn scaling(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// Whether the module `name` (this crate's module name, e.g.
    /// `model.layers.0.self_attn.q_proj`, `model.layers.1.mlp.experts.gate_proj`, `lm_head`)
    /// gets an adapter.
    pub fn targets(&self, name: &str) -> bool {
        if suffix_match(name, &expand_names(&self.exclude_modules)) {
            return false;
        }
        if self.target_modules.iter().any(|t| t == ALL_LINEAR) && name != "lm_head" {
            return true;
        }
        suffix_match(name, &expand_names(&self.target_modules))
    }

    /// PEFT's `adapter_config.json` for an adapter on `modules` (the adapted module names):
    /// `target_modules` is the configured list (Megatron names expanded) or, for
    /// `all-linear`, the last name components of `modules`, as PEFT stores a resolved
    /// `all-linear`.
    pub fn to_peft_json(&self, modules: &[String]) -> serde_json::Value {
        let targets: BTreeSet<String> = if self.target_modules.iter().any(|t| t == ALL_LINEAR) {
            modules
                .iter()
                .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
                .collect()
        } else {
            expand_names(&self.target_modules).into_iter().collect()
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": targets,
            "exclude_modules": if self.exclude_modules.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::json!(self.exclude_modules)
            },
            "use_rslora": self.use_rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "rank_pattern": {},
            "alpha_pattern": {},
            "modules_to_save": null,
            "base_model_name_or_path": null,
        })
    }

    /// Reads the fields this crate supports from PEFT's `adapter_config.json`; features it does
    /// not implement (DoRA, LoRA bias, rank / alpha patterns, `target_parameters`, regex
    /// `target_modules`, `modules_to_save`) are errors naming the field.
    pub fn from_peft_json(value: &serde_json::Value) -> Result<Self, BridgeError> {
        let get = |k: &str| value.get(k).filter(|v| !v.is_null());
        if let Some(t) = get("peft_type").and_then(|v| v.as_str())
            && t != "LORA"
        {
            return Err(BridgeError::config("peft_type", format!("{t} (only LORA)")));
        }
        let r = get("r")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| BridgeError::config("r", "missing or not an integer"))?
            as usize;
        let lora_alpha = get("lora_alpha")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| BridgeError::config("lora_alpha", "missing or not a number"))?;
        let list = |k: &str| -> Result<Vec<String>, BridgeError> {
            match get(k) {
                None => Ok(Vec::new()),
                Some(serde_json::Value::String(s)) if s == ALL_LINEAR => Ok(vec![s.clone()]),
                Some(serde_json::Value::String(s)) => Err(BridgeError::config(
                    k,
                    format!("regular expression {s:?} is not supported (give a list)"),
                )),
                Some(serde_json::Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| BridgeError::config(k, "entries must be strings"))
                    })
                    .collect(),
                Some(other) => Err(BridgeError::config(k, format!("unexpected {other}"))),
            }
        };
        for k in ["use_dora", "lora_bias"] {
            if get(k).and_then(serde_json::Value::as_bool) == Some(true) {
                return Err(BridgeError::config(k, "not supported"));
            }
        }
        if let Some(b) = get("bias").and_then(|v| v.as_str())
            && b != "none"
        {
            return Err(BridgeError::config("bias", format!("{b} (only none)")));
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if get(k)
                .and_then(serde_json::Value::as_object)
                .is_some_and(|m| !m.is_empty())
            {
                return Err(BridgeError::config(k, "per-module ranks are not supported"));
            }
        }
        for k in ["target_parameters", "modules_to_save"] {
            if get(k)
                .and_then(serde_json::Value::as_array)
                .is_some_and(|a| !a.is_empty())
            {
                return Err(BridgeError::config(k, "not supported"));
            }
        }
        let config = Self {
            r,
            lora_alpha,
            lora_dropout: get("lora_dropout")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0),
            target_modules: list("target_modules")?,
            exclude_modules: list("exclude_modules")?,
            use_rslora: get("use_rslora")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            ..Self::default()
        };
        Ok(config)
    }
}

/// The adapter of one [`Linear`]: `A: [r, in]`, `B: [out, r]`, output scaled by `scaling`.
#[derive(Module, Debug)]
pub struct LoraAdapter {
    /// `lora_A.weight`, `[r, in]`.
    pub lora_a: Param<Tensor<2>>,
    /// `lora_B.weight`, `[out, r]`.
    pub lora_b: Param<Tensor<2>>,
    /// `lora_alpha / r`.
    pub scaling: f64,
    /// Forward formulation.
    #[module(skip)]
    pub mode: LoraForward,
}

impl LoraAdapter {
    /// `scaling · B · A`, `[out, in]`.
    pub fn delta(&self) -> Tensor<2> {
        self.lora_b.val().matmul(self.lora_a.val()) * self.scaling
    }
}

/// Per-expert adapters of one stacked expert projection `[E, out, in]`:
/// `A: [E, r, in]`, `B: [E, out, r]`.
#[derive(Module, Debug)]
pub struct ExpertLora {
    /// `lora_A`, `[E, r, in]`.
    pub lora_a: Param<Tensor<3>>,
    /// `lora_B`, `[E, out, r]`.
    pub lora_b: Param<Tensor<3>>,
    /// `lora_alpha / r`.
    pub scaling: f64,
}

impl ExpertLora {
    /// `scaling · B_e · A_e` for every expert, `[E, out, in]`.
    pub fn delta(&self) -> Tensor<3> {
        self.lora_b.val().matmul(self.lora_a.val()) * self.scaling
    }
}

/// Deterministic uniform numbers for `lora_A` (SplitMix64; no global RNG state involved).
struct SplitMix(u64);

impl SplitMix {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 24 random bits → [0, 1).
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// `n` values uniform in `[-bound, bound)`.
    fn uniform(&mut self, n: usize, bound: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next_f32() * 2.0 - 1.0) * bound)
            .collect()
    }
}

/// Where adapter values come from while adapters are attached.
enum AdapterSource<'a> {
    /// PEFT init: `A` ~ Uniform(±1/√in), `B` = 0.
    Init(SplitMix),
    /// PEFT-named host tensors (each removed when used).
    Peft(&'a mut TensorMap),
}

fn tensor_from<const D: usize>(values: Vec<f32>, shape: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

fn take_peft(map: &mut TensorMap, name: &str, shape: &[usize]) -> Result<Vec<f32>, BridgeError> {
    let t = map.remove(name).ok_or_else(|| BridgeError::MissingTensor {
        name: name.to_string(),
    })?;
    if t.shape != shape {
        return Err(BridgeError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            got: t.shape,
        });
    }
    Ok(t.to_f32())
}

impl AdapterSource<'_> {
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
                rng.uniform(r * d_in, 1.0 / (d_in as f32).sqrt()),
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
                rng.uniform(e * r * d_in, 1.0 / (d_in as f32).sqrt()),
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

fn host(name: &str, data: TensorData, dtype: FloatDtype) -> Result<HostTensor, BridgeError> {
    let shape = data.shape().to_vec();
    let values =
        data.convert::<f32>()
            .try_to_vec::<f32>()
            .map_err(|e| BridgeError::UnsupportedDtype {
                name: name.to_string(),
                dtype: format!("{e:?}"),
            })?;
    Ok(HostTensor::from_f32(shape, &values).to_dtype(dtype))
}

impl CausalLm {
    /// Every dense linear layer with its module name, in a fixed order (attention, dense MLP,
    /// shared experts per layer, then `lm_head`).
    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (l, layer) in self.model.layers.iter().enumerate() {
            let p = format!("model.layers.{l}");
            for (n, lin) in layer.self_attn.linears() {
                out.push((format!("{p}.self_attn.{n}"), lin));
            }
            let mlp = match &layer.mlp {
                FeedForward::Dense(m) => Some((format!("{p}.mlp"), m)),
                FeedForward::Moe(moe) => moe
                    .shared_experts
                    .as_ref()
                    .map(|m| (format!("{p}.mlp.shared_experts"), m)),
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
            for (n, lin) in layer.self_attn.linears_mut() {
                out.push((format!("{p}.self_attn.{n}"), lin));
            }
            let mlp = match &mut layer.mlp {
                FeedForward::Dense(m) => Some((format!("{p}.mlp"), m)),
                FeedForward::Moe(moe) => moe
                    .shared_experts
                    .as_mut()
                    .map(|m| (format!("{p}.mlp.shared_experts"), m)),
            };
            if let Some((q, m)) = mlp {
                out.push((format!("{q}.gate_proj"), &mut m.gate_proj));
                out.push((format!("{q}.up_proj"), &mut m.up_proj));
                out.push((format!("{q}.down_proj"), &mut m.down_proj));
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
                if config.targets(&module) {
                    let dims = weight.val().dims();
                    *slot =
                        Some(source.experts(&prefix, stack.projection, dims, config, &device)?);
                    attached += 1;
                }
            }
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
            return Err(BridgeError::UnexpectedTensor { name: name.clone() });
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
        let rng = SplitMix(config.seed);
        self.attach_lora(config, AdapterSource::Init(rng))
    }

    /// Attaches adapters with the values of PEFT-named tensors
    /// (`base_model.model.<module>.lora_A.weight`, routed experts per expert) to the modules
    /// `config` targets; every targeted module needs its tensors and every tensor a targeted
    /// module (else [`BridgeError::MissingTensor`] / [`BridgeError::UnexpectedTensor`]).
    pub fn with_lora_tensors(
        self,
        config: &LoraConfig,
        mut tensors: TensorMap,
    ) -> Result<Self, BridgeError> {
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
        let tensors = read_safetensors_file(&dir.join(ADAPTER_WEIGHTS_FILE))?;
        self.with_lora_tensors(&config, tensors)
    }

    /// The adapter configuration, when adapters are attached.
    pub fn lora_config(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Names of the adapted modules, in a fixed order.
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
    /// `model.layers.{l}.mlp.experts.<proj>.lora_A.weight`, `[E, r, in]`).
    pub fn visit_lora_params(&self, f: &mut ParamVisitor<'_>) {
        for (name, linear) in self.linears() {
            if let Some(lora) = &linear.lora {
                f(&format!("{name}.lora_A.weight"), ParamRef::R2(&lora.lora_a));
                f(&format!("{name}.lora_B.weight"), ParamRef::R2(&lora.lora_b));
            }
        }
        for (l, layer) in self.model.layers.iter().enumerate() {
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
    pub fn to_hf_tensors_merged(&self, dtype: FloatDtype) -> Result<TensorMap, BridgeError> {
        if self.lora.is_none() {
            return self.to_hf_tensors(dtype);
        }
        self.valid().merge_lora().to_hf_tensors(dtype)
    }

    /// The adapters as PEFT-named host tensors in `dtype`
    /// (`base_model.model.<module>.lora_A.weight` `[r, in]` / `lora_B.weight` `[out, r]`;
    /// routed experts split into `…mlp.experts.{e}.<proj>.lora_A.weight`). Empty without
    /// adapters.
    pub fn lora_to_peft_tensors(&self, dtype: FloatDtype) -> Result<TensorMap, BridgeError> {
        let mut out = TensorMap::new();
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
                            let t = HostTensor::from_f32(
                                vec![shape[1], shape[2]],
                                &values[e * per..(e + 1) * per],
                            );
                            out.insert(key, t.to_dtype(dtype));
                        }
                    }
                    _ => {
                        out.insert(
                            format!("{PEFT_PREFIX}{name}"),
                            host(name, p.to_data(), dtype)?,
                        );
                    }
                }
                Ok(())
            })();
            if let Err(e) = result {
                failure.get_or_insert(e);
            }
        });
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// PEFT's `adapter_config.json` for the attached adapters (`None` without adapters).
    pub fn peft_adapter_config(&self) -> Option<serde_json::Value> {
        self.lora
            .as_ref()
            .map(|c| c.to_peft_json(&self.lora_modules()))
    }

    /// Writes the adapters as a PEFT adapter directory (`adapter_model.safetensors` in `dtype`
    /// and `adapter_config.json`), loadable by PEFT's `PeftModel.from_pretrained` and by
    /// [`Self::load_lora_adapter`].
    pub fn save_lora_adapter(
        &self,
        dir: impl AsRef<Path>,
        dtype: FloatDtype,
    ) -> Result<(), BridgeError> {
        let dir = dir.as_ref();
        let Some(config) = self.peft_adapter_config() else {
            return Err(BridgeError::config("lora", "the model has no adapters"));
        };
        std::fs::create_dir_all(dir).map_err(|e| BridgeError::io(dir, e))?;
        let tensors = self.lora_to_peft_tensors(dtype)?;
        let bytes = crate::checkpoint::serialize_safetensors(&tensors, None)?;
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        std::fs::write(&path, bytes).map_err(|e| BridgeError::io(&path, e))?;
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
    fn target_matching_follows_peft_suffix_rule() {
        let c = LoraConfig::new(4, 8.0, &["q_proj", "mlp.down_proj"]);
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.xq_proj"));
        assert!(c.targets("model.layers.0.mlp.down_proj"));
        assert!(!c.targets("model.layers.0.mlp.shared_experts.down_proj"));
        let all = LoraConfig {
            exclude_modules: vec!["experts.gate_proj".into()],
            ..LoraConfig::new(4, 8.0, &[ALL_LINEAR])
        };
        assert!(all.targets("model.layers.1.mlp.experts.up_proj"));
        assert!(!all.targets("model.layers.1.mlp.experts.gate_proj"));
        assert!(all.targets("model.layers.1.mlp.shared_experts.gate_proj"));
        assert!(!all.targets("lm_head"));
        let meg = LoraConfig::new(4, 8.0, &["linear_qkv", "linear_fc2"]);
        assert!(meg.targets("model.layers.0.self_attn.k_proj"));
        assert!(!meg.targets("model.layers.0.self_attn.o_proj"));
        assert!(meg.targets("model.layers.0.mlp.down_proj"));
        assert_eq!(
            LoraConfig::parse_list(" q_proj, v_proj ,"),
            vec!["q_proj".to_string(), "v_proj".to_string()]
        );
    }

    #[test]
    fn scaling_and_validation() {
        assert_eq!(LoraConfig::new(4, 8.0, &["q_proj"]).scaling(), 2.0);
        let rs = LoraConfig {
            use_rslora: true,
            ..LoraConfig::new(4, 8.0, &["q_proj"])
        };
        assert_eq!(rs.scaling(), 4.0);
        assert!(LoraConfig::new(0, 8.0, &["q_proj"]).validate().is_err());
        let dropout = LoraConfig {
            lora_dropout: 0.1,
            ..LoraConfig::default()
        };
        assert!(matches!(
            dropout.validate(),
            Err(BridgeError::Config { field, .. }) if field == "lora_dropout"
        ));
    }

    #[test]
    fn init_is_uniform_in_kaiming_bound() {
        let mut rng = SplitMix(7);
        let v = rng.uniform(10_000, 0.125);
        assert!(v.iter().all(|x| (-0.125..0.125).contains(x)));
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32;
        // Uniform(±b): mean 0, variance b²/3.
        assert!(mean.abs() < 0.005, "{mean}");
        assert!((var - 0.125f32.powi(2) / 3.0).abs() < 2e-4, "{var}");
    }

    #[test]
    fn peft_config_round_trip_and_unsupported_fields() {
        let c = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
        let json = c.to_peft_json(&[
            "model.layers.0.self_attn.q_proj".into(),
            "model.layers.0.self_attn.v_proj".into(),
        ]);
        assert_eq!(
            json["target_modules"],
            serde_json::json!(["q_proj", "v_proj"])
        );
        let back = LoraConfig::from_peft_json(&json).unwrap();
        assert_eq!(back.r, 4);
        assert_eq!(back.lora_alpha, 8.0);
        assert_eq!(back.target_modules, vec!["q_proj", "v_proj"]);
        let mut dora = json.clone();
        dora["use_dora"] = serde_json::json!(true);
        assert!(LoraConfig::from_peft_json(&dora).is_err());
        let mut pattern = json;
        pattern["rank_pattern"] = serde_json::json!({"q_proj": 8});
        assert!(matches!(
            LoraConfig::from_peft_json(&pattern),
            Err(BridgeError::Config { field, .. }) if field == "rank_pattern"
        ));
    }
}
