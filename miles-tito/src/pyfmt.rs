//! Python-compatible text forms of template values.
//!
//! HF renders chat templates in Python's Jinja2, so values print the way Python prints them:
//! `str()` of `None`/`True` is `None`/`True`, containers print as their `repr()`, floats use
//! Python's shortest round-trip repr, and HF's `tojson` is `json.dumps(x, ensure_ascii=False,
//! indent=…, separators=…, sort_keys=…)`. This module applies those forms to minijinja
//! values; the primitives (`repr(float)`, `repr(str)`, JSON string literals, the `json.dumps`
//! options) are miles-core's [`miles_core::python`], which also prints JSON values.

use std::fmt::Write as _;

use miles_core::python::{JsonDumpOptions, float_repr, push_json_string, str_repr};
use minijinja::value::{Value, ValueKind};
use minijinja::{Error as JinjaError, ErrorKind};

fn number_text(value: &Value, json: bool) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    if json {
        if f.is_nan() {
            return "NaN".into();
        }
        if f.is_infinite() {
            return if f > 0.0 {
                "Infinity".into()
            } else {
                "-Infinity".into()
            };
        }
    }
    float_repr(f)
}

/// Python `repr()` of a value (how Jinja2 prints a value nested in a list or dict).
pub fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, value);
    out
}

fn write_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => out.push_str("Undefined"),
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_text(value, false)),
        ValueKind::String => out.push_str(&str_repr(value.as_str().unwrap_or_default())),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            if let Ok(iter) = value.try_iter() {
                for (i, item) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                }
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(iter) = value.try_iter() {
                for (i, key) in iter.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python `str()` of a value, which is what `{{ value }}` prints in Jinja2 (undefined prints
/// as the empty string).
pub fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        ValueKind::None | ValueKind::Bool | ValueKind::Number | ValueKind::Seq | ValueKind::Map => {
            py_repr(value)
        }
        ValueKind::Iterable => py_repr(value),
        _ => value.to_string(),
    }
}

/// Python `json.dumps(value, …)` for a minijinja value. Values JSON cannot hold (undefined,
/// functions, namespaces) are an error, as in Python.
pub fn json_dumps(value: &Value, options: &JsonDumpOptions) -> Result<String, JinjaError> {
    let (item_sep, key_sep) = options.effective_separators();
    let mut out = String::new();
    let ctx = DumpCtx {
        options,
        item_sep,
        key_sep,
    };
    ctx.write(&mut out, value, 0)?;
    Ok(out)
}

struct DumpCtx<'a> {
    options: &'a JsonDumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl DumpCtx<'_> {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(indent) = &self.options.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, out: &mut String, value: &Value, level: usize) -> Result<(), JinjaError> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&number_text(value, true)),
            ValueKind::String => push_json_string(
                out,
                value.as_str().unwrap_or_default(),
                self.options.ensure_ascii,
            ),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push(']');
            }
            ValueKind::Map => {
                let mut pairs: Vec<(Value, Value)> =
                    match value.as_object().and_then(|o| o.try_iter_pairs()) {
                        Some(pairs) => pairs.collect(),
                        None => {
                            let keys: Vec<Value> = value.try_iter()?.collect();
                            let mut pairs = Vec::with_capacity(keys.len());
                            for key in keys {
                                let item = value.get_item(&key)?;
                                pairs.push((key, item));
                            }
                            pairs
                        }
                    };
                if pairs.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.options.sort_keys {
                    pairs.sort_by(|a, b| a.0.cmp(&b.0));
                }
                out.push('{');
                for (i, (key, item)) in pairs.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_sep);
                    }
                    self.newline(out, level + 1);
                    let key_text = match key.kind() {
                        ValueKind::String => {
                            push_json_string(
                                out,
                                key.as_str().unwrap_or_default(),
                                self.options.ensure_ascii,
                            );
                            out.push_str(self.key_sep);
                            self.write(out, item, level + 1)?;
                            continue;
                        }
                        ValueKind::None => "null".to_owned(),
                        ValueKind::Bool => {
                            (if key.is_true() { "true" } else { "false" }).to_owned()
                        }
                        ValueKind::Number => number_text(key, true),
                        _ => {
                            return Err(JinjaError::new(
                                ErrorKind::InvalidOperation,
                                format!(
                                    "keys must be str, int, float, bool or None, not {}",
                                    key.kind()
                                ),
                            ));
                        }
                    };
                    push_json_string(out, &key_text, self.options.ensure_ascii);
                    out.push_str(self.key_sep);
                    self.write(out, item, level + 1)?;
                }
                self.newline(out, level);
                out.push('}');
            }
            kind => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!("Object of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }
}

/// Python `time.strftime`-style formatting of a UTC-offset-free civil time (what HF's
/// `strftime_now` does with the local clock). Supports the directives chat templates use:
/// `%d %m %Y %y %B %b %h %A %a %H %I %M %S %p %j %e %%`; unknown directives are kept as is.
pub fn strftime(format: &str, time: &CivilTime) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let month = MONTHS[(time.month.clamp(1, 12) - 1) as usize];
        let day = DAYS[time.weekday as usize % 7];
        match d {
            'd' => {
                let _ = write!(out, "{:02}", time.day);
            }
            'e' => {
                let _ = write!(out, "{:>2}", time.day);
            }
            'm' => {
                let _ = write!(out, "{:02}", time.month);
            }
            'Y' => {
                let _ = write!(out, "{}", time.year);
            }
            'y' => {
                let _ = write!(out, "{:02}", time.year.rem_euclid(100));
            }
            'B' => out.push_str(month),
            'b' | 'h' => out.push_str(&month[..3]),
            'A' => out.push_str(day),
            'a' => out.push_str(&day[..3]),
            'H' => {
                let _ = write!(out, "{:02}", time.hour);
            }
            'I' => {
                let h = time.hour % 12;
                let _ = write!(out, "{:02}", if h == 0 { 12 } else { h });
            }
            'p' => out.push_str(if time.hour < 12 { "AM" } else { "PM" }),
            'M' => {
                let _ = write!(out, "{:02}", time.minute);
            }
            'S' => {
                let _ = write!(out, "{:02}", time.second);
            }
            'j' => {
                let _ = write!(out, "{:03}", time.day_of_year);
            }
            '%' => out.push('%'),
            other => {
                out.push('%');
                out.push(other);
            }
        }
    }
    out
}

/// A calendar date and time of day (proleptic Gregorian, UTC).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilTime {
    /// Year, e.g. 2024.
    pub year: i64,
    /// Month 1-12.
    pub month: u32,
    /// Day of month 1-31.
    pub day: u32,
    /// Hour 0-23.
    pub hour: u32,
    /// Minute 0-59.
    pub minute: u32,
    /// Second 0-59.
    pub second: u32,
    /// Day of week, 0 = Monday.
    pub weekday: u32,
    /// Day of year, 1-366.
    pub day_of_year: u32,
}

impl CivilTime {
    /// The civil time `secs` seconds after the Unix epoch (UTC).
    pub fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400);
        // Howard Hinnant's days-to-civil algorithm.
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy_mar + 2) / 153;
        let day = (doy_mar - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let day_of_year = CUM[(month - 1) as usize] + day + u32::from(leap && month > 2);
        // 1970-01-01 was a Thursday (weekday 3 with Monday = 0).
        let weekday = (days + 3).rem_euclid(7) as u32;
        Self {
            year,
            month,
            day,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            weekday,
            day_of_year,
        }
    }

    /// The current UTC time.
    pub fn now() -> Self {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        Self::from_unix(secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_dumps_matches_python() {
        let value = Value::from_serialize(serde_json::json!({
            "b": [1, 2.0, true, null, "é\n\"<>&"], "a": {}, "c": []
        }));
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            json_dumps(&value, &JsonDumpOptions::unicode()).unwrap(),
            r#"{"b": [1, 2.0, true, null, "é\n\"<>&"], "a": {}, "c": []}"#
        );
        // json.dumps(v, ensure_ascii=True, sort_keys=True)
        let opts = JsonDumpOptions {
            ensure_ascii: true,
            sort_keys: true,
            ..Default::default()
        };
        assert_eq!(
            json_dumps(&value, &opts).unwrap(),
            r#"{"a": {}, "b": [1, 2.0, true, null, "\u00e9\n\"<>&"], "c": []}"#
        );
        // json.dumps({"x": [1, {"y": "😀"}]}, indent=2, ensure_ascii=True)
        let value = Value::from_serialize(serde_json::json!({"x": [1, {"y": "😀"}]}));
        let opts = JsonDumpOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(
            json_dumps(&value, &opts).unwrap(),
            "{\n  \"x\": [\n    1,\n    {\n      \"y\": \"\\ud83d\\ude00\"\n    }\n  ]\n}"
        );
    }

    #[test]
    fn repr_matches_python() {
        let value = Value::from_serialize(serde_json::json!([
            {"type": "text", "text": "it's"}, null, true, 1.5, "a\"b", "tab\t\u{200b}"
        ]));
        // repr([{'type': 'text', 'text': "it's"}, None, True, 1.5, 'a"b', 'tab\t\u200b'])
        assert_eq!(
            py_repr(&value),
            r#"[{'type': 'text', 'text': "it's"}, None, True, 1.5, 'a"b', 'tab\t\u200b']"#
        );
    }

    #[test]
    fn strftime_matches_python() {
        // 2024-07-26 13:05:09 UTC = 1722000309; time.strftime("%d %b %Y", ...) = "26 Jul 2024".
        let t = CivilTime::from_unix(1_722_000_309);
        assert_eq!(strftime("%d %b %Y", &t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %j %H:%M:%S %p %y", &t),
            "Friday July 208 13:25:09 PM 24"
        );
        let leap = CivilTime::from_unix(951_782_400); // 2000-02-29 00:00:00
        assert_eq!(
            strftime("%Y-%m-%d %a %j %I", &leap),
            "2000-02-29 Tue 060 12"
        );
    }
}
