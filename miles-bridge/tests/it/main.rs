//! The integration tests of miles-bridge, one module per former test file, built as one test
//! binary: one compile of the dependencies' generic code and one link instead of one per file.

mod common;

mod deepseek_v3;
mod glm4_moe_lite;
mod glm4moe_tiny;
mod gpt_oss;
mod half_precision;
mod lora;
mod other_architectures;
mod paged;
mod qwen3_5;
mod r3_replay;
