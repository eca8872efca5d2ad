//! mimalloc's upkeep for the session server (`miles session`): a turn allocates and frees
//! many small JSON / token buffers; glibc's allocator spent a third of the server's CPU on
//! them and kept the memory of deleted sessions. `miles` runs on mimalloc (the `mimalloc`
//! feature, on by default: `main.rs` sets the global allocator and tunes it before `main`);
//! these functions hand freed memory back to the OS while the server idles.

use std::cell::Cell;
use std::time::{Duration, Instant};

unsafe extern "C" {
    /// mimalloc's `mi_collect`: frees the calling thread's unused pages and returns
    /// (purges) free memory to the OS; `force` purges at once instead of after a delay.
    fn mi_collect(force: bool);
}

/// Returns the calling thread's free memory to the OS.
pub fn collect_now() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time;
    // it only walks the calling thread's own heap and the shared arenas under their locks.
    unsafe { mi_collect(true) }
}

/// Collects at most every 100 ms per worker thread, when the worker runs out of work: an idle
/// server gives the memory of deleted sessions back instead of keeping it for the next burst.
pub fn collect_when_idle() {
    const EVERY: Duration = Duration::from_millis(100);
    thread_local! {
        static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    }
    LAST.with(|last| {
        let now = Instant::now();
        if last.get().is_none_or(|t| now.duration_since(t) >= EVERY) {
            last.set(Some(now));
            collect_now();
        }
    });
}

/// Twice a second, from outside the runtime, queues no-op tasks that wake idle workers, so
/// each parks again and runs [`collect_when_idle`]: after a burst the last worker to finish
/// would otherwise sleep on memory it freed less than 100 ms before parking.
pub fn nudge_workers(handle: tokio::runtime::Handle, workers: usize) {
    loop {
        std::thread::sleep(Duration::from_millis(500));
        for _ in 0..workers * 2 {
            handle.spawn(tokio::task::yield_now());
        }
    }
}
