//! Child-process helpers the subprocess tests share.

use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// Waits for `child` to exit, at most `limit` (then kills it and fails).
pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let until = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` (SIGINT, SIGTERM, …) to `child`.
pub fn send_signal(child: &Child, signal: i32) {
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: kill(2) with a child's pid and a valid signal number.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}
