//! Session replay and loss masks checked against HF transformers' render, Miles'
//! trailing-trim vectors (the `miles tito` contract is tested in miles-cli).

use std::path::PathBuf;

use miles_core::Message;
use miles_tito::{HfChat, TitoFamily, TitoTokenizer, TurnRecord, merge_turn_samples, turn_samples};
use serde_json::{Map, Value, json};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn hf_case(
    template: &str,
    conversation: &str,
    kwargs: &Value,
    gen_prompt: bool,
) -> (Value, String) {
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tokenizers/hf_renders.json")).unwrap(),
    )
    .unwrap();
    let entry = data["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == template)
        .unwrap();
    let case = entry["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["conversation"] == conversation
                && &c["kwargs"] == kwargs
                && c["add_generation_prompt"] == gen_prompt
        })
        .unwrap();
    (
        data["conversations"][conversation].clone(),
        case["text"].as_str().unwrap().to_owned(),
    )
}

#[test]
fn qwen3_replay_masks_exactly_the_assistant_turns_hf_renders() {
    let kwargs =
        json!({"date_string": "26 Jul 2024", "enable_thinking": true, "clear_thinking": false});
    let (conv, hf_text) = hf_case("qwen3_fixed", "multi_step_tools_reasoning", &kwargs, false);
    let messages: Vec<Message> = serde_json::from_value(conv["messages"].clone()).unwrap();
    let tools = conv["tools"].as_array().cloned();
    let chat = HfChat::load(fixtures().join("tokenizers/qwen3")).unwrap();
    let tito = TitoTokenizer::new(&chat, TitoFamily::Qwen3, Map::new())
        .unwrap()
        .clone_with_chat_template_kwargs(kwargs.as_object().unwrap())
        .unwrap();
    let trajectory = tito
        .replay_conversation(&messages, tools.as_deref())
        .unwrap();
    assert_eq!(trajectory.num_turns(), 3);

    // The incremental ids decode to HF's render of the history (the model stops at
    // <|im_end|>, so HF's text continues with "\n" and the final user turn).
    let decoded = tito.decode(trajectory.ids()).unwrap();
    assert!(hf_text.starts_with(&format!("{decoded}\n")), "{decoded}");
    // ... and equal a fresh tokenization of that text.
    assert_eq!(trajectory.ids(), chat.encode(&decoded).unwrap().as_slice());

    // Loss mask: the 1-runs are exactly the assistant segments of HF's text, from after
    // "<|im_start|>assistant\n" through "<|im_end|>".
    let expected: Vec<String> = hf_text
        .split("<|im_start|>assistant\n")
        .skip(1)
        .map(|s| {
            let end = s.find("<|im_end|>").unwrap() + "<|im_end|>".len();
            s[..end].to_owned()
        })
        .collect();
    let mask = trajectory.loss_mask();
    let ids = trajectory.ids();
    let mut runs = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        if mask[i] == 1 {
            let start = i;
            while i < ids.len() && mask[i] == 1 {
                i += 1;
            }
            runs.push(tito.decode(&ids[start..i]).unwrap());
        } else {
            i += 1;
        }
    }
    assert_eq!(runs, expected);
    let spans = trajectory.turns();
    assert_eq!(
        spans.iter().map(|t| t.completion_len).sum::<usize>(),
        mask.iter().filter(|m| **m == 1).count()
    );
}

#[test]
fn glm47_replay_keeps_stored_prefix() {
    let (conv, _) = hf_case(
        "glm-4.7-flash",
        "multi_step_tools_reasoning@miles",
        &json!({"date_string": "26 Jul 2024"}),
        false,
    );
    let messages: Vec<Message> = serde_json::from_value(conv["messages"].clone()).unwrap();
    let tools = conv["tools"].as_array().cloned();
    let chat = HfChat::load(fixtures().join("tokenizers/glm-4.5"))
        .unwrap()
        .with_template_source(
            std::fs::read_to_string(
                fixtures().join("tokenizers/glm-4.5/templates/glm-4.7-flash.jinja"),
            )
            .unwrap(),
        )
        .unwrap();
    let tito = TitoTokenizer::new(&chat, TitoFamily::Glm47, Map::new()).unwrap();
    let trajectory = tito
        .replay_conversation(&messages, tools.as_deref())
        .unwrap();
    assert_eq!(trajectory.num_turns(), 3);
    assert_eq!(trajectory.max_trim_tokens(), 1);
    // A stored turn that stopped on <|observation|> loses it: the appendix re-renders it.
    let obs = chat
        .tokenizer()
        .unwrap()
        .token_to_id("<|observation|>")
        .unwrap();
    let merged = tito
        .merge_tokens(
            &messages[..3],
            &messages[..4],
            &[1, 2, obs],
            tools.as_deref(),
        )
        .unwrap();
    assert_eq!(&merged[..2], &[1, 2]);
    assert_eq!(merged[2], obs);
}

#[test]
fn miles_trailing_trim_vectors() {
    let data: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tito/tito_trailing_trim_cases.json")).unwrap(),
    )
    .unwrap();
    for case in data["cases"].as_array().unwrap() {
        let records: Vec<TurnRecord> = case["records"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| TurnRecord {
                prompt: serde_json::from_value(r["prompt"].clone()).unwrap(),
                output: serde_json::from_value(r["output"].clone()).unwrap(),
            })
            .collect();
        let accumulated: Option<Vec<u32>> =
            serde_json::from_value(case["accumulated"].clone()).unwrap();
        let max_trim = case["max_trim_tokens"].as_u64().unwrap() as usize;
        let result = turn_samples(&records, accumulated.as_deref(), max_trim);
        match case.get("expected_error") {
            Some(err) => {
                let got = result.unwrap_err().to_string();
                assert!(
                    got.contains(err.as_str().unwrap()),
                    "{}: {got}",
                    case["name"]
                );
            }
            None => {
                let samples = result.unwrap();
                let expected = case["expected"].as_array().unwrap();
                assert_eq!(samples.len(), expected.len());
                for (s, e) in samples.iter().zip(expected) {
                    assert_eq!(json!(s.tokens), e["tokens"], "{}", case["name"]);
                    assert_eq!(json!(s.response_length), e["response_length"]);
                    assert_eq!(s.loss_mask.len(), s.response_length);
                }
                // Merged sample (`merge_samples`): a ⊕ 0^obs ⊕ b.
                let merged = merge_turn_samples(&samples).unwrap();
                assert_eq!(&merged.tokens, samples.last().map(|s| &s.tokens).unwrap());
                if case["name"] == "three_turn_trim_trailing_stop_tokens" {
                    assert_eq!(merged.loss_mask, vec![1, 0, 0, 0, 1, 0, 0, 0, 1, 1]);
                    assert_eq!(merged.response_length, 10);
                }
            }
        }
    }
}
