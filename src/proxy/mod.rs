//! Sidecar mode (`--engine-grpc`): kvbridge listens on the worker URL a stock SMG gateway
//! registers, answers `SubscribeKvEvents` itself and forwards every other call to the engine's
//! gRPC server (docs/smg-api.md §2 "Proxy mode").
//!
//! ```text
//!   gateway ──HTTP/2──► kvbridge :50061 ──┬─ SubscribeKvEvents (4 paths), grpc.health.v1 ─► ring
//!                                         └─ everything else, opaquely ──► engine :50051
//! ```
//!
//! One job per file: this one decides which requests are kvbridge's and serves the listener;
//! `upstream.rs` keeps the connections to the engine; `forward.rs` relays one call; `budget.rs`
//! bounds what kvbridge holds for forwarded streams; `crate::net::h2io` holds the HTTP/2 plumbing
//! both sides share (bodies, flow control, keepalive); `load.rs` polls the engine's `GetLoads` and
//! turns it into `load_only` records (§3.5).
//!
//! **Why our own HTTP/2 server loop here.** tonic's server wraps every service in its
//! `grpc-timeout` handling, which answers `CANCELLED` on its own when a deadline passes before
//! response headers. A forwarded call's deadline belongs to the engine (it answers
//! `DEADLINE_EXCEEDED` itself, with its own message), so in sidecar mode connections are served
//! on the `h2` crate directly (see `crate::net::h2io` for why not hyper), with the same HTTP/2
//! settings, by the gRPC edge's own connection loop (`crate::fanout::serve_connection`:
//! `SubscribeKvEvents` streams in the connection's task); kvbridge's other services are tonic's
//! [`Routes`] called from there.
//!
//! **Why one thread.** Everything the sidecar does runs on a `current_thread` runtime of its own
//! (the listener, client connections, engine connections, the probe and the load poller): a
//! forwarded DATA frame passes three tasks in kvbridge (the engine connection's, which reads it;
//! the client stream's, which polls the response body; the client connection's, which writes
//! it), and on one thread each hand-off is a local queue push, never a cross-worker wake-up
//! (futex, another thread's wake-up latency) or a steal. Measured with `cargo bench --bench
//! proxy` against the shared two-worker runtime, same build, same run: the latency kvbridge adds
//! per streamed message, p50, fell by about a third, and CPU per forwarded message by 30 %
//! (README, "Sidecar performance"). The cost: in sidecar mode kvbridge's own gRPC streams
//! (`SubscribeKvEvents`) are served from that one thread too; ingest, the ring and the NATS sink
//! keep theirs.

mod budget;
mod config;
mod forward;
mod load;
mod metrics;
mod upstream;

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tonic::service::Routes;
use tonic::Code;

use crate::net::h2io;
pub use config::{
    parse_engine_grpc, EngineGrpc, ProxyConfig, DEFAULT_LOAD_INTERVAL_MS, DEFAULT_SIDECAR_BUFFER,
    DEFAULT_SIDECAR_CONNECTION_BUFFER, DEFAULT_SIDECAR_STALL_TIMEOUT_MS, MAX_LOAD_INTERVAL_MS,
    MIN_SIDECAR_CONNECTION_BUFFER, PROXY_MAX_STREAMS_PER_CONNECTION,
};
pub use metrics::ProxyMetrics;

/// How often the engine is probed for health (`grpc.health.v1` in sidecar mode).
const PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// How long a probe waits for the engine's answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Decoded header bytes (names and values) a client connection may send kvbridge, and so have
/// it re-send to the engine, per byte that actually arrived on it, beyond
/// [`HEADER_BYTES_SLACK`]. HPACK lets a client reference one large dynamic-table entry from
/// each new stream for a byte or two (an "HPACK bomb": 387 bytes decoding to 1 MB); a gRPC
/// client's indexed metadata decodes to a few bytes per byte on the wire. A connection over it
/// is closed with `ENHANCE_YOUR_CALM`.
const HEADER_BYTES_PER_WIRE_BYTE: u64 = 16;
/// Decoded header bytes every client connection may use regardless of what it sent.
const HEADER_BYTES_SLACK: u64 = 64 << 10;
/// The HPACK dynamic table a client's headers are decoded with (RFC 7541's default, stated so
/// that it stays the bound on what one connection's table holds).
const HEADER_TABLE_SIZE: u32 = 4096;

/// Whether kvbridge answers `path` itself in sidecar mode: `SubscribeKvEvents` on the four engine
/// services, and `grpc.health.v1.Health` (whose SERVING then also covers the engine). Everything
/// else, reflection and the engines' own `HealthCheck`s included, is the engine's.
pub fn is_ours(path: &str) -> bool {
    crate::proto::ENGINE_SERVICES.iter().any(|s| s.path == path)
        || path.starts_with("/grpc.health.v1.Health/")
}

/// The sidecar's engine side: the connection pool, the health probe and the load poller.
pub struct Sidecar {
    upstream: upstream::Upstream,
    metrics: Arc<ProxyMetrics>,
    /// What client connections' forwarded streams may make kvbridge hold.
    budgets: budget::Budgets,
    /// The probe's verdict: the engine's gRPC server answers. A flag of its own, `Relaxed`.
    answering: Arc<AtomicBool>,
    /// Set at the start of a shutdown: the listener closes at once (open streams drain).
    draining: tokio::sync::watch::Sender<bool>,
    load: Option<crate::fanout::LoadFeed>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    runtime: ProxyRuntime,
}

/// Sidecar mode could not start.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// `--engine-tls-ca` is unusable (the message names the flag and the file's problem).
    #[error("{0}")]
    EngineTlsCa(String),
    /// The sidecar's own runtime or its thread could not be started.
    #[error("cannot start the sidecar's runtime thread: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Where the sidecar's tasks run: a runtime of its own on one thread (`kvbridge-proxy`); see
/// "Why one thread" in the module docs.
struct ProxyRuntime {
    handle: tokio::runtime::Handle,
    /// Dropped with the sidecar: the thread's runtime then stops.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl ProxyRuntime {
    fn start() -> Result<Self, ProxyError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ProxyError::Runtime)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("kvbridge-proxy".into())
            .spawn(move || {
                rt.block_on(async move {
                    let _ = stopped.await;
                })
            })
            .map_err(ProxyError::Runtime)?;
        Ok(ProxyRuntime {
            handle,
            _stop: stop,
        })
    }
}

impl Sidecar {
    /// Starts the probe (and the `GetLoads` poller unless its interval is 0) against the
    /// engine in `cfg`. Nothing is connected yet; an engine that is down is no start-up error.
    /// Fails only on an unusable `--engine-tls-ca`.
    pub fn start(cfg: &ProxyConfig, metrics: Arc<ProxyMetrics>) -> Result<Arc<Self>, ProxyError> {
        let upstream = upstream::Upstream::new(&cfg.engine, cfg.tls_ca.as_deref(), metrics.clone())
            .map_err(ProxyError::EngineTlsCa)?;
        let runtime = ProxyRuntime::start()?;
        let (load_tx, load_rx) = tokio::sync::watch::channel(None);
        let sidecar = Arc::new_cyclic(|weak: &std::sync::Weak<Sidecar>| {
            let rt = &runtime.handle;
            let mut tasks = vec![rt.spawn(probe(weak.clone()))];
            if let Some(every) = cfg.load_interval {
                tasks.push(rt.spawn(load::poll(weak.clone(), every, load_tx)));
            }
            Sidecar {
                upstream,
                budgets: budget::Budgets::new(
                    cfg.connection_buffer,
                    cfg.buffer,
                    cfg.stall_timeout,
                    metrics.clone(),
                ),
                metrics,
                answering: Arc::new(AtomicBool::new(false)),
                draining: tokio::sync::watch::Sender::new(false),
                load: cfg.load_interval.map(|_| load_rx),
                tasks,
                runtime,
            }
        });
        tracing::info!(engine = %sidecar.upstream.address(), load_interval = ?cfg.load_interval,
            "sidecar mode: forwarding every call but SubscribeKvEvents to the engine");
        Ok(sidecar)
    }

    /// True while the engine's gRPC server answers (the last probe got an HTTP/2 response).
    pub fn engine_answers(&self) -> Arc<AtomicBool> {
        self.answering.clone()
    }

    /// The engine's load samples, when polling is on.
    pub fn load_feed(&self) -> Option<crate::fanout::LoadFeed> {
        self.load.clone()
    }

    /// The engine's address, as given.
    pub fn engine(&self) -> &str {
        self.upstream.address()
    }

    /// Stops accepting connections at once (the start of a shutdown): the listener is closed,
    /// so a new connection is refused rather than left in the backlog, and open connections
    /// get a GOAWAY; their open streams drain as long as the shutdown lets them.
    pub fn stop_accepting(&self) {
        self.draining.send_replace(true);
    }

    /// Runs `task` on the sidecar's runtime.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<()>
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.runtime.handle.spawn(task)
    }

    /// One request: kvbridge's own, or forwarded.
    async fn handle(
        self: Arc<Self>,
        routes: Routes,
        budget: Arc<budget::ConnectionBudget>,
        req: Request<h2::RecvStream>,
        respond: h2::server::SendResponse<Bytes>,
    ) {
        if is_ours(req.uri().path()) {
            h2io::serve_routes(routes, req, respond).await
        } else {
            forward::forward(&self.upstream, &self.metrics, &budget, req, respond).await
        }
    }

    /// Serves the gRPC edge (`edge`: kvbridge's own routes, TLS, the handshake deadline) on
    /// `listener` in sidecar mode until `shutdown`, all of it on the sidecar's own runtime, the
    /// listener included; every call the edge does not serve goes to the engine.
    pub async fn serve_edge(
        self: Arc<Self>,
        edge: crate::fanout::Edge,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) {
        let listener = match listener.into_std() {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "gRPC listener unusable");
                return;
            }
        };
        let s = self.clone();
        let task = self.spawn(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "gRPC listener unusable");
                    return;
                }
            };
            let parts = edge.into_parts();
            let max_streams = parts
                .max_streams
                .unwrap_or(PROXY_MAX_STREAMS_PER_CONNECTION);
            let incoming = parts.incoming(listener);
            s.serve(
                parts.routes.clone(),
                parts.streams.clone(),
                incoming,
                max_streams,
                shutdown,
            )
            .await;
        });
        // Aborted with this future: serving ends when its caller stops waiting.
        struct AbortOnDrop(tokio::task::JoinHandle<()>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let mut task = AbortOnDrop(task);
        let _ = (&mut task.0).await;
    }

    /// Serves the gRPC listener in sidecar mode until `shutdown`: connections from `incoming`
    /// (already accepted, tuned and wrapped), HTTP/2 only, with the keepalive kvbridge uses
    /// elsewhere and `max_streams` streams per connection; kvbridge's `routes` for [`is_ours`]
    /// paths, the engine for the rest. On shutdown, open connections get a GOAWAY and up to the
    /// caller's patience to finish.
    pub async fn serve(
        self: Arc<Self>,
        routes: Routes,
        streams: Arc<crate::fanout::Streams>,
        incoming: impl futures_util::Stream<Item = crate::net::EdgeIo> + Send,
        max_streams: u32,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) {
        self.upstream.set_client_limit(max_streams);
        let mut builder = h2io::server_builder();
        builder
            // Per stream 1 MiB (the shared set-up's); per connection the part of the
            // connection's buffer budget set aside for requests (see `connection`). h2 buffers
            // at most the budget's `SEND_BUFFER` per stream for sending (`budget.rs`).
            .max_send_buffer_size(budget::SEND_BUFFER)
            .max_concurrent_streams(max_streams)
            .header_table_size(HEADER_TABLE_SIZE);
        let mut draining = self.draining.subscribe();
        let stop = async move {
            tokio::select! {
                _ = shutdown => {}
                _ = draining.wait_for(|d| *d) => {}
            }
        };
        h2io::serve_connections(incoming, stop, |io, stopping| {
            self.clone().connection(
                routes.clone(),
                streams.clone(),
                builder.clone(),
                io,
                stopping,
            )
        })
        .await;
    }

    /// One client connection, until the client closes it, stops answering keepalive pings, or
    /// (after `stopping`) its last stream ends: served as the edge serves its own
    /// ([`crate::fanout::serve_connection`]: `SubscribeKvEvents` streams in the connection's
    /// task), with every other call on a task of its own, kvbridge's or forwarded.
    async fn connection(
        self: Arc<Self>,
        routes: Routes,
        streams: Arc<crate::fanout::Streams>,
        builder: h2::server::Builder,
        io: crate::net::EdgeIo,
        stopping: tokio::sync::watch::Receiver<bool>,
    ) {
        // Header lists as large as the engine accepts, decoded bytes bounded by what arrived;
        // request bytes in flight bounded by the connection's window, from its buffer budget.
        let budget = Arc::new(self.budgets.connection());
        let mut builder = builder;
        builder
            .max_header_list_size(self.upstream.header_list_limit())
            .initial_connection_window_size(budget.window());
        let wire = Arc::new(AtomicU64::new(0));
        let mut headers = HeaderBudget {
            wire: wire.clone(),
            decoded: 0,
        };
        let hold = io.flush_hold();
        let io = h2io::Tap::new(io, wire);
        let metrics = self.metrics.clone();
        let sidecar = self.clone();
        let others = crate::fanout::Others {
            admit: Box::new(move |req| {
                headers.admit(req).inspect_err(|_| {
                    metrics
                        .calls
                        .with_label_values(&[method_label(req.uri().path()), "resource_exhausted"])
                        .inc();
                })
            }),
            serve: Box::new(move |req, respond| {
                tokio::spawn(
                    sidecar
                        .clone()
                        .handle(routes.clone(), budget.clone(), req, respond),
                );
            }),
        };
        crate::fanout::serve_connection(streams, builder, io, hold, stopping, others).await;
    }
}

/// A client connection's decoded header bytes against what arrived on it
/// ([`HEADER_BYTES_PER_WIRE_BYTE`]).
struct HeaderBudget {
    /// Bytes read from the connection so far.
    wire: Arc<AtomicU64>,
    /// Header bytes (names and values, pseudo-headers included) of its streams so far.
    decoded: u64,
}

impl HeaderBudget {
    /// Counts `req`'s headers; `RESOURCE_EXHAUSTED` when the connection is over its budget.
    fn admit<B>(&mut self, req: &Request<B>) -> Result<(), tonic::Status> {
        let uri = req.uri();
        let pseudo = req.method().as_str().len()
            + uri.scheme_str().map_or(0, str::len)
            + uri.authority().map_or(0, |a| a.as_str().len())
            + uri.path_and_query().map_or(0, |p| p.as_str().len());
        let fields: usize = req
            .headers()
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        self.decoded += (pseudo + fields) as u64;
        let wire = self.wire.load(Ordering::Relaxed);
        let allowed = wire
            .saturating_mul(HEADER_BYTES_PER_WIRE_BYTE)
            .saturating_add(HEADER_BYTES_SLACK);
        if self.decoded <= allowed {
            return Ok(());
        }
        Err(tonic::Status::resource_exhausted(format!(
            "kvbridge sidecar: this connection's request headers decode to {} bytes from {wire} bytes received (more than {HEADER_BYTES_PER_WIRE_BYTE} per byte): closing it",
            self.decoded
        )))
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Probes the engine every [`PROBE_INTERVAL`]: a `grpc.health.v1.Health/Check` for the whole
/// server. Any gRPC answer counts, `UNIMPLEMENTED` included (vLLM's and SGLang's servers need
/// not implement it): what health needs to know is that the engine's gRPC server answers.
async fn probe(sidecar: std::sync::Weak<Sidecar>) {
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = None;
    loop {
        tick.tick().await;
        let Some(s) = sidecar.upgrade() else { return };
        let answer = s
            .upstream
            .unary("/grpc.health.v1.Health/Check", &[], PROBE_TIMEOUT)
            .await;
        // Any status but these is the engine's own answer.
        let up = match &answer {
            Ok(_) => true,
            Err(st) => !matches!(st.code(), Code::Unavailable | Code::DeadlineExceeded),
        };
        s.answering.store(up, Ordering::Relaxed);
        s.metrics.engine_up.set(up as i64);
        s.upstream.set_state(match &answer {
            Err(e) if !up => {
                upstream::EngineState::Down(down_reason(s.upstream.address(), e).into())
            }
            _ => upstream::EngineState::Up,
        });
        if last != Some(up) {
            match &answer {
                Err(e) if !up => {
                    tracing::warn!(engine = %s.upstream.address(), error = %e.message(),
                    "engine gRPC server not answering: forwarded calls fail UNAVAILABLE, health NOT_SERVING")
                }
                _ => tracing::info!(engine = %s.upstream.address(), "engine gRPC server answers"),
            }
            last = Some(up);
        }
    }
}

/// What forwarded calls are answered while the probe finds the engine down: the probe's own
/// failure, naming the engine (a connect failure already does).
fn down_reason(engine: &str, probe: &tonic::Status) -> String {
    let why = probe.message();
    if why.contains(engine) && why.contains("unreachable") {
        why.to_string()
    } else {
        format!("kvbridge sidecar: engine gRPC server {engine} unreachable: the health probe got no answer ({why})")
    }
}

/// gRPC status code as a metric label (all seventeen).
pub(crate) fn code_name(c: Code) -> &'static str {
    match c {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// The `method` label of a forwarded call: its path when it is a method of the engine services
/// ([`crate::proto::ENGINE_SERVICES`], created at zero with the metrics), else `other`, so that
/// the series are known from the start and a client sending random paths adds none.
pub(crate) fn method_label(path: &str) -> &'static str {
    static KNOWN: std::sync::OnceLock<HashSet<String>> = std::sync::OnceLock::new();
    KNOWN
        .get_or_init(|| crate::proto::forwarded_methods().collect())
        .get(path)
        .map_or("other", String::as_str)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_subscribe_and_health_are_ours() {
        for s in crate::proto::ENGINE_SERVICES {
            assert!(is_ours(s.path));
            assert!(!is_ours(&format!("/{}/Generate", s.service)));
            assert!(!is_ours(&format!("/{}/HealthCheck", s.service)));
        }
        assert!(is_ours("/grpc.health.v1.Health/Check"));
        assert!(is_ours("/grpc.health.v1.Health/Watch"));
        assert!(!is_ours(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
        ));
        assert!(!is_ours("/mlx.grpc.engine.MlxEngine/SubscribeKvEvents"));
    }

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(
            method_label("/vllm.grpc.engine.VllmEngine/Generate"),
            "/vllm.grpc.engine.VllmEngine/Generate"
        );
        assert_eq!(
            method_label("/sglang.grpc.scheduler.SglangScheduler/LoadLoRAAdapter"),
            "/sglang.grpc.scheduler.SglangScheduler/LoadLoRAAdapter"
        );
        assert_eq!(
            method_label("/vllm.grpc.engine.VllmEngine/Unknown"),
            "other"
        );
        assert_eq!(method_label("/mlx.grpc.engine.MlxEngine/Generate"), "other");
        assert_eq!(method_label("/no-method"), "other");
        assert_eq!(method_label("/a b/c"), "other");
    }
}
