//! Model configuration: the architecture table ([`ARCHITECTURES`], one row per supported HF
//! `model_type`) and [`ModelConfig`], read from HF `config.json` through it.

mod architecture;
mod hf;
mod linear;
mod mla;
mod model_config;
mod rope;

pub use architecture::{
    ARCHITECTURES, Architecture, ArchitectureSpec, AttentionKind, ExpertCountField, ExpertKind,
    FieldRule, MoeLayers, MoeSpec, MultimodalLayout, PinnedField, PinnedValue, RopeScalingKind,
    RouterKind, SharedExpertKind,
};
pub use linear::LinearAttentionConfig;
pub use mla::MlaConfig;
pub use model_config::{LayerType, MlpLayerType, ModelConfig};
pub use rope::{Llama3RopeScaling, YarnRopeScaling};
