//! [`TitoFamily::detect`] on the model directories under `fixtures/`: tokenizer directories
//! (a vocabulary, sometimes a `config.json`) and checkpoint directories (a `config.json`
//! only), plus the cases where the two kinds of evidence disagree.

use std::path::PathBuf;

use miles_tito::{HfChat, TitoFamily};

fn fixture(path: &str) -> HfChat {
    HfChat::load(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures")
            .join(path),
    )
    .unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn detect(chat: &HfChat) -> TitoFamily {
    TitoFamily::detect(chat.model_type(), chat.tokenizer().map(|t| t.as_ref()))
}

#[test]
fn fixture_directories_detect_their_family() {
    let cases = [
        // Vocabulary only: the special tokens decide.
        ("tokenizers/qwen3", TitoFamily::Qwen3),
        ("tokenizers/glm-4.5", TitoFamily::Glm47),
        ("tokenizers/kimi-k2", TitoFamily::Kimi25),
        ("tokenizers/llama3.1", TitoFamily::Default),
        ("tokenizers/deepseek-v3", TitoFamily::Default),
        // config.json and vocabulary agree.
        ("tokenizers/deepseek-v32", TitoFamily::DeepseekV32),
        ("tokenizers/deepseek-v4", TitoFamily::DeepseekV4),
        ("serve/qwen3-tiny-chat", TitoFamily::Qwen3),
        // config.json only: the model_type decides.
        ("models/qwen3-tiny", TitoFamily::Qwen3),
        ("models/qwen3moe-tiny", TitoFamily::Qwen3),
        ("models/glm4moe-tiny", TitoFamily::Glm47),
        ("models/llama-tiny", TitoFamily::Default),
        ("models/qwen2-tiny", TitoFamily::Default),
        ("models/dsv3-tiny", TitoFamily::Default),
        ("models/variants/kimi-k2", TitoFamily::Default),
    ];
    for (path, family) in cases {
        assert_eq!(detect(&fixture(path)), family, "{path}");
    }
}

#[test]
fn a_vocabulary_without_the_marker_overrules_the_model_type() {
    // The workspace's toy checkpoints: a GLM-4 MoE architecture (`model_type` glm4_moe) with
    // a ChatML tokenizer and a Qwen3 template. The model type alone says glm47, whose
    // template and boundary rule need `<|observation|>`; the vocabulary has `<|im_start|>`.
    let qwen3 = fixture("tokenizers/qwen3");
    let vocabulary = qwen3.tokenizer().map(|t| t.as_ref());
    assert_eq!(
        TitoFamily::detect(Some("glm4_moe"), None),
        TitoFamily::Glm47
    );
    assert_eq!(
        TitoFamily::detect(Some("glm4_moe"), vocabulary),
        TitoFamily::Qwen3
    );
    // A model type the table does not list leaves the decision to the vocabulary.
    assert_eq!(
        TitoFamily::detect(Some("qwen2"), vocabulary),
        TitoFamily::Qwen3
    );
    // A listed model type whose marker the vocabulary has wins over the fallback row.
    assert_eq!(
        TitoFamily::detect(Some("qwen3_next"), vocabulary),
        TitoFamily::QwenNext
    );
}

#[test]
fn every_fixture_vocabulary_holds_at_most_one_fallback_marker() {
    // Detection's fallback takes the first row whose marker the vocabulary holds; with one
    // marker per vocabulary the table order does not matter.
    let markers: Vec<&str> = TitoFamily::ALL
        .iter()
        .filter(|f| f.spec().detection.fallback)
        .filter_map(|f| f.spec().detection.marker)
        .collect();
    for path in [
        "tokenizers/qwen3",
        "tokenizers/glm-4.5",
        "tokenizers/kimi-k2",
        "tokenizers/llama3.1",
        "tokenizers/deepseek-v3",
        "tokenizers/deepseek-v32",
        "tokenizers/deepseek-v4",
    ] {
        let chat = fixture(path);
        let tokenizer = chat.tokenizer().expect("a vocabulary");
        let held: Vec<&&str> = markers
            .iter()
            .filter(|m| tokenizer.token_to_id(m).is_some())
            .collect();
        assert!(held.len() <= 1, "{path}: {held:?}");
    }
}
