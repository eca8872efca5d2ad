//! `--rm-type` values: a rule of the registry ([`RmRule`]), optionally with Miles' `boxed_`
//! prefix ([`RmType`]), and the per-sample resolution of Miles' `_resolve_reward_config`
//! ([`resolve_rm_type`]).

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use miles_core::Error as CoreError;
use miles_core::python;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::Error;
use crate::rule::Rule;
use crate::rules;

/// A rule of Miles' rm_hub, named by its `--rm-type` value: a row of the crate's rule
/// registry. Serialises as its name (`"math"`).
#[derive(Clone, Copy)]
pub struct RmRule(&'static Rule);

impl RmRule {
    /// Every rule, in the order Miles' `async_rm` tests them.
    pub fn all() -> impl ExactSizeIterator<Item = RmRule> + Clone {
        rules::RULES.iter().map(RmRule)
    }

    /// The rule named `name` (exact, case-sensitive; no `boxed_` prefix).
    pub fn from_name(name: &str) -> Option<RmRule> {
        rules::find(name).map(RmRule)
    }

    /// The `--rm-type` name.
    pub fn name(self) -> &'static str {
        self.0.name
    }

    /// What the rule scores, in one line.
    pub fn description(self) -> &'static str {
        self.0.description
    }

    /// The registry row.
    pub(crate) fn rule(self) -> &'static Rule {
        self.0
    }
}

impl PartialEq for RmRule {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for RmRule {}

impl Hash for RmRule {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name().hash(state);
    }
}

impl fmt::Debug for RmRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RmRule").field(&self.name()).finish()
    }
}

impl fmt::Display for RmRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RmRule {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_name(s).ok_or_else(|| Error::UnknownRmType { name: s.to_owned() })
    }
}

impl Serialize for RmRule {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for RmRule {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
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

impl RmType {
    /// Parses an `--rm-type` value as Miles' `async_rm` dispatches it: surrounding whitespace
    /// stripped, one `boxed_` prefix, then an exact, case-sensitive rule name.
    pub fn from_rm_type(name: &str) -> Result<Self, Error> {
        let stripped = python::strip(name);
        let (boxed, rest) = match stripped.strip_prefix("boxed_") {
            Some(rest) => (true, rest),
            None => (false, stripped),
        };
        RmRule::from_name(rest)
            .map(|rule| Self { boxed, rule })
            .ok_or_else(|| Error::UnknownRmType {
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
    type Err = Error;
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
            if python::truthy(v) =>
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rm_type_names_round_trip() {
        for rule in RmRule::all() {
            for boxed in [false, true] {
                let t = RmType { boxed, rule };
                assert_eq!(RmType::from_rm_type(&t.to_string()), Ok(t));
                let json = serde_json::to_string(&t).unwrap();
                assert_eq!(serde_json::from_str::<RmType>(&json).unwrap(), t);
            }
            let json = serde_json::to_value(rule).unwrap();
            assert_eq!(json, Value::String(rule.name().into()));
        }
        let math = RmRule::from_name("math").unwrap();
        assert_eq!(
            RmType::from_rm_type(" boxed_math\n"),
            Ok(RmType {
                boxed: true,
                rule: math
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
    fn the_registry_builds_the_rule_list_parsing_and_error() {
        let names: Vec<&str> = RmRule::all().map(RmRule::name).collect();
        assert_eq!(
            names,
            [
                "remote_rm",
                "deepscaler",
                "gemma_math",
                "dapo",
                "math",
                "f1",
                "gpqa",
                "random",
                "deterministic_random"
            ]
        );
        let err = RmType::from_rm_type(" nope ").unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown rm_type \"nope\": expected one of remote_rm, deepscaler, gemma_math, dapo, \
             math, f1, gpqa, random, deterministic_random, optionally prefixed with boxed_"
        );
        assert_eq!(
            RmType::from_rm_type("boxed_ifbench")
                .unwrap_err()
                .to_string(),
            "unknown rm_type \"boxed_ifbench\": expected one of remote_rm, deepscaler, gemma_math, \
             dapo, math, f1, gpqa, random, deterministic_random, optionally prefixed with boxed_ \
             (ifbench is not implemented in miles-rs)"
        );
        for rule in RmRule::all() {
            assert!(!rule.description().is_empty(), "{rule}");
            assert_eq!(rule.name().parse::<RmRule>(), Ok(rule));
        }
        assert!("boxed_math".parse::<RmRule>().is_err());
    }
}
