//! The integration tests of miles-reward, one module per file, built as one test binary (one
//! link instead of one per file).

mod remote;
mod rm_hub;
