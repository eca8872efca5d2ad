//! Token-sequence comparator (MILES_SPEC §1.10) on the real Qwen3 tokenizer.

use std::path::PathBuf;

use miles_core::Message;
use miles_tito::{HfChat, MismatchMetric, MismatchType, TitoFamily, TitoTokenizer};
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
