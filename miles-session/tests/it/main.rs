//! The integration tests of miles-session, one module per former test file, built as one test
//! binary (one link instead of one per file). Tests that measure the whole process (resident
//! memory) or need the binary's allocator stay binaries of their own: hardening, load_memory, soak.

mod agent;
mod codec_interop;
mod command_agent;
mod common;
mod fuzz_routes;
mod message_matcher;
mod miles_contracts;
mod prometheus_scrape;
mod response_text;
mod server;
mod sglang;
mod sglang_fuzz_routes;
mod sglang_serve_contract;
mod tito_qwen3;
#[cfg(feature = "tls")]
mod tls;
mod trailing_trim;
mod trajectory_props;
mod tree_flows;
mod tree_sessions;
mod tree_state;
