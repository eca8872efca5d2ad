//! Child-process helpers the subprocess tests share: waiting and signals, scratch folders,
//! the tiny chat checkpoint and its prompts, `miles serve` processes.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
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

/// A fresh, empty scratch folder `miles-it-{name}-{pid}` under the temp dir.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("miles-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A path of the repository.
pub fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

/// The tiny Qwen3 chat checkpoint (`fixtures/serve/qwen3-tiny-chat`).
pub fn tiny_chat_checkpoint() -> PathBuf {
    repo("fixtures/serve/qwen3-tiny-chat")
}

/// `python3`, or `$PYTHON`.
pub fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Eight prompts `What is i + 1?` with their labels, as JSONL in `dir`.
pub fn sum_prompts(dir: &Path) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let lines: Vec<String> = (0..8)
        .map(|i| {
            serde_json::json!({"input": format!("What is {i} + 1?"), "label": (i + 1).to_string()})
                .to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// A `miles serve` process and its base URL; killed on drop.
pub struct Server {
    /// The process.
    pub child: Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `miles serve --model MODEL --port PORT EXTRA…` (port 0: any; its stderr to
/// `stderr`) and waits for its `listening on` line; `Err(first line)` when it did not come up.
pub fn start_serve(
    model: &Path,
    port: u16,
    extra: &[&std::ffi::OsStr],
    stderr: Stdio,
) -> Result<Server, String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_miles"))
        .args(["serve", "--model"])
        .arg(model)
        .args(["--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start miles serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("read the listening line");
    match line.trim().strip_prefix("listening on ") {
        Some(url) => Ok(Server {
            url: url.to_owned(),
            child,
        }),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(line)
        }
    }
}
