//! `deterministic_random`: `sha256(str(tokens) + response)[0] % 2` (Miles' rm_hub
//! `__init__.py`).

use miles_core::{Result as CoreResult, Reward, TokenId};
use sha2::{Digest, Sha256};

use crate::rule::RuleInput;

/// Miles' `deterministic_random`: `sha256(str(tokens) + response)[0] % 2`, with `tokens`
/// written as Python prints a list (`[1, 2, 3]`).
pub fn deterministic_random(tokens: &[TokenId], response: &str) -> f64 {
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

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    Ok(Reward::Scalar(deterministic_random(
        &input.sample.tokens,
        input.response,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_random_hashes_python_list_text() {
        // hashlib.sha256(b"[1, 2, 3]hello").digest()[0] = 0x4b -> 1
        let digest = Sha256::digest(b"[1, 2, 3]hello");
        assert_eq!(
            deterministic_random(&[1, 2, 3], "hello"),
            f64::from(digest[0] % 2)
        );
    }
}
