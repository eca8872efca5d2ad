//! [`SplitMix64`]: the one small seeded generator of the workspace (data shuffling, the
//! `random` reward rule, the examples' task generators and test data).

/// Sebastiano Vigna's SplitMix64 (`splitmix64.c`): 64 bits of state advanced by the golden
/// gamma `0x9E3779B97F4A7C15`, each output mixed with Stafford's variant-13 finaliser. Tiny,
/// fast, and the same stream for the same seed on every platform. Not cryptographic.
///
/// The state is the seed itself (the first output mixes `seed + gamma`), as in the reference
/// implementation.
///
/// ```
/// use miles_core::rng::SplitMix64;
///
/// let mut rng = SplitMix64::new(1234567);
/// assert_eq!(rng.next_u64(), 6457827717110365317);
/// let unit = rng.next_f64();
/// assert!((0.0..1.0).contains(&unit));
/// assert!((10..=99).contains(&rng.range_inclusive(10, 99)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// The golden gamma the state advances by.
    const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

    /// A generator seeded by `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(Self::GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` from the top 53 bits of [`next_u64`](Self::next_u64).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, 1)` from the top 24 bits of [`next_u64`](Self::next_u64).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in `lo..=hi`, without modulo bias: draws below the largest multiple of the
    /// span are kept, the rest redrawn. Bounds given the wrong way round are swapped; the full
    /// `0..=u64::MAX` range is one draw.
    pub fn range_inclusive(&mut self, lo: u64, hi: u64) -> u64 {
        let (lo, hi) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        let Some(span) = (hi - lo).checked_add(1) else {
            return self.next_u64();
        };
        let zone = u64::MAX - u64::MAX % span;
        loop {
            let x = self.next_u64();
            if x < zone {
                return lo + x % span;
            }
        }
    }

    /// Uniform in `0..n` by Lemire's multiply-shift (`(x · n) >> 64`): one draw each, a bias
    /// below `n / 2^64`. A different stream from [`range_inclusive`](Self::range_inclusive),
    /// kept for the data shuffles seeded with it. `n = 0` gives 0.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference outputs from an independent Python implementation:
    ///
    /// ```text
    /// M = (1 << 64) - 1
    /// class SM:
    ///     def __init__(s, seed): s.x = seed & M
    ///     def next(s):
    ///         s.x = (s.x + 0x9E3779B97F4A7C15) & M
    ///         z = s.x
    ///         z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    ///         z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    ///         return z ^ (z >> 31)
    ///     def f64(s): return (s.next() >> 11) / (1 << 53)
    ///     def f32(s): return (s.next() >> 40) / (1 << 24)
    ///     def rng(s, lo, hi):
    ///         span = hi - lo + 1; zone = M - (M % span)
    ///         while True:
    ///             x = s.next()
    ///             if x < zone: return lo + x % span
    ///     def below(s, n): return (s.next() * n) >> 64
    /// ```
    #[test]
    fn matches_the_reference_streams() {
        // for seed in seeds: r = SM(seed); print([r.next() for _ in range(4)])
        let cases: [(u64, [u64; 4]); 5] = [
            (
                0,
                [
                    16294208416658607535,
                    7960286522194355700,
                    487617019471545679,
                    17909611376780542444,
                ],
            ),
            (
                1234567,
                [
                    6457827717110365317,
                    3203168211198807973,
                    9817491932198370423,
                    4593380528125082431,
                ],
            ),
            (
                0x5EED,
                [
                    716632666546416052,
                    6139096880363046005,
                    6727192872932819891,
                    8129731167615341197,
                ],
            ),
            (
                0x9E37_79B9_7F4A_7C15,
                [
                    7960286522194355700,
                    487617019471545679,
                    17909611376780542444,
                    1961750202426094747,
                ],
            ),
            (
                u64::MAX,
                [
                    16490336266968443936,
                    16834447057089888969,
                    4048727598324417001,
                    7862637804313477842,
                ],
            ),
        ];
        for (seed, expected) in cases {
            let mut rng = SplitMix64::new(seed);
            let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
            assert_eq!(got, expected, "seed {seed:#x}");
        }
    }

    #[test]
    fn splitmix_matches_the_reference_sequence() {
        // SplitMix64 with seed 1234567 (Vigna's reference implementation, splitmix64.c).
        let mut rng = SplitMix64::new(1234567);
        assert_eq!(rng.next_u64(), 6457827717110365317);
        assert_eq!(rng.next_u64(), 3203168211198807973);
        assert_eq!(rng.next_u64(), 9817491932198370423);
    }

    #[test]
    fn derived_draws_match_the_reference() {
        // r = SM(42); print([repr(r.f64()) for _ in range(3)])
        let mut rng = SplitMix64::new(42);
        let f64s: Vec<f64> = (0..3).map(|_| rng.next_f64()).collect();
        assert_eq!(
            f64s,
            [0.7415648787718233, 0.1599103928769201, 0.27860113025513866]
        );
        // r = SM(42); print([repr(r.f32()) for _ in range(3)])
        let mut rng = SplitMix64::new(42);
        let f32s: Vec<f64> = (0..3).map(|_| f64::from(rng.next_f32())).collect();
        assert_eq!(
            f32s,
            [0.7415648698806763, 0.1599103808403015, 0.27860110998153687]
        );
        // r = SM(7); print([r.rng(10, 99) for _ in range(8)])
        let mut rng = SplitMix64::new(7);
        let ranged: Vec<u64> = (0..8).map(|_| rng.range_inclusive(10, 99)).collect();
        assert_eq!(ranged, [67, 34, 46, 43, 44, 85, 98, 22]);
        // r = SM(7); print([r.below(7) for _ in range(8)])
        let mut rng = SplitMix64::new(7);
        let below: Vec<usize> = (0..8).map(|_| rng.below(7)).collect();
        assert_eq!(below, [2, 0, 6, 4, 3, 1, 3, 2]);
        // r = SM(7); print([r.next() >> 63 for _ in range(8)])
        let mut rng = SplitMix64::new(7);
        let bits: Vec<u64> = (0..8).map(|_| rng.next_u64() >> 63).collect();
        assert_eq!(bits, [0, 0, 1, 1, 0, 0, 0, 0]);
    }

    #[test]
    fn edge_ranges_do_not_panic() {
        let mut rng = SplitMix64::new(1);
        assert_eq!(rng.range_inclusive(5, 5), 5);
        assert!((3..=9).contains(&rng.range_inclusive(9, 3)));
        let mut a = SplitMix64::new(1);
        let mut b = SplitMix64::new(1);
        assert_eq!(a.range_inclusive(0, u64::MAX), b.next_u64());
        assert_eq!(rng.below(0), 0);
    }
}
