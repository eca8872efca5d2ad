//! Incremental tokenization equals the Python reference (`fixtures/tito/tito_reference.json`,
//! Miles' algorithm run on HF transformers by `fixtures/tito/gen_tito_reference.py`) id for id.

use std::collections::BTreeMap;
use std::path::PathBuf;

use miles_tito::{ChatTemplate, HfChat, TitoFamily, TitoTokenizer, Trajectory, parse_trajectories};
use serde_json::{Map, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

#[test]
fn merged_ids_equal_the_hf_reference() {
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tito/tito_reference.json")).unwrap(),
    )
    .unwrap();
    let trajectories: BTreeMap<String, Trajectory> = parse_trajectories(
        &std::fs::read_to_string(root().join("tito/verify_chat_template_trajectories.json"))
            .unwrap(),
    )
    .unwrap()
    .into_iter()
    .map(|t| (t.short_name.clone(), t))
    .collect();
    let mut checked = 0;
    let mut failures = Vec::new();
    for entry in data["families"].as_array().unwrap() {
        let family = TitoFamily::parse(entry["family"].as_str().unwrap()).unwrap();
        let chat = HfChat::load(
            root()
                .join("tokenizers")
                .join(entry["model_dir"].as_str().unwrap()),
        )
        .unwrap();
        let source = std::fs::read_to_string(
            root()
                .join("tokenizers")
                .join(entry["template_file"].as_str().unwrap()),
        )
        .unwrap();
        let template = ChatTemplate::new(source)
            .unwrap()
            .with_special_tokens(chat.special_tokens().clone());
        let base = TitoTokenizer::with_template(&chat, template, family, Map::new()).unwrap();
        for case in entry["cases"].as_array().unwrap() {
            let traj = &trajectories[case["trajectory"].as_str().unwrap()];
            let (n, m) = (
                case["n"].as_u64().unwrap() as usize,
                case["m"].as_u64().unwrap() as usize,
            );
            let tito = base
                .clone_with_chat_template_kwargs(case["kwargs"].as_object().unwrap())
                .unwrap();
            let tools: Option<Vec<Value>> =
                traj.tools.as_ref().map(|t| miles_tito::tools_to_json(t));
            let result = (|| {
                let mut prefix =
                    tito.encode(&tito.render(&traj.messages[..n], tools.as_deref(), false)?)?;
                while prefix
                    .last()
                    .is_some_and(|id| tito.trailing_token_ids().contains(id))
                {
                    prefix.pop();
                }
                let merged = tito.merge_tokens(
                    &traj.messages[..n],
                    &traj.messages[..m],
                    &prefix,
                    tools.as_deref(),
                )?;
                let standard = tito.render(&traj.messages[..m], tools.as_deref(), true)?;
                Ok::<_, miles_tito::Error>((tito.decode(&merged)? == standard, merged))
            })();
            checked += 1;
            let label = format!(
                "{family} {} {} N={n}",
                entry["template_file"], case["kwargs"]
            );
            match (result, case.get("error")) {
                (Err(_), Some(_)) => {}
                (Ok(_), Some(e)) => {
                    failures.push(format!("{label}: reference raised {e}, we succeeded"))
                }
                (Err(e), None) => failures.push(format!("{label}: we failed: {e}")),
                (Ok((matches, merged)), None) => {
                    let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
                    if merged != want {
                        failures.push(format!("{label}: ids differ"));
                    }
                    if Value::Bool(matches) != case["matches_standard"] {
                        failures.push(format!("{label}: matches_standard differs"));
                    }
                }
            }
        }
    }
    for f in &failures {
        println!("FAIL {f}");
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} differ",
        failures.len()
    );
    assert_eq!(checked, 8 * 74);
}
