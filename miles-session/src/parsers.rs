//! Reasoning and tool-call parsers for assistant output text, with SGLang's parser names
//! (`--reasoning-parser qwen3|qwen3-thinking|glm45|kimi_k2|nemotron_3|deepseek-r1|deepseek-v3|
//! deepseek-v4|minimax|minimax-append-think`, `--tool-call-parser qwen25|glm45|glm47|kimi_k2|
//! kimi_k2_raw_id|qwen3_coder|minimax-m2|deepseekv31|deepseekv32|deepseekv4`).
//!
//! SGLang parses the detokenized output of a chat completion into `reasoning_content`,
//! `content` and `tool_calls`; the session server must do the same from the output ids. A
//! [`ChatTokenizer`](crate::chat::ChatTokenizer) implementation decodes and hands the text to an
//! [`OutputParser`] built from the family's parser names (MILES_SPEC §1.2 table). The formats
//! and value typing follow SGLang's detectors; no model output makes a parser panic or fail the
//! request (malformed markup stays in `content`).

use std::io;

use miles_core::{ToolArguments, ToolCall, ToolSpec};
use serde::Serialize;
use serde_json::{Map, Value};

use crate::chat::ParsedAssistant;
use crate::error::{Error, Result};

/// Serialises JSON as Python's `json.dumps(v, ensure_ascii=False)` does (`", "` and `": "`
/// separators), which is how SGLang spells tool-call `arguments`.
pub fn python_json(value: &Value) -> String {
    struct PyFormatter;
    impl serde_json::ser::Formatter for PyFormatter {
        fn begin_array_value<W: ?Sized + io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PyFormatter);
    match value.serialize(&mut ser) {
        Ok(()) => String::from_utf8(out).unwrap_or_default(),
        Err(_) => value.to_string(),
    }
}

/// How reasoning is separated from the answer.
///
/// The `force_reasoning` variants start inside the reasoning block: the family's template
/// opened `<think>` in the generation prompt, so text before `</think>` is reasoning even
/// without `<think>` (SGLang forces reasoning per request: by default for `qwen3`, `glm45`,
/// `nemotron_3` and `kimi_k2`, when `thinking` is on for `deepseek-v3` / `deepseek-v4`; see
/// [`ReasoningParser::for_kwargs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReasoningParser {
    /// `<think>…</think>` (Qwen3, Qwen3.5, Qwen-Next; SGLang `qwen3`, `qwen3-thinking`,
    /// `minimax`). A `<tool_call>` before any `</think>` ends the reasoning.
    Qwen3 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// GLM-4.5 / 4.7: `<think>…</think>`; a `<tool_call>` before `</think>` ends it.
    Glm45,
    /// Kimi K2 / K2.5 / K2.6: `<think>…</think>`; `<|tool_calls_section_begin|>` before
    /// `</think>` ends it.
    KimiK2 {
        /// The output starts inside the reasoning block (K2.5's template opens `<think>`).
        force_reasoning: bool,
    },
    /// SGLang `deepseek-r1`: always starts inside reasoning, `(<think>)?…</think>`.
    DeepSeekR1,
    /// SGLang `deepseek-v3` (DeepSeek V3.1 / V3.2): `<think>…</think>`, forced when the request
    /// thinks (the encoder ends the generation prompt with `<think>`).
    DeepSeekV3 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// SGLang `deepseek-v4`: `<think>…</think>`, forced when the request thinks.
    DeepSeekV4 {
        /// The output starts inside the reasoning block.
        force_reasoning: bool,
    },
    /// SGLang `nemotron_3`: `<think>…</think>`; a `<tool_call>` before `</think>` ends it.
    Nemotron3 {
        /// The output starts inside the reasoning block (the template opens `<think>`).
        force_reasoning: bool,
    },
    /// SGLang `minimax-append-think` (MiniMax M2 / M2.5 / M2.7): nothing is split off; the
    /// `<think>` the generation prompt opened is put back in front of the text, so the
    /// reasoning stays in `content` (the template recovers it from there next turn).
    MinimaxAppendThink,
}

/// `<think>`.
const THINK_START: &str = "<think>";
/// `</think>`.
const THINK_END: &str = "</think>";

/// Whether the DeepSeek thinking mode is on in `kwargs`, when any of its aliases is set
/// (`thinking_mode`, `enable_thinking`, `thinking`; resolved as Miles' DeepSeek bridge does).
fn deepseek_thinking(kwargs: &Map<String, Value>) -> Option<bool> {
    ["thinking_mode", "enable_thinking", "thinking"]
        .iter()
        .any(|k| kwargs.contains_key(*k))
        .then(|| miles_tito::deepseek::thinking_enabled(kwargs))
}

impl ReasoningParser {
    /// The parser for an SGLang `--reasoning-parser` name (with the detector's own default for
    /// `force_reasoning`; `qwen3-thinking`, `minimax` and `deepseek-r1` always force).
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name {
            "qwen3" => Self::Qwen3 {
                force_reasoning: false,
            },
            "qwen3-thinking" | "minimax" => Self::Qwen3 {
                force_reasoning: true,
            },
            "glm45" => Self::Glm45,
            "kimi_k2" => Self::KimiK2 {
                force_reasoning: false,
            },
            "deepseek-r1" => Self::DeepSeekR1,
            "deepseek-v3" => Self::DeepSeekV3 {
                force_reasoning: false,
            },
            "deepseek-v4" => Self::DeepSeekV4 {
                force_reasoning: false,
            },
            "nemotron_3" => Self::Nemotron3 {
                force_reasoning: false,
            },
            "minimax-append-think" => Self::MinimaxAppendThink,
            other => return Err(Error::Config(format!("unknown reasoning parser {other:?}"))),
        })
    }

    /// The parser for a request with chat-template `kwargs`, as SGLang decides per request
    /// whether the output starts inside reasoning: `enable_thinking: false` (Qwen3, Nemotron 3)
    /// or `thinking: false` (Kimi) turns forcing off; for DeepSeek the resolved thinking mode
    /// (`thinking_mode` / `enable_thinking` / `thinking`) sets it. Without such a kwarg the
    /// family's default stays.
    pub fn for_kwargs(self, kwargs: &Map<String, Value>) -> Self {
        let off = |key: &str| kwargs.get(key).and_then(Value::as_bool) == Some(false);
        match self {
            Self::Qwen3 { .. } if off("enable_thinking") => Self::Qwen3 {
                force_reasoning: false,
            },
            Self::Nemotron3 { .. } if off("enable_thinking") => Self::Nemotron3 {
                force_reasoning: false,
            },
            Self::KimiK2 { .. } if off("thinking") => Self::KimiK2 {
                force_reasoning: false,
            },
            Self::DeepSeekV3 { force_reasoning } => Self::DeepSeekV3 {
                force_reasoning: deepseek_thinking(kwargs).unwrap_or(force_reasoning),
            },
            Self::DeepSeekV4 { force_reasoning } => Self::DeepSeekV4 {
                force_reasoning: deepseek_thinking(kwargs).unwrap_or(force_reasoning),
            },
            other => other,
        }
    }

    /// `(forced, tool-call start that also ends reasoning)`.
    fn mode(self) -> (bool, Option<&'static str>) {
        match self {
            Self::Qwen3 { force_reasoning }
            | Self::DeepSeekV3 { force_reasoning }
            | Self::Nemotron3 { force_reasoning } => (force_reasoning, Some("<tool_call>")),
            Self::Glm45 => (false, Some("<tool_call>")),
            Self::KimiK2 { force_reasoning } => {
                (force_reasoning, Some("<|tool_calls_section_begin|>"))
            }
            Self::DeepSeekR1 => (true, None),
            Self::DeepSeekV4 { force_reasoning } => (force_reasoning, None),
            Self::MinimaxAppendThink => (false, None),
        }
    }

    /// Splits `text` into `(reasoning, normal text)` as SGLang's detectors do: the start tag is
    /// removed and the text stripped; everything before the end tag is reasoning, the rest
    /// (stripped) is the answer. No end tag: all reasoning (generation cut short), unless the
    /// family's tool-call start comes first, which then ends the reasoning and stays in the
    /// answer.
    pub fn parse(self, text: &str) -> (Option<String>, String) {
        if self == Self::MinimaxAppendThink {
            return (None, format!("{THINK_START}{text}"));
        }
        let (forced, tool_start) = self.mode();
        if !forced && !text.contains(THINK_START) {
            return (None, text.to_owned());
        }
        let processed = text.replacen(THINK_START, "", 1);
        let processed = processed.trim();
        if let Some((reasoning, rest)) = processed.split_once(THINK_END) {
            return (Some(reasoning.to_owned()), rest.trim().to_owned());
        }
        if let Some(at) = tool_start.and_then(|t| processed.find(t)) {
            return (Some(processed[..at].to_owned()), processed[at..].to_owned());
        }
        (Some(processed.to_owned()), String::new())
    }
}

/// How tool calls are written by the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ToolCallParser {
    /// Qwen2.5 / Qwen3: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`.
    Qwen25,
    /// GLM-4.5: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>`.
    Glm45,
    /// GLM-4.7: as GLM-4.5 without the newlines.
    Glm47,
    /// Kimi K2 / K2.5 / K2.6 (`kimi_k2`, `kimi_k2_raw_id`):
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    /// <|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; the
    /// model's id is kept as the call id.
    KimiK2,
    /// Qwen3-Coder / Qwen3.5 / Nemotron 3 (`qwen3_coder`): `<tool_call>\n<function=NAME>\n
    /// <parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>`, values typed by the
    /// tool's JSON schema.
    Qwen3Coder,
    /// MiniMax M2 (`minimax-m2`): `<minimax:tool_call>\n<invoke name="NAME"><parameter
    /// name="P">VALUE</parameter>…</invoke>\n</minimax:tool_call>`, values typed by the schema.
    MinimaxM2,
    /// DeepSeek V3.1 (`deepseekv31`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
    /// <｜tool▁sep｜>{…}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`.
    DeepSeekV31,
    /// DeepSeek V3.2 (`deepseekv32`): DSML, `<｜DSML｜function_calls>` holding
    /// `<｜DSML｜invoke name="NAME">` with `<｜DSML｜parameter name="P" string="true|false">`
    /// (or a JSON object), also without the `｜DSML｜` prefixes.
    DeepSeekV32,
    /// DeepSeek V4 (`deepseekv4`): DSML as V3.2 in a `<｜DSML｜tool_calls>` block, parsed
    /// strictly (a malformed block, an unknown tool or a bad value is an error).
    DeepSeekV4,
}

/// A parsed call: model-given id, name, arguments as a JSON string.
type RawCall = (Option<String>, String, String);

fn known(tools: &[ToolSpec], name: &str) -> bool {
    tools.is_empty() || tools.iter().any(|t| t.function.name == name)
}

fn param_is_string(tools: &[ToolSpec], name: &str, key: &str) -> bool {
    tools
        .iter()
        .find(|t| t.function.name == name)
        .and_then(|t| t.function.parameters.as_ref())
        .and_then(|p| p.pointer(&format!("/properties/{key}/type")))
        .and_then(Value::as_str)
        == Some("string")
}

/// The tool's `parameters.properties` (or `parameters` itself when it has none), as SGLang's
/// Qwen3-Coder detector reads it.
fn coder_properties<'a>(tools: &'a [ToolSpec], name: &str) -> Option<&'a Map<String, Value>> {
    let params = tools
        .iter()
        .find(|t| t.function.name == name)?
        .function
        .parameters
        .as_ref()?;
    match params.get("properties") {
        Some(Value::Object(props)) => Some(props),
        _ => params.as_object(),
    }
}

/// Python's `ast.literal_eval(raw)` as JSON, for the literals a model writes (numbers,
/// quoted strings, `True` / `False` / `None`, lists, tuples, dicts); anything else stays the
/// string.
fn py_literal(raw: &str) -> Value {
    let mut lit = PyLiteral {
        s: raw.trim(),
        at: 0,
    };
    match lit.value(0) {
        Some(v) if lit.rest().trim().is_empty() => v,
        _ => Value::String(raw.to_owned()),
    }
}

/// A recursive-descent reader of Python literals (depth-limited: never overflows the stack).
struct PyLiteral<'a> {
    s: &'a str,
    at: usize,
}

impl PyLiteral<'_> {
    fn rest(&self) -> &str {
        &self.s[self.at..]
    }

    fn skip_ws(&mut self) {
        self.at = self.s.len() - self.rest().trim_start().len();
    }

    fn eat(&mut self, c: char) -> bool {
        self.skip_ws();
        if self.rest().starts_with(c) {
            self.at += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Value> {
        if depth > 64 {
            return None;
        }
        self.skip_ws();
        let first = self.rest().chars().next()?;
        match first {
            '[' | '(' => {
                self.at += 1;
                let close = if first == '[' { ']' } else { ')' };
                let mut items = Vec::new();
                while !self.eat(close) {
                    items.push(self.value(depth + 1)?);
                    if !self.eat(',') {
                        self.eat(close).then_some(())?;
                        break;
                    }
                }
                Some(Value::Array(items))
            }
            '{' => {
                self.at += 1;
                let mut map = Map::new();
                while !self.eat('}') {
                    let key = match self.value(depth + 1)? {
                        Value::String(k) => k,
                        Value::Object(_) | Value::Array(_) => return None,
                        other => other.to_string(),
                    };
                    self.eat(':').then_some(())?;
                    map.insert(key, self.value(depth + 1)?);
                    if !self.eat(',') {
                        self.eat('}').then_some(())?;
                        break;
                    }
                }
                Some(Value::Object(map))
            }
            '\'' | '"' => {
                self.at += 1;
                let mut out = String::new();
                let mut chars = self.rest().char_indices();
                loop {
                    let (i, c) = chars.next()?;
                    match c {
                        c if c == first => {
                            self.at += i + 1;
                            return Some(Value::String(out));
                        }
                        '\\' => {
                            let (_, e) = chars.next()?;
                            out.push(match e {
                                'n' => '\n',
                                't' => '\t',
                                'r' => '\r',
                                '0' => '\0',
                                other => other,
                            });
                        }
                        c => out.push(c),
                    }
                }
            }
            _ => {
                let len = self
                    .rest()
                    .find(|c: char| !(c.is_ascii_alphanumeric() || "_.+-".contains(c)))
                    .unwrap_or(self.rest().len());
                let whole = self.s;
                let token = &whole[self.at..self.at + len];
                self.at += len;
                match token {
                    "True" => Some(Value::Bool(true)),
                    "False" => Some(Value::Bool(false)),
                    "None" => Some(Value::Null),
                    _ => token.parse::<i64>().map(Value::from).ok().or_else(|| {
                        let f = py_float(token)?;
                        token
                            .contains(|c: char| c.is_ascii_digit())
                            .then(|| serde_json::Number::from_f64(f))
                            .flatten()
                            .map(Value::Number)
                    }),
                }
            }
        }
    }
}

/// Python's `float(raw)` as a JSON number (non-finite values are not JSON numbers: `None`).
fn py_float(raw: &str) -> Option<f64> {
    raw.trim().parse::<f64>().ok().filter(|f| f.is_finite())
}

/// An integral float as a JSON integer, otherwise as a float.
fn int_or_float(f: f64) -> Value {
    if f.fract() == 0.0 && f.abs() < 9.0e15 {
        Value::from(f as i64)
    } else {
        serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
    }
}

/// A `qwen3_coder` parameter value typed by its schema (SGLang `Qwen3CoderDetector`):
/// `null` is null; parameters the schema does not declare, and string types, stay strings;
/// integer types parse as integers and number types as numbers (an integral number written
/// without `.`/`e` becomes an integer), falling back to the string; booleans are
/// `value.lower() == "true"`; objects and arrays parse as JSON, then (like other types) as a
/// Python literal, else stay strings.
fn coder_value(raw: &str, key: &str, props: Option<&Map<String, Value>>) -> Value {
    if raw.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let string = || Value::String(raw.to_owned());
    let Some(schema) = props.and_then(|p| p.get(key)) else {
        return string();
    };
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.trim().to_lowercase(),
        Some(other) => other.to_string().to_lowercase(),
        None => "string".to_owned(),
    };
    let starts = |prefixes: &[&str]| prefixes.iter().any(|p| ty.starts_with(p));
    match ty.as_str() {
        "string" | "str" | "text" | "varchar" | "char" | "enum" => string(),
        "boolean" | "bool" | "binary" => Value::Bool(raw.to_lowercase() == "true"),
        _ if starts(&["int", "uint", "long", "short", "unsigned"]) => raw
            .trim()
            .parse::<i64>()
            .map_or_else(|_| string(), Value::from),
        _ if starts(&["num", "float"]) => match py_float(raw) {
            Some(f) => {
                let written_as_float = raw.contains('.') || raw.to_lowercase().contains('e');
                if written_as_float {
                    serde_json::Number::from_f64(f).map_or_else(string, Value::Number)
                } else {
                    int_or_float(f)
                }
            }
            None => string(),
        },
        _ => {
            if (matches!(ty.as_str(), "object" | "array" | "arr") || starts(&["dict", "list"]))
                && let Ok(v) = serde_json::from_str(raw)
            {
                return v;
            }
            py_literal(raw)
        }
    }
}

/// The JSON-schema types a MiniMax parameter may have: `type` (string or list), the types of
/// `enum` values, and those of `anyOf` / `oneOf` / `allOf` choices; `["string"]` when none.
fn schema_types(schema: &Value, out: &mut Vec<String>) {
    let Some(schema) = schema.as_object() else {
        return;
    };
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.to_lowercase()),
        Some(Value::Array(ts)) => {
            out.extend(ts.iter().filter_map(Value::as_str).map(str::to_lowercase))
        }
        _ => {}
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        for v in values {
            out.push(
                match v {
                    Value::Null => "null",
                    Value::Bool(_) => "boolean",
                    Value::Number(n) if n.is_f64() => "number",
                    Value::Number(_) => "integer",
                    Value::String(_) => "string",
                    Value::Array(_) => "array",
                    Value::Object(_) => "object",
                }
                .to_owned(),
            );
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = schema.get(key) {
            for choice in choices {
                schema_types(choice, out);
            }
        }
    }
}

/// A `minimax-m2` parameter value typed by its schema (SGLang `MinimaxM2Detector`): `null` /
/// `none` / `nil` are null; otherwise the schema's types are tried in the order integer,
/// number, boolean (`true/1/yes/on`, `false/0/no/off`), object, array, string, the first that
/// converts wins; then JSON; then the string. (SGLang also answers null for any value of a
/// type list containing `null`; that is not reproduced.)
fn minimax_value(raw: &str, fname: &str, key: &str, tools: &[ToolSpec]) -> Value {
    if matches!(raw.to_lowercase().as_str(), "null" | "none" | "nil") {
        return Value::Null;
    }
    let mut types = Vec::new();
    if let Some(schema) = tools
        .iter()
        .find(|t| t.function.name == fname)
        .and_then(|t| t.function.parameters.as_ref())
        .and_then(|p| {
            p.pointer(&format!(
                "/properties/{}",
                key.replace('~', "~0").replace('/', "~1")
            ))
        })
    {
        schema_types(schema, &mut types);
    }
    if types.is_empty() {
        types.push("string".into());
    }
    let has = |names: &[&str]| names.iter().any(|n| types.iter().any(|t| t == n));
    for group in [
        &["integer", "int"][..],
        &["number", "float"],
        &["boolean", "bool"],
        &["object"],
        &["array"],
        &["string", "str", "text"],
    ] {
        if !has(group) {
            continue;
        }
        match group[0] {
            "integer" => {
                if let Ok(i) = raw.trim().parse::<i64>() {
                    return Value::from(i);
                }
            }
            "number" => {
                if let Some(f) = py_float(raw) {
                    return int_or_float(f);
                }
            }
            "boolean" => match raw.trim().to_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => return Value::Bool(true),
                "false" | "0" | "no" | "off" => return Value::Bool(false),
                _ => {}
            },
            "object" | "array" => {
                if let Ok(v) = serde_json::from_str(raw) {
                    return v;
                }
            }
            _ => return Value::String(raw.to_owned()),
        }
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned()))
}

/// Removes one leading and one trailing `\n`.
fn strip_one_newline(s: &str) -> &str {
    let s = s.strip_prefix('\n').unwrap_or(s);
    s.strip_suffix('\n').unwrap_or(s)
}

/// `<tool_call>(.*?)</tool_call>` bodies, in order.
fn delimited<'a>(text: &'a str, open: &str, close: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(s) = rest.find(open) {
        let after = &rest[s + open.len()..];
        let Some(e) = after.find(close) else { break };
        out.push(&after[..e]);
        rest = &after[e + close.len()..];
    }
    out
}

/// The earliest of `needles` in `hay` at or after `from`: `(position, needle index)`.
fn find_first(hay: &str, from: usize, needles: &[&str]) -> Option<(usize, usize)> {
    needles
        .iter()
        .enumerate()
        .filter_map(|(i, n)| hay.get(from..)?.find(n).map(|p| (from + p, i)))
        .min()
}

fn qwen3_coder(text: &str, tools: &[ToolSpec]) -> Vec<RawCall> {
    let mut blocks = delimited(text, "<tool_call>", "</tool_call>");
    if blocks.is_empty() && text.contains("<function=") {
        // SGLang: an unterminated block is parsed from the whole text.
        blocks.push(text);
    }
    let mut calls = Vec::new();
    for block in blocks {
        // `<function=(.*?)</function>|<function=(.*)$`
        let mut rest = block;
        while let Some(s) = rest.find("<function=") {
            let after = &rest[s + "<function=".len()..];
            let body = match after.find("</function>") {
                Some(e) => {
                    rest = &after[e + "</function>".len()..];
                    &after[..e]
                }
                None => {
                    rest = "";
                    after
                }
            };
            let Some((name, params)) = body.split_once('>') else {
                continue;
            };
            let props = coder_properties(tools, name);
            let mut args = Map::new();
            // `<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)`
            let mut at = 0;
            while let Some(p) = params[at..].find("<parameter=") {
                let start = at + p + "<parameter=".len();
                let (end, next) = match find_first(
                    params,
                    start,
                    &["</parameter>", "<parameter=", "</function>"],
                ) {
                    Some((e, 0)) => (e, e + "</parameter>".len()),
                    Some((e, _)) => (e, e),
                    None => (params.len(), params.len()),
                };
                at = next;
                let Some((key, value)) = params[start..end].split_once('>') else {
                    continue;
                };
                args.insert(
                    key.to_owned(),
                    coder_value(strip_one_newline(value), key, props),
                );
            }
            calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
        }
    }
    calls
}

fn minimax_m2(text: &str, tools: &[ToolSpec]) -> (String, Vec<RawCall>) {
    const START: &str = "<minimax:tool_call>";
    const END: &str = "</minimax:tool_call>";
    let mut normal = String::new();
    let mut calls = Vec::new();
    let mut cursor = 0;
    loop {
        let Some(s) = text[cursor..].find(START).map(|s| cursor + s) else {
            normal.push_str(&text[cursor..]);
            break;
        };
        normal.push_str(&text[cursor..s]);
        let Some(e) = text[s..].find(END).map(|e| s + e) else {
            // An unclosed block stays text (SGLang).
            normal.push_str(&text[s..]);
            break;
        };
        cursor = e + END.len();
        let block = &text[s..cursor];
        // `<invoke name="(.*?)</invoke>|<invoke name="(.*)$`
        for invoke in tag_bodies(block, "<invoke name=\"", "</invoke>") {
            let Some((fname, body)) = invoke.split_once("\">") else {
                continue;
            };
            let fname = fname.trim();
            let mut args = Map::new();
            for param in tag_bodies(body, "<parameter name=\"", "</parameter>") {
                let Some((pname, value)) = param.split_once("\">") else {
                    continue;
                };
                let pname = pname.trim();
                let value = value.trim_start_matches('\n').trim_end_matches('\n');
                args.insert(pname.to_owned(), minimax_value(value, fname, pname, tools));
            }
            calls.push((None, fname.to_owned(), python_json(&Value::Object(args))));
        }
    }
    (normal, calls)
}

/// Bodies of `OPEN(.*?)CLOSE|OPEN(.*)$`: each `OPEN` up to the next `CLOSE`, the last one
/// unclosed up to the end of the text.
fn tag_bodies<'a>(text: &'a str, open: &str, close: &str) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(s) = rest.find(open) {
        let after = &rest[s + open.len()..];
        match after.find(close) {
            Some(e) => {
                out.push(&after[..e]);
                rest = &after[e + close.len()..];
            }
            None => {
                out.push(after);
                break;
            }
        }
    }
    out
}

const V31_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const V31_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const V31_CALL_END: &str = "<｜tool▁call▁end｜>";
const V31_SEP: &str = "<｜tool▁sep｜>";

fn deepseek_v31(text: &str) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for inner in delimited(text, V31_CALL_BEGIN, V31_CALL_END) {
        // `<｜tool▁call▁begin｜>(.*)<｜tool▁sep｜>(.*)<｜tool▁call▁end｜>` (greedy name).
        let (name, args) = inner
            .rsplit_once(V31_SEP)
            .ok_or_else(|| Error::upstream("deepseek tool call without <｜tool▁sep｜>"))?;
        let args: Value = serde_json::from_str(args)
            .map_err(|e| Error::upstream(format!("deepseek tool call arguments: {e}")))?;
        calls.push((None, name.to_owned(), python_json(&args)));
    }
    Ok(calls)
}

const DSML: &str = "｜DSML｜";

/// Parses `ATTR="VALUE"` attributes (each after at least one whitespace) and the closing `>`
/// of an opening tag at the start of `s`: `(values, bytes consumed)`.
fn tag_attributes<'a>(s: &'a str, names: &[&str]) -> Option<(Vec<&'a str>, usize)> {
    let mut at = 0;
    let mut values = Vec::with_capacity(names.len());
    for name in names {
        let ws = s[at..].len() - s[at..].trim_start().len();
        if ws == 0 {
            return None;
        }
        at += ws;
        let rest = s[at..].strip_prefix(name)?.strip_prefix("=\"")?;
        let end = rest.find('"').filter(|&e| e > 0)?;
        values.push(&rest[..end]);
        at = s.len() - rest.len() + end + 1;
    }
    let rest = s[at..].trim_start();
    let rest = rest.strip_prefix('>')?;
    Some((values, s.len() - rest.len()))
}

/// One DSML element `<(｜DSML｜)?TAG ATTRS>(.*?)</(｜DSML｜)?TAG>` found at or after `from`:
/// `(start, attribute values, body, end)`; `None` when there is none (a tag without its close
/// is not an element).
fn dsml_element<'a>(
    text: &'a str,
    from: usize,
    tag: &str,
    attrs: &[&str],
) -> Option<(usize, Vec<&'a str>, &'a str, usize)> {
    let opens = [format!("<{DSML}{tag}"), format!("<{tag}")];
    let closes = [format!("</{DSML}{tag}>"), format!("</{tag}>")];
    let opens = [opens[0].as_str(), opens[1].as_str()];
    let closes = [closes[0].as_str(), closes[1].as_str()];
    let mut at = from;
    while let Some((start, which)) = find_first(text, at, &opens) {
        let head = start + opens[which].len();
        if let Some((values, used)) = tag_attributes(&text[head..], attrs) {
            let body_start = head + used;
            let (close, which) = find_first(text, body_start, &closes)?;
            return Some((
                start,
                values,
                &text[body_start..close],
                close + closes[which].len(),
            ));
        }
        at = start + 1;
    }
    None
}

/// DSML invoke arguments (SGLang `DeepSeekV32Detector`): a JSON object body, or
/// `<(｜DSML｜)?parameter name="P" string="true|false">V</(｜DSML｜)?parameter>` elements
/// (`string="true"`: the stripped text; otherwise JSON, else the stripped text).
fn dsml_arguments(body: &str) -> Map<String, Value> {
    let trimmed = body.trim();
    if trimmed.starts_with('{')
        && trimmed.ends_with('}')
        && let Ok(Value::Object(map)) = serde_json::from_str(trimmed)
    {
        return map;
    }
    let mut args = Map::new();
    let mut at = 0;
    while let Some((_, attrs, value, end)) =
        dsml_element(body, at, "parameter", &["name", "string"])
    {
        at = end;
        let value = value.trim();
        let value = if attrs[1] == "true" {
            Value::String(value.to_owned())
        } else {
            serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()))
        };
        args.insert(attrs[0].to_owned(), value);
    }
    args
}

fn deepseek_v32(text: &str) -> (String, Vec<RawCall>) {
    let open = [
        format!("<{DSML}function_calls>"),
        "<function_calls>".to_owned(),
    ];
    let close = [
        format!("</{DSML}function_calls>"),
        "</function_calls>".to_owned(),
    ];
    let Some((start, which)) = find_first(text, 0, &[&open[0], &open[1]]) else {
        return (text.to_owned(), Vec::new());
    };
    let normal = text[..start].trim().to_owned();
    let body_start = start + open[which].len();
    let Some((end, _)) = find_first(text, body_start, &[&close[0], &close[1]]) else {
        return (normal, Vec::new());
    };
    let block = &text[body_start..end];
    let mut calls = Vec::new();
    let mut at = 0;
    while let Some((_, attrs, body, next)) = dsml_element(block, at, "invoke", &["name"]) {
        at = next;
        let args = dsml_arguments(body);
        calls.push((None, attrs[0].to_owned(), python_json(&Value::Object(args))));
    }
    (normal, calls)
}

/// DeepSeek V4's strict DSML (SGLang `DeepSeekV4Detector`): the text before the first DSML
/// marker (less a trailing blank line) is content; then `<｜DSML｜tool_calls>` blocks of
/// `<｜DSML｜invoke name="…">` elements holding only parameters (or one JSON object), with
/// `string` either `true` or `false`, JSON for non-strings, no repeated parameter, known
/// tools; any other DSML markup is an error. Text after the blocks is content.
fn deepseek_v4(text: &str, tools: &[ToolSpec]) -> Result<(String, Vec<RawCall>)> {
    let open_block = format!("<{DSML}tool_calls>");
    let close_block = format!("</{DSML}tool_calls>");
    let open_invoke = format!("<{DSML}invoke");
    let close_invoke = format!("</{DSML}invoke>");
    let open_param = format!("<{DSML}parameter");
    let close_param = format!("</{DSML}parameter>");
    let bad = |what: &str| Error::upstream(format!("DeepSeek V4 tool output: {what}"));
    let Some((first, _)) = find_first(text, 0, &[&format!("<{DSML}"), &format!("</{DSML}")]) else {
        return Ok((text.to_owned(), Vec::new()));
    };
    let mut normal = text[..first]
        .strip_suffix("\n\n")
        .unwrap_or(&text[..first])
        .to_owned();
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(after) = rest.strip_prefix(open_block.as_str()) {
        rest = after.trim_start();
        while let Some(after) = rest.strip_prefix(open_invoke.as_str()) {
            let (names, used) =
                tag_attributes(after, &["name"]).ok_or_else(|| bad("malformed invoke tag"))?;
            let name = names[0];
            if !known(tools, name) {
                return Err(bad(&format!("undefined tool {name:?}")));
            }
            let body_and_rest = &after[used..];
            let end = body_and_rest
                .find(close_invoke.as_str())
                .ok_or_else(|| bad("unterminated invoke"))?;
            let body = &body_and_rest[..end];
            rest = body_and_rest[end + close_invoke.len()..].trim_start();
            let args = if body.trim_start().starts_with('{') {
                match serde_json::from_str(body.trim()) {
                    Ok(Value::Object(map)) => map,
                    _ => return Err(bad("invoke arguments are not a JSON object")),
                }
            } else {
                let mut args = Map::new();
                let mut params = body.trim_start();
                while let Some(after) = params.strip_prefix(open_param.as_str()) {
                    let (attrs, used) = tag_attributes(after, &["name", "string"])
                        .ok_or_else(|| bad("malformed parameter tag"))?;
                    let value_and_rest = &after[used..];
                    let end = value_and_rest
                        .find(close_param.as_str())
                        .ok_or_else(|| bad("unterminated parameter"))?;
                    let value = value_and_rest[..end].trim();
                    params = value_and_rest[end + close_param.len()..].trim_start();
                    let value = match attrs[1] {
                        "true" => Value::String(value.to_owned()),
                        "false" => serde_json::from_str(value).map_err(|e| {
                            bad(&format!("parameter {:?} is not JSON: {e}", attrs[0]))
                        })?,
                        other => return Err(bad(&format!("string flag {other:?}"))),
                    };
                    if args.insert(attrs[0].to_owned(), value).is_some() {
                        return Err(bad(&format!("repeated parameter {:?}", attrs[0])));
                    }
                }
                if !params.is_empty() {
                    return Err(bad("text between parameters"));
                }
                args
            };
            calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
        }
        match rest.strip_prefix(close_block.as_str()) {
            Some(after) => rest = after.trim_start_matches('\n'),
            None if rest.trim().is_empty() => rest = "",
            None => return Err(bad("malformed tool_calls block")),
        }
    }
    if rest.contains(DSML) {
        return Err(bad("DSML markup outside a tool_calls block"));
    }
    normal.push_str(rest);
    Ok((normal, calls))
}

impl ToolCallParser {
    /// The parser for an SGLang `--tool-call-parser` name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "qwen25" | "qwen" => Ok(Self::Qwen25),
            "glm45" | "glm" => Ok(Self::Glm45),
            "glm47" => Ok(Self::Glm47),
            "kimi_k2" | "kimi_k2_raw_id" => Ok(Self::KimiK2),
            "qwen3_coder" => Ok(Self::Qwen3Coder),
            "minimax-m2" => Ok(Self::MinimaxM2),
            "deepseekv31" => Ok(Self::DeepSeekV31),
            "deepseekv32" => Ok(Self::DeepSeekV32),
            "deepseekv4" => Ok(Self::DeepSeekV4),
            other => Err(Error::Config(format!("unknown tool-call parser {other:?}"))),
        }
    }

    fn start_token(self) -> &'static str {
        match self {
            Self::Qwen25 | Self::Glm45 | Self::Glm47 | Self::Qwen3Coder => "<tool_call>",
            Self::KimiK2 => "<|tool_calls_section_begin|>",
            Self::MinimaxM2 => "<minimax:tool_call>",
            Self::DeepSeekV31 => V31_CALLS_BEGIN,
            Self::DeepSeekV32 => "<｜DSML｜function_calls>",
            Self::DeepSeekV4 => "<｜DSML｜tool_calls>",
        }
    }

    /// Whether `text` holds this format's tool-call markup (SGLang's `has_tool_call`).
    pub fn has_tool_call(self, text: &str) -> bool {
        text.contains(self.start_token())
            || (self == Self::DeepSeekV32 && text.contains("<function_calls>"))
    }

    /// Splits `text` into normal text and tool calls, as SGLang's detector for the format
    /// does. Calls to tools not in `tools` are dropped (as SGLang does) unless `tools` is
    /// empty (DeepSeek V4: an error). A Qwen 2.5 block that does not parse is skipped
    /// (SGLang's detector); for the GLM, Kimi, DeepSeek V3.1 and V4 formats a call that does
    /// not parse is an error ([`OutputParser::parse`] then keeps the whole text as content, as
    /// SGLang's chat serving does).
    /// Arguments are JSON strings in Python's spelling (`{"city": "Paris"}`); Kimi's are the
    /// model's text.
    pub fn parse(self, text: &str, tools: &[ToolSpec]) -> Result<(String, Vec<ToolCall>)> {
        let Some(at) = (self.has_tool_call(text))
            .then(|| {
                text.find(self.start_token())
                    .or_else(|| text.find("<function_calls>"))
            })
            .flatten()
        else {
            return Ok((text.to_owned(), Vec::new()));
        };
        let trimmed_prefix = || text[..at].trim().to_owned();
        let body = &text[at..];
        let (normal, calls) = match self {
            Self::Qwen25 => (trimmed_prefix(), qwen25(body)),
            Self::Glm45 | Self::Glm47 => (trimmed_prefix(), glm(body, tools)?),
            Self::KimiK2 => (trimmed_prefix(), kimi_k2(body)?),
            // SGLang keeps the text before the first call as it is.
            Self::Qwen3Coder => (text[..at].to_owned(), qwen3_coder(text, tools)),
            Self::MinimaxM2 => minimax_m2(text, tools),
            Self::DeepSeekV31 => (trimmed_prefix(), deepseek_v31(text)?),
            Self::DeepSeekV32 => deepseek_v32(text),
            Self::DeepSeekV4 => deepseek_v4(text, tools)?,
        };
        let calls = calls
            .into_iter()
            .filter(|(_, name, _)| known(tools, name))
            .enumerate()
            .map(|(i, (id, name, args))| {
                let mut call = ToolCall::function("", name, Map::new());
                call.id = id;
                call.index = Some(i as u32);
                call.function.arguments = ToolArguments::Json(args);
                call
            })
            .collect();
        Ok((normal, calls))
    }
}

/// SGLang's `Qwen25Detector`: blocks that are unterminated or not JSON are skipped (logged),
/// the others kept.
fn qwen25(body: &str) -> Vec<RawCall> {
    let mut calls = Vec::new();
    for block in body.split("<tool_call>").skip(1) {
        let Some((inner, _)) = block.split_once("</tool_call>") else {
            tracing::warn!(block = %format!("{block:.80}"), "unterminated <tool_call> skipped");
            continue;
        };
        let v: Value = match serde_json::from_str(inner.trim()) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(%e, inner = %format!("{inner:.80}"), "tool call that is not JSON skipped");
                continue;
            }
        };
        let name = v
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let args = v
            .get("arguments")
            .or_else(|| v.get("parameters"))
            .cloned()
            .unwrap_or(Value::Object(Map::new()));
        calls.push((None, name, python_json(&args)));
    }
    calls
}

fn glm(body: &str, tools: &[ToolSpec]) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for block in body.split("<tool_call>").skip(1) {
        let Some((inner, _)) = block.split_once("</tool_call>") else {
            return Err(Error::upstream(format!(
                "unterminated <tool_call>: {block:.80}"
            )));
        };
        let (name, mut rest) = match inner.find("<arg_key>") {
            Some(i) => (inner[..i].trim(), &inner[i..]),
            None => (inner.trim(), ""),
        };
        let mut args = Map::new();
        while let Some(k0) = rest.find("<arg_key>") {
            let after = &rest[k0 + "<arg_key>".len()..];
            let (key, after) = after
                .split_once("</arg_key>")
                .ok_or_else(|| Error::upstream("unterminated <arg_key>"))?;
            let v0 = after.find("<arg_value>").ok_or_else(|| {
                Error::upstream(format!("<arg_key>{key}</arg_key> without <arg_value>"))
            })?;
            let after = &after[v0 + "<arg_value>".len()..];
            let (raw, after) = after
                .split_once("</arg_value>")
                .ok_or_else(|| Error::upstream("unterminated <arg_value>"))?;
            let key = key.trim();
            let value = if param_is_string(tools, name, key) {
                Value::String(raw.to_owned())
            } else {
                serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_owned()))
            };
            args.insert(key.to_owned(), value);
            rest = after;
        }
        calls.push((None, name.to_owned(), python_json(&Value::Object(args))));
    }
    Ok(calls)
}

fn kimi_k2(body: &str) -> Result<Vec<RawCall>> {
    let mut calls = Vec::new();
    for block in body.split("<|tool_call_begin|>").skip(1) {
        let (header, after) = block
            .split_once("<|tool_call_argument_begin|>")
            .ok_or_else(|| {
                Error::upstream("kimi tool call without <|tool_call_argument_begin|>")
            })?;
        let (args, _) = after
            .split_once("<|tool_call_end|>")
            .ok_or_else(|| Error::upstream("unterminated kimi tool call"))?;
        let id = header.trim();
        let name = id
            .rsplit_once(':')
            .map_or(id, |(n, _)| n)
            .rsplit('.')
            .next()
            .unwrap_or_default();
        calls.push((Some(id.to_owned()), name.to_owned(), args.trim().to_owned()));
    }
    Ok(calls)
}

/// Reasoning + tool-call parsing of one family's output text.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OutputParser {
    /// The reasoning parser, if the family separates reasoning.
    pub reasoning: Option<ReasoningParser>,
    /// The tool-call parser, if the family calls tools.
    pub tool_calls: Option<ToolCallParser>,
    /// End-of-turn strings removed from the end of the text first (`<|im_end|>`, …).
    pub end_of_turn: Vec<String>,
}

impl OutputParser {
    /// The parser for a request with chat-template `kwargs` (the thinking toggles of
    /// [`ReasoningParser::for_kwargs`]).
    pub fn for_kwargs(&self, kwargs: &Map<String, Value>) -> Self {
        Self {
            reasoning: self.reasoning.map(|r| r.for_kwargs(kwargs)),
            ..self.clone()
        }
    }

    /// Parses decoded assistant output: end-of-turn strings trimmed, reasoning split off, then
    /// tool calls.
    ///
    /// Never fails on model output: a malformed call (an error of the format's parser), or
    /// tool-call markup that yields no call at all (unterminated, unparsable, unknown tools),
    /// leaves the whole answer text as `content` with no calls, so the agent sees what the
    /// model wrote (the session records the exact tokens either way).
    pub fn parse(&self, text: &str, tools: &[ToolSpec]) -> Result<ParsedAssistant> {
        let mut text = text;
        while let Some(stripped) = self
            .end_of_turn
            .iter()
            .find_map(|s| text.strip_suffix(s.as_str()))
        {
            text = stripped;
        }
        let (reasoning_content, rest) = match self.reasoning {
            Some(parser) => parser.parse(text),
            None => (None, text.to_owned()),
        };
        let (content, tool_calls) = match self.tool_calls {
            Some(parser) => match parser.parse(&rest, tools) {
                Ok((_, calls)) if calls.is_empty() && parser.has_tool_call(&rest) => {
                    tracing::warn!(
                        "tool-call markup without a valid call; the text is kept as content"
                    );
                    (rest, Vec::new())
                }
                Ok(parsed) => parsed,
                Err(error) => {
                    tracing::warn!(%error, "tool-call parsing failed; the text is kept as content");
                    (rest, Vec::new())
                }
            },
            None => (rest, Vec::new()),
        };
        Ok(ParsedAssistant {
            content,
            reasoning_content,
            tool_calls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<ToolSpec> {
        vec![ToolSpec::function(
            "get_weather",
            "w",
            json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}),
        )]
    }

    #[test]
    fn python_json_spacing() {
        let v = json!({"city": "Zürich", "days": [1, 2], "x": {"a": null}});
        assert_eq!(
            python_json(&v),
            r#"{"city": "Zürich", "days": [1, 2], "x": {"a": null}}"#
        );
    }

    #[test]
    fn qwen3_reasoning_and_qwen25_tool_calls() {
        // SGLang's Qwen3Detector keeps the reasoning's trailing newline and strips the answer.
        let (r, rest) = ReasoningParser::Qwen3 {
            force_reasoning: false,
        }
        .parse("<think>\nplan\n</think>\n\nHi");
        assert_eq!((r.as_deref(), rest.as_str()), (Some("plan\n"), "Hi"));
        let (r, rest) = ReasoningParser::Qwen3 {
            force_reasoning: true,
        }
        .parse("plan</think>ok");
        assert_eq!((r.as_deref(), rest.as_str()), (Some("plan"), "ok"));
        assert_eq!(
            ReasoningParser::Glm45.parse("no tags"),
            (None, "no tags".to_owned())
        );
        let parser = OutputParser {
            reasoning: Some(ReasoningParser::Qwen3 {
                force_reasoning: false,
            }),
            tool_calls: Some(ToolCallParser::Qwen25),
            end_of_turn: vec!["<|im_end|>".into()],
        };
        let text = "<think>\nneed data\n</think>\n\nLet me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\",\"days\":2}}\n</tool_call>\n<tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}\n</tool_call><|im_end|>";
        let parsed = parser.parse(text, &weather()).unwrap();
        assert_eq!(parsed.reasoning_content.as_deref(), Some("need data\n"));
        assert_eq!(parsed.content, "Let me check.");
        assert_eq!(parsed.tool_calls.len(), 1, "unknown tools are dropped");
        assert_eq!(parsed.tool_calls[0].function.name, "get_weather");
        assert_eq!(
            parsed.tool_calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "Paris", "days": 2}"#.into())
        );
        // Malformed or unterminated blocks are skipped, the good ones kept (SGLang).
        let parsed = parser
            .parse(
                "Try.<tool_call>\n{broken\n</tool_call><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call><tool_call>{\"name\"",
                &weather(),
            )
            .unwrap();
        assert_eq!(parsed.content, "Try.");
        assert_eq!(parsed.tool_calls.len(), 1);
        assert_eq!(
            parsed.tool_calls[0].function.arguments,
            ToolArguments::Json("{}".into())
        );
    }

    #[test]
    fn glm_arg_key_value_calls() {
        let glm45 = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        let (normal, calls) = ToolCallParser::Glm45.parse(glm45, &weather()).unwrap();
        assert_eq!(normal, "");
        // `city` is a string in the schema: kept raw; `days` parsed as JSON.
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "42", "days": 3}"#.into())
        );
        let glm47 = "I'll look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>";
        let (normal, calls) = ToolCallParser::Glm47.parse(glm47, &weather()).unwrap();
        assert_eq!(normal, "I'll look.");
        assert_eq!(
            calls[0].function.arguments.to_object().unwrap()["city"],
            json!("Oslo")
        );
        let broken = "Hm.<tool_call>get_weather<arg_key>city</arg_key></tool_call>";
        assert!(ToolCallParser::Glm47.parse(broken, &[]).is_err());
        // The output parser answers with the whole text as content and no calls.
        let output = OutputParser {
            reasoning: None,
            tool_calls: Some(ToolCallParser::Glm47),
            end_of_turn: vec![],
        };
        let parsed = output.parse(broken, &[]).unwrap();
        assert_eq!(parsed.content, broken);
        assert!(parsed.tool_calls.is_empty());
    }

    #[test]
    fn kimi_k2_markers_and_ids() {
        let text = "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"Nice\"}<|tool_call_end|><|tool_calls_section_end|>";
        let (normal, calls) = ToolCallParser::KimiK2.parse(text, &weather()).unwrap();
        assert_eq!(normal, "Sure.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].id.as_deref(), Some("functions.get_weather:1"));
        assert_eq!(calls[1].index, Some(1));
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json("{\"city\": \"Rome\"}".into())
        );
        assert!(ReasoningParser::from_name("nope").is_err());
        assert_eq!(
            ToolCallParser::from_name("glm47").unwrap(),
            ToolCallParser::Glm47
        );
    }
    #[test]
    fn qwen3_coder_values_follow_the_schema() {
        let props = json!({
            "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
            "b": {"type": "boolean"}, "o": {"type": "object"}, "a": {"type": "array"},
            "u": {"type": "uint8"}, "any": {"type": "any"}, "untyped": {}
        });
        let props = props.as_object();
        let cases = [
            ("s", "007", json!("007")),
            ("s", "null", Value::Null),
            ("i", " 42 ", json!(42)),
            ("i", "4.5", json!("4.5")),
            ("n", "3", json!(3)),
            ("n", "3.0", json!(3.0)),
            ("n", "1e3", json!(1000.0)),
            ("n", "abc", json!("abc")),
            ("b", "True", json!(true)),
            ("b", "yes", json!(false)),
            ("o", r#"{"k": [1]}"#, json!({"k": [1]})),
            (
                "o",
                "{'k': 1, 'v': (True, None)}",
                json!({"k": 1, "v": [true, null]}),
            ),
            ("o", "{'k': ", json!("{'k': ")),
            ("any", "true", json!("true")),
            ("any", "-2.5", json!(-2.5)),
            ("any", "['a\\'b', \"c\"]", json!(["a'b", "c"])),
            ("a", "[1, 2]", json!([1, 2])),
            ("u", "7", json!(7)),
            ("any", "x", json!("x")),
            ("untyped", "5", json!("5")),
            ("undeclared", "12", json!("12")),
        ];
        for (key, raw, want) in cases {
            assert_eq!(coder_value(raw, key, props), want, "{key}={raw:?}");
        }
        assert_eq!(coder_value("5", "k", None), json!("5"));
    }

    #[test]
    fn minimax_values_follow_the_schema() {
        let tools = vec![ToolSpec::function(
            "f",
            "",
            json!({"type": "object", "properties": {
                "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
                "b": {"type": "boolean"}, "o": {"type": "object"},
                "e": {"enum": [1, 2]}, "u": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "opt": {"type": ["string", "null"]}
            }}),
        )];
        let cases = [
            ("s", "12", json!("12")),
            ("i", "12", json!(12)),
            ("i", "x", json!("x")),
            ("n", "2.0", json!(2)),
            ("n", "2.5", json!(2.5)),
            ("b", "on", json!(true)),
            ("b", "0", json!(false)),
            ("o", r#"{"a": 1}"#, json!({"a": 1})),
            ("e", "2", json!(2)),
            ("u", "7", json!(7)),
            ("u", "seven", json!("seven")),
            ("opt", "text", json!("text")),
            ("opt", "None", Value::Null),
            ("missing", "[1]", json!("[1]")),
        ];
        for (key, raw, want) in cases {
            assert_eq!(minimax_value(raw, "f", key, &tools), want, "{key}={raw:?}");
        }
    }

    #[test]
    fn dsml_tags_and_reasoning_toggles() {
        // Mixed DSML / plain tags (SGLang's V3.2 detector), extra spaces, JSON bodies.
        let text = "Ok.\n\n<function_calls>\n<｜DSML｜invoke  name=\"get_weather\" >\n<parameter name=\"city\" string=\"true\"> Oslo </｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">2</parameter>\n</invoke>\n<invoke name=\"get_weather\">{\"city\": \"Rome\"}</｜DSML｜invoke>\n</｜DSML｜function_calls>";
        let (normal, calls) = ToolCallParser::DeepSeekV32.parse(text, &weather()).unwrap();
        assert_eq!(normal, "Ok.");
        assert_eq!(
            calls[0].function.arguments,
            ToolArguments::Json(r#"{"city": "Oslo", "days": 2}"#.into())
        );
        assert_eq!(
            calls[1].function.arguments,
            ToolArguments::Json(r#"{"city": "Rome"}"#.into())
        );
        // V4 is strict: a repeated parameter is an error.
        let v4 = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">a</｜DSML｜parameter>\n<｜DSML｜parameter name=\"city\" string=\"true\">b</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        assert!(ToolCallParser::DeepSeekV4.parse(v4, &weather()).is_err());

        let mut off = Map::new();
        off.insert("thinking".into(), json!(false));
        let forced = ReasoningParser::DeepSeekV3 {
            force_reasoning: true,
        };
        assert_eq!(
            forced.for_kwargs(&off),
            ReasoningParser::DeepSeekV3 {
                force_reasoning: false
            }
        );
        let mut on = Map::new();
        on.insert("thinking_mode".into(), json!("thinking"));
        assert_eq!(
            ReasoningParser::from_name("deepseek-v4")
                .unwrap()
                .for_kwargs(&on),
            ReasoningParser::DeepSeekV4 {
                force_reasoning: true
            }
        );
        assert_eq!(
            ReasoningParser::from_name("deepseek-r1")
                .unwrap()
                .parse("a</think>b"),
            (Some("a".to_owned()), "b".to_owned())
        );
        // Kimi: the tool section ends an unclosed reasoning block.
        let (r, rest) = ReasoningParser::KimiK2 {
            force_reasoning: true,
        }
        .parse("plan<|tool_calls_section_begin|>x");
        assert_eq!(
            (r.as_deref(), rest.as_str()),
            (Some("plan"), "<|tool_calls_section_begin|>x")
        );
        for name in [
            "qwen3_coder",
            "minimax-m2",
            "deepseekv31",
            "deepseekv32",
            "deepseekv4",
            "kimi_k2_raw_id",
        ] {
            assert!(ToolCallParser::from_name(name).is_ok(), "{name}");
        }
        for name in [
            "deepseek-v3",
            "nemotron_3",
            "minimax-append-think",
            "minimax",
            "qwen3-thinking",
        ] {
            assert!(ReasoningParser::from_name(name).is_ok(), "{name}");
        }
    }
}
