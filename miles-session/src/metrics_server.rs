//! A `/metrics` endpoint for any process holding a [`miles_core::prometheus::Registry`]: a
//! trainer (with [`miles_core::prometheus::PrometheusMetricsSink`] and
//! [`miles_core::prometheus::TrainerMetrics`]), `miles serve` (with
//! [`miles_core::prometheus::SglangMetrics`]), or anything else.
//!
//! * [`router`]: the axum route alone, to merge into a server that already exists.
//! * [`serve`]: serves it on a listener, inside a tokio runtime.
//! * [`MetricsServer::start`]: binds an address and serves from its own thread (its own
//!   single-threaded runtime), for blocking code such as a training loop; it stops when
//!   dropped.
//!
//! ```
//! use std::sync::Arc;
//! use miles_core::prometheus::{PrometheusMetricsSink, Registry};
//! use miles_core::{Metrics, MetricsSink};
//! use miles_session::metrics_server::MetricsServer;
//!
//! let registry = Arc::new(Registry::new());
//! let sink = PrometheusMetricsSink::new(registry.clone());
//! let server = MetricsServer::start("127.0.0.1:0".parse()?, registry)?;
//! sink.log(1, &Metrics::from([("train/pg_loss".to_string(), 0.5)]))?;
//! println!("scrape http://{}/metrics", server.local_addr());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use miles_core::prometheus::{CONTENT_TYPE, Registry};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// `GET /metrics` rendering `registry` in the Prometheus text format 0.0.4.
pub fn router(registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(render))
        .with_state(registry)
}

async fn render(State(registry): State<Arc<Registry>>) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], registry.render()).into_response()
}

/// Serves [`router`] on `listener` until the future is dropped or the listener fails.
pub async fn serve(listener: TcpListener, registry: Arc<Registry>) -> std::io::Result<()> {
    axum::serve(listener, router(registry)).await
}

/// A `/metrics` server on its own thread. Dropping it stops the server and joins the
/// thread.
pub struct MetricsServer {
    local_addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks a free port) and serves `registry` from a new thread.
    /// Binding errors are returned here, not later. Callable from blocking code and from
    /// inside a tokio runtime alike.
    pub fn start(addr: SocketAddr, registry: Arc<Registry>) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (shutdown, stop) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("miles-metrics".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener)?;
                    axum::serve(listener, router(registry))
                        .with_graceful_shutdown(async move {
                            let _ = stop.await;
                        })
                        .await
                })
            })?;
        Ok(Self {
            local_addr,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// The address it listens on (with the port actually bound).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops the server and waits for its thread; returns how serving ended.
    pub fn stop(mut self) -> std::io::Result<()> {
        self.shutdown_and_join()
    }

    fn shutdown_and_join(&mut self) -> std::io::Result<()> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(std::io::Error::other("metrics server thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        let _ = self.shutdown_and_join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::HttpClient;
    use std::time::Duration;

    #[test]
    fn serves_the_registry_and_stops() {
        let registry = Arc::new(Registry::new());
        let gauge = registry.gauge("miles_test_gauge", "A test gauge.").unwrap();
        gauge.set(2.5);
        let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), registry).unwrap();
        let url = format!("http://{}/metrics", server.local_addr());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let http = HttpClient::new(Duration::from_secs(5));
        let response = runtime.block_on(http.get(&url)).unwrap();
        assert_eq!(response.status, 200);
        assert_eq!(response.headers[header::CONTENT_TYPE], CONTENT_TYPE);
        assert_eq!(
            response.text(),
            "# HELP miles_test_gauge A test gauge.\n# TYPE miles_test_gauge gauge\nmiles_test_gauge 2.5\n"
        );
        gauge.set(3.0);
        let response = runtime.block_on(http.get(&url)).unwrap();
        assert!(response.text().ends_with("miles_test_gauge 3\n"));
        let addr = server.local_addr();
        server.stop().unwrap();
        assert!(std::net::TcpStream::connect(addr).is_err(), "stopped");
    }

    #[test]
    fn starts_and_stops_inside_a_runtime() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let registry = Arc::new(Registry::new());
            registry.counter("miles_test_total", "Test.").unwrap().inc();
            let server = MetricsServer::start("127.0.0.1:0".parse().unwrap(), registry).unwrap();
            let http = HttpClient::new(Duration::from_secs(5));
            let url = format!("http://{}/metrics", server.local_addr());
            let text = http.get(&url).await.unwrap().text();
            assert!(text.ends_with("miles_test_total 1\n"), "{text}");
            // A taken port is an error at start, not later.
            let taken = MetricsServer::start(server.local_addr(), Arc::new(Registry::new()));
            assert!(taken.is_err());
            drop(server);
        });
    }
}
