//! Miles' rm_hub rules against Miles' own Python: every case of
//! `fixtures/rewards/rm_hub_cases.jsonl` (scored by `gen_rm_hub_cases.py` with the rm_hub
//! modules of radixark/miles 31f1ca961a94) must give Miles' value, except the listed known
//! differences (each with its reason; COMPATIBILITY.md repeats them).

use std::collections::BTreeMap;

use miles_core::{Reward, RewardFn, Sample};
use miles_reward::{RmHubReward, RmRule, RmType};
use proptest::prelude::*;
use serde_json::{Map, Value};

const CASES: &str = include_str!("../../../fixtures/rewards/rm_hub_cases.jsonl");

/// Cases where miles-rs knowingly differs from Miles: id → reason.
const KNOWN_DIFFERENCES: &[(u64, &str)] = &[(
    268,
    "0.1x+0.2x vs 0.3x: sympy collects the float coefficients (0.1+0.2 != 0.3 in binary), the \
     numeric check sees a difference of 1e-17 relative and calls it equal",
)];

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

fn sample(
    response: &str,
    label: Option<&str>,
    metadata: Map<String, Value>,
    tokens: Vec<u32>,
) -> Sample {
    Sample {
        response: response.to_owned(),
        label: label.map(str::to_owned),
        metadata,
        tokens,
        ..Sample::default()
    }
}

/// Whether our result equals Miles' expected `{"value": …}` / `{"error": …}`.
fn agrees(got: &miles_core::Result<Reward>, expected: &Value) -> bool {
    match (got, expected.get("value")) {
        (Err(_), None) => expected.get("error").is_some(),
        (Ok(Reward::Scalar(v)), Some(Value::Number(n))) => {
            n.as_f64().is_some_and(|want| (v - want).abs() <= 1e-12)
        }
        (Ok(Reward::Map(map)), Some(Value::Object(want))) => {
            map.get("score").and_then(Value::as_f64) == want.get("score").and_then(Value::as_f64)
                && map.get("acc") == want.get("acc")
                && map.get("pred") == want.get("pred")
        }
        _ => false,
    }
}

#[test]
fn every_case_scores_as_miles() {
    let mut total = 0usize;
    let mut disagreements = BTreeMap::new();
    for line in CASES.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).expect("fixture line is JSON");
        let id = case["id"].as_u64().expect("id");
        let rm_type = case["rm_type"].as_str();
        let global = match rm_type.map(RmType::from_rm_type) {
            Some(Ok(t)) => Some(t),
            _ => None,
        };
        let metadata = case["metadata"].as_object().cloned().unwrap_or_default();
        let tokens = case["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        let s = sample(
            case["response"].as_str().expect("response"),
            case["label"].as_str(),
            metadata,
            tokens,
        );
        let got = match (rm_type, global) {
            // A global rm_type that does not parse: Miles raises unless metadata names one.
            (Some(name), None) if !name.trim().is_empty() => {
                match s
                    .metadata
                    .get("rm_type")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                {
                    Some(_) => block_on(RmHubReward::new(None).reward(&s)),
                    None => Err(miles_core::Error::Reward(format!("unknown rm_type {name}"))),
                }
            }
            _ => block_on(RmHubReward::new(global).reward(&s)),
        };
        total += 1;
        if !agrees(&got, &case["expected"]) {
            disagreements.insert(id, format!("{case} -> got {got:?}"));
        }
    }
    let known: BTreeMap<u64, &str> = KNOWN_DIFFERENCES.iter().copied().collect();
    let unexpected: Vec<&String> = disagreements
        .iter()
        .filter(|(id, _)| !known.contains_key(id))
        .map(|(_, d)| d)
        .collect();
    let fixed: Vec<&u64> = known
        .keys()
        .filter(|id| !disagreements.contains_key(id))
        .collect();
    let agreement = 1.0 - disagreements.len() as f64 / total as f64;
    eprintln!(
        "rm_hub: {} of {total} cases agree with Miles ({:.1}%)",
        total - disagreements.len(),
        agreement * 100.0
    );
    assert!(total >= 300, "only {total} cases");
    assert!(
        unexpected.is_empty(),
        "{} unexpected disagreements:\n{}",
        unexpected.len(),
        unexpected
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        fixed.is_empty(),
        "known differences that now agree (remove them): {fixed:?}"
    );
    assert!(agreement >= 0.97, "agreement {agreement}");
}

fn all_rm_types() -> Vec<RmType> {
    RmRule::all()
        .filter(|r| r.name() != "remote_rm")
        .flat_map(|rule| [RmType { boxed: false, rule }, RmType { boxed: true, rule }])
        .collect()
}

fn score_all(response: &str, label: Option<&str>) {
    for rm_type in all_rm_types() {
        let s = sample(response, label, Map::new(), vec![1, 2]);
        // Any value or a typed error; never a panic.
        let _ = block_on(RmHubReward::new(Some(rm_type)).reward(&s));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn no_rule_panics_on_arbitrary_text(response in ".{0,200}", label in ".{0,40}") {
        score_all(&response, Some(&label));
        score_all(&response, None);
    }

    #[test]
    fn no_rule_panics_on_latex_like_text(
        response in r"[\\{}()\[\]^_$%,./=0-9a-zA-Z !|:\-]{0,120}",
        label in r"[\\{}()^0-9a-z.,/ -]{0,30}",
    ) {
        let boxed = format!("Answer: {response} \\boxed{{{response}}} </think>");
        score_all(&boxed, Some(&label));
        score_all(&response, Some(&label));
    }
}

/// 1 MB responses: every rule finishes promptly (linear regexes, bounded passes, the
/// equivalence check capped in length). A quadratic step would take minutes here.
#[test]
fn huge_responses_are_bounded() {
    let unit = r"\frac{1}{2} 1,000,000 the answer is B \boxed{x^2+1 Answer: 3 {{ \sqrt ";
    let big = unit.repeat(1_000_000 / unit.len());
    let commas = format!("\\boxed{{{}}}", "1,000".repeat(200_000));
    let braces = format!("\\boxed{{{}", "{".repeat(1_000_000));
    let started = std::time::Instant::now();
    for response in [&big, &commas, &braces] {
        score_all(response, Some("1,000"));
        score_all(response, Some(response));
    }
    // Generous bound for a shared 2-core machine; the point is "not quadratic".
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn metadata_rm_type_overrides_the_global_one() {
    let mut s = sample("the cat sat", Some("cat sat"), Map::new(), vec![]);
    let hub = RmHubReward::new(Some(RmType::from_rm_type("math").unwrap()));
    assert_eq!(block_on(hub.reward(&s)).unwrap(), Reward::Scalar(0.0));
    s.metadata.insert("rm_type".into(), " f1 ".into());
    assert_eq!(block_on(hub.reward(&s)).unwrap(), Reward::Scalar(1.0));
    s.metadata.insert("rm_type".into(), "".into());
    assert_eq!(block_on(hub.reward(&s)).unwrap(), Reward::Scalar(0.0));
    s.metadata.insert("rm_type".into(), "nope".into());
    assert!(block_on(hub.reward(&s)).is_err());
    s.metadata.insert("rm_type".into(), 3.into());
    assert!(block_on(hub.reward(&s)).is_err());
    s.metadata.remove("rm_type");
    assert!(block_on(RmHubReward::new(None).reward(&s)).is_err());
    // remote_rm without a reward model URL is a typed error, not a panic.
    s.metadata.insert("rm_type".into(), "remote_rm".into());
    assert!(block_on(hub.reward(&s)).is_err());
}

/// `remote_rm` reaches its reward model through the `RewardFn` seam: any implementation works.
#[test]
fn remote_rm_goes_through_the_reward_fn_seam() {
    struct Fixed;
    #[miles_core::async_trait]
    impl RewardFn for Fixed {
        async fn reward(&self, sample: &Sample) -> miles_core::Result<Reward> {
            Ok(Reward::Scalar(sample.response.len() as f64))
        }
    }
    let hub = RmHubReward::new(Some(RmType::from_rm_type("remote_rm").unwrap()))
        .with_remote(std::sync::Arc::new(Fixed));
    let s = sample("four", None, Map::new(), vec![]);
    assert_eq!(block_on(hub.reward(&s)).unwrap(), Reward::Scalar(4.0));
    // Without a reward model, remote_rm is a typed error.
    let bare = RmHubReward::new(Some(RmType::from_rm_type("remote_rm").unwrap()));
    assert!(block_on(bare.reward(&s)).is_err());
}
