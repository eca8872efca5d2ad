//! The integration tests of miles-rollout, one module per former test file, built as one test
//! binary: one compile of burn's generic code and one link instead of one per file. The modules
//! that need the embedded burn engine (or the `miles-rollout` binary it builds) are compiled only
//! with the `embedded` feature (on by default).

mod common;

mod data_formats;
#[cfg(feature = "embedded")]
mod engine;
#[cfg(feature = "embedded")]
mod engine_paths;
mod fuzz_routes;
mod loops;
mod router;
mod router_http;
mod serve_contract;
#[cfg(feature = "embedded")]
mod serve_embedded;
#[cfg(feature = "embedded")]
mod serve_failover;
#[cfg(feature = "embedded")]
mod serve_hardening;
