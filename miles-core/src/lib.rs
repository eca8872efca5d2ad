//! miles-core (in progress)
pub mod error;
pub mod message;
pub use error::{EngineErrorKind, Error, Result};
pub use message::{Content, FunctionCall, FunctionSpec, Message, Role, ToolArguments, ToolCall, ToolSpec};
