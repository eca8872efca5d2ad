//! miles-session (in progress).
pub mod agent;
pub mod assembly;
pub mod chat;
pub mod cli;
pub mod codec;
pub mod error;
pub mod http;
pub mod metrics;
pub mod parsers;
pub mod server;
pub mod sglang;
pub mod testkit;
pub mod trajectory;

pub use error::{Error, Result};
