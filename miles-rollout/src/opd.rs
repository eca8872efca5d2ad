//! On-policy distillation (OPD) during rollout, as Miles' `rollout/on_policy_distillation.py`
//! does it (`--opd-type sglang`): each sampled response is scored by a teacher on any
//! SGLang-compatible server (`POST /generate` with `max_new_tokens = 0`,
//! `return_logprob`, `logprob_start_len = 0`), and the sample gets either the teacher's
//! log-probs of its response tokens (`Sample::teacher_log_probs`, `--opd-log-prob-top-k 0`)
//! or the top-k reverse-KL estimate of "Rethinking On-Policy Distillation"
//! (`Sample::opd_reverse_kl`). The trainer subtracts `opd_kl_coef ×` the reverse KL from the
//! advantages (miles-train).
//!
//! Teachers are chosen per sample: without `--opd-teacher-urls` every sample goes to
//! `--rm-url`; with it, by the name in `metadata[--opd-teacher-key]`, the reserved name
//! `default` being the fallback, and an error when no route fits.

use std::collections::BTreeMap;
use std::time::Duration;

use miles_core::Sample;
use miles_session::http::HttpClient;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};

/// Reserved teacher name of `--opd-teacher-urls`: the fallback route.
pub const DEFAULT_TEACHER_NAME: &str = "default";

/// The metadata key of the student's per-token top-k log-probs (Miles' name).
pub const STUDENT_TOP_LOGPROBS_KEY: &str = "opd_student_top_logprobs";

/// `--opd-top-k-strategy`: the token set of each response position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TopKStrategy {
    /// The student's top-k tokens, the teacher scored on them.
    #[default]
    #[serde(rename = "only-student")]
    OnlyStudent,
    /// The teacher's top-k tokens, the student scored on them.
    #[serde(rename = "only-teacher")]
    OnlyTeacher,
    /// Tokens in both top-k sets.
    #[serde(rename = "intersection")]
    Intersection,
    /// Tokens in either top-k set.
    #[serde(rename = "union")]
    Union,
    /// Tokens in exactly one top-k set (weights not normalised).
    #[serde(rename = "xor")]
    Xor,
}

impl TopKStrategy {
    /// Miles' CLI value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::OnlyStudent => "only-student",
            Self::OnlyTeacher => "only-teacher",
            Self::Intersection => "intersection",
            Self::Union => "union",
            Self::Xor => "xor",
        }
    }
    fn student_top(self) -> bool {
        self != Self::OnlyTeacher
    }
    fn teacher_top(self) -> bool {
        self != Self::OnlyStudent
    }
    fn teacher_on_student(self) -> bool {
        matches!(self, Self::OnlyStudent | Self::Union | Self::Xor)
    }
    fn student_on_teacher(self) -> bool {
        matches!(self, Self::OnlyTeacher | Self::Union | Self::Xor)
    }
}

impl std::str::FromStr for TopKStrategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        serde_json::from_value(Value::from(s))
            .map_err(|_| Error::Config(format!("Unknown OPD top-k strategy: {s}")))
    }
}

/// `--opd-reward-weight-mode`: the weight of each selected token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardWeightMode {
    /// The student's probability.
    #[default]
    StudentP,
    /// The teacher's probability.
    TeacherP,
    /// Uniform.
    None,
}

impl std::str::FromStr for RewardWeightMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        serde_json::from_value(Value::from(s))
            .map_err(|_| Error::Config(format!("Unknown OPD reward weight mode: {s}")))
    }
}

/// A string as Python's `repr` shows it in Miles' messages (single quotes).
fn py_repr(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Miles' `parse_teacher_urls`: `NAME=URL` entries (split on the first `=`, both sides
/// trimmed) into a routing map; a malformed entry or a duplicate name is an error.
pub fn parse_teacher_urls(values: &[String]) -> Result<BTreeMap<String, String>> {
    let mut map = BTreeMap::new();
    for value in values {
        let (name, url) = match value.split_once('=') {
            Some((n, u)) => (n.trim(), u.trim()),
            None => ("", ""),
        };
        if name.is_empty() || url.is_empty() {
            return Err(Error::Config(format!(
                "Invalid --opd-teacher-urls entry {}; expected NAME=URL.",
                py_repr(value)
            )));
        }
        if map.insert(name.to_string(), url.to_string()).is_some() {
            return Err(Error::Config(format!(
                "Duplicate teacher name {} in --opd-teacher-urls.",
                py_repr(name)
            )));
        }
    }
    Ok(map)
}

/// The rollout side of OPD with `--opd-type sglang`.
#[derive(Debug, Clone, PartialEq)]
pub struct OpdTeacherConfig {
    /// `--opd-log-prob-top-k` (0: sampled-token OPD).
    pub top_k: usize,
    /// `--opd-top-k-strategy`.
    pub strategy: TopKStrategy,
    /// `--opd-reward-weight-mode`.
    pub weight_mode: RewardWeightMode,
    /// `--opd-teacher-urls`, parsed.
    pub teacher_urls: BTreeMap<String, String>,
    /// `--opd-teacher-key` (`opd_teacher`).
    pub teacher_key: String,
    /// `--rm-url`: the single teacher without `teacher_urls`.
    pub rm_url: Option<String>,
    /// The student's `/generate` URL (Miles: the SGLang router), for the strategies that score
    /// the teacher's top-k tokens under the student.
    pub student_url: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// `--opd-topk-per-position`: score each position's own ids
    /// (`token_ids_logprob_positions`) instead of the union of every position's
    /// (`token_ids_logprob`).
    pub per_position: bool,
}

impl Default for OpdTeacherConfig {
    fn default() -> Self {
        Self {
            top_k: 0,
            strategy: TopKStrategy::OnlyStudent,
            weight_mode: RewardWeightMode::StudentP,
            teacher_urls: BTreeMap::new(),
            teacher_key: "opd_teacher".into(),
            rm_url: None,
            student_url: None,
            timeout: Duration::from_secs(600),
            per_position: false,
        }
    }
}

impl OpdTeacherConfig {
    /// Miles' `_teacher_url_for_sample`: the teacher endpoint of `sample`.
    pub fn teacher_url_for(&self, sample: &Sample) -> Result<&str> {
        if self.teacher_urls.is_empty() {
            return self.rm_url.as_deref().ok_or_else(|| {
                Error::Config(
                    "OPD with --opd-type sglang needs --rm-url or --opd-teacher-urls".into(),
                )
            });
        }
        let key = &self.teacher_key;
        let default = self.teacher_urls.get(DEFAULT_TEACHER_NAME);
        match sample.metadata.get(key).filter(|v| !v.is_null()) {
            Some(value) => {
                // Miles looks the name up as `str(name)` and shows it as `repr(name)`.
                let (name, shown) = match value {
                    Value::String(s) => (s.clone(), py_repr(s)),
                    other => (other.to_string(), other.to_string()),
                };
                if let Some(url) = self.teacher_urls.get(&name).or(default) {
                    return Ok(url);
                }
                let known: Vec<String> = self.teacher_urls.keys().map(|k| py_repr(k)).collect();
                Err(Error::Config(format!(
                    "Sample metadata[{}]={shown} matches no --opd-teacher-urls name \
                     (known: [{}]) and no 'default' entry is configured.",
                    py_repr(key),
                    known.join(", ")
                )))
            }
            None => default.map(String::as_str).ok_or_else(|| {
                Error::Config(format!(
                    "Sample metadata is missing teacher key {} and --opd-teacher-urls has \
                     no 'default' entry.",
                    py_repr(key)
                ))
            }),
        }
    }
}

/// Miles' `_score_payload`: the `/generate` body that scores `input_ids` without generating.
pub fn score_payload(input_ids: &[u32], top_k: usize, token_ids: Option<&[u32]>) -> Value {
    let mut body = json!({
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 0, "skip_special_tokens": false},
        "return_logprob": true,
        "logprob_start_len": 0,
    });
    if top_k > 0 {
        body["top_logprobs_num"] = json!(top_k);
    }
    if let Some(ids) = token_ids.filter(|ids| !ids.is_empty()) {
        body["token_ids_logprob"] = json!(ids);
    }
    body
}

/// Miles' `_score_payload` with `token_ids_positions`: the scoring body that asks, at each
/// input position `p`, for the log-probs of `positions[p]` (`token_ids_logprob_positions`,
/// aligned with `logprob_start_len = 0`; understood by `miles serve` and patched SGLang
/// servers).
pub fn score_payload_per_position(
    input_ids: &[u32],
    top_k: usize,
    positions: &[Vec<u32>],
) -> Value {
    let mut body = score_payload(input_ids, top_k, None);
    body["token_ids_logprob_positions"] = json!(positions);
    body
}

/// Miles' `_per_position_ids`: one id list per input position for
/// [`score_payload_per_position`], empty over the prompt, then each response position's ids
/// in the order of its top-k entries (null entries skipped, duplicates kept).
pub fn per_position_ids(top: &[Value], prompt_len: usize, field: &str) -> Result<Vec<Vec<u32>>> {
    let mut positions = vec![Vec::new(); prompt_len];
    for entries in top {
        let ids = entries
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| !e.is_null())
            .map(|e| entry_of(e, field).map(|(id, _)| id))
            .collect::<Result<Vec<u32>>>()?;
        positions.push(ids);
    }
    Ok(positions)
}

/// Per-position maps token id → log-prob, in first-seen order (a later duplicate replaces the
/// value, as a Python dict does).
type LogprobMap = Vec<(u32, f64)>;

fn entry_of(entry: &Value, field: &str) -> Result<(u32, f64)> {
    let bad = || Error::Opd(format!("{field}: {entry} is not [logprob, token_id, ...]"));
    let items = entry.as_array().ok_or_else(bad)?;
    let lp = items.first().and_then(Value::as_f64).ok_or_else(bad)?;
    let id = items
        .get(1)
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(bad)?;
    Ok((id, lp))
}

fn entries_to_map(entries: &Value, field: &str) -> Result<LogprobMap> {
    let mut map: LogprobMap = Vec::new();
    for entry in entries.as_array().into_iter().flatten() {
        if entry.is_null() {
            continue;
        }
        let (id, lp) = entry_of(entry, field)?;
        match map.iter_mut().find(|(k, _)| *k == id) {
            Some(slot) => slot.1 = lp,
            None => map.push((id, lp)),
        }
    }
    Ok(map)
}

/// Miles' `_trim_input_field`: the response positions of an input field of `meta_info` (the
/// first input position is SGLang's placeholder).
fn trim_input_field<'a>(
    meta_info: &'a Value,
    field: &str,
    response_length: usize,
) -> Result<&'a [Value]> {
    let values = meta_info
        .get(field)
        .and_then(Value::as_array)
        .ok_or_else(|| Error::Opd(format!("Teacher response is missing meta_info.{field}.")))?;
    if response_length == 0 {
        return Ok(&[]);
    }
    let rest = values.get(1..).unwrap_or(&[]);
    if rest.len() < response_length {
        return Err(Error::Opd(format!(
            "meta_info.{field} covers {} positions after the placeholder, the response has \
             {response_length}",
            rest.len()
        )));
    }
    Ok(&rest[rest.len() - response_length..])
}

fn input_maps(meta_info: &Value, field: &str, response_length: usize) -> Result<Vec<LogprobMap>> {
    trim_input_field(meta_info, field, response_length)?
        .iter()
        .map(|entries| entries_to_map(entries, field))
        .collect()
}

/// Miles' `_teacher_sampled_log_probs`: the teacher's log-prob of each response token, from
/// `meta_info.input_token_logprobs`.
pub fn teacher_sampled_log_probs(meta_info: &Value, response_length: usize) -> Result<Vec<f64>> {
    let field = "input_token_logprobs";
    trim_input_field(meta_info, field, response_length)?
        .iter()
        .map(|item| {
            item.get(0)
                .and_then(Value::as_f64)
                .ok_or_else(|| Error::Opd(format!("{field}: {item} has no log-prob")))
        })
        .collect()
}

/// The student's top-k log-probs of the response (`metadata.opd_student_top_logprobs`, its
/// last `response_length` entries).
fn student_top(sample: &Sample) -> Result<&[Value]> {
    let r = sample.response_length;
    let top = sample
        .metadata
        .get(STUDENT_TOP_LOGPROBS_KEY)
        .and_then(Value::as_array)
        .ok_or_else(|| {
            Error::Opd(
                "Top-k OPD requires student output_top_logprobs \
                 (metadata.opd_student_top_logprobs); use --opd-top-k-strategy only-teacher \
                 with an engine that does not return them"
                    .into(),
            )
        })?;
    let top = &top[top.len().saturating_sub(r)..];
    if top.len() != r {
        return Err(Error::Opd(format!(
            "Student top-k logprob length mismatch: got {}, expected {r}.",
            top.len()
        )));
    }
    Ok(top)
}

/// Miles' `_unique_ids`: the sorted distinct token ids of per-position top-k lists.
fn unique_ids(top: &[Value], field: &str) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for entries in top {
        for (id, _) in entries_to_map(entries, field)? {
            ids.push(id);
        }
    }
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

fn selected_ids(strategy: TopKStrategy, student: &[u32], teacher: &[u32]) -> Vec<u32> {
    let in_s = |id: &u32| student.contains(id);
    let in_t = |id: &u32| teacher.contains(id);
    match strategy {
        TopKStrategy::OnlyStudent => student.to_vec(),
        TopKStrategy::OnlyTeacher => teacher.to_vec(),
        TopKStrategy::Intersection => student.iter().copied().filter(in_t).collect(),
        TopKStrategy::Union => {
            let mut out: Vec<u32> = Vec::new();
            for &id in student.iter().chain(teacher) {
                if !out.contains(&id) {
                    out.push(id);
                }
            }
            out
        }
        TopKStrategy::Xor => student
            .iter()
            .chain(teacher)
            .copied()
            .filter(|id| in_s(id) != in_t(id))
            .collect(),
    }
}

fn lookup(id: u32, primary: &LogprobMap, fallback: &LogprobMap, source: &str) -> Result<f64> {
    primary
        .iter()
        .chain(fallback)
        .find(|(k, _)| *k == id)
        .map(|(_, v)| *v)
        .ok_or_else(|| Error::Opd(format!("Missing {source} logprob for token id {id}.")))
}

fn reward_weights(
    student: &[f64],
    teacher: &[f64],
    mode: RewardWeightMode,
    normalize: bool,
) -> Vec<f64> {
    let logps: Vec<f64> = match mode {
        RewardWeightMode::StudentP => student.to_vec(),
        RewardWeightMode::TeacherP => teacher.to_vec(),
        RewardWeightMode::None => vec![0.0; student.len()],
    };
    if !normalize {
        return logps.iter().map(|l| l.exp()).collect();
    }
    let Some(max) = logps.iter().copied().reduce(f64::max) else {
        return Vec::new();
    };
    let exps: Vec<f64> = logps.iter().map(|l| (l - max).exp()).collect();
    let denom: f64 = exps.iter().sum();
    if denom == 0.0 {
        return vec![0.0; logps.len()];
    }
    exps.iter().map(|e| e / denom).collect()
}

/// Miles' `_compute_topk_reverse_kl`: the weighted reverse-KL estimate of each response
/// position over the token set of `strategy`. `student_top` is the student's per-position
/// top-k (required unless `only-teacher`), `teacher` the teacher's `meta_info`,
/// `student_on_teacher` the student's `meta_info` scored on the teacher's ids (required for
/// `only-teacher`, `union`, `xor`). Computed in f64 and rounded to f32, as Miles stores it.
pub fn topk_reverse_kl(
    strategy: TopKStrategy,
    mode: RewardWeightMode,
    response_length: usize,
    student_top: Option<&[Value]>,
    teacher: &Value,
    student_on_teacher: Option<&Value>,
) -> Result<Vec<f64>> {
    let r = response_length;
    if r == 0 {
        return Ok(Vec::new());
    }
    let empty = || vec![LogprobMap::new(); r];
    let student_maps = match (strategy.student_top(), student_top) {
        (true, Some(top)) => top
            .iter()
            .map(|e| entries_to_map(e, STUDENT_TOP_LOGPROBS_KEY))
            .collect::<Result<Vec<_>>>()?,
        (true, None) => {
            return Err(Error::Opd(
                "Top-k OPD requires student output_top_logprobs.".into(),
            ));
        }
        (false, _) => empty(),
    };
    if student_maps.len() != r {
        return Err(Error::Opd(format!(
            "Student top-k logprob length mismatch: got {}, expected {r}.",
            student_maps.len()
        )));
    }
    let teacher_top = if strategy.teacher_top() {
        input_maps(teacher, "input_top_logprobs", r)?
    } else {
        empty()
    };
    let teacher_on_student = if strategy.teacher_on_student() {
        input_maps(teacher, "input_token_ids_logprobs", r)?
    } else {
        empty()
    };
    let student_on_teacher = match (strategy.student_on_teacher(), student_on_teacher) {
        (true, Some(meta)) => input_maps(meta, "input_token_ids_logprobs", r)?,
        (true, None) => {
            return Err(Error::Opd(
                "the student's scoring of the teacher's top-k is missing".into(),
            ));
        }
        (false, _) => empty(),
    };
    let normalize = strategy != TopKStrategy::Xor;
    let mut out = Vec::with_capacity(r);
    for i in 0..r {
        let s_ids: Vec<u32> = student_maps[i].iter().map(|(k, _)| *k).collect();
        let t_ids: Vec<u32> = teacher_top[i].iter().map(|(k, _)| *k).collect();
        let ids = selected_ids(strategy, &s_ids, &t_ids);
        let mut s_lp = Vec::with_capacity(ids.len());
        let mut t_lp = Vec::with_capacity(ids.len());
        for &id in &ids {
            s_lp.push(lookup(
                id,
                &student_maps[i],
                &student_on_teacher[i],
                "student",
            )?);
            t_lp.push(lookup(
                id,
                &teacher_top[i],
                &teacher_on_student[i],
                "teacher",
            )?);
        }
        let weights = reward_weights(&s_lp, &t_lp, mode, normalize);
        let kl: f64 = weights
            .iter()
            .zip(s_lp.iter().zip(&t_lp))
            .map(|(w, (s, t))| w * (s - t))
            .fold(0.0, |acc, v| acc + v);
        out.push(f64::from(kl as f32));
    }
    Ok(out)
}

/// Scores samples with their teacher over HTTP and fills `teacher_log_probs` or
/// `opd_reverse_kl` (Miles' OPD `reward_func` + `post_process_rewards`).
#[derive(Clone)]
pub struct OpdTeacher {
    config: OpdTeacherConfig,
    http: HttpClient,
}

impl std::fmt::Debug for OpdTeacher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpdTeacher")
            .field("config", &self.config)
            .finish()
    }
}

impl OpdTeacher {
    /// A scorer for `config`.
    pub fn new(config: OpdTeacherConfig) -> Self {
        let http = HttpClient::new(config.timeout);
        Self { config, http }
    }

    /// The configuration.
    pub fn config(&self) -> &OpdTeacherConfig {
        &self.config
    }

    /// The `/generate` bodies Miles' `reward_func` sends for `sample`: the teacher's, and the
    /// student's scoring of the teacher's top-k ids (`None` here: it needs the teacher's
    /// answer first, see [`OpdTeacher::student_payload`]).
    pub fn teacher_payload(&self, sample: &Sample) -> Result<Value> {
        let c = &self.config;
        if c.top_k == 0 {
            return Ok(score_payload(&sample.tokens, 0, None));
        }
        let teacher_top_k = if c.strategy.teacher_top() { c.top_k } else { 0 };
        if !c.strategy.teacher_on_student() {
            return Ok(score_payload(&sample.tokens, teacher_top_k, None));
        }
        let top = student_top(sample)?;
        if c.per_position {
            let prompt_len = sample.tokens.len().saturating_sub(sample.response_length);
            let positions = per_position_ids(top, prompt_len, STUDENT_TOP_LOGPROBS_KEY)?;
            return Ok(score_payload_per_position(
                &sample.tokens,
                teacher_top_k,
                &positions,
            ));
        }
        let ids = unique_ids(top, STUDENT_TOP_LOGPROBS_KEY)?;
        Ok(score_payload(&sample.tokens, teacher_top_k, Some(&ids)))
    }

    /// The student's scoring body for the teacher's top-k ids (strategies `only-teacher`,
    /// `union`, `xor`), given the teacher's `meta_info`.
    pub fn student_payload(&self, sample: &Sample, teacher: &Value) -> Result<Option<Value>> {
        if self.config.top_k == 0 || !self.config.strategy.student_on_teacher() {
            return Ok(None);
        }
        let field = "input_top_logprobs";
        let top = trim_input_field(teacher, field, sample.response_length)?;
        if self.config.per_position {
            let prompt_len = sample.tokens.len().saturating_sub(sample.response_length);
            let positions = per_position_ids(top, prompt_len, field)?;
            return Ok(Some(score_payload_per_position(
                &sample.tokens,
                0,
                &positions,
            )));
        }
        let ids = unique_ids(top, field)?;
        Ok(Some(score_payload(&sample.tokens, 0, Some(&ids))))
    }

    async fn post(&self, url: &str, body: &Value) -> Result<Value> {
        let r = self
            .http
            .post_json(url, body, &[])
            .await
            .map_err(|e| Error::Opd(format!("teacher scoring at {url}: {e}")))?;
        if !r.status.is_success() {
            return Err(Error::Opd(format!(
                "teacher scoring at {url} answered {}: {}",
                r.status,
                r.text()
            )));
        }
        let value: Value = r
            .json()
            .map_err(|e| Error::Opd(format!("teacher scoring at {url}: {e}")))?;
        // A batched answer (one prompt) is a one-element list.
        let value = match value {
            Value::Array(mut items) if items.len() == 1 => items.remove(0),
            other => other,
        };
        value
            .get("meta_info")
            .cloned()
            .ok_or_else(|| Error::Opd(format!("teacher scoring at {url}: no meta_info")))
    }

    /// Scores `sample` with its teacher: sets `teacher_log_probs` (top-k 0) or
    /// `opd_reverse_kl`. A sample without response tokens gets empty vectors.
    pub async fn score(&self, sample: &mut Sample) -> Result<()> {
        let url = self.config.teacher_url_for(sample)?.to_string();
        let teacher = self.post(&url, &self.teacher_payload(sample)?).await?;
        let r = sample.response_length;
        if self.config.top_k == 0 {
            sample.teacher_log_probs = Some(teacher_sampled_log_probs(&teacher, r)?);
            return Ok(());
        }
        let student_on_teacher = match self.student_payload(sample, &teacher)? {
            Some(body) => {
                let url = self.config.student_url.as_deref().ok_or_else(|| {
                    Error::Config(format!(
                        "--opd-top-k-strategy {} scores the teacher's top-k under the student: \
                         it needs the student's /generate URL",
                        self.config.strategy.as_str()
                    ))
                })?;
                Some(self.post(url, &body).await?)
            }
            None => None,
        };
        let top = if self.config.strategy.student_top() {
            Some(student_top(sample)?)
        } else {
            None
        };
        let kl = topk_reverse_kl(
            self.config.strategy,
            self.config.weight_mode,
            r,
            top,
            &teacher,
            student_on_teacher.as_ref(),
        )?;
        sample.opd_reverse_kl = Some(kl);
        Ok(())
    }

    /// Scores every sample of `samples` concurrently; a sample whose scoring fails is marked
    /// FAILED (`metadata.failure`, `failure_kind = "reward"`: the teacher is OPD's reward
    /// function in Miles).
    pub async fn score_all(&self, samples: &mut [Sample]) {
        let mut set = tokio::task::JoinSet::new();
        for (i, sample) in samples.iter().enumerate() {
            let me = self.clone();
            let mut sample = sample.clone();
            set.spawn(async move {
                let result = me.score(&mut sample).await;
                (i, sample, result)
            });
        }
        while let Some(joined) = set.join_next().await {
            let Ok((i, sample, result)) = joined else {
                continue;
            };
            samples[i] = sample;
            if let Err(e) = result {
                let s = &mut samples[i];
                s.status = miles_core::SampleStatus::Failed;
                let meta: &mut Map<String, Value> = &mut s.metadata;
                meta.insert("failure".into(), Value::from(format!("opd teacher: {e}")));
                meta.insert("failure_kind".into(), Value::from("reward"));
            }
        }
    }
}

/// The task reward of pure distillation: 0 for every sample (Miles' OPD
/// `post_process_rewards`; the learning signal is the teacher's reverse KL alone).
#[derive(Debug, Clone, Copy, Default)]
pub struct DistillationOnlyReward;

#[async_trait::async_trait]
impl miles_core::RewardFn for DistillationOnlyReward {
    async fn reward(&self, _sample: &Sample) -> miles_core::Result<miles_core::Reward> {
        Ok(miles_core::Reward::Scalar(0.0))
    }
}
