//! Weights on the host: versions, the one dtype enum, one tensor type and one collection of
//! HF-named tensors, with the one safetensors codec (bytes, files, sharded Hugging Face
//! checkpoint directories) every crate reads and writes weights through.

mod checkpoint;
mod dtype;
mod in_process;
mod named;
mod safetensors;
mod tensor;
mod version;

pub use checkpoint::{INDEX_FILE, SINGLE_FILE};
pub use dtype::DType;
pub use in_process::InProcessWeights;
pub use named::NamedTensors;
pub use safetensors::MAX_HEADER_BYTES;
pub use tensor::TensorBytes;
pub use version::WeightVersion;
