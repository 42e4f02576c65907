//! Prometheus metrics: one registry per process, created at start-up and handed to each stage.
//!
//! Stages hold pre-resolved counter handles (see [`RankMetrics`]) so the hot path never hashes
//! label values. The exposition format comes from the `prometheus` crate's `TextEncoder`; the
//! HTTP side is a deliberately tiny responder (GET anything → the metrics page), because the
//! endpoint has one job and pulling a web framework in for it would cost more than it gives.

pub mod process;

use std::net::SocketAddr;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// All of kvbridge's metrics.
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Engine batches received, per rank.
    pub batches_received: IntCounterVec,
    /// Messages dropped before decoding, per rank and reason.
    pub frames_dropped: IntCounterVec,
    /// Upstream sequence gaps detected, per rank.
    pub upstream_gaps: IntCounterVec,
    /// Replay requests by outcome, per rank.
    pub replays: IntCounterVec,
    /// Batches recovered through replay, per rank.
    pub replayed_batches: IntCounterVec,
    /// Engine restarts detected, per rank.
    pub engine_restarts: IntCounterVec,
    /// Synthesized in-band clears, per rank and cause.
    pub synthesized_clears: IntCounterVec,
    /// Batches that could not be decoded at all, per rank and error kind.
    pub decode_errors: IntCounterVec,
    /// Publisher connections established (ZMQ monitor CONNECTED/ACCEPTED), per rank.
    pub publisher_connects: IntCounterVec,
    /// Publisher disconnects (ZMQ monitor DISCONNECTED), per rank.
    pub publisher_disconnects: IntCounterVec,
    /// Publisher connections currently up, per rank.
    pub upstream_connected: IntGaugeVec,
    /// Connecting SUBs connected again by kvbridge after libzmq gave the connection up, per rank.
    pub publisher_rejoins: IntCounterVec,
    /// Health status served on grpc.health.v1 (1 SERVING, 0 NOT_SERVING).
    pub health_serving: IntGauge,
    /// Per rank: 1 while kvbridge's output is the engine's whole state, 0 while degraded.
    pub rank_exact: IntGaugeVec,
    /// Per rank and cause: 1 for the cause the rank is degraded by, else 0.
    pub rank_degraded: IntGaugeVec,
    /// Ring capacity in bytes, per ring.
    pub ring_capacity: IntGaugeVec,
    /// Bytes holding retained records, per ring.
    pub ring_used: IntGaugeVec,
    /// `ring_used_bytes / ring_capacity_bytes`, per ring.
    pub ring_fill: prometheus::GaugeVec,
    /// Subscribers that fell a lap behind and were ended with DATA_LOSS, per ring.
    pub ring_reader_laps: IntCounterVec,
    /// Records that failed their checksum (or had a damaged header) when read from the ring;
    /// the subscriber reading one was ended with DATA_LOSS. Per ring.
    pub ring_corrupt_records: IntCounterVec,
    /// Subscribers disconnected for being too slow (DATA_LOSS), per path.
    pub slow_disconnects: IntCounterVec,
    /// Calls rejected for a missing or wrong bearer token.
    pub auth_failures: IntCounter,
    /// `accept(2)` failures, per listener (`grpc`, `metrics`) and kind (`emfile`, …).
    pub accept_errors: IntCounterVec,
    /// gRPC connections closed for not completing TLS / the HTTP/2 preface in time.
    pub handshake_timeouts: IntCounter,
    /// Duplicates dropped while merging replay and live, per rank.
    pub duplicates_dropped: IntCounterVec,
    /// Live frames repeating the last applied engine seq on the same connection, per rank.
    pub repeated_frames: IntCounterVec,
    /// Batches whose own rank element differs from the socket's rank.
    pub rank_mismatch: IntCounterVec,
    /// Last engine sequence applied, per rank.
    pub last_upstream_seq: IntGaugeVec,
    /// Decoder counters (events by type, skipped fields and tags, filters), per rank and kind.
    pub decoder: IntCounterVec,
    /// Records written, per ring.
    pub ring_records: IntCounterVec,
    /// Record bytes written, per ring.
    pub ring_bytes: IntCounterVec,
    /// Oldest retained sequence, per ring.
    pub ring_oldest: IntGaugeVec,
    /// Newest sequence, per ring.
    pub ring_newest: IntGaugeVec,
    /// Encoded batch size.
    pub record_size: Histogram,
    /// Current subscribers, per path.
    pub subscribers: IntGaugeVec,
    /// Batches sent to subscribers.
    pub batches_sent: IntCounter,
    /// Bytes sent to subscribers (encoded batches).
    pub bytes_sent: IntCounter,
    /// Subscribe outcomes (fresh, in_window, at_head, out_of_range, data_loss, …).
    pub resumes: IntCounterVec,
    /// Statuses emitted, by gRPC code.
    pub statuses: IntCounterVec,
    /// Time from ingest to hand-off to the transport, seconds.
    pub send_latency: HistogramVec,
    /// Batches a subscriber was sent from history it caught up on (ingested before it
    /// subscribed): not live sends, so not in `send_latency`.
    pub catchup_sends: IntCounterVec,
    /// Per-subscriber lag (N − the sequence just handed off), observed at every hand-off.
    pub subscriber_lag: Histogram,
    /// Sidecar mode (`--engine-grpc`): forwarding to the engine.
    pub proxy: ProxyMetrics,
    /// The process's own CPU, memory and descriptors (`process_*`, read at every scrape).
    process: ProcessMetrics,
}

fn counter(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    reg.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn gauge(reg: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    reg.register(Box::new(g.clone())).expect("unique metric");
    g
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Self {
        let r = Registry::new_custom(Some("kvbridge".into()), None).expect("registry");
        let record_size = Histogram::with_opts(
            HistogramOpts::new("record_size_bytes", "Encoded KvEventBatch size")
                .buckets(prometheus::exponential_buckets(64.0, 4.0, 10).expect("buckets")),
        )
        .expect("histogram");
        r.register(Box::new(record_size.clone())).expect("unique");
        let send_latency = HistogramVec::new(
            HistogramOpts::new(
                "send_latency_seconds",
                "Ingest to transport hand-off, per live subscriber batch (ingested after the subscriber subscribed; catch-up is kvbridge_catchup_sends_total)",
            )
            .buckets(prometheus::exponential_buckets(5e-6, 2.5, 14).expect("buckets")),
            &["path"],
        )
        .expect("histogram");
        r.register(Box::new(send_latency.clone())).expect("unique");
        let subscriber_lag = Histogram::with_opts(
            HistogramOpts::new(
                "subscriber_lag_batches",
                "Newest sequence minus the one just handed to a subscriber, per hand-off",
            )
            .buckets(
                std::iter::once(0.0)
                    .chain(prometheus::exponential_buckets(1.0, 4.0, 10).expect("buckets"))
                    .collect(),
            ),
        )
        .expect("histogram");
        r.register(Box::new(subscriber_lag.clone()))
            .expect("unique");
        let batches_sent =
            IntCounter::new("batches_sent_total", "Batches sent to subscribers").expect("metric");
        r.register(Box::new(batches_sent.clone())).expect("unique");
        let bytes_sent = IntCounter::new(
            "bytes_sent_total",
            "Encoded batch bytes sent to subscribers",
        )
        .expect("metric");
        r.register(Box::new(bytes_sent.clone())).expect("unique");
        let m = Metrics {
            batches_received: counter(
                &r,
                "batches_received_total",
                "Engine batches received",
                &["rank"],
            ),
            frames_dropped: counter(
                &r,
                "frames_dropped_total",
                "ZMQ messages dropped before decoding",
                &["rank", "reason"],
            ),
            upstream_gaps: counter(
                &r,
                "upstream_gaps_total",
                "Engine sequence gaps detected",
                &["rank"],
            ),
            replays: counter(
                &r,
                "replays_total",
                "Replay requests by outcome",
                &["rank", "outcome"],
            ),
            replayed_batches: counter(
                &r,
                "replayed_batches_total",
                "Batches recovered by replay",
                &["rank"],
            ),
            engine_restarts: counter(
                &r,
                "engine_restarts_total",
                "Engine restarts detected",
                &["rank"],
            ),
            synthesized_clears: counter(
                &r,
                "synthesized_clears_total",
                "In-band cleared events",
                &["rank", "cause"],
            ),
            decode_errors: counter(
                &r,
                "decode_errors_total",
                "Batches that could not be decoded, by error kind",
                &["rank", "kind"],
            ),
            publisher_connects: counter(
                &r,
                "publisher_connects_total",
                "Engine publisher connections established",
                &["rank"],
            ),
            publisher_disconnects: counter(
                &r,
                "publisher_disconnects_total",
                "Engine publisher disconnects",
                &["rank"],
            ),
            publisher_rejoins: counter(
                &r,
                "publisher_rejoins_total",
                "Publisher connections kvbridge re-established after libzmq dropped them for a protocol error (e.g. a message above --max-engine-message)",
                &["rank"],
            ),
            upstream_connected: gauge(
                &r,
                "upstream_connected",
                "Engine publisher connections currently up",
                &["rank"],
            ),
            health_serving: {
                let g = IntGauge::new(
                    "health_serving",
                    "grpc.health.v1 status: 1 SERVING, 0 NOT_SERVING",
                )
                .expect("metric");
                r.register(Box::new(g.clone())).expect("unique");
                g
            },
            rank_exact: gauge(
                &r,
                "rank_exact",
                "1 while a rank's output is the engine's whole cache state, 0 while degraded (kvbridge_rank_degraded says why)",
                &["rank"],
            ),
            rank_degraded: gauge(
                &r,
                "rank_degraded",
                "1 for the cause a rank's output is degraded by (until the engine's next cache reset or restart), else 0",
                &["rank", "cause"],
            ),
            ring_capacity: gauge(&r, "ring_capacity_bytes", "Ring data capacity", &["ring"]),
            ring_used: gauge(
                &r,
                "ring_used_bytes",
                "Ring bytes holding retained records",
                &["ring"],
            ),
            ring_fill: {
                let g = prometheus::GaugeVec::new(
                    Opts::new("ring_fill_ratio", "Retained bytes / capacity"),
                    &["ring"],
                )
                .expect("metric");
                r.register(Box::new(g.clone())).expect("unique");
                g
            },
            ring_reader_laps: counter(
                &r,
                "ring_reader_laps_total",
                "In-process readers (subscribers) overtaken by the writer",
                &["ring"],
            ),
            ring_corrupt_records: counter(
                &r,
                "ring_corrupt_records_total",
                "Records read from the ring with a bad checksum or damaged header (not served)",
                &["ring"],
            ),
            slow_disconnects: counter(
                &r,
                "slow_subscriber_disconnects_total",
                "Subscribers ended with DATA_LOSS for falling a ring lap behind",
                &["path"],
            ),
            auth_failures: {
                let c = IntCounter::new(
                    "auth_failures_total",
                    "gRPC calls rejected with UNAUTHENTICATED",
                )
                .expect("metric");
                r.register(Box::new(c.clone())).expect("unique");
                c
            },
            accept_errors: counter(
                &r,
                "accept_errors_total",
                "Failed accept(2) calls by listener and kind (emfile, enfile, nomem, connection, other)",
                &["listener", "kind"],
            ),
            handshake_timeouts: {
                let c = IntCounter::new(
                    "handshake_timeouts_total",
                    "gRPC connections closed for not completing TLS and the HTTP/2 preface in time",
                )
                .expect("metric");
                r.register(Box::new(c.clone())).expect("unique");
                c
            },
            duplicates_dropped: counter(
                &r,
                "duplicates_dropped_total",
                "Duplicate batches dropped",
                &["rank"],
            ),
            repeated_frames: counter(
                &r,
                "repeated_frames_total",
                "Live frames repeating the last applied engine batch, same seq and bytes (dropped)",
                &["rank"],
            ),
            rank_mismatch: counter(
                &r,
                "rank_mismatch_total",
                "Batches whose rank differs from the socket's",
                &["rank"],
            ),
            last_upstream_seq: gauge(
                &r,
                "last_upstream_seq",
                "Last engine sequence applied",
                &["rank"],
            ),
            decoder: counter(
                &r,
                "decoder_events_total",
                "Decoder counters by kind (events by type, skipped keys/tags, filtered, splits)",
                &["rank", "kind"],
            ),
            ring_records: counter(&r, "ring_records_total", "Records written", &["ring"]),
            ring_bytes: counter(&r, "ring_bytes_total", "Record bytes written", &["ring"]),
            ring_oldest: gauge(&r, "ring_oldest_seq", "Oldest retained sequence", &["ring"]),
            ring_newest: gauge(&r, "ring_newest_seq", "Newest sequence", &["ring"]),
            record_size,
            subscribers: gauge(&r, "subscribers", "Current subscribers", &["path"]),
            batches_sent,
            bytes_sent,
            resumes: counter(
                &r,
                "subscribe_outcomes_total",
                "Subscribe requests by outcome",
                &["outcome"],
            ),
            statuses: counter(&r, "statuses_total", "gRPC statuses emitted", &["code"]),
            send_latency,
            catchup_sends: counter(
                &r,
                "catchup_sends_total",
                "Batches sent to subscribers from history ingested before they subscribed (a new or resuming subscriber catching up)",
                &["path"],
            ),
            subscriber_lag,
            proxy: ProxyMetrics::new(&r),
            process: ProcessMetrics::new(),
            registry: r,
        };
        // Counters that alerts take `increase()` of exist at 0 from the start: a series that
        // first appears at 1 shows no increase, so the first event would go unseen.
        for s in crate::proto::ENGINE_SERVICES {
            m.slow_disconnects.with_label_values(&[s.path]);
        }
        m
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

    /// Counter handles for one ingest rank.
    pub fn rank(&self, rank: u32) -> RankMetrics {
        let r = rank.to_string();
        let l = [r.as_str()];
        RankMetrics {
            label: r.clone(),
            batches: self.batches_received.with_label_values(&l),
            gaps: self.upstream_gaps.with_label_values(&l),
            restarts: self.engine_restarts.with_label_values(&l),
            decode_errors: self.decode_errors.clone(),
            connects: self.publisher_connects.with_label_values(&l),
            disconnects: self.publisher_disconnects.with_label_values(&l),
            connected: self.upstream_connected.with_label_values(&l),
            rejoins: self.publisher_rejoins.with_label_values(&l),
            duplicates: self.duplicates_dropped.with_label_values(&l),
            repeated: self.repeated_frames.with_label_values(&l),
            replayed: self.replayed_batches.with_label_values(&l),
            rank_mismatch: self.rank_mismatch.with_label_values(&l),
            last_seq: self.last_upstream_seq.with_label_values(&l),
            frames_dropped: self.frames_dropped.clone(),
            replays: self.replays.clone(),
            clears: self.synthesized_clears.clone(),
            decoder: self.decoder.clone(),
            exact: self.rank_exact.with_label_values(&l),
            degraded: self.rank_degraded.clone(),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Per-rank handles (resolved once).
#[derive(Clone)]
pub struct RankMetrics {
    /// Rank label.
    pub label: String,
    /// Batches received.
    pub batches: IntCounter,
    /// Gaps.
    pub gaps: IntCounter,
    /// Restarts.
    pub restarts: IntCounter,
    /// Publisher connections established.
    pub connects: IntCounter,
    /// Publisher disconnects.
    pub disconnects: IntCounter,
    /// Publisher connections up.
    pub connected: IntGauge,
    /// Publisher connections re-established after libzmq gave them up.
    pub rejoins: IntCounter,
    /// Duplicates dropped.
    pub duplicates: IntCounter,
    /// Live frames repeating the last applied seq (dropped).
    pub repeated: IntCounter,
    /// Batches recovered by replay.
    pub replayed: IntCounter,
    /// Rank element differs from the socket's rank.
    pub rank_mismatch: IntCounter,
    /// Last engine seq.
    pub last_seq: IntGauge,
    decode_errors: IntCounterVec,
    frames_dropped: IntCounterVec,
    replays: IntCounterVec,
    clears: IntCounterVec,
    decoder: IntCounterVec,
    exact: IntGauge,
    degraded: IntGaugeVec,
}

impl RankMetrics {
    /// Counts a message dropped before decoding.
    pub fn frame_dropped(&self, reason: &str) {
        self.frames_dropped
            .with_label_values(&[self.label.as_str(), reason])
            .inc();
    }
    /// Counts an undecodable batch by error kind.
    pub fn decode_error(&self, kind: &str) {
        self.decode_errors
            .with_label_values(&[self.label.as_str(), kind])
            .inc();
    }
    /// Counts a replay outcome (`requested`, `succeeded`, `history_missing`, `timed_out`, …).
    pub fn replay(&self, outcome: &str) {
        self.replays
            .with_label_values(&[self.label.as_str(), outcome])
            .inc();
    }
    /// Creates the synthesized-clear series for `cause` (at 0) without counting one.
    pub fn clear_series(&self, cause: &str) {
        self.clears.with_label_values(&[self.label.as_str(), cause]);
    }
    /// Creates the series of every dropped-frame reason, replay outcome and decode-error kind
    /// given (at 0), so that rates and `increase()` are defined before the first one.
    pub fn input_series(&self, drops: &[&str], replays: &[&str], decode_errors: &[&str]) {
        let r = self.label.as_str();
        for d in drops {
            self.frames_dropped.with_label_values(&[r, d]);
        }
        for o in replays {
            self.replays.with_label_values(&[r, o]);
        }
        for k in decode_errors {
            self.decode_errors.with_label_values(&[r, k]);
        }
    }
    /// Counts a synthesized clear.
    pub fn clear(&self, cause: &str) {
        self.clears
            .with_label_values(&[self.label.as_str(), cause])
            .inc();
    }
    /// Sets the freshness series: `exact` 1 and every cause of `causes` 0, or `exact` 0 and
    /// only `current` 1. Every label value exists from the first call on.
    pub fn set_freshness(&self, causes: &[&str], current: Option<&str>) {
        self.exact.set(current.is_none() as i64);
        for c in causes {
            self.degraded
                .with_label_values(&[self.label.as_str(), c])
                .set((Some(*c) == current) as i64);
        }
    }
    /// Brings a decoder counter up to `value` (the decoder's own running total).
    pub fn decoder_set(&self, kind: &str, value: u64) {
        let c = self.decoder.with_label_values(&[self.label.as_str(), kind]);
        let cur = c.get();
        if value > cur {
            c.inc_by(value - cur);
        }
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

// ---- Sidecar mode ----

/// Metrics of sidecar mode: calls forwarded to the engine's gRPC server. Registered in every
/// mode (all zero without `--engine-grpc`), so dashboards need no second variant.
pub struct ProxyMetrics {
    /// Forwarded calls, by method (`/package.Service/Method`, or `other`) and final gRPC status
    /// (`cancelled` also for a client that went away).
    pub calls: IntCounterVec,
    /// HTTP/2 connections to the engine currently open.
    pub connections: IntGauge,
    /// Connection attempts to the engine, by outcome (`ok`, `failed`).
    pub connects: IntCounterVec,
    /// 1 while the engine's gRPC server answers kvbridge's probe, else 0.
    pub engine_up: IntGauge,
    /// The engine's `SETTINGS_MAX_CONCURRENT_STREAMS` on kvbridge's connections (0: the engine
    /// sets no limit, or no connection has seen its settings yet).
    pub engine_max_streams: IntGauge,
    /// Time kvbridge adds before a call reaches the engine's connection: routing, header
    /// rewrite, picking (or opening) a pooled connection. Seconds.
    pub overhead: Histogram,
    /// From a forwarded request's arrival to the engine's response headers. Seconds.
    pub headers_latency: Histogram,
    /// `GetLoads` polls, by outcome (`ok`, `failed`, `undecodable`).
    pub load_polls: IntCounterVec,
    /// Bytes of the sidecar's buffer budget (`--sidecar-buffer`) taken by client connections'
    /// windows and forwarded streams' shares.
    pub buffer_reserved: IntGauge,
    /// Forwarded streams that waited for a share of the buffer budget (`waited`), and streams
    /// reset because their client took nothing while others waited (`stall_reset`).
    pub buffer_events: IntCounterVec,
}

impl ProxyMetrics {
    fn new(r: &Registry) -> Self {
        let histogram = |name: &str, help: &str, start: f64| {
            let h = Histogram::with_opts(
                HistogramOpts::new(name, help)
                    .buckets(prometheus::exponential_buckets(start, 2.5, 14).expect("buckets")),
            )
            .expect("histogram");
            r.register(Box::new(h.clone())).expect("unique metric");
            h
        };
        let int_gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric");
            r.register(Box::new(g.clone())).expect("unique metric");
            g
        };
        ProxyMetrics {
            calls: counter(
                r,
                "proxy_calls_total",
                "Calls forwarded to the engine, by method and final gRPC status",
                &["method", "code"],
            ),
            connections: int_gauge(
                "proxy_upstream_connections",
                "HTTP/2 connections to the engine open",
            ),
            connects: counter(
                r,
                "proxy_upstream_connects_total",
                "Connection attempts to the engine, by outcome",
                &["outcome"],
            ),
            engine_up: int_gauge(
                "proxy_engine_up",
                "1 while the engine's gRPC server answers kvbridge's probe",
            ),
            engine_max_streams: int_gauge(
                "proxy_engine_max_concurrent_streams",
                "The engine's HTTP/2 MAX_CONCURRENT_STREAMS (0: no limit, or not seen yet)",
            ),
            overhead: histogram(
                "proxy_added_latency_seconds",
                "Time kvbridge adds before a forwarded call reaches the engine connection",
                1e-6,
            ),
            headers_latency: histogram(
                "proxy_response_headers_seconds",
                "Forwarded request arrival to the engine's response headers",
                1e-5,
            ),
            load_polls: counter(
                r,
                "proxy_load_polls_total",
                "GetLoads polls of the engine, by outcome",
                &["outcome"],
            ),
            buffer_reserved: int_gauge(
                "proxy_buffer_reserved_bytes",
                "Sidecar buffer budget taken by client connection windows and forwarded streams",
            ),
            buffer_events: counter(
                r,
                "proxy_buffer_events_total",
                "Forwarded streams that waited for buffer budget (waited) or were reset for taking nothing while others waited (stall_reset)",
                &["event"],
            ),
        }
    }
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
