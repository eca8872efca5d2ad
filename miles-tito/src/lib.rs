//! miles-tito: HF-exact chat templates and token-in-token-out incremental tokenization.
//!
//! ```
//! use miles_tito::{ChatTemplate, RenderArgs};
//! use serde_json::{json, Map};
//!
//! let template = ChatTemplate::new(
//!     "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
//!      {% if add_generation_prompt %}<|assistant|>{% endif %}",
//! )?;
//! let messages = vec![json!({"role": "user", "content": "hi", "name": null})];
//! let text = template.render(RenderArgs {
//!     messages: &messages,
//!     tools: None,
//!     add_generation_prompt: true,
//!     kwargs: &Map::new(),
//! })?;
//! assert_eq!(text, "<|user|>hi\n<|assistant|>");
//! # Ok::<(), miles_tito::Error>(())
//! ```

pub mod comparator;
pub mod error;
pub mod matcher;
pub mod model;
pub mod pyfmt;
pub mod template;
pub mod tito;
pub mod trajectory;
pub mod verify;

pub use comparator::{Mismatch, MismatchMetric, MismatchType, TokenSeqComparator};
pub use error::{Error, Result};
pub use matcher::{MessageMatcher, assert_append_only};
pub use model::{HfChat, Rendered};
pub use template::{ChatTemplate, RenderArgs};
pub use tito::{BoundaryRule, TitoFamily, TitoTokenizer};
pub use trajectory::{
    TokenTrajectory, TurnRecord, TurnSample, TurnSpan, assert_pretokenized_prefix,
};
