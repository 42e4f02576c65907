//! The running service: one value built from validated settings ([`ServeConfig`]), started as a
//! list and stopped in reverse on one signal.
//!
//! [`App::build`] binds the listeners (an occupied port fails before a ring is touched);
//! [`App::spawn`] starts the parts in data-flow order, upstream last-but-one and the front door
//! last, so that everything a part reads is running before it:
//!
//! | # | part | owner | stops by |
//! |---|---|---|---|
//! | 1 | rings and their heartbeat | `crate::ring` ([`RingSet`]) | heartbeat thread joined; the rings close when the last reader drops them |
//! | 2 | metrics page (`--metrics`) | `crate::metrics` | task aborted |
//! | 3 | NATS sink (`--nats`) | `crate::sink` | waits for the batch in flight |
//! | 4 | snapshot tables and checkpoints | `crate::snapshot` | writes a last checkpoint |
//! | 5 | engine-wire publisher (`--publish-zmq`) | `crate::publish_zmq` | threads joined |
//! | 6 | ingest (one thread per DP rank) | `crate::ingest` | threads joined |
//! | 7 | gRPC front door: fan-out, health, sidecar | `crate::fanout`, `crate::proxy` | NOT_SERVING, streams end `UNAVAILABLE`, 5 s drain |
//!
//! Each part is pushed on a stack the moment it runs (`parts.rs`), so [`Service::shutdown`] —
//! and a part failing to start — stops exactly what runs, newest first: the front door first
//! (no new subscribers), ingest before the edges that read what it wrote (the sink publishes,
//! and the last checkpoint holds, everything ingested), the rings' heartbeat last. A start that
//! fails also removes the rings it created ([`RingSet::remove_created`]): nothing is left on
//! tmpfs.
//!
//! **Adding an edge.** An edge reads the rings and never reaches back. Copy any one of
//! `src/sink/`, `src/publish_zmq/`, `src/snapshot/`: `config.rs` holds its settings (parsed from
//! flags by `crate::config`), `metrics.rs` its series (registered at start, every label value
//! known in advance at 0), and `mod.rs` a `start(settings, &RingSet, &Metrics)` returning a
//! handle with one `shutdown`. Then add one step to [`App::spawn`] at its place in the order
//! above — the one place a new edge is added.

mod front_door;
mod parts;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvbridge_shm::WriterOptions;
use thiserror::Error;
use tokio::sync::watch;

use crate::config::ServeConfig;
use crate::decode::DecodeConfig;
use crate::fanout::{DpMode, Fanout, FanoutMetrics};
use crate::health::{HealthMetrics, UpstreamState};
use crate::ingest::{Ingest, IngestError, IngestMetrics, Targets};
use crate::metrics::Metrics;
use crate::proxy::{ProxyError, ProxyMetrics};
use crate::publish_zmq::{PublishZmqError, ZmqPublisher};
use crate::ring::{RingError, RingHub, RingMetrics, RingSet};
use crate::sink::{Sink, SinkError};
use front_door::FrontDoor;
use parts::Parts;

/// Why the service could not start: one line naming the flag or part at fault.
#[derive(Debug, Error)]
pub enum SetupError {
    /// A listener could not be bound.
    #[error("{flag} {addr}: cannot listen: {source}")]
    Listen {
        /// The flag that set the address.
        flag: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// A ring could not be opened or created.
    #[error("--shm: {0}")]
    Ring(#[from] RingError),
    /// The NATS sink could not be set up (`--nats-required`).
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// The engine-wire publisher could not bind.
    #[error(transparent)]
    PublishZmq(#[from] PublishZmqError),
    /// Ingest could not open an engine endpoint.
    #[error(transparent)]
    Ingest(#[from] IngestError),
    /// Sidecar mode could not start (`--engine-grpc`).
    #[error(transparent)]
    Proxy(#[from] ProxyError),
    /// The TLS certificate or key is unusable.
    #[error("--tls-cert/--tls-key: {0}")]
    Tls(String),
}

/// The service, its listeners bound, nothing started yet.
pub struct App<'a> {
    cfg: &'a ServeConfig,
    grpc: tokio::net::TcpListener,
    grpc_addr: SocketAddr,
    metrics_page: Option<(tokio::net::TcpListener, SocketAddr)>,
}

impl<'a> App<'a> {
    /// Binds `--grpc` and `--metrics`.
    pub async fn build(cfg: &'a ServeConfig) -> Result<App<'a>, SetupError> {
        let listen = |flag, addr| move |source| SetupError::Listen { flag, addr, source };
        let grpc_at = cfg.fanout.grpc;
        let grpc = tokio::net::TcpListener::bind(grpc_at)
            .await
            .map_err(listen("--grpc", grpc_at))?;
        let grpc_addr = grpc.local_addr().map_err(listen("--grpc", grpc_at))?;
        let metrics_page = match cfg.ops.metrics {
            Some(a) => {
                let l = crate::metrics::bind(a)
                    .await
                    .map_err(listen("--metrics", a))?;
                let at = l.local_addr().map_err(listen("--metrics", a))?;
                Some((l, at))
            }
            None => None,
        };
        Ok(App {
            cfg,
            grpc,
            grpc_addr,
            metrics_page,
        })
    }

    /// Starts every part (see the module doc for the order). On an error, what was started is
    /// stopped again and the rings this start created are removed.
    pub async fn spawn(self) -> Result<Service, SetupError> {
        let cfg = self.cfg;
        for w in &cfg.warnings {
            tracing::warn!("{w}");
        }
        let metrics = Arc::new(Metrics::new());
        let stages = StageMetrics::new(&metrics);
        // Derived from the port actually bound, so that `--grpc …:0` gets a ring of its own.
        let shm = cfg.ring.ring_path(self.grpc_addr.port());
        let opts = WriterOptions {
            capacity: cfg.ring.size as usize,
            seq_base: cfg.ring.seq_base,
            group_read: cfg.ring.group_read,
        };
        let ranks = cfg.ingest.ranks.iter().map(|r| r.rank).collect();
        let per_rank = cfg.fanout.dp_mode == DpMode::Metadata;
        let rings = RingSet::open(&shm, ranks, per_rank, &opts, &stages.ring)?;
        let mut parts = Parts::default();
        let started = self
            .start_parts(&rings, &metrics, &stages, &mut parts)
            .await;
        match started {
            Ok(s) => Ok(Service {
                grpc_addr: s.grpc_addr,
                metrics_addr: s.metrics_addr,
                merged: rings.merged.clone(),
                fanout: s.fanout,
                metrics,
                publish_zmq: s.publish_zmq,
                fatal: s.fatal,
                parts,
                rings,
            }),
            Err(e) => {
                parts.stop_all().await;
                rings.remove_created();
                Err(e)
            }
        }
    }

    /// Parts 1–7 of the module doc, each pushed on `parts` once running.
    async fn start_parts(
        self,
        rings: &RingSet,
        metrics: &Arc<Metrics>,
        stages: &StageMetrics,
        parts: &mut Parts,
    ) -> Result<Started, SetupError> {
        let cfg = self.cfg;
        if cfg.fanout.send_dp_rank && cfg.fanout.dp_mode == DpMode::Merged {
            tracing::warn!(
                "--send-dp-rank: merged batches carry dp_rank; G2 gateways (smg 1.13+) keep a cursor per rank and \
                 will see gaps and spurious restarts on this stream"
            );
        }
        // 1. The rings' heartbeat: liveness for readers, gauges, and the fatal signal.
        let (fatal_tx, fatal) = watch::channel(None);
        let heartbeat_stop = Arc::new(AtomicBool::new(false));
        let heartbeat =
            crate::ring::spawn_heartbeat(rings.hubs(), heartbeat_stop.clone(), fatal_tx);
        parts.started_blocking("ring heartbeat", move || {
            heartbeat_stop.store(true, Ordering::Relaxed);
            let _ = heartbeat.join();
        });
        // 2. The metrics page, up before any traffic (every series is there at zero).
        let upstream = UpstreamState::new(cfg.ingest.ranks.len());
        Ingest::restore_freshness(&cfg.ingest, &rings.recovered, &stages.ingest, &upstream);
        let metrics_addr = self.metrics_page.as_ref().map(|(_, a)| *a);
        if let Some((listener, _)) = self.metrics_page {
            let health_page: crate::metrics::HealthPage = {
                let (upstream, grace) = (upstream.clone(), cfg.ops.health_grace);
                Arc::new(move || upstream.detail_json(grace))
            };
            let task = tokio::spawn(crate::metrics::serve(
                listener,
                metrics.clone(),
                Some(health_page),
            ));
            parts.started("metrics page", move || async move { task.abort() });
        }
        // 3. The NATS sink reads the rings like a subscriber; with --nats-required a NATS
        // set-up failure stops the start here, before ingest.
        if let Some(n) = &cfg.nats {
            let mut n = n.clone();
            let port = self.grpc_addr.port();
            n.worker_id
                .get_or_insert_with(|| crate::sink::default_worker_id(port));
            let sink = Sink::start(&n, rings, metrics).await?;
            parts.started("NATS sink", move || sink.shutdown());
        }
        // 4. Snapshot tables: hooked to their rings before ingest, so they see every record.
        let snapshot = crate::snapshot::start(&cfg.snapshot, rings, metrics);
        let tables = snapshot.tables().to_vec();
        let snapshots = snapshot.snapshots(cfg.snapshot.mode);
        parts.started_blocking("snapshot checkpoints", move || snapshot.shutdown());
        // 5. The engine-wire publisher reads from the rings' newest record on: started before
        // ingest, so that it sees every record published from now.
        let mut publish_zmq = Vec::new();
        if let Some(z) = &cfg.publish_zmq {
            let p = ZmqPublisher::start(z, &cfg.ingest.topic, rings, &tables, metrics)?;
            publish_zmq = p.bound.clone();
            parts.started_blocking("engine-wire publisher", move || p.shutdown());
        }
        // 6. Ingest.
        let ingest = start_ingest(cfg, rings, &stages.ingest, upstream.clone())?;
        parts.started_blocking("ingest", move || ingest.stop());
        // 7. The front door.
        let fanout = FrontDoor {
            cfg,
            listener: self.grpc,
            rings,
            snapshots,
            upstream,
            fanout_metrics: stages.fanout.clone(),
            health_metrics: stages.health.clone(),
            proxy_metrics: stages.proxy.clone(),
        }
        .start(parts)?;
        front_door::announce(cfg, self.grpc_addr, metrics_addr, rings);
        Ok(Started {
            grpc_addr: self.grpc_addr,
            metrics_addr,
            fanout,
            publish_zmq,
            fatal,
        })
    }
}

/// The series of the stages the service itself builds (the edges register their own when they
/// start: `crate::sink`, `crate::snapshot`, `crate::publish_zmq`). Built once, before anything
/// starts, so every one of them exists from start-up, at zero. Sidecar mode's are registered in
/// every mode, so that dashboards need no second variant.
struct StageMetrics {
    ring: RingMetrics,
    ingest: IngestMetrics,
    fanout: Arc<FanoutMetrics>,
    health: HealthMetrics,
    proxy: Arc<ProxyMetrics>,
}

impl StageMetrics {
    fn new(m: &Metrics) -> Self {
        StageMetrics {
            ring: RingMetrics::new(m),
            ingest: IngestMetrics::new(m),
            fanout: Arc::new(FanoutMetrics::new(m)),
            health: HealthMetrics::new(m),
            proxy: Arc::new(ProxyMetrics::new(m)),
        }
    }
}

/// What [`App::start_parts`] hands back to [`App::spawn`].
struct Started {
    grpc_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    fanout: Arc<Fanout>,
    publish_zmq: Vec<crate::publish_zmq::Bound>,
    fatal: watch::Receiver<Option<String>>,
}

/// One ingest thread per DP rank, each publishing into the merged ring and its own.
fn start_ingest(
    cfg: &ServeConfig,
    rings: &RingSet,
    metrics: &IngestMetrics,
    upstream: Arc<UpstreamState>,
) -> Result<Ingest, SetupError> {
    let targets = cfg
        .ingest
        .ranks
        .iter()
        .map(|r| Targets {
            merged: rings.merged.clone(),
            merged_sends_rank: cfg.fanout.send_dp_rank,
            own: rings.rank_hubs.get(r.rank as usize).cloned(),
        })
        .collect();
    let records = DecodeConfig {
        split_threshold: cfg.ring.split_threshold as usize,
        profile: cfg.fanout.profile,
        ..DecodeConfig::default()
    };
    let ingest = Ingest::start(
        &cfg.ingest,
        records,
        targets,
        &rings.recovered,
        metrics,
        upstream,
    )?;
    Ok(ingest)
}

/// A running bridge.
pub struct Service {
    /// Where gRPC is served.
    pub grpc_addr: SocketAddr,
    /// Where metrics are served.
    pub metrics_addr: Option<SocketAddr>,
    /// The merged ring.
    pub merged: Arc<RingHub>,
    /// The fan-out state.
    pub fanout: Arc<Fanout>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// What `--publish-zmq` bound, per rank.
    pub publish_zmq: Vec<crate::publish_zmq::Bound>,
    fatal: watch::Receiver<Option<String>>,
    parts: Parts,
    rings: RingSet,
}

impl Service {
    /// Becomes `Some(reason)` when the bridge can no longer run (a ring file truncated under
    /// it): the owner should then [`shutdown`](Self::shutdown) and exit with an error.
    pub fn failure(&self) -> watch::Receiver<Option<String>> {
        self.fatal.clone()
    }

    /// Stops every part, newest first (see the module doc), then releases the rings.
    pub async fn shutdown(self) {
        self.parts.stop_all().await;
        drop(self.fanout);
        drop(self.merged);
        drop(self.rings);
    }
}

/// Builds and starts the service for `cfg` ([`App::build`], then [`App::spawn`]).
pub async fn run_service(cfg: &ServeConfig) -> Result<Service, SetupError> {
    App::build(cfg).await?.spawn().await
}
