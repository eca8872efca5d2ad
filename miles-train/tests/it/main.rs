//! The integration tests of miles-train, one module per former test file, built as one test
//! binary: one compile of the dependencies' generic code and one link instead of one per file.

mod actor;
mod lora;
mod optim;
mod recompute;
mod shared_prefix;
