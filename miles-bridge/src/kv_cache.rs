//! Contiguous KV caches: [`LayerCache`] (one attention layer's keys and values, written in
//! place with geometric growth) and [`KvCache`] (every layer's, with key validity and
//! positions per row) for prefill + decode over rows of different lengths.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::error::BridgeError;
use crate::nn::gated_delta::LinearState;

/// Keys and values of one attention layer kept across decoding steps.
///
/// The tensors may hold more key columns than are in use (their capacity, see
/// [`LayerCache::capacity`]): a step writes its keys in place after the used ones and the
/// capacity grows geometrically, so decoding does not copy the whole cache every step. The
/// used length is the owning [`KvCache`]'s [`KvCache::len`]; [`KvCache::layer`] returns
/// the used part.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// `[batch, kv_heads, capacity, head_dim]`; for a multi-head latent attention layer
    /// (DeepSeek-V3's `LatentAttention`) the compressed latent after `kv_a_layernorm` and the
    /// rotated rope key, `[batch, 1, capacity, kv_lora_rank + qk_rope_head_dim]`.
    pub keys: Tensor<4>,
    /// `[batch, kv_heads, capacity, head_dim]`; `None` for a multi-head latent attention
    /// layer (its values are expanded from the latent in `keys`).
    pub values: Option<Tensor<4>>,
}

/// Key columns a layer cache's capacity is a multiple of.
pub(crate) const KV_BLOCK: usize = 64;

impl LayerCache {
    /// Key columns the tensors hold (used or not).
    pub fn capacity(&self) -> usize {
        self.keys.dims()[2]
    }

    /// The first `len` key columns (views; `len` at most the capacity).
    pub(crate) fn narrowed(&self, len: usize) -> LayerCache {
        if len == self.capacity() {
            return self.clone();
        }
        LayerCache {
            keys: self.keys.clone().narrow(2, 0, len),
            values: self.values.clone().map(|v| v.narrow(2, 0, len)),
        }
    }

    /// Writes `keys` / `values` (`[batch, heads, seq, dim]`) at key columns `past..past + seq`
    /// of the cache in `slot` (creating it when empty), in place when the capacity allows and
    /// the tensors are not shared (a shared one is copied first, so a cache cloned into a
    /// prefix cache never changes), growing the capacity to at least twice the old one
    /// otherwise. Returns the used part, `past + seq` columns, for the attention.
    pub(crate) fn append(
        slot: &mut Option<LayerCache>,
        past: usize,
        keys: Tensor<4>,
        values: Option<Tensor<4>>,
    ) -> LayerCache {
        let [batch, _, seq, _] = keys.dims();
        let need = past + seq;
        let write = |cache: Tensor<4>, new: Tensor<4>| -> Tensor<4> {
            let [_, h, _, d] = new.dims();
            cache.slice_assign([0..batch, 0..h, past..need, 0..d], new)
        };
        let cache = match slot.take() {
            // Nothing cached yet: the step's tensors are the cache (exact size).
            None if past == 0 => LayerCache { keys, values },
            Some(old) if old.capacity() >= need && old.keys.dims()[0] == batch => LayerCache {
                keys: write(old.keys, keys),
                values: match (old.values, values) {
                    (Some(old), Some(new)) => Some(write(old, new)),
                    _ => None,
                },
            },
            old => {
                let old_cap = old.as_ref().map_or(0, LayerCache::capacity);
                let cap = need.max(2 * old_cap).div_ceil(KV_BLOCK) * KV_BLOCK;
                let device = keys.device();
                let grown = |old: Option<Tensor<4>>, new: Tensor<4>| -> Tensor<4> {
                    let [_, h, _, d] = new.dims();
                    let mut t = Tensor::<4>::zeros([batch, h, cap, d], (&device, new.dtype()));
                    if let Some(old) = old
                        && past > 0
                    {
                        t = t.slice_assign([0..batch, 0..h, 0..past, 0..d], old.narrow(2, 0, past));
                    }
                    write(t, new)
                };
                let (old_keys, old_values) = match old {
                    Some(o) => (Some(o.keys), o.values),
                    None => (None, None),
                };
                LayerCache {
                    values: values.map(|v| grown(old_values, v)),
                    keys: grown(old_keys, keys),
                }
            }
        };
        let used = cache.narrowed(need);
        *slot = Some(cache);
        used
    }
}

/// Per-layer keys / values and key validity for incremental decoding.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per decoder layer, `None` until filled.
    pub(crate) layers: Vec<Option<LayerCache>>,
    /// `[rows, len]`: which cached key columns are real (false: padding).
    pub(crate) key_valid: Option<Tensor<2, Bool>>,
    /// `[rows, 1]`: the position each row's next token takes.
    pub(crate) next_position: Option<Tensor<2, Int>>,
    /// Per decoder layer, the conv and recurrent state of a Gated DeltaNet layer (Qwen3.5);
    /// `None` for attention layers and until filled.
    pub(crate) linear: Vec<Option<LinearState>>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of cached key positions (padding included).
    pub fn len(&self) -> usize {
        self.key_valid.as_ref().map_or(0, |v| v.dims()[1])
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache of decoder layer `layer`, if it has been filled, narrowed to the
    /// [`KvCache::len`] key columns in use (see [`LayerCache`]: keys and values per key /
    /// value head, or for DeepSeek-V3's latent attention the compressed latent plus rope key
    /// and no values).
    pub fn layer(&self, layer: usize) -> Option<LayerCache> {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .map(|l| l.narrowed(self.len()))
    }

    /// The conv and recurrent state of linear-attention layer `layer` (Qwen3.5's Gated
    /// DeltaNet), if it has been filled.
    pub fn linear_state(&self, layer: usize) -> Option<&LinearState> {
        self.linear.get(layer).and_then(Option::as_ref)
    }

    /// Number of rows (sequences) the cache holds; 0 when empty.
    pub fn rows(&self) -> usize {
        self.key_valid.as_ref().map_or(0, |v| v.dims()[0])
    }

    /// Number of real (attended) keys in each row.
    pub fn valid_lens(&self) -> Vec<usize> {
        match &self.key_valid {
            None => Vec::new(),
            Some(valid) => {
                let [rows, len] = valid.dims();
                let flags = bool_rows(valid.clone());
                (0..rows)
                    .map(|r| flags[r * len..(r + 1) * len].iter().filter(|&&b| b).count())
                    .collect()
            }
        }
    }

    /// A one-row cache of `len` real positions filled from position 0 (`layers`: `None` for
    /// a linear-attention layer, whose state is in `linear`; empty without such layers).
    pub(crate) fn from_filled_row(
        layers: Vec<Option<LayerCache>>,
        linear: Vec<Option<LinearState>>,
        len: usize,
        device: &Device,
    ) -> Self {
        KvCache {
            layers,
            key_valid: Some(Tensor::<2, Int>::ones([1, len], device).equal_elem(1)),
            next_position: Some(Tensor::from_data(
                TensorData::new(vec![len as i32], [1, 1]),
                device,
            )),
            linear,
        }
    }

    /// The cache of the given rows, in that order (for dropping finished sequences from a
    /// running batch). Out-of-range rows are an error.
    pub fn select_rows(&self, rows: &[usize]) -> Result<KvCache, BridgeError> {
        let Some(valid) = &self.key_valid else {
            return Err(BridgeError::input("select_rows on an empty cache"));
        };
        let n = valid.dims()[0];
        if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
            return Err(BridgeError::input(format!(
                "row {bad} out of range for a cache of {n} rows"
            )));
        }
        if rows.is_empty() {
            return Ok(KvCache::new());
        }
        let device = valid.device();
        let index = Tensor::<1, Int>::from_data(
            TensorData::new(rows.iter().map(|&r| r as i32).collect(), [rows.len()]),
            &device,
        );
        Ok(KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    l.as_ref().map(|l| LayerCache {
                        keys: l.keys.clone().select(0, index.clone()),
                        values: l.values.clone().map(|v| v.select(0, index.clone())),
                    })
                })
                .collect(),
            key_valid: Some(same_bool(valid.clone().select(0, index.clone()))),
            next_position: self
                .next_position
                .as_ref()
                .map(|p| p.clone().select(0, index.clone())),
            linear: self
                .linear
                .iter()
                .map(|s| s.as_ref().map(|s| s.select(index.clone())))
                .collect(),
        })
    }

    /// Stacks caches row-wise into one batch cache. Shorter caches are padded on the key axis
    /// with keys that are never attended to, so every row keeps its own length and positions.
    /// Empty caches are skipped; all non-empty ones must come from the same model.
    pub fn concat_rows(parts: Vec<KvCache>) -> Result<KvCache, BridgeError> {
        let parts: Vec<KvCache> = parts.into_iter().filter(|p| !p.is_empty()).collect();
        if parts.len() <= 1 {
            return Ok(parts.into_iter().next().unwrap_or_default());
        }
        let layers = parts[0].layers.len();
        if parts.iter().any(|p| p.layers.len() != layers) {
            return Err(BridgeError::input("caches of different models"));
        }
        let total = parts.iter().map(KvCache::len).max().unwrap_or(0);
        let mut valid = Vec::with_capacity(parts.len());
        let mut next = Vec::with_capacity(parts.len());
        let mut per_layer: Vec<(Vec<Tensor<4>>, Vec<Option<Tensor<4>>>)> =
            (0..layers).map(|_| (Vec::new(), Vec::new())).collect();
        let mut linear: Vec<Vec<LinearState>> = (0..layers).map(|_| Vec::new()).collect();
        for part in parts {
            let used = part.len();
            let pad = total - used;
            let kv = part
                .key_valid
                .ok_or_else(|| BridgeError::input("cache without key validity"))?;
            let [rows, _] = kv.dims();
            let device = kv.device();
            next.push(
                part.next_position
                    .ok_or_else(|| BridgeError::input("cache without positions"))?,
            );
            valid.push(if pad == 0 {
                kv
            } else {
                Tensor::cat(
                    vec![
                        kv,
                        Tensor::<2, Int>::zeros([rows, pad], &device).equal_elem(1),
                    ],
                    1,
                )
            });
            for (l, state) in part.linear.into_iter().enumerate() {
                if let (Some(state), Some(states)) = (state, linear.get_mut(l)) {
                    states.push(state);
                }
            }
            for (l, slot) in part.layers.into_iter().enumerate() {
                // A linear-attention layer has no keys (its state is joined above).
                if slot.is_none() && !linear[l].is_empty() {
                    continue;
                }
                let slot = slot
                    .ok_or_else(|| BridgeError::input("cache with a missing layer"))?
                    .narrowed(used);
                let padded = |t: Tensor<4>| -> Tensor<4> {
                    if pad == 0 {
                        return t;
                    }
                    let [b, h, _, d] = t.dims();
                    let zeros = Tensor::<4>::zeros([b, h, pad, d], (&t.device(), t.dtype()));
                    Tensor::cat(vec![t, zeros], 2)
                };
                per_layer[l].0.push(padded(slot.keys));
                per_layer[l].1.push(slot.values.map(padded));
            }
        }
        let joined = valid.len();
        if linear
            .iter()
            .any(|states| !states.is_empty() && states.len() != joined)
        {
            return Err(BridgeError::input("caches of different models"));
        }
        Ok(KvCache {
            linear: linear
                .into_iter()
                .map(|states| (!states.is_empty()).then(|| LinearState::cat(states)))
                .collect(),
            layers: per_layer
                .into_iter()
                .map(|(k, v)| {
                    if k.is_empty() {
                        return None;
                    }
                    // Latent-attention layers store no values.
                    let values = v
                        .into_iter()
                        .collect::<Option<Vec<_>>>()
                        .map(|v| Tensor::cat(v, 0));
                    Some(LayerCache {
                        keys: Tensor::cat(k, 0),
                        values,
                    })
                })
                .collect(),
            key_valid: Some(
                Tensor::cat(valid.into_iter().map(|v| v.int()).collect(), 0).equal_elem(1),
            ),
            next_position: Some(Tensor::cat(next, 0)),
        })
    }

    /// Moves every row's real keys to the front and drops the key columns no row needs, so a
    /// long-running batch does not keep paying for padding left by departed sequences.
    pub fn compact(&self) -> KvCache {
        let Some(valid) = &self.key_valid else {
            return KvCache::new();
        };
        let [rows, len] = valid.dims();
        let flags = bool_rows(valid.clone());
        let kept: Vec<Vec<usize>> = (0..rows)
            .map(|r| (0..len).filter(|&c| flags[r * len + c]).collect())
            .collect();
        let new_len = kept.iter().map(Vec::len).max().unwrap_or(0).max(1);
        if new_len == len {
            return self.clone();
        }
        let device = valid.device();
        let mut index = Vec::with_capacity(rows * new_len);
        let mut new_valid = Vec::with_capacity(rows * new_len);
        for cols in &kept {
            for j in 0..new_len {
                index.push(cols.get(j).copied().unwrap_or(0) as i32);
                new_valid.push(j < cols.len());
            }
        }
        let index = Tensor::<2, Int>::from_data(TensorData::new(index, [rows, new_len]), &device);
        let gather = |t: &Tensor<4>| -> Tensor<4> {
            let [b, h, _, d] = t.dims();
            let idx = index
                .clone()
                .reshape([b, 1, new_len, 1])
                .expand([b, h, new_len, d]);
            t.clone().gather(2, idx)
        };
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    l.as_ref().map(|l| LayerCache {
                        keys: gather(&l.keys),
                        values: l.values.as_ref().map(gather),
                    })
                })
                .collect(),
            key_valid: Some(
                Tensor::<2, Int>::from_data(
                    TensorData::new(
                        new_valid.into_iter().map(i32::from).collect(),
                        [rows, new_len],
                    ),
                    &device,
                )
                .equal_elem(1),
            ),
            next_position: self.next_position.clone(),
            linear: self.linear.clone(),
        }
    }

    /// Keeps the first `len` key columns (for reusing a cached prefix of a prompt). Positions
    /// continue from the number of real keys kept, which is right for caches whose rows were
    /// filled from position 0 (every prefix cache). A recurrent state cannot be cut back:
    /// for a model with linear-attention layers (Qwen3.5) any shorter prefix is an empty
    /// cache (nothing reusable).
    pub fn truncate(&self, len: usize) -> KvCache {
        let Some(valid) = &self.key_valid else {
            return KvCache::new();
        };
        if len >= self.len() {
            return self.clone();
        }
        if len == 0 || self.linear.iter().any(Option::is_some) {
            return KvCache::new();
        }
        let valid = valid.clone().narrow(1, 0, len);
        let rows = valid.dims()[0];
        KvCache {
            layers: self
                .layers
                .iter()
                .map(|l| {
                    l.as_ref().map(|l| LayerCache {
                        keys: l.keys.clone().narrow(2, 0, len),
                        values: l.values.clone().map(|v| v.narrow(2, 0, len)),
                    })
                })
                .collect(),
            next_position: Some(valid.clone().int().sum_dim(1).reshape([rows, 1])),
            key_valid: Some(same_bool(valid)),
            linear: Vec::new(),
        }
    }
}

/// A bool tensor in the storage form comparisons produce: backends may store the results of
/// different ops (a comparison, a row `select`) differently, and `cat` needs them alike.
fn same_bool(t: Tensor<2, Bool>) -> Tensor<2, Bool> {
    t.int().equal_elem(1)
}

/// Host copy of a bool tensor, row-major.
fn bool_rows(t: Tensor<2, Bool>) -> Vec<bool> {
    t.int()
        .into_data()
        .convert::<i32>()
        .try_to_vec::<i32>()
        .map(|v| v.into_iter().map(|x| x != 0).collect())
        .unwrap_or_default()
}
