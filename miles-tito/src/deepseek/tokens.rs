//! The DeepSeek special tokens and the fixed prompt texts the encoders write.

/// `<｜begin▁of▁sentence｜>`.
pub(super) const BOS: &str = "<｜begin▁of▁sentence｜>";
/// `<｜end▁of▁sentence｜>`.
pub(crate) const EOS: &str = "<｜end▁of▁sentence｜>";
/// `<think>`.
pub(crate) const THINK_START: &str = "<think>";
/// `</think>`.
pub(crate) const THINK_END: &str = "</think>";
/// `<｜User｜>`.
pub(crate) const USER_TOKEN: &str = "<｜User｜>";
/// `<｜Assistant｜>`.
pub(crate) const ASSISTANT_TOKEN: &str = "<｜Assistant｜>";
/// `<｜latest_reminder｜>` (V4).
pub(super) const LATEST_REMINDER_TOKEN: &str = "<｜latest_reminder｜>";

pub(super) const RESPONSE_FORMAT_PREFIX: &str =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

pub(super) const V32_TOOLS_PREFIX: &str = "## Tools\n\
You have access to a set of tools you can use to answer the user's question.\n\
You can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following as part of your reply to the user:\n\
<｜DSML｜function_calls>\n\
<｜DSML｜invoke name=\"$FUNCTION_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$FUNCTION_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜function_calls>\n\
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The \"string\" attribute should be set to \"true\" for string type parameters and \"false\" for other types (numbers, booleans, arrays, objects).\n\
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:\n\
<｜DSML｜function_calls>\n\
...\n\
</｜DSML｜function_calls>\n\
<function_results>\n\
...\n\
</function_results>\n\
<think>...thinking about results</think>\n\
Here are the functions available in JSONSchema format:\n\
<functions>\n";
pub(super) const V32_TOOLS_SUFFIX: &str = "\n</functions>\n";

pub(super) const V4_TOOLS_PREFIX: &str = "## Tools\n\
\n\
You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\
\n\
<｜DSML｜tool_calls>\n\
<｜DSML｜invoke name=\"$TOOL_NAME\">\n\
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n\
...\n\
</｜DSML｜invoke>\n\
<｜DSML｜invoke name=\"$TOOL_NAME2\">\n\
...\n\
</｜DSML｜invoke>\n\
</｜DSML｜tool_calls>\n\
\n\
String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\
\n\
If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\
\n\
Otherwise, output directly after </think> with tool calls or final response.\n\
\n\
### Available Tool Schemas\n\
\n";
pub(super) const V4_TOOLS_SUFFIX: &str = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

pub(super) const REASONING_EFFORT_MAX: &str = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n\
You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n\
Explicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

/// V4 task tokens (`task` on a user message).
pub(super) const V4_TASKS: [(&str, &str); 6] = [
    ("action", "<｜action｜>"),
    ("query", "<｜query｜>"),
    ("authority", "<｜authority｜>"),
    ("domain", "<｜domain｜>"),
    ("title", "<｜title｜>"),
    ("read_url", "<｜read_url｜>"),
];
