//! The integration tests of miles-tito, one module per former test file, built as one test
//! binary (one link instead of one per file). Tests that measure the whole process (resident
//! memory) or need the binary's allocator stay binaries of their own: none.

mod common;
mod comparator;
mod deepseek_reference;
mod family_detection;
mod fast_decode;
mod fast_encode;
mod gpt_oss;
mod hf_exact;
mod hostile_templates;
mod loss_mask_cli;
mod matcher_cases;
mod parsers_roundtrip;
mod tito_reference;
mod verify_tito;
