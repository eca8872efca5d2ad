//! Property: with an append-only template, the incrementally built prompt of every turn equals
//! the full render of the conversation, and the finished session shows no TITO mismatch.

use miles_core::{Message, TokenId};
use miles_session::testkit::ByteChatml;
use miles_session::trajectory::LinearTrajectory;

use crate::common::empty_record;
use miles_tito::{ChatTokenizer, MessageMatcher};
use proptest::prelude::*;
use serde_json::Map;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn incremental_prompt_equals_full_render(
        turns in prop::collection::vec(("[a-z ]{0,12}", "[a-z ]{1,12}", "[a-z]{0,8}", any::<bool>()), 1..6)
    ) {
        let tok = ByteChatml::default();
        let kwargs = tok.resolve_kwargs(&Map::new()).unwrap();
        let mut messages = vec![Message::system("sys")];
        let mut trajectory = LinearTrajectory::new();
        for (user, reply, reasoning, as_system) in turns {
            messages.push(if as_system { Message::system(user) } else { Message::user(user) });
            let prepared = trajectory
                .prepare(&messages, &[], &kwargs, &tok, MessageMatcher::Strict)
                .unwrap();
            prop_assert_eq!(tok.decode(&prepared.prompt_ids), tok.render_text(&messages, &[], true, &kwargs));
            let assistant = Message::assistant(reply.clone()).with_reasoning(reasoning.clone());
            let output: Vec<TokenId> = tok.encode(&format!("<think>\n{reasoning}\n</think>\n\n{reply}<|im_end|>"));
            trajectory.commit(&prepared, &messages, &output, assistant.clone(), empty_record(), 0).unwrap();
            messages.push(assistant);
        }
        prop_assert_eq!(trajectory.messages(), &messages[..]);
        let canonical = tok.render(&messages, &[], false, &kwargs).unwrap();
        prop_assert!(tok.compare_sequences(&canonical, trajectory.token_ids()).is_empty());
    }
}
