//! The integration tests of miles-cli: `miles` run as a subprocess, as a user runs it (one
//! module per subcommand family), built as one test binary: one compile and one link of the
//! dependencies instead of one per file.

mod agent_failures;
mod bridge;
mod cli;
mod faults;
mod memory_plan;
mod process;
mod serve_failover;
mod session;
mod session_memory;
mod tito;
