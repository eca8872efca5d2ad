//! Output parsers against the real chat templates: for each TITO family, a conversation with
//! reasoning, content and two tool calls is rendered with the family's real template (or
//! DeepSeek encoder) from `fixtures/tokenizers` / miles-tito's fixed templates, the assistant
//! turn is cut out of the render (the full render less the render of the prefix with the
//! generation prompt: exactly what the model writes), and the family's parser must give back
//! the conversation's tool calls (names and typed arguments), reasoning and content. Where the
//! family has a tokenizer fixture the same is checked through ids
//! ([`TitoChat::parse_assistant`]).
//!
//! Also: every truncation of each assistant turn, and hand-broken outputs (bad JSON, unknown
//! tools, unclosed blocks, bad DSML), parse without panicking, keeping the text as content.
//!
//! Fixtures missing: Kimi K2.6's native template (Kimi K2.6 is checked with K2.5's fixed
//! template, same tool-call format) and a Nemotron 3 / MiniMax tokenizer (text level only).

use std::path::{Path, PathBuf};

use miles_core::{ToolArguments, ToolSpec};
use miles_tito::{
    ChatTemplate, ChatTokenizer, DeepSeekVersion, HfChat, OutputParser, ParsedAssistant,
    ReasoningParser, RenderArgs, TitoChat, TitoFamily, ToolCallParser,
};
use serde_json::{Map, Value, json};

const REASONING: &str = "The user wants the weather and a search; call both tools.";
const CONTENT: &str = "Let me check both.";
/// DeepSeek's end of sentence (its families' end of turn).
const DEEPSEEK_EOS: &str = "<｜end▁of▁sentence｜>";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers")
}

fn tito_templates() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("templates")
}

fn tools_json() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "description": "postal code, digits"},
                "days": {"type": "integer"},
                "celsius": {"type": "boolean"}
            }, "required": ["city"]}
        }},
        {"type": "function", "function": {
            "name": "search",
            "description": "Web search.",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object"},
                "limit": {"type": "number"},
                "tags": {"type": "array", "items": {"type": "string"}}
            }, "required": ["query"]}
        }}
    ])
}

fn tools() -> Vec<ToolSpec> {
    serde_json::from_value(tools_json()).unwrap()
}

/// The two calls' `(id, name, arguments)`.
fn calls() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "functions.get_weather:0",
            "get_weather",
            json!({"city": "Paris", "zip": "75001", "days": 3, "celsius": true}),
        ),
        (
            "functions.search:1",
            "search",
            json!({
                "query": "cafés near the Louvre",
                "filters": {"open_now": true, "price": [1, 2]},
                "limit": 2.5,
                "tags": ["coffee", "wifi"]
            }),
        ),
    ]
}

fn prefix_messages() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        json!({"role": "user", "content": "Weather in Paris (75001), and cafés near the Louvre?"}),
    ]
}

/// The assistant turn; `string_args`: arguments as JSON strings (templates that concatenate).
fn assistant(with_reasoning: bool, string_args: bool) -> Value {
    let tool_calls: Vec<Value> = calls()
        .into_iter()
        .map(|(id, name, args)| {
            let args = if string_args {
                Value::String(args.to_string())
            } else {
                args
            };
            json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}})
        })
        .collect();
    let mut message = json!({"role": "assistant", "content": CONTENT, "tool_calls": tool_calls});
    if with_reasoning {
        message["reasoning_content"] = json!(REASONING);
    }
    message
}

/// How a family renders.
enum Renderer {
    Jinja(ChatTemplate),
    DeepSeek(DeepSeekVersion),
}

impl Renderer {
    fn jinja(source: &str, special_from: Option<&str>) -> Self {
        let mut template = ChatTemplate::new(source).unwrap();
        if let Some(dir) = special_from {
            let chat = HfChat::load(fixtures().join(dir)).unwrap();
            template = template.with_special_tokens(chat.special_tokens().clone());
        }
        Self::Jinja(template)
    }

    fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> String {
        let tools = tools_json();
        let tools = tools.as_array().unwrap();
        match self {
            Self::Jinja(template) => template
                .render(RenderArgs {
                    messages,
                    tools: Some(tools),
                    add_generation_prompt,
                    kwargs,
                })
                .unwrap(),
            Self::DeepSeek(version) => version
                .apply_chat_template(messages, Some(tools), add_generation_prompt, kwargs)
                .unwrap(),
        }
    }

    /// What the model writes for `assistant` (through its end-of-turn marker `end`): the full
    /// render less the prefix's render with the generation prompt.
    fn assistant_turn(&self, assistant: Value, kwargs: &Map<String, Value>, end: &str) -> String {
        let prefix = prefix_messages();
        let prompt = self.render(&prefix, true, kwargs);
        let mut all = prefix;
        all.push(assistant);
        let full = self.render(&all, false, kwargs);
        let turn = full.strip_prefix(prompt.as_str()).unwrap_or_else(|| {
            panic!("the full render does not extend the prompt:\n{prompt}\n---\n{full}")
        });
        let stop = turn
            .find(end)
            .unwrap_or_else(|| panic!("no {end:?} in {turn:?}"))
            + end.len();
        turn[..stop].to_owned()
    }
}

fn family_parser(family: TitoFamily) -> OutputParser {
    family.output_parser()
}

/// The parsed turn carries the conversation's calls (names, arguments as typed JSON, and the
/// ids when `ids`).
fn assert_calls(parsed: &ParsedAssistant, ids: bool) {
    let expected = calls();
    assert_eq!(parsed.tool_calls.len(), expected.len(), "{parsed:#?}");
    for (call, (id, name, args)) in parsed.tool_calls.iter().zip(expected) {
        assert_eq!(call.function.name, name);
        let ToolArguments::Json(text) = &call.function.arguments else {
            panic!("arguments not a JSON string: {call:?}")
        };
        let got: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(got, args, "arguments of {name}");
        if ids {
            assert_eq!(call.id.as_deref(), Some(id));
        }
    }
}

/// Every truncation of `turn` parses without error or panic; any call found is a known tool
/// with JSON-object arguments.
fn assert_truncations_parse(parser: &OutputParser, turn: &str) {
    let tools = tools();
    for (cut, _) in turn.char_indices() {
        let parsed = parser
            .parse(&turn[..cut], &tools)
            .unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        for call in &parsed.tool_calls {
            assert!(["get_weather", "search"].contains(&call.function.name.as_str()));
            let ToolArguments::Json(text) = &call.function.arguments else {
                panic!()
            };
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("cut {cut}: {text}: {e}"));
            assert!(value.is_object(), "cut {cut}: {text}");
        }
    }
}

/// Checks through ids: the turn encodes with the family's tokenizer and
/// [`TitoChat::parse_assistant`] decodes and parses it.
fn parse_ids(dir: &str, family: &str, turn: &str) -> ParsedAssistant {
    let chat = TitoChat::load(&fixtures().join(dir), family).unwrap();
    let ids = chat.encode(turn).unwrap();
    assert_eq!(chat.decode(&ids), turn, "lossless decode");
    chat.parse_assistant(&ids, &tools()).unwrap()
}

#[test]
fn qwen35_qwen3_coder_round_trip() {
    let source = std::fs::read_to_string(tito_templates().join("qwen3.5_fixed.jinja")).unwrap();
    let renderer = Renderer::jinja(&source, Some("qwen3"));
    let kwargs = TitoFamily::Qwen35.merge_kwargs(Map::new()).unwrap();
    let turn = renderer.assistant_turn(assistant(true, false), &kwargs, "<|im_end|>");
    // The template writes booleans with Python's `str` (`True`), numbers bare, objects as JSON.
    assert!(
        turn.contains("<parameter=celsius>\nTrue\n</parameter>"),
        "{turn}"
    );
    let parser = family_parser(TitoFamily::Qwen35);
    for parsed in [
        parser.parse(&turn, &tools()).unwrap(),
        parse_ids("qwen3", "qwen35", &turn),
    ] {
        assert_eq!(
            parsed.reasoning_content.as_deref().map(str::trim),
            Some(REASONING)
        );
        assert_eq!(parsed.content.trim(), CONTENT);
        assert_calls(&parsed, false);
    }
    assert_truncations_parse(&parser, &turn);
}

#[test]
fn nemotron3_qwen3_coder_round_trip() {
    let source =
        std::fs::read_to_string(fixtures().join("nemotron-3-nano/chat_template.jinja")).unwrap();
    let renderer = Renderer::jinja(&source, None);
    let kwargs = TitoFamily::Nemotron3.merge_kwargs(Map::new()).unwrap();
    let turn = renderer.assistant_turn(assistant(true, false), &kwargs, "<|im_end|>");
    let parser = family_parser(TitoFamily::Nemotron3);
    let parsed = parser.parse(&turn, &tools()).unwrap();
    assert_eq!(
        parsed.reasoning_content.as_deref().map(str::trim),
        Some(REASONING)
    );
    assert_eq!(parsed.content.trim(), CONTENT);
    assert_calls(&parsed, false);
    assert_truncations_parse(&parser, &turn);

    // enable_thinking=False: the prompt closes the block (`<think></think>`), the model
    // writes no reasoning; the request's kwargs un-force the parser.
    let mut off = kwargs.clone();
    off.insert("enable_thinking".into(), json!(false));
    let turn = renderer.assistant_turn(assistant(false, false), &off, "<|im_end|>");
    let parsed = parser.for_kwargs(&off).parse(&turn, &tools()).unwrap();
    assert_eq!(parsed.reasoning_content, None);
    assert_calls(&parsed, false);
}

#[test]
fn minimax_m2_round_trip() {
    for (family, file) in [
        (TitoFamily::MinimaxM25, "minimax_m25_fixed.jinja"),
        (TitoFamily::MinimaxM27, "minimax_m27_fixed.jinja"),
    ] {
        let source = std::fs::read_to_string(tito_templates().join(file)).unwrap();
        let renderer = Renderer::jinja(&source, None);
        let kwargs = family.merge_kwargs(Map::new()).unwrap();
        let turn = renderer.assistant_turn(assistant(true, false), &kwargs, "[e~[");
        let parser = family_parser(family);
        let parsed = parser.parse(&turn, &tools()).unwrap();
        // `minimax-append-think`: the reasoning stays in the content, behind a `<think>` put
        // back for the one the generation prompt opened (`<think>\n`, the newline stays in the
        // prompt); the template reads it back from there next turn.
        assert_eq!(parsed.reasoning_content, None);
        assert!(
            parsed
                .content
                .starts_with(&format!("<think>{REASONING}\n</think>")),
            "{:?}",
            parsed.content
        );
        assert!(
            parsed.content.trim_end().ends_with(CONTENT),
            "{:?}",
            parsed.content
        );
        assert_calls(&parsed, false);
        assert_truncations_parse(&parser, &turn);
        // SGLang's `minimax` reasoning parser (forced `<think>`) splits it instead.
        let split = OutputParser {
            reasoning: Some(ReasoningParser::from_name("minimax").unwrap()),
            ..parser.clone()
        }
        .parse(&turn, &tools())
        .unwrap();
        assert_eq!(
            split.reasoning_content.as_deref().map(str::trim),
            Some(REASONING)
        );
        assert_eq!(split.content.trim(), CONTENT);
        assert_calls(&split, false);
    }
}

#[test]
fn kimi_k25_round_trip() {
    let source = std::fs::read_to_string(tito_templates().join("kimi_k25_fixed.jinja")).unwrap();
    let renderer = Renderer::jinja(&source, Some("kimi-k2"));
    let kwargs = TitoFamily::Kimi25.merge_kwargs(Map::new()).unwrap();
    let turn = renderer.assistant_turn(assistant(true, false), &kwargs, "<|im_end|>");
    let parser = family_parser(TitoFamily::Kimi25);
    assert_eq!(parser, family_parser(TitoFamily::Kimi26));
    for parsed in [
        parser.parse(&turn, &tools()).unwrap(),
        parse_ids("kimi-k2", "kimi25", &turn),
    ] {
        assert_eq!(parsed.reasoning_content.as_deref(), Some(REASONING));
        assert_eq!(parsed.content, CONTENT);
        // The model's ids are kept (`kimi_k2_raw_id`).
        assert_calls(&parsed, true);
    }
    assert_truncations_parse(&parser, &turn);

    // thinking=False: the prompt holds `<think></think>`.
    let mut off = kwargs.clone();
    off.insert("thinking".into(), json!(false));
    let turn = renderer.assistant_turn(assistant(false, false), &off, "<|im_end|>");
    let parsed = parser.for_kwargs(&off).parse(&turn, &tools()).unwrap();
    assert_eq!(parsed.reasoning_content, None);
    assert_eq!(parsed.content, CONTENT);
    assert_calls(&parsed, true);
}

#[test]
fn deepseek_v31_round_trip() {
    // V3.1 has no TITO family; its parsers are SGLang's `deepseek-v3` + `deepseekv31`. The
    // template writes `</think>` before a tool-call turn, i.e. non-thinking mode.
    let source =
        std::fs::read_to_string(fixtures().join("deepseek-v3/templates/deepseek-v3.1.jinja"))
            .unwrap();
    let renderer = Renderer::jinja(&source, Some("deepseek-v3"));
    let kwargs = Map::new();
    let turn = renderer.assistant_turn(assistant(false, true), &kwargs, DEEPSEEK_EOS);
    let parser = OutputParser {
        reasoning: Some(ReasoningParser::from_name("deepseek-v3").unwrap()),
        tool_calls: Some(ToolCallParser::from_name("deepseekv31").unwrap()),
        end_of_turn: vec![DEEPSEEK_EOS.to_owned()],
    };
    let parsed = parser.parse(&turn, &tools()).unwrap();
    assert_eq!(parsed.reasoning_content, None);
    assert_eq!(parsed.content, CONTENT);
    assert_calls(&parsed, false);
    assert_truncations_parse(&parser, &turn);
    // Bad JSON arguments: the whole text stays content.
    let broken = turn.replacen("\"Paris\"", "Paris", 1);
    let parsed = parser.parse(&broken, &tools()).unwrap();
    assert!(parsed.tool_calls.is_empty());
    assert!(parsed.content.contains("<｜tool▁calls▁begin｜>"));
}

fn deepseek_round_trip(family: TitoFamily, version: DeepSeekVersion, dir: &str, block: &str) {
    let renderer = Renderer::DeepSeek(version);
    let parser = family_parser(family);
    // Thinking mode (the default): the prompt ends with `<think>`.
    let kwargs = family.merge_kwargs(Map::new()).unwrap();
    let turn = renderer.assistant_turn(assistant(true, false), &kwargs, DEEPSEEK_EOS);
    assert!(turn.contains(&format!("<｜DSML｜{block}>")), "{turn}");
    for parsed in [
        parser.parse(&turn, &tools()).unwrap(),
        parse_ids(dir, family.name(), &turn),
    ] {
        assert_eq!(parsed.reasoning_content.as_deref(), Some(REASONING));
        assert_eq!(parsed.content, CONTENT);
        assert_calls(&parsed, false);
    }
    assert_truncations_parse(&parser, &turn);

    // Non-thinking mode: the prompt ends with `</think>`; the request's kwargs un-force the
    // reasoning parser.
    let mut off = Map::new();
    off.insert("thinking".into(), json!(false));
    let off = family.merge_kwargs(off).unwrap();
    let turn = renderer.assistant_turn(assistant(false, false), &off, DEEPSEEK_EOS);
    let chat = TitoChat::load(&fixtures().join(dir), family.name()).unwrap();
    // The engine stops at the end of the turn: `<｜end▁of▁sentence｜>` is the stop id.
    let eos = chat.encode(DEEPSEEK_EOS).unwrap();
    assert_eq!(eos.len(), 1);
    assert_eq!(chat.stop_token_ids(), eos);
    let ids = chat.encode(&turn).unwrap();
    assert_eq!(ids.last(), eos.last());
    for parsed in [
        parser.for_kwargs(&off).parse(&turn, &tools()).unwrap(),
        // What the server calls, with the request's kwargs.
        chat.parse_assistant_with_kwargs(&ids, &tools(), &off)
            .unwrap(),
    ] {
        assert_eq!(parsed.reasoning_content, None);
        assert_eq!(parsed.content, CONTENT);
        assert_calls(&parsed, false);
    }
    // Without the kwargs the default (thinking) parser reads it all as reasoning, as SGLang
    // does for a thinking request.
    let forced = chat.parse_assistant(&ids, &tools()).unwrap();
    assert!(forced.tool_calls.is_empty() && forced.content.is_empty());
}

#[test]
fn deepseek_v32_dsml_round_trip() {
    deepseek_round_trip(
        TitoFamily::DeepseekV32,
        DeepSeekVersion::V32,
        "deepseek-v32",
        "function_calls",
    );
}

#[test]
fn deepseek_v4_dsml_round_trip() {
    deepseek_round_trip(
        TitoFamily::DeepseekV4,
        DeepSeekVersion::V4,
        "deepseek-v4",
        "tool_calls",
    );
}

#[test]
fn malformed_outputs_stay_content() {
    let tools = tools();
    let cases: &[(TitoFamily, &str)] = &[
        // Unknown tool.
        (
            TitoFamily::Qwen35,
            "</think>\n\nHi.\n\n<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>",
        ),
        (
            TitoFamily::MinimaxM25,
            "Hi.\n<minimax:tool_call>\n<invoke name=\"launch\"><parameter name=\"x\">1</parameter></invoke>\n</minimax:tool_call>[e~[",
        ),
        (
            TitoFamily::Kimi25,
            "</think>Hi.<|tool_calls_section_begin|><|tool_call_begin|>functions.launch:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>",
        ),
        (
            TitoFamily::DeepseekV32,
            "</think>Hi.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"launch\">\n</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>",
        ),
        (
            TitoFamily::DeepseekV4,
            "</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"launch\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
        ),
        // Unclosed blocks.
        (
            TitoFamily::Qwen35,
            "</think>\n\nHi.\n\n<tool_call>\n<function",
        ),
        (
            TitoFamily::MinimaxM25,
            "Hi.\n<minimax:tool_call>\n<invoke name=\"get_weather\"><parameter name=\"city\">Paris</parameter></invoke>",
        ),
        (
            TitoFamily::Kimi25,
            "</think>Hi.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}",
        ),
        (
            TitoFamily::DeepseekV32,
            "</think>Hi.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n",
        ),
        (
            TitoFamily::DeepseekV4,
            "</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris",
        ),
        // Bad values.
        (
            TitoFamily::Kimi25,
            "</think>Hi.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            TitoFamily::DeepseekV4,
            "</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"days\" string=\"false\">three</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ),
        (
            TitoFamily::DeepseekV4,
            "</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"maybe\">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ),
        (
            TitoFamily::DeepseekV4,
            "</think>Hi.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n{\"city\": \"Paris\"\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ),
    ];
    for (family, text) in cases {
        let parsed = family_parser(*family).parse(text, &tools).unwrap();
        assert!(
            parsed.tool_calls.is_empty(),
            "{family}: {text:?} gave {parsed:#?}"
        );
        assert!(parsed.content.contains("Hi."), "{family}: {parsed:#?}");
        let markup = [
            "<tool_call>",
            "<minimax:tool_call>",
            "<|tool_calls_section_begin|>",
            "｜DSML｜",
        ];
        assert!(
            markup.iter().any(|m| parsed.content.contains(m)),
            "{family}: the model's markup is kept: {parsed:#?}"
        );
    }

    // A Qwen3-Coder call cut before `</tool_call>` is still read (SGLang parses an unclosed
    // block from the whole text).
    let parsed = family_parser(TitoFamily::Qwen35)
        .parse("</think>\n\nHi.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2", &tools)
        .unwrap();
    assert_eq!(parsed.reasoning_content.as_deref(), Some(""));
    assert_eq!(parsed.content, "Hi.\n\n");
    assert_eq!(
        parsed.tool_calls[0].function.arguments,
        ToolArguments::Json(r#"{"city": "Paris", "days": 2}"#.into())
    );
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// Markup fragments of every format, to be shuffled with text.
    const FRAGMENTS: &[&str] = &[
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=get_weather>",
        "<function=",
        "</function>",
        "<parameter=city>",
        "<parameter=",
        "</parameter>",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "<invoke name=\"search\">",
        "<invoke name=\"",
        "</invoke>",
        "<parameter name=\"days\">",
        "<parameter name=\"",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.search:0",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜DSML｜function_calls>",
        "</｜DSML｜function_calls>",
        "<｜DSML｜tool_calls>",
        "</｜DSML｜tool_calls>",
        "<｜DSML｜invoke name=\"get_weather\">",
        "</｜DSML｜invoke>",
        "<｜DSML｜parameter name=\"city\" string=\"true\">",
        "string=\"false\">",
        "</｜DSML｜parameter>",
        "<function_calls>",
        "{\"city\": \"x\"}",
        "{'a': [1, (2,",
        "\"",
        "'",
        ">",
        "\n",
        " ",
        "3",
        "True",
        "null",
        "é",
        "[[[[",
        "<|im_end|>",
        "[e~[",
        "<｜end▁of▁sentence｜>",
    ];

    fn all_parsers() -> Vec<OutputParser> {
        let reasoning = [
            "qwen3",
            "qwen3-thinking",
            "glm45",
            "kimi_k2",
            "deepseek-r1",
            "deepseek-v3",
            "deepseek-v4",
            "nemotron_3",
            "minimax",
            "minimax-append-think",
        ];
        let tool_calls = [
            "qwen25",
            "glm45",
            "glm47",
            "kimi_k2",
            "qwen3_coder",
            "minimax-m2",
            "deepseekv31",
            "deepseekv32",
            "deepseekv4",
        ];
        let mut out = Vec::new();
        for (i, t) in tool_calls.iter().enumerate() {
            out.push(OutputParser {
                reasoning: Some(
                    ReasoningParser::from_name(reasoning[i % reasoning.len()]).unwrap(),
                ),
                tool_calls: Some(ToolCallParser::from_name(t).unwrap()),
                end_of_turn: vec!["<|im_end|>".into(), DEEPSEEK_EOS.into()],
            });
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// No arrangement of markup makes a parser fail or panic, with or without tools.
        #[test]
        fn any_markup_parses(picks in proptest::collection::vec((0..FRAGMENTS.len(), "[a-z ]{0,3}"), 0..24)) {
            let text: String = picks.iter().map(|(i, s)| format!("{}{s}", FRAGMENTS[*i])).collect();
            let tools = tools();
            for parser in all_parsers() {
                for tools in [&tools[..], &[]] {
                    let parsed = parser.parse(&text, tools);
                    prop_assert!(parsed.is_ok());
                }
            }
        }
    }
}
