//! Prometheus metrics: one registry per process, created at start-up; each stage registers and
//! owns its series (`src/<stage>/metrics.rs`) and holds pre-resolved handles, so that the hot
//! path never hashes label values. Every series of a started component exists from start-up,
//! at zero with its label values known in advance, so that dashboards show 0 and `increase()`
//! sees the first event. The exposition format comes from the `prometheus` crate's `TextEncoder`; the
//! HTTP side is a deliberately tiny responder (GET anything → the metrics page), because the
//! endpoint has one job and pulling a web framework in for it would cost more than it gives.

pub mod process;

use std::net::SocketAddr;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The process's metrics registry, the series of the listeners, and the process's own stats.
/// Each stage registers and owns its series (`src/<stage>/metrics.rs`, built once from this by
/// the service); this module knows none of them.
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// `accept(2)` failures, per listener (`grpc`, `metrics`) and kind (`emfile`, …): every
    /// listener's accept loop (`crate::net`) counts into it.
    pub accept_errors: IntCounterVec,
    /// The process's own CPU, memory and descriptors (`process_*`, read at every scrape).
    process: ProcessMetrics,
}

impl Metrics {
    /// A fresh registry (names prefixed `kvbridge_`) with the listeners' series.
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("kvbridge".into()), None).expect("registry");
        let m = Metrics {
            accept_errors: IntCounterVec::new(
                Opts::new(
                    "accept_errors_total",
                    "Failed accept(2) calls by listener and kind (emfile, enfile, nomem, connection, other)",
                ),
                &["listener", "kind"],
            )
            .expect("valid metric"),
            registry,
            process: ProcessMetrics::new(),
        };
        m.register(m.accept_errors.clone());
        m
    }

    /// Registers `c` (a stage's series). Each series is registered once per process: by the
    /// stage that owns it, when the service builds that stage's metrics.
    pub fn register<C: prometheus::core::Collector + Clone + 'static>(&self, c: C) -> C {
        self.registry
            .register(Box::new(c.clone()))
            .expect("each series is registered once");
        c
    }

    /// A counter vector `name` (`kvbridge_` prefixed) with `labels`, registered.
    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.register(IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    /// A gauge vector `name` with `labels`, registered.
    pub fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.register(IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"))
    }

    /// A counter `name`, registered.
    pub fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.register(IntCounter::new(name, help).expect("valid metric"))
    }

    /// A gauge `name`, registered.
    pub fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.register(IntGauge::new(name, help).expect("valid metric"))
    }

    /// A histogram `name` with `buckets`, registered.
    pub fn histogram(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        self.register(
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("valid metric"),
        )
    }

    /// A histogram vector `name` with `labels` and `buckets`, registered.
    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: Vec<f64>,
    ) -> HistogramVec {
        self.register(
            HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
                .expect("valid metric"),
        )
    }

    /// The metrics page in the Prometheus text format.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        let mut families = self.registry.gather();
        families.extend(self.process.gather());
        TextEncoder::new()
            .encode(&families, &mut out)
            .expect("text encoding");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Renders the `/health` page (JSON) on the metrics listener: the service's health detail,
/// owned by whoever knows it (metrics knows no stage).
pub type HealthPage = std::sync::Arc<dyn Fn() -> String + Send + Sync>;

/// Serves the metrics page (and `/health`, when given) on `addr` until the task is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: std::sync::Arc<Metrics>,
    health: Option<HealthPage>,
) {
    let mut acceptor =
        crate::net::Acceptor::new(listener, "metrics", metrics.accept_errors.clone());
    loop {
        let mut sock = acceptor.accept().await;
        let m = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            // Read the request head (one read is enough for a GET from Prometheus or curl).
            let n =
                match tokio::time::timeout(std::time::Duration::from_secs(5), sock.read(&mut buf))
                    .await
                {
                    Ok(Ok(n)) => n,
                    _ => return,
                };
            let head = String::from_utf8_lossy(&buf[..n]);
            let path = head.split_whitespace().nth(1).unwrap_or("/");
            let (status, ctype, body) = if path.starts_with("/metrics") || path == "/" {
                ("200 OK", "text/plain; version=0.0.4", m.render())
            } else if let (Some(page), true) = (&health, path == "/health") {
                ("200 OK", "application/json", page().into_bytes())
            } else {
                ("404 Not Found", "text/plain", b"not found\n".to_vec())
            };
            let hdr = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = sock.write_all(hdr.as_bytes()).await;
            let _ = sock.write_all(&body).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Binds the metrics listener (errors are reported by the caller as one line).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

// ---- The process (CPU, memory, descriptors) ----

/// The standard `process_*` metrics (the names Prometheus client libraries export, without the
/// `kvbridge_` prefix, so stock dashboards and alerts apply), read from `/proc/self` at every
/// scrape. Their own registry: the main one prefixes every name.
struct ProcessMetrics {
    registry: Registry,
    cpu_seconds: prometheus::Counter,
    resident: IntGauge,
    virtual_bytes: IntGauge,
    open_fds: IntGauge,
}

impl ProcessMetrics {
    fn new() -> Self {
        let registry = Registry::new();
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric");
            registry
                .register(Box::new(g.clone()))
                .expect("unique metric");
            g
        };
        let cpu_seconds = prometheus::Counter::new(
            "process_cpu_seconds_total",
            "User and system CPU time spent, seconds",
        )
        .expect("metric");
        registry
            .register(Box::new(cpu_seconds.clone()))
            .expect("unique metric");
        ProcessMetrics {
            cpu_seconds,
            resident: int_gauge("process_resident_memory_bytes", "Resident memory size"),
            virtual_bytes: int_gauge("process_virtual_memory_bytes", "Virtual memory size"),
            open_fds: int_gauge("process_open_fds", "Open file descriptors"),
            registry,
        }
    }

    /// Reads `/proc/self` into the metrics and gathers them.
    fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        use process as proc_stats;
        let pid = std::process::id();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        if let Some(cpu) = proc_stats::cpu_seconds(pid) {
            let delta = cpu - self.cpu_seconds.get();
            if delta > 0.0 {
                self.cpu_seconds.inc_by(delta);
            }
        }
        if let Some(kib) = proc_stats::status_kib(pid, "VmRSS") {
            self.resident.set(clamp(kib.saturating_mul(1024)));
        }
        if let Some(kib) = proc_stats::status_kib(pid, "VmSize") {
            self.virtual_bytes.set(clamp(kib.saturating_mul(1024)));
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            self.open_fds.set(clamp(fds.count() as u64));
        }
        self.registry.gather()
    }
}
