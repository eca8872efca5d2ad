//! A complete, tiny HF model directory built from nothing: a byte-level BPE tokenizer made
//! with the `tokenizers` crate, Qwen3's chat template and special tokens, and a small
//! GLM-4-MoE `config.json` with randomly initialised safetensors weights.
//!
//! The tokenizer is lossless on any text (byte-level: every byte has a token, so
//! `decode(encode(text)) == text`), which TITO needs. Its base vocabulary is the 256 GPT-2
//! byte symbols, a few merges make the chat template's words (`user`, `assistant`, …) and the
//! task's words single tokens, and digits are never merged (one token per digit, which makes
//! arithmetic learnable). The special / added tokens are Qwen3's, with Qwen3's flags:
//! `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special), `<think>`, `</think>`,
//! `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (added, not special).
//!
//! [`write_model_dir`] writes what `transformers.AutoTokenizer` / `AutoModelForCausalLM` (and
//! so [`miles_tito::HfChat::load`] and [`miles_bridge::CausalLm::from_pretrained`]) read:
//! `tokenizer.json`, `tokenizer_config.json` (with the real Qwen3 `chat_template`),
//! `config.json` (`model_type` `glm4_moe`, `vocab_size` = the tokenizer's size),
//! `generation_config.json` and `model.safetensors`.

use std::path::Path;

use burn::tensor::Device;
use miles_bridge::{CausalLm, ModelConfig};
use miles_core::DType;
use serde_json::{Value, json};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::Error;

/// Qwen3's chat template (the real one, from the repository's Qwen3 tokenizer fixture).
pub const QWEN3_CHAT_TEMPLATE: &str =
    include_str!("../../fixtures/tokenizers/qwen3/chat_template.jinja");

/// End of text; also the padding token.
pub const ENDOFTEXT: &str = "<|endoftext|>";
/// Start of a chat turn.
pub const IM_START: &str = "<|im_start|>";
/// End of a chat turn: the end-of-sequence token the model stops on.
pub const IM_END: &str = "<|im_end|>";

/// The added tokens, in id order after the byte-level vocabulary and merges, with whether
/// each is special (Qwen3's flags).
pub const ADDED_TOKENS: [(&str, bool); 9] = [
    (ENDOFTEXT, true),
    (IM_START, true),
    (IM_END, true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
];

/// Words that get merges (as themselves and with a leading space): the chat template's
/// role names and the words of the addition task's phrasing.
pub const MERGED_WORDS: [&str; 16] = [
    "user",
    "assistant",
    "system",
    "tool",
    "What",
    "is",
    "the",
    "sum",
    "of",
    "and",
    "Add",
    "answer",
    "Answer",
    "plus",
    "equals",
    "think",
];

/// GPT-2's byte → symbol table (printable bytes map to themselves, the others to U+0100 +
/// n in byte order), as used by HF's `ByteLevel` pre-tokenizer and decoder.
pub fn byte_symbols() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    out
}

fn symbols(text: &str, table: &[char; 256]) -> Vec<String> {
    text.bytes()
        .map(|b| table[b as usize].to_string())
        .collect()
}

/// The BPE vocabulary (symbol → id) and merges of the toy tokenizer, without the added
/// tokens: ids `0..256` are the byte symbols in byte order, then one id per merge result.
pub fn vocab_and_merges() -> (Vec<String>, Vec<(String, String)>) {
    vocab_and_merges_with(&[])
}

/// [`vocab_and_merges`] with merges for `extra_words` too (each as itself and with a
/// leading space), after [`MERGED_WORDS`]. A word should be one pre-token of the GPT-2
/// split (letters, or a run of punctuation), or its merges are never used.
pub fn vocab_and_merges_with(extra_words: &[String]) -> (Vec<String>, Vec<(String, String)>) {
    let table = byte_symbols();
    let mut vocab: Vec<String> = table.iter().map(char::to_string).collect();
    let mut merges: Vec<(String, String)> = Vec::new();
    let mut add_word = |pieces: Vec<String>, vocab: &mut Vec<String>| {
        let mut current = pieces[0].clone();
        for piece in &pieces[1..] {
            let merged = format!("{current}{piece}");
            if !vocab.contains(&merged) {
                merges.push((current.clone(), piece.clone()));
                vocab.push(merged.clone());
            }
            current = merged;
        }
    };
    // "\n\n" (one pre-token under the GPT-2 split) as one token.
    add_word(symbols("\n\n", &table), &mut vocab);
    let extra = extra_words.iter().map(String::as_str);
    for word in MERGED_WORDS.into_iter().chain(extra) {
        add_word(symbols(word, &table), &mut vocab);
        add_word(symbols(&format!(" {word}"), &table), &mut vocab);
    }
    (vocab, merges)
}

/// Builds the toy tokenizer (byte-level BPE, no normaliser, no post-processor: HF's
/// Qwen2-style setup, so `add_special_tokens` adds nothing).
pub fn build_tokenizer() -> Result<Tokenizer, Error> {
    build_tokenizer_with(&[])
}

/// [`build_tokenizer`] with merges for `extra_words` ([`vocab_and_merges_with`]).
pub fn build_tokenizer_with(extra_words: &[String]) -> Result<Tokenizer, Error> {
    let (vocab, merges) = vocab_and_merges_with(extra_words);
    let vocab: Vocab = vocab
        .into_iter()
        .enumerate()
        .map(|(id, symbol)| (symbol, id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, false, true)));
    tokenizer.with_decoder(Some(ByteLevel::new(false, false, true)));
    let added: Vec<AddedToken> = ADDED_TOKENS
        .iter()
        .map(|&(content, special)| AddedToken::from(content, special).normalized(false))
        .collect();
    // One call keeps the ids in ADDED_TOKENS order.
    tokenizer.add_tokens(&added);
    Ok(tokenizer)
}

/// The size of a small GLM-4-MoE for the toy tokenizer. Defaults: width 64, 2 layers (the
/// first dense), 4 heads of 16 (2 key/value heads), 8 routed experts top-2 plus one shared
/// expert — about 0.15 M parameters with the toy vocabulary of 380 ids.
#[derive(Debug, Clone, PartialEq)]
pub struct ToyModelSpec {
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers` (the first is dense: `first_k_dense_replace` = 1).
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads`.
    pub num_key_value_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `intermediate_size` of the dense layer.
    pub intermediate_size: usize,
    /// `moe_intermediate_size` of one expert.
    pub moe_intermediate_size: usize,
    /// `n_routed_experts`.
    pub n_routed_experts: usize,
    /// `num_experts_per_tok`.
    pub num_experts_per_tok: usize,
    /// `n_shared_experts`.
    pub n_shared_experts: usize,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `initializer_range`: the standard deviation of the random weights.
    pub initializer_range: f64,
    /// Words the tokenizer merges into single tokens besides [`MERGED_WORDS`]
    /// ([`build_tokenizer_with`]); empty by default.
    pub extra_merged_words: Vec<String>,
}

impl Default for ToyModelSpec {
    fn default() -> Self {
        Self {
            hidden_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            intermediate_size: 128,
            moe_intermediate_size: 32,
            n_routed_experts: 8,
            num_experts_per_tok: 2,
            n_shared_experts: 1,
            max_position_embeddings: 512,
            initializer_range: 0.02,
            extra_merged_words: Vec::new(),
        }
    }
}

/// The ids of the special tokens of a toy tokenizer.
fn token_id(tokenizer: &Tokenizer, token: &str) -> Result<u32, Error> {
    tokenizer
        .token_to_id(token)
        .ok_or_else(|| Error::Tokenizer(format!("{token} is not in the vocabulary")))
}

impl ToyModelSpec {
    /// The HF `config.json` of this spec for a vocabulary of `vocab_size` ids, with the GLM-4
    /// defaults (partial RoPE 0.5, attention bias, sigmoid routing with scaling 1.0, one
    /// expert group) and the given special-token ids.
    pub fn config_json(&self, vocab_size: usize, eos_token_id: u32, pad_token_id: u32) -> Value {
        json!({
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "attention_bias": true,
            "use_qk_norm": false,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5
            },
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": false,
            "hidden_act": "silu",
            "bos_token_id": null,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "num_nextn_predict_layers": 0,
            "torch_dtype": "float32"
        })
    }
}

/// `tokenizer_config.json` for the toy tokenizer: Qwen3's fields (`eos_token`
/// `<|im_end|>`, `pad_token` `<|endoftext|>`, no BOS, `added_tokens_decoder` with the
/// special flags) and its chat template.
pub fn tokenizer_config_json(tokenizer: &Tokenizer) -> Result<Value, Error> {
    let mut decoder = serde_json::Map::new();
    for (content, special) in ADDED_TOKENS {
        decoder.insert(
            token_id(tokenizer, content)?.to_string(),
            json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": special
            }),
        );
    }
    Ok(json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": null,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null
    }))
}

/// What [`write_model_dir`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToyModelInfo {
    /// Vocabulary size (tokenizer with added tokens = the model's `vocab_size`).
    pub vocab_size: usize,
    /// Id of `<|im_end|>` (EOS).
    pub eos_token_id: u32,
    /// Id of `<|endoftext|>` (padding).
    pub pad_token_id: u32,
    /// Number of model parameters.
    pub num_params: usize,
}

fn write_json(path: &Path, value: &Value) -> Result<(), Error> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        source: e,
    })?;
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

/// Writes a complete HF model directory into `dir` (created if missing): tokenizer,
/// tokenizer config with Qwen3's chat template, GLM-4-MoE config of `spec` and randomly
/// initialised f32 weights (`model.safetensors`, burn's initialiser on `device`, seeded by
/// `seed`).
pub fn write_model_dir(
    dir: &Path,
    spec: &ToyModelSpec,
    seed: u64,
    device: &Device,
) -> Result<ToyModelInfo, Error> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tokenizer = build_tokenizer_with(&spec.extra_merged_words)?;
    let tokenizer_path = dir.join("tokenizer.json");
    tokenizer
        .save(&tokenizer_path, false)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", tokenizer_path.display())))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &tokenizer_config_json(&tokenizer)?,
    )?;
    let vocab_size = tokenizer.get_vocab_size(true);
    let eos = token_id(&tokenizer, IM_END)?;
    let pad = token_id(&tokenizer, ENDOFTEXT)?;
    let config = spec.config_json(vocab_size, eos, pad);
    write_json(
        &dir.join("generation_config.json"),
        &json!({
            "bos_token_id": null,
            "eos_token_id": [eos, pad],
            "pad_token_id": pad,
            "do_sample": true,
            "temperature": 1.0,
            "top_p": 1.0
        }),
    )?;
    let model_config = ModelConfig::from_hf_json(&config.to_string())?;
    device.seed(seed);
    let model = CausalLm::init(&model_config, device)?;
    model.save_pretrained(dir, DType::F32, None)?;
    // save_pretrained wrote the config it knows; put back the full one (special-token ids,
    // the GLM-4 fields it does not model).
    write_json(&dir.join("config.json"), &config)?;
    Ok(ToyModelInfo {
        vocab_size,
        eos_token_id: eos,
        pad_token_id: pad,
        num_params: model.num_params(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_symbols_are_gpt2s() {
        let table = byte_symbols();
        // GPT-2: space → 'Ġ' (U+0120), newline → 'Ċ' (U+010A), 'a' → 'a', 0x00 → 'Ā' (U+0100).
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(table[0], 'Ā');
        let alphabet = ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        assert!(table.iter().all(|c| alphabet.contains(c)));
    }

    #[test]
    fn tokenizer_is_lossless_and_splits_digits() {
        let tok = build_tokenizer().unwrap();
        let text = "<|im_start|>user\nWhat is 12+35?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n47<|im_end|>\n héllo ✓";
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
        let ids = tok.encode("user\n1234", false).unwrap().get_ids().to_vec();
        let tokens: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
        assert_eq!(tokens, ["user", "Ċ", "1", "2", "3", "4"]);
        for (content, _) in ADDED_TOKENS {
            let ids = tok.encode(content, false).unwrap().get_ids().to_vec();
            assert_eq!(ids, [tok.token_to_id(content).unwrap()], "{content}");
        }
        // Added tokens come last, in order.
        let base = tok.get_vocab_size(false) as u32;
        assert_eq!(tok.token_to_id(ENDOFTEXT), Some(base));
        assert_eq!(tok.token_to_id("</tool_response>"), Some(base + 8));
        assert_eq!(tok.get_vocab_size(true), base as usize + ADDED_TOKENS.len());
        assert_eq!(
            tok.encode("\n\n", false).unwrap().get_ids().len(),
            1,
            "\\n\\n is one token"
        );
    }
}
