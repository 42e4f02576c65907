//! `kvbridge serve`, and [`run_service`], which `demo` and the tests also use in-process.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_shm::WriterOptions;

use super::CliError;
use crate::config::{ServeArgs, ServeConfig};
use crate::decode::DecodeConfig;
use crate::fanout::{DpMode, EdgeOptions, Fanout};
use crate::health::UpstreamState;
use crate::ingest::{Ingest, Targets};
use crate::metrics::Metrics;
use crate::ring::RingHub;

pub(super) fn run(args: ServeArgs) -> Result<(), CliError> {
    let cfg = args.resolve().map_err(|e| CliError::Setup(e.to_string()))?;
    super::init_tracing(cfg.ops.log_format);
    let rt = super::runtime()?;
    rt.block_on(async move {
        // Before anything starts: a SIGTERM during start-up still means a clean stop.
        let mut stop = StopSignals::install()?;
        // One left by an earlier run must not pass for this one's.
        if let Some(path) = &cfg.ops.ready_file {
            remove_ready_file(path);
        }
        let handle = run_service(&cfg).await?;
        let ready = match &cfg.ops.ready_file {
            Some(path) => match write_ready_file(path, &handle) {
                Ok(()) => Some(path.clone()),
                Err(e) => {
                    handle.shutdown().await;
                    return Err(CliError::Setup(format!(
                        "--ready-file {}: {e}",
                        path.display()
                    )));
                }
            },
            None => None,
        };
        let mut fatal = handle.failure();
        let failed = tokio::select! {
            _ = stop.recv() => None,
            f = fatal.wait_for(Option::is_some) => Some(match f {
                Ok(f) => f.clone().unwrap_or_default(),
                Err(_) => "the ring heartbeat thread ended unexpectedly".to_string(),
            }),
        };
        match &failed {
            None => {
                tracing::info!("shutting down: stopping ingest, ending streams, releasing the ring")
            }
            Some(why) => tracing::error!("shutting down after a fatal ring error: {why}"),
        }
        // Not ready any more from the moment shutting down begins.
        if let Some(path) = &ready {
            remove_ready_file(path);
        }
        handle.shutdown().await;
        match failed {
            None => Ok(()),
            Some(why) => Err(CliError::Failed(why)),
        }
    })
}

/// Writes `--ready-file`: the addresses as bound, as one JSON object, through a temporary file
/// in the same directory renamed over `path`, so that a reader sees the whole file or none.
fn write_ready_file(path: &std::path::Path, h: &ServiceHandle) -> std::io::Result<()> {
    let publish_zmq: Vec<serde_json::Value> = h
        .zmq_publisher
        .iter()
        .flat_map(|z| &z.bound)
        .map(|(rank, publish, replay)| {
            serde_json::json!({ "rank": rank, "publish": publish, "replay": replay })
        })
        .collect();
    let text = serde_json::json!({
        "pid": std::process::id(),
        "grpc": h.grpc_addr.to_string(),
        "metrics": h.metrics_addr.map(|a| a.to_string()),
        "publish_zmq": publish_zmq,
    })
    .to_string();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = std::path::PathBuf::from(tmp);
    let written = std::fs::write(&tmp, text + "\n").and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Removes `--ready-file` (nothing to do when it is not there).
fn remove_ready_file(path: &std::path::Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove the ready file")
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), caught from the moment they are installed.
pub struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    /// Installs the handlers (needs a running tokio runtime).
    pub fn install() -> Result<Self, CliError> {
        use tokio::signal::unix::{signal, SignalKind};
        let install = |kind| {
            signal(kind)
                .map_err(|e| CliError::Setup(format!("cannot install a signal handler: {e}")))
        };
        Ok(StopSignals {
            term: install(SignalKind::terminate())?,
            int: install(SignalKind::interrupt())?,
        })
    }

    /// Waits for either signal.
    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// A running bridge.
pub struct ServiceHandle {
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
    ingest: Ingest,
    heartbeat_stop: Arc<AtomicBool>,
    heartbeat: std::thread::JoinHandle<()>,
    fatal: tokio::sync::watch::Receiver<Option<String>>,
    shutdown_tx: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    health_task: tokio::task::JoinHandle<()>,
    health: tonic_health::server::HealthReporter,
    hubs: Vec<Arc<RingHub>>,
    /// The NATS JetStream sink, when `--nats` is given.
    sink: Option<crate::sink::Sink>,
    checkpointer: Option<std::thread::JoinHandle<()>>,
    /// Sidecar mode: told to stop accepting at the start of a shutdown.
    sidecar: Option<Arc<crate::proxy::Sidecar>>,
    /// The engine-wire ZMQ edge, when `--publish-zmq` is given.
    zmq_publisher: Option<crate::publish_zmq::ZmqPublisher>,
}

impl ServiceHandle {
    /// Becomes `Some(reason)` when the bridge can no longer run (a ring file truncated under
    /// it): the owner should then [`shutdown`](Self::shutdown) and exit with an error.
    pub fn failure(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.fatal.clone()
    }

    /// Stops ingest, ends every stream with `UNAVAILABLE`, stops the server (waiting at most 5 s
    /// for connections to drain) and releases the ring writer.
    pub async fn shutdown(self) {
        // Health first, so that load balancers stop sending new subscribers.
        self.health_task.abort();
        for svc in std::iter::once("").chain(crate::fanout::service_names()) {
            self.health
                .set_service_status(svc, tonic_health::ServingStatus::NotServing)
                .await;
        }
        self.metrics.health_serving.set(0);
        // A sidecar's listener closes now: new calls are refused at once, not left to wait in
        // the backlog for the drain (open streams drain as below).
        if let Some(s) = &self.sidecar {
            s.stop_accepting();
        }
        let ingest = self.ingest;
        let _ = tokio::task::spawn_blocking(move || ingest.stop()).await;
        // The sink after ingest: what was committed is published (bounded wait for its acks).
        if let Some(sink) = self.sink {
            sink.shutdown().await;
        }
        if let Some(z) = self.zmq_publisher {
            let _ = tokio::task::spawn_blocking(move || z.shutdown()).await;
        }
        let _ = self.shutdown_tx.send(true);
        for h in &self.hubs {
            h.wake_all();
        }
        let mut server = self.server;
        if tokio::time::timeout(Duration::from_secs(5), &mut server)
            .await
            .is_err()
        {
            tracing::warn!("connections did not drain within 5 s; closing them");
            server.abort();
        }
        if let Some(t) = self.metrics_task {
            t.abort();
        }
        self.heartbeat_stop.store(true, Ordering::SeqCst);
        let _ = self.heartbeat.join();
        if let Some(c) = self.checkpointer {
            c.thread().unpark();
            let _ = c.join(); // writes the last checkpoint
        }
        drop(self.fanout);
        drop(self.hubs);
        drop(self.merged);
    }
}

/// Starts the whole bridge for `cfg`: rings, ingest threads, the gRPC server and metrics.
/// Every set-up failure (occupied port, unusable ring path, bad endpoint) is a `Setup` error.
pub async fn run_service(cfg: &ServeConfig) -> Result<ServiceHandle, CliError> {
    let setup = CliError::Setup;
    for w in &cfg.warnings {
        tracing::warn!("{w}");
    }
    // Bind first: an occupied port should fail before a ring is touched.
    let listener = tokio::net::TcpListener::bind(cfg.streaming.grpc)
        .await
        .map_err(|e| setup(format!("--grpc {}: cannot listen: {e}", cfg.streaming.grpc)))?;
    let grpc_addr = listener.local_addr().map_err(|e| setup(e.to_string()))?;
    let metrics_listener = match cfg.ops.metrics {
        Some(a) => Some(
            crate::metrics::bind(a)
                .await
                .map_err(|e| setup(format!("--metrics {a}: cannot listen: {e}")))?,
        ),
        None => None,
    };
    let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    // Derived from the port actually bound, so that `--grpc …:0` gets a ring of its own too.
    let shm = cfg.ring.ring_path(grpc_addr.port());
    remove_stale_ring_files(&shm);
    // Rings this start creates (rather than adopts) are removed again, with their wake files,
    // if the start fails after creating them: a failed start leaves nothing in /dev/shm.
    let mut created = Vec::new();
    let started = start_on_rings(
        cfg,
        &shm,
        listener,
        grpc_addr,
        metrics_listener,
        metrics_addr,
        &mut created,
    )
    .await;
    if started.is_err() {
        for path in &created {
            if let Err(e) = crate::ring::RingFiles::new(path).remove() {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove the ring this failed start created");
            }
        }
    }
    started
}

/// The rest of [`run_service`]: rings (each one created rather than adopted is added to
/// `created`), ingest, the gRPC server and metrics.
async fn start_on_rings(
    cfg: &ServeConfig,
    shm: &std::path::Path,
    listener: tokio::net::TcpListener,
    grpc_addr: SocketAddr,
    metrics_listener: Option<tokio::net::TcpListener>,
    metrics_addr: Option<SocketAddr>,
    created: &mut Vec<std::path::PathBuf>,
) -> Result<ServiceHandle, CliError> {
    let setup = CliError::Setup;
    let metrics = Arc::new(Metrics::new());
    let opts = WriterOptions {
        capacity: cfg.ring.size as usize,
        seq_base: cfg.ring.seq_base,
        group_read: cfg.ring.group_read,
    };
    let (merged, recovered) =
        RingHub::open("merged", shm, &opts, &metrics).map_err(|e| setup(format!("--shm: {e}")))?;
    if !recovered.adopted {
        created.push(shm.to_path_buf());
    }
    tracing::info!(path = %shm.display(), adopted = recovered.adopted, window = ?merged.window(), "ring ready");
    let mut rank_hubs = Vec::new();
    let mut rank_adopted = Vec::new();
    if cfg.streaming.dp_mode == DpMode::Metadata {
        for r in &cfg.ingest.ranks {
            let path = crate::ring::RingFiles::rank(shm, r.rank)
                .path()
                .to_path_buf();
            let (hub, rec) = RingHub::open(&format!("rank-{}", r.rank), &path, &opts, &metrics)
                .map_err(|e| setup(format!("--shm: {e}")))?;
            if !rec.adopted {
                created.push(path);
            }
            rank_adopted.push(rec.adopted);
            rank_hubs.push(hub);
        }
    }
    if cfg.streaming.send_dp_rank && cfg.streaming.dp_mode == DpMode::Merged {
        tracing::warn!(
            "--send-dp-rank: merged batches carry dp_rank; G2 gateways (smg 1.13+) keep a cursor per rank and \
             will see gaps and spurious restarts on this stream"
        );
    }
    // The NATS sink reads the rings like a subscriber; it starts before ingest so that, with
    // --nats-required, a NATS set-up failure (unreachable, stream mismatch) stops the start
    // cleanly. Without it, `start` returns at once and the sink sets itself up in the background.
    let sink = match &cfg.nats {
        Some(n) => {
            let mut rings = vec![("merged".to_string(), merged.clone())];
            for (hub, r) in rank_hubs.iter().zip(&cfg.ingest.ranks) {
                rings.push((r.rank.to_string(), hub.clone()));
            }
            Some(
                crate::sink::Sink::start(n, grpc_addr.port(), rings, &metrics)
                    .await
                    .map_err(|e| setup(e.to_string()))?,
            )
        }
        None => None,
    };
    // Snapshot tables: attached before ingest starts, so they see every record.
    let snapshot_tables = attach_snapshot_tables(
        cfg,
        shm,
        &merged,
        &rank_hubs,
        recovered.adopted,
        &rank_adopted,
        &metrics,
    );
    // The ZMQ edge reads the rings from their newest record on: bound and started before
    // ingest, so that it sees every record published from now.
    let zmq_publisher = match &cfg.publish_zmq {
        Some(z) => Some(start_zmq_publisher(
            z,
            cfg,
            &merged,
            &rank_hubs,
            &snapshot_tables,
            &metrics,
        )?),
        None => None,
    };
    let targets = cfg
        .ingest
        .ranks
        .iter()
        .map(|r| Targets {
            merged: merged.clone(),
            merged_sends_rank: cfg.streaming.send_dp_rank,
            own: rank_hubs.get(r.rank as usize).cloned(),
        })
        .collect();
    let upstream = UpstreamState::new(cfg.ingest.ranks.len());
    let records = DecodeConfig {
        split_threshold: cfg.ring.split_threshold as usize,
        profile: cfg.streaming.profile,
        ..DecodeConfig::default()
    };
    let ingest = Ingest::start(
        &cfg.ingest,
        records,
        targets,
        &recovered,
        &metrics,
        upstream.clone(),
    )
    .map_err(|e| setup(e.to_string()))?;

    let mut hubs = vec![merged.clone()];
    hubs.extend(rank_hubs.iter().cloned());
    let heartbeat_stop = Arc::new(AtomicBool::new(false));
    let (fatal_tx, fatal) = tokio::sync::watch::channel(None);
    let heartbeat = crate::ring::spawn_heartbeat(hubs.clone(), heartbeat_stop.clone(), fatal_tx);
    let checkpointer = (!snapshot_tables.is_empty()).then(|| {
        crate::snapshot::spawn_checkpointer(snapshot_tables.clone(), heartbeat_stop.clone())
    });

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let fanout = Arc::new(
        Fanout::new(
            merged.clone(),
            rank_hubs,
            metrics.clone(),
            cfg.streaming.max_subscribers,
            shutdown_rx.clone(),
        )
        .with_snapshots(crate::snapshot::Snapshots::new(
            cfg.snapshot.mode,
            snapshot_tables,
        )),
    );
    let health_page: crate::metrics::HealthPage = {
        let upstream = upstream.clone();
        let grace = cfg.ops.health_grace;
        Arc::new(move || upstream.detail_json(grace))
    };
    let metrics_task = metrics_listener
        .map(|l| tokio::spawn(crate::metrics::serve(l, metrics.clone(), Some(health_page))));
    // Sidecar mode: the engine's gRPC server behind the same listener; health then
    // also needs the engine, and subscribers that ask get its load records.
    let sidecar = match &cfg.proxy {
        Some(p) => {
            let s = crate::proxy::Sidecar::start(p, metrics.clone()).map_err(setup)?;
            upstream.gate_on_engine(s.engine_answers());
            if let Some(feed) = s.load_feed() {
                fanout.attach_load_feed(feed);
            }
            Some(s)
        }
        None => None,
    };
    let (reporter, _) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(crate::health::run_reporter(
        reporter.clone(),
        upstream,
        cfg.ops.health_grace,
        crate::fanout::service_names(),
        metrics.clone(),
    ));
    let edge = EdgeOptions {
        tls: cfg.security.tls.clone(),
        auth_token: cfg.security.auth_token.clone(),
        max_streams_per_connection: Some(cfg.streaming.max_streams_per_connection),
        handshake_timeout: Some(cfg.streaming.handshake_timeout),
        health: Some(reporter.clone()),
        reload: Some(cfg.security.files.clone()),
    };
    let edge = crate::fanout::edge(fanout.clone(), &edge)
        .map_err(|e| setup(format!("--tls-cert/--tls-key: {e}")))?;
    let server = {
        let mut rx = shutdown_rx;
        let sidecar = sidecar.clone();
        tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|v| *v).await;
                // Let streams deliver their UNAVAILABLE before connections close.
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            match sidecar {
                // Sidecar mode: kvbridge's routes for its own paths, the engine for the rest.
                Some(s) => s.serve_edge(edge, listener, stop).await,
                None => {
                    if let Err(e) = edge.serve(listener, stop).await {
                        tracing::error!(error = %e, "gRPC server failed");
                    }
                }
            }
        })
    };
    let metrics_url =
        metrics_addr.map_or_else(|| "off".to_string(), |a| format!("http://{a}/metrics"));
    tracing::info!(%grpc_addr, metrics = %metrics_url, ring = %shm.display(), ranks = cfg.ingest.ranks.len(),
        tls = cfg.security.tls.is_some(), auth = cfg.security.auth_token.is_some(), "serving SubscribeKvEvents");
    Ok(ServiceHandle {
        grpc_addr,
        metrics_addr,
        merged,
        fanout,
        metrics,
        ingest,
        heartbeat_stop,
        heartbeat,
        fatal,
        shutdown_tx,
        server,
        metrics_task,
        health_task,
        health: reporter,
        hubs,
        sink,
        checkpointer,
        sidecar,
        zmq_publisher,
    })
}

/// The ZMQ edge on each rank's ring (the merged ring when there is a single rank and no rank
/// rings), with the ring's snapshot table.
fn start_zmq_publisher(
    z: &crate::publish_zmq::PublishZmqConfig,
    cfg: &ServeConfig,
    merged: &Arc<RingHub>,
    rank_hubs: &[Arc<RingHub>],
    tables: &[Arc<crate::snapshot::RingTable>],
    metrics: &Metrics,
) -> Result<crate::publish_zmq::ZmqPublisher, CliError> {
    use crate::publish_zmq::RankSource;
    let sources = if rank_hubs.is_empty() {
        let rank = cfg.ingest.ranks.first().map_or(0, |r| r.rank);
        vec![RankSource {
            rank,
            hub: merged.clone(),
            table: tables.first().cloned(),
        }]
    } else {
        rank_hubs
            .iter()
            .zip(&cfg.ingest.ranks)
            .enumerate()
            .map(|(i, (hub, r))| RankSource {
                rank: r.rank,
                hub: hub.clone(),
                table: tables.get(i + 1).cloned(),
            })
            .collect()
    };
    crate::publish_zmq::ZmqPublisher::start(z, &cfg.ingest.topic, sources, metrics)
        .map_err(|e| CliError::Setup(e.to_string()))
}

/// One snapshot table per ring (none with `--snapshot off`), restored from its checkpoint and
/// hooked to its ring.
fn attach_snapshot_tables(
    cfg: &ServeConfig,
    shm: &std::path::Path,
    merged: &Arc<RingHub>,
    rank_hubs: &[Arc<RingHub>],
    merged_adopted: bool,
    rank_adopted: &[bool],
    metrics: &Metrics,
) -> Vec<Arc<crate::snapshot::RingTable>> {
    use crate::snapshot::{RingTable, SnapshotMetrics, SnapshotMode};
    if cfg.snapshot.mode == SnapshotMode::Off {
        return Vec::new();
    }
    let m = SnapshotMetrics::new(metrics);
    let all_ranks: Vec<u32> = cfg.ingest.ranks.iter().map(|r| r.rank).collect();
    let mut tables = vec![RingTable::attach(
        merged,
        shm,
        merged_adopted,
        None,
        &all_ranks,
        &cfg.snapshot,
        m.clone(),
    )];
    for (r, hub) in rank_hubs.iter().enumerate() {
        let path = crate::ring::RingFiles::rank(shm, r as u32)
            .path()
            .to_path_buf();
        let adopted = rank_adopted.get(r).copied().unwrap_or(false);
        tables.push(RingTable::attach(
            hub,
            &path,
            adopted,
            Some(r as i32),
            &[r as u32],
            &cfg.snapshot,
            m.clone(),
        ));
    }
    tables
}

/// Removes leftovers of this bridge's rings from earlier runs (see
/// [`kvbridge_shm::remove_stale_files`]): a `.wake` file whose ring was removed, a ring file a
/// crashed writer was still creating. Covers the merged ring `<shm>` and every per-rank ring
/// `<shm>-rank<r>` found beside it (ranks of earlier runs included). Runs before any ring is
/// opened.
fn remove_stale_ring_files(shm: &std::path::Path) {
    let rings = crate::ring::RingFiles::with_rank_rings_beside(shm);
    for ring in rings {
        match ring.remove_stale() {
            Ok(removed) => {
                for f in removed {
                    tracing::info!(path = %f.path.display(), reason = f.reason, "removed a stale ring file");
                }
            }
            Err(e) => {
                tracing::warn!(ring = %ring.path().display(), error = %e, "cannot look for stale ring files")
            }
        }
    }
}
