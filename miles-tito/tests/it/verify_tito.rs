//! Miles' template verifier cases (`fixtures/tito/verify_chat_template_trajectories.json`,
//! 17 trajectories / 43 cases) against the real tokenizers and templates.

use std::path::PathBuf;

use miles_tito::{
    ChatTemplate, HfChat, ThinkingMode, TitoFamily, TitoTokenizer, Trajectory, VerifyTarget,
    parse_trajectories, verify,
};
use serde_json::{Map, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

fn trajectories() -> Vec<Trajectory> {
    let text = std::fs::read_to_string(root().join("tito/verify_chat_template_trajectories.json"))
        .unwrap();
    parse_trajectories(&text).unwrap()
}

fn chat(dir: &str, template: Option<&str>) -> HfChat {
    let chat = HfChat::load(root().join("tokenizers").join(dir)).unwrap();
    match template {
        Some(file) => chat
            .with_template_source(
                std::fs::read_to_string(root().join("tokenizers").join(file)).unwrap(),
            )
            .unwrap(),
        None => chat,
    }
}

fn run_tito(
    dir: &str,
    template: Option<&str>,
    family: TitoFamily,
    thinking: ThinkingMode,
) -> miles_tito::VerifyReport {
    let chat = chat(dir, template);
    let tito = TitoTokenizer::new(&chat, family, Map::new()).unwrap();
    let report = verify(
        &VerifyTarget::Tito {
            tito: &tito,
            kwargs: Map::new(),
            source: format!("{family}"),
        },
        &trajectories(),
        thinking,
    )
    .unwrap();
    println!("{}", report.render());
    report
}

#[test]
fn fixture_has_43_cases() {
    let t = trajectories();
    assert_eq!(t.len(), 17);
    assert_eq!(
        t.iter()
            .map(|t| t.pretokenize_positions.len())
            .sum::<usize>(),
        43
    );
}

#[test]
fn qwen3_family_passes_all_cases() {
    for thinking in [ThinkingMode::Off, ThinkingMode::On, ThinkingMode::Both] {
        let report = run_tito("qwen3", None, TitoFamily::Qwen3, thinking);
        assert!(report.passed(), "{}", report.render());
        assert!(!report.results.is_empty());
    }
    let both = run_tito("qwen3", None, TitoFamily::Qwen3, ThinkingMode::Both);
    // 43 cases minus those whose boundary is followed by an assistant message, twice.
    assert!(
        both.results
            .iter()
            .any(|r| r.name == "single_tool-N3-clear_thinking_off-enable_thinking_on")
    );
}

#[test]
fn qwennext_and_qwen35_families_pass() {
    let report = run_tito("qwen3", None, TitoFamily::QwenNext, ThinkingMode::Both);
    assert!(report.passed(), "{}", report.render());
    let report = run_tito("qwen3", None, TitoFamily::Qwen35, ThinkingMode::Both);
    assert!(report.passed(), "{}", report.render());
    // qwen35 does not allow system appends: those trajectories are filtered out.
    assert!(
        report
            .results
            .iter()
            .all(|r| !r.name.starts_with("retry_system"))
    );
}

#[test]
fn glm47_family_passes_with_glm_4_7_flash_template() {
    let report = run_tito(
        "glm-4.5",
        Some("glm-4.5/templates/glm-4.7-flash.jinja"),
        TitoFamily::Glm47,
        ThinkingMode::Both,
    );
    assert!(report.passed(), "{}", report.render());
}

#[test]
fn kimi_families_pass() {
    let report = run_tito("kimi-k2", None, TitoFamily::Kimi25, ThinkingMode::Both);
    assert!(report.passed(), "{}", report.render());
    let report = run_tito("kimi-k2", None, TitoFamily::Kimi26, ThinkingMode::Both);
    assert!(report.passed(), "{}", report.render());
}

#[test]
fn raw_mode_original_qwen3_is_not_append_only_fixed_is() {
    let original = chat("qwen3", None);
    let report = verify(
        &VerifyTarget::Raw {
            template: original.template(false).unwrap(),
            kwargs: Map::new(),
            source: "qwen3".into(),
        },
        &trajectories(),
        ThinkingMode::Both,
    )
    .unwrap();
    println!("{}", report.render());
    assert!(!report.passed());
    assert!(
        report
            .render()
            .contains("Verdict: FAIL - template is NOT append-only after last user message")
    );

    let fixed = ChatTemplate::new(TitoFamily::Qwen3.fixed_template().unwrap().1).unwrap();
    let mut kwargs = Map::new();
    kwargs.insert("clear_thinking".into(), Value::Bool(false));
    let report = verify(
        &VerifyTarget::Raw {
            template: &fixed,
            kwargs,
            source: "qwen3_fixed.jinja".into(),
        },
        &trajectories(),
        ThinkingMode::Both,
    )
    .unwrap();
    println!("{}", report.render());
    assert!(report.passed());
}

#[test]
fn tito_mode_with_original_qwen3_template_fails() {
    let chat = chat("qwen3", None);
    let original = chat.template(false).unwrap().clone();
    let tito =
        TitoTokenizer::with_template(&chat, original, TitoFamily::Qwen3, Map::new()).unwrap();
    let report = verify(
        &VerifyTarget::Tito {
            tito: &tito,
            kwargs: Map::new(),
            source: "qwen3 original".into(),
        },
        &trajectories(),
        ThinkingMode::On,
    )
    .unwrap();
    println!("{}", report.render());
    assert!(!report.passed());
    assert!(
        report.render().contains(
            "Verdict: FAIL - TITO incremental tokenization did NOT match standard render"
        )
    );
    assert!(report.results.iter().any(|r| {
        r.error.as_deref().is_some_and(|e| {
            e.contains("Decode-roundtrip mismatch") || e.contains("rendered suffix diff failed")
        })
    }));
}
