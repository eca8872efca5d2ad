//! A faster, id-exact path for `tokenizer(text, add_special_tokens=False)` on byte-level BPE
//! tokenizers with the GPT-4-style split regex (Qwen2/Qwen3, Llama 3, GLM-4.x).
//!
//! HF tokenizers spends most of an encode on bookkeeping this crate never reads (alignment
//! tracking through normalisation and pre-tokenisation, offsets, per-token strings). For the
//! tokenizers whose pipeline is exactly
//!
//! * added tokens split out first, leftmost-longest, none with `normalized`, `lstrip`,
//!   `rstrip` or `single_word`;
//! * a normaliser that leaves ASCII unchanged (none, NFC, NFD, NFKC, NFKD, or a sequence of
//!   those);
//! * `Split(<GPT-4-style regex>, Isolated)` then `ByteLevel(add_prefix_space=false,
//!   use_regex=false)`;
//! * a post-processor that adds nothing when `add_special_tokens=false`, no truncation, no
//!   padding,
//!
//! [`FastEncoder`] splits added tokens itself, pre-tokenises ASCII text with a hand-written
//! scanner equivalent to the regex on ASCII, maps bytes to the byte-level alphabet and asks
//! the tokenizer's own model for each piece's ids (memoised per piece). Text between added
//! tokens that is not pure ASCII goes through the HF tokenizer unchanged (each such piece is
//! encoded exactly as HF encodes it inside the full text, because HF processes the pieces
//! between added tokens independently). A tokenizer of any other shape is not accelerated.
//! `tests/it/fast_encode.rs` checks ids against HF tokenizers on every fixture render and on
//! randomised ASCII text for the Qwen3, Llama 3.1 and GLM-4.5 tokenizers.

use std::collections::HashMap;
use std::hash::Hasher;
use std::sync::{Arc, RwLock};

use serde_json::Value as Json;
use tokenizers::{Model, Tokenizer};

use crate::error::{Error, Result};

/// Qwen2 / Qwen3: digits one at a time.
const REGEX_DIGITS_1: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3 / GLM-4.x: digits in groups of up to three.
const REGEX_DIGITS_3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Pieces memoised before the cache is cleared.
const CACHE_CAPACITY: usize = 1 << 16;
/// Longer pieces (long whitespace or punctuation runs) are not memoised.
const CACHE_MAX_PIECE: usize = 256;

/// An id-exact accelerated encoder for one tokenizer (see the module docs).
#[derive(Debug)]
pub struct FastEncoder {
    tokenizer: Arc<Tokenizer>,
    /// Maximum digits per piece (`\p{N}` = 1, `\p{N}{1,3}` = 3).
    digits: usize,
    /// Added tokens by first byte, longest first.
    added: Vec<Vec<(Box<[u8]>, u32)>>,
    /// Whether any added token starts with the byte.
    added_first: [bool; 256],
    /// GPT-2 byte-to-character map.
    byte_char: [char; 256],
    cache: RwLock<PieceCache>,
}

type PieceCache = HashMap<Box<str>, Box<[u32]>, PieceHasherBuilder>;

/// A multiply-rotate hasher over 8-byte words (the Fx scheme) with a per-process random seed
/// and a murmur3 finaliser, for the piece cache: SipHash cost a third of a cache lookup. The
/// seed keeps collisions from being chosen by whoever writes the text (the words after the
/// first are mixed with seed-dependent state), and the finaliser spreads every input bit
/// into the bucket bits (plain Fx leaves the low bits blind to the high bytes of a word).
struct PieceHasher(u64);

/// Builds [`PieceHasher`]s from one random seed.
#[derive(Clone)]
struct PieceHasherBuilder(u64);

impl Default for PieceHasherBuilder {
    fn default() -> Self {
        use std::hash::BuildHasher;
        Self(std::collections::hash_map::RandomState::new().hash_one(0x9e37_79b9_u64))
    }
}

impl std::hash::BuildHasher for PieceHasherBuilder {
    type Hasher = PieceHasher;

    fn build_hasher(&self) -> PieceHasher {
        PieceHasher(self.0)
    }
}

impl PieceHasher {
    const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(Self::SEED);
    }
}

impl Hasher for PieceHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn write_usize(&mut self, value: usize) {
        self.add(value as u64);
    }

    fn finish(&self) -> u64 {
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// GPT-2's reversible byte-to-unicode map (printable Latin-1 maps to itself, the rest to
/// U+0100 onwards in byte order).
fn byte_char_table() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

fn json_type(value: &Json) -> Option<&str> {
    value.get("type").and_then(Json::as_str)
}

/// Whether a normaliser (as serialised) leaves every ASCII string unchanged.
fn ascii_identity_normalizer(value: &Json) -> bool {
    match json_type(value) {
        Some("NFC" | "NFD" | "NFKC" | "NFKD") => true,
        Some("Sequence") => value
            .get("normalizers")
            .and_then(Json::as_array)
            .is_some_and(|all| all.iter().all(ascii_identity_normalizer)),
        _ => false,
    }
}

/// The digit group size of a supported pre-tokenizer, or `None`.
fn supported_pre_tokenizer(value: &Json) -> Option<usize> {
    if json_type(value) != Some("Sequence") {
        return None;
    }
    let steps = value.get("pretokenizers")?.as_array()?;
    let [split, byte_level] = steps.as_slice() else {
        return None;
    };
    let split_ok = json_type(split) == Some("Split")
        && split.get("behavior").and_then(Json::as_str) == Some("Isolated")
        && split.get("invert") == Some(&Json::Bool(false));
    let byte_level_ok = json_type(byte_level) == Some("ByteLevel")
        && byte_level.get("add_prefix_space") == Some(&Json::Bool(false))
        && byte_level.get("use_regex") == Some(&Json::Bool(false));
    if !(split_ok && byte_level_ok) {
        return None;
    }
    match split.get("pattern")?.get("Regex")?.as_str()? {
        REGEX_DIGITS_1 => Some(1),
        REGEX_DIGITS_3 => Some(3),
        _ => None,
    }
}

/// Whether a post-processor (as serialised) adds nothing with `add_special_tokens=false`.
fn supported_post_processor(value: &Json) -> bool {
    match json_type(value) {
        Some("ByteLevel" | "TemplateProcessing") => true,
        Some("Sequence") => value
            .get("processors")
            .and_then(Json::as_array)
            .is_some_and(|all| all.iter().all(supported_post_processor)),
        _ => false,
    }
}

fn serialised<T: serde::Serialize>(value: Option<&T>) -> Option<Json> {
    value.map(|v| serde_json::to_value(v).unwrap_or(Json::Null))
}

/// Probe texts run through both paths when an encoder is built; any difference disables
/// the fast path for that tokenizer.
const PROBES: [&str; 6] = [
    "Hello, world! It's 2024-06-01; we'll   see.\n\n  x\t\ty  \n",
    "<|im_start|>user\nWhat's 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
    "def f(a, b):\n    return a**b  # don't\r\n\r\n\tdone\x0b\x0c end   ",
    "caf\u{e9} na\u{ef}ve \u{4f60}\u{597d} \u{1F600} 'S 'LL 'Re ok",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
    "   leading and trailing   \n\n\n",
];

impl FastEncoder {
    /// Builds the accelerated encoder, or `None` when the tokenizer's pipeline is not one
    /// this path reproduces exactly.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Option<Self> {
        if tokenizer.get_encode_special_tokens()
            || tokenizer.get_truncation().is_some()
            || tokenizer.get_padding().is_some()
        {
            return None;
        }
        if let Some(normalizer) = serialised(tokenizer.get_normalizer())
            && !ascii_identity_normalizer(&normalizer)
        {
            return None;
        }
        let digits = supported_pre_tokenizer(&serialised(tokenizer.get_pre_tokenizer())?)?;
        if let Some(post) = serialised(tokenizer.get_post_processor())
            && !supported_post_processor(&post)
        {
            return None;
        }
        let mut added: Vec<Vec<(Box<[u8]>, u32)>> = vec![Vec::new(); 256];
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.normalized || token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            let bytes = token.content.as_bytes();
            let Some(&first) = bytes.first() else {
                continue;
            };
            added[first as usize].push((bytes.into(), id));
        }
        for list in &mut added {
            list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        }
        let encoder = Self {
            tokenizer,
            digits,
            added_first: std::array::from_fn(|b| !added[b].is_empty()),
            added,
            byte_char: byte_char_table(),
            cache: RwLock::new(PieceCache::default()),
        };
        let agrees = PROBES.iter().all(|text| {
            matches!(
                (encoder.encode(text), crate::hf::encode(&encoder.tokenizer, text)),
                (Ok(fast), Ok(slow)) if fast == slow
            )
        });
        agrees.then_some(encoder)
    }

    /// `tokenizer(text, add_special_tokens=False)["input_ids"]`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut start = 0;
        let mut i = 0;
        while let Some(at) = bytes[i..]
            .iter()
            .position(|&b| self.added_first[b as usize])
        {
            i += at;
            if let Some((len, id)) = self.added_at(&bytes[i..]) {
                self.encode_segment(&text[start..i], &mut ids)?;
                ids.push(id);
                i += len;
                start = i;
            } else {
                i += 1;
            }
        }
        self.encode_segment(&text[start..], &mut ids)?;
        Ok(ids)
    }

    /// The longest added token starting at `rest`, as (byte length, id).
    fn added_at(&self, rest: &[u8]) -> Option<(usize, u32)> {
        self.added[rest[0] as usize]
            .iter()
            .find(|(token, _)| rest.starts_with(token))
            .map(|(token, id)| (token.len(), *id))
    }

    /// Text between added tokens.
    fn encode_segment(&self, segment: &str, ids: &mut Vec<u32>) -> Result<()> {
        if segment.is_empty() {
            return Ok(());
        }
        if !segment.is_ascii() {
            ids.extend(crate::hf::encode(&self.tokenizer, segment)?);
            return Ok(());
        }
        let bytes = segment.as_bytes();
        // One read lock for the segment; pieces it misses are tokenized and memoised after.
        let mut misses: Vec<(usize, usize, Box<[u32]>)> = Vec::new();
        {
            let cache = self.cache.read().ok();
            let mut i = 0;
            while i < bytes.len() {
                let len = piece_len(bytes, i, self.digits);
                let piece = &segment[i..i + len];
                if let Some(hit) = cache.as_ref().and_then(|c| c.get(piece)) {
                    ids.extend_from_slice(hit);
                } else {
                    let piece_ids = self.tokenize_piece(piece)?;
                    ids.extend_from_slice(&piece_ids);
                    if len <= CACHE_MAX_PIECE {
                        misses.push((i, len, piece_ids));
                    }
                }
                i += len;
            }
        }
        if !misses.is_empty()
            && let Ok(mut cache) = self.cache.write()
        {
            for (at, len, piece_ids) in misses {
                if cache.len() >= CACHE_CAPACITY {
                    cache.clear();
                }
                cache.insert(segment[at..at + len].into(), piece_ids);
            }
        }
        Ok(())
    }

    /// The model's ids for one pre-tokenized ASCII piece.
    fn tokenize_piece(&self, piece: &str) -> Result<Box<[u32]>> {
        let mapped: String = piece.bytes().map(|b| self.byte_char[b as usize]).collect();
        let tokens = self
            .tokenizer
            .get_model()
            .tokenize(&mapped)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(tokens.iter().map(|t| t.id).collect())
    }
}

/// ASCII `\s` (Oniguruma's Unicode White_Space restricted to ASCII).
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

fn is_crlf(b: u8) -> bool {
    matches!(b, b'\r' | b'\n')
}

/// `[^\s\p{L}\p{N}]` on ASCII.
fn is_other(b: u8) -> bool {
    !is_space(b) && !b.is_ascii_alphanumeric()
}

fn run(bytes: &[u8], from: usize, pred: impl Fn(u8) -> bool) -> usize {
    bytes[from..].iter().take_while(|b| pred(**b)).count()
}

/// Length of the regex match at `i` (leftmost-first alternation, as Oniguruma evaluates
/// it) of
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// on ASCII text. Every ASCII character starts a match of at least one byte.
fn piece_len(bytes: &[u8], i: usize, digits: usize) -> usize {
    let b = bytes[i];
    let at = |k: usize| bytes.get(i + k).map(u8::to_ascii_lowercase);
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if b == b'\'' {
        match (at(1), at(2)) {
            (Some(b's' | b't' | b'm' | b'd'), _) => return 2,
            (Some(b'r' | b'v'), Some(b'e')) => return 3,
            (Some(b'l'), Some(b'l')) => return 3,
            _ => {}
        }
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if b.is_ascii_alphabetic() {
        return run(bytes, i, |c| c.is_ascii_alphabetic());
    }
    if !is_crlf(b) && !b.is_ascii_digit() && bytes.get(i + 1).is_some_and(u8::is_ascii_alphabetic) {
        return 1 + run(bytes, i + 1, |c| c.is_ascii_alphabetic());
    }
    // \p{N}{1,D}
    if b.is_ascii_digit() {
        return run(bytes, i, |c| c.is_ascii_digit()).min(digits);
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other_from = if b == b' ' { i + 1 } else { i };
    if bytes.get(other_from).copied().is_some_and(is_other) {
        let end = other_from + run(bytes, other_from, is_other);
        return end + run(bytes, end, is_crlf) - i;
    }
    // Whitespace from here on.
    let spaces = run(bytes, i, is_space);
    // \s*[\r\n]+ : up to and including the last CR/LF of the whitespace run.
    if let Some(last) = bytes[i..i + spaces].iter().rposition(|c| is_crlf(*c)) {
        return last + 1;
    }
    // \s+(?!\S) : the run minus its last character when a non-space follows.
    if i + spaces == bytes.len() || spaces == 1 {
        return spaces;
    }
    spaces - 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, digits: usize) -> Vec<&str> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < text.len() {
            let len = piece_len(text.as_bytes(), i, digits);
            out.push(&text[i..i + len]);
            i += len;
        }
        out
    }

    #[test]
    fn scanner_follows_the_regex_by_hand() {
        // Worked by hand from the regex's alternatives, in order.
        assert_eq!(
            pieces("Hello world's 12345 x  y\n\n  z!!\n", 3),
            [
                "Hello", " world", "'s", " ", "123", "45", " x", " ", " y", "\n\n", " ", " z",
                "!!\n"
            ]
        );
        assert_eq!(pieces("a1234", 1), ["a", "1", "2", "3", "4"]);
        assert_eq!(pieces("'LL'Re'x", 1), ["'LL", "'Re", "'x"]);
        assert_eq!(pieces("  \t", 1), ["  \t"]);
        assert_eq!(pieces(" \r\n x", 1), [" \r\n", " x"]);
        assert_eq!(pieces("\tfoo ,bar", 1), ["\tfoo", " ,", "bar"]);
        assert_eq!(pieces("\nfoo", 1), ["\n", "foo"]);
        assert_eq!(pieces("   {", 1), ["  ", " {"]);
    }

    #[test]
    fn piece_hasher_spreads_high_bytes_into_bucket_bits() {
        use std::hash::BuildHasher;
        let build = PieceHasherBuilder::default();
        // Pieces that differ only in the high bytes of their one word: with plain Fx their
        // low hash bits (the bucket of a small table) would all be equal.
        let buckets: std::collections::HashSet<u64> = (b'A'..=b'Z')
            .map(|c| build.hash_one(format!("abcd{}xyz", c as char)) & 0xff)
            .collect();
        assert!(
            buckets.len() > 16,
            "{} distinct buckets of 26 pieces",
            buckets.len()
        );
    }

    #[test]
    fn byte_table_matches_gpt2() {
        let table = byte_char_table();
        assert_eq!(table[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(table[b'\n' as usize], '\u{10A}'); // Ċ
        assert_eq!(table[b'A' as usize], 'A');
        assert_eq!(table[0x7F], '\u{121}');
        assert_eq!(table[0xAD], '\u{143}');
    }
}
