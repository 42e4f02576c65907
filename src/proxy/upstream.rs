//! The connections to the engine's gRPC server: a small pool of multiplexed HTTP/2 connections,
//! opened on demand and replaced when they close.
//!
//! **Fail fast.** A call that finds no live connection opens one, with a short connect deadline
//! ([`CONNECT_TIMEOUT`]); when that fails the call is answered `UNAVAILABLE` naming the engine's
//! address, at once, rather than queued behind a dead engine (docs/smg-api.md §2: the gateway
//! retries, and a hang would hold its request). The next call tries again, so an engine that
//! comes back is used without restarting kvbridge.
//!
//! **Why a pool.** One HTTP/2 connection is one TCP stream with one flow-control window and one
//! task on each side; a few of them spread a busy worker's `Generate` streams over several
//! engine-side connections and cores. Calls take the slots in turn.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use tokio_rustls::rustls;
use tonic::Status;

use super::budget::STREAM_WINDOW;
use super::EngineGrpc;
use super::ProxyMetrics;
use crate::net::h2io::{RecvBody, SettingsWatch, Tap};

/// Connections kept to the engine.
pub(crate) const POOL_SIZE: usize = 4;
/// HTTP/2 receive window per engine connection: the protocol's maximum.
pub(crate) const CONNECTION_WINDOW: u32 = (1 << 31) - 1;
/// Keepalive pings to the engine: as a G2 gateway's channel (docs/smg-api.md §3.1).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive ping may go unanswered before the connection is dropped.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time to open a TCP connection (and TLS) to the engine before the call fails `UNAVAILABLE`.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the engine has, once TCP (and TLS) is up, to send its HTTP/2 SETTINGS: until then
/// the connection is not used. An engine that accepts TCP but never speaks HTTP/2 (or is
/// stopped) is thus `UNAVAILABLE` within a second, not a hang.
pub(crate) const SETTINGS_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a failed connect is remembered for its pool slot: calls in that time are answered
/// with its error at once instead of trying again.
pub(crate) const CONNECT_BACKOFF: Duration = Duration::from_millis(500);
/// The decoded header list kvbridge accepts from its clients until an engine connection has
/// reported the engine's own `SETTINGS_MAX_HEADER_LIST_SIZE`: what hyper and gRPC C-core
/// advertise by default.
pub(crate) const DEFAULT_HEADER_LIST: u32 = 16 << 10;
/// The largest decoded header list kvbridge accepts from its clients, whatever the engine
/// allows (also its limit for the engine's response headers).
pub(crate) const MAX_HEADER_LIST: u32 = 1 << 20;

/// Streams kvbridge may reset on one engine connection before the engine answered them, within
/// [`RESET_BURST_WINDOW`], before the connection leaves its pool slot. A client that goes away
/// with many calls unanswered (a gateway restarting, a connection kvbridge closes for abuse)
/// makes kvbridge reset them all at once on the connections they went to, and servers take such
/// a burst for the HTTP/2 "rapid reset" attack: hyper/h2 closes the connection with GOAWAY
/// `ENHANCE_YOUR_CALM` ("too_many_resets") past 20 streams reset before it accepted them. That
/// GOAWAY would fail every call routed to the connection after the burst; retired at half that,
/// the connection keeps only the calls already on it, and later calls go to a fresh one.
pub(crate) const RESET_BURST: u32 = 10;
/// The interval [`RESET_BURST`] is counted in: resets further apart are no burst.
pub(crate) const RESET_BURST_WINDOW: Duration = Duration::from_secs(1);

/// An engine connection as the pool hands it out: its sender, the flag that takes it out of its
/// slot, and the count of its streams reset unanswered ([`RESET_BURST`]).
#[derive(Clone)]
pub(crate) struct Connection {
    /// Opens streams on the connection.
    pub(crate) sender: SendRequest<Bytes>,
    /// Set when the connection's task ends or it is retired; a flag of its own (nothing is
    /// published through it), so `Relaxed`.
    closed: Arc<AtomicBool>,
    /// When the current burst of unanswered resets began, and its count so far.
    resets: Arc<std::sync::Mutex<(std::time::Instant, u32)>>,
}

impl Connection {
    /// Takes the connection out of its pool slot: the next call that picks the slot connects
    /// anew. For a connection that refused to open a stream (the engine sent GOAWAY, say after
    /// another client's calls were reset in a burst and it judged that abuse): its streams
    /// still open finish on it, new ones go elsewhere.
    pub(crate) fn retire(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// Notes that kvbridge resets one of this connection's streams before the engine answered
    /// it; the [`RESET_BURST`]th within [`RESET_BURST_WINDOW`] retires the connection.
    pub(crate) fn reset_unanswered(&self, engine: &str) {
        let now = std::time::Instant::now();
        let mut burst = self.resets.lock().unwrap_or_else(|e| e.into_inner());
        if now.duration_since(burst.0) > RESET_BURST_WINDOW {
            *burst = (now, 0);
        }
        burst.1 += 1;
        if burst.1 == RESET_BURST {
            self.retire();
            tracing::info!(
                engine,
                "{RESET_BURST} calls on one engine connection reset unanswered within {RESET_BURST_WINDOW:?}: new calls go to a fresh connection (the engine may take the burst for a rapid-reset attack and close this one)"
            );
        }
    }
}

/// A pool slot: at most one connect in flight, whose result every waiter gets; a failure is
/// remembered for [`CONNECT_BACKOFF`].
enum Slot {
    Empty,
    Ready(Connection),
    Connecting(tokio::sync::watch::Receiver<Option<Result<Connection, Arc<str>>>>),
    Failed {
        until: tokio::time::Instant,
        error: Arc<str>,
    },
}

/// What the health probe last found ([`super::probe`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum EngineState {
    /// Not probed yet.
    Unknown,
    Up,
    /// Not answering: the reason, as forwarded calls are answered while it lasts.
    Down(Arc<str>),
}

/// The engine end of the sidecar.
pub(crate) struct Upstream {
    engine: EngineGrpc,
    /// `http://host:port` / `https://host:port`, the scheme and authority of forwarded requests.
    pub(crate) base: String,
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    slots: Vec<std::sync::Mutex<Slot>>,
    next: AtomicUsize,
    metrics: Arc<ProxyMetrics>,
    /// The `MAX_CONCURRENT_STREAMS` kvbridge advertises to its own clients, to compare with the
    /// engine's.
    client_limit: Arc<AtomicU32>,
    /// The engine's `SETTINGS_MAX_HEADER_LIST_SIZE` from the last connection that opened
    /// (0: none opened yet; `u32::MAX`: the engine sets no limit).
    header_list: AtomicU32,
    state: tokio::sync::watch::Sender<EngineState>,
}

impl Upstream {
    /// The pool for `engine` (nothing is connected yet). Fails only on an unusable CA file.
    pub(crate) fn new(
        engine: &EngineGrpc,
        tls_ca: Option<&[u8]>,
        metrics: Arc<ProxyMetrics>,
    ) -> Result<Self, String> {
        let tls = match tls_ca {
            Some(pem) => Some(tls_connector(pem, &engine.host)?),
            None => None,
        };
        Ok(Upstream {
            base: engine.to_string(),
            engine: engine.clone(),
            tls,
            slots: (0..POOL_SIZE)
                .map(|_| std::sync::Mutex::new(Slot::Empty))
                .collect(),
            next: AtomicUsize::new(0),
            metrics,
            client_limit: Arc::new(AtomicU32::new(u32::MAX)),
            header_list: AtomicU32::new(0),
            state: tokio::sync::watch::Sender::new(EngineState::Unknown),
        })
    }

    /// Notes the `MAX_CONCURRENT_STREAMS` kvbridge advertises to its clients: an engine that
    /// allows more is warned about (docs/smg-api.md §2: the sidecar must not lower it).
    pub(crate) fn set_client_limit(&self, streams: u32) {
        self.client_limit.store(streams, Ordering::Relaxed);
    }

    /// The engine's address as the operator gave it, for messages.
    pub(crate) fn address(&self) -> &str {
        &self.base
    }

    /// The largest decoded header list a client connection opened now may send: the engine's
    /// own limit (once a connection has read it; [`DEFAULT_HEADER_LIST`] before), at most
    /// [`MAX_HEADER_LIST`].
    pub(crate) fn header_list_limit(&self) -> u32 {
        match self.header_list.load(Ordering::Relaxed) {
            0 => DEFAULT_HEADER_LIST,
            n => n.min(MAX_HEADER_LIST),
        }
    }

    /// Records what the probe found (only changes wake anyone). An engine that answers ends
    /// every remembered connect failure: the next call on such a slot connects again.
    pub(crate) fn set_state(&self, state: EngineState) {
        if state == EngineState::Up {
            for slot in &self.slots {
                let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
                if matches!(*slot, Slot::Failed { .. }) {
                    *slot = Slot::Empty;
                }
            }
        }
        self.state.send_if_modified(|s| {
            let changed = *s != state;
            *s = state;
            changed
        });
    }

    /// What the probe found, and its changes from now on.
    pub(crate) fn state(&self) -> tokio::sync::watch::Receiver<EngineState> {
        self.state.subscribe()
    }

    fn unreachable(&self, e: &str) -> Status {
        Status::unavailable(format!(
            "kvbridge sidecar: engine gRPC server {} unreachable: {e}",
            self.base
        ))
    }

    /// A sender on a live connection: the next slot's, or a new connection in that slot (one
    /// connect per slot at a time, shared by every call that needs it). `UNAVAILABLE` naming
    /// the engine when it cannot be reached, at once while a failed connect is remembered.
    pub(crate) async fn sender(&self) -> Result<Connection, Status> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        loop {
            let wait = {
                let mut slot = self.slots[i].lock().unwrap_or_else(|e| e.into_inner());
                match &*slot {
                    Slot::Ready(c) if !c.closed.load(Ordering::Relaxed) => return Ok(c.clone()),
                    Slot::Failed { until, error } if tokio::time::Instant::now() < *until => {
                        return Err(self.unreachable(error))
                    }
                    Slot::Connecting(rx) => Ok(rx.clone()),
                    _ => {
                        let (tx, rx) = tokio::sync::watch::channel(None);
                        *slot = Slot::Connecting(rx);
                        Err(tx)
                    }
                }
            };
            let mut result = match wait {
                Ok(rx) => rx,
                Err(tx) => return self.connect_slot(i, tx).await,
            };
            // Another call is connecting this slot: its result is ours. If that call went away
            // mid-connect (its sender dropped, the slot emptied), try again.
            let outcome = match result.wait_for(Option::is_some).await {
                Ok(r) => r.clone(),
                Err(_) => None,
            };
            match outcome {
                Some(Ok(s)) => return Ok(s),
                Some(Err(e)) => return Err(self.unreachable(&e)),
                None => {}
            }
        }
    }

    /// Connects slot `i` and publishes the outcome on `tx` (and in the slot).
    async fn connect_slot(
        &self,
        i: usize,
        tx: tokio::sync::watch::Sender<Option<Result<Connection, Arc<str>>>>,
    ) -> Result<Connection, Status> {
        // Empties the slot if this call is dropped mid-connect, so waiters try again.
        struct Abandoned<'a>(Option<&'a std::sync::Mutex<Slot>>);
        impl Drop for Abandoned<'_> {
            fn drop(&mut self) {
                if let Some(m) = self.0 {
                    *m.lock().unwrap_or_else(|e| e.into_inner()) = Slot::Empty;
                }
            }
        }
        let mut guard = Abandoned(Some(&self.slots[i]));
        let outcome = self.connect().await;
        guard.0 = None;
        let mut slot = self.slots[i].lock().unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(c) => {
                self.metrics.connects.with_label_values(&["ok"]).inc();
                *slot = Slot::Ready(c.clone());
                tx.send_replace(Some(Ok(c.clone())));
                Ok(c)
            }
            Err(e) => {
                self.metrics.connects.with_label_values(&["failed"]).inc();
                let error: Arc<str> = e.into();
                *slot = Slot::Failed {
                    until: tokio::time::Instant::now() + CONNECT_BACKOFF,
                    error: error.clone(),
                };
                tx.send_replace(Some(Err(error.clone())));
                Err(self.unreachable(&error))
            }
        }
    }

    async fn connect(&self) -> Result<Connection, String> {
        let addr = (self.engine.host.as_str(), self.engine.port);
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| format!("no TCP connection within {CONNECT_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => self.handshake(tcp).await,
            Some((connector, name)) => {
                let tls =
                    tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name.clone(), tcp))
                        .await
                        .map_err(|_| format!("no TLS handshake within {CONNECT_TIMEOUT:?}"))?
                        .map_err(|e| format!("TLS: {e}"))?;
                self.handshake(tls).await
            }
        }
    }

    async fn handshake<T>(&self, io: T) -> Result<Connection, String>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        // Keepalive as the gateway's own channel (docs/smg-api.md §3.1), idle connections
        // included. Windows: fixed, a stream's bounded by STREAM_WINDOW, and the connection's as
        // large as HTTP/2 allows: the streams' shares of the buffer budgets bound what is held
        // (`budget.rs`), and a connection window shared by every client's streams must not let
        // one client's unread streams stall the others'. It also keeps h2's small-DATA-frame
        // guard (≥ 0.4.16: a connection-wide budget of half the connection window) from closing
        // the connection with ENHANCE_YOUR_CALM when a `Generate` stream of small messages is
        // buffered while the client reads slowly; the engine is the one peer kvbridge trusts
        // not to flood it.
        let (settings_tx, settings) = tokio::sync::oneshot::channel();
        let io = Tap::new(io, SettingsWatch::new(settings_tx));
        let (sender, mut conn) = tokio::time::timeout(
            CONNECT_TIMEOUT,
            h2::client::Builder::new()
                .initial_window_size(STREAM_WINDOW)
                .initial_connection_window_size(CONNECTION_WINDOW)
                .max_send_buffer_size(super::budget::SEND_BUFFER)
                .max_header_list_size(MAX_HEADER_LIST)
                .enable_push(false)
                .handshake::<_, Bytes>(io),
        )
        .await
        .map_err(|_| format!("no HTTP/2 handshake within {CONNECT_TIMEOUT:?}"))?
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
        let live = Live {
            gauge: self.metrics.connections.clone(),
            closed: Arc::new(AtomicBool::new(false)),
        };
        live.gauge.inc();
        let closed = live.closed.clone();
        let base = self.base.clone();
        let pings = conn.ping_pong();
        let limits = StreamLimits {
            gauge: self.metrics.engine_max_streams.clone(),
            client: self.client_limit.clone(),
            engine: self.base.clone(),
            seen: None,
        };
        let driver = tokio::spawn(async move {
            let _live = live;
            let mut limits = limits;
            // The engine's settings arrive while the connection is driven: read its stream
            // limit after each poll (a field read) and report it when it changes.
            let driven = std::future::poll_fn(|cx| {
                let r = std::future::Future::poll(std::pin::Pin::new(&mut conn), cx);
                limits.observe(conn.max_concurrent_send_streams());
                r
            });
            tokio::select! {
                r = driven => if let Err(e) = r {
                    tracing::debug!(engine = %base, error = %e, "engine connection ended");
                },
                () = crate::net::h2io::keepalive(pings, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT) => {
                    tracing::debug!(engine = %base, "engine connection closed: keepalive ping not answered");
                }
            }
        });
        // Usable only once the engine has spoken HTTP/2.
        let peer = match tokio::time::timeout(SETTINGS_TIMEOUT, settings).await {
            Ok(Ok(Ok(peer))) => Ok(peer),
            Ok(Ok(Err(e))) => Err(format!("the engine is not an HTTP/2 server: {e}")),
            Ok(Err(_)) => Err("the connection ended before the engine's HTTP/2 SETTINGS".to_string()),
            Err(_) => Err(format!(
                "TCP connected, but no HTTP/2 SETTINGS from the engine within {SETTINGS_TIMEOUT:?} (not an HTTP/2 server, or stopped)"
            )),
        }
        .inspect_err(|_| driver.abort())?;
        self.header_list.store(
            peer.max_header_list_size.unwrap_or(u32::MAX).max(1),
            Ordering::Relaxed,
        );
        Ok(Connection {
            sender,
            closed,
            resets: Arc::new(std::sync::Mutex::new((std::time::Instant::now(), 0))),
        })
    }
}

/// An engine connection's driver task while it lives: the gauge of open connections, and the
/// flag its pool slot reads, set when the task ends (or is aborted).
struct Live {
    gauge: prometheus::IntGauge,
    closed: Arc<AtomicBool>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
        self.gauge.dec();
    }
}

/// Reports the engine's `SETTINGS_MAX_CONCURRENT_STREAMS` as a connection learns it.
struct StreamLimits {
    gauge: prometheus::IntGauge,
    client: Arc<AtomicU32>,
    engine: String,
    seen: Option<usize>,
}

impl StreamLimits {
    fn observe(&mut self, engine: usize) {
        if self.seen == Some(engine) {
            return;
        }
        self.seen = Some(engine);
        // h2 starts from "no limit" until the engine's SETTINGS say otherwise.
        let Ok(limit) = u32::try_from(engine) else {
            self.gauge.set(0);
            return;
        };
        self.gauge.set(i64::from(limit));
        let client = self.client.load(Ordering::Relaxed);
        if client < limit {
            tracing::warn!(engine = %self.engine, engine_max_streams = limit, max_streams_per_connection = client,
                "the engine allows more concurrent streams per connection than kvbridge advertises to its clients: raise --max-streams-per-connection (or leave it unset) so the sidecar does not lower the engine's limit");
        } else {
            tracing::info!(engine = %self.engine, engine_max_streams = limit, "engine's stream limit per connection");
        }
    }
}

/// rustls client for the engine: the CA from `--engine-tls-ca`, ALPN `h2`, the host of
/// `--engine-grpc` as the name checked against the certificate.
fn tls_connector(
    pem: &[u8],
    host: &str,
) -> Result<
    (
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    ),
    String,
> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| format!("--engine-tls-ca: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("--engine-tls-ca: {e}"))?;
    }
    if roots.is_empty() {
        return Err("--engine-tls-ca: no CERTIFICATE block".into());
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| format!("--engine-grpc host {host:?}: {e}"))?;
    Ok((tokio_rustls::TlsConnector::from(Arc::new(config)), name))
}

impl Upstream {
    /// One unary call of kvbridge's own (GetLoads, the health probe): `msg` is the encoded
    /// request; the answer is the encoded response message, or the engine's status (or
    /// `UNAVAILABLE` / `DEADLINE_EXCEEDED` when it does not answer within `timeout`).
    pub(crate) async fn unary(
        &self,
        path: &str,
        msg: &[u8],
        timeout: Duration,
    ) -> Result<Bytes, Status> {
        let call = async {
            let unavailable = |e: h2::Error| Status::unavailable(format!("{}: {e}", self.base));
            // A connection that cannot open a stream leaves its slot (see `Connection::retire`).
            let lease = self.sender().await?;
            let mut sender = lease
                .sender
                .clone()
                .ready()
                .await
                .inspect_err(|_| lease.retire())
                .map_err(unavailable)?;
            let mut framed = Vec::with_capacity(5 + msg.len());
            framed.push(0);
            framed.extend_from_slice(&(msg.len() as u32).to_be_bytes());
            framed.extend_from_slice(msg);
            let req = http::Request::post(format!("{}{path}", self.base))
                .header(http::header::CONTENT_TYPE, "application/grpc")
                .header(http::header::TE, "trailers")
                .header("grpc-timeout", format!("{}m", timeout.as_millis().max(1)))
                .body(())
                .map_err(|e| Status::internal(e.to_string()))?;
            let (resp, mut send) = sender
                .send_request(req, false)
                .inspect_err(|_| lease.retire())
                .map_err(unavailable)?;
            send.send_data(Bytes::from(framed), true)
                .map_err(unavailable)?;
            let resp = resp.await.map_err(unavailable)?;
            let (parts, body) = resp.into_parts();
            if let Some(s) = Status::from_header_map(&parts.headers) {
                return if s.code() == tonic::Code::Ok {
                    Ok(Bytes::new())
                } else {
                    Err(s)
                };
            }
            let collected = http_body_util::BodyExt::collect(RecvBody::new(body))
                .await
                .map_err(unavailable)?;
            let trailers = collected.trailers().cloned().unwrap_or_default();
            let data = collected.to_bytes();
            match Status::from_header_map(&trailers) {
                Some(s) if s.code() != tonic::Code::Ok => return Err(s),
                None => return Err(Status::internal("engine answered without grpc-status")),
                _ => {}
            }
            if data.len() < 5 {
                return Ok(Bytes::new());
            }
            if data[0] != 0 {
                return Err(Status::internal("engine answered compressed"));
            }
            let len = u32::from_be_bytes([data[1], data[2], data[3], data[4]]) as usize;
            if data.len() < 5 + len {
                return Err(Status::internal("engine answer truncated"));
            }
            Ok(data.slice(5..5 + len))
        };
        match tokio::time::timeout(timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(Status::deadline_exceeded(format!(
                "engine gRPC server {} did not answer {path} within {timeout:?}",
                self.base
            ))),
        }
    }
}
