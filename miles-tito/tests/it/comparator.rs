//! Token-sequence comparator on the real Qwen3 tokenizer, and through the [`ChatTokenizer`]
//! seam over the byte-level ChatML tokenizer.

use std::path::PathBuf;

use crate::common::ByteChatml;
use miles_core::Message;
use miles_tito::{ChatTokenizer, HfChat, MismatchMetric, MismatchType, TitoFamily, TitoTokenizer};
use serde_json::Map;

fn qwen3(family: TitoFamily) -> (HfChat, TitoTokenizer) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let chat = HfChat::load(dir).unwrap();
    let tito = TitoTokenizer::new(&chat, family, Map::new()).unwrap();
    (chat, tito)
}

fn conversation(user: &str, assistant: &str) -> Vec<Message> {
    vec![
        Message::system("You are helpful."),
        Message::user(user),
        Message::assistant(assistant),
    ]
}

#[test]
fn classifies_each_mismatch_type() {
    let (_, tito) = qwen3(TitoFamily::Qwen3);
    let cmp = tito.comparator();
    let expected = tito
        .apply_chat_template(&conversation("Hi there", "Hello friend"), None, false)
        .unwrap();

    // Identical, and the trailing "\n" after <|im_end|> (where the model stops) is ignored.
    assert!(cmp.compare(&expected, &expected).unwrap().is_empty());
    assert!(
        cmp.compare(&expected, &expected[..expected.len() - 1])
            .unwrap()
            .is_empty()
    );

    // Assistant content differs.
    let actual = tito
        .apply_chat_template(&conversation("Hi there", "Hello pal"), None, false)
        .unwrap();
    let m = cmp.compare(&expected, &actual).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].kind, MismatchType::AssistantText);
    assert!(m[0].expected_text.contains("Hello friend"));

    // User content differs.
    let actual = tito
        .apply_chat_template(&conversation("Hi thar", "Hello friend"), None, false)
        .unwrap();
    let m = cmp.compare(&expected, &actual).unwrap();
    assert_eq!(
        m.iter().map(|m| m.kind).collect::<Vec<_>>(),
        vec![MismatchType::NonAssistantText]
    );

    // A special token replaced by another special token.
    let im_end = tito.tokenizer().token_to_id("<|im_end|>").unwrap();
    let eot = tito.tokenizer().token_to_id("<|endoftext|>").unwrap();
    let mut actual = expected.clone();
    let pos = actual.iter().position(|id| *id == im_end).unwrap();
    actual[pos] = eot;
    let m = cmp.compare(&expected, &actual).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].kind, MismatchType::SpecialTokenType);
    assert_eq!(m[0].expected_text, "<|im_end|>");
    assert_eq!(m[0].actual_text, "<|endoftext|>");

    // An extra special token changes the segment structure.
    let mut actual = expected.clone();
    actual.insert(pos, im_end);
    let m = cmp.compare(&expected, &actual).unwrap();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].kind, MismatchType::SpecialTokenCount);
    assert_eq!(m[0].segment_index, -1);
    assert!(m[0].expected_text.starts_with("[<|im_start|>] ("));

    // Same text, different tokenization: not a mismatch (segments compared as text).
    let text = tito.decode(&expected).unwrap();
    let split: Vec<u32> = {
        let mut ids = Vec::new();
        for piece in ["<|im_start|>system\nYou are help", "ful.<|im_end|>\n"] {
            ids.extend(tito.encode(piece).unwrap());
        }
        ids
    };
    let whole = tito
        .encode("<|im_start|>system\nYou are helpful.<|im_end|>\n")
        .unwrap();
    assert_ne!(split, whole);
    assert!(cmp.compare(&whole, &split).unwrap().is_empty());
    assert!(text.starts_with("<|im_start|>system"));
}

#[test]
fn default_family_cannot_classify_assistant_text() {
    let (_, tito) = qwen3(TitoFamily::Default);
    let cmp = tito.comparator();
    let expected = tito
        .apply_chat_template(&conversation("Hi", "Hello friend"), None, false)
        .unwrap();
    let actual = tito
        .apply_chat_template(&conversation("Hi", "Hello pal"), None, false)
        .unwrap();
    let m = cmp.compare(&expected, &actual).unwrap();
    assert_eq!(m[0].kind, MismatchType::NonAssistantText);
}

#[test]
fn session_metric_fractions() {
    let (_, tito) = qwen3(TitoFamily::Qwen3);
    let cmp = tito.comparator();
    let a = tito
        .apply_chat_template(&conversation("Hi", "A"), None, false)
        .unwrap();
    let b = tito
        .apply_chat_template(&conversation("Hi", "B"), None, false)
        .unwrap();
    let c = tito
        .apply_chat_template(&conversation("Yo", "A"), None, false)
        .unwrap();
    let samples = [
        cmp.compare(&a, &a).unwrap(),
        cmp.compare(&a, &b).unwrap(),
        cmp.compare(&a, &c).unwrap(),
        cmp.compare(&a, &a).unwrap(),
    ];
    let metric = MismatchMetric::from_samples(samples.iter().map(Vec::as_slice)).unwrap();
    assert_eq!(metric.samples, 4);
    assert_eq!(metric.rate, 0.5);
    let named = metric.to_named("tito_session_mismatch_rate/v1");
    assert_eq!(named[0], ("tito_session_mismatch_rate/v1".to_owned(), 0.5));
    assert!(named.contains(&(
        "tito_session_mismatch_rate/v1/assistant_text".to_owned(),
        0.25
    )));
    assert!(named.contains(&(
        "tito_session_mismatch_rate/v1/non_assistant_text".to_owned(),
        0.25
    )));
    assert!(named.contains(&(
        "tito_session_mismatch_rate/v1/special_token_count".to_owned(),
        0.0
    )));
    assert!(MismatchMetric::from_samples(std::iter::empty()).is_none());
}

fn kinds(tok: &ByteChatml, expected: &str, actual: &str) -> Vec<(MismatchType, i64)> {
    tok.compare_sequences(&tok.encode(expected), &tok.encode(actual))
        .into_iter()
        .map(|m| (m.kind, m.segment_index))
        .collect()
}

#[test]
fn comparator_classifies_each_kind() {
    let tok = ByteChatml::default();
    let base = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n";
    // Identical, and identical up to the trailing "\n" that is stripped.
    assert!(kinds(&tok, base, base).is_empty());
    assert!(kinds(&tok, base, base.trim_end_matches('\n')).is_empty());
    // Segments: 0 [im_start] 1 "user\nhi" 2 [im_end] 3 "\n" 4 [im_start] 5 "assistant\nhello" 6 [im_end].
    let assistant = base.replace("hello", "hullo");
    assert_eq!(
        kinds(&tok, base, &assistant),
        vec![(MismatchType::AssistantText, 5)]
    );
    let user = base.replace("hi", "ho");
    assert_eq!(
        kinds(&tok, base, &user),
        vec![(MismatchType::NonAssistantText, 1)]
    );
    let special = base.replace("hello<|im_end|>", "hello<think>");
    assert_eq!(
        kinds(&tok, base, &special),
        vec![(MismatchType::SpecialTokenType, 6)]
    );
    let extra = base.replace("hello", "<think>hello");
    let found = tok.compare_sequences(&tok.encode(base), &tok.encode(&extra));
    assert_eq!(found.len(), 1);
    assert_eq!(
        (found[0].kind, found[0].segment_index),
        (MismatchType::SpecialTokenCount, -1)
    );
    assert!(
        found[0].actual_text.contains("[<think>]"),
        "{}",
        found[0].actual_text
    );
    assert_eq!(
        serde_json::to_value(&found[0]).unwrap()["type"],
        "special_token_count"
    );
}
