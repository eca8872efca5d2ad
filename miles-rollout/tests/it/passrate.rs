//! pass@k against Miles' own `compute_pass_rate` (`fixtures/metrics/passrate_cases.json`, made
//! by `fixtures/metrics/gen_passrate_cases.py` from Miles 31f1ca961), and the grouping of
//! samples by `group_index` with incomplete groups left out, as Miles'
//! `_compute_passrate_from_samples` does.

use std::path::Path;

use miles_core::{Prompt, Sample};
use miles_rollout::{RolloutConfig, pass_at_k, pass_rate, pass_rate_of_samples, passrate_metrics};
use serde_json::Value;

#[test]
fn pass_rate_equals_miles_on_every_case() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/metrics/passrate_cases.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 9);
    for case in cases {
        let rewards: Vec<f64> = serde_json::from_value(case["rewards"].clone()).unwrap();
        let group_size = case["group_size"].as_u64().unwrap() as usize;
        let want = case["pass_rate"].as_object().unwrap();
        let got = pass_rate(&rewards, group_size);
        let mut want_keys: Vec<&String> = want.keys().collect();
        want_keys.sort();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want_keys,
            "group size {group_size}"
        );
        for (k, v) in want {
            let v = v.as_f64().unwrap();
            assert!((got[k] - v).abs() <= 1e-12, "{k}: {} vs Miles {v}", got[k]);
        }
    }
}

#[test]
fn the_estimator_is_the_unbiased_one() {
    // 1 - C(n - c, k) / C(n, k): n = 8, c = 3, k = 2 → 1 - C(5, 2) / C(8, 2) = 1 - 10 / 28.
    assert!((pass_at_k(8, 3, 2) - (1.0 - 10.0 / 28.0)).abs() < 1e-15);
    assert_eq!(pass_at_k(8, 7, 2), 1.0);
    assert_eq!(pass_at_k(4, 0, 4), 0.0);
}

fn sample(group: u64, reward: f64) -> Sample {
    let mut s = Sample::builder(Prompt::Text("q".into())).build().unwrap();
    s.group_index = Some(group);
    s.reward = Some(reward.into());
    s
}

#[test]
fn samples_are_grouped_by_index_and_incomplete_groups_left_out() {
    // Group 7 (interleaved with group 2) is complete, group 9 lost a sample to a filter.
    let samples = vec![
        sample(7, 1.0),
        sample(2, 0.0),
        sample(7, 0.0),
        sample(2, 0.0),
        sample(9, 1.0),
    ];
    let got = pass_rate_of_samples(&samples, 2, None);
    // Groups 7 (1 of 2 correct) and 2 (0 of 2): pass@1 = (0.5 + 0) / 2, pass@2 = (1 + 0) / 2.
    assert_eq!(got["pass@1"], 0.25);
    assert_eq!(got["pass@2"], 0.5);
    assert!(pass_rate_of_samples(&samples, 1, None).is_empty());
}

#[test]
fn rollout_metrics_carry_passrate_only_when_asked() {
    // Groups of two: {1, 0} and {0, 0}, as a rollout's kept groups.
    let groups = vec![
        vec![sample(7, 1.0), sample(7, 0.0)],
        vec![sample(2, 0.0), sample(2, 0.0)],
    ];
    let mut config = RolloutConfig {
        n_samples_per_prompt: 2,
        ..RolloutConfig::default()
    };
    assert!(passrate_metrics(&config, &groups).is_empty());
    config.log_passrate = true;
    let got = passrate_metrics(&config, &groups);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got["passrate/pass@1"], 0.25);
    assert_eq!(got["passrate/pass@2"], 0.5);
}
