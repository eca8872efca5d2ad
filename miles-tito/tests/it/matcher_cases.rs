//! The session message matchers against Miles' own: `fixtures/tito/matcher_cases.json`
//! (`fixtures/tito/gen_matcher_cases.py`) holds message pairs with the verdicts of Miles'
//! `strict_message_matches`, `loose_tool_call_message_matches` and
//! `role_content_only_message_matches` (Miles 31f1ca961), and every pair must get the same
//! verdict from [`MessageMatcher`]. A matching pair also passes `assert_append_only`, a
//! rejected one fails it naming the index.

use std::path::Path;

use miles_core::{Message, Role};
use miles_tito::{MessageMatcher, assert_append_only};
use serde_json::Value;

#[test]
fn matchers_agree_with_miles_on_every_case() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tito/matcher_cases.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 30);
    let mut loose_only = 0;
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let stored: Message = serde_json::from_value(case["stored"].clone()).unwrap();
        let replayed: Message = serde_json::from_value(case["replayed"].clone()).unwrap();
        for (key, matcher) in [
            ("strict", MessageMatcher::Strict),
            ("loose_tool_call", MessageMatcher::LooseToolCall),
            ("role_content_only", MessageMatcher::RoleContentOnly),
        ] {
            let want = case[key].as_bool().unwrap();
            assert_eq!(
                matcher.matches(&stored, &replayed),
                want,
                "{name}: {key} (Miles says {want})"
            );
            assert_eq!(
                matcher.diffs(&stored, &replayed).is_empty(),
                want,
                "{name}: {key} diffs"
            );
            let history = [Message::user("q"), stored.clone()];
            let next = [Message::user("q"), replayed.clone(), Message::user("next")];
            let verdict = assert_append_only(&history, &next, &[Role::User, Role::Tool], matcher);
            assert_eq!(
                verdict.is_ok(),
                want,
                "{name}: {key} append-only: {verdict:?}"
            );
        }
        if case["loose_tool_call"] == true && case["strict"] == false {
            loose_only += 1;
        }
    }
    // The loose matcher's own equivalences are exercised, not only strict's.
    assert!(loose_only >= 8, "{loose_only}");
    assert_eq!(
        MessageMatcher::parse("loose_tool_call").unwrap(),
        MessageMatcher::LooseToolCall
    );
}
