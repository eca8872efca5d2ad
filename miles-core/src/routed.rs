//! The MoE routing table recorded at rollout (R3, Miles' routing tables).

use serde::{Deserialize, Serialize};

use crate::base64;
use crate::error::{Error, Result};

/// Expert choices per forwarded position, exactly as SGLang returns them: a row-major
/// `[rows, layers, top_k]` table of `i32` expert ids.
///
/// * `rows` = forwarded positions = `len(input_ids) + len(output_ids) − 1` (the last sampled
///   token is never forwarded); in a [`crate::Sample`], `rows == tokens.len() − 1`.
/// * `layers` = **all** transformer layers, dense ones included (their entries are whatever
///   the engine wrote, typically 0); trainers pick the MoE layers out.
/// * `−1` marks padding rows (trainer side, Miles' trainer-side R3 mapping).
///
/// On the wire (`meta_info.routed_experts`) it is base64 of the little-endian int32 buffer;
/// [`RoutedExperts::from_base64`] / [`RoutedExperts::to_base64`] are that codec. In JSON it
/// serialises as `{"shape": [rows, layers, top_k], "data": "<base64>"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RoutedExpertsWire", into = "RoutedExpertsWire")]
pub struct RoutedExperts {
    rows: usize,
    layers: usize,
    top_k: usize,
    data: Vec<i32>,
}

impl RoutedExperts {
    /// A table from its shape and row-major data. The data length must equal
    /// `rows × layers × top_k`, and ids must be ≥ −1.
    pub fn new(rows: usize, layers: usize, top_k: usize, data: Vec<i32>) -> Result<Self> {
        let expected = rows
            .checked_mul(layers)
            .and_then(|n| n.checked_mul(top_k))
            .ok_or_else(|| Error::RoutedExperts("shape overflows".into()))?;
        if data.len() != expected {
            return Err(Error::RoutedExperts(format!(
                "data has {} entries, shape [{rows}, {layers}, {top_k}] needs {expected}",
                data.len()
            )));
        }
        if let Some((at, bad)) = data.iter().enumerate().find(|(_, v)| **v < -1) {
            return Err(Error::RoutedExperts(format!(
                "expert id {bad} at flat index {at} is below -1"
            )));
        }
        Ok(Self {
            rows,
            layers,
            top_k,
            data,
        })
    }

    /// An empty table (`[0, layers, top_k]`).
    pub fn empty(layers: usize, top_k: usize) -> Self {
        Self {
            rows: 0,
            layers,
            top_k,
            data: Vec::new(),
        }
    }

    /// Decodes SGLang's `meta_info.routed_experts`: base64 of little-endian int32,
    /// `[num_tokens, num_layers, top_k]` with `top_k` recovered from the buffer length.
    ///
    /// As in Miles, `num_tokens == 0` gives an empty table (`top_k` is then recovered as 0
    /// unless the buffer is empty too). A buffer whose length is not a multiple of
    /// `4 · num_tokens · num_layers` is an error.
    pub fn from_base64(text: &str, num_tokens: usize, num_layers: usize) -> Result<Self> {
        let bytes = base64::decode(text)?;
        if bytes.len() % 4 != 0 {
            return Err(Error::RoutedExperts(format!(
                "buffer of {} bytes is not a whole number of int32",
                bytes.len()
            )));
        }
        let values = bytes.len() / 4;
        if num_tokens == 0 || num_layers == 0 {
            if values != 0 {
                return Err(Error::RoutedExperts(format!(
                    "{values} values for {num_tokens} tokens × {num_layers} layers"
                )));
            }
            return Ok(Self::empty(num_layers, 0));
        }
        let per_row = num_tokens * num_layers;
        if values % per_row != 0 || values == 0 {
            return Err(Error::RoutedExperts(format!(
                "{values} values do not split into {num_tokens} tokens × {num_layers} layers"
            )));
        }
        let data = bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Self::new(num_tokens, num_layers, values / per_row, data)
    }

    /// Encodes as SGLang does: base64 of the little-endian int32 buffer.
    pub fn to_base64(&self) -> String {
        let mut bytes = Vec::with_capacity(self.data.len() * 4);
        for v in &self.data {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        base64::encode(&bytes)
    }

    /// Number of rows (forwarded positions).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of layers (all transformer layers).
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The shape `[rows, layers, top_k]`.
    pub fn shape(&self) -> [usize; 3] {
        [self.rows, self.layers, self.top_k]
    }

    /// The row-major data.
    pub fn as_slice(&self) -> &[i32] {
        &self.data
    }

    /// Consumes the table into its row-major data.
    pub fn into_vec(self) -> Vec<i32> {
        self.data
    }

    /// The `top_k` expert ids of position `row` at layer `layer`, or `None` out of range.
    pub fn get(&self, row: usize, layer: usize) -> Option<&[i32]> {
        if row >= self.rows || layer >= self.layers {
            return None;
        }
        let start = (row * self.layers + layer) * self.top_k;
        Some(&self.data[start..start + self.top_k])
    }

    /// Keeps the first `rows` rows (no-op if the table is already that short).
    pub fn truncate(&mut self, rows: usize) {
        if rows < self.rows {
            self.rows = rows;
            self.data.truncate(rows * self.layers * self.top_k);
        }
    }

    /// Removes the last `n` rows (Miles' `strip_last_output_tokens` on the replay array).
    pub fn strip_last(&mut self, n: usize) -> Result<()> {
        if n > self.rows {
            return Err(Error::RoutedExperts(format!(
                "cannot strip {n} rows from a table of {}",
                self.rows
            )));
        }
        self.truncate(self.rows - n);
        Ok(())
    }

    /// Appends the rows of `other` (the turn-by-turn merge of addition-R3, Miles' addition-R3):
    /// `start` is the position of `other`'s first row and must equal the rows covered so far
    /// (contiguous), and layers / top-k must agree. An empty `other` is always accepted.
    pub fn extend_from(&mut self, start: usize, other: &RoutedExperts) -> Result<()> {
        if other.rows == 0 {
            return Ok(());
        }
        if start != self.rows {
            return Err(Error::RoutedExperts(format!(
                "rows starting at {start} do not continue a table covering {} rows",
                self.rows
            )));
        }
        if self.rows == 0 && self.data.is_empty() {
            self.layers = other.layers;
            self.top_k = other.top_k;
        }
        if other.layers != self.layers || other.top_k != self.top_k {
            return Err(Error::RoutedExperts(format!(
                "cannot append [_, {}, {}] rows to a [_, {}, {}] table",
                other.layers, other.top_k, self.layers, self.top_k
            )));
        }
        self.rows += other.rows;
        self.data.extend_from_slice(&other.data);
        Ok(())
    }

    /// Merges one turn into a multi-turn trajectory the way Miles does for full-sequence
    /// tables: the later turn's table covers the whole prefix, so it replaces the earlier one,
    /// after checking that the prefix rows they share agree in shape (`other.rows ≥ self.rows`).
    pub fn merge_turn(&mut self, later: RoutedExperts) -> Result<()> {
        if later.rows < self.rows {
            return Err(Error::RoutedExperts(format!(
                "later turn covers {} rows, fewer than the {} already recorded",
                later.rows, self.rows
            )));
        }
        if self.rows > 0 && (later.layers != self.layers || later.top_k != self.top_k) {
            return Err(Error::RoutedExperts(format!(
                "layer/top-k mismatch: [_, {}, {}] vs [_, {}, {}]",
                later.layers, later.top_k, self.layers, self.top_k
            )));
        }
        *self = later;
        Ok(())
    }

    /// Checks every id lies in `-1..num_experts`.
    pub fn check_expert_range(&self, num_experts: usize) -> Result<()> {
        match self
            .data
            .iter()
            .enumerate()
            .find(|(_, v)| **v < -1 || **v as i64 >= num_experts as i64)
        {
            Some((at, v)) => Err(Error::RoutedExperts(format!(
                "expert id {v} at row {} is outside 0..{num_experts}",
                at / (self.layers * self.top_k).max(1)
            ))),
            None => Ok(()),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct RoutedExpertsWire {
    shape: [usize; 3],
    data: String,
}

impl TryFrom<RoutedExpertsWire> for RoutedExperts {
    type Error = Error;

    fn try_from(wire: RoutedExpertsWire) -> Result<Self> {
        let [rows, layers, top_k] = wire.shape;
        let table = Self::from_base64(&wire.data, rows, layers)?;
        if table.rows > 0 && table.top_k != top_k {
            return Err(Error::RoutedExperts(format!(
                "declared top_k {top_k}, data holds {}",
                table.top_k
            )));
        }
        Ok(Self { top_k, ..table })
    }
}

impl From<RoutedExperts> for RoutedExpertsWire {
    fn from(table: RoutedExperts) -> Self {
        Self {
            shape: table.shape(),
            data: table.to_base64(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(rows: usize) -> RoutedExperts {
        let data = (0..rows * 2 * 2).map(|v| (v % 8) as i32).collect();
        RoutedExperts::new(rows, 2, 2, data).unwrap()
    }

    #[test]
    fn decodes_sglang_buffer() {
        // Python: base64.b64encode(np.arange(12, dtype='<i4').tobytes()) → 3 tokens, 2 layers, k=2
        let text = "AAAAAAEAAAACAAAAAwAAAAQAAAAFAAAABgAAAAcAAAAIAAAACQAAAAoAAAALAAAA";
        let t = RoutedExperts::from_base64(text, 3, 2).unwrap();
        assert_eq!(t.shape(), [3, 2, 2]);
        assert_eq!(t.get(1, 1), Some(&[6, 7][..]));
        assert_eq!(t.get(3, 0), None);
        assert_eq!(t.to_base64(), text);
    }

    #[test]
    fn zero_tokens_is_empty_and_bad_lengths_fail() {
        let t = RoutedExperts::from_base64("", 0, 4).unwrap();
        assert_eq!(t.shape(), [0, 4, 0]);
        // 5 int32 values cannot split into 2 tokens × 2 layers.
        let five = base64::encode(&[0u8; 20]);
        assert!(matches!(
            RoutedExperts::from_base64(&five, 2, 2),
            Err(Error::RoutedExperts(_))
        ));
        assert!(matches!(
            RoutedExperts::from_base64("AAAA!", 1, 1),
            Err(Error::Base64 { .. })
        ));
        assert!(RoutedExperts::new(1, 1, 2, vec![0]).is_err());
        assert!(RoutedExperts::new(1, 1, 1, vec![-2]).is_err());
    }

    #[test]
    fn truncation_extension_and_merge() {
        let mut t = table(3);
        t.strip_last(1).unwrap();
        assert_eq!(t.rows(), 2);
        assert!(t.strip_last(3).is_err());
        let more = table(2);
        assert!(t.extend_from(1, &more).is_err());
        t.extend_from(2, &more).unwrap();
        assert_eq!(t.rows(), 4);
        assert_eq!(t.get(2, 0), more.get(0, 0));
        let mut short = table(4);
        assert!(short.merge_turn(table(3)).is_err());
        short.merge_turn(table(6)).unwrap();
        assert_eq!(short.rows(), 6);
        assert!(table(2).check_expert_range(8).is_ok());
        assert!(table(2).check_expert_range(7).is_err());
    }

    #[test]
    fn json_form_round_trips_and_validates() {
        let t = table(2);
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["shape"], serde_json::json!([2, 2, 2]));
        let back: RoutedExperts = serde_json::from_value(json).unwrap();
        assert_eq!(back, t);
        let bad = serde_json::json!({"shape": [2, 2, 3], "data": t.to_base64()});
        assert!(serde_json::from_value::<RoutedExperts>(bad).is_err());
    }
}
