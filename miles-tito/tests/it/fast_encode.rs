//! The accelerated encoder ([`miles_tito::FastEncoder`]) gives exactly the ids of HF
//! tokenizers' own `encode(text, add_special_tokens=False)` (the library transformers runs)
//! on randomised text built to hit every branch of the split regex, with added tokens and
//! non-ASCII runs mixed in. It is enabled for the Qwen3, Llama 3.1 and GLM-4.5 tokenizers and
//! disabled for the DeepSeek-V3 and Kimi-K2 ones, whose pre-tokenizers it does not reproduce.
//! (`tests/it/hf_exact.rs` also runs every fixture render through it against transformers' ids.)

use crate::common::{Rng, load};

/// Fragments chosen for the regex's edge cases: contractions in any case, letter runs with
/// a leading space / punctuation / tab, digit runs, punctuation runs with trailing newlines,
/// whitespace runs with and without CR/LF, ASCII control characters, JSON and code.
const FRAGMENTS: [&str; 48] = [
    "'s",
    "'S",
    "'t",
    "'re",
    "'RE",
    "'rE",
    "'ve",
    "'m",
    "'ll",
    "'LL",
    "'d",
    "'x",
    "'",
    "hello",
    " world",
    "\tTab",
    "!bang",
    "A",
    "z",
    "1",
    "22",
    "333",
    "4444",
    "12345678",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "\t",
    "\x0b",
    "\x0c",
    "\x00",
    "\x1f",
    "\x7f",
    "...",
    "?!\n",
    " {",
    "\"key\": ",
    "[1, 2]",
    "},\n",
    "<|",
    "|>",
    "()",
    "__init__",
    "-->",
];

const SPECIALS: [&str; 6] = [
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|user|>",
];

const UNICODE: [&str; 6] = ["é", "naïve", "你好", "😀", "\u{a0}", "Ǆ"];

fn random_text(rng: &mut Rng, with_unicode: bool) -> String {
    let len = 1 + rng.next() % 24;
    let mut text = String::new();
    for _ in 0..len {
        match rng.next() % 20 {
            0 => text.push_str(rng.pick(&SPECIALS)),
            1 if with_unicode => text.push_str(rng.pick(&UNICODE)),
            _ => text.push_str(rng.pick(&FRAGMENTS)),
        }
    }
    text
}

fn check(name: &str, seed: u64) {
    let chat = load(name);
    let tokenizer = chat.tokenizer().expect("tokenizer");
    let fast = chat
        .fast_encoder()
        .unwrap_or_else(|| panic!("{name}: fast encoder should be enabled"));
    let mut rng = Rng(seed);
    for case in 0..4000 {
        let text = random_text(&mut rng, case % 4 == 0);
        let expected = miles_tito::encode(tokenizer, &text).unwrap();
        assert_eq!(fast.encode(&text).unwrap(), expected, "{name}: {text:?}");
    }
}

#[test]
fn qwen3_ids_equal_hf_tokenizers() {
    check("qwen3", 0x9E37_79B9_7F4A_7C15);
}

#[test]
fn llama31_ids_equal_hf_tokenizers() {
    check("llama3.1", 0xD1B5_4A32_D192_ED03);
}

#[test]
fn glm45_ids_equal_hf_tokenizers() {
    check("glm-4.5", 0x94D0_49BB_1331_11EB);
}

#[test]
fn other_pre_tokenizers_are_not_accelerated() {
    assert!(load("deepseek-v3").fast_encoder().is_none());
    assert!(load("kimi-k2").fast_encoder().is_none());
}
