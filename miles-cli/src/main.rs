//! `miles`: RL post-training from one command, with Miles' flags; the engine server, the
//! session server, checkpoint and chat-template tools. See [`miles_cli`] and `miles --help`.

use std::process::ExitCode;

/// mimalloc: the session server's turns allocate and free many small JSON / token buffers;
/// glibc's allocator spent a third of its CPU on them and kept the memory of deleted sessions.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(feature = "mimalloc")]
unsafe extern "C" {
    /// mimalloc's `mi_option_set(option, value)`.
    fn mi_option_set(option: i32, value: std::ffi::c_long);
    /// The C library's `getenv`.
    fn getenv(name: *const std::ffi::c_char) -> *mut std::ffi::c_char;
}

/// `mi_option_arena_eager_commit` (mimalloc 3 `mi_option_e`).
#[cfg(feature = "mimalloc")]
const MI_OPTION_ARENA_EAGER_COMMIT: i32 = 4;
/// `mi_option_purge_delay` (mimalloc 3 `mi_option_e`).
#[cfg(feature = "mimalloc")]
const MI_OPTION_PURGE_DELAY: i32 = 15;

/// Commit arena memory on demand and purge freed pages after 500 ms: with the defaults (eager
/// commit, 1 s purge delay) the pages of deleted sessions stayed resident (+40 % after
/// 10,000 sessions although the live heap was flat). Runs as an ELF constructor ahead of
/// mimalloc's own (prioritised `.init_array` entries run first), because the Rust runtime
/// allocates (and so reserves mimalloc's first arena) before `main`.
///
/// Either setting given in the environment (mimalloc's own `MIMALLOC_ARENA_EAGER_COMMIT`,
/// `MIMALLOC_PURGE_DELAY`) is left to mimalloc: e.g. `MIMALLOC_PURGE_DELAY=-1` keeps freed
/// pages for reuse, which trades peak RSS for fewer page faults in a training run (README's
/// performance section gives the 0.6B figures).
#[cfg(feature = "mimalloc")]
extern "C" fn tune_allocator() {
    // `getenv` does not allocate (an allocation here would reserve mimalloc's first arena
    // before the options are set).
    let unset = |name: &std::ffi::CStr| {
        // SAFETY: `name` is NUL-terminated; constructors run before any thread can change the
        // environment.
        unsafe { getenv(name.as_ptr()).is_null() }
    };
    // SAFETY: `mi_option_set` only stores an integer option; both options may be changed at
    // run time (they are read when arenas are reserved and when pages are purged).
    unsafe {
        if unset(c"MIMALLOC_ARENA_EAGER_COMMIT") {
            mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        }
        if unset(c"MIMALLOC_PURGE_DELAY") {
            mi_option_set(MI_OPTION_PURGE_DELAY, 500);
        }
    }
}

#[cfg(all(feature = "mimalloc", target_os = "linux"))]
#[used]
#[unsafe(link_section = ".init_array.00050")]
static TUNE_ALLOCATOR: extern "C" fn() = tune_allocator;

fn main() -> ExitCode {
    #[cfg(all(feature = "mimalloc", not(target_os = "linux")))]
    tune_allocator();
    miles_cli::app::run(std::env::args().collect())
}
