//! Finite-difference checks of the policy-loss gradient on flex autodiff.

use burn::tensor::{Device, Tensor};
use miles_ops::AdvantageEstimator;
use miles_ops::KlLossType;
use miles_ops::{PolicyLossConfig, PolicyLossInput};

const B: usize = 2;
const T: usize = 4;
const OLD: [f32; 8] = [-1.0, -2.0, -0.5, -3.0, -1.2, -0.8, -2.2, -1.7];
const NEW: [f32; 8] = [-0.95, -2.4, -0.52, -2.0, -1.1, -0.85, -2.6, -9.0];
const ADV: [f32; 8] = [0.7, -1.3, 0.4, -0.6, 1.1, -0.2, 0.9, 5.0];
const MASK: [f32; 8] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0];
const REF: [f32; 8] = [-1.3, -1.9, -0.4, -2.5, -1.0, -1.0, -2.0, -1.0];
const ROLLOUT: [f32; 8] = [-1.1, -1.8, -0.5, -3.4, -1.3, -0.7, -2.2, -1.7];
const ENTROPY: [f32; 8] = [2.0, 1.5, 0.3, 0.9, 1.1, 2.2, 0.4, 0.0];

fn t2(v: &[f32], d: &Device) -> Tensor<2> {
    Tensor::<1>::from_floats(v, d).reshape([B, T])
}

fn input(lp: Tensor<2>, d: &Device) -> PolicyLossInput {
    PolicyLossInput::new(lp, t2(&OLD, d), t2(&ADV, d), t2(&MASK, d))
        .with_ref_log_probs(t2(&REF, d))
        .with_rollout_log_probs(t2(&ROLLOUT, d))
        .with_entropy(t2(&ENTROPY, d))
}

fn check(cfg: PolicyLossConfig) {
    let loss = cfg.init().unwrap();
    let value = |lp: &[f32]| -> f64 {
        let d = Device::flex();
        f64::from(
            loss.forward(input(t2(lp, &d), &d))
                .unwrap()
                .loss
                .into_scalar::<f32>(),
        )
    };
    let d = Device::flex().autodiff();
    let lp = t2(&NEW, &d).require_grad();
    let out = loss.forward(input(lp.clone(), &d)).unwrap();
    let grads = out.loss.backward();
    let g: Vec<f32> = lp
        .grad(&grads)
        .unwrap()
        .into_data()
        .try_to_vec::<f32>()
        .unwrap();
    let eps = 1e-3f32;
    for i in 0..B * T {
        let (mut p, mut m) = (NEW, NEW);
        p[i] += eps;
        m[i] -= eps;
        let fd = (value(&p) - value(&m)) / (2.0 * f64::from(eps));
        assert!(
            (fd - f64::from(g[i])).abs() < 2e-3,
            "token {i}: finite difference {fd} vs autodiff {}",
            g[i]
        );
    }
    // The masked token gets no gradient.
    assert_eq!(g[7], 0.0);
}

#[test]
fn ppo_clip_gradient() {
    check(PolicyLossConfig::default());
}

#[test]
fn dual_clip_asymmetric_with_kl_and_entropy_gradient() {
    check(PolicyLossConfig {
        eps_clip_high: Some(0.28),
        eps_clip_c: Some(3.0),
        use_kl_loss: true,
        kl_loss_coef: 0.3,
        kl_loss_type: KlLossType::LowVarKl,
        use_unbiased_kl: true,
        entropy_coef: 0.01,
        ..Default::default()
    });
}

#[test]
fn gspo_with_tis_gradient() {
    check(PolicyLossConfig {
        advantage_estimator: AdvantageEstimator::Gspo,
        use_tis: true,
        use_kl_loss: true,
        kl_loss_coef: 0.1,
        kl_loss_type: KlLossType::K2,
        calculate_per_token_loss: true,
        ..Default::default()
    });
}
