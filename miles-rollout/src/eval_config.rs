//! Evaluation datasets as Miles resolves them (`miles/utils/eval_config.py` and
//! `_resolve_eval_datasets` of `miles/utils/arguments.py`): an `--eval-config` document (YAML or
//! JSON, a file or an inline `base64:` payload) or `--eval-prompt-data NAME PATH …` pairs, each
//! dataset's settings merged with the command line's eval flags.
//!
//! For each of `n_samples_per_eval_prompt`, `temperature`, `top_p`, `top_k`,
//! `max_response_len`, `input_key`, `label_key`, `tool_key` and `metadata_key` the first of
//! these that is *present* wins (a `null` in the file is present, as in Miles):
//! 1. the dataset's own key;
//! 2. the key under `eval.defaults` (only these nine keys are read there);
//! 3. the first of the flags that is set: `--n-samples-per-eval-prompt` then
//!    `--n-samples-per-prompt`; `--eval-temperature` then `--rollout-temperature` (and so for
//!    top-p, top-k and `--eval-max-response-len` / `--rollout-max-response-len`);
//!    `--eval-input-key` then `--input-key` (and so for the label and tool keys);
//!    `--metadata-key`.
//!
//! `rm_type`, `stop`, `stop_token_ids`, `min_new_tokens`, `custom_generate_function_path` and
//! `metadata_overrides` come from the dataset only. Any other key is an error, as is a dataset
//! without `path` (or, in a list, without `name`).
//!
//! ```
//! use miles_rollout::{EvalFlags, eval_datasets_from_document};
//!
//! let flags = EvalFlags {
//!     eval_temperature: Some(0.6),
//!     rollout_max_response_len: Some(1024),
//!     n_samples_per_eval_prompt: Some(1),
//!     ..EvalFlags::default()
//! };
//! let doc = "eval:\n  defaults: {max_response_len: 64}\n  datasets:\n    - {name: aime, path: aime.jsonl, n_samples_per_eval_prompt: 16}\n";
//! let sets = eval_datasets_from_document(doc, &flags).unwrap();
//! assert_eq!(sets[0].n_samples_per_eval_prompt, Some(16)); // the dataset's own
//! assert_eq!(sets[0].max_response_len, Some(64)); // eval.defaults
//! assert_eq!(sets[0].temperature, Some(0.6)); // --eval-temperature
//! ```

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// One evaluation dataset, with Miles' fields (`EvalDatasetConfig`); `None` where neither the
/// file nor the flags give a value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalDatasetConfig {
    /// Name in the metric keys (`eval/<name>`).
    pub name: String,
    /// The prompt file (JSONL or Parquet, with an optional `@[a:b]` row slice).
    pub path: String,
    /// Reward rule for this dataset's samples (put into each sample's `metadata["rm_type"]`).
    #[serde(default)]
    pub rm_type: Option<String>,
    /// The prompt key.
    #[serde(default)]
    pub input_key: Option<String>,
    /// The label key.
    #[serde(default)]
    pub label_key: Option<String>,
    /// The tool-list key.
    #[serde(default)]
    pub tool_key: Option<String>,
    /// The metadata key.
    #[serde(default)]
    pub metadata_key: Option<String>,
    /// Samples per prompt.
    #[serde(default)]
    pub n_samples_per_eval_prompt: Option<usize>,
    /// Sampling temperature.
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus sampling.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Top-k (-1: off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Response token limit.
    #[serde(default)]
    pub max_response_len: Option<usize>,
    /// Stop strings.
    #[serde(default)]
    pub stop: Option<Vec<String>>,
    /// Stop token ids.
    #[serde(default)]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Tokens generated before a stop may end the response.
    #[serde(default)]
    pub min_new_tokens: Option<usize>,
    /// Miles' per-dataset Python generate function (an import path).
    #[serde(default)]
    pub custom_generate_function_path: Option<String>,
    /// Metadata set on every sample of the dataset (after `rm_type`).
    #[serde(default, deserialize_with = "metadata_overrides")]
    pub metadata_overrides: Map<String, Value>,
}

fn metadata_overrides<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Map<String, Value>, D::Error> {
    match Value::deserialize(d)? {
        Value::Null => Ok(Map::new()),
        Value::Object(map) => Ok(map),
        _ => Err(serde::de::Error::custom(
            "metadata_overrides must be a mapping.",
        )),
    }
}

impl EvalDatasetConfig {
    /// A sample's metadata with the dataset's `rm_type` and `metadata_overrides` applied
    /// (Miles' `inject_metadata`).
    pub fn inject_metadata(&self, metadata: &mut Map<String, Value>) {
        if let Some(rm_type) = &self.rm_type {
            metadata.insert("rm_type".into(), Value::from(rm_type.clone()));
        }
        for (key, value) in &self.metadata_overrides {
            metadata.insert(key.clone(), value.clone());
        }
    }
}

/// The command-line values dataset resolution reads (Miles' argparse attributes, `None` where
/// a flag is unset).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalFlags {
    /// `--eval-config`: a file path or `base64:<payload>`.
    pub eval_config: Option<String>,
    /// `--eval-prompt-data NAME PATH …` (one bare path is named `aime`, as in Miles).
    pub eval_prompt_data: Option<Vec<String>>,
    /// `--n-samples-per-eval-prompt`.
    pub n_samples_per_eval_prompt: Option<usize>,
    /// `--n-samples-per-prompt`.
    pub n_samples_per_prompt: Option<usize>,
    /// `--eval-temperature`.
    pub eval_temperature: Option<f64>,
    /// `--rollout-temperature`.
    pub rollout_temperature: Option<f64>,
    /// `--eval-top-p`.
    pub eval_top_p: Option<f64>,
    /// `--rollout-top-p`.
    pub rollout_top_p: Option<f64>,
    /// `--eval-top-k`.
    pub eval_top_k: Option<i64>,
    /// `--rollout-top-k`.
    pub rollout_top_k: Option<i64>,
    /// `--eval-max-response-len`.
    pub eval_max_response_len: Option<usize>,
    /// `--rollout-max-response-len`.
    pub rollout_max_response_len: Option<usize>,
    /// `--eval-input-key`.
    pub eval_input_key: Option<String>,
    /// `--input-key`.
    pub input_key: Option<String>,
    /// `--eval-label-key`.
    pub eval_label_key: Option<String>,
    /// `--label-key`.
    pub label_key: Option<String>,
    /// `--eval-tool-key`.
    pub eval_tool_key: Option<String>,
    /// `--tool-key`.
    pub tool_key: Option<String>,
    /// `--metadata-key`.
    pub metadata_key: Option<String>,
}

/// Miles' `DATASET_RUNTIME_SPECS` and `DATASET_SAMPLE_SPECS`: each field, and the flags it
/// falls back to in order (the file keys are the field's own name).
const FIELD_FLAGS: [(&str, &[&str]); 9] = [
    (
        "n_samples_per_eval_prompt",
        &["n_samples_per_eval_prompt", "n_samples_per_prompt"],
    ),
    ("temperature", &["eval_temperature", "rollout_temperature"]),
    ("top_p", &["eval_top_p", "rollout_top_p"]),
    ("top_k", &["eval_top_k", "rollout_top_k"]),
    (
        "max_response_len",
        &["eval_max_response_len", "rollout_max_response_len"],
    ),
    ("input_key", &["eval_input_key", "input_key"]),
    ("label_key", &["eval_label_key", "label_key"]),
    ("tool_key", &["eval_tool_key", "tool_key"]),
    ("metadata_key", &["metadata_key"]),
];

const PSEUDO_FILE_PREFIX: &str = "base64:";

/// The text of a command-line value that is a file path or an inline `base64:<payload>`
/// (Miles' `resolve_file_arg`).
pub fn read_file_arg(value: &str, flag: &str) -> Result<String> {
    if let Some(payload) = value.strip_prefix(PSEUDO_FILE_PREFIX) {
        let bytes = miles_core::base64::decode(payload)
            .map_err(|e| Error::Config(format!("{flag}: invalid base64 payload: {e}")))?;
        return String::from_utf8(bytes)
            .map_err(|e| Error::Config(format!("{flag}: the base64 payload is not UTF-8: {e}")));
    }
    std::fs::read_to_string(value).map_err(|source| Error::Io {
        path: value.into(),
        source,
    })
}

impl EvalFlags {
    /// The evaluation datasets: from `--eval-config` when set, else from `--eval-prompt-data`
    /// pairs, else none (Miles' `_resolve_eval_datasets`).
    pub fn resolve(&self) -> Result<Vec<EvalDatasetConfig>> {
        if let Some(arg) = &self.eval_config {
            let text = read_file_arg(arg, "--eval-config")?;
            return eval_datasets_from_document(&text, self);
        }
        let values = match &self.eval_prompt_data {
            Some(values) if !values.is_empty() => values.clone(),
            _ => return Ok(Vec::new()),
        };
        let values = if values.len() == 1 {
            tracing::info!(
                "[legacy] only one eval_prompt_data detected, will assume it is data for aime"
            );
            vec!["aime".to_owned(), values[0].clone()]
        } else {
            values
        };
        if !values.len().is_multiple_of(2) {
            return Err(Error::Config(
                "eval prompt data must be provided as name/path pairs.".into(),
            ));
        }
        let raw: Vec<Map<String, Value>> = values
            .chunks(2)
            .map(|pair| {
                let mut m = Map::new();
                m.insert("name".into(), Value::from(pair[0].clone()));
                m.insert("path".into(), Value::from(pair[1].clone()));
                m
            })
            .collect();
        build_datasets(self, raw, &Map::new())
    }

    fn flag(&self, name: &str) -> Value {
        let json = serde_json::to_value(self).unwrap_or(Value::Null);
        json.get(name).cloned().unwrap_or(Value::Null)
    }
}

/// The datasets of an `--eval-config` document (its text), merged with `flags`.
pub fn eval_datasets_from_document(
    document: &str,
    flags: &EvalFlags,
) -> Result<Vec<EvalDatasetConfig>> {
    let root = parse_document(document)?;
    let Value::Object(root) = root else {
        return Err(Error::Config(
            "--eval-config must contain a mapping at the root.".into(),
        ));
    };
    let eval = match root.get("eval") {
        Some(eval) => eval.clone(),
        None => Value::Object(root),
    };
    let Value::Object(eval) = eval else {
        return Err(Error::Config(
            "--eval-config must define an `eval` mapping or be a mapping itself.".into(),
        ));
    };
    let defaults = match eval.get("defaults") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(d)) => d.clone(),
        Some(_) => {
            return Err(Error::Config(
                "--eval-config: `eval.defaults` must be a mapping.".into(),
            ));
        }
    };
    let raw = dataset_list(eval.get("datasets"))?;
    if raw.is_empty() {
        return Err(Error::Config(
            "--eval-config does not define any datasets under `eval.datasets`.".into(),
        ));
    }
    build_datasets(flags, raw, &defaults)
}

/// Miles' `ensure_dataset_list`: a list of entries with `name`, or a mapping keyed by name.
fn dataset_list(config: Option<&Value>) -> Result<Vec<Map<String, Value>>> {
    let entry = |v: &Value| -> Result<Map<String, Value>> {
        match v {
            Value::Null => Ok(Map::new()),
            Value::Object(m) => Ok(m.clone()),
            other => Err(Error::Config(format!(
                "an evaluation dataset entry must be a mapping, not {other}"
            ))),
        }
    };
    match config {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Object(by_name)) => by_name
            .iter()
            .map(|(name, cfg)| {
                let mut dataset = entry(cfg)?;
                dataset
                    .entry("name")
                    .or_insert_with(|| Value::from(name.clone()));
                Ok(dataset)
            })
            .collect(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let dataset = entry(item)?;
                if !dataset.contains_key("name") {
                    return Err(Error::Config(
                        "Each evaluation dataset entry must include a `name` field.".into(),
                    ));
                }
                Ok(dataset)
            })
            .collect(),
        Some(_) => Err(Error::Config(
            "eval.datasets must be either a list or a mapping.".into(),
        )),
    }
}

/// Miles' `build_eval_dataset_configs`.
fn build_datasets(
    flags: &EvalFlags,
    raw: Vec<Map<String, Value>>,
    defaults: &Map<String, Value>,
) -> Result<Vec<EvalDatasetConfig>> {
    raw.into_iter()
        .map(|mut dataset| {
            for (field, attrs) in FIELD_FLAGS {
                if dataset.contains_key(field) {
                    continue;
                }
                let value = match defaults.get(field) {
                    Some(v) => v.clone(),
                    None => attrs
                        .iter()
                        .map(|a| flags.flag(a))
                        .find(|v| !v.is_null())
                        .unwrap_or(Value::Null),
                };
                dataset.insert(field.to_owned(), value);
            }
            let name = match dataset.get("name") {
                Some(Value::String(name)) => name.clone(),
                Some(other) => other.to_string(),
                None => String::new(),
            };
            serde_json::from_value(Value::Object(dataset))
                .map_err(|e| Error::Config(format!("evaluation dataset {name}: {e}")))
        })
        .collect()
}

/// Parses a YAML (or JSON) document into JSON values, YAML merge keys applied and OmegaConf's
/// `${path.to.node}` interpolations resolved; an empty document is an empty mapping.
pub fn parse_document(text: &str) -> Result<Value> {
    let mut yaml: serde_yaml::Value = serde_yaml::from_str(text)
        .map_err(|e| Error::Config(format!("--eval-config: not YAML: {e}")))?;
    yaml.apply_merge()
        .map_err(|e| Error::Config(format!("--eval-config: {e}")))?;
    let value =
        serde_json::to_value(&yaml).map_err(|e| Error::Config(format!("--eval-config: {e}")))?;
    let value = match value {
        Value::Null => Value::Object(Map::new()),
        v => v,
    };
    resolve_interpolations(&value, &value, 0)
}

const MAX_INTERPOLATION_DEPTH: usize = 32;

fn resolve_interpolations(node: &Value, root: &Value, depth: usize) -> Result<Value> {
    if depth > MAX_INTERPOLATION_DEPTH {
        return Err(Error::Config(
            "--eval-config: interpolation too deep (a cycle?)".into(),
        ));
    }
    Ok(match node {
        Value::String(s) if s.contains("${") => interpolate(s, root, depth)?,
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|v| resolve_interpolations(v, root, depth))
                .collect::<Result<_>>()?,
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| Ok((k.clone(), resolve_interpolations(v, root, depth)?)))
                .collect::<Result<_>>()?,
        ),
        other => other.clone(),
    })
}

/// One string with `${…}` parts: a string that is exactly one interpolation takes the node's
/// value (any type); otherwise each part is replaced by the node's text.
fn interpolate(s: &str, root: &Value, depth: usize) -> Result<Value> {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        let end = rest[start..].find('}').map(|e| start + e).ok_or_else(|| {
            Error::Config(format!("--eval-config: unclosed interpolation in {s:?}"))
        })?;
        let path = &rest[start + 2..end];
        let value = lookup(path, root, depth)?;
        if start == 0 && end + 1 == rest.len() && out.is_empty() {
            return Ok(value);
        }
        out.push_str(&rest[..start]);
        out.push_str(&match value {
            Value::String(text) => text,
            Value::Bool(b) => if b { "True" } else { "False" }.to_owned(),
            Value::Null => "None".to_owned(),
            other => other.to_string(),
        });
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(Value::String(out))
}

fn lookup(path: &str, root: &Value, depth: usize) -> Result<Value> {
    if path.contains(':') || path.starts_with('.') || path.contains('[') {
        return Err(Error::Config(format!(
            "--eval-config: interpolation ${{{path}}} is not supported (only absolute ${{a.b.c}} node paths; no resolvers, relative or bracket paths)"
        )));
    }
    let mut node = root;
    for part in path.split('.') {
        node = match node {
            Value::Object(map) => map.get(part),
            Value::Array(items) => part.parse::<usize>().ok().and_then(|i| items.get(i)),
            _ => None,
        }
        .ok_or_else(|| {
            Error::Config(format!(
                "--eval-config: interpolation key '{path}' not found"
            ))
        })?;
    }
    resolve_interpolations(node, root, depth + 1)
}
