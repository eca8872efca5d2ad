//! [`CausalLm`](causal_lm::CausalLm): building, loading, casting and exporting the model
//! (`causal_lm`), its forward passes (`forward`), activation recomputation (`recompute`) and
//! LoRA on it (`adapters`).

mod adapters;
pub(crate) mod causal_lm;
pub(crate) mod forward;
pub(crate) mod recompute;
