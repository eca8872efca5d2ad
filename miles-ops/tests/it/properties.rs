//! Property tests of the invariants Miles' formulas guarantee.

use burn::tensor::{Device, Tensor};
use miles_ops::TisFunction;
use miles_ops::{AdvantageConfig, AdvantageEstimator, AdvantageSample, Grouping};
use miles_ops::{PolicyLossConfig, PolicyLossInput};
use proptest::prelude::*;

fn t2(values: &[f32], b: usize, t: usize, device: &Device) -> Tensor<2> {
    Tensor::<1>::from_floats(values, device).reshape([b, t])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// GRPO (with or without std normalisation) and GSPO advantages sum to zero per group.
    #[test]
    fn grpo_advantages_sum_to_zero_per_group(
        groups in prop::collection::vec(prop::collection::vec(-5.0f32..5.0, 4), 1..6),
        dr_grpo in any::<bool>(),
        gspo in any::<bool>(),
    ) {
        let estimator = if gspo { AdvantageEstimator::Gspo } else { AdvantageEstimator::Grpo };
        let calc = AdvantageConfig::default()
            .with_advantage_estimator(estimator)
            .with_n_samples_per_prompt(4)
            .with_disable_grpo_std_normalization(dr_grpo)
            .init()
            .unwrap();
        let rewards: Vec<f32> = groups.iter().flatten().copied().collect();
        let normalised = calc.normalize_rewards(&rewards, Grouping::FanOut, None).unwrap();
        let mask = [1.0f32, 1.0, 0.0];
        let samples: Vec<_> = normalised.iter().map(|&r| AdvantageSample::new(r, &mask)).collect();
        let out = calc.compute(&samples).unwrap();
        for g in 0..groups.len() {
            let sum: f64 = (0..4).map(|i| f64::from(out[g * 4 + i].advantages[0])).sum();
            prop_assert!(sum.abs() < 1e-4, "group {g} sums to {sum}");
            for i in 0..4 {
                prop_assert!(out[g * 4 + i].advantages.iter().all(|a| a.is_finite()));
            }
        }
    }

    /// TIS weights stay in [tis_clip_low, tis_clip]: the on-policy loss −A·w with A = 1 is
    /// bounded by the clip range, and tis_clipfrac is a fraction.
    #[test]
    fn tis_weights_within_bounds(
        diffs in prop::collection::vec(-30.0f32..30.0, 8),
        low in 0.0f32..0.9,
        high in 1.1f32..4.0,
    ) {
        let d = Device::flex();
        let lp = vec![-1.0f32; 8];
        let rollout: Vec<f32> = diffs.iter().map(|x| -1.0 - x).collect();
        let loss = PolicyLossConfig {
            use_tis: true,
            tis_clip_low: low,
            tis_clip: high,
            calculate_per_token_loss: true,
            ..Default::default()
        }
        .init()
        .unwrap();
        let out = loss
            .forward(
                PolicyLossInput::new(t2(&lp, 1, 8, &d), t2(&lp, 1, 8, &d), t2(&[1.0; 8], 1, 8, &d),
                    t2(&[1.0; 8], 1, 8, &d))
                    .with_rollout_log_probs(t2(&rollout, 1, 8, &d)),
            )
            .unwrap();
        let mean_w = -out.metrics.get("pg_loss").unwrap().clone().into_scalar::<f32>();
        prop_assert!(mean_w >= low - 1e-5 && mean_w <= high + 1e-5, "{mean_w} not in [{low}, {high}]");
        let frac = out.metrics.get("tis_clipfrac").unwrap().clone().into_scalar::<f32>();
        prop_assert!((0.0..=1.0).contains(&frac));
    }

    /// pg_clipfrac is a fraction for any ratios, advantages, masks and clip settings.
    #[test]
    fn clipfrac_in_unit_interval(
        new in prop::collection::vec(-5.0f32..0.0, 12),
        old in prop::collection::vec(-5.0f32..0.0, 12),
        adv in prop::collection::vec(-3.0f32..3.0, 12),
        mask in prop::collection::vec(prop::bool::ANY, 12),
        eps in 0.01f32..0.5,
        per_token in any::<bool>(),
    ) {
        let d = Device::flex();
        let mask: Vec<f32> = mask.iter().map(|&m| if m { 1.0 } else { 0.0 }).collect();
        let out = PolicyLossConfig { eps_clip: eps, calculate_per_token_loss: per_token, ..Default::default() }
            .init()
            .unwrap()
            .forward(PolicyLossInput::new(t2(&new, 3, 4, &d), t2(&old, 3, 4, &d), t2(&adv, 3, 4, &d), t2(&mask, 3, 4, &d)))
            .unwrap();
        let frac = out.metrics.get("pg_clipfrac").unwrap().clone().into_scalar::<f32>();
        prop_assert!((-1e-6..=1.0 + 1e-6).contains(&frac), "clipfrac {frac}");
    }

    /// Whatever sits at masked positions (including NaN and ±inf) never changes the loss.
    #[test]
    fn masked_tokens_never_change_the_loss(
        new in prop::collection::vec(-5.0f32..0.0, 8),
        old in prop::collection::vec(-5.0f32..0.0, 8),
        adv in prop::collection::vec(-3.0f32..3.0, 8),
        mask in prop::collection::vec(prop::bool::ANY, 8),
        junk in prop::collection::vec(prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY), -1e6f32..1e6], 8),
        gspo in any::<bool>(),
    ) {
        let d = Device::flex();
        let m: Vec<f32> = mask.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect();
        let poison = |v: &[f32]| -> Vec<f32> {
            v.iter().zip(&mask).zip(&junk).map(|((x, keep), j)| if *keep { *x } else { *j }).collect()
        };
        let loss = PolicyLossConfig {
            advantage_estimator: if gspo { AdvantageEstimator::Gspo } else { AdvantageEstimator::Grpo },
            use_tis: true,
            use_kl_loss: true,
            kl_loss_coef: 0.1,
            kl_loss_type: miles_ops::KlLossType::LowVarKl,
            tis_function: TisFunction::VanillaTis,
            ..Default::default()
        }
        .init()
        .unwrap();
        let run = |new: &[f32], old: &[f32], adv: &[f32]| {
            loss.forward(
                PolicyLossInput::new(t2(new, 2, 4, &d), t2(old, 2, 4, &d), t2(adv, 2, 4, &d), t2(&m, 2, 4, &d))
                    .with_rollout_log_probs(t2(old, 2, 4, &d))
                    .with_ref_log_probs(t2(old, 2, 4, &d)),
            )
            .unwrap()
            .loss
            .into_scalar::<f32>()
        };
        let clean = run(&new, &old, &adv);
        let dirty = run(&poison(&new), &poison(&old), &poison(&adv));
        prop_assert!(clean.is_finite());
        prop_assert!((clean - dirty).abs() <= 1e-6 * clean.abs().max(1.0), "{clean} vs {dirty}");
    }
}
