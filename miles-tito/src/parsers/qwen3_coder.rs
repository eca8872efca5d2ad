//! Qwen3-Coder / Qwen3.5 / Nemotron 3 tool calls (SGLang `qwen3_coder`):
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>\n</tool_call>`,
//! values typed by the tool's JSON schema (Python literals included).

use miles_core::ToolSpec;
use serde_json::{Map, Value};

use super::markup::{
    RawCall, delimited, find_first, int_or_float, py_float, python_json, strip_one_newline,
};

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

/// The calls in `text`: every `<function=…>` of every `<tool_call>` block (the whole text when
/// no block is closed), arguments typed by the schema.
pub(crate) fn parse(text: &str, tools: &[ToolSpec]) -> Vec<RawCall> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
}
