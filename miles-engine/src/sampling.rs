//! Token sampling (per-sequence seeded generators, temperature / top-k / top-p / min-p) and
//! the stop conditions checked after each sampled token.
//!
//! A row of logits costs two vectorised passes (`miles_ops::logprobs`: its maximum, then its
//! exponentials with their sums per block of 256, which give the log-sum-exp and, at
//! temperature 1, the draw's weights; another temperature recomputes the weights in a third
//! pass), so a draw skips whole blocks; greedy picks the first index of the maximum.
//! The exponentials are `f32` (within 2 ulp), the sums `f64` over `f32` lanes; the rows of a
//! decode step are sampled in parallel. Top-k / top-p / min-p sort the row.

use miles_core::rng::SplitMix64;

/// Samples one token from `logits` with the request's parameters; returns the token and its
/// log-prob under the untempered distribution.
pub(crate) fn sample_token(
    logits: &[f32],
    params: &miles_core::SamplingParams,
    rng: &mut SplitMix64,
) -> (u32, f64) {
    use miles_ops::logprobs::{log_sum_exp_of, row_max, tempered_weights};
    // f32 exponentials summed in f64: the log-sum-exp to a few f32 ulps, several times
    // faster than f64 exponentials over the whole vocabulary. The untempered weights are
    // also temperature 1's sampling weights (the rollout default), so that draw reuses them.
    let max = row_max(logits);
    let mut weights = Vec::new();
    let mut blocks = tempered_weights(logits, max, 1.0, &mut weights);
    let lse = log_sum_exp_of(max, &blocks);
    // A temperature so small that its inverse overflows `f32` is greedy (the tempered
    // weights would be `0 · ∞` at the maximum).
    let greedy = params.temperature <= 0.0
        || params.top_k == 1
        || !((1.0 / params.temperature as f64) as f32).is_finite();
    let token = if greedy {
        miles_ops::logprobs::first_index_of_max(logits, max)
    } else {
        let t = params.temperature as f64;
        let u = rng.next_f64();
        let plain = params.top_k < 1 && params.top_p >= 1.0 && params.min_p <= 0.0;
        if plain {
            let inv_temperature = (1.0 / t) as f32;
            if inv_temperature != 1.0 {
                blocks = tempered_weights(logits, max, inv_temperature, &mut weights);
            }
            pick_in_blocks(&weights, &blocks, u)
        } else {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            if params.top_k > 0 {
                order.truncate(params.top_k as usize);
            }
            let mut probs: Vec<f64> = order
                .iter()
                .map(|&i| ((logits[i] as f64 - max as f64) / t).exp())
                .collect();
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
            if params.min_p > 0.0 {
                let floor = params.min_p as f64 * probs[0];
                let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
                probs.truncate(keep);
            }
            if params.top_p < 1.0 {
                let total: f64 = probs.iter().sum();
                let mut cum = 0.0;
                let mut keep = probs.len();
                for (i, p) in probs.iter().enumerate() {
                    cum += p / total;
                    if cum >= params.top_p as f64 {
                        keep = i + 1;
                        break;
                    }
                }
                probs.truncate(keep.max(1));
            }
            pick(&probs, u, |i| order[i])
        }
    };
    (token as u32, logits[token] as f64 - lse)
}

/// Index drawn with probability proportional to `weights`, whose sums over consecutive
/// blocks of [`miles_ops::logprobs::WEIGHT_BLOCK`] are `blocks`: whole blocks are skipped by
/// their sums, then the block holding the draw is walked element by element (the same draw
/// as [`pick`] up to the rounding of the sums).
fn pick_in_blocks(weights: &[f32], blocks: &[f64], u: f64) -> usize {
    const BLOCK: usize = miles_ops::logprobs::WEIGHT_BLOCK;
    let total: f64 = blocks.iter().sum();
    let target = u * total;
    let mut cum = 0.0;
    for (b, &sum) in blocks.iter().enumerate() {
        if target >= cum + sum {
            cum += sum;
            continue;
        }
        let start = b * BLOCK;
        for (i, &w) in weights[start..].iter().enumerate() {
            cum += f64::from(w);
            if target < cum {
                return start + i;
            }
        }
        break;
    }
    weights.len().saturating_sub(1)
}

/// Index drawn with probability proportional to `weights`, mapped through `map`.
pub(crate) fn pick(weights: &[f64], u: f64, map: impl Fn(usize) -> usize) -> usize {
    let total: f64 = weights.iter().sum();
    let target = u * total;
    let mut cum = 0.0;
    for (i, w) in weights.iter().enumerate() {
        cum += w;
        if target < cum {
            return map(i);
        }
    }
    map(weights.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::SamplingParams;

    #[test]
    fn greedy_picks_the_argmax_and_reports_its_log_prob() {
        let logits = [0.0f32, 2.0, 1.0];
        let params = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let (tok, lp) = sample_token(&logits, &params, &mut SplitMix64::new(1));
        assert_eq!(tok, 1);
        let lse = (1.0f64 + 2f64.exp() + 1f64.exp()).ln();
        // f32 exponentials: the log-sum-exp to a few f32 ulps.
        assert!((lp - (2.0 - lse)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.5f32, -1.0, 3.0, 2.9];
        for params in [
            SamplingParams {
                top_k: 1,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 1e-6,
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 0.999,
                ..SamplingParams::default()
            },
        ] {
            for seed in 0..20 {
                assert_eq!(
                    sample_token(&logits, &params, &mut SplitMix64::new(seed)).0,
                    2
                );
            }
        }
    }

    #[test]
    fn top_k_restricts_the_support_and_sampling_follows_the_distribution() {
        let logits = [1.0f32, 0.0, 2.0, -5.0];
        let params = SamplingParams {
            top_k: 2,
            ..SamplingParams::default()
        };
        let mut rng = SplitMix64::new(42);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample_token(&logits, &params, &mut rng).0 as usize] += 1;
        }
        assert_eq!(counts[1] + counts[3], 0);
        // p(2) = e^2 / (e^2 + e^1) = 0.731.
        let p2 = counts[2] as f64 / 20_000.0;
        assert!((p2 - 0.7311).abs() < 0.015, "p2 = {p2}");
        // Plain sampling at temperature 0.5: p ∝ exp(2x).
        let params = SamplingParams {
            temperature: 0.5,
            ..SamplingParams::default()
        };
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample_token(&logits, &params, &mut rng).0 as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&x| (2.0 * x as f64).exp()).sum();
        let p0 = (2.0f64).exp() / z;
        assert!((counts[0] as f64 / 20_000.0 - p0).abs() < 0.015);
    }

    #[test]
    fn a_vanishing_temperature_samples_the_argmax() {
        let logits = [0.5f32, -1.0, 3.0, 2.9];
        for temperature in [1e-40f32, f32::MIN_POSITIVE, 1e-30] {
            let params = SamplingParams {
                temperature,
                ..SamplingParams::default()
            };
            for seed in 0..20 {
                assert_eq!(
                    sample_token(&logits, &params, &mut SplitMix64::new(seed)).0,
                    2
                );
            }
        }
    }

    #[test]
    fn drawing_by_blocks_is_drawing_by_elements() {
        // Three blocks and a partial one, some zero weights, a heavy element late.
        let mut weights: Vec<f32> = (0..900).map(|i| ((i * 37) % 11) as f32 * 0.125).collect();
        weights[850] = 40.0;
        let blocks: Vec<f64> = weights
            .chunks(miles_ops::logprobs::WEIGHT_BLOCK)
            .map(|b| b.iter().map(|&w| f64::from(w)).sum())
            .collect();
        assert_eq!(blocks.len(), 4);
        let wide: Vec<f64> = weights.iter().map(|&w| f64::from(w)).collect();
        let mut hits_850 = 0;
        for k in 0..2000 {
            let u = (k as f64 + 0.5) / 2000.0;
            let got = pick_in_blocks(&weights, &blocks, u);
            assert_eq!(got, pick(&wide, u, |i| i), "u = {u}");
            assert!(weights[got] > 0.0);
            hits_850 += usize::from(got == 850);
        }
        let total: f64 = wide.iter().sum();
        let expected = 2000.0 * 40.0 / total;
        assert!(
            (hits_850 as f64 - expected).abs() <= 1.0,
            "{hits_850} vs {expected}"
        );
        assert_eq!(pick_in_blocks(&weights, &blocks, 0.0), 1);
        assert_eq!(pick_in_blocks(&weights, &blocks, 1.0), 899);
        assert_eq!(pick_in_blocks(&[], &[], 0.5), 0);
    }

    #[test]
    fn seeded_generators_repeat() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        assert_eq!(
            (0..5).map(|_| a.next_u64()).collect::<Vec<_>>(),
            (0..5).map(|_| b.next_u64()).collect::<Vec<_>>()
        );
    }
}
