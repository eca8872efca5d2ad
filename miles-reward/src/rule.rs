//! What a rule of the rm_hub is: a name (Miles' `--rm-type` value), a one-line description
//! and a scoring function over a [`RuleInput`]. Each rule is one file of `rules/` that
//! defines its scoring function; the registry (`rules/mod.rs`) lists them in one table.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

use miles_core::rng::SplitMix64;
use miles_core::{Result as CoreResult, Reward, RewardFn, Sample};

/// What a rule scores: the sample, the response text the rule grades and the hub's shared
/// resources.
pub(crate) struct RuleInput<'a> {
    /// The whole sample (tokens, metadata, label, …).
    pub(crate) sample: &'a Sample,
    /// The text the rule grades: the sample's response, or with Miles' `boxed_` prefix the
    /// content of its last `\boxed{}` (`""` without one).
    pub(crate) response: &'a str,
    /// The sample's label.
    pub(crate) label: Option<&'a str>,
    /// The hub's reward model (Miles' `--rm-url`), when one is configured.
    pub(crate) remote: Option<&'a dyn RewardFn>,
    /// The hub's random stream, for rules that draw random numbers.
    pub(crate) rng: &'a Mutex<SplitMix64>,
}

/// A boxed, `Send` future of a rule's reward.
pub(crate) type RewardFuture<'a> = Pin<Box<dyn Future<Output = CoreResult<Reward>> + Send + 'a>>;

/// How a rule computes its reward.
#[derive(Clone, Copy)]
pub(crate) enum Scorer {
    /// From the input alone, without waiting.
    Local(fn(&RuleInput<'_>) -> CoreResult<Reward>),
    /// Waiting on something (a reward model over the network).
    Async(for<'a> fn(RuleInput<'a>) -> RewardFuture<'a>),
}

/// One row of the rule registry.
pub(crate) struct Rule {
    /// Miles' `--rm-type` name.
    pub(crate) name: &'static str,
    /// What it scores, in one line.
    pub(crate) description: &'static str,
    /// Its scoring function.
    pub(crate) scorer: Scorer,
}

impl Rule {
    /// A registry row.
    pub(crate) const fn new(name: &'static str, description: &'static str, scorer: Scorer) -> Self {
        Self {
            name,
            description,
            scorer,
        }
    }

    /// Scores `input` with this rule.
    pub(crate) async fn score(&self, input: RuleInput<'_>) -> CoreResult<Reward> {
        match self.scorer {
            Scorer::Local(score) => score(&input),
            Scorer::Async(score) => score(input).await,
        }
    }
}
