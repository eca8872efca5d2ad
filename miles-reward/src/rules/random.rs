//! `random`: 0 or 1 with probability ½ (Miles' `random.randint(0, 1)`). Miles draws from
//! Python's global Mersenne Twister; here each hub draws the top bit of its own SplitMix64
//! stream.

use std::sync::Mutex;

use miles_core::rng::SplitMix64;
use miles_core::{Result as CoreResult, Reward};

use crate::rule::RuleInput;

/// The next fair bit of the stream in `rng` (its top bit), as 0.0 or 1.0.
pub(crate) fn next_bit(rng: &Mutex<SplitMix64>) -> f64 {
    let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
    (rng.next_u64() >> 63) as f64
}

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    Ok(Reward::Scalar(next_bit(input.rng)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_is_a_fair_coin() {
        let rng = Mutex::new(SplitMix64::new(7));
        let ones: f64 = (0..10_000).map(|_| next_bit(&rng)).sum();
        assert!((4_800.0..5_200.0).contains(&ones), "{ones}");
    }
}
