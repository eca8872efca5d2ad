//! Python's semantics where miles-rs must produce or read the same text as Miles, SGLang and
//! HF's Jinja2 templates (all Python): one module for every crate.
//!
//! * How Python prints values: [`float_repr`] (`1e-05`, `1e+16`, `-0.0`, `inf`, `nan`,
//!   `1.0`), [`str_repr`], [`repr`] and [`str()`] of JSON values as Python prints dicts and lists
//!   (`{'a': 1, 'b': True, 'c': None}`), [`truthy`], and [`round`] (`round(x, n)`, ties to even
//!   on the binary value).
//! * `json.dumps`: [`json_dumps`] of a `serde_json::Value` and [`json_dumps_to_vec`] of any
//!   serialisable value, with Python's separators, `indent`, `ensure_ascii` (`\uXXXX` and
//!   surrogate pairs), `sort_keys` ([`JsonDumpOptions`]) and float text; [`push_json_string`]
//!   for one string literal.
//! * `str` methods and number parsing: [`strip`], [`split_whitespace`], [`is_space`],
//!   [`is_digit_str`], [`is_alpha`], [`decimal_digit`], [`last_chars`], [`float`] (Python's
//!   `float(s)`) and [`int_string`] (`str(int(x))`).
//!
//! Every function is tested against the output of CPython 3.11 (the snippet that produced
//! each expected string is beside it).
//!
//! ```
//! use miles_core::python::{JsonDumpOptions, float_repr, json_dumps, repr, round};
//! use serde_json::json;
//!
//! assert_eq!(float_repr(1e-5), "1e-05");
//! assert_eq!(float_repr(round(0.25, 1)), "0.2");
//! let args = json!({"city": "Zürich", "temp": 1e-5});
//! // SGLang writes tool-call arguments with json.dumps(x, ensure_ascii=False).
//! assert_eq!(json_dumps(&args, &JsonDumpOptions::unicode()), r#"{"city": "Zürich", "temp": 1e-05}"#);
//! assert_eq!(json_dumps(&args, &JsonDumpOptions::default()), r#"{"city": "Z\u00fcrich", "temp": 1e-05}"#);
//! assert_eq!(repr(&json!({"a": 1, "b": true, "c": null})), "{'a': 1, 'b': True, 'c': None}");
//! ```

mod json;
mod repr;
mod text;

pub use json::{JsonDumpOptions, json_dumps, json_dumps_to_vec, push_json_string};
pub use repr::{float_repr, repr, round, str, str_repr, truthy};
pub use text::{
    decimal_digit, float, int_string, is_alpha, is_digit_str, is_space, last_chars,
    split_whitespace, strip,
};
