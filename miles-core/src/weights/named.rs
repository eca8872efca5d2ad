//! [`NamedTensors`]: HF-named host tensors plus string metadata, the unit of weight export,
//! checkpoints and engine weight updates.

use std::collections::BTreeMap;
use std::ops::Index;

use super::tensor::TensorBytes;

/// HF-named tensors (`model.layers.0.self_attn.q_proj.weight` → tensor), in name order, plus
/// optional string metadata: the unit of weight export, checkpoints and engine weight updates.
/// Converts to and from the safetensors format byte for byte
/// ([`NamedTensors::to_safetensors_bytes`], [`NamedTensors::from_safetensors_file`],
/// [`NamedTensors::read_hf_checkpoint`], [`NamedTensors::write_hf_shards`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NamedTensors {
    pub(super) tensors: BTreeMap<String, TensorBytes>,
    pub(super) metadata: BTreeMap<String, String>,
}

impl NamedTensors {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: TensorBytes) -> Option<TensorBytes> {
        self.tensors.insert(name.into(), tensor)
    }

    /// A tensor by name.
    pub fn get(&self, name: &str) -> Option<&TensorBytes> {
        self.tensors.get(name)
    }

    /// A tensor by name, to replace in place.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut TensorBytes> {
        self.tensors.get_mut(name)
    }

    /// Whether a tensor of that name is in the set.
    pub fn contains_key(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes a tensor by name.
    pub fn remove(&mut self, name: &str) -> Option<TensorBytes> {
        self.tensors.remove(name)
    }

    /// Keeps only the tensors for which `keep(name, tensor)` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&str, &TensorBytes) -> bool) {
        self.tensors.retain(|name, tensor| keep(name, tensor));
    }

    /// Moves every tensor of `other` into this set (replacing those of the same name); the
    /// metadata is not moved.
    pub fn append(&mut self, other: &mut Self) {
        self.tensors.append(&mut other.tensors);
    }

    /// Iterates `(name, tensor)` in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TensorBytes)> {
        self.tensors.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Iterates `(name, tensor)` in name order, tensors mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&str, &mut TensorBytes)> {
        self.tensors.iter_mut().map(|(k, v)| (k.as_str(), v))
    }

    /// The names, in order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensors, in name order.
    pub fn values(&self) -> impl Iterator<Item = &TensorBytes> {
        self.tensors.values()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// True when there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|t| t.data().len()).sum()
    }

    /// String metadata (safetensors `__metadata__`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Sets one metadata entry.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.metadata.insert(key.into(), value.into());
    }

    /// The same tensors with no metadata (what a model's export holds, to compare with a
    /// file's tensors).
    pub fn without_metadata(mut self) -> Self {
        self.metadata.clear();
        self
    }
}

impl FromIterator<(String, TensorBytes)> for NamedTensors {
    fn from_iter<I: IntoIterator<Item = (String, TensorBytes)>>(iter: I) -> Self {
        Self {
            tensors: iter.into_iter().collect(),
            metadata: BTreeMap::new(),
        }
    }
}

impl Extend<(String, TensorBytes)> for NamedTensors {
    fn extend<I: IntoIterator<Item = (String, TensorBytes)>>(&mut self, iter: I) {
        self.tensors.extend(iter);
    }
}

impl IntoIterator for NamedTensors {
    type Item = (String, TensorBytes);
    type IntoIter = std::collections::btree_map::IntoIter<String, TensorBytes>;

    /// The tensors by value, in name order (the metadata is dropped).
    fn into_iter(self) -> Self::IntoIter {
        self.tensors.into_iter()
    }
}

/// One entry of the map as `(name, tensor)`.
type Entry<'a> = (&'a str, &'a TensorBytes);

impl<'a> IntoIterator for &'a NamedTensors {
    type Item = Entry<'a>;
    type IntoIter = std::iter::Map<
        std::collections::btree_map::Iter<'a, String, TensorBytes>,
        fn((&'a String, &'a TensorBytes)) -> Entry<'a>,
    >;

    /// `(name, tensor)` in name order, as [`NamedTensors::iter`].
    fn into_iter(self) -> Self::IntoIter {
        let entry: fn((&'a String, &'a TensorBytes)) -> Entry<'a> = |(k, v)| (k.as_str(), v);
        self.tensors.iter().map(entry)
    }
}

impl<Name: AsRef<str> + ?Sized> Index<&Name> for NamedTensors {
    type Output = TensorBytes;

    /// The tensor `name`; panics when there is none (use [`NamedTensors::get`] for names that
    /// come from input).
    fn index(&self, name: &Name) -> &TensorBytes {
        &self.tensors[name.as_ref()]
    }
}
