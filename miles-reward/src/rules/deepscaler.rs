//! `deepscaler`: `math`'s grading of the text after the reasoning — after the last
//! `</think>`, else after the first `###Response`; 0 without either (Miles' `deepscaler.py`).

use miles_core::{Result as CoreResult, Reward};

use crate::math_utils::grade_boxed_solution;
use crate::rule::RuleInput;

/// Miles' `deepscaler` rule.
pub fn deepscaler_reward(response: &str, label: Option<&str>) -> CoreResult<f64> {
    let solution = if response.contains("</think>") {
        response.rsplit("</think>").next().unwrap_or_default()
    } else if response.contains("###Response") {
        response.split("###Response").nth(1).unwrap_or_default()
    } else {
        return Ok(0.0);
    };
    grade_boxed_solution(solution, label)
}

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    deepscaler_reward(input.response, input.label).map(Reward::Scalar)
}
