//! The integration tests of miles-rollout, one module per former test file, built as one test
//! binary (one link instead of one per file).

mod common;

mod data_formats;
mod eval_config;
mod loops;
mod opd;
mod passrate;
mod response_text;
mod router;
mod router_http;
