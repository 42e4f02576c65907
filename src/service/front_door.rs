//! The gRPC front door: the fan-out's `SubscribeKvEvents` routes, health, and in sidecar mode
//! the engine's own gRPC server behind the same listener. Started last (everything it serves
//! is running by then), stopped first (load balancers see NOT_SERVING before anything else
//! goes away, and open streams end with `UNAVAILABLE` while the rings are still there).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::parts::Parts;
use super::SetupError;
use crate::config::ServeConfig;
use crate::fanout::{EdgeOptions, Fanout, FanoutMetrics};
use crate::health::{HealthMetrics, UpstreamState};
use crate::proxy::{ProxyMetrics, Sidecar};
use crate::ring::RingSet;
use crate::snapshot::Snapshots;

/// How long open connections get to drain at shutdown before they are closed.
const DRAIN: Duration = Duration::from_secs(5);

/// Time streams get to deliver their `UNAVAILABLE` before connections close.
const LAST_WORDS: Duration = Duration::from_millis(200);

/// What the front door serves.
pub(super) struct FrontDoor<'a> {
    pub cfg: &'a ServeConfig,
    pub listener: tokio::net::TcpListener,
    pub rings: &'a RingSet,
    pub snapshots: Snapshots,
    pub upstream: Arc<UpstreamState>,
    pub fanout_metrics: Arc<FanoutMetrics>,
    pub health_metrics: HealthMetrics,
    pub proxy_metrics: Arc<ProxyMetrics>,
}

impl FrontDoor<'_> {
    /// Starts health, the sidecar (if configured) and the gRPC server, and registers their one
    /// stop with `parts`: health NOT_SERVING, the sidecar's listener closed, streams ended with
    /// `UNAVAILABLE`, connections drained for at most [`DRAIN`].
    pub(super) fn start(self, parts: &mut Parts) -> Result<Arc<Fanout>, SetupError> {
        let FrontDoor {
            cfg,
            listener,
            rings,
            snapshots,
            upstream,
            fanout_metrics,
            health_metrics,
            proxy_metrics,
        } = self;
        let (drain_tx, drain_rx) = watch::channel(false);
        let fanout = Arc::new(
            Fanout::new(
                rings.merged.clone(),
                rings.rank_hubs.clone(),
                fanout_metrics,
                cfg.fanout.max_subscribers,
                drain_rx.clone(),
            )
            .with_snapshots(snapshots)
            .with_linger(cfg.fanout.linger),
        );
        // Sidecar mode: the engine's gRPC server behind the same listener; health then also
        // needs the engine, and subscribers that ask get its load records.
        let sidecar = match &cfg.proxy {
            Some(p) => {
                let s = Sidecar::start(p, proxy_metrics)?;
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
            health_metrics.clone(),
        ));
        let opts = EdgeOptions {
            tls: cfg.security.tls.clone(),
            auth_token: cfg.security.auth_token.clone(),
            max_streams_per_connection: Some(cfg.fanout.max_streams_per_connection),
            handshake_timeout: Some(cfg.fanout.handshake_timeout),
            health: Some(reporter.clone()),
            reload: Some(cfg.security.files.clone()),
        };
        let edge = match crate::fanout::edge(fanout.clone(), &opts) {
            Ok(e) => e,
            Err(e) => {
                health_task.abort();
                return Err(SetupError::Tls(e));
            }
        };
        let server = tokio::spawn(serve(edge, listener, sidecar.clone(), drain_rx));
        let hubs = rings.hubs();
        parts.started("gRPC front door", move || async move {
            // Health first, so that load balancers stop sending new subscribers.
            health_task.abort();
            for svc in std::iter::once("").chain(crate::fanout::service_names()) {
                reporter
                    .set_service_status(svc, tonic_health::ServingStatus::NotServing)
                    .await;
            }
            health_metrics.serving.set(0);
            // A sidecar's listener closes now: new calls are refused at once, not left to
            // wait in the backlog for the drain.
            if let Some(s) = &sidecar {
                s.stop_accepting();
            }
            let _ = drain_tx.send(true);
            for h in &hubs {
                h.wake_all();
            }
            let mut server = server;
            if tokio::time::timeout(DRAIN, &mut server).await.is_err() {
                tracing::warn!("connections did not drain within 5 s; closing them");
                server.abort();
            }
        });
        Ok(fanout)
    }
}

/// Serves `edge` on `listener` (behind the sidecar, when there is one) until `drain` turns true,
/// then gives streams [`LAST_WORDS`] to deliver their `UNAVAILABLE`.
async fn serve(
    edge: crate::fanout::Edge,
    listener: tokio::net::TcpListener,
    sidecar: Option<Arc<Sidecar>>,
    mut drain: watch::Receiver<bool>,
) {
    let stop = async move {
        let _ = drain.wait_for(|v| *v).await;
        tokio::time::sleep(LAST_WORDS).await;
    };
    match sidecar {
        // Sidecar mode: kvbridge's routes for its own paths, the engine for the rest.
        Some(s) => s.serve_edge(edge, listener, stop).await,
        None => edge.serve(listener, stop).await,
    }
}

/// Where the front door listens, for the start-up log line.
pub(super) fn announce(
    cfg: &ServeConfig,
    grpc_addr: SocketAddr,
    metrics: Option<SocketAddr>,
    rings: &RingSet,
) {
    let metrics_url = metrics.map_or_else(|| "off".to_string(), |a| format!("http://{a}/metrics"));
    tracing::info!(%grpc_addr, metrics = %metrics_url, ring = %rings.path().display(),
        ranks = cfg.ingest.ranks.len(), tls = cfg.security.tls.is_some(),
        auth = cfg.security.auth_token.is_some(), "serving SubscribeKvEvents");
}
