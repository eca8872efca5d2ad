//! LoRA adapters on the HF-layout linear layers and the stacked routed experts, with PEFT's
//! naming, initialisation and `target_modules` semantics: their configuration
//! ([`LoraConfig`]), the adapters ([`LoraAdapter`], [`ExpertLora`]) and PEFT's file and name
//! constants. Attaching, merging and exporting them are methods of `CausalLm`.
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
//!   `B: [E, out, r]`, always applied in merged form (GPT-OSS's fused experts: below);
//! - targets follow PEFT: a module is adapted when its name equals a `target_modules` entry or
//!   ends with `.<entry>`; `all-linear` means every linear layer except `lm_head` (attention,
//!   dense MLP, shared experts, routed experts); `exclude_modules` uses the same rule. Megatron's
//!   names are accepted too (`linear_qkv` → `q_proj,k_proj,v_proj`, `linear_proj` → `o_proj`,
//!   `linear_fc1` → `gate_proj,up_proj`, `linear_fc2` → `down_proj`), as Miles' flag does.
//!   Module names are this crate's: routed experts are `model.layers.{l}.mlp.experts.<proj>`,
//!   Qwen3.5's Gated DeltaNet projections `model.layers.{l}.linear_attn.{in_proj_qkv,
//!   in_proj_z, in_proj_b, in_proj_a, out_proj}`, Qwen3.5-MoE's shared-expert gate
//!   `model.layers.{l}.mlp.shared_expert_gate` (a linear layer, so `all-linear` includes it, as
//!   PEFT's does). A PEFT adapter that names a routed-expert projection in `target_modules`
//!   but holds no per-expert tensors (PEFT with transformers 5, where the experts are fused
//!   parameters and such an entry reaches only the shared expert) leaves the routed experts
//!   unadapted;
//! - GPT-OSS's experts are fused 3-D parameters (`mlp.experts.gate_up_proj` `[E, hidden, 2I]`,
//!   gate / up columns interleaved, and `mlp.experts.down_proj` `[E, I, hidden]`; their biases
//!   are never adapted), which PEFT adapts through `target_parameters` with its `ParamWrapper`
//!   ([`ParamLora`]: one rank-`r` adapter per expert on the fused projection, kept in PEFT's
//!   `lora_A` `[E·r, in]` / `lora_B` `[out, r·E]` layout, applied in merged form). A parameter
//!   is adapted when `target_parameters` names it (PEFT's rule: its full name, e.g.
//!   `model.layers.0.mlp.experts.gate_up_proj`, equals an entry or ends with `.<entry>`), or
//!   through `target_modules` as Miles' flag reaches it (Megatron's `linear_fc1` /
//!   `linear_fc2` on the experts): by its own name (`gate_up_proj`, `down_proj`), by a
//!   projection fused into it (`gate_proj` or `up_proj` adapt the whole `gate_up_proj`, as
//!   Megatron's `linear_fc1` holds both), or by `all-linear`; `exclude_modules` applies to
//!   all these names. A `target_parameters` entry that matches no parameter of the model is
//!   an error (only GPT-OSS's experts are read this way). The PEFT file names the adapters
//!   after PEFT's nesting of wrappers on `mlp.experts`: with both parameters adapted
//!   `…mlp.experts.base_layer.lora_A.weight` is `gate_up_proj`'s and
//!   `…mlp.experts.lora_A.weight` `down_proj`'s; with one, `…mlp.experts.lora_A.weight`; its
//!   `adapter_config.json` lists them in `target_parameters`
//!   (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and keeps in `target_modules`
//!   only the entries that reach a linear module;
//! - `CausalLm::with_lora` attaches and freezes every base parameter (only `lora_A` /
//!   `lora_B` require gradients); `CausalLm::merge_lora` folds the adapters into the base
//!   weights; `CausalLm::to_hf_tensors_merged` exports merged HF weights (what an inference
//!   engine that only knows HF names loads); `CausalLm::lora_to_peft_tensors` /
//!   `CausalLm::save_lora_adapter` write a PEFT adapter (`adapter_model.safetensors` with
//!   `base_model.model.<module>.lora_A.weight` / `lora_B.weight`, routed experts split per
//!   expert, a vision-language checkpoint's text modules under
//!   `base_model.model.model.language_model.*`, and `adapter_config.json`) that
//!   `CausalLm::load_lora_adapter` reads back — as it reads adapters saved by PEFT (for a
//!   vision-language checkpoint, saved on either the checkpoint's class or the text-only one).
//!
//! In `Merged` mode the trainer's forward multiplies by exactly the tensor
//! `CausalLm::to_hf_tensors_merged` exports, so an engine loaded with the merged weights
//! reproduces the LoRA model's log-probs bit for bit.

use std::collections::BTreeSet;

use burn::module::{Module, Param};
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::BridgeError;

/// Prefix PEFT puts before every module name in `adapter_model.safetensors`.
pub const PEFT_PREFIX: &str = "base_model.model.";

/// PEFT's adapter weights file.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// PEFT's adapter config file.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";

/// The `target_modules` shorthand for every linear layer except the output layer.
pub const ALL_LINEAR: &str = "all-linear";

/// How an adapted `Linear` applies its adapter in the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoraForward {
    /// `x (W + s·B·A)^T`: the effective weight is formed first, exactly as
    /// `CausalLm::to_hf_tensors_merged` forms it, so the merged export reproduces the
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
    /// PEFT's `target_parameters`: fused expert parameters to adapt, by full name or suffix
    /// (`mlp.experts.gate_up_proj`; GPT-OSS only).
    pub target_parameters: Vec<String>,
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
            target_parameters: Vec::new(),
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
        if self.target_modules.is_empty() && self.target_parameters.is_empty() {
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

    /// Whether `target_parameters` names the fused parameter `name` (its full name, e.g.
    /// `model.layers.0.mlp.experts.gate_up_proj`, equals an entry or ends with `.<entry>`).
    pub fn names_parameter(&self, name: &str) -> bool {
        suffix_match(name, &self.target_parameters)
    }

    /// Whether the fused expert parameter `{experts}.{parameter}` (GPT-OSS's
    /// `model.layers.{l}.mlp.experts` and `gate_up_proj` / `down_proj`) gets an adapter: named
    /// by `target_parameters` ([`Self::names_parameter`]), or by `target_modules` through its
    /// own name or one of the projections `fused` into it (`gate_proj` / `up_proj` for
    /// `gate_up_proj`; Megatron's `linear_fc1` / `linear_fc2` expand to them) or `all-linear`;
    /// never when `exclude_modules` matches one of these names.
    pub fn targets_parameter(&self, experts: &str, parameter: &str, fused: &[&str]) -> bool {
        let names: Vec<String> = std::iter::once(parameter)
            .chain(fused.iter().copied())
            .map(|p| format!("{experts}.{p}"))
            .collect();
        let exclude = expand_names(&self.exclude_modules);
        if names.iter().any(|n| suffix_match(n, &exclude)) {
            return false;
        }
        self.names_parameter(&names[0]) || names.iter().any(|n| self.targets(n))
    }

    /// PEFT's `adapter_config.json` for an adapter on `modules` (the adapted module names):
    /// `target_modules` is the configured list (Megatron names expanded) or, for
    /// `all-linear`, the last name components of `modules`, as PEFT stores a resolved
    /// `all-linear`.
    ///
    /// `parameters` are the adapted fused expert parameters (full names,
    /// `model.layers.0.mlp.experts.gate_up_proj`): with any, `target_parameters` is the
    /// configured list or, when they were reached through `target_modules`, their
    /// `mlp.experts.<parameter>` names, and `target_modules` keeps only the entries that
    /// match one of `modules` (PEFT's `target_modules` reaches no fused parameter).
    pub fn to_peft_json(&self, modules: &[String], parameters: &[String]) -> serde_json::Value {
        let mut targets: BTreeSet<String> = if self.target_modules.iter().any(|t| t == ALL_LINEAR) {
            modules
                .iter()
                .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
                .collect()
        } else {
            expand_names(&self.target_modules).into_iter().collect()
        };
        let mut target_parameters: Vec<String> = Vec::new();
        if !parameters.is_empty() {
            targets.retain(|t| {
                modules
                    .iter()
                    .any(|m| suffix_match(m, std::slice::from_ref(t)))
            });
            if self.target_parameters.is_empty() {
                for p in parameters {
                    let short = p
                        .rsplit_once(".mlp.")
                        .map_or_else(|| p.clone(), |(_, rest)| format!("mlp.{rest}"));
                    if !target_parameters.contains(&short) {
                        target_parameters.push(short);
                    }
                }
            } else {
                target_parameters.clone_from(&self.target_parameters);
            }
        }
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
            "target_parameters": if target_parameters.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::json!(target_parameters)
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
    /// not implement (DoRA, LoRA bias, rank / alpha patterns, regex `target_modules`,
    /// `modules_to_save`) are errors naming the field. `target_parameters` is read (a list);
    /// attaching checks each entry matches a parameter this crate adapts.
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
        if get("modules_to_save")
            .and_then(serde_json::Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(BridgeError::config("modules_to_save", "not supported"));
        }
        let config = Self {
            r,
            lora_alpha,
            lora_dropout: get("lora_dropout")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(0.0),
            target_modules: list("target_modules")?,
            exclude_modules: list("exclude_modules")?,
            target_parameters: match get("target_parameters") {
                Some(serde_json::Value::String(_)) => {
                    return Err(BridgeError::config(
                        "target_parameters",
                        "must be a list of parameter names",
                    ));
                }
                _ => list("target_parameters")?,
            },
            use_rslora: get("use_rslora")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false),
            ..Self::default()
        };
        Ok(config)
    }
}

/// The adapter of one `Linear`: `A: [r, in]`, `B: [out, r]`, output scaled by `scaling`.
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

/// PEFT's `ParamWrapper` adapter on a fused expert parameter `[E, in, out]` (GPT-OSS's
/// `mlp.experts.gate_up_proj` `[E, hidden, 2I]` and `down_proj` `[E, I, hidden]`), in PEFT's
/// layout: `lora_A` `[E·r, in]` holds expert `e`'s `A_e` (`[r, in]`) in rows `e·r..(e+1)·r`,
/// `lora_B` `[out, r·E]` expert `e`'s `B_e` (`[out, r]`) in columns `k·E + e`; expert `e`
/// uses `W_e + scaling · A_eᵀ B_eᵀ` (`[in, out]`).
#[derive(Module, Debug)]
pub struct ParamLora {
    /// `lora_A.weight`, `[E·r, in]`.
    pub lora_a: Param<Tensor<2>>,
    /// `lora_B.weight`, `[out, r·E]`.
    pub lora_b: Param<Tensor<2>>,
    /// Number of experts `E`.
    pub experts: usize,
    /// `lora_alpha / r`.
    pub scaling: f64,
}

impl ParamLora {
    /// `scaling · A_eᵀ B_eᵀ` for every expert, `[E, in, out]` (the parameter's layout).
    pub fn delta(&self) -> Tensor<3> {
        let e = self.experts;
        let [rows, d_in] = self.lora_a.val().dims();
        let [d_out, _] = self.lora_b.val().dims();
        let r = rows / e;
        let a = self.lora_a.val().reshape([e, r, d_in]).swap_dims(1, 2);
        let b = self.lora_b.val().reshape([d_out, r, e]).permute([2, 1, 0]);
        a.matmul(b) * self.scaling
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
    fn peft_config_round_trip_and_unsupported_fields() {
        let c = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
        let json = c.to_peft_json(
            &[
                "model.layers.0.self_attn.q_proj".into(),
                "model.layers.0.self_attn.v_proj".into(),
            ],
            &[],
        );
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
