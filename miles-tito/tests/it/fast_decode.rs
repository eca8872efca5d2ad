//! The table-driven decoder ([`miles_tito::FastDecoder`]) gives exactly the text of HF
//! tokenizers' own `decode(ids, skip_special_tokens=False)` on every fixture tokenizer (all
//! have a `ByteLevel` decoder): random id sequences over the whole vocabulary (so byte
//! tokens that split multi-byte characters, lone continuation bytes and invalid UTF-8 occur),
//! every added token, ids past the vocabulary (HF skips them), and whole encoded texts.

use miles_tito::{FastDecoder, HfChat};

const TOKENIZERS: [&str; 7] = [
    "qwen3",
    "llama3.1",
    "glm-4.5",
    "deepseek-v3",
    "deepseek-v32",
    "deepseek-v4",
    "kimi-k2",
];

use crate::common::{Rng, load};

#[test]
fn fast_decode_equals_hf_decode_on_every_fixture_tokenizer() {
    for name in TOKENIZERS {
        let chat = load(name);
        let tokenizer = chat.tokenizer().expect("tokenizer.json");
        let fast = chat
            .fast_decoder()
            .unwrap_or_else(|| panic!("{name}: ByteLevel decoder not accelerated"));
        let hf = |ids: &[u32]| tokenizer.decode(ids, false).expect("hf decode");
        let size = tokenizer.get_vocab_size(true) as u64;
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ size);
        let mut invalid_utf8 = 0;
        for _ in 0..3000 {
            let len = 1 + (rng.next() % 24) as usize;
            let ids: Vec<u32> = (0..len)
                // A few ids past the vocabulary, which HF skips.
                .map(|_| (rng.next() % (size + 8)) as u32)
                .collect();
            let expected = hf(&ids);
            invalid_utf8 += usize::from(expected.contains('\u{FFFD}'));
            assert_eq!(fast.decode(&ids), expected, "{name}: ids {ids:?}");
        }
        // The random sequences did exercise the lossy path.
        assert!(
            invalid_utf8 > 100,
            "{name}: only {invalid_utf8} lossy cases"
        );
        let added: Vec<u32> = tokenizer
            .get_added_tokens_decoder()
            .keys()
            .copied()
            .collect();
        assert!(!added.is_empty(), "{name}: no added tokens");
        for id in &added {
            assert_eq!(fast.decode(&[*id]), hf(&[*id]), "{name}: added token {id}");
        }
        assert_eq!(fast.decode(&added), hf(&added), "{name}: all added tokens");
        let text = "Grüße, 世界! <think>\n\n</think>\n\n{\"city\": \"Paris\"} 😀 \t\r\n x";
        let ids = tokenizer
            .encode(text, false)
            .expect("encode")
            .get_ids()
            .to_vec();
        assert_eq!(fast.decode(&ids), hf(&ids), "{name}: encoded text");
        assert_eq!(fast.decode(&[]), "");
    }
}

#[test]
fn a_tokenizer_whose_decoder_is_not_byte_level_is_not_accelerated() {
    let chat = load("qwen3");
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chat.dir().join("tokenizer.json")).expect("read"),
    )
    .expect("json");
    json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}]});
    let tokenizer: tokenizers::Tokenizer =
        serde_json::from_value(json).expect("tokenizer with another decoder");
    assert!(FastDecoder::new(&tokenizer).is_none());
    json_none_decoder(&chat);
}

/// A tokenizer without a decoder joins tokens with spaces: not accelerated either.
fn json_none_decoder(chat: &HfChat) {
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(chat.dir().join("tokenizer.json")).expect("read"),
    )
    .expect("json");
    json["decoder"] = serde_json::Value::Null;
    let tokenizer: tokenizers::Tokenizer =
        serde_json::from_value(json).expect("tokenizer without a decoder");
    assert!(FastDecoder::new(&tokenizer).is_none());
}
