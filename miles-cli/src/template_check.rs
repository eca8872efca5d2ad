//! Is a model directory safe for token-in-token-out (TITO) multi-turn RL? The checks behind
//! the `verify_template` example.
//!
//! 1. **Tokenizer**: `tokenizer.json` loads; the EOS token of `tokenizer_config.json` is one
//!    id; every added / special token encodes to exactly its own id; `decode(encode(text))`
//!    gives `text` back for every rendered verifier conversation.
//! 2. **Raw template** (miles-tito's verifier, raw mode): the directory's own chat template
//!    is append-only as text. Informational when the TITO family brings its own fixed
//!    template (as Miles' `qwen3` family does), since that template is the one sessions use.
//! 3. **TITO mode** (miles-tito's verifier): for the family (`--tito`, or detected from
//!    `config.json`'s `model_type` and the special tokens by [`TitoFamily::detect`]), merging stored ids with the incremental tokens of appended messages
//!    decodes to exactly the standard render, on Miles' 17 trajectories (43 cases).
//!
//! The directory is TITO-safe when 1 and 3 pass.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use miles_tito::{
    HfChat, ThinkingMode, TitoFamily, TitoTokenizer, Trajectory, VerifyReport, VerifyTarget,
    parse_trajectories, verify,
};
use serde_json::{Map, Value};

use crate::error::Error;

/// Miles' verifier trajectories (the copy miles-tito ships).
pub use miles_tito::DEFAULT_TRAJECTORIES;

/// What to check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The model directory.
    pub model: PathBuf,
    /// A chat template file replacing the directory's (and the family's fixed template).
    pub template: Option<PathBuf>,
    /// The TITO family; `None`: detected with [`TitoFamily::detect`].
    pub family: Option<TitoFamily>,
    /// Which trajectories / `enable_thinking` variants to run.
    pub thinking: ThinkingMode,
    /// Extra chat-template kwargs.
    pub kwargs: Map<String, Value>,
    /// A trajectories file replacing Miles' default set.
    pub trajectories: Option<PathBuf>,
}

impl CheckOptions {
    /// Defaults for `model`: detected family, thinking `on` (Miles' default), no kwargs.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        Self {
            model: model.into(),
            template: None,
            family: None,
            thinking: ThinkingMode::On,
            kwargs: Map::new(),
            trajectories: None,
        }
    }
}

/// One tokenizer check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// `None` on pass, else why it failed.
    pub failure: Option<String>,
}

/// The outcome of [`check_model_dir`].
#[derive(Debug, Clone)]
pub struct TemplateCheck {
    /// The directory checked.
    pub model: PathBuf,
    /// The family used in TITO mode.
    pub family: TitoFamily,
    /// Whether the family was detected (no `--tito`).
    pub family_guessed: bool,
    /// Tokenizer checks.
    pub tokenizer: Vec<Check>,
    /// Raw-mode verifier report on the directory's own template.
    pub raw: VerifyReport,
    /// TITO-mode verifier report.
    pub tito: VerifyReport,
}

impl TemplateCheck {
    /// Whether every tokenizer check passed.
    pub fn tokenizer_ok(&self) -> bool {
        self.tokenizer.iter().all(|c| c.failure.is_none())
    }

    /// Tokenizer checks and TITO mode passed.
    pub fn tito_safe(&self) -> bool {
        self.tokenizer_ok() && self.tito.passed()
    }

    /// Whether the raw result decides anything (the family uses the directory's template).
    pub fn raw_is_informational(&self) -> bool {
        self.family.fixed_template().is_some()
    }

    /// The printable report.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "Model directory: {}", self.model.display());
        let _ = writeln!(out, "\n== 1. Tokenizer");
        for c in &self.tokenizer {
            match &c.failure {
                None => {
                    let _ = writeln!(out, "  [PASS] {}", c.name);
                }
                Some(why) => {
                    let _ = writeln!(out, "  [FAIL] {} -- {why}", c.name);
                }
            }
        }
        let _ = writeln!(
            out,
            "\n== 2. Raw template: append-only as text{}",
            if self.raw_is_informational() {
                " (informational: the family renders with its own fixed template)"
            } else {
                ""
            }
        );
        out.push_str(&self.raw.render());
        let _ = writeln!(
            out,
            "\n== 3. TITO mode: --tito {}{}",
            self.family,
            if self.family_guessed {
                " (detected from config.json and the special tokens; pass --tito to choose)"
            } else {
                ""
            }
        );
        out.push_str(&self.tito.render());
        let _ = writeln!(
            out,
            "\n{}",
            if self.tito_safe() {
                format!(
                    "TITO-SAFE: yes, with --tito {} (tokenizer checks and TITO mode pass)",
                    self.family
                )
            } else if !self.tokenizer_ok() {
                "TITO-SAFE: NO - tokenizer checks failed".to_string()
            } else {
                format!(
                    "TITO-SAFE: NO - incremental tokenization with --tito {} does not match the \
                     standard render",
                    self.family
                )
            }
        );
        out
    }
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

fn tokenizer_checks(
    chat: &HfChat,
    tito: &TitoTokenizer,
    trajectories: &[Trajectory],
) -> Vec<Check> {
    let tokenizer = tito.tokenizer();
    let mut checks = vec![Check {
        name: format!(
            "tokenizer.json loads ({} ids with added tokens)",
            tokenizer.get_vocab_size(true)
        ),
        failure: None,
    }];
    let eos = chat
        .special_tokens()
        .get("eos_token")
        .and_then(Value::as_str);
    checks.push(match eos {
        None => Check {
            name: "eos_token is set".into(),
            failure: Some("tokenizer_config.json has no eos_token: the engine cannot stop".into()),
        },
        Some(eos) => {
            let ids = tito.encode(eos).unwrap_or_default();
            Check {
                name: format!("eos_token {eos:?} is one id ({ids:?})"),
                failure: (ids.len() != 1 || tokenizer.token_to_id(eos) != ids.first().copied())
                    .then(|| format!("{eos:?} encodes to {ids:?}")),
            }
        }
    });
    let mut added: Vec<(u32, String)> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .map(|(id, t)| (id, t.content))
        .collect();
    added.sort();
    let broken: Vec<String> = added
        .iter()
        .filter(|(id, content)| tito.encode(content).ok().as_deref() != Some(&[*id][..]))
        .map(|(id, content)| format!("{content:?} ({id})"))
        .collect();
    checks.push(Check {
        name: format!(
            "each of the {} added tokens encodes to its own id",
            added.len()
        ),
        failure: (!broken.is_empty()).then(|| format!("not one id: {}", broken.join(", "))),
    });
    let mut renders = 0usize;
    let mut mismatches = Vec::new();
    for t in trajectories {
        let tools = t
            .tools
            .as_ref()
            .map(|tools| miles_tito::tools_to_json(tools));
        let Ok(text) = tito.render(&t.messages, tools.as_deref(), false) else {
            continue; // render failures are reported by the verifier
        };
        renders += 1;
        let round_trip = tito.encode(&text).and_then(|ids| tito.decode(&ids));
        match round_trip {
            Ok(back) if back == text => {}
            Ok(_) => mismatches.push(t.short_name.clone()),
            Err(e) => mismatches.push(format!("{} ({e})", t.short_name)),
        }
    }
    checks.push(Check {
        name: format!("decode(encode(render)) == render on {renders} conversations"),
        failure: (!mismatches.is_empty() || renders == 0).then(|| {
            if renders == 0 {
                "no conversation could be rendered".to_string()
            } else {
                format!("differs for {}", mismatches.join(", "))
            }
        }),
    });
    checks
}

/// Runs the three checks on a model directory. Load failures (no directory, no tokenizer,
/// no chat template, unreadable files) are errors; check failures are in the report.
pub fn check_model_dir(options: &CheckOptions) -> Result<TemplateCheck, Error> {
    let mut chat = HfChat::load(&options.model)?;
    if let Some(path) = &options.template {
        chat = chat.with_template_source(read(path)?)?;
    }
    let trajectories = match &options.trajectories {
        Some(path) => parse_trajectories(&read(path)?)?,
        None => parse_trajectories(DEFAULT_TRAJECTORIES)?,
    };
    let family_guessed = options.family.is_none();
    let family = options.family.unwrap_or_else(|| {
        TitoFamily::detect(chat.model_type(), chat.tokenizer().map(|t| t.as_ref()))
    });
    if family.deepseek_encoder().is_some() {
        // The report compares the directory's Jinja template with the family's; a DeepSeek
        // family renders with its Python-equivalent encoder instead.
        return Err(Error::Invalid {
            what: "--tito family for this check",
            reason: format!(
                "{family} renders with the DeepSeek encoder, not a Jinja template; verify it \
                 with `miles tito verify --model DIR --tito {family}`"
            ),
        });
    }
    let tito = if options.template.is_some() {
        let template = chat.template(false)?.clone();
        TitoTokenizer::with_template(&chat, template, family, options.kwargs.clone())?
    } else {
        TitoTokenizer::new(&chat, family, options.kwargs.clone())?
    };
    let source = options
        .template
        .as_ref()
        .unwrap_or(&options.model)
        .display()
        .to_string();
    let raw = verify(
        &VerifyTarget::Raw {
            template: chat.template(false)?,
            kwargs: options.kwargs.clone(),
            source: source.clone(),
        },
        &trajectories,
        options.thinking,
    )?;
    let tito_source = match (&options.template, family.fixed_template()) {
        (None, Some((name, _))) => format!("{name} (fixed template of --tito {family})"),
        _ => source,
    };
    let tito_report = verify(
        &VerifyTarget::Tito {
            tito: &tito,
            kwargs: options.kwargs.clone(),
            source: tito_source,
        },
        &trajectories,
        options.thinking,
    )?;
    Ok(TemplateCheck {
        model: options.model.clone(),
        family,
        family_guessed,
        tokenizer: tokenizer_checks(&chat, &tito, &trajectories),
        raw,
        tito: tito_report,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_path(relative: &str) -> Result<PathBuf, std::convert::Infallible> {
        Ok(Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures")
            .join(relative))
    }

    #[test]
    fn a_deepseek_family_is_refused_with_the_command_that_checks_it() {
        let dir = fixture_path("tokenizers/deepseek-v32").unwrap();
        let options = CheckOptions {
            family: Some(TitoFamily::DeepseekV32),
            ..CheckOptions::new(&dir)
        };
        match check_model_dir(&options) {
            Err(Error::Invalid { reason, .. }) => {
                assert!(
                    reason.contains("miles tito verify --model DIR --tito deepseekv32"),
                    "{reason}"
                );
            }
            other => panic!(
                "expected Error::Invalid, got {:?}",
                other.map(|c| c.render())
            ),
        }
    }

    #[test]
    fn qwen3_is_tito_safe_with_its_family() {
        let dir = fixture_path("tokenizers/qwen3").unwrap();
        let check = check_model_dir(&CheckOptions::new(&dir)).unwrap();
        assert_eq!(check.family, TitoFamily::Qwen3);
        assert!(check.family_guessed);
        assert!(check.tokenizer_ok(), "{}", check.render());
        assert!(check.tito.passed(), "{}", check.render());
        assert!(check.tito_safe());
        let text = check.render();
        assert!(text.contains("TITO-SAFE: yes, with --tito qwen3"), "{text}");
        assert!(
            text.contains("eos_token \"<|im_end|>\" is one id ([151645])"),
            "{text}"
        );
        // Miles' verifier selects the thinking trajectories with thinking "on".
        assert!(!check.tito.results.is_empty());
    }

    #[test]
    fn qwen3s_own_template_is_not_tito_safe_without_the_fixed_one() {
        // The HF Qwen3 template drops earlier turns' reasoning, so with the `default` family
        // (the directory's own template, no boundary rule) incremental ids cannot match.
        let dir = fixture_path("tokenizers/qwen3").unwrap();
        let options = CheckOptions {
            family: Some(TitoFamily::Default),
            ..CheckOptions::new(&dir)
        };
        let check = check_model_dir(&options).unwrap();
        assert!(check.tokenizer_ok());
        assert!(!check.tito.passed());
        assert!(!check.tito_safe());
        assert!(!check.raw_is_informational());
        assert!(check.render().contains("TITO-SAFE: NO"));
    }

    #[test]
    fn missing_directories_are_errors() {
        assert!(check_model_dir(&CheckOptions::new("/no/such/model")).is_err());
    }
}
