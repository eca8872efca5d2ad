//! Miles' rule-based rewards (`miles/rollout/rm_hub`), selected by `--rm-type` and by a
//! sample's `metadata["rm_type"]`, with Miles' exact semantics.
//!
//! | `--rm-type` | reward | Miles source |
//! |---|---|---|
//! | `math` | 1 / 0: the last `\boxed{}` against the label, MATH normalisation, then sympy equivalence | `math_utils.grade_answer_verl` |
//! | `deepscaler` | 1 / 0: as `math` on the text after the last `</think>` (or after the first `###Response`); 0 without either | `deepscaler.py` |
//! | `gemma_math` | 1 / 0: as `deepscaler` on the text after the last `<channel|>` (the whole response without one) | `deepscaler.py` |
//! | `dapo` | `{"score": ±1.0, "acc": bool, "pred": str}`: the last `Answer: …` line of the last 300 characters against the integer label | `math_dapo_utils.compute_score` |
//! | `f1` | SQuAD token F1 in [0, 1] | `f1.f1_score` |
//! | `gpqa` | 1.0 / 0.0: the option letter (or the correct option's text) in the response | `gpqa.compute_gpqa_reward` |
//! | `random` | 0 or 1 with probability ½ | `random.randint(0, 1)` |
//! | `deterministic_random` | `sha256(str(tokens) + response)[0] % 2` | `__init__.py` |
//! | `remote_rm` | the JSON answer of `POST rm_url {"prompt", "response", "label"}` | [`RemoteReward`] |
//! | `boxed_<rule>` | `<rule>` on the content of the response's last `\boxed{}` (`""` without one) | `__init__.async_rm` |
//!
//! Miles' `sympy.simplify` step of `math` / `deepscaler` is replaced by exact rational and
//! numeric evaluation (see `COMPATIBILITY.md`; `tests/it/rm_hub.rs` measures the agreement on
//! a table of cases scored by Miles' own Python).
//!
//! ```
//! use miles_core::{RewardFn, Reward, Sample};
//! use miles_rollout::rm_hub::{RmHubReward, RmType};
//!
//! let rm = RmHubReward::new(Some(RmType::from_rm_type("math")?));
//! let mut sample = Sample::default();
//! sample.response = r"so the answer is $\boxed{\dfrac{1}{2}}$".into();
//! sample.label = Some("0.5".into());
//! let reward = futures_lite_block_on(rm.reward(&sample))?;
//! assert_eq!(reward, Reward::Scalar(1.0));
//! // A sample's metadata["rm_type"] overrides the global one, as in Miles.
//! sample.metadata.insert("rm_type".into(), "f1".into());
//! sample.response = "the cat sat".into();
//! sample.label = Some("cat sat".into());
//! assert_eq!(futures_lite_block_on(rm.reward(&sample))?, Reward::Scalar(1.0));
//! # fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     let mut f = std::pin::pin!(f);
//! #     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
//! #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod dapo;
mod f1;
mod gpqa;
mod latex2text;
mod latex_symbols;
mod math_utils;
mod python;
mod sympy_lite;

use std::fmt;
use std::str::FromStr;
use std::sync::Mutex;

use miles_core::{Error as CoreError, Result as CoreResult, Reward, RewardFn, Sample, async_trait};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::reward::RemoteReward;

pub use dapo::{DapoScore, compute_score as dapo_score};
pub use f1::f1_score;
pub use math_utils::{extract_answer as extract_boxed_answer, grade_answer_verl};

/// A rule of Miles' rm_hub, named by its `--rm-type` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RmRule {
    /// `remote_rm`: a reward model over HTTP (`--rm-url`).
    RemoteRm,
    /// `deepscaler`: `math` after the reasoning (`</think>` / `###Response`).
    Deepscaler,
    /// `gemma_math`: `math` after Gemma's `<channel|>`.
    GemmaMath,
    /// `dapo`: DAPO's `Answer:` line against an integer label.
    Dapo,
    /// `math`: the last `\boxed{}` against the label (MATH normalisation + equivalence).
    Math,
    /// `f1`: SQuAD token F1.
    F1,
    /// `gpqa`: multiple-choice letter grading.
    Gpqa,
    /// `random`: 0 or 1 uniformly.
    Random,
    /// `deterministic_random`: a hash of the tokens and response, mod 2.
    DeterministicRandom,
}

impl RmRule {
    /// Every rule, in the order Miles' `async_rm` tests them.
    pub const ALL: [RmRule; 9] = [
        Self::RemoteRm,
        Self::Deepscaler,
        Self::GemmaMath,
        Self::Dapo,
        Self::Math,
        Self::F1,
        Self::Gpqa,
        Self::Random,
        Self::DeterministicRandom,
    ];

    /// The `--rm-type` name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::RemoteRm => "remote_rm",
            Self::Deepscaler => "deepscaler",
            Self::GemmaMath => "gemma_math",
            Self::Dapo => "dapo",
            Self::Math => "math",
            Self::F1 => "f1",
            Self::Gpqa => "gpqa",
            Self::Random => "random",
            Self::DeterministicRandom => "deterministic_random",
        }
    }
}

/// An `--rm-type` value: a rule, optionally with Miles' `boxed_` prefix (the rule then sees
/// only the content of the response's last `\boxed{}`). Serialises as the string Miles
/// uses (`"math"`, `"boxed_f1"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RmType {
    /// Whether the `boxed_` prefix is present.
    pub boxed: bool,
    /// The rule.
    pub rule: RmRule,
}

/// An `--rm-type` that Miles' rm_hub (as re-created here) does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown rm_type {name:?}: expected one of remote_rm, deepscaler, gemma_math, dapo, math, f1, gpqa, random, deterministic_random, optionally prefixed with boxed_{note}",
    note = if name.trim_start_matches("boxed_") == "ifbench" { " (ifbench is not implemented in miles-rs)" } else { "" }
)]
#[non_exhaustive]
pub struct UnknownRmType {
    /// The name given (after Miles' whitespace strip).
    pub name: String,
}

impl RmType {
    /// Parses an `--rm-type` value as Miles' `async_rm` dispatches it: surrounding whitespace
    /// stripped, one `boxed_` prefix, then an exact, case-sensitive rule name.
    pub fn from_rm_type(name: &str) -> Result<Self, UnknownRmType> {
        let stripped = python::strip(name);
        let (boxed, rest) = match stripped.strip_prefix("boxed_") {
            Some(rest) => (true, rest),
            None => (false, stripped),
        };
        RmRule::ALL
            .into_iter()
            .find(|r| r.name() == rest)
            .map(|rule| Self { boxed, rule })
            .ok_or_else(|| UnknownRmType {
                name: stripped.to_owned(),
            })
    }

    /// The plain rule (no `boxed_` prefix).
    pub const fn rule(rule: RmRule) -> Self {
        Self { boxed: false, rule }
    }
}

impl fmt::Display for RmType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.boxed {
            f.write_str("boxed_")?;
        }
        f.write_str(self.rule.name())
    }
}

impl FromStr for RmType {
    type Err = UnknownRmType;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_rm_type(s)
    }
}

impl Serialize for RmType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RmType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Self::from_rm_type(&name).map_err(serde::de::Error::custom)
    }
}

/// The rm_type a sample is scored with, resolved as Miles' `_resolve_reward_config`: the
/// sample's `metadata["rm_type"]` when truthy, else the global `--rm-type`, stripped. Miles
/// first consults the sample's `reward_spec.rm_type` (multi-LoRA adapters); miles-core's
/// `Sample` has no reward spec, so that step is absent here. `Ok(None)`: no rm_type at all
/// (Miles raises "Rule-based RM type is not specified").
pub fn resolve_rm_type(
    metadata: &Map<String, Value>,
    global: Option<&str>,
) -> Result<Option<RmType>, CoreError> {
    let name = match metadata.get("rm_type") {
        Some(Value::String(s)) if !s.is_empty() => s.as_str(),
        Some(v @ (Value::Number(_) | Value::Bool(true) | Value::Array(_) | Value::Object(_)))
            if gpqa_truthy(v) =>
        {
            return Err(CoreError::Reward(format!(
                "metadata rm_type {v} is not a string"
            )));
        }
        _ => global.unwrap_or(""),
    };
    let name = python::strip(name);
    if name.is_empty() || name == "boxed_" {
        return Ok(None);
    }
    RmType::from_rm_type(name)
        .map(Some)
        .map_err(|e| CoreError::Reward(e.to_string()))
}

fn gpqa_truthy(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_f64().is_some_and(|x| x != 0.0),
        Value::Bool(b) => *b,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Null => false,
    }
}

/// Miles' `deepscaler` rule.
pub fn deepscaler_reward(response: &str, label: Option<&str>) -> CoreResult<f64> {
    let solution = if response.contains("</think>") {
        response.rsplit("</think>").next().unwrap_or_default()
    } else if response.contains("###Response") {
        response.split("###Response").nth(1).unwrap_or_default()
    } else {
        return Ok(0.0);
    };
    grade_boxed_solution(solution, label)
}

/// Miles' `gemma_math` rule.
pub fn gemma_math_reward(response: &str, label: Option<&str>) -> CoreResult<f64> {
    let solution = response.rsplit("<channel|>").next().unwrap_or_default();
    grade_boxed_solution(solution, label)
}

fn grade_boxed_solution(solution: &str, label: Option<&str>) -> CoreResult<f64> {
    let Some(given) = math_utils::extract_answer(solution) else {
        return Ok(0.0);
    };
    let Some(label) = label else {
        return Err(CoreError::Reward("deepscaler needs a label".into()));
    };
    if label.is_empty() {
        return Ok(0.0);
    }
    let truth = if label.contains("\\boxed") {
        match math_utils::extract_answer(label) {
            Some(t) => t,
            None => return Ok(0.0),
        }
    } else {
        label
    };
    let ok = math_utils::grade_answer_mathd(given, truth)
        || math_utils::grade_answer_sympy(given, truth);
    Ok(if ok { 1.0 } else { 0.0 })
}

/// Miles' `deterministic_random`: `sha256(str(tokens) + response)[0] % 2`, with `tokens`
/// written as Python prints a list (`[1, 2, 3]`).
pub fn deterministic_random(tokens: &[miles_core::TokenId], response: &str) -> f64 {
    let mut hasher = Sha256::new();
    hasher.update(b"[");
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            hasher.update(b", ");
        }
        hasher.update(t.to_string().as_bytes());
    }
    hasher.update(b"]");
    hasher.update(response.as_bytes());
    f64::from(hasher.finalize()[0] % 2)
}

/// Miles' rm_hub as one reward: the global `--rm-type` (optional), a sample's
/// `metadata["rm_type"]` overriding it, the `boxed_` prefix, every rule of [`RmRule`], and
/// `remote_rm` through a [`RemoteReward`] when one is configured.
#[derive(Debug)]
pub struct RmHubReward {
    rm_type: Option<RmType>,
    remote: Option<RemoteReward>,
    /// SplitMix64 state of `random`.
    rng: Mutex<u64>,
}

impl RmHubReward {
    /// A hub with the global `--rm-type` (`None`: every sample must name its own).
    pub fn new(rm_type: Option<RmType>) -> Self {
        Self {
            rm_type,
            remote: None,
            rng: Mutex::new(0x9E37_79B9_7F4A_7C15),
        }
    }

    /// The reward model used for `remote_rm` (Miles' `--rm-url`).
    pub fn with_remote(mut self, remote: RemoteReward) -> Self {
        self.remote = Some(remote);
        self
    }

    /// Seeds `random` (Miles draws from Python's global `random`; here each hub has its own
    /// SplitMix64 stream).
    pub fn with_seed(self, seed: u64) -> Self {
        Self {
            rng: Mutex::new(seed),
            ..self
        }
    }

    /// The global `--rm-type`.
    pub fn rm_type(&self) -> Option<RmType> {
        self.rm_type
    }

    fn next_bit(&self) -> f64 {
        let mut state = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 63) as f64
    }

    /// Scores `sample` with an explicit rm_type (no metadata lookup).
    pub async fn score_with(&self, rm_type: RmType, sample: &Sample) -> CoreResult<Reward> {
        let label = sample.label.as_deref();
        let response: &str = if rm_type.boxed {
            math_utils::extract_answer(&sample.response).unwrap_or("")
        } else {
            &sample.response
        };
        let scalar = |v: f64| Ok(Reward::Scalar(v));
        match rm_type.rule {
            RmRule::RemoteRm => match &self.remote {
                Some(remote) => remote.reward(sample).await,
                None => Err(CoreError::Reward(
                    "rm_type remote_rm needs a reward model URL (--rm-url)".into(),
                )),
            },
            RmRule::Deepscaler => scalar(deepscaler_reward(response, label)?),
            RmRule::GemmaMath => scalar(gemma_math_reward(response, label)?),
            RmRule::Dapo => {
                let label = label.unwrap_or("None");
                let score = dapo::compute_score(response, label).ok_or_else(|| {
                    CoreError::Reward(format!("dapo label {label:?} is not a number"))
                })?;
                let mut map = Map::new();
                map.insert("score".into(), score.score.into());
                map.insert("acc".into(), score.acc.into());
                map.insert("pred".into(), score.pred.into());
                Ok(Reward::Map(map))
            }
            RmRule::Math => scalar(if grade_answer_verl(response, label) {
                1.0
            } else {
                0.0
            }),
            RmRule::F1 => {
                let label = label.ok_or_else(|| CoreError::Reward("f1 needs a label".into()))?;
                scalar(f1::f1_score(response, label))
            }
            RmRule::Gpqa => gpqa::compute_gpqa_reward(response, label, &sample.metadata)
                .map(Reward::Scalar)
                .map_err(|e| CoreError::Reward(format!("gpqa metadata: {}", e.0))),
            RmRule::Random => scalar(self.next_bit()),
            RmRule::DeterministicRandom => scalar(deterministic_random(&sample.tokens, response)),
        }
    }
}

#[async_trait]
impl RewardFn for RmHubReward {
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        let global = self.rm_type.map(|t| t.to_string());
        let rm_type = resolve_rm_type(&sample.metadata, global.as_deref())?
            .ok_or_else(|| CoreError::Reward("rule-based RM type is not specified".into()))?;
        self.score_with(rm_type, sample).await
    }
}

#[async_trait]
impl RewardFn for RmType {
    /// Scores as an [`RmHubReward`] with this global rm_type and no remote model (a sample's
    /// `metadata["rm_type"]` still overrides it, as in Miles).
    async fn reward(&self, sample: &Sample) -> CoreResult<Reward> {
        RmHubReward::new(Some(*self)).reward(sample).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rm_type_names_round_trip() {
        for rule in RmRule::ALL {
            for boxed in [false, true] {
                let t = RmType { boxed, rule };
                assert_eq!(RmType::from_rm_type(&t.to_string()), Ok(t));
                let json = serde_json::to_string(&t).unwrap();
                assert_eq!(serde_json::from_str::<RmType>(&json).unwrap(), t);
            }
            let json = serde_json::to_value(rule).unwrap();
            assert_eq!(json, Value::String(rule.name().into()));
        }
        assert_eq!(
            RmType::from_rm_type(" boxed_math\n"),
            Ok(RmType {
                boxed: true,
                rule: RmRule::Math
            })
        );
        let err = RmType::from_rm_type("Math").unwrap_err();
        assert!(err.to_string().contains("deterministic_random"), "{err}");
        assert!(RmType::from_rm_type("boxed_boxed_math").is_err());
        assert!(
            RmType::from_rm_type("ifbench")
                .unwrap_err()
                .to_string()
                .contains("not implemented")
        );
    }

    #[test]
    fn deterministic_random_hashes_python_list_text() {
        // hashlib.sha256(b"[1, 2, 3]hello").digest()[0] = 0x4b -> 1
        let digest = Sha256::digest(b"[1, 2, 3]hello");
        assert_eq!(
            deterministic_random(&[1, 2, 3], "hello"),
            f64::from(digest[0] % 2)
        );
    }

    #[test]
    fn random_is_a_fair_coin() {
        let hub = RmHubReward::new(None).with_seed(7);
        let ones: f64 = (0..10_000).map(|_| hub.next_bit()).sum();
        assert!((4_800.0..5_200.0).contains(&ones), "{ones}");
    }
}
