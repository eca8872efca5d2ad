//! The bearer API key shared by the servers' guard and the HTTP client.

use crate::error::{Error, Result};

/// The environment variable read by [`ApiKey::from_env`] (SGLang reads `--api-key` only; the
/// variable keeps the key out of `ps`).
pub const API_KEY_ENV: &str = "MILES_API_KEY";

/// A bearer API key. Its `Debug` output never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    /// A key: non-empty, printable ASCII without spaces (it travels in a header).
    pub fn new(key: impl Into<String>) -> Result<Self> {
        let key = key.into();
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::Config(
                "an API key must be non-empty printable ASCII without spaces".into(),
            ));
        }
        Ok(Self(key))
    }

    /// The key in [`API_KEY_ENV`], if set and non-empty.
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var(API_KEY_ENV) {
            Ok(v) if v.is_empty() => Ok(None),
            Ok(v) => Self::new(v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(Error::Config(format!("{API_KEY_ENV} is not valid UTF-8")))
            }
        }
    }

    /// The key itself (to send it).
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The `Authorization` header value, `Bearer <key>`.
    pub fn bearer(&self) -> String {
        format!("Bearer {}", self.0)
    }

    /// Whether an `Authorization` header value is `Bearer <this key>` (scheme
    /// case-insensitive), compared in constant time in the key's length.
    pub fn matches_authorization(&self, value: &[u8]) -> bool {
        let Some(token) = value
            .get(..7)
            .filter(|scheme| scheme.eq_ignore_ascii_case(b"bearer "))
            .and_then(|_| value.get(7..))
        else {
            return false;
        };
        constant_time_eq(token, self.0.as_bytes())
    }
}

/// Compares two byte strings in time that depends only on their lengths (not on where they
/// differ).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    // Walk the expected value's length whatever `a` is, so timing reveals nothing about it.
    for (i, &y) in b.iter().enumerate() {
        let x = a.get(i).copied().unwrap_or(!y);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}
