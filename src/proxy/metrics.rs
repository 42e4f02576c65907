//! Sidecar mode's series: calls forwarded to the engine's gRPC server, its connections and the
//! buffer budget. Registered in every mode (all zero without `--engine-grpc`), so that
//! dashboards need no second variant.

use prometheus::{Histogram, IntCounterVec, IntGauge};

use crate::metrics::Metrics;

/// Metrics of sidecar mode: calls forwarded to the engine's gRPC server. Registered in every
/// mode (all zero without `--engine-grpc`), so dashboards need no second variant.
pub struct ProxyMetrics {
    /// Forwarded calls, by method (`/package.Service/Method` of the engine services, each at 0
    /// from the start, or `other`) and final gRPC status (`cancelled` also for a client that went
    /// away).
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
    /// Registers sidecar mode's series on `m`'s registry.
    pub fn new(m: &Metrics) -> Self {
        let histogram = |name: &str, help: &str, start: f64| {
            let buckets = prometheus::exponential_buckets(start, 2.5, 14).expect("buckets");
            m.histogram(name, help, buckets)
        };
        let int_gauge = |name: &str, help: &str| m.gauge(name, help);
        let calls = m.counter_vec(
            "proxy_calls_total",
            "Calls forwarded to the engine, by method (the engine services' methods, or other) and final gRPC status",
            &["method", "code"],
        );
        // Every method's series at 0 from the start (with the code of a call that succeeded),
        // so that a rate over them is defined before the first call.
        for method in crate::proto::forwarded_methods().chain(["other".to_string()]) {
            calls.with_label_values(&[method.as_str(), "ok"]);
        }
        ProxyMetrics {
            calls,
            connections: int_gauge(
                "proxy_upstream_connections",
                "HTTP/2 connections to the engine open",
            ),
            connects: m.counter_vec(
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
            load_polls: m.counter_vec(
                "proxy_load_polls_total",
                "GetLoads polls of the engine, by outcome",
                &["outcome"],
            ),
            buffer_reserved: int_gauge(
                "proxy_buffer_reserved_bytes",
                "Sidecar buffer budget taken by client connection windows and forwarded streams",
            ),
            buffer_events: m.counter_vec(
                "proxy_buffer_events_total",
                "Forwarded streams that waited for buffer budget (waited) or were reset for taking nothing while others waited (stall_reset)",
                &["event"],
            ),
        }
    }
}

#[cfg(test)]
impl ProxyMetrics {
    /// Sidecar mode's series on a registry of their own.
    pub(crate) fn for_tests() -> Self {
        ProxyMetrics::new(&Metrics::new())
    }
}
