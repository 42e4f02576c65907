//! The NATS JetStream sink: every ring record, published to a replicated stream, exactly once.
//!
//! Like a gRPC subscriber, the sink is a reader of the ring and nothing else: one publisher task
//! per ring (the merged ring, and each rank's ring in `metadata` mode) walks it with its own
//! [`kvbridge_shm::RingReader`] and publishes each record, as the very `KvEventBatch` bytes
//! subscribers get, to `<prefix>.<worker-id>.<merged|rank>`. It never reaches back into ingest,
//! and nothing waits for it: when NATS is slow or down, the sink falls behind in the ring (its
//! lag is a metric) and catches up later, or, if the ring overwrote what it had not published
//! yet, publishes an in-band `cleared` in its place (counted), as the ingest side does for an
//! unfillable gap.
//!
//! Exactly once. Each message carries `Nats-Msg-Id: <ring id>:<sequence>`, so JetStream drops a
//! re-publication inside the stream's duplicate window, and the publisher resumes from what the
//! stream holds: at start (and after any failed acknowledgement) it asks JetStream for the last
//! message on its subject, reads its `Kvbridge-Seq` and `Kvbridge-Ring-Id` headers, and publishes
//! from the next sequence. Acknowledgements are awaited in order with a bounded number in flight
//! ([`MAX_IN_FLIGHT`]); the first failure stops the pipeline and publication restarts at the first
//! record not acknowledged (what the stream already has of the rest is de-duplicated).
//!
//! Wire contract for consumers (README, "NATS JetStream sink"): subject
//! `<prefix>.<worker>.<merged|N>`, payload a `KvEventBatch`, headers `Kvbridge-Seq`,
//! `Kvbridge-Ring-Id` (16 hex digits), `Kvbridge-Dp-Rank` (the engine rank the record came from),
//! `Kvbridge-Cleared` (only on a synthesized clear: why) and `Nats-Msg-Id`.

mod publisher;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts};
use thiserror::Error;

use crate::config::NatsConfig;
use crate::metrics::Metrics;
use crate::ring::RingHub;

/// Header: the record's kvbridge sequence number (`KvEventBatch.sequence_number`).
pub const HEADER_SEQ: &str = "Kvbridge-Seq";
/// Header: the ring's id (16 hex digits); a new id means a new ring, whose numbering restarted.
pub const HEADER_RING_ID: &str = "Kvbridge-Ring-Id";
/// Header: the engine DP rank the record came from.
pub const HEADER_DP_RANK: &str = "Kvbridge-Dp-Rank";
/// Header, only on a batch the sink synthesized: why (`ring_lapped`, `ring_replaced`, `corrupt`).
pub const HEADER_CLEARED: &str = "Kvbridge-Cleared";
/// Header: JetStream's de-duplication id, `<ring id>:<sequence>`.
pub const HEADER_MSG_ID: &str = "Nats-Msg-Id";
/// Most records published and not yet acknowledged, per ring.
pub const MAX_IN_FLIGHT: usize = 256;
/// How long a publication waits for its acknowledgement before the pipeline restarts.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(3);
/// JetStream's duplicate window for the stream the sink creates.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// A sink set-up failure (reported as one line; `serve` exits with 2).
#[derive(Debug, Error)]
pub enum SinkError {
    /// No NATS server could be reached, or the credentials or TLS settings were refused.
    #[error("--nats {urls}: cannot connect: {why}")]
    Connect {
        /// The URLs given.
        urls: String,
        /// Cause.
        why: String,
    },
    /// The stream exists with settings other than the ones asked for.
    #[error(
        "--nats-stream {stream}: the existing stream has {what}; change the flag or the stream"
    )]
    Mismatch {
        /// Stream name.
        stream: String,
        /// What differs.
        what: String,
    },
    /// Creating or reading the stream failed.
    #[error("--nats-stream {stream}: {why}")]
    Stream {
        /// Stream name.
        stream: String,
        /// Cause.
        why: String,
    },
}

/// The sink's metrics, registered in the process registry.
#[derive(Clone)]
pub(crate) struct SinkMetrics {
    published: IntCounterVec,
    cleared: IntCounterVec,
    failures: IntCounterVec,
    lag: IntGaugeVec,
    acked_seq: IntGaugeVec,
    latency: HistogramVec,
}

impl SinkMetrics {
    fn new(m: &Metrics) -> Self {
        let r = &m.registry;
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
            // One sink per process registers; registering twice is refused and harmless.
            let _ = r.register(Box::new(c.clone()));
            c
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGaugeVec::new(Opts::new(name, help), &["subject"]).expect("valid metric");
            let _ = r.register(Box::new(g.clone()));
            g
        };
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "nats_publish_lag_seconds",
                "Commit in the ring to JetStream acknowledgement, per published record",
            )
            .buckets(prometheus::exponential_buckets(5e-5, 1.25, 56).expect("buckets")),
            &["subject"],
        )
        .expect("histogram");
        let _ = r.register(Box::new(latency.clone()));
        SinkMetrics {
            published: counter(
                "nats_published_total",
                "Ring records acknowledged by JetStream",
                &["subject"],
            ),
            cleared: counter(
                "nats_cleared_total",
                "In-band cleared batches the sink published for records the ring no longer had",
                &["subject", "cause"],
            ),
            failures: counter(
                "nats_publish_failures_total",
                "Publications that failed or timed out (the pipeline restarted at the first unacknowledged record)",
                &["subject"],
            ),
            lag: gauge(
                "nats_lag_records",
                "Newest ring sequence minus the last one JetStream acknowledged",
            ),
            acked_seq: gauge(
                "nats_acked_sequence",
                "Last ring sequence JetStream acknowledged",
            ),
            latency,
        }
    }
}

/// The running sink: one publisher task per ring.
pub struct Sink {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    stop: tokio::sync::watch::Sender<bool>,
    client: async_nats::Client,
}

/// Default worker id: `<hostname>-<grpc port>`, reduced to subject-token characters.
pub fn default_worker_id(grpc_port: u16) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string();
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let host = if host.is_empty() {
        "kvbridge".into()
    } else {
        host
    };
    format!("{host}-{grpc_port}")
}

/// Connects to NATS with the configured URLs, credentials and TLS. The client reconnects by
/// itself for ever after the first connection.
pub async fn connect(cfg: &NatsConfig, name: &str) -> Result<async_nats::Client, SinkError> {
    let urls = cfg.urls.join(",");
    let err = |why: String| SinkError::Connect {
        urls: urls.clone(),
        why,
    };
    let mut opts = match &cfg.creds {
        Some(f) => async_nats::ConnectOptions::with_credentials_file(f.clone())
            .await
            .map_err(|e| err(format!("--nats-creds {}: {e}", f.display())))?,
        None => async_nats::ConnectOptions::new(),
    };
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    let addrs: Vec<async_nats::ServerAddr> = cfg
        .urls
        .iter()
        .map(|u| u.parse().map_err(|e| err(format!("{u:?}: {e}"))))
        .collect::<Result<_, _>>()?;
    let opts = opts
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        // Keep a publisher's writes from sitting in a buffer of the client for long.
        .client_capacity(4096);
    tokio::time::timeout(Duration::from_secs(15), opts.connect(addrs.as_slice()))
        .await
        .map_err(|_| err("no server answered within 15 s".into()))?
        .map_err(|e| err(e.to_string()))
}

/// The stream configuration the sink asks for.
pub fn stream_config(cfg: &NatsConfig) -> stream::Config {
    stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![format!("{}.>", cfg.subject_prefix)],
        retention: stream::RetentionPolicy::Limits,
        max_age: cfg.max_age,
        num_replicas: cfg.replicas,
        storage: stream::StorageType::File,
        duplicate_window: DUPLICATE_WINDOW,
        discard: stream::DiscardPolicy::Old,
        allow_direct: true,
        ..Default::default()
    }
}

/// Creates the stream, or checks that the existing one has the replicas, retention and subjects
/// asked for (a mismatch is an error naming what differs).
pub async fn ensure_stream(
    js: &jetstream::Context,
    cfg: &NatsConfig,
) -> Result<stream::Stream, SinkError> {
    let want = stream_config(cfg);
    let serr = |why: String| SinkError::Stream {
        stream: cfg.stream.clone(),
        why,
    };
    let mut s = match js.get_stream(&cfg.stream).await {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(_)
            ) =>
        {
            match js.create_stream(want.clone()).await {
                Ok(s) => {
                    tracing::info!(stream = %cfg.stream, replicas = cfg.replicas,
                        max_age = ?cfg.max_age, "created the JetStream stream");
                    return Ok(s);
                }
                // Another bridge created it meanwhile: check that one.
                Err(_) => js
                    .get_stream(&cfg.stream)
                    .await
                    .map_err(|e| serr(e.to_string()))?,
            }
        }
        Err(e) => return Err(serr(e.to_string())),
    };
    let have = s
        .info()
        .await
        .map_err(|e| serr(e.to_string()))?
        .config
        .clone();
    let subject = format!("{}.>", cfg.subject_prefix);
    let mismatch = |what: String| SinkError::Mismatch {
        stream: cfg.stream.clone(),
        what,
    };
    if have.num_replicas != want.num_replicas {
        return Err(mismatch(format!(
            "{} replicas, not {} (--nats-replicas)",
            have.num_replicas, want.num_replicas
        )));
    }
    if have.max_age != want.max_age {
        return Err(mismatch(format!(
            "max age {:?}, not {:?} (--nats-max-age)",
            have.max_age, want.max_age
        )));
    }
    if have.retention != stream::RetentionPolicy::Limits {
        return Err(mismatch(format!(
            "retention {:?}, not limits (a work-queue or interest stream would lose events other consumers need)",
            have.retention
        )));
    }
    if !have.subjects.iter().any(|s| *s == subject || s == ">") {
        return Err(mismatch(format!(
            "subjects {:?}, which do not include {subject} (--nats-subject-prefix)",
            have.subjects
        )));
    }
    Ok(s)
}

impl Sink {
    /// Connects, creates or checks the stream, and starts one publisher per ring. `rings` pairs
    /// each ring with its subject's last token (`merged`, or the rank number).
    pub async fn start(
        cfg: &NatsConfig,
        grpc_port: u16,
        rings: Vec<(String, Arc<RingHub>)>,
        metrics: &Metrics,
    ) -> Result<Sink, SinkError> {
        let worker = cfg
            .worker_id
            .clone()
            .unwrap_or_else(|| default_worker_id(grpc_port));
        let client = connect(cfg, &format!("kvbridge {worker}")).await?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(ACK_TIMEOUT);
        let stream = ensure_stream(&js, cfg).await?;
        let sm = SinkMetrics::new(metrics);
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = Vec::new();
        for (tail, hub) in rings {
            let subject = format!("{}.{worker}.{tail}", cfg.subject_prefix);
            tracing::info!(%subject, stream = %cfg.stream, ring = hub.label(), "publishing the ring to NATS JetStream");
            let p = publisher::Publisher::new(
                js.clone(),
                stream.clone(),
                hub,
                subject,
                sm.clone(),
                stop_rx.clone(),
            );
            tasks.push(tokio::spawn(p.run()));
        }
        Ok(Sink {
            tasks,
            stop,
            client,
        })
    }

    /// Stops publishing: each publisher waits (briefly) for its acknowledgements in flight.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for mut t in self.tasks {
            if tokio::time::timeout(ACK_TIMEOUT + Duration::from_secs(1), &mut t)
                .await
                .is_err()
            {
                tracing::warn!("a NATS publisher did not stop in time");
                t.abort();
            }
        }
        let _ = self.client.flush().await;
    }
}
