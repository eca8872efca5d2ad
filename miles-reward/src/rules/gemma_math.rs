//! `gemma_math`: `deepscaler`'s grading of the text after Gemma's last `<channel|>` (the whole
//! response without one; Miles' `deepscaler.py`).

use miles_core::{Result as CoreResult, Reward};

use crate::math_utils::grade_boxed_solution;
use crate::rule::RuleInput;

/// Miles' `gemma_math` rule.
pub fn gemma_math_reward(response: &str, label: Option<&str>) -> CoreResult<f64> {
    let solution = response.rsplit("<channel|>").next().unwrap_or_default();
    grade_boxed_solution(solution, label)
}

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    gemma_math_reward(input.response, input.label).map(Reward::Scalar)
}
