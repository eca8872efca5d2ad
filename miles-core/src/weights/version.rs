//! [`WeightVersion`]: the version of the policy weights an output was generated with.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// A monotonically increasing version of the policy weights.
///
/// Trainers bump it at every weight export; engines stamp every output with the version it was
/// generated with. On the SGLang wire it is a string (`"7"`); it deserialises from a string or
/// a number and serialises as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WeightVersion(pub u64);

impl WeightVersion {
    /// The next version.
    pub fn next(self) -> Self {
        Self(self.0 + 1)
    }

    /// How many versions `self` is behind `current` (0 if not behind).
    pub fn staleness(self, current: WeightVersion) -> u64 {
        current.0.saturating_sub(self.0)
    }
}

impl fmt::Display for WeightVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for WeightVersion {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        s.trim().parse::<u64>().map(Self).map_err(|_| Error::Parse {
            what: "weight version",
            input: s.to_owned(),
        })
    }
}

impl Serialize for WeightVersion {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for WeightVersion {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(s) => s.parse().map_err(serde::de::Error::custom),
            Value::Number(n) => n
                .as_u64()
                .map(Self)
                .ok_or_else(|| serde::de::Error::custom(format!("invalid weight version {n}"))),
            other => Err(serde::de::Error::custom(format!(
                "invalid weight version {other}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_version_wire_form() {
        let v: WeightVersion = serde_json::from_str("\"12\"").unwrap();
        assert_eq!(v, WeightVersion(12));
        let n: WeightVersion = serde_json::from_str("3").unwrap();
        assert_eq!(n.next(), WeightVersion(4));
        assert_eq!(serde_json::to_string(&v).unwrap(), "\"12\"");
        assert!(serde_json::from_str::<WeightVersion>("\"default\"").is_err());
        assert_eq!(WeightVersion(3).staleness(WeightVersion(5)), 2);
        assert_eq!(WeightVersion(6).staleness(WeightVersion(5)), 0);
    }
}
