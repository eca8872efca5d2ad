//! The samples wire codec (MILES_SPEC §3.4): what `POST /sessions/{id}/samples` returns.
//!
//! One safetensors blob. For sample `k`, tensor fields are stored as `"<field>.<k>"` with pinned
//! dtypes (`tokens` I64, `loss_mask` U8, `rollout_log_probs` F64, `rollout_routed_experts` and
//! `rollout_indexer_topk` I32 `[rows, layers, top_k]`); everything else travels in `_samples_meta`,
//! a U8 rank-1 tensor holding compact UTF-8 JSON
//! `{"samples": [{response, response_length, status, weight_versions, prefix_cache_info,
//! metadata, nulls}], "session_metadata": {…}, "empty_reason": null | "no_records" | "all_truncated"}`.

use std::collections::BTreeSet;

use miles_core::{
    DType, NamedTensors, PrefixCacheInfo, RoutedExperts, Sample, SampleStatus, TensorBytes,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The key of the JSON metadata tensor.
pub const META_KEY: &str = "_samples_meta";

/// Why a session produced no sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EmptyReason {
    /// The session has no committed turn.
    NoRecords,
    /// Truncation to `max_seq_len` dropped every turn.
    AllTruncated,
}

/// What the samples route carries: samples, the session's metadata, and why it is empty.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SamplesPayload {
    /// The assembled samples (one, merged, for a linear session).
    pub samples: Vec<Sample>,
    /// `accumulated_token_ids`, `max_trim_tokens`, `tito_session_mismatch`, …
    pub session_metadata: Map<String, Value>,
    /// Set when `samples` is empty.
    pub empty_reason: Option<EmptyReason>,
}

#[derive(Serialize, Deserialize)]
struct SampleMeta {
    response: String,
    response_length: usize,
    status: SampleStatus,
    weight_versions: Vec<String>,
    prefix_cache_info: PrefixCacheInfo,
    metadata: Map<String, Value>,
    nulls: Vec<String>,
}

#[derive(Serialize, Deserialize)]
struct PayloadMeta {
    samples: Vec<SampleMeta>,
    session_metadata: Map<String, Value>,
    empty_reason: Option<EmptyReason>,
}

fn codec_err(field: impl Into<String>, reason: impl Into<String>) -> Error {
    Error::Codec {
        field: field.into(),
        reason: reason.into(),
    }
}

fn tensor(dtype: DType, shape: Vec<usize>, data: Vec<u8>, name: &str) -> Result<TensorBytes> {
    TensorBytes::new(dtype, shape, data).map_err(|e| codec_err(name, e.to_string()))
}

fn table_tensor(table: &RoutedExperts, name: &str) -> Result<TensorBytes> {
    let data = table
        .as_slice()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    tensor(DType::I32, table.shape().to_vec(), data, name)
}

/// Encodes a payload as Miles does (MILES_SPEC §3.4).
pub fn encode_samples(payload: &SamplesPayload) -> Result<Vec<u8>> {
    let mut tensors = NamedTensors::new();
    let mut metas = Vec::with_capacity(payload.samples.len());
    for (k, s) in payload.samples.iter().enumerate() {
        let mut nulls = Vec::new();
        let name = format!("tokens.{k}");
        let data = s
            .tokens
            .iter()
            .flat_map(|t| i64::from(*t).to_le_bytes())
            .collect();
        tensors.insert(
            name.clone(),
            tensor(DType::I64, vec![s.tokens.len()], data, &name)?,
        );
        match &s.loss_mask {
            Some(mask) => {
                let name = format!("loss_mask.{k}");
                tensors.insert(
                    name.clone(),
                    tensor(DType::U8, vec![mask.len()], mask.clone(), &name)?,
                );
            }
            None => nulls.push("loss_mask".to_owned()),
        }
        match &s.rollout_log_probs {
            Some(lp) => {
                let name = format!("rollout_log_probs.{k}");
                let data = lp.iter().flat_map(|v| v.to_le_bytes()).collect();
                tensors.insert(
                    name.clone(),
                    tensor(DType::F64, vec![lp.len()], data, &name)?,
                );
            }
            None => nulls.push("rollout_log_probs".to_owned()),
        }
        for (field, table) in [
            ("rollout_routed_experts", &s.rollout_routed_experts),
            ("rollout_indexer_topk", &s.rollout_indexer_topk),
        ] {
            match table {
                Some(t) => {
                    let name = format!("{field}.{k}");
                    tensors.insert(name.clone(), table_tensor(t, &name)?);
                }
                None => nulls.push(field.to_owned()),
            }
        }
        metas.push(SampleMeta {
            response: s.response.clone(),
            response_length: s.response_length,
            status: s.status,
            weight_versions: s.weight_versions.clone(),
            prefix_cache_info: s.prefix_cache_info,
            metadata: s.metadata.clone(),
            nulls,
        });
    }
    let meta = PayloadMeta {
        samples: metas,
        session_metadata: payload.session_metadata.clone(),
        empty_reason: payload.empty_reason,
    };
    let json = serde_json::to_vec(&meta).map_err(|e| codec_err(META_KEY, e.to_string()))?;
    tensors.insert(
        META_KEY,
        tensor(DType::U8, vec![json.len()], json, META_KEY)?,
    );
    Ok(tensors.to_safetensors_bytes())
}

fn take(
    tensors: &NamedTensors,
    name: &str,
    dtype: DType,
    used: &mut BTreeSet<String>,
) -> Result<Option<TensorBytes>> {
    match tensors.get(name) {
        None => Ok(None),
        Some(t) if t.dtype() != dtype => Err(codec_err(
            name,
            format!("dtype {:?}, expected {dtype:?}", t.dtype()),
        )),
        Some(t) => {
            used.insert(name.to_owned());
            Ok(Some(t.clone()))
        }
    }
}

fn table_from(t: &TensorBytes, name: &str) -> Result<RoutedExperts> {
    let [rows, layers, top_k] = t.shape() else {
        return Err(codec_err(
            name,
            format!("rank {}, expected 3", t.shape().len()),
        ));
    };
    let data = t
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    RoutedExperts::new(*rows, *layers, *top_k, data).map_err(|e| codec_err(name, e.to_string()))
}

/// Decodes a payload, overlaying each encoded sample onto a copy of `input` (whose
/// generated fields must be at their defaults). Unreferenced tensors, wrong dtypes, values
/// that do not fit (token ids beyond u32, loss-mask values other than 0/1) and samples that
/// break [`Sample::validate`] are [`Error::Codec`].
pub fn decode_samples(bytes: &[u8], input: &Sample) -> Result<SamplesPayload> {
    if !input.weight_versions.is_empty()
        || input.prefix_cache_info != PrefixCacheInfo::default()
        || input.spec_info != Default::default()
        || input.teacher_log_probs.is_some()
    {
        return Err(codec_err(
            "input",
            "input sample must have default weight_versions, prefix_cache_info, spec_info and no teacher log-probs",
        ));
    }
    let tensors = NamedTensors::from_safetensors_bytes(bytes)
        .map_err(|e| codec_err("blob", e.to_string()))?;
    let mut used = BTreeSet::new();
    let meta_tensor = take(&tensors, META_KEY, DType::U8, &mut used)?
        .ok_or_else(|| codec_err(META_KEY, "missing"))?;
    let meta: PayloadMeta = serde_json::from_slice(meta_tensor.data())
        .map_err(|e| codec_err(META_KEY, e.to_string()))?;
    let mut samples = Vec::with_capacity(meta.samples.len());
    for (k, m) in meta.samples.into_iter().enumerate() {
        let mut s = input.clone();
        let is_null = |f: &str| m.nulls.iter().any(|n| n == f);
        let name = format!("tokens.{k}");
        s.tokens = match take(&tensors, &name, DType::I64, &mut used)? {
            Some(t) => t
                .data()
                .chunks_exact(8)
                .map(|b| {
                    let v = i64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                    u32::try_from(v)
                        .map_err(|_| codec_err(&name, format!("token id {v} out of range")))
                })
                .collect::<Result<_>>()?,
            None if is_null("tokens") => Vec::new(),
            None => return Err(codec_err(name, "missing")),
        };
        let name = format!("loss_mask.{k}");
        s.loss_mask = match take(&tensors, &name, DType::U8, &mut used)? {
            Some(t) => Some(t.data().to_vec()),
            None if is_null("loss_mask") => None,
            None => return Err(codec_err(name, "missing")),
        };
        let name = format!("rollout_log_probs.{k}");
        s.rollout_log_probs = match take(&tensors, &name, DType::F64, &mut used)? {
            Some(t) => Some(
                t.data()
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            None if is_null("rollout_log_probs") => None,
            None => return Err(codec_err(name, "missing")),
        };
        for field in ["rollout_routed_experts", "rollout_indexer_topk"] {
            let name = format!("{field}.{k}");
            let value = match take(&tensors, &name, DType::I32, &mut used)? {
                Some(t) => Some(table_from(&t, &name)?),
                None if is_null(field) => None,
                None => return Err(codec_err(name, "missing")),
            };
            if field == "rollout_routed_experts" {
                s.rollout_routed_experts = value;
            } else {
                s.rollout_indexer_topk = value;
            }
        }
        s.response = m.response;
        s.response_length = m.response_length;
        s.status = m.status;
        s.weight_versions = m.weight_versions;
        s.prefix_cache_info = m.prefix_cache_info;
        for (key, value) in m.metadata {
            s.metadata.insert(key, value);
        }
        s.validate()
            .map_err(|e| codec_err(format!("sample {k}"), e.to_string()))?;
        samples.push(s);
    }
    let unreferenced: Vec<&str> = tensors
        .iter()
        .map(|(n, _)| n)
        .filter(|n| !used.contains(*n))
        .collect();
    if !unreferenced.is_empty() {
        return Err(codec_err(
            "blob",
            format!("unreferenced tensors {unreferenced:?}"),
        ));
    }
    Ok(SamplesPayload {
        samples,
        session_metadata: meta.session_metadata,
        empty_reason: meta.empty_reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Sample {
        let mut s = Sample::builder(Default::default())
            .tokens(vec![1, 2, 3, 70000], 2)
            .loss_mask(vec![1, 0])
            .rollout_log_probs(vec![-0.5, -1.25])
            .routed_experts(RoutedExperts::new(3, 2, 2, (0..12).collect()).unwrap())
            .status(SampleStatus::Truncated)
            .weight_version(4)
            .metadata("k", json!([1, "x"]))
            .build()
            .unwrap();
        s.response = "ab".into();
        s.prefix_cache_info.cached_tokens = 2;
        s.prefix_cache_info.total_prompt_tokens = 3;
        s
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn valid_bytes() -> Vec<u8> {
            let payload = SamplesPayload {
                samples: vec![sample(), sample()],
                session_metadata: Map::new(),
                empty_reason: None,
            };
            encode_samples(&payload).unwrap()
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Arbitrary bytes: an error or a payload, never a panic or a huge allocation.
            #[test]
            fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                let _ = decode_samples(&bytes, &Sample::default());
            }

            /// A valid payload with bytes overwritten, cut short or extended: every decode
            /// either fails with a codec error or yields samples that pass validation.
            #[test]
            fn mutated_payloads_are_errors_or_valid_samples(
                edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
                cut in any::<prop::sample::Index>(),
                mode in 0u8..3,
            ) {
                let mut bytes = valid_bytes();
                for (at, value) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = value;
                }
                match mode {
                    0 => bytes.truncate(cut.index(bytes.len())),
                    1 => bytes.extend(std::iter::repeat_n(0xffu8, cut.index(64))),
                    _ => {}
                }
                if let Ok(payload) = decode_samples(&bytes, &Sample::default()) {
                    for sample in &payload.samples {
                        prop_assert!(sample.validate().is_ok());
                    }
                }
            }

            /// A header length field rewritten to any value is an error, not an allocation.
            #[test]
            fn hostile_header_lengths_are_errors(length in any::<u64>()) {
                let mut bytes = valid_bytes();
                let real = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                prop_assume!(length != real);
                bytes[..8].copy_from_slice(&length.to_le_bytes());
                prop_assert!(decode_samples(&bytes, &Sample::default()).is_err());
            }
        }
    }

    #[test]
    fn round_trip_and_layout() {
        let mut meta = Map::new();
        meta.insert("max_trim_tokens".into(), json!(0));
        let payload = SamplesPayload {
            samples: vec![sample()],
            session_metadata: meta,
            empty_reason: None,
        };
        let bytes = encode_samples(&payload).unwrap();
        let tensors = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            vec![
                "_samples_meta",
                "loss_mask.0",
                "rollout_log_probs.0",
                "rollout_routed_experts.0",
                "tokens.0"
            ]
        );
        let tokens = tensors.get("tokens.0").unwrap();
        assert_eq!(tokens.dtype(), DType::I64);
        assert_eq!(&tokens.data()[24..32], &70000i64.to_le_bytes());
        assert_eq!(
            tensors.get("rollout_routed_experts.0").unwrap().shape(),
            &[3, 2, 2]
        );
        let meta: Value = serde_json::from_slice(tensors.get(META_KEY).unwrap().data()).unwrap();
        assert_eq!(meta["samples"][0]["status"], json!("truncated"));
        assert_eq!(meta["samples"][0]["nulls"], json!(["rollout_indexer_topk"]));
        assert_eq!(meta["empty_reason"], Value::Null);
        let back = decode_samples(&bytes, &Sample::default()).unwrap();
        assert_eq!(back, payload);
    }

    #[test]
    fn decoder_rejects_extra_tensors_and_bad_input() {
        let payload = SamplesPayload {
            samples: vec![],
            session_metadata: Map::new(),
            empty_reason: Some(EmptyReason::NoRecords),
        };
        let bytes = encode_samples(&payload).unwrap();
        assert_eq!(decode_samples(&bytes, &Sample::default()).unwrap(), payload);
        let mut tensors = NamedTensors::from_safetensors_bytes(&bytes).unwrap();
        tensors.insert(
            "tokens.7",
            TensorBytes::new(DType::I64, vec![0], vec![]).unwrap(),
        );
        let err = decode_samples(&tensors.to_safetensors_bytes(), &Sample::default()).unwrap_err();
        assert!(err.to_string().contains("unreferenced"), "{err}");
        let mut used = Sample::default();
        used.weight_versions.push("1".into());
        assert!(decode_samples(&bytes, &used).is_err());
        assert!(decode_samples(b"garbage", &Sample::default()).is_err());
    }
}
