//! `random`: 0 or 1 with probability ½ (Miles' `random.randint(0, 1)`). Miles draws from
//! Python's global Mersenne Twister; here each hub draws the top bit of its own SplitMix64
//! stream.

use std::sync::Mutex;

use miles_core::{Result as CoreResult, Reward};

use crate::rule::RuleInput;

/// The next fair bit of the SplitMix64 stream in `rng`, as 0.0 or 1.0.
pub(crate) fn next_bit(rng: &Mutex<u64>) -> f64 {
    let mut state = rng.lock().unwrap_or_else(|p| p.into_inner());
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 63) as f64
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
        let rng = Mutex::new(7);
        let ones: f64 = (0..10_000).map(|_| next_bit(&rng)).sum();
        assert!((4_800.0..5_200.0).contains(&ones), "{ones}");
    }
}
