//! The `miles-session` binary (wired in a later commit).
fn main() {}
