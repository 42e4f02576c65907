//! The NATS JetStream sink: every ring record, published to a replicated stream, exactly once
//! and in order.
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
//! NATS is optional at run time: unless `--nats-required`, [`Sink::start`] returns at once and a
//! background task connects, creates or checks the stream and starts the publishers, retrying
//! with a capped backoff and logging once per change of state. A configuration error the server
//! reports (the stream exists with other settings, permission denied) is an ERROR and
//! `kvbridge_nats_config_errors_total`, never an exit.
//!
//! Exactly once, in order. Records go out in atomic batches (nats-server ≥ 2.12, stream
//! `allow_atomic`), one batch at a time, each stored only if the subject's last message in the
//! stream is the one the batch follows (`Nats-Expected-Last-Subject-Sequence` on its first
//! message); after any failure the publisher reads the subject's last message (its
//! `Kvbridge-Seq` and `Kvbridge-Ring-Id` headers) and goes on from the next record. The stream
//! therefore holds each subject's records in sequence order with no gap and no duplicate across
//! leader changes, node kills, NATS restarts and kvbridge restarts. Why this and not the other
//! JetStream options: the module documentation of `src/sink/publisher.rs`. `Nats-Msg-Id: <ring id>:<sequence>` stays on
//! every message.
//!
//! Wire contract for consumers (docs/nats-sink.md): subject `<prefix>.<worker>.<merged|N>`,
//! payload a `KvEventBatch`, headers `Kvbridge-Seq`, `Kvbridge-Ring-Id` (16 hex digits),
//! `Kvbridge-Dp-Rank` (the engine rank the record came from), `Kvbridge-Cleared` (only on a
//! synthesized clear: why) and `Nats-Msg-Id` (plus JetStream's own `Nats-Batch-*` ones).

mod config;
mod metrics;
mod publisher;

pub use config::{
    is_subject_token, NatsConfig, DEFAULT_NATS_MAX_AGE, DEFAULT_NATS_REPLICAS, DEFAULT_NATS_STREAM,
    DEFAULT_NATS_SUBJECT_PREFIX,
};

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use thiserror::Error;

use crate::metrics::Metrics;
use crate::ring::{RingHub, RingSet};
pub(crate) use metrics::SinkMetrics;

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
/// Most messages in flight of the bench's bare pipelined publisher (the floor the sink is
/// measured against; the sink itself has one atomic batch in flight).
pub const MAX_IN_FLIGHT: usize = 256;
/// Records per atomic batch at most: nats-server's default limit (`max_batch_size`, 1000).
pub const MAX_BATCH: usize = 1000;
/// How long a batch's commit waits for its acknowledgement before the publisher re-reads the
/// stream.
pub const ACK_TIMEOUT: Duration = Duration::from_secs(3);
/// JetStream's duplicate window for the stream the sink creates.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// A sink set-up failure: one line. With `--nats-required`, `serve` exits with 2 on it;
/// otherwise the sink logs it (ERROR when [`SinkError::is_config`]) and retries.
#[derive(Debug, Error)]
pub enum SinkError {
    /// No NATS server could be reached, or the credentials or TLS settings were refused.
    #[error("--nats {urls}: cannot connect: {why}")]
    Connect {
        /// The URLs given.
        urls: String,
        /// Cause.
        why: String,
        /// The server refused the credentials or TLS settings (not a passing failure).
        refused: bool,
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
        /// JetStream answered with an error (as opposed to not answering in time).
        refused: bool,
    },
}

impl SinkError {
    /// A configuration problem the server reported (as opposed to NATS being unreachable or
    /// slow): worth an ERROR, and retrying will not help until someone changes something.
    pub fn is_config(&self) -> bool {
        match self {
            SinkError::Mismatch { .. } => true,
            SinkError::Connect { refused, .. } | SinkError::Stream { refused, .. } => *refused,
        }
    }
}

/// The running sink: a task that connects (unless already connected) and runs one publisher
/// per ring.
pub struct Sink {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
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
    connect_with(cfg, name, None).await
}

/// [`connect`]; with `metrics`, the connection's ups and downs set the connected gauge and are
/// logged (once per change), and errors the server reports are counted as configuration errors.
async fn connect_with(
    cfg: &NatsConfig,
    name: &str,
    metrics: Option<SinkMetrics>,
) -> Result<async_nats::Client, SinkError> {
    let urls = cfg.urls.join(",");
    let err = |why: String, refused: bool| SinkError::Connect {
        urls: urls.clone(),
        why,
        refused,
    };
    let mut opts = match &cfg.creds {
        Some(f) => async_nats::ConnectOptions::with_credentials_file(f.clone())
            .await
            .map_err(|e| err(format!("--nats-creds {}: {e}", f.display()), true))?,
        None => async_nats::ConnectOptions::new(),
    };
    if let Some(ca) = &cfg.tls_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some(m) = metrics {
        opts = opts.event_callback(move |ev| {
            let m = m.clone();
            async move {
                match ev {
                    async_nats::Event::Connected => {
                        m.connected.set(1);
                        tracing::info!("NATS connected");
                    }
                    async_nats::Event::Disconnected => {
                        m.connected.set(0);
                        tracing::warn!("NATS connection lost; reconnecting in the background (records wait in the ring)");
                    }
                    async_nats::Event::ServerError(e) => {
                        m.config_errors.inc();
                        tracing::error!(error = %e, "the NATS server refused a request of the sink (permissions?)");
                    }
                    _ => {}
                }
            }
        });
    }
    let addrs: Vec<async_nats::ServerAddr> = cfg
        .urls
        .iter()
        .map(|u| u.parse().map_err(|e| err(format!("{u:?}: {e}"), true)))
        .collect::<Result<_, _>>()?;
    let opts = opts
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        // Keep a publisher's writes from sitting in a buffer of the client for long.
        .client_capacity(4096);
    tokio::time::timeout(Duration::from_secs(15), opts.connect(addrs.as_slice()))
        .await
        .map_err(|_| err("no server answered within 15 s".into(), false))?
        .map_err(|e| {
            let refused = matches!(
                e.kind(),
                async_nats::ConnectErrorKind::Authentication
                    | async_nats::ConnectErrorKind::AuthorizationViolation
                    | async_nats::ConnectErrorKind::Tls
            );
            err(e.to_string(), refused)
        })
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
        // The publisher's atomic batches (see the module documentation).
        allow_atomic_publish: true,
        ..Default::default()
    }
}

/// Creates the stream, or checks that the existing one has the replicas, retention and subjects
/// asked for (a mismatch is an error naming what differs). An existing stream without atomic
/// batch publish gets it turned on (the one setting the sink changes).
pub async fn ensure_stream(
    js: &jetstream::Context,
    cfg: &NatsConfig,
) -> Result<stream::Stream, SinkError> {
    let want = stream_config(cfg);
    let serr = |why: String, refused: bool| SinkError::Stream {
        stream: cfg.stream.clone(),
        why,
        refused,
    };
    let get_err = |e: jetstream::context::GetStreamError| {
        let refused = matches!(
            e.kind(),
            jetstream::context::GetStreamErrorKind::JetStream(_)
        );
        serr(e.to_string(), refused)
    };
    let mut s = match js.get_stream(&cfg.stream).await {
        Ok(s) => s,
        Err(e)
            if matches!(
                e.kind(),
                jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
            ) =>
        {
            match js.create_stream(want.clone()).await {
                Ok(mut s) => {
                    tracing::info!(stream = %cfg.stream, replicas = cfg.replicas,
                        max_age = ?cfg.max_age, "created the JetStream stream");
                    let info = s.info().await.map_err(|e| serr(e.to_string(), false))?;
                    if !info.config.allow_atomic_publish {
                        return Err(no_atomic(cfg));
                    }
                    return Ok(s);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        jetstream::context::CreateStreamErrorKind::TimedOut
                            | jetstream::context::CreateStreamErrorKind::JetStreamUnavailable
                    ) =>
                {
                    return Err(serr(e.to_string(), false))
                }
                // Another bridge created it meanwhile: check that one.
                Err(_) => js.get_stream(&cfg.stream).await.map_err(get_err)?,
            }
        }
        Err(e) => return Err(get_err(e)),
    };
    let have = s
        .info()
        .await
        .map_err(|e| serr(e.to_string(), false))?
        .config
        .clone();
    check_matches(cfg, &have, &want)?;
    if !have.allow_atomic_publish {
        let mut c = have.clone();
        c.allow_atomic_publish = true;
        let info = js.update_stream(c).await.map_err(|e| {
            let refused = matches!(
                e.kind(),
                jetstream::context::CreateStreamErrorKind::JetStream(_)
            );
            serr(format!("turning on atomic batch publish: {e}"), refused)
        })?;
        if !info.config.allow_atomic_publish {
            return Err(no_atomic(cfg));
        }
        tracing::info!(stream = %cfg.stream, "turned on atomic batch publish (allow_atomic) on the existing stream");
        s = js.get_stream(&cfg.stream).await.map_err(get_err)?;
    }
    Ok(s)
}

/// Checks that the existing stream's config `have` has the replicas, max age, retention and
/// subjects of `want` (what `cfg` asks for); a mismatch is an error naming what differs.
fn check_matches(
    cfg: &NatsConfig,
    have: &stream::Config,
    want: &stream::Config,
) -> Result<(), SinkError> {
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
    Ok(())
}

/// The server kept no `allow_atomic`: it predates atomic batches.
fn no_atomic(cfg: &NatsConfig) -> SinkError {
    SinkError::Mismatch {
        stream: cfg.stream.clone(),
        what: "no atomic batch publish (allow_atomic): the sink needs nats-server 2.12 or later"
            .into(),
    }
}

/// What a publisher task needs, once NATS answered.
struct Ready {
    client: async_nats::Client,
    stream: stream::Stream,
}

/// Connects and creates or checks the stream, once.
async fn set_up(cfg: &NatsConfig, worker: &str, sm: &SinkMetrics) -> Result<Ready, SinkError> {
    let client = connect_with(cfg, &format!("kvbridge {worker}"), Some(sm.clone())).await?;
    sm.connected.set(1);
    let mut js = jetstream::new(client.clone());
    js.set_timeout(ACK_TIMEOUT);
    let stream = ensure_stream(&js, cfg).await?;
    Ok(Ready { client, stream })
}

impl Sink {
    /// Starts the sink on `rings`; each ring's subject ends in its [`RingSet::named`] token
    /// (`merged`, or the rank number). The service sets `cfg.worker_id` when the flag is not
    /// given ([`default_worker_id`] of the bound gRPC port). With `cfg.required` it first
    /// connects and creates or checks the stream, and returns the error if that fails; otherwise it returns at once and all of that happens in
    /// the background, retried with a capped backoff, logged once per change of state.
    pub async fn start(
        cfg: &NatsConfig,
        rings: &RingSet,
        metrics: &Metrics,
    ) -> Result<Sink, SinkError> {
        let rings = rings.named();
        let worker = cfg
            .worker_id
            .clone()
            .unwrap_or_else(|| default_worker_id(0));
        let sm = SinkMetrics::new(metrics);
        sm.connected.set(0);
        let ready = if cfg.required {
            Some(set_up(cfg, &worker, &sm).await?)
        } else {
            None
        };
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(run(cfg.clone(), worker, rings, sm, ready, stop_rx));
        Ok(Sink { task, stop })
    }

    /// Stops publishing: each publisher waits (briefly) for the batch it has in flight.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(ACK_TIMEOUT + Duration::from_secs(2), &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("the NATS sink did not stop in time");
            self.task.abort();
        }
    }
}

/// The sink's task: set-up (unless done), then the publishers until stopped.
async fn run(
    cfg: NatsConfig,
    worker: String,
    rings: Vec<(String, Arc<RingHub>)>,
    sm: SinkMetrics,
    ready: Option<Ready>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    // Every subject's series at 0 while NATS may still be unreachable: the dashboard then shows
    // the sink is there and has published nothing, and `increase()` sees the first failure.
    for (tail, _) in &rings {
        sm.series_at_zero(&format!("{}.{worker}.{tail}", cfg.subject_prefix));
    }
    let ready = match ready {
        Some(r) => r,
        None => {
            let mut backoff = Duration::from_millis(200);
            let mut last: Option<String> = None;
            loop {
                let attempt = tokio::select! {
                    r = set_up(&cfg, &worker, &sm) => r,
                    _ = stop.changed() => return,
                };
                match attempt {
                    Ok(r) => break r,
                    Err(e) => {
                        // One line per distinct failure, not per retry.
                        let line = e.to_string();
                        if e.is_config() {
                            sm.config_errors.inc();
                        }
                        if last.as_deref() != Some(line.as_str()) {
                            if e.is_config() {
                                tracing::error!(error = %line, "NATS sink not started (kvbridge serves without it); retrying in the background");
                            } else {
                                tracing::warn!(error = %line, "NATS sink not started (kvbridge serves without it); retrying in the background");
                            }
                            last = Some(line);
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stop.changed() => return,
                }
                backoff = (backoff * 2).min(SETUP_BACKOFF_CAP);
            }
        }
    };
    let mut tasks = Vec::new();
    for (tail, hub) in rings {
        let subject = format!("{}.{worker}.{tail}", cfg.subject_prefix);
        tracing::info!(%subject, stream = %cfg.stream, ring = hub.label(), "publishing the ring to NATS JetStream");
        let p = publisher::Publisher::new(
            ready.client.clone(),
            ready.stream.clone(),
            hub,
            subject,
            sm.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(p.run()));
    }
    for t in tasks {
        let _ = t.await;
    }
    let _ = ready.client.flush().await;
}

/// Longest wait between two set-up attempts while NATS is unreachable or refuses.
const SETUP_BACKOFF_CAP: Duration = Duration::from_secs(5);
