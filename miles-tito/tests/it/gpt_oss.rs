//! GPT-OSS (harmony format): the `o200k_harmony` tokenizer fixture against openai-harmony's
//! ids, SGLang's `gpt-oss` reasoning and tool-call parsers against SGLang's own code
//! (`fixtures/tito/gpt_oss_parsers.json`, made by `gen_gpt_oss_parsers.py`), and TITO sessions
//! against HF's renders and ids (`fixtures/tito/gpt_oss_tito.json`, `gen_gpt_oss_tito.py`).
//! The template's renders themselves are in `hf_renders.json` (`hf_exact.rs`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use miles_core::{Message, ToolArguments, ToolSpec};
use miles_tito::{
    ChatTokenizer, HfChat, ReasoningParser, TemplateClock, TitoChat, TitoFamily, TitoTokenizer,
    ToolCallParser,
};
use serde_json::{Map, Value};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn read_json(path: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join(path)).unwrap()).unwrap()
}

/// The fixture directory, loaded once (its tokenizer is 200k entries), with `clock`.
fn chat(clock: TemplateClock) -> HfChat {
    static CHAT: OnceLock<HfChat> = OnceLock::new();
    CHAT.get_or_init(|| HfChat::load(fixtures().join("tokenizers/gpt-oss")).unwrap())
        .clone()
        .with_clock(clock)
        .unwrap()
}

#[test]
fn harmony_tokens_have_their_ids() {
    let chat = chat(TemplateClock::System);
    let tokenizer = chat.tokenizer().unwrap();
    // openai/gpt-oss-20b's added tokens (tokenizer_config.json), the same ids in
    // openai-harmony's `HarmonyGptOss` encoding.
    for (text, id) in [
        ("<|startoftext|>", 199_998),
        ("<|endoftext|>", 199_999),
        ("<|reserved_200000|>", 200_000),
        ("<|return|>", 200_002),
        ("<|constrain|>", 200_003),
        ("<|channel|>", 200_005),
        ("<|start|>", 200_006),
        ("<|end|>", 200_007),
        ("<|message|>", 200_008),
        ("<|call|>", 200_012),
        ("<|endofprompt|>", 200_018),
    ] {
        assert_eq!(tokenizer.token_to_id(text), Some(id), "{text}");
    }
    assert_eq!(tokenizer.get_vocab_size(true), 200_019);
    // openai-harmony: `enc.encode("hello world <|start|>", allowed_special="all")`.
    assert_eq!(
        chat.encode("hello world <|start|>").unwrap(),
        [24912, 2375, 220, 200_006]
    );
    assert_eq!(
        TitoFamily::detect(Some("gpt_oss"), Some(tokenizer)),
        TitoFamily::GptOss
    );
    assert_eq!(
        TitoFamily::detect(None, Some(tokenizer)),
        TitoFamily::GptOss
    );
}

fn tool_specs(tools: &Value) -> Vec<ToolSpec> {
    serde_json::from_value(tools.clone()).unwrap()
}

#[test]
fn parsers_equal_sglang() {
    let data = read_json("tito/gpt_oss_parsers.json");
    let tools = tool_specs(&data["tools"]);
    let reasoning = ReasoningParser::from_name("gpt-oss").unwrap();
    let tool_parser = ToolCallParser::from_name("gpt-oss").unwrap();
    assert_eq!(
        (reasoning, tool_parser),
        (ReasoningParser::GptOss, ToolCallParser::GptOss)
    );
    let mut checked = 0;
    for case in data["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let (got_reasoning, normal) = reasoning.parse(text);
        let want_reasoning = case["reasoning_text"].as_str().unwrap();
        assert_eq!(
            got_reasoning.as_deref().unwrap_or(""),
            want_reasoning,
            "{name}: reasoning"
        );
        assert_eq!(
            normal,
            case["normal_text"].as_str().unwrap(),
            "{name}: normal"
        );
        let expected = &case["tool"];
        assert_eq!(
            tool_parser.has_tool_call(&normal),
            expected["has_tool_call"].as_bool().unwrap(),
            "{name}: has_tool_call"
        );
        let (content, calls) = tool_parser.parse(&normal, &tools).unwrap();
        assert_eq!(
            content,
            expected["normal_text"].as_str().unwrap(),
            "{name}: content"
        );
        let calls: Vec<(String, ToolArguments)> = calls
            .into_iter()
            .map(|c| (c.function.name, c.function.arguments))
            .collect();
        let want: Vec<(String, ToolArguments)> = expected["calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["name"].as_str().unwrap().to_owned(),
                    ToolArguments::Json(c["parameters"].as_str().unwrap().to_owned()),
                )
            })
            .collect();
        assert_eq!(calls, want, "{name}: calls");
        checked += 1;
    }
    assert_eq!(checked, 29);
}

#[test]
fn output_ids_parse_into_reasoning_content_and_calls() {
    let data = read_json("tito/gpt_oss_parsers.json");
    let tools = tool_specs(&data["tools"]);
    let chat = chat(TemplateClock::System);
    let tito = TitoChat::new(&chat, TitoFamily::GptOss).unwrap();
    let case = |name: &str| {
        let case = data["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap();
        let ids = chat.encode(case["text"].as_str().unwrap()).unwrap();
        (case.clone(), tito.parse_assistant(&ids, &tools).unwrap())
    };
    // The stop tokens (`<|return|>`, `<|call|>`) are kept for the channel parser.
    let (want, parsed) = case("analysis_then_final");
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        want["reasoning_text"].as_str()
    );
    assert_eq!(parsed.content, want["normal_text"].as_str().unwrap());
    assert!(parsed.tool_calls.is_empty());
    let (want, parsed) = case("preamble_then_call");
    assert_eq!(parsed.reasoning_content.as_deref(), Some("Search first."));
    assert_eq!(
        parsed.content,
        want["tool"]["normal_text"].as_str().unwrap()
    );
    assert_eq!(parsed.tool_calls.len(), 1);
    assert_eq!(parsed.tool_calls[0].function.name, "search");
    assert_eq!(
        parsed.tool_calls[0].function.arguments,
        ToolArguments::Json(
            want["tool"]["calls"][0]["parameters"]
                .as_str()
                .unwrap()
                .to_owned()
        )
    );
    // The engine stops on generation_config.json's `eos_token_id` [200002, 199999, 200012];
    // `<|endoftext|>` is stripped before parsing, the harmony end markers are not.
    assert_eq!(
        TitoFamily::GptOss.end_of_turn(),
        ["<|return|>", "<|call|>", "<|endoftext|>"].as_slice()
    );
    assert_eq!(tito.stop_token_ids(), [200_002, 200_012, 199_999]);
    let ids = chat
        .encode("<|channel|>final<|message|>Done.<|endoftext|>")
        .unwrap();
    assert_eq!(tito.parse_assistant(&ids, &tools).unwrap().content, "Done.");
}

fn messages(value: &Value) -> Vec<Message> {
    serde_json::from_value(value.clone()).unwrap()
}

/// Each prompt of a replayed session is the stored ids plus the appended messages' ids, as HF
/// renders and encodes them; no earlier id changes although HF's own render of the longer
/// history drops the earlier analysis.
#[test]
fn sessions_append_ids_without_retokenizing() {
    let data = read_json("tito/gpt_oss_tito.json");
    let chat = chat(TemplateClock::FixedUnix(
        data["strftime_now_unix"].as_i64().unwrap(),
    ));
    let tito = TitoTokenizer::new(&chat, TitoFamily::GptOss, Map::new()).unwrap();
    let mut turns_checked = 0;
    for (name, conv) in data["conversations"].as_object().unwrap() {
        let messages = messages(&conv["messages"]);
        let tools = conv["tools"].as_array().map(Vec::as_slice);
        let mut stored: Vec<u32> = Vec::new();
        let mut stored_end = 0;
        for turn in conv["turns"].as_array().unwrap() {
            let index = turn["assistant_index"].as_u64().unwrap() as usize;
            let want_prompt: Vec<u32> = serde_json::from_value(turn["prompt_ids"].clone()).unwrap();
            let want_output: Vec<u32> = serde_json::from_value(turn["output_ids"].clone()).unwrap();
            let prompt = if stored.is_empty() {
                tito.apply_chat_template(&messages[..index], tools, true)
                    .unwrap()
            } else {
                tito.merge_tokens(&messages[..stored_end], &messages[..index], &stored, tools)
                    .unwrap()
            };
            assert_eq!(prompt, want_prompt, "{name}: prompt of message {index}");
            let output = tito.assistant_output_ids(&messages, index, tools).unwrap();
            assert_eq!(output, want_output, "{name}: output of message {index}");
            stored = [prompt, output].concat();
            stored_end = index + 1;
            turns_checked += 1;
        }
        let replayed = tito.replay_conversation(&messages, tools).unwrap();
        assert_eq!(replayed.ids(), stored.as_slice(), "{name}: replay");
    }
    assert_eq!(turns_checked, 5);
}
