//! `miles bridge`: inspect, score and convert HF checkpoints.
//!
//! ```text
//! miles bridge inspect DIR
//! miles bridge logprobs --model DIR --input FILE [--out FILE] [--device DEV]
//! miles bridge convert --model DIR --out DIR [--dtype f32|bf16|f16] [--tp N] [--ep N]
//! ```
//! Errors are one line naming the file or flag at fault.

use std::path::{Path, PathBuf};

use burn::tensor::{Bool, Device, Tensor, TensorData};
use miles_bridge::parallel::shard;
use miles_bridge::{BridgeError, CausalLm, ModelConfig, ModelInput, ids_tensor, token_logprobs};
use miles_core::{DType, NamedTensors};
use miles_r3::Fallthrough;

use crate::args::BridgeCommand;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn load_config(dir: &Path) -> Result<ModelConfig, String> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    // The architecture first, so an unsupported checkpoint says so rather than naming
    // whichever field its config lacks.
    match v.get("model_type").and_then(|m| m.as_str()) {
        Some(kind) => {
            miles_bridge::Architecture::from_model_type(kind).map_err(err)?;
        }
        None => {
            return Err(err(BridgeError::MissingModelType {
                supported: miles_bridge::Architecture::supported_model_types(),
            }));
        }
    }
    ModelConfig::from_hf_json(&text).map_err(|e| format!("{}: {}", path.display(), err(e)))
}

/// Runs `miles bridge COMMAND`; the error is one line for the user.
pub fn run(command: &BridgeCommand) -> Result<(), String> {
    match command {
        BridgeCommand::Inspect { dir } => inspect(dir),
        BridgeCommand::Logprobs {
            model,
            input,
            out,
            device,
        } => {
            let device =
                miles_ops::device::parse_device(device).map_err(|e| format!("--device: {e}"))?;
            logprobs(model, input, out.clone(), &device)
        }
        BridgeCommand::Convert {
            model,
            out,
            dtype,
            tp,
            ep,
        } => {
            let dtype = match dtype {
                None => None,
                Some(d) => Some(
                    d.parse::<DType>()
                        .ok()
                        .filter(|d| d.is_float())
                        .ok_or_else(|| format!("--dtype: unknown dtype `{d}` (f32, bf16, f16)"))?,
                ),
            };
            convert(model, out, dtype, *tp, *ep)
        }
    }
}

fn inspect(dir: &Path) -> Result<(), String> {
    let config = load_config(dir)?;
    let tensors = NamedTensors::read_hf_checkpoint(dir).map_err(err)?;
    let params: usize = tensors.values().map(|t| t.numel()).sum();
    let mut dtypes: Vec<String> = tensors.values().map(|t| t.dtype().to_string()).collect();
    dtypes.sort();
    dtypes.dedup();
    println!(
        "architecture: {} ({})",
        config.architecture.model_type(),
        config.architecture.hf_class()
    );
    let moe_layers = (0..config.num_hidden_layers)
        .filter(|&l| config.is_moe_layer(l))
        .count();
    println!(
        "layers: {} ({} MoE), hidden {}, heads {}/{} x {}, experts {} top-{} + {} shared, vocab {}",
        config.num_hidden_layers,
        moe_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.n_shared_experts,
        config.vocab_size
    );
    if let Some(mla) = config.mla {
        println!(
            "latent attention: q_lora_rank {}, kv_lora_rank {}, qk nope/rope {}/{}, v {}{}",
            mla.q_lora_rank
                .map_or_else(|| "none".to_string(), |r| r.to_string()),
            mla.kv_lora_rank,
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            if config.yarn.is_some() {
                ", yarn rope"
            } else {
                ""
            }
        );
    }
    let mtp = miles_bridge::mtp_tensor_names(&config, &tensors);
    if !mtp.is_empty() {
        println!(
            "note: {} multi-token-prediction tensors (layers {}..) are skipped (not trained)",
            mtp.len(),
            config.num_hidden_layers
        );
    }
    println!("parameters: {params}");
    println!("dtype: {}", dtypes.join(", "));
    println!("tensors: {}", tensors.len());
    for (name, t) in &tensors {
        println!("  {name} {} {:?}", t.dtype(), t.shape());
    }
    Ok(())
}

fn logprobs(dir: &Path, input: &Path, out: Option<PathBuf>, device: &Device) -> Result<(), String> {
    let text = std::fs::read_to_string(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", input.display()))?;
    let rows: Vec<Vec<u32>> =
        serde_json::from_value(v.get("input_ids").cloned().unwrap_or_default()).map_err(|e| {
            format!(
                "{}: `input_ids` must be a list of lists of token ids: {e}",
                input.display()
            )
        })?;
    let config = load_config(dir)?;
    if rows.is_empty() || rows.iter().any(|r| r.len() < 2) {
        return Err("every sequence needs at least two tokens".to_string());
    }
    if let Some(bad) = rows
        .iter()
        .flatten()
        .find(|&&t| t as usize >= config.vocab_size)
    {
        return Err(format!(
            "token id {bad} is outside the vocabulary ({})",
            config.vocab_size
        ));
    }
    let device = device.clone();
    let tensors = NamedTensors::read_hf_checkpoint(dir).map_err(err)?;
    let model = CausalLm::from_hf_tensors(&config, tensors, &device).map_err(err)?;
    let seq = rows.iter().map(Vec::len).max().unwrap_or(0);
    let padded: Vec<Vec<u32>> = rows
        .iter()
        .map(|r| {
            r.iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(seq)
                .collect()
        })
        .collect();
    let mask: Vec<bool> = rows
        .iter()
        .flat_map(|r| (0..seq).map(move |t| t < r.len()))
        .collect();
    let ids = ids_tensor(&padded, &device).map_err(err)?;
    let mut input = ModelInput::new(ids.clone());
    input.attention_mask = Some(Tensor::<2, Bool>::from_data(
        TensorData::new(mask, [rows.len(), seq]),
        &device,
    ));
    let output = model.forward(&input, &Fallthrough).map_err(err)?;
    let lp = token_logprobs(output.logits, ids)
        .into_data()
        .try_to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    let token_logprobs: Vec<Vec<f32>> = rows
        .iter()
        .enumerate()
        .map(|(s, r)| lp[s * (seq - 1)..s * (seq - 1) + r.len() - 1].to_vec())
        .collect();
    let mut routed = serde_json::Map::new();
    for routing in &output.routing {
        let k = routing.experts.dims()[1];
        let ids = routing
            .experts
            .clone()
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .map_err(|e| format!("{e:?}"))?;
        let mut table = Vec::new();
        for (s, r) in rows.iter().enumerate() {
            for t in 0..r.len() {
                let at = (s * seq + t) * k;
                let mut row = ids[at..at + k].to_vec();
                row.sort_unstable();
                table.push(row);
            }
        }
        routed.insert(
            format!("layer{}", routing.layer_index),
            serde_json::json!(table),
        );
    }
    let json = serde_json::json!({"token_logprobs": token_logprobs, "routed_experts": routed});
    let text = serde_json::to_string(&json).map_err(|e| e.to_string())?;
    match out {
        Some(path) => std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display())),
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

fn convert(
    dir: &Path,
    out: &Path,
    dtype: Option<DType>,
    tp: usize,
    ep: usize,
) -> Result<(), String> {
    let config = load_config(dir)?;
    let tensors = NamedTensors::read_hf_checkpoint(dir).map_err(err)?;
    // Validate by building the model on the host before writing anything.
    CausalLm::from_hf_tensors(&config, tensors.clone(), &Device::flex()).map_err(err)?;
    if config.num_key_value_heads % tp != 0 {
        return Err(format!(
            "--tp {tp} does not divide num_key_value_heads {}",
            config.num_key_value_heads
        ));
    }
    let write_config = |target: &Path| -> Result<(), String> {
        std::fs::create_dir_all(target).map_err(|e| format!("{}: {e}", target.display()))?;
        let src = dir.join("config.json");
        std::fs::copy(&src, target.join("config.json"))
            .map_err(|e| format!("{}: {e}", src.display()))?;
        Ok(())
    };
    if tp == 1 && ep == 1 {
        write_config(out)?;
        tensors.write_hf_shards(out, dtype, 5 << 30).map_err(err)?;
        return Ok(());
    }
    for ep_rank in 0..ep {
        for tp_rank in 0..tp {
            let part =
                shard(&tensors, tp, tp_rank, ep, ep_rank, config.n_routed_experts).map_err(err)?;
            let target = out.join(format!("tp{tp_rank:02}_ep{ep_rank:02}"));
            write_config(&target)?;
            part.write_hf_shards(&target, dtype, 5 << 30).map_err(err)?;
        }
    }
    Ok(())
}
