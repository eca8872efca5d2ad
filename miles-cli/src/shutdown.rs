//! A clean stop on SIGINT / SIGTERM: [`Signals`] resolves with the exit status the signal asks
//! for (130 / 143, as a shell reports a process killed by it), and [`InFlight`] lets a server
//! stop accepting, then wait for the requests it holds up to a deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Exit status after SIGINT (128 + 2).
pub const EXIT_SIGINT: u8 = 130;
/// Exit status after SIGTERM (128 + 15).
pub const EXIT_SIGTERM: u8 = 143;

/// The SIGINT / SIGTERM handlers, installed when this is made (so a signal that arrives
/// before anything awaits it is not lost, and no longer kills the process).
#[derive(Debug)]
pub struct Signals {
    #[cfg(unix)]
    handlers: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    /// Installs the handlers (inside a tokio runtime). Where they cannot be installed, a
    /// warning says so and [`Signals::recv`] waits for Ctrl-C alone.
    pub fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) {
                (Ok(int), Ok(term)) => Self {
                    handlers: Some((int, term)),
                },
                (Err(error), _) | (_, Err(error)) => {
                    tracing::warn!(%error, "cannot install the SIGINT / SIGTERM handlers");
                    Self { handlers: None }
                }
            }
        }
        #[cfg(not(unix))]
        {
            Self {}
        }
    }

    /// Waits for the next SIGINT or SIGTERM and returns the exit status for it.
    pub async fn recv(&mut self) -> u8 {
        #[cfg(unix)]
        if let Some((int, term)) = &mut self.handlers {
            return tokio::select! {
                _ = int.recv() => EXIT_SIGINT,
                _ = term.recv() => EXIT_SIGTERM,
            };
        }
        match tokio::signal::ctrl_c().await {
            Ok(()) => EXIT_SIGINT,
            Err(_) => std::future::pending().await,
        }
    }
}

/// Counts the requests a server is answering (a middleware around its router).
#[derive(Debug, Clone, Default)]
pub struct InFlight {
    count: Arc<AtomicUsize>,
}

struct Held(Arc<AtomicUsize>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl InFlight {
    /// A counter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Requests being answered now.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// `router` with every request counted from its arrival until its response is handed
    /// back.
    pub fn track(&self, router: axum::Router) -> axum::Router {
        let count = self.count.clone();
        router.layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let count = count.clone();
                async move {
                    count.fetch_add(1, Ordering::SeqCst);
                    let _held = Held(count);
                    next.run(request).await
                }
            },
        ))
    }

    /// Waits until no request is in flight or `deadline` has passed; returns how many were
    /// still in flight then.
    pub async fn drain(&self, deadline: Duration) -> usize {
        let until = Instant::now() + deadline;
        loop {
            let left = self.count();
            if left == 0 || Instant::now() >= until {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Serves `app` (already hardened) on `listener` with `guard` until `signals` delivers SIGINT /
/// SIGTERM, then stops accepting and lets the requests in flight finish, up to `drain`
/// (`--shutdown-timeout-s`); the ones still running then are counted in a warning. What
/// `miles serve`, `miles session` and `miles router` do at the end.
pub async fn serve_until_signal(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    guard: miles_session::guard::GuardConfig,
    signals: &mut Signals,
    drain: Duration,
) -> Result<(), String> {
    let in_flight = InFlight::new();
    let app = in_flight.track(app);
    miles_session::guard::serve_with_shutdown(listener, app, guard, async {
        let code = signals.recv().await;
        tracing::info!(
            code,
            "stopping: no new connections; draining requests in flight"
        );
    })
    .await
    .map_err(|e| e.to_string())?;
    let left = in_flight.drain(drain).await;
    if left > 0 {
        tracing::warn!(left, "requests still in flight at the shutdown deadline");
    }
    Ok(())
}
