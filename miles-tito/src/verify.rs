//! Chat-template verifier (Miles' `scripts/tools/verify_chat_template.py`).
//!
//! Runs trajectories (Miles' 17 trajectories / 43 cases, or any the user gives) against a
//! template. *Raw mode* checks that the template is append-only as text: for every boundary
//! `N`, `render(msgs[:N], gen=False)` must be a prefix of `render(msgs, gen=True)`. *TITO
//! mode* checks the incremental path of a family: the stored ids of `msgs[:N]` (with the
//! stop tokens stripped where the model would have stopped), merged with the incremental
//! tokens of the following non-assistant run `msgs[N..M]`, must decode to exactly
//! `render(msgs[:M], gen=True)`.

use std::fmt::Write as _;

use miles_core::{Message, Role, ToolSpec};
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::args::RenderArgs;
use crate::error::{Error, Result};
use crate::family::ALL_ROLES;
use crate::template::ChatTemplate;
use crate::tito::{TitoTokenizer, miles_normalise};

/// One trajectory: a conversation and the boundaries at which a session would have stored
/// tokens.
#[derive(Debug, Clone, Deserialize)]
pub struct Trajectory {
    /// Short snake-case name (`single_tool`).
    pub short_name: String,
    /// Message counts after which the prefix is pretokenized (`N`).
    pub pretokenize_positions: Vec<usize>,
    /// Roles appended after those boundaries.
    pub append_roles: Vec<Role>,
    /// Whether the trajectory carries reasoning (selected by `--thinking on`).
    pub is_thinking: bool,
    /// Tools offered.
    #[serde(default)]
    pub tools: Option<Vec<ToolSpec>>,
    /// The conversation.
    pub messages: Vec<Message>,
}

#[derive(Deserialize)]
struct TrajectoryFile {
    trajectories: Vec<Trajectory>,
}

/// Miles' verifier trajectories (`verify_chat_template_trajectories.json`, the copy this crate
/// ships): what `miles tito verify` runs when no trajectories file is given.
pub const DEFAULT_TRAJECTORIES: &str =
    include_str!("../data/verify_chat_template_trajectories.json");

/// Parses a trajectories file (`{"trajectories": [...]}` as in
/// `verify_chat_template_trajectories.json`, or a bare list).
pub fn parse_trajectories(text: &str) -> Result<Vec<Trajectory>> {
    let value: Json = serde_json::from_str(text).map_err(|e| Error::json("trajectories", e))?;
    let result = if value.is_array() {
        serde_json::from_value(value)
    } else {
        serde_json::from_value::<TrajectoryFile>(value).map(|f| f.trajectories)
    };
    result.map_err(|e| Error::json("trajectories", e))
}

/// Which trajectories and kwargs variants to run (`--thinking`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThinkingMode {
    /// Non-thinking trajectories, no extra kwargs.
    Off,
    /// Thinking trajectories with `enable_thinking=true` (Miles' default).
    On,
    /// All trajectories, each with `enable_thinking` true and false.
    Both,
}

impl ThinkingMode {
    /// Parses `off`, `on`, `both`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "off" => Ok(Self::Off),
            "on" => Ok(Self::On),
            "both" => Ok(Self::Both),
            other => Err(Error::InvalidInput(format!(
                "--thinking must be off, on or both, got {other:?}"
            ))),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::On => "on",
            Self::Both => "both",
        }
    }

    fn selects(self, is_thinking: bool) -> bool {
        match self {
            Self::Off => !is_thinking,
            Self::On => is_thinking,
            Self::Both => true,
        }
    }

    fn variants(self) -> Vec<Map<String, Json>> {
        let flag = |on: bool| {
            let mut m = Map::new();
            m.insert("enable_thinking".into(), Json::Bool(on));
            m
        };
        match self {
            Self::Off => vec![Map::new()],
            Self::On => vec![flag(true)],
            Self::Both => vec![flag(true), flag(false)],
        }
    }
}

/// What is verified.
pub enum VerifyTarget<'a> {
    /// Raw string mode: a template and the kwargs to render with.
    Raw {
        /// The template.
        template: &'a ChatTemplate,
        /// Extra kwargs merged over each thinking variant.
        kwargs: Map<String, Json>,
        /// Where the template came from (printed).
        source: String,
    },
    /// TITO mode: a family tokenizer (its template and forced kwargs).
    Tito {
        /// The tokenizer.
        tito: &'a TitoTokenizer,
        /// Extra kwargs merged over each thinking variant.
        kwargs: Map<String, Json>,
        /// Where the template came from (printed).
        source: String,
    },
}

/// The outcome of one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaseResult {
    /// Case id (`single_tool-N3-enable_thinking_on`).
    pub name: String,
    /// `None` on PASS, else the error text.
    pub error: Option<String>,
    /// First diverging character position, when the texts differ.
    pub diverge_at: Option<usize>,
}

/// The verifier's report.
#[derive(Debug, Clone)]
pub struct VerifyReport {
    /// Header lines (template source, capability, thinking mode, kwargs, selection).
    pub header: Vec<String>,
    /// Per-case results.
    pub results: Vec<CaseResult>,
    /// Whether TITO mode was used.
    pub tito_mode: bool,
}

impl VerifyReport {
    /// Whether every case passed.
    pub fn passed(&self) -> bool {
        self.results.iter().all(|r| r.error.is_none())
    }

    /// The verdict line.
    pub fn verdict(&self) -> &'static str {
        match (self.tito_mode, self.passed()) {
            (false, true) => "Verdict: PASS - template IS append-only after last user message",
            (false, false) => "Verdict: FAIL - template is NOT append-only after last user message",
            (true, true) => "Verdict: PASS - TITO incremental tokenization matched standard render",
            (true, false) => {
                "Verdict: FAIL - TITO incremental tokenization did NOT match standard render"
            }
        }
    }

    /// The full printable report, Miles' layout.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for line in &self.header {
            let _ = writeln!(out, "{line}");
        }
        let width = self.results.iter().map(|r| r.name.len()).max().unwrap_or(0);
        for r in &self.results {
            match &r.error {
                None => {
                    let _ = writeln!(out, "  [PASS] {}", r.name);
                }
                Some(err) => {
                    let first = err.lines().next().unwrap_or_default();
                    let short = if first.chars().count() > 80 {
                        format!("{}...", first.chars().take(77).collect::<String>())
                    } else {
                        first.to_owned()
                    };
                    let _ = writeln!(out, "  [FAIL] {:width$}  -- {short}", r.name);
                }
            }
        }
        let passed = self.results.iter().filter(|r| r.error.is_none()).count();
        let _ = writeln!(
            out,
            "Results: {passed}/{} passed, {} failed",
            self.results.len(),
            self.results.len() - passed
        );
        let _ = writeln!(out, "{}", self.verdict());
        out
    }
}

fn case_suffix(kwargs: &Map<String, Json>) -> String {
    let mut parts: Vec<String> = kwargs
        .iter()
        .map(|(k, v)| match v {
            Json::Bool(true) => format!("{k}_on"),
            Json::Bool(false) => format!("{k}_off"),
            Json::String(s) => format!("{k}={s}"),
            other => format!("{k}={other}"),
        })
        .collect();
    parts.sort();
    parts.iter().map(|p| format!("-{p}")).collect()
}

fn first_diff(a: &str, b: &str) -> usize {
    a.chars()
        .zip(b.chars())
        .position(|(x, y)| x != y)
        .unwrap_or_else(|| a.chars().count().min(b.chars().count()))
}

fn context(text: &str, at: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    let lo = at.saturating_sub(60);
    let hi = (at + 60).min(chars.len());
    chars[lo..hi]
        .iter()
        .collect::<String>()
        .escape_debug()
        .to_string()
}

fn tail(text: &str, n: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    chars[chars.len().saturating_sub(n)..]
        .iter()
        .collect::<String>()
        .escape_debug()
        .to_string()
}

fn tools_json(tools: &Option<Vec<ToolSpec>>) -> Option<Vec<Json>> {
    tools.as_ref().map(|t| crate::template::tools_to_json(t))
}

fn render_raw(
    template: &ChatTemplate,
    messages: &[Message],
    tools: Option<&[Json]>,
    gen_prompt: bool,
    kwargs: &Map<String, Json>,
) -> Result<String> {
    let messages = miles_normalise(messages)?;
    template.render(RenderArgs {
        messages: &messages,
        tools,
        add_generation_prompt: gen_prompt,
        kwargs,
    })
}

fn raw_case(
    template: &ChatTemplate,
    traj: &Trajectory,
    n: usize,
    kwargs: &Map<String, Json>,
) -> (Option<String>, Option<usize>) {
    let tools = tools_json(&traj.tools);
    let n = n.min(traj.messages.len());
    let prefix = render_raw(
        template,
        &traj.messages[..n],
        tools.as_deref(),
        false,
        kwargs,
    );
    let full = render_raw(template, &traj.messages, tools.as_deref(), true, kwargs);
    match (prefix, full) {
        (Err(e), _) | (_, Err(e)) => (Some(format!("Render error: {e}")), None),
        (Ok(prefix), Ok(full)) => {
            if full.starts_with(&prefix) {
                (None, None)
            } else {
                let at = first_diff(&prefix, &full);
                (
                    Some(format!(
                        "Prefix mismatch! (N={n}) at char {at}; prefix tail: \"{}\" | full around: \"{}\"",
                        tail(&prefix, 200),
                        context(&full, at)
                    )),
                    Some(at),
                )
            }
        }
    }
}

fn tito_case(tito: &TitoTokenizer, traj: &Trajectory, n: usize) -> (Option<String>, Option<usize>) {
    let msgs = &traj.messages;
    let tools = tools_json(&traj.tools);
    let mut m = n;
    while m < msgs.len() && msgs[m].role != Role::Assistant {
        m += 1;
    }
    let run = || -> Result<(String, String)> {
        let prefix_text = tito.render(&msgs[..n], tools.as_deref(), false)?;
        let mut prefix_ids = tito.encode(&prefix_text)?;
        while prefix_ids
            .last()
            .is_some_and(|id| tito.trailing_token_ids().contains(id))
        {
            prefix_ids.pop();
        }
        let merged = tito.merge_tokens(&msgs[..n], &msgs[..m], &prefix_ids, tools.as_deref())?;
        let decoded = tito.decode(&merged)?;
        let expected = tito.render(&msgs[..m], tools.as_deref(), true)?;
        Ok((decoded, expected))
    };
    match run() {
        Err(e) => (Some(format!("TITO error (N={n}): {e}")), None),
        Ok((decoded, expected)) if decoded == expected => (None, None),
        Ok((decoded, expected)) => {
            let at = first_diff(&decoded, &expected);
            (
                Some(format!(
                    "Decode-roundtrip mismatch (N={n}) at char {at}: merged \"{}\" vs standard \"{}\"",
                    context(&decoded, at),
                    context(&expected, at)
                )),
                Some(at),
            )
        }
    }
}

/// Runs the verifier over `trajectories`.
pub fn verify(
    target: &VerifyTarget<'_>,
    trajectories: &[Trajectory],
    thinking: ThinkingMode,
) -> Result<VerifyReport> {
    let (tito_mode, allowed, base_kwargs, source): (bool, Vec<Role>, Map<String, Json>, &str) =
        match target {
            VerifyTarget::Raw { kwargs, source, .. } => {
                (false, ALL_ROLES.to_vec(), kwargs.clone(), source)
            }
            VerifyTarget::Tito {
                tito,
                kwargs,
                source,
            } => (
                true,
                tito.family().allowed_append_roles().to_vec(),
                kwargs.clone(),
                source,
            ),
        };
    let total_cases: usize = trajectories
        .iter()
        .map(|t| t.pretokenize_positions.len())
        .sum();
    let selected: Vec<&Trajectory> = trajectories
        .iter()
        .filter(|t| t.append_roles.iter().all(|r| allowed.contains(r)))
        .filter(|t| thinking.selects(t.is_thinking))
        .collect();
    let selected_cases: usize = selected.iter().map(|t| t.pretokenize_positions.len()).sum();
    let mut header = vec![
        format!("Template source: {source}"),
        format!(
            "Append capability: {}",
            allowed
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!("Thinking mode: {}", thinking.name()),
    ];
    let mut forced = Map::new();
    if let VerifyTarget::Tito { tito, .. } = target {
        for (k, v) in tito.family().forced_kwargs() {
            if !base_kwargs.contains_key(&k) {
                header.push(format!(
                    "Auto-set --chat-template-kwargs {k}={v} (from --tito-model={})",
                    tito.family()
                ));
            }
            forced.insert(k, v);
        }
    }
    if !base_kwargs.is_empty() {
        header.push(format!(
            "Template kwargs: {}",
            Json::Object(base_kwargs.clone())
        ));
    }
    header.push(format!(
        "Selected trajectories: {selected_cases} of {total_cases} (after filtering)"
    ));

    let mut results = Vec::new();
    for variant in thinking.variants() {
        let mut kwargs = variant;
        for (k, v) in forced.iter().chain(&base_kwargs) {
            kwargs.insert(k.clone(), v.clone());
        }
        let tito_for_variant = match target {
            VerifyTarget::Tito { tito, .. } => Some(tito.clone_with_chat_template_kwargs(&kwargs)?),
            VerifyTarget::Raw { .. } => None,
        };
        for traj in &selected {
            for &n in &traj.pretokenize_positions {
                if tito_mode
                    && traj
                        .messages
                        .get(n)
                        .is_none_or(|m| m.role == Role::Assistant)
                {
                    continue;
                }
                let name = format!("{}-N{n}{}", traj.short_name, case_suffix(&kwargs));
                let (error, diverge_at) = match (target, &tito_for_variant) {
                    (VerifyTarget::Raw { template, .. }, _) => raw_case(template, traj, n, &kwargs),
                    (VerifyTarget::Tito { .. }, Some(tito)) => tito_case(tito, traj, n),
                    (VerifyTarget::Tito { .. }, None) => (Some("internal".into()), None),
                };
                results.push(CaseResult {
                    name,
                    error,
                    diverge_at,
                });
            }
        }
    }
    Ok(VerifyReport {
        header,
        results,
        tito_mode,
    })
}
