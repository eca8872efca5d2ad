//! The rule registry: every rule of the rm_hub, one file each, listed once in [`RULES`].
//! The rule list ([`crate::RmRule::all`]), `--rm-type` parsing ([`crate::RmType`]) and the
//! unknown-rule error ([`crate::Error::UnknownRmType`]) are all built from this table.
//!
//! Adding a rule: write `rules/<name>.rs` with a `score` function over a
//! [`RuleInput`](crate::rule::RuleInput) (`Scorer::Local` when it computes from the input,
//! `Scorer::Async` when it waits on something), declare `mod <name>;` below and add its row
//! to [`RULES`].

mod dapo;
mod deepscaler;
mod deterministic_random;
mod f1;
mod gemma_math;
mod gpqa;
mod math;
mod random;
mod remote_rm;

use crate::rule::{Rule, Scorer};

pub use dapo::{DapoScore, compute_score as dapo_score};
pub use deepscaler::deepscaler_reward;
pub use deterministic_random::deterministic_random;
pub use f1::f1_score;
pub use gemma_math::gemma_math_reward;

/// Every rule, in the order Miles' `async_rm` tests them: Miles' name, what it scores, its
/// scoring function.
pub(crate) static RULES: &[Rule] = &[
    Rule::new(
        "remote_rm",
        "the JSON answer of the hub's reward model (POST rm_url {prompt, response, label})",
        Scorer::Async(remote_rm::score),
    ),
    Rule::new(
        "deepscaler",
        "1 / 0: math on the text after the last </think> (or the first ###Response); 0 without either",
        Scorer::Local(deepscaler::score),
    ),
    Rule::new(
        "gemma_math",
        "1 / 0: deepscaler's grading of the text after the last <channel|>",
        Scorer::Local(gemma_math::score),
    ),
    Rule::new(
        "dapo",
        "{score: ±1.0, acc, pred}: the last `Answer:` line of the last 300 characters against the integer label",
        Scorer::Local(dapo::score),
    ),
    Rule::new(
        "math",
        "1 / 0: the last \\boxed{} against the label, MATH normalisation then sympy equivalence",
        Scorer::Local(math::score),
    ),
    Rule::new("f1", "SQuAD token F1 in [0, 1]", Scorer::Local(f1::score)),
    Rule::new(
        "gpqa",
        "1 / 0: the option letter (or the correct option's text) in the response",
        Scorer::Local(gpqa::score),
    ),
    Rule::new(
        "random",
        "0 or 1 with probability 1/2",
        Scorer::Local(random::score),
    ),
    Rule::new(
        "deterministic_random",
        "sha256(str(tokens) + response)[0] % 2",
        Scorer::Local(deterministic_random::score),
    ),
];

/// Rules of Miles' rm_hub that miles-rs does not implement (the unknown-rule error says so).
pub(crate) const NOT_IMPLEMENTED: &[&str] = &["ifbench"];

/// The registry row named `name` (exact, case-sensitive).
pub(crate) fn find(name: &str) -> Option<&'static Rule> {
    RULES.iter().find(|rule| rule.name == name)
}

/// The rule names, comma-separated, in registry order.
pub(crate) fn name_list() -> String {
    RULES
        .iter()
        .map(|rule| rule.name)
        .collect::<Vec<_>>()
        .join(", ")
}
