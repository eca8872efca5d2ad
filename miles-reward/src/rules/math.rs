//! `math`: the last `\boxed{}` of the response against the label, equal under the MATH
//! normaliser or the sympy grader (Miles' `math_utils.grade_answer_verl`). 1 / 0.

use miles_core::{Result as CoreResult, Reward};

use crate::math_utils::grade_answer_verl;
use crate::rule::RuleInput;

/// The rule's scoring function.
pub(crate) fn score(input: &RuleInput<'_>) -> CoreResult<Reward> {
    let ok = grade_answer_verl(input.response, input.label);
    Ok(Reward::Scalar(if ok { 1.0 } else { 0.0 }))
}
