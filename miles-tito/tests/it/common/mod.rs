//! Helpers shared by the tests: fixture model directories and a deterministic generator
//! (`fast_encode.rs`, `fast_decode.rs`), and the crate's byte-level ChatML test double
//! (`comparator.rs`).

use std::path::PathBuf;

use miles_tito::HfChat;

pub use miles_tito::testkit::ByteChatml;

/// A fixture model directory under `fixtures/tokenizers/`.
pub fn load(name: &str) -> HfChat {
    HfChat::load(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/tokenizers")
            .join(name),
    )
    .expect("fixture model directory")
}

/// xorshift64*: deterministic test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// One of `items`, uniformly.
    #[allow(dead_code)] // used by fast_encode.rs only
    pub fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}
