//! Standard base64 (RFC 4648, `+/` alphabet, `=` padding), as SGLang uses for
//! `meta_info.routed_experts`. Hand-written so miles-core keeps its dependency list short.

use crate::error::{Error, Result};

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes bytes as padded standard base64.
pub fn encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(ALPHABET[(n >> 18) as usize & 63] as char);
        out.push(ALPHABET[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            ALPHABET[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            ALPHABET[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

fn sextet(c: u8) -> Option<u32> {
    match c {
        b'A'..=b'Z' => Some(u32::from(c - b'A')),
        b'a'..=b'z' => Some(u32::from(c - b'a') + 26),
        b'0'..=b'9' => Some(u32::from(c - b'0') + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    }
}

/// Decodes padded (or unpadded) standard base64. ASCII whitespace is ignored; any other
/// character outside the alphabet, misplaced padding or a dangling single character is an
/// [`Error::Base64`].
pub fn decode(text: &str) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let mut acc: u32 = 0;
    let mut count = 0usize;
    let mut padding = 0usize;
    for (position, &c) in text.as_bytes().iter().enumerate() {
        if c.is_ascii_whitespace() {
            continue;
        }
        if c == b'=' {
            padding += 1;
            if padding > 2 {
                return Err(Error::Base64 {
                    position,
                    reason: "too much padding",
                });
            }
            continue;
        }
        if padding > 0 {
            return Err(Error::Base64 {
                position,
                reason: "data after padding",
            });
        }
        let value = sextet(c).ok_or(Error::Base64 {
            position,
            reason: "character outside the base64 alphabet",
        })?;
        acc = (acc << 6) | value;
        count += 1;
        if count == 4 {
            out.extend_from_slice(&[(acc >> 16) as u8, (acc >> 8) as u8, acc as u8]);
            acc = 0;
            count = 0;
        }
    }
    match count {
        0 => {}
        1 => {
            return Err(Error::Base64 {
                position: text.len(),
                reason: "truncated input",
            });
        }
        2 => out.push((acc >> 4) as u8),
        _ => out.extend_from_slice(&[(acc >> 10) as u8, (acc >> 2) as u8]),
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, encoded) in cases {
            assert_eq!(encode(plain.as_bytes()), encoded);
            assert_eq!(decode(encoded).unwrap(), plain.as_bytes());
        }
        // Python: base64.b64encode(np.array([1, -1, 300], dtype='<i4').tobytes())
        assert_eq!(
            decode("AQAAAP////8sAQAA").unwrap(),
            [1, 0, 0, 0, 255, 255, 255, 255, 44, 1, 0, 0]
        );
    }

    #[test]
    fn corrupt_input_is_a_typed_error() {
        assert!(matches!(
            decode("Zm9v!"),
            Err(Error::Base64 { position: 4, .. })
        ));
        assert!(matches!(decode("Zg==Zg"), Err(Error::Base64 { .. })));
        assert!(matches!(decode("Z"), Err(Error::Base64 { .. })));
        assert!(matches!(decode("Zg==="), Err(Error::Base64 { .. })));
    }
}
