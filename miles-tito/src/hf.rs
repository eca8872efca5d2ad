//! HF tokenizers' own encode and decode, as transformers calls them for chat templates.

use tokenizers::Tokenizer;

use crate::error::{Error, Result};

/// `tokenizer(text, add_special_tokens=False)["input_ids"]`.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    tokenizer
        .encode_fast(text, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

/// `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)`: the response text as
/// SGLang's detokenizer makes it (with `true`, every added token marked special is left out).
pub fn decode_text(
    tokenizer: &Tokenizer,
    ids: &[u32],
    skip_special_tokens: bool,
) -> Result<String> {
    tokenizer
        .decode(ids, skip_special_tokens)
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

/// Decodes ids keeping special tokens (what Miles' verifier and comparator do).
pub fn decode(tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
    tokenizer
        .decode(ids, false)
        .map_err(|e| Error::Tokenizer(e.to_string()))
}
