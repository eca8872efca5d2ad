//! Miles' trailing-token-trim vectors (`fixtures/session/tito_trailing_trim_cases.json`) through
//! `compute_samples_from_records`, with records shaped exactly as the session server stores them.

use miles_core::{Sample, SampleStatus, TokenId};
use miles_session::assembly::compute_samples_from_records;
use miles_session::trajectory::SessionRecord;
use serde_json::{Value, json};

fn ids(v: &Value) -> Vec<TokenId> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as TokenId)
        .collect()
}

fn record(prompt: &[TokenId], output: &[TokenId]) -> SessionRecord {
    // Log-prob of the j-th output token: −(j+1)/10, so the kept prefix is checkable.
    let logprobs: Vec<Value> = output
        .iter()
        .enumerate()
        .map(|(j, id)| json!([-((j + 1) as f64) / 10.0, id, null]))
        .collect();
    // Built from the wire form, as GET /sessions/{id} returns it.
    let record: SessionRecord = serde_json::from_value(json!({
        "timestamp": 0.0,
        "request_timestamp": null,
        "method": "POST",
        "path": "/v1/chat/completions",
        "request": {"input_ids": prompt, "logprobs": true},
        "response": {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": ""},
            "meta_info": {"output_token_logprobs": logprobs, "completion_tokens": output.len(), "weight_version": "3"}}]},
        "status_code": 200
    }))
    .unwrap();
    assert_eq!(record.input_ids.as_deref(), Some(prompt));
    assert!(record.request.get("input_ids").is_none());
    assert_eq!(
        serde_json::to_value(&record).unwrap()["request"]["input_ids"],
        json!(prompt)
    );
    record
}

fn decode(ids: &[TokenId]) -> String {
    ids.iter().map(|i| format!("[{i}]")).collect()
}

#[test]
fn miles_trailing_trim_vectors_pass() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/session/tito_trailing_trim_cases.json"
    );
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = data["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 6);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let records: Vec<SessionRecord> = case["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| record(&ids(&r["prompt"]), &ids(&r["output"])))
            .collect();
        let accumulated = (!case["accumulated"].is_null()).then(|| ids(&case["accumulated"]));
        let max_trim = case["max_trim_tokens"].as_u64().unwrap() as usize;
        let result = compute_samples_from_records(
            &Sample::default(),
            &records,
            accumulated.as_deref(),
            max_trim,
            &decode,
        );
        if let Some(expected_error) = case.get("expected_error") {
            let err = result.expect_err(name).to_string();
            assert!(
                err.contains(expected_error.as_str().unwrap()),
                "{name}: {err}"
            );
            continue;
        }
        let samples = result.unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = case["expected"].as_array().unwrap();
        assert_eq!(samples.len(), expected.len(), "{name}");
        for (s, e) in samples.iter().zip(expected) {
            assert_eq!(s.tokens, ids(&e["tokens"]), "{name}");
            let len = e["response_length"].as_u64().unwrap() as usize;
            assert_eq!(s.response_length, len, "{name}");
            assert_eq!(s.loss_mask.as_deref(), Some(&vec![1u8; len][..]), "{name}");
            let lp: Vec<f64> = (0..len).map(|j| -((j + 1) as f64) / 10.0).collect();
            assert_eq!(s.rollout_log_probs.as_deref(), Some(&lp[..]), "{name}");
            assert_eq!(
                s.response,
                decode(&s.tokens[s.tokens.len() - len..]),
                "{name}"
            );
            assert_eq!(s.status, SampleStatus::Completed);
            assert_eq!(s.weight_versions, vec!["3".to_owned()]);
        }
    }
}
