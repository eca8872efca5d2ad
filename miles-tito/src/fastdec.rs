//! A faster, text-exact path for `tokenizer.decode(ids, skip_special_tokens=False)` on
//! tokenizers whose decoder is exactly `ByteLevel` (Qwen2/Qwen3, Llama 3, GLM-4.x,
//! DeepSeek-V3, …).
//!
//! HF tokenizers decodes by looking every id up as a token string (added tokens first, then
//! the model's vocabulary; unknown ids are skipped), handing the strings to the decoder, which
//! for `ByteLevel` maps each token's characters back to bytes through GPT-2's byte alphabet
//! (a token holding a character outside the alphabet keeps its own UTF-8 bytes), joins the
//! bytes and converts them to text lossily. Per token, that byte string never changes, so
//! [`FastDecoder`] computes it once for every id and a decode is a concatenation plus one
//! UTF-8 validation. Any other decoder (sequences, `Replace`, `ByteFallback`, `Metaspace`, …)
//! is not accelerated. `tests/it/fast_decode.rs` checks the text against HF tokenizers on
//! random id sequences (added tokens and split multi-byte characters included) for every
//! fixture tokenizer with a `ByteLevel` decoder.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// The bytes every id decodes to, stored back to back.
#[derive(Debug)]
pub struct FastDecoder {
    /// `offsets[id]..offsets[id + 1]` indexes `bytes` (empty for an id with no token, which
    /// HF skips: skipping and appending nothing are the same).
    offsets: Vec<u32>,
    bytes: Vec<u8>,
}

/// GPT-2's byte alphabet inverted: character → byte.
fn char_byte(c: char) -> Option<u8> {
    let code = c as u32;
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    if code < 256 && printable(code) {
        return Some(code as u8);
    }
    // The non-printable bytes map, in byte order, to U+0100 onwards.
    let n = code.checked_sub(256)?;
    (0u32..256)
        .filter(|b| !printable(*b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn is_byte_level_decoder(tokenizer: &Tokenizer) -> bool {
    let Some(decoder) = tokenizer.get_decoder() else {
        return false;
    };
    let Ok(value) = serde_json::to_value(decoder) else {
        return false;
    };
    value.get("type").and_then(|t| t.as_str()) == Some("ByteLevel")
}

impl FastDecoder {
    /// Builds the table, or `None` when the tokenizer's decoder is not exactly `ByteLevel`.
    pub fn new(tokenizer: &Tokenizer) -> Option<Self> {
        if !is_byte_level_decoder(tokenizer) {
            return None;
        }
        // The inverse alphabet as a table over the 512 code points it uses.
        let table: Vec<Option<u8>> = (0u32..512)
            .map(|c| char::from_u32(c).and_then(char_byte))
            .collect();
        let size = tokenizer.get_vocab_size(true) as u32;
        let max_added = tokenizer
            .get_added_tokens_decoder()
            .keys()
            .copied()
            .max()
            .map_or(0, |m| m + 1);
        let ids = size.max(max_added);
        let mut offsets = Vec::with_capacity(ids as usize + 1);
        let mut bytes = Vec::with_capacity(ids as usize * 6);
        offsets.push(0);
        let mut token_bytes = Vec::new();
        for id in 0..ids {
            let Some(token) = tokenizer.id_to_token(id) else {
                offsets.push(u32::try_from(bytes.len()).ok()?);
                continue;
            };
            token_bytes.clear();
            let mapped = token
                .chars()
                .all(|c| match table.get(c as usize).copied().flatten() {
                    Some(b) => {
                        token_bytes.push(b);
                        true
                    }
                    None => false,
                });
            if mapped {
                bytes.extend_from_slice(&token_bytes);
            } else {
                bytes.extend_from_slice(token.as_bytes());
            }
            offsets.push(u32::try_from(bytes.len()).ok()?);
        }
        bytes.shrink_to_fit();
        Some(Self { offsets, bytes })
    }

    /// The bytes of `id` (`None` past the vocabulary: HF skips such ids).
    fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        let id = id as usize;
        let end = *self.offsets.get(id + 1)? as usize;
        Some(&self.bytes[self.offsets[id] as usize..end])
    }

    /// `tokenizer.decode(ids, skip_special_tokens=False)`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = Vec::with_capacity(ids.len() * 6);
        for &id in ids {
            if let Some(bytes) = self.token_bytes(id) {
                out.extend_from_slice(bytes);
            }
        }
        match String::from_utf8(out) {
            Ok(text) => text,
            Err(err) => String::from_utf8_lossy(err.as_bytes()).into_owned(),
        }
    }
}

/// The decoder for `tokenizer`, shared, or `None` (see [`FastDecoder::new`]).
pub fn shared(tokenizer: &Tokenizer) -> Option<Arc<FastDecoder>> {
    FastDecoder::new(tokenizer).map(Arc::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_inverse_matches_gpt2() {
        // Printable bytes map to themselves; space is 'Ġ' (U+0120), newline 'Ċ' (U+010A),
        // byte 0 is U+0100, 0xAD (soft hyphen) is U+0143.
        assert_eq!(char_byte('a'), Some(b'a'));
        assert_eq!(char_byte('\u{120}'), Some(b' '));
        assert_eq!(char_byte('\u{10A}'), Some(b'\n'));
        assert_eq!(char_byte('\u{100}'), Some(0));
        assert_eq!(char_byte('\u{143}'), Some(0xAD));
        assert_eq!(char_byte(' '), None);
        assert_eq!(char_byte('\u{144}'), None);
        let all: std::collections::BTreeSet<u8> = (0u32..512)
            .filter_map(|c| char::from_u32(c).and_then(char_byte))
            .collect();
        assert_eq!(all.len(), 256);
    }
}
