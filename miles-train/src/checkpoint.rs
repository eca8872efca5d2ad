//! Atomic actor checkpoints.
//!
//! Layout of a checkpoint directory:
//! - `model/`: HF-named safetensors + `config.json` (loadable by `CausalLm::from_pretrained`
//!   and by HF transformers);
//! - `optimizer.safetensors`: AdamW moments (`<param>.exp_avg`, `<param>.exp_avg_sq`, f32);
//! - `adapter/` (LoRA only): the adapters as a PEFT adapter directory
//!   (`adapter_model.safetensors` in f32 + `adapter_config.json`), loadable by PEFT; `model/`
//!   then holds the frozen base weights and the optimizer state covers the adapters only;
//! - `trainer_state.json`: format version, optimizer step, weight version, rollouts trained,
//!   and the LoRA configuration when adapters are trained.
//!
//! Everything is written into a sibling temporary directory first, synced, then renamed over
//! the target (the previous checkpoint, if any, is moved aside and removed only after the
//! rename), so a crash at any point leaves a complete checkpoint at `dir` or at `dir.old`;
//! [`load`] falls back to `dir.old` when `dir` is missing.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use miles_bridge::CausalLm;
use miles_bridge::lora::{ADAPTER_WEIGHTS_FILE, LoraConfig};
use miles_core::{DType, NamedTensors, TensorBytes, WeightVersion};
use serde::{Deserialize, Serialize};

use crate::optim::AdamW;
use crate::{Error, Result};

const FORMAT: u32 = 1;
const STATE_FILE: &str = "trainer_state.json";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const MODEL_DIR: &str = "model";
const ADAPTER_DIR: &str = "adapter";

#[derive(Debug, Serialize, Deserialize)]
struct TrainerState {
    format_version: u32,
    optimizer_step: u64,
    weight_version: WeightVersion,
    rollouts_trained: u64,
    architecture: String,
    num_params: usize,
    /// The adapters' configuration (absent: no LoRA; older checkpoints).
    #[serde(default)]
    lora: Option<LoraConfig>,
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "checkpoint".into());
    dir.with_file_name(format!("{name}{suffix}"))
}

/// fsyncs every file and folder under `dir`, and `dir` itself.
fn sync_dir(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        if path.is_dir() {
            sync_dir(&path)?;
        } else {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| Error::io(&path, e))?;
        }
    }
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// What a checkpoint restores: the policy, its optimizer, the weight version and the count of
/// rollouts trained.
pub(crate) struct Restored {
    pub(crate) model: CausalLm,
    pub(crate) optimizer: AdamW,
    pub(crate) version: WeightVersion,
    pub(crate) rollouts_trained: u64,
}

/// Writes an actor's checkpoint (its policy `model`, `optimizer`, weight `version` and
/// `rollouts` trained) to `dir` atomically.
pub(crate) fn save(
    model: &CausalLm,
    optimizer: &AdamW,
    version: WeightVersion,
    rollouts: u64,
    dir: &Path,
) -> Result<()> {
    let tmp = sibling(dir, ".tmp");
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    model.save_pretrained(tmp.join(MODEL_DIR), DType::F32, None)?;
    if model.lora_config().is_some() {
        model.save_lora_adapter(tmp.join(ADAPTER_DIR), DType::F32)?;
    }
    let mut map = NamedTensors::new();
    for (name, shape, values) in optimizer.state_tensors() {
        map.insert(name, TensorBytes::from_f32(shape, &values)?);
    }
    map.set_metadata("format", "pt");
    map.write_safetensors_file(&tmp.join(OPTIMIZER_FILE))?;
    let state = TrainerState {
        format_version: FORMAT,
        optimizer_step: optimizer.step_count(),
        weight_version: version,
        rollouts_trained: rollouts,
        architecture: model.config.architecture.model_type().to_string(),
        num_params: model.num_params(),
        lora: model.lora_config().cloned(),
    };
    let state_path = tmp.join(STATE_FILE);
    let text = serde_json::to_string_pretty(&state)
        .map_err(|e| Error::checkpoint(&state_path, e.to_string()))?;
    fs::write(&state_path, text).map_err(|e| Error::io(&state_path, e))?;
    sync_dir(&tmp)?;
    let old = sibling(dir, ".old");
    if dir.exists() {
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        }
        fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
    }
    fs::rename(&tmp, dir).map_err(|e| Error::io(&tmp, e))?;
    // The rename is durable once the parent folder's entry is.
    sync_parent(dir)?;
    if old.exists() {
        fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        sync_parent(dir)?;
    }
    Ok(())
}

/// fsyncs the folder holding `path`, making a rename or removal in it durable.
fn sync_parent(path: &Path) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::File::open(parent)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(parent, e))
}

/// Reads the checkpoint at `dir` (or at `dir.old` left by an interrupted save) for an actor
/// training `model` with `optimizer`: the checkpoint must match their architecture, adapters,
/// parameters and optimizer state.
pub(crate) fn load(model: &CausalLm, optimizer: &AdamW, dir: &Path) -> Result<Restored> {
    let dir = if dir.join(STATE_FILE).exists() {
        dir.to_path_buf()
    } else {
        let old = sibling(dir, ".old");
        if old.join(STATE_FILE).exists() {
            old
        } else {
            return Err(Error::checkpoint(dir, format!("no {STATE_FILE}")));
        }
    };
    let state_path = dir.join(STATE_FILE);
    let text = fs::read_to_string(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(&state_path, format!("corrupt: {e}")))?;
    if state.format_version != FORMAT {
        return Err(Error::checkpoint(
            &state_path,
            format!(
                "format version {} (this build reads {FORMAT})",
                state.format_version
            ),
        ));
    }
    let config = model.config.clone();
    let ours = config.architecture.model_type();
    if state.architecture != ours {
        return Err(Error::checkpoint(
            &state_path,
            format!(
                "checkpoint is a {} model, the actor trains a {ours}",
                state.architecture
            ),
        ));
    }
    let device = model.lm_head_weight().device();
    let opt_config = *optimizer.config();
    let model_dir = dir.join(MODEL_DIR);
    let tensors = NamedTensors::read_hf_checkpoint(&model_dir)?;
    let loaded = CausalLm::from_hf_tensors(&config, tensors, &device).map_err(|e| {
        Error::checkpoint(&model_dir, format!("does not match the actor's model: {e}"))
    })?;
    let loaded = match (model.lora_config(), &state.lora) {
        (None, None) => loaded,
        (Some(ours), Some(theirs)) => {
            if (ours.r, ours.lora_alpha, ours.use_rslora)
                != (theirs.r, theirs.lora_alpha, theirs.use_rslora)
            {
                return Err(Error::checkpoint(
                    &state_path,
                    format!(
                        "LoRA r = {}, alpha = {}; the actor trains r = {}, alpha = {}",
                        theirs.r, theirs.lora_alpha, ours.r, ours.lora_alpha
                    ),
                ));
            }
            // The actor's own config (targets, forward, seed) decides which modules carry
            // adapters; the checkpoint must hold exactly their tensors.
            let adapter = dir.join(ADAPTER_DIR).join(ADAPTER_WEIGHTS_FILE);
            let tensors = NamedTensors::from_safetensors_file(&adapter)
                .map_err(|e| Error::checkpoint(&adapter, e.to_string()))?;
            loaded.with_lora_tensors(ours, tensors).map_err(|e| {
                Error::checkpoint(&adapter, format!("does not match the actor: {e}"))
            })?
        }
        (ours, theirs) => {
            let has = |c: bool| if c { "has" } else { "has no" };
            return Err(Error::checkpoint(
                &state_path,
                format!(
                    "the checkpoint {} LoRA adapters, the actor {}",
                    has(theirs.is_some()),
                    has(ours.is_some())
                ),
            ));
        }
    };
    if loaded.num_params() != state.num_params {
        return Err(Error::checkpoint(
            &model_dir,
            format!(
                "{} parameters, trainer_state.json says {}",
                loaded.num_params(),
                state.num_params
            ),
        ));
    }
    let opt_path = dir.join(OPTIMIZER_FILE);
    let host = NamedTensors::from_safetensors_file(&opt_path)
        .map_err(|e| Error::checkpoint(&opt_path, e.to_string()))?;
    let values: BTreeMap<String, Vec<f32>> = host
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_f32()?)))
        .collect::<std::result::Result<_, miles_core::Error>>()
        .map_err(|e| Error::checkpoint(&opt_path, e.to_string()))?;
    let mut opt = AdamW::new(opt_config);
    opt.load_state(state.optimizer_step, values, &device)
        .map_err(|e| match e {
            Error::Checkpoint { reason, .. } => Error::checkpoint(&opt_path, reason),
            other => other,
        })?;
    opt.check_against(&loaded).map_err(|e| match e {
        Error::Checkpoint { reason, .. } => Error::checkpoint(&opt_path, reason),
        other => other,
    })?;
    Ok(Restored {
        model: loaded,
        optimizer: opt,
        version: state.weight_version,
        rollouts_trained: state.rollouts_trained,
    })
}
