//! On-policy distillation at rollout against Miles' own functions: the cases of
//! `fixtures/opd/opd_cases.json` (made by `fixtures/opd/gen_opd_cases.py`, which runs Miles'
//! `rollout/on_policy_distillation.py`), and a teacher on loopback speaking SGLang's
//! `/generate` scoring protocol.

use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use miles_core::Sample;
use miles_rollout::opd::{
    OpdTeacher, OpdTeacherConfig, RewardWeightMode, TopKStrategy, parse_teacher_urls,
    teacher_sampled_log_probs, topk_reverse_kl,
};
use serde_json::{Value, json};

fn cases() -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fixtures/opd/opd_cases.json"
        ))
        .unwrap(),
    )
    .unwrap()
}

fn f64s(v: &Value) -> Vec<f64> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Miles stores the estimate in float32; ours is computed in f64 and rounded to f32.
fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}: {got:?} vs {want:?}"
        );
    }
}

fn sample(case: &Value) -> Sample {
    let mut s = Sample {
        tokens: vec![1, 2, 1, 4, 9],
        response_length: case["response_length"].as_u64().unwrap() as usize,
        ..Sample::default()
    };
    if let Some(top) = case.get("student_top").filter(|v| !v.is_null()) {
        s.metadata
            .insert("opd_student_top_logprobs".into(), top.clone());
    }
    s
}

#[test]
fn topk_reverse_kl_matches_miles_for_every_strategy_and_weight_mode() {
    let cases = cases();
    let cases = cases["topk"].as_array().unwrap();
    assert_eq!(cases.len(), 16);
    for case in cases {
        let strategy: TopKStrategy = case["strategy"].as_str().unwrap().parse().unwrap();
        let mode: RewardWeightMode = case["weight_mode"].as_str().unwrap().parse().unwrap();
        let top = case["student_top"].as_array().map(Vec::as_slice);
        let got = topk_reverse_kl(
            strategy,
            mode,
            3,
            top,
            &case["teacher"],
            Some(&case["student_on_teacher"]),
        );
        match case.get("error") {
            Some(e) => assert_eq!(
                got.unwrap_err().to_string(),
                format!("on-policy distillation: {}", e.as_str().unwrap())
            ),
            None => assert_close(
                &got.unwrap(),
                &f64s(&case["expected"]),
                &case["strategy"].to_string(),
            ),
        }
    }
}

#[test]
fn sampled_teacher_log_probs_skip_the_placeholder_and_keep_the_response() {
    let cases = cases();
    let case = &cases["sampled"][0];
    let got = teacher_sampled_log_probs(&case["teacher"], 3).unwrap();
    assert_close(&got, &f64s(&case["expected"]), "sampled");
    assert!(teacher_sampled_log_probs(&json!({}), 3).is_err());
    assert!(
        teacher_sampled_log_probs(&json!({"input_token_logprobs": [[null, 1], [-1.0, 2]]}), 3)
            .is_err()
    );
}

#[test]
fn teacher_routing_and_url_parsing_match_miles() {
    let cases = cases();
    for case in cases["routing"].as_array().unwrap() {
        let urls: Vec<String> = serde_json::from_value(case["urls"].clone()).unwrap_or_default();
        let config = OpdTeacherConfig {
            teacher_urls: parse_teacher_urls(&urls).unwrap(),
            teacher_key: case["key"].as_str().unwrap().into(),
            rm_url: case["rm_url"].as_str().map(String::from),
            ..OpdTeacherConfig::default()
        };
        let s = Sample {
            metadata: case["metadata"].as_object().unwrap().clone(),
            ..Sample::default()
        };
        match case.get("error") {
            Some(e) => assert_eq!(
                config.teacher_url_for(&s).unwrap_err().to_string(),
                format!("invalid rollout config: {}", e.as_str().unwrap()),
                "{case}"
            ),
            None => assert_eq!(
                config.teacher_url_for(&s).unwrap(),
                case["expected"],
                "{case}"
            ),
        }
    }
    for case in cases["parse"].as_array().unwrap() {
        let values: Vec<String> = serde_json::from_value(case["values"].clone()).unwrap();
        match case.get("error") {
            Some(e) => assert_eq!(
                parse_teacher_urls(&values).unwrap_err().to_string(),
                format!("invalid rollout config: {}", e.as_str().unwrap())
            ),
            None => assert_eq!(
                serde_json::to_value(parse_teacher_urls(&values).unwrap()).unwrap(),
                case["expected"]
            ),
        }
    }
}

/// A teacher (and student) on loopback: records every body, answers with the fixture's
/// `meta_info` (the student URL with the student's scoring of the teacher's ids).
async fn serve(teacher: Value, student: Value) -> (String, Arc<Mutex<Vec<(String, Value)>>>) {
    type Seen = Arc<Mutex<Vec<(String, Value)>>>;
    let seen: Seen = Arc::default();
    async fn answer(
        State((who, meta, seen)): State<(String, Value, Seen)>,
        Json(body): Json<Value>,
    ) -> Json<Value> {
        seen.lock().unwrap().push((who, body));
        Json(json!({"text": "", "output_ids": [], "meta_info": meta}))
    }
    let app = axum::Router::new()
        .route(
            "/teacher/generate",
            post(answer).with_state(("teacher".to_string(), teacher, seen.clone())),
        )
        .route(
            "/student/generate",
            post(answer).with_state(("student".to_string(), student, seen.clone())),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

/// Miles' `reward_func` + `post_process_rewards` over HTTP: the bodies sent to the teacher and
/// the student equal Miles' for each strategy, with and without `--opd-topk-per-position`
/// (`token_ids_logprob_positions`), and the sample gets Miles' values.
#[tokio::test]
async fn teacher_scoring_over_http_sends_miles_bodies_and_fills_the_sample() {
    let cases = cases();
    let teacher_meta = cases["sampled"][0]["teacher"].clone();
    let student_meta = cases["topk"][0]["student_on_teacher"].clone();
    let (url, seen) = serve(teacher_meta, student_meta).await;
    for case in cases["payload"].as_array().unwrap() {
        seen.lock().unwrap().clear();
        let strategy: TopKStrategy = case["strategy"].as_str().unwrap().parse().unwrap();
        let top_k = case["top_k"].as_u64().unwrap() as usize;
        let per_position = case["per_position"].as_bool().unwrap();
        let teacher = OpdTeacher::new(OpdTeacherConfig {
            top_k,
            strategy,
            per_position,
            rm_url: Some(format!("{url}/teacher/generate")),
            student_url: Some(format!("{url}/student/generate")),
            ..OpdTeacherConfig::default()
        });
        let mut s = sample(case);
        teacher.score(&mut s).await.unwrap();
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen[0],
            ("teacher".to_string(), case["expected_teacher"].clone()),
            "{strategy:?}, per position {per_position}"
        );
        match case["expected_student"].is_null() {
            true => assert_eq!(seen.len(), 1),
            false => assert_eq!(
                seen[1],
                ("student".to_string(), case["expected_student"].clone())
            ),
        }
        if top_k == 0 {
            assert_close(
                s.teacher_log_probs.as_deref().unwrap(),
                &f64s(&cases["sampled"][0]["expected"]),
                "sampled",
            );
            assert!(s.opd_reverse_kl.is_none());
        } else {
            let want = cases["topk"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["strategy"] == case["strategy"] && c["weight_mode"] == "student_p")
                .unwrap();
            assert_close(
                s.opd_reverse_kl.as_deref().unwrap(),
                &f64s(&want["expected"]),
                "topk",
            );
        }
    }
    // A teacher that cannot be reached fails the sample (Miles: the reward function raised).
    let teacher = OpdTeacher::new(OpdTeacherConfig {
        rm_url: Some("http://127.0.0.1:9/generate".into()),
        ..OpdTeacherConfig::default()
    });
    let mut batch = vec![sample(&cases["payload"][0])];
    teacher.score_all(&mut batch).await;
    assert_eq!(batch[0].status, miles_core::SampleStatus::Failed);
    assert_eq!(batch[0].metadata["failure_kind"], "reward");
}
