//! Python's `json.dumps`: its separators, `indent`, `ensure_ascii` (`\uXXXX`, surrogate pairs
//! above U+FFFF), `sort_keys`, and floats as `float.__repr__` (`1e-05`, `1e+16`, `-0.0`)
//! where serde_json writes `1e-5`, `1e16`.

use std::io;

use serde::Serialize;
use serde_json::ser::{Formatter, Serializer};
use serde_json::{Map, Value};

use super::repr::float_repr;

/// The options of Python's `json.dumps` that change its text. [`Default`] is Python's
/// defaults: `ensure_ascii=True`, no indent, separators `(", ", ": ")`, keys in the map's
/// order. Callers that mirror SGLang or HF's `tojson` set `ensure_ascii: false`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonDumpOptions {
    /// Escape every non-ASCII character (and DEL) as `\uXXXX`, with surrogate pairs above
    /// U+FFFF.
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string (Python's `indent=2` is `"  "`).
    pub indent: Option<String>,
    /// Item and key separators; Python's default is `(", ", ": ")`, or `(",", ": ")` with an
    /// indent.
    pub separators: Option<(String, String)>,
    /// Sort object keys (by code point, as Python compares strings).
    pub sort_keys: bool,
}

impl Default for JsonDumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: true,
            indent: None,
            separators: None,
            sort_keys: false,
        }
    }
}

impl JsonDumpOptions {
    /// `json.dumps(x, ensure_ascii=False)`: what SGLang writes tool-call arguments with.
    pub fn unicode() -> Self {
        Self {
            ensure_ascii: false,
            ..Self::default()
        }
    }

    /// `json.dumps(x, ensure_ascii=False, separators=(",", ":"))`: Python's compact form.
    pub fn compact() -> Self {
        Self {
            ensure_ascii: false,
            separators: Some((",".into(), ":".into())),
            ..Self::default()
        }
    }

    /// The item and key separators `json.dumps` writes with these options: the given ones,
    /// else `(",", ": ")` with an indent and `(", ", ": ")` without.
    pub fn effective_separators(&self) -> (&str, &str) {
        match &self.separators {
            Some((item, key)) => (item, key),
            None if self.indent.is_some() => (",", ": "),
            None => (", ", ": "),
        }
    }
}

/// Python's `json.dumps(value, …)` of a value as `json.loads` produced it.
pub fn json_dumps(value: &Value, options: &JsonDumpOptions) -> String {
    // Writing a `Value` into memory cannot fail (its keys are strings, its floats finite),
    // and the formatter writes valid UTF-8.
    json_dumps_to_vec(value, options)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .unwrap_or_default()
}

/// Python's `json.dumps(…)` of any serialisable value, as bytes. Fails where serde_json
/// does (a map key that is not a string or an integer); a non-finite float is written as
/// `null` (Python writes `NaN` / `Infinity`, which are not JSON).
pub fn json_dumps_to_vec<T: Serialize + ?Sized>(
    value: &T,
    options: &JsonDumpOptions,
) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(128);
    if options.sort_keys {
        sorted(serde_json::to_value(value)?).serialize(&mut Serializer::with_formatter(
            &mut out,
            formatter(options),
        ))?;
    } else {
        value.serialize(&mut Serializer::with_formatter(
            &mut out,
            formatter(options),
        ))?;
    }
    Ok(out)
}

/// Appends `s` as a JSON string literal the way Python's `json.dumps` writes it: `\"`, `\\`,
/// `\b \f \n \r \t`, other control characters as lowercase `\u00XX`, and with `ensure_ascii`
/// every character above `~` as `\uXXXX`.
pub fn push_json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    let options = JsonDumpOptions {
        ensure_ascii,
        ..JsonDumpOptions::default()
    };
    let mut bytes = Vec::with_capacity(s.len() + 2);
    // A string serialises without error, into valid UTF-8.
    if s.serialize(&mut Serializer::with_formatter(
        &mut bytes,
        formatter(&options),
    ))
    .is_ok()
        && let Ok(text) = String::from_utf8(bytes)
    {
        out.push_str(&text);
    }
}

fn formatter(options: &JsonDumpOptions) -> PythonFormatter<'_> {
    let (item_separator, key_separator) = options.effective_separators();
    PythonFormatter {
        item_separator: item_separator.as_bytes(),
        key_separator: key_separator.as_bytes(),
        indent: options.indent.as_deref().map(str::as_bytes),
        ensure_ascii: options.ensure_ascii,
        level: 0,
        has_value: false,
    }
}

/// `value` with every object's keys in sorted order (whatever the map type keeps).
fn sorted(value: Value) -> Value {
    match value {
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, sorted(v)))
                    .collect::<Map<_, _>>(),
            )
        }
        other => other,
    }
}

/// serde_json's writer with Python's separators, indentation, `ensure_ascii` and float text.
/// String escapes are serde_json's, which are Python's (`\"`, `\\`, `\b \f \n \r \t`, other
/// control characters as lowercase `\u00XX`).
struct PythonFormatter<'a> {
    item_separator: &'a [u8],
    key_separator: &'a [u8],
    indent: Option<&'a [u8]>,
    ensure_ascii: bool,
    level: usize,
    has_value: bool,
}

impl PythonFormatter<'_> {
    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(indent) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent)?;
            }
        }
        Ok(())
    }
}

impl Formatter for PythonFormatter<'_> {
    fn write_f64<W: ?Sized + io::Write>(&mut self, w: &mut W, value: f64) -> io::Result<()> {
        w.write_all(float_repr(value).as_bytes())
    }

    fn write_f32<W: ?Sized + io::Write>(&mut self, w: &mut W, value: f32) -> io::Result<()> {
        self.write_f64(w, f64::from(value))
    }

    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"]")
    }

    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if !first {
            w.write_all(self.item_separator)?;
        }
        self.newline(w)
    }

    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b"}")
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if !first {
            w.write_all(self.item_separator)?;
        }
        self.newline(w)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(self.key_separator)
    }

    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        if !self.ensure_ascii {
            return w.write_all(fragment.as_bytes());
        }
        let mut rest = fragment;
        while let Some(at) = rest.bytes().position(|b| b > b'~') {
            w.write_all(&rest.as_bytes()[..at])?;
            let Some(c) = rest[at..].chars().next() else {
                break;
            };
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                write!(w, "\\u{unit:04x}")?;
            }
            rest = &rest[at + c.len_utf8()..];
        }
        w.write_all(rest.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Keys in sorted order, so the map order is the same with or without serde_json's
    /// `preserve_order`:
    /// v = {"arguments": {"big": 1e16, "city": "Zürich", "list": [1, 2.5, True, None, "😀"],
    ///      "neg": -0.0, "nested": {"q": "a\"b\\c\n\t\u0001\u007f"}, "temp": 1e-05},
    ///      "name": "get_weather"}
    fn tool_call() -> Value {
        json!({"arguments": {
            "big": 1e16, "city": "Zürich", "list": [1, 2.5, true, null, "😀"], "neg": -0.0,
            "nested": {"q": "a\"b\\c\n\t\u{1}\u{7f}"}, "temp": 1e-05
        }, "name": "get_weather"})
    }

    #[test]
    fn json_dumps_matches_python() {
        let v = tool_call();
        // print(json.dumps(v))
        assert_eq!(
            json_dumps(&v, &JsonDumpOptions::default()),
            r#"{"arguments": {"big": 1e+16, "city": "Z\u00fcrich", "list": [1, 2.5, true, null, "\ud83d\ude00"], "neg": -0.0, "nested": {"q": "a\"b\\c\n\t\u0001\u007f"}, "temp": 1e-05}, "name": "get_weather"}"#
        );
        // print(json.dumps(v, ensure_ascii=False))   (DEL written raw)
        assert_eq!(
            json_dumps(&v, &JsonDumpOptions::unicode()),
            "{\"arguments\": {\"big\": 1e+16, \"city\": \"Zürich\", \"list\": [1, 2.5, true, null, \"😀\"], \"neg\": -0.0, \"nested\": {\"q\": \"a\\\"b\\\\c\\n\\t\\u0001\u{7f}\"}, \"temp\": 1e-05}, \"name\": \"get_weather\"}"
        );
        // print(json.dumps(v, ensure_ascii=False, separators=(",", ":")))
        assert_eq!(
            json_dumps(&v, &JsonDumpOptions::compact()),
            "{\"arguments\":{\"big\":1e+16,\"city\":\"Zürich\",\"list\":[1,2.5,true,null,\"😀\"],\"neg\":-0.0,\"nested\":{\"q\":\"a\\\"b\\\\c\\n\\t\\u0001\u{7f}\"},\"temp\":1e-05},\"name\":\"get_weather\"}"
        );
        // print(repr(json.dumps(v, indent=2)))
        let indent = |s: &str| JsonDumpOptions {
            indent: Some(s.into()),
            ..JsonDumpOptions::default()
        };
        assert_eq!(
            json_dumps(&v, &indent("  ")),
            "{\n  \"arguments\": {\n    \"big\": 1e+16,\n    \"city\": \"Z\\u00fcrich\",\n    \"list\": [\n      1,\n      2.5,\n      true,\n      null,\n      \"\\ud83d\\ude00\"\n    ],\n    \"neg\": -0.0,\n    \"nested\": {\n      \"q\": \"a\\\"b\\\\c\\n\\t\\u0001\\u007f\"\n    },\n    \"temp\": 1e-05\n  },\n  \"name\": \"get_weather\"\n}"
        );
        // print(repr(json.dumps({"a": [1, 2], "b": 1}, indent=0)))
        assert_eq!(
            json_dumps(&json!({"a": [1, 2], "b": 1}), &indent("")),
            "{\n\"a\": [\n1,\n2\n],\n\"b\": 1\n}"
        );
        // print(repr(json.dumps([], indent=2)), repr(json.dumps({}, indent=2)))
        assert_eq!(json_dumps(&json!([]), &indent("  ")), "[]");
        assert_eq!(json_dumps(&json!({}), &indent("  ")), "{}");
        // print(repr(json.dumps([1, "x", None], indent=4)))
        assert_eq!(
            json_dumps(&json!([1, "x", null]), &indent("    ")),
            "[\n    1,\n    \"x\",\n    null\n]"
        );
        // print(repr(json.dumps({"a": [1, 2], "b": 1}, indent="\t", separators=(", ", " = "),
        //                       ensure_ascii=False)))
        let tabs = JsonDumpOptions {
            ensure_ascii: false,
            indent: Some("\t".into()),
            separators: Some((", ".into(), " = ".into())),
            sort_keys: false,
        };
        assert_eq!(
            json_dumps(&json!({"a": [1, 2], "b": 1}), &tabs),
            "{\n\t\"a\" = [\n\t\t1, \n\t\t2\n\t], \n\t\"b\" = 1\n}"
        );
    }

    #[test]
    fn sort_keys_matches_python() {
        let sorted = JsonDumpOptions {
            sort_keys: true,
            ..JsonDumpOptions::default()
        };
        // print(json.dumps({"z": {"y": 1, "x": 2}, "a": [{"d": 1, "c": 2}]}, sort_keys=True))
        let mut v = Map::new();
        v.insert("z".into(), json!({"y": 1, "x": 2}));
        v.insert("a".into(), json!([{"d": 1, "c": 2}]));
        assert_eq!(
            json_dumps(&Value::Object(v), &sorted),
            r#"{"a": [{"c": 2, "d": 1}], "z": {"x": 2, "y": 1}}"#
        );
        // print(repr(json.dumps({"b": [], "a": {}, "c": [{}]}, indent=2, sort_keys=True)))
        let pretty = JsonDumpOptions {
            indent: Some("  ".into()),
            ..sorted
        };
        assert_eq!(
            json_dumps(&json!({"b": [], "a": {}, "c": [{}]}), &pretty),
            "{\n  \"a\": {},\n  \"b\": [],\n  \"c\": [\n    {}\n  ]\n}"
        );
    }

    #[test]
    fn strings_and_structs() {
        // print(json.dumps("é\x7f\u2028😀"), json.dumps("é\x7f\u2028😀", ensure_ascii=False))
        let mut out = String::new();
        push_json_string(&mut out, "é\u{7f}\u{2028}😀", true);
        assert_eq!(out, r#""\u00e9\u007f\u2028\ud83d\ude00""#);
        out.clear();
        push_json_string(&mut out, "é\u{7f}\u{2028}😀", false);
        assert_eq!(out, "\"é\u{7f}\u{2028}😀\"");

        // Any serialisable value, fields in declaration order; non-finite floats are null.
        #[derive(Serialize)]
        struct Meta {
            temp: f64,
            weights: Vec<f32>,
            missing: f64,
        }
        let meta = Meta {
            temp: 1e-05,
            weights: vec![0.5, -0.0],
            missing: f64::NAN,
        };
        let bytes = json_dumps_to_vec(&meta, &JsonDumpOptions::compact()).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"temp":1e-05,"weights":[0.5,-0.0],"missing":null}"#
        );
    }
}
