//! # miles-reward
//!
//! Rewards for RL post-training, all implementing [`miles_core::RewardFn`]:
//!
//! * Miles' rule-based rewards (its `rm_hub`) with Miles' exact semantics, selected by
//!   `--rm-type` ([`RmType`]) and by a sample's `metadata["rm_type"]` ([`RmHubReward`]);
//! * a reward model behind HTTP ([`RemoteReward`], Miles' `remote_rm` with `--rm-url`);
//! * miles-rs' own simple rewards ([`BuiltinReward`]: `exact_match`, `numeric_match` and a
//!   lenient `math` checker).
//!
//! ## The rules
//!
//! | `--rm-type` | reward | Miles source |
//! |---|---|---|
//! | `math` | 1 / 0: the last `\boxed{}` against the label, MATH normalisation, then sympy equivalence | `math_utils.grade_answer_verl` |
//! | `deepscaler` | 1 / 0: as `math` on the text after the last `</think>` (or after the first `###Response`); 0 without either | `deepscaler.py` |
//! | `gemma_math` | 1 / 0: as `deepscaler` on the text after the last `<channel|>` (the whole response without one) | `deepscaler.py` |
//! | `dapo` | `{"score": ±1.0, "acc": bool, "pred": str}`: the last `Answer: …` line of the last 300 characters against the integer label | `math_dapo_utils.compute_score` |
//! | `f1` | SQuAD token F1 in [0, 1] | `f1.f1_score` |
//! | `gpqa` | 1.0 / 0.0: the option letter (or the correct option's text) in the response | `gpqa.compute_gpqa_reward` |
//! | `random` | 0 or 1 with probability ½ | `random.randint(0, 1)` |
//! | `deterministic_random` | `sha256(str(tokens) + response)[0] % 2` | `__init__.py` |
//! | `remote_rm` | the JSON answer of `POST rm_url {"prompt", "response", "label"}` | [`RemoteReward`] |
//! | `boxed_<rule>` | `<rule>` on the content of the response's last `\boxed{}` (`""` without one) | `__init__.async_rm` |
//!
//! The rules are the rows of one registry table: [`RmRule::all`] lists them (name and
//! description), [`RmType::from_rm_type`] parses `--rm-type` from it (with the `boxed_`
//! prefix) and [`Error::UnknownRmType`] names every valid rule from it. `remote_rm` reaches
//! its reward model through the [`miles_core::RewardFn`] seam ([`RmHubReward::with_remote`]
//! takes any `Arc<dyn RewardFn>`; [`RemoteReward`] is the HTTP one).
//!
//! Miles' `sympy.simplify` step of `math` / `deepscaler` is replaced by exact rational and
//! numeric evaluation (see `COMPATIBILITY.md`; `tests/it/rm_hub.rs` measures the agreement on
//! a table of cases scored by Miles' own Python).
//!
//! ## Adding a rule
//!
//! One file and one registry row: write `src/rules/<name>.rs` with a
//! `pub(crate) fn score(input: &RuleInput<'_>) -> miles_core::Result<Reward>` (the input holds
//! the sample, the graded response — already unboxed for `boxed_<name>` — the label, the
//! hub's reward model and random state), declare `mod <name>;` in `src/rules/mod.rs` and add
//! `Rule::new("<name>", "<what it scores>", Scorer::Local(<name>::score))` to its `RULES`
//! table. `--rm-type <name>`, `boxed_<name>`, [`RmRule::all`] and the unknown-rule message
//! follow from the row.
//!
//! ```
//! use miles_core::{RewardFn, Reward, Sample};
//! use miles_reward::{RmHubReward, RmRule, RmType};
//!
//! let rm = RmHubReward::new(Some(RmType::from_rm_type("math")?));
//! let mut sample = Sample::default();
//! sample.response = r"so the answer is $\boxed{\dfrac{1}{2}}$".into();
//! sample.label = Some("0.5".into());
//! let reward = futures_lite_block_on(rm.reward(&sample))?;
//! assert_eq!(reward, Reward::Scalar(1.0));
//! // A sample's metadata["rm_type"] overrides the global one, as in Miles.
//! sample.metadata.insert("rm_type".into(), "f1".into());
//! sample.response = "the cat sat".into();
//! sample.label = Some("cat sat".into());
//! assert_eq!(futures_lite_block_on(rm.reward(&sample))?, Reward::Scalar(1.0));
//! // The registry is the list of rules, and the unknown-rule error names them.
//! assert!(RmRule::all().any(|rule| rule.name() == "gpqa"));
//! let unknown = RmType::from_rm_type("Math").unwrap_err().to_string();
//! assert!(unknown.contains("deterministic_random"), "{unknown}");
//! # fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     let mut f = std::pin::pin!(f);
//! #     let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
//! #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
//! # }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod builtin;
mod error;
mod hub;
mod latex2text;
mod latex_symbols;
mod math_utils;
mod remote;
mod rm_type;
mod rule;
mod rules;
mod sympy_lite;

pub use builtin::{
    BuiltinReward, answers_equal, extract_answer, last_boxed, last_number, parse_number,
};
pub use error::Error;
pub use hub::RmHubReward;
pub use math_utils::{extract_answer as extract_boxed_answer, grade_answer_verl};
pub use remote::RemoteReward;
pub use rm_type::{RmRule, RmType, resolve_rm_type};
pub use rules::{
    DapoScore, dapo_score, deepscaler_reward, deterministic_random, f1_score, gemma_math_reward,
};
