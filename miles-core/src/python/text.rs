//! Python's `str` methods and number parsing: `str.strip()`, `str.split()`, `str.isspace()`,
//! `str.isdigit()`, `str.isalpha()`, `s[-n:]`, `float(s)` and `str(int(x))`.

/// Python's `str.isspace()` for one character (Unicode `White_Space` plus the ASCII
/// information separators U+001C..U+001F, which Python also treats as whitespace).
pub fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip()` without arguments.
pub fn strip(s: &str) -> &str {
    s.trim_matches(is_space)
}

/// Python's `str.split()` without arguments.
pub fn split_whitespace(s: &str) -> impl Iterator<Item = &str> {
    s.split(is_space).filter(|t| !t.is_empty())
}

/// Python's `s[-n:]` (code points).
pub fn last_chars(s: &str, n: usize) -> &str {
    if n == 0 {
        return "";
    }
    match s.char_indices().rev().nth(n - 1) {
        Some((at, _)) => &s[at..],
        None => s,
    }
}

/// The first code point of every run of ten Unicode decimal digits (category `Nd`, Unicode
/// 14 as in Python 3.11).
const DIGIT_ZEROS: [u32; 66] = [
    0x30, 0x660, 0x6F0, 0x7C0, 0x966, 0x9E6, 0xA66, 0xAE6, 0xB66, 0xBE6, 0xC66, 0xCE6, 0xD66,
    0xDE6, 0xE50, 0xED0, 0xF20, 0x1040, 0x1090, 0x17E0, 0x1810, 0x1946, 0x19D0, 0x1A80, 0x1A90,
    0x1B50, 0x1BB0, 0x1C40, 0x1C50, 0xA620, 0xA8D0, 0xA900, 0xA9D0, 0xA9F0, 0xAA50, 0xABF0, 0xFF10,
    0x104A0, 0x10D30, 0x11066, 0x110F0, 0x11136, 0x111D0, 0x112F0, 0x11450, 0x114D0, 0x11650,
    0x116C0, 0x11730, 0x118E0, 0x11950, 0x11C50, 0x11D50, 0x11DA0, 0x16A60, 0x16AC0, 0x16B50,
    0x1D7CE, 0x1D7D8, 0x1D7E2, 0x1D7EC, 0x1D7F6, 0x1E140, 0x1E2F0, 0x1E950, 0x1FBF0,
];

/// The value of a Unicode decimal digit (Python's `\d`, what `float()` / `int()` accept).
pub fn decimal_digit(c: char) -> Option<u32> {
    let cp = u32::from(c);
    let i = DIGIT_ZEROS.partition_point(|&z| z <= cp);
    let zero = *DIGIT_ZEROS.get(i.checked_sub(1)?)?;
    (cp - zero < 10).then_some(cp - zero)
}

/// Python's `float(s)`: surrounding whitespace, a sign, `_` between digits, any Unicode
/// decimal digits, `inf` / `infinity` / `nan` in any case.
pub fn float(s: &str) -> Option<f64> {
    let ascii: String;
    let s = if s.is_ascii() {
        s
    } else {
        ascii = s
            .chars()
            .map(|c| match decimal_digit(c) {
                Some(d) => char::from(b'0' + d as u8),
                None => c,
            })
            .collect();
        &ascii
    };
    let t = strip(s);
    let (neg, body) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let lower = body.to_ascii_lowercase();
    let special = match lower.as_str() {
        "inf" | "infinity" => Some(f64::INFINITY),
        "nan" => Some(f64::NAN),
        _ => None,
    };
    if let Some(v) = special {
        return Some(if neg { -v } else { v });
    }
    let bytes = body.as_bytes();
    let mut cleaned = String::with_capacity(body.len() + 1);
    let mut saw_digit = false;
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'0'..=b'9' => {
                saw_digit = true;
                cleaned.push(b as char);
            }
            b'_' => {
                let ok = i > 0
                    && bytes[i - 1].is_ascii_digit()
                    && bytes.get(i + 1).is_some_and(u8::is_ascii_digit);
                if !ok {
                    return None;
                }
            }
            b'.' | b'e' | b'E' => cleaned.push(b as char),
            b'+' | b'-' if i > 0 && matches!(bytes[i - 1], b'e' | b'E') => cleaned.push(b as char),
            _ => return None,
        }
    }
    if !saw_digit {
        return None;
    }
    let v: f64 = cleaned.parse().ok()?;
    Some(if neg { -v } else { v })
}

/// Python's `str(int(x))` for a finite float (truncation toward zero, exact digits);
/// `None` for inf / nan (Python raises).
pub fn int_string(x: f64) -> Option<String> {
    if !x.is_finite() {
        return None;
    }
    let t = x.trunc();
    if t == 0.0 {
        return Some("0".into());
    }
    let neg = t < 0.0;
    let bits = t.abs().to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i64 - 1075;
    let mantissa = (bits & ((1u64 << 52) - 1)) | (1u64 << 52);
    // value = mantissa * 2^exp, exp may be negative for small integers.
    let digits = if exp >= 0 {
        // Big number in base 1e9, little endian.
        let mut limbs: Vec<u64> = vec![mantissa % 1_000_000_000, mantissa / 1_000_000_000];
        for _ in 0..exp {
            let mut carry = 0u64;
            for limb in &mut limbs {
                let v = *limb * 2 + carry;
                *limb = v % 1_000_000_000;
                carry = v / 1_000_000_000;
            }
            if carry > 0 {
                limbs.push(carry);
            }
        }
        while limbs.len() > 1 && limbs.last() == Some(&0) {
            limbs.pop();
        }
        let mut s = limbs.last().map(u64::to_string).unwrap_or_default();
        for limb in limbs.iter().rev().skip(1) {
            s.push_str(&format!("{limb:09}"));
        }
        s
    } else {
        (mantissa >> (-exp).min(63)).to_string()
    };
    Some(if neg { format!("-{digits}") } else { digits })
}

/// Python's `str.isdigit()` on a whole string (non-empty, every character a digit; non-ASCII
/// characters count when Rust calls them numeric, a close approximation of Python's set).
pub fn is_digit_str(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_digit() || (!c.is_ascii() && c.is_numeric()))
}

/// Python's `str.isalpha()` for one character.
pub fn is_alpha(c: char) -> bool {
    c.is_alphabetic()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_number_semantics() {
        assert_eq!(float(" 1_000 "), Some(1000.0));
        assert_eq!(float("1__0"), None);
        assert_eq!(float("5."), Some(5.0));
        assert_eq!(float(".5"), Some(0.5));
        assert_eq!(float("-Infinity"), Some(f64::NEG_INFINITY));
        assert_eq!(float("1e3"), Some(1000.0));
        assert_eq!(float("e3"), None);
        assert_eq!(float(""), None);
        assert_eq!(float("٣.٥"), Some(3.5));
        assert_eq!(float("𝟓"), Some(5.0));
        assert_eq!(decimal_digit('9'), Some(9));
        assert_eq!(decimal_digit('a'), None);
        assert_eq!(decimal_digit('\u{65f}'), None);
        assert_eq!(
            int_string(1e30).as_deref(),
            Some("1000000000000000019884624838656")
        );
        assert_eq!(int_string(-42.9).as_deref(), Some("-42"));
        assert_eq!(int_string(f64::NAN), None);
        assert_eq!(last_chars("héllo", 3), "llo");
        assert_eq!(last_chars("ab", 5), "ab");
    }
}
