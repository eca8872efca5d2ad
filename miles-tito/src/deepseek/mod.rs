//! DeepSeek V3.2 and V4 prompt encoders, and Miles' bridge to them.
//!
//! Neither model ships a Jinja chat template: prompts are built by Python encoders
//! (`encode_messages`). This module reproduces, byte for byte, the two encoders Miles renders
//! with — its vendored `encoding_dsv32` (upstream's with `drop_thinking=False` honoured on
//! every turn) and sglang's `encoding_dsv4` — and Miles' bridge around them
//! ([`DeepSeekVersion::apply_chat_template`]): tool-call arguments as JSON, tools (validated like sglang's
//! `Tool` model) injected into the first system message, the thinking mode resolved from
//! `thinking_mode` / `enable_thinking` / `thinking`, and the generation suffix stripped when
//! no generation prompt is asked for.
//!
//! Messages are JSON objects and are read the way the Python reads dicts, so every message kind
//! the encoders know works: `system` (with `tools`, `response_format`), `user` (V4: merged with
//! adjacent tool results and users, `task`), `assistant` (`reasoning_content`, `tool_calls`
//! in DSML, V4 `wo_eos`), `tool`, `developer`, and V4's `latest_reminder`; encoder keywords
//! `drop_thinking`, `add_default_bos_token`, `context` and (V4) `reasoning_effort`. Input the
//! Python rejects is an [`Error::DeepSeekEncoding`] naming the exception Python raises.
//!
//! One file per part: `tokens` (special tokens, fixed prompt texts), `version`
//! ([`DeepSeekVersion`]), `pydict` (Python's dict access and exceptions), `common` (pieces
//! both encoders share, [`DeepSeekEncodeOptions`]), `v32` and `v4` (the encoders), `bridge`
//! (Miles' bridge and the public entry points).

mod bridge;
mod common;
mod pydict;
mod tokens;
mod v32;
mod v4;
mod version;

pub(crate) use bridge::thinking_enabled;
pub use common::DeepSeekEncodeOptions;
pub(crate) use tokens::{ASSISTANT_TOKEN, EOS, THINK_END, THINK_START, USER_TOKEN};
pub use version::DeepSeekVersion;

#[cfg(test)]
mod tests {
    use super::common::encode_arguments_to_dsml;
    use super::pydict::Raise;
    use super::*;
    use crate::error::Error;
    use serde_json::{Map, Value as Json, json};

    fn render(version: DeepSeekVersion, messages: Json, kwargs: Json, gen_prompt: bool) -> String {
        version
            .apply_chat_template(
                messages.as_array().unwrap(),
                None,
                gen_prompt,
                kwargs.as_object().unwrap(),
            )
            .unwrap()
    }

    #[test]
    fn v32_user_turns_and_generation_suffix() {
        let messages = json!([{"role": "user", "content": "hi"}]);
        let kwargs = json!({"drop_thinking": false, "thinking": true});
        assert_eq!(
            render(DeepSeekVersion::V32, messages.clone(), kwargs.clone(), true),
            "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
        );
        assert_eq!(
            render(DeepSeekVersion::V32, messages, kwargs, false),
            "<｜begin▁of▁sentence｜><｜User｜>hi"
        );
    }

    #[test]
    fn v4_folds_tool_results_into_one_user_turn() {
        let messages = json!([
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                {"id": "b", "type": "function", "function": {"name": "f", "arguments": "{\"x\": \"y\"}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "B"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
        ]);
        let text = render(
            DeepSeekVersion::V4,
            messages,
            json!({"thinking": false}),
            true,
        );
        assert!(text.ends_with(
            "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result><｜Assistant｜></think>"
        ));
        assert!(
            text.contains("<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>")
        );
        assert!(
            text.contains("<｜DSML｜parameter name=\"x\" string=\"true\">y</｜DSML｜parameter>")
        );
    }

    #[test]
    fn thinking_resolution_follows_the_bridge() {
        let map = |v: Json| v.as_object().unwrap().clone();
        assert!(thinking_enabled(&Map::new()));
        assert!(!thinking_enabled(&map(json!({"enable_thinking": false}))));
        assert!(thinking_enabled(&map(
            json!({"thinking": false, "enable_thinking": true})
        )));
        assert!(!thinking_enabled(&map(
            json!({"thinking_mode": "chat", "enable_thinking": true})
        )));
        assert!(thinking_enabled(&map(
            json!({"enable_thinking": null, "thinking": null})
        )));
        assert!(!thinking_enabled(&map(json!({"thinking_mode": null}))));
    }

    #[test]
    fn json_string_arguments_differ_from_python_only_where_documented() {
        // COMPATIBILITY.md: Python's json.loads accepts NaN and keeps big integers exact.
        let dsml = |args: &str| encode_arguments_to_dsml(&json!(args));
        assert!(matches!(
            dsml("{\"x\": NaN}"),
            Err(Raise {
                exception: "JSONDecodeError",
                ..
            })
        ));
        let big = dsml("{\"x\": 123456789012345678901234567890}")
            .ok()
            .unwrap();
        assert!(big.contains(">1.2345678901234568e+29<"), "{big}");
        let neg_zero = dsml("{\"x\": -0}").ok().unwrap();
        assert!(neg_zero.contains(">-0.0<"), "{neg_zero}");
        // Everything else round-trips as Python prints it.
        let text = dsml("{\"f\": 1.0, \"e\": 1E3, \"s\": \"\\u00e9\", \"l\": [1, null, true]}")
            .ok()
            .unwrap();
        assert_eq!(
            text,
            "<｜DSML｜parameter name=\"f\" string=\"false\">1.0</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"e\" string=\"false\">1000.0</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"s\" string=\"true\">é</｜DSML｜parameter>\n\
             <｜DSML｜parameter name=\"l\" string=\"false\">[1, null, true]</｜DSML｜parameter>"
        );
    }

    #[test]
    fn rejected_input_names_the_python_exception() {
        let err = DeepSeekVersion::V32
            .apply_chat_template(
                &[json!({"role": "user", "content": "x"})],
                None,
                true,
                json!({"reasoning_effort": "max"}).as_object().unwrap(),
            )
            .unwrap_err();
        assert!(matches!(
            err,
            Error::DeepSeekEncoding {
                exception: "TypeError",
                ..
            }
        ));
        let err = DeepSeekVersion::V4
            .apply_chat_template(
                &[json!({"role": "user", "content": "x"}), json!(3)],
                None,
                true,
                &Map::new(),
            )
            .unwrap_err();
        assert!(matches!(
            err,
            Error::DeepSeekEncoding {
                exception: "AttributeError",
                ..
            }
        ));
    }
}
