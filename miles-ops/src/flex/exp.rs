//! The polynomial `exp` of the flex row loops (softmax, SiLU, samplers' weights): Cephes'
//! polynomial after a base-2 range reduction, within 2 ulp of libm's, written without
//! branches or calls so that the loops calling it vectorise.

/// `exp(x)` for `x ≤ 0` (Cephes' polynomial after a base-2 range reduction, within 2 ulp),
/// written without branches or calls so that row loops vectorise.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // Written so that a NaN argument stays NaN (`f32::max` would replace it).
    let x = if x < -87.0 { -87.0 } else { x };
    let t = x * LOG2E + 0.5;
    let mut n = t as i32;
    n -= i32::from((n as f32) > t);
    let nf = n as f32;
    let g = x - nf * C1 - nf * C2;
    exp_reduced(g) * f32::from_bits(((n + 127) as u32) << 23)
}

/// `exp(g)` for `|g| ≤ ln 2 / 2` (the reduced argument): Cephes' polynomial.
#[inline(always)]
pub(crate) fn exp_reduced(g: f32) -> f32 {
    let z = g * g;
    (((((1.987_569_1e-4 * g + 1.398_199_9e-3) * g + 8.333_452e-3) * g + 4.166_579_6e-2) * g
        + 1.666_666_5e-1)
        * g
        + 0.5)
        * z
        + g
        + 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_on_the_softmax_range() {
        let mut worst = 0.0f32;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (ours, reference) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((ours - reference) / reference).abs());
        }
        assert!(worst < 4.0 * f32::EPSILON, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1.0e30) < 1.0e-37);
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }
}
