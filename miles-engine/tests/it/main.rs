//! The integration tests of miles-engine, built as one test binary (one compile of burn's
//! generic code and one link): the engine against the model's own forward pass and HF, its
//! paths (specialised, precision, devices), hybrid (linear-attention) models' state slots,
//! GPT-OSS' sinks and sliding window in the paged decode, and
//! the engine served over SGLang's HTTP protocol (in-process, including hostile input; the
//! `miles serve` process and its failover under a router are tested in miles-cli).

mod engine;
mod engine_paths;
mod gpt_oss;
mod hybrid;
mod serve_embedded;
mod serve_hardening;
