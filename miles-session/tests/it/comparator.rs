//! The token-sequence comparator (MILES_SPEC §1.10) over the byte-level ChatML tokenizer.

use crate::common::ByteChatml;
use miles_session::chat::{ChatTokenizer, MismatchType};

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
