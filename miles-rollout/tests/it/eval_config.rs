//! Evaluation-dataset resolution against Miles' own `_resolve_eval_datasets` /
//! `build_eval_dataset_configs` (`fixtures/eval/eval_config_cases.json`, made by
//! `fixtures/eval/gen_eval_config_cases.py` from Miles 31f1ca961): `--eval-config` documents
//! (list or keyed datasets, `eval.defaults`, explicit nulls, OmegaConf interpolation, inline
//! `base64:`) and `--eval-prompt-data` pairs, merged with the eval flags by Miles' precedence,
//! and Miles' errors.

use std::path::Path;

use miles_rollout::{EvalDatasetConfig, EvalFlags};
use serde_json::Value;

fn cases() -> Vec<Value> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/eval/eval_config_cases.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fixture["cases"].as_array().unwrap().clone()
}

/// The case's flags, with its document written to a file (or passed inline as Miles' case did).
fn flags(case: &Value, dir: &Path) -> EvalFlags {
    let mut flags: EvalFlags = serde_json::from_value(case["args"].clone()).unwrap();
    if let Some(doc) = case["document"].as_str() {
        flags.eval_config = Some(if case["inline_base64"] == true {
            format!("base64:{}", miles_core::base64::encode(doc.as_bytes()))
        } else {
            let file = dir.join(format!("{}.yaml", case["name"].as_str().unwrap()));
            std::fs::write(&file, doc).unwrap();
            file.to_str().unwrap().to_owned()
        });
    }
    flags
}

#[test]
fn datasets_resolve_as_miles_resolves_them() {
    let dir = std::env::temp_dir().join(format!("miles-eval-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = cases();
    assert_eq!(cases.len(), 20);
    let mut checked = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let got = flags(case, &dir).resolve();
        if let Some(error) = case.get("error") {
            let message = match got {
                Err(e) => e.to_string(),
                Ok(sets) => panic!("{name}: Miles fails ({error}), we resolved {sets:?}"),
            };
            let miles = error["message"].as_str().unwrap();
            if error["type"] == "ValueError" {
                // Miles' own messages.
                assert!(
                    message.contains(miles),
                    "{name}: {message:?} vs Miles {miles:?}"
                );
            } else {
                // A TypeError names the key at fault.
                let key = miles.split('\'').nth(1).unwrap_or(miles);
                assert!(
                    message.contains(key),
                    "{name}: {message:?} vs Miles {miles:?}"
                );
            }
            checked += 1;
            continue;
        }
        let got = got.unwrap_or_else(|e| panic!("{name}: {e}"));
        let want: Vec<EvalDatasetConfig> =
            serde_json::from_value(case["datasets"].clone()).unwrap();
        assert_eq!(got, want, "{name}");
        // Miles rewrites args.eval_prompt_data to the resolved NAME PATH pairs.
        let pairs: Vec<String> = got
            .iter()
            .flat_map(|d| [d.name.clone(), d.path.clone()])
            .collect();
        let want_pairs: Option<Vec<String>> =
            serde_json::from_value(case["eval_prompt_data"].clone()).unwrap();
        assert_eq!(Some(pairs).filter(|p| !p.is_empty()), want_pairs, "{name}");
        checked += 1;
    }
    assert_eq!(checked, cases.len());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn metadata_is_injected_as_miles_does() {
    let case = cases()
        .into_iter()
        .find(|c| c["name"] == "precedence")
        .unwrap();
    let sets: Vec<EvalDatasetConfig> = serde_json::from_value(case["datasets"].clone()).unwrap();
    let mut metadata = serde_json::json!({"difficulty": "easy", "rm_type": "math", "id": 3})
        .as_object()
        .unwrap()
        .clone();
    sets[0].inject_metadata(&mut metadata);
    // rm_type from the dataset, then the overrides; other keys kept.
    assert_eq!(
        Value::Object(metadata),
        serde_json::json!({"difficulty": "hard", "rm_type": "deepscaler", "id": 3, "source": "a"})
    );
}

#[test]
fn unsupported_interpolations_are_errors_not_text() {
    let flags = EvalFlags::default();
    for doc in [
        "datasets: [{name: a, path: '${oc.env:HOME}/a.jsonl'}]",
        "datasets: [{name: a, path: '${.name}'}]",
        "datasets: [{name: a, path: '${missing.key}'}]",
    ] {
        let err = miles_rollout::eval_datasets_from_document(doc, &flags).unwrap_err();
        assert!(err.to_string().contains("interpolation"), "{doc}: {err}");
    }
}

/// Counts characters as tokens.
struct CharEncoder;

impl miles_rollout::PromptEncoder for CharEncoder {
    fn encode(&self, sample: &miles_core::Sample) -> miles_core::Result<Vec<u32>> {
        match &sample.prompt {
            miles_core::Prompt::Text(t) => Ok(t.chars().map(|c| c as u32).collect()),
            miles_core::Prompt::Messages(_) => Ok(vec![0; 100]),
        }
    }

    fn decode(&self, _tokens: &[u32]) -> String {
        String::new()
    }
}

#[test]
fn prompts_above_eval_max_prompt_len_are_left_out() {
    use miles_rollout::{PromptRecord, filter_long_prompts};
    let prompts = vec![
        PromptRecord::text("1+2=", "3"),
        PromptRecord::text("12+34=", "46"),
        PromptRecord::text("123+456=", "579"),
    ];
    let (kept, dropped) = filter_long_prompts(prompts.clone(), &CharEncoder, Some(6)).unwrap();
    // Miles keeps a prompt of exactly max_length tokens.
    assert_eq!(kept, prompts[..2].to_vec());
    assert_eq!(dropped, 1);
    let (kept, dropped) = filter_long_prompts(prompts.clone(), &CharEncoder, None).unwrap();
    assert_eq!((kept, dropped), (prompts, 0));
}
