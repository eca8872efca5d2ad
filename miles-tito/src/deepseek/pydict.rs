//! Python's dict / list access and exceptions over JSON values, as the encoders' Python code
//! performs them: a failing access is the [`Raise`] of the exception Python raises.

use std::borrow::Cow;

use serde_json::{Map, Value as Json};

use super::version::DeepSeekVersion;
use crate::error::Error;
use miles_core::python::str as py_str;

/// A Python exception: its class name and message.
pub(super) struct Raise {
    pub(super) exception: &'static str,
    pub(super) message: String,
}

pub(super) type Py<T> = std::result::Result<T, Raise>;

pub(super) fn raise<T>(exception: &'static str, message: impl Into<String>) -> Py<T> {
    Err(Raise {
        exception,
        message: message.into(),
    })
}

impl Raise {
    pub(super) fn into_error(self, version: DeepSeekVersion) -> Error {
        Error::DeepSeekEncoding {
            encoder: version.model_type(),
            exception: self.exception,
            message: self.message,
        }
    }
}

pub(super) static NULL: Json = Json::Null;

pub(super) fn py_type(value: &Json) -> &'static str {
    match value {
        Json::Null => "NoneType",
        Json::Bool(_) => "bool",
        Json::Number(n) if n.is_f64() => "float",
        Json::Number(_) => "int",
        Json::String(_) => "str",
        Json::Array(_) => "list",
        Json::Object(_) => "dict",
    }
}

pub(crate) use miles_core::python::truthy;

pub(super) fn is_str(value: &Json, text: &str) -> bool {
    value.as_str() == Some(text)
}

pub(super) fn as_dict(value: &Json) -> Py<&Map<String, Json>> {
    match value {
        Json::Object(map) => Ok(map),
        other => raise(
            "AttributeError",
            format!("'{}' object has no attribute 'get'", py_type(other)),
        ),
    }
}

/// `d.get(key)`.
pub(super) fn get<'a>(value: &'a Json, key: &str) -> Py<&'a Json> {
    Ok(as_dict(value)?.get(key).unwrap_or(&NULL))
}

/// `d.get(key, default)`.
pub(super) fn get_or<'a>(value: &'a Json, key: &str, default: &'a Json) -> Py<&'a Json> {
    Ok(as_dict(value)?.get(key).unwrap_or(default))
}

/// `value[key]` with a string key.
pub(super) fn subscript<'a>(value: &'a Json, key: &str) -> Py<&'a Json> {
    match value {
        Json::Object(map) => match map.get(key) {
            Some(item) => Ok(item),
            None => raise("KeyError", format!("'{key}'")),
        },
        Json::Array(_) => raise(
            "TypeError",
            "list indices must be integers or slices, not str",
        ),
        Json::String(_) => raise("TypeError", "string indices must be integers, not 'str'"),
        other => raise(
            "TypeError",
            format!("'{}' object is not subscriptable", py_type(other)),
        ),
    }
}

/// `for item in value`.
pub(super) fn iterate(value: &Json) -> Py<Vec<Cow<'_, Json>>> {
    match value {
        Json::Array(items) => Ok(items.iter().map(Cow::Borrowed).collect()),
        Json::Object(map) => Ok(map
            .keys()
            .map(|k| Cow::Owned(Json::String(k.clone())))
            .collect()),
        Json::String(s) => Ok(s
            .chars()
            .map(|c| Cow::Owned(Json::String(c.to_string())))
            .collect()),
        other => raise(
            "TypeError",
            format!("'{}' object is not iterable", py_type(other)),
        ),
    }
}

/// `len(value)`.
pub(super) fn py_len(value: &Json) -> Py<usize> {
    match value {
        Json::Array(items) => Ok(items.len()),
        Json::Object(map) => Ok(map.len()),
        Json::String(s) => Ok(s.chars().count()),
        other => raise(
            "TypeError",
            format!("object of type '{}' has no len()", py_type(other)),
        ),
    }
}

/// `str(value or "")`.
pub(super) fn or_empty(value: &Json) -> Cow<'_, str> {
    if truthy(value) {
        py_str(value)
    } else {
        Cow::Borrowed("")
    }
}

/// The right operand of `str + value`.
pub(super) fn concat_operand(value: &Json) -> Py<&str> {
    match value {
        Json::String(s) => Ok(s),
        other => raise(
            "TypeError",
            format!(
                "can only concatenate str (not \"{}\") to str",
                py_type(other)
            ),
        ),
    }
}

/// `sep.join(items)` where every item must be a string.
pub(super) fn join_strings(items: &[Cow<'_, Json>], sep: &str) -> Py<String> {
    let mut out = String::new();
    for (i, item) in items.iter().enumerate() {
        let Json::String(s) = item.as_ref() else {
            return raise(
                "TypeError",
                format!(
                    "sequence item {i}: expected str instance, {} found",
                    py_type(item)
                ),
            );
        };
        if i > 0 {
            out.push_str(sep);
        }
        out.push_str(s);
    }
    Ok(out)
}

/// `json.loads(text)` for tool-call arguments.
pub(super) fn json_loads(text: &str) -> Py<Json> {
    serde_json::from_str(text).or_else(|e| raise("JSONDecodeError", e.to_string()))
}

/// Whether a value can be a dict key (`hash()` succeeds).
pub(super) fn hashable(value: &Json) -> Py<()> {
    match value {
        Json::Array(_) | Json::Object(_) => raise(
            "TypeError",
            format!("unhashable type: '{}'", py_type(value)),
        ),
        _ => Ok(()),
    }
}

/// A message's role, compared with `==` against role names.
pub(super) fn role_of(message: &Json) -> Py<&Json> {
    get(message, "role")
}

pub(super) fn find_last_user_index(messages: &[Json]) -> Py<isize> {
    for (idx, message) in messages.iter().enumerate().rev() {
        let role = role_of(message)?;
        if is_str(role, "user") || is_str(role, "developer") {
            return Ok(idx as isize);
        }
    }
    Ok(-1)
}
