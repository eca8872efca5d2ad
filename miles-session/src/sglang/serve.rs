//! Serving a router of SGLang routes on a TCP address: bound, announced on stdout, hardened
//! with a [`GuardConfig`] and served with its connection limit and request-head timeout.

use std::net::SocketAddr;

use crate::error::{Error, Result};
use crate::guard::{self, GuardConfig};

/// Binds `host:port`, prints `listening on http://ADDR` to stdout (the line a supervisor or a
/// test waits for; with port 0 the system picks a free port) and serves `app` behind `guard`
/// ([`guard::harden`]) until the process ends. Warns when it binds a non-loopback address
/// without an API key.
pub async fn serve(app: axum::Router, host: &str, port: u16, guard: GuardConfig) -> Result<()> {
    let listener = guard::bind(host, port)
        .await
        .map_err(|e| Error::Config(format!("cannot bind {host}:{port}: {e}")))?;
    let addr: SocketAddr = listener.local_addr()?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        // A closed stdout is not fatal.
        let _ = writeln!(out, "listening on http://{addr}");
        let _ = out.flush();
    }
    if guard.api_key.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "warning: serving {addr} without --api-key: anyone who can reach it can generate \
             and (with --weights-root) load weights"
        );
    }
    let app = guard::harden(app, &guard);
    guard::serve(listener, app, guard).await
}
