//! Per-turn cost of TITO incremental tokenization vs full re-render + re-tokenize on a
//! 64-turn tool-calling conversation with the real Qwen3 tokenizer and the `qwen3` family
//! (issue 3 item 7), a quick `std::time::Instant` version of the criterion bench
//! `benches/tito_turns.rs` (`cargo bench -p miles-tito`).
//!
//! `cargo run -p miles-tito --release --example turn_cost`
//!
//! Conversation: system, user, then 64 × [assistant with one tool call and ~120 words, tool
//! result ~80 words]. At turn k the stored ids end at assistant k-1 and the tool result of
//! turn k-1 is appended. Miles' Python TITO (the constants, not re-measured): 0.67 ms
//! at turn 2, 0.93 ms at turn 64; full re-tokenize 1.37 ms and 28.0 ms.

use std::path::PathBuf;
use std::time::Instant;

use miles_core::{Message, ToolCall};
use miles_tito::{HfChat, TitoFamily, TitoTokenizer};
use serde_json::{Map, Value, json};

const WORDS: [&str; 24] = [
    "the",
    "weather",
    "service",
    "returned",
    "a",
    "forecast",
    "for",
    "city",
    "with",
    "light",
    "rain",
    "and",
    "moderate",
    "wind",
    "temperatures",
    "between",
    "twelve",
    "eighteen",
    "degrees",
    "humidity",
    "remains",
    "high",
    "tomorrow",
    "morning",
];

/// The session server's allocator (`miles session`), so the step is measured as the
/// server runs it.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| WORDS[(i * 7 + seed * 13) % WORDS.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn time_ms(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_secs_f64() * 1e3 / iters as f64
}

fn main() -> Result<(), miles_tito::Error> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tokenizers/qwen3");
    let chat = HfChat::load(dir)?;
    let tito = TitoTokenizer::new(&chat, TitoFamily::Qwen3, Map::new())?;
    let tools: Vec<Value> = vec![json!({"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})];
    let mut messages = vec![
        Message::system("You are a meticulous weather analyst."),
        Message::user("Compare the weather of many cities, one tool call at a time."),
    ];
    for t in 0..64 {
        let mut args = Map::new();
        args.insert("city".into(), json!(format!("City{t}")));
        messages.push(
            Message::assistant(words(120, t)).with_tool_calls(vec![ToolCall::function(
                format!("call_{t}"),
                "get_weather",
                args,
            )]),
        );
        messages.push(Message::tool(format!("call_{t}"), words(80, t + 1000)));
    }
    let mut per_turn = Vec::new();
    for turn in [2usize, 64] {
        let a = 2 + 2 * (turn - 2);
        let stored = tito.apply_chat_template(&messages[..=a], Some(&tools), false)?;
        // The request is parsed afresh, as the session server receives it.
        let request: Vec<Message> =
            serde_json::from_value(serde_json::to_value(&messages[..=a + 1]).expect("serialise"))
                .expect("parse request");
        let (old, new) = (&messages[..=a], &request[..]);
        if let Ok(n) = std::env::var("MILES_TURN_COST_LOOP") {
            // Profiling aid: only the incremental step, n times.
            if turn == 64 {
                let n: usize = n.parse().expect("MILES_TURN_COST_LOOP is a count");
                for _ in 0..n {
                    std::hint::black_box(
                        tito.merge_tokens(old, new, &stored, Some(&tools))
                            .expect("merge"),
                    );
                }
                return Ok(());
            }
            continue;
        }
        let tokens = tito.apply_chat_template(new, Some(&tools), true)?.len();
        let inc = time_ms(200, || {
            tito.merge_tokens(old, new, &stored, Some(&tools))
                .expect("merge");
        });
        let full = time_ms(20, || {
            tito.apply_chat_template(new, Some(&tools), true)
                .expect("render");
        });
        println!(
            "turn {turn:2}: history {tokens:5} tokens | incremental {inc:.3} ms | full re-render+re-tokenize {full:.3} ms | speed-up {:.1}x",
            full / inc
        );
        per_turn.push(inc);
    }
    println!(
        "incremental turn64/turn2 = {:.2}",
        per_turn[1] / per_turn[0]
    );
    let short = &messages[..10];
    let n = 200;
    let ms = time_ms(n, || {
        tito.render(short, Some(&tools), true).expect("render");
    });
    println!(
        "render throughput (4-turn tool conversation): {:.0} conversations/s",
        1e3 / ms
    );
    Ok(())
}
