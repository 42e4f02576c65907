//! `kvbridge serve`, and [`run_service`], which `demo` and the tests also use in-process.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_shm::WriterOptions;

use super::CliError;
use crate::config::{DpMode, ServeArgs, ServeConfig};
use crate::fanout::{EdgeOptions, Fanout};
use crate::health::UpstreamState;
use crate::ingest::{Ingest, Targets};
use crate::metrics::Metrics;
use crate::ring::RingHub;

pub(super) fn run(args: ServeArgs) -> Result<(), CliError> {
    let cfg = args.resolve().map_err(|e| CliError::Setup(e.to_string()))?;
    super::init_tracing(cfg.log_format);
    let rt = super::runtime()?;
    rt.block_on(async move {
        let handle = run_service(&cfg).await?;
        wait_for_signal().await;
        tracing::info!("shutting down: stopping ingest, ending streams, releasing the ring");
        handle.shutdown().await;
        Ok(())
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
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
    shutdown_tx: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    health_task: tokio::task::JoinHandle<()>,
    health: tonic_health::server::HealthReporter,
    hubs: Vec<Arc<RingHub>>,
}

impl ServiceHandle {
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
        let ingest = self.ingest;
        let _ = tokio::task::spawn_blocking(move || ingest.stop()).await;
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
        drop(self.fanout);
        drop(self.hubs);
        drop(self.merged);
    }
}

/// Starts the whole bridge for `cfg`: rings, ingest threads, the gRPC server and metrics.
/// Every set-up failure (occupied port, unusable ring path, bad endpoint) is a `Setup` error.
pub async fn run_service(cfg: &ServeConfig) -> Result<ServiceHandle, CliError> {
    let setup = CliError::Setup;
    // Bind first: an occupied port should fail before a ring is touched.
    let listener = tokio::net::TcpListener::bind(cfg.grpc)
        .await
        .map_err(|e| setup(format!("--grpc {}: cannot listen: {e}", cfg.grpc)))?;
    let grpc_addr = listener.local_addr().map_err(|e| setup(e.to_string()))?;
    let metrics_listener = match cfg.metrics {
        Some(a) => Some(
            crate::metrics::bind(a)
                .await
                .map_err(|e| setup(format!("--metrics {a}: cannot listen: {e}")))?,
        ),
        None => None,
    };
    let metrics_addr = metrics_listener.as_ref().and_then(|l| l.local_addr().ok());
    let metrics = Arc::new(Metrics::new());

    let opts = WriterOptions {
        capacity: cfg.ring_size as usize,
        seq_base: cfg.seq_base,
        group_read: cfg.shm_group_read,
    };
    let (merged, recovered) = RingHub::open("merged", &cfg.shm, &opts, &metrics)
        .map_err(|e| setup(format!("--shm: {e}")))?;
    tracing::info!(path = %cfg.shm.display(), adopted = recovered.adopted, window = ?merged.window(), "ring ready");
    let mut rank_hubs = Vec::new();
    if cfg.dp_mode == DpMode::Metadata {
        for r in &cfg.ranks {
            let path = rank_ring_path(&cfg.shm, r.rank);
            let (hub, _) = RingHub::open(&format!("rank-{}", r.rank), &path, &opts, &metrics)
                .map_err(|e| setup(format!("--shm: {e}")))?;
            rank_hubs.push(hub);
        }
    }
    if cfg.send_dp_rank && cfg.dp_mode == DpMode::Merged {
        tracing::warn!(
            "--send-dp-rank: merged batches carry dp_rank; G2 gateways (smg 1.13+) keep a cursor per rank and \
             will see gaps and spurious restarts on this stream"
        );
    }
    let targets = cfg
        .ranks
        .iter()
        .map(|r| Targets {
            merged: merged.clone(),
            merged_sends_rank: cfg.send_dp_rank,
            own: rank_hubs.get(r.rank as usize).cloned(),
        })
        .collect();
    let upstream = UpstreamState::new(cfg.ranks.len());
    let ingest = Ingest::start(
        cfg,
        targets,
        &recovered.last_upstream,
        &metrics,
        upstream.clone(),
    )
    .map_err(|e| setup(e.to_string()))?;

    let mut hubs = vec![merged.clone()];
    hubs.extend(rank_hubs.iter().cloned());
    let heartbeat_stop = Arc::new(AtomicBool::new(false));
    let heartbeat = crate::ring::spawn_heartbeat(hubs.clone(), heartbeat_stop.clone());

    let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
    let fanout = Arc::new(Fanout::new(
        merged.clone(),
        rank_hubs,
        metrics.clone(),
        cfg.max_subscribers,
        shutdown_rx.clone(),
    ));
    let metrics_task =
        metrics_listener.map(|l| tokio::spawn(crate::metrics::serve(l, metrics.clone())));
    let (reporter, _) = tonic_health::server::health_reporter();
    let health_task = tokio::spawn(crate::health::run_reporter(
        reporter.clone(),
        upstream,
        cfg.health_grace,
        crate::fanout::service_names(),
        metrics.clone(),
    ));
    let edge = EdgeOptions {
        tls: cfg.tls.clone(),
        auth_token: cfg.auth_token.clone(),
        max_streams_per_connection: Some(cfg.max_streams_per_connection),
        handshake_timeout: Some(cfg.handshake_timeout),
        health: Some(reporter.clone()),
    };
    let edge = crate::fanout::edge(fanout.clone(), &edge)
        .map_err(|e| setup(format!("--tls-cert/--tls-key: {e}")))?;
    let server = {
        let mut rx = shutdown_rx;
        tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|v| *v).await;
                // Let streams deliver their UNAVAILABLE before connections close.
                tokio::time::sleep(Duration::from_millis(200)).await;
            };
            if let Err(e) = edge.serve(listener, stop).await {
                tracing::error!(error = %e, "gRPC server failed");
            }
        })
    };
    tracing::info!(%grpc_addr, metrics = ?metrics_addr, ranks = cfg.ranks.len(), tls = cfg.tls.is_some(),
        auth = cfg.auth_token.is_some(), "serving SubscribeKvEvents");
    Ok(ServiceHandle {
        grpc_addr,
        metrics_addr,
        merged,
        fanout,
        metrics,
        ingest,
        heartbeat_stop,
        heartbeat,
        shutdown_tx,
        server,
        metrics_task,
        health_task,
        health: reporter,
        hubs,
    })
}

/// The ring file of one rank in `metadata` mode: `<shm>-rank<r>`.
pub(super) fn rank_ring_path(shm: &std::path::Path, rank: u32) -> std::path::PathBuf {
    let mut s = shm.as_os_str().to_owned();
    s.push(format!("-rank{rank}"));
    s.into()
}
