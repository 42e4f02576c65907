//! The tonic side: the four generated servers (from `proto/services/`), all delegating to one
//! [`Fanout`], plus the HTTP/2 settings SMG gateways need (docs/smg-api.md §3.1).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use tonic::{Request, Response, Status};

use super::{code_label, EncodedBatch, Fanout, DP_RANK_HEADER};
use crate::proto::common::SubscribeKvEventsRequest;

/// Server code generated with `KvEventBatch` mapped to [`EncodedBatch`] (see `build.rs`).
#[allow(missing_docs, unreachable_pub, clippy::all)]
mod generated {
    pub mod sglang {
        include!(concat!(env!("OUT_DIR"), "/server/sglang.grpc.scheduler.rs"));
    }
    pub mod vllm {
        include!(concat!(env!("OUT_DIR"), "/server/vllm.grpc.engine.rs"));
    }
    pub mod tokenspeed {
        include!(concat!(
            env!("OUT_DIR"),
            "/server/tokenspeed.grpc.scheduler.rs"
        ));
    }
    pub mod trtllm {
        include!(concat!(env!("OUT_DIR"), "/server/trtllm.rs"));
    }
}
use generated::sglang::sglang_scheduler_server::SglangSchedulerServer;
use generated::tokenspeed::token_speed_scheduler_server::TokenSpeedSchedulerServer;
use generated::trtllm::trtllm_service_server::TrtllmServiceServer;
use generated::vllm::vllm_engine_server::VllmEngineServer;
use generated::*;

/// The response stream of every path.
pub(super) type BatchStream =
    Pin<Box<dyn Stream<Item = Result<EncodedBatch, Status>> + Send + 'static>>;

/// One handle per path, so that metrics can tell the paths apart.
#[derive(Clone)]
pub(super) struct PathHandler {
    fanout: Arc<Fanout>,
    path: &'static str,
    secrets: Arc<crate::secrets::Secrets>,
}

/// Compares without an early exit, so response time says nothing about a token's prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether `md` carries exactly one `authorization` header holding `Bearer <want>`. The scheme
/// is matched case-insensitively (RFC 7235 §2.1), the token exactly; a repeated header is
/// refused, since proxies and servers disagree on which copy counts.
fn bearer_ok(md: &tonic::metadata::MetadataMap, want: &[u8]) -> bool {
    let mut values = md.get_all("authorization").iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return false;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let Some((scheme, token)) = value.trim().split_once([' ', '\t']) else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && constant_time_eq(token.trim().as_bytes(), want)
}

impl PathHandler {
    /// `authorization: Bearer <token>` when a token is configured; else `UNAUTHENTICATED`.
    fn check_auth(&self, md: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        // The token current now (it may have been rotated since the bridge started).
        let ok = self
            .secrets
            .with_token(|want| want.is_none_or(|w| bearer_ok(md, w)));
        if ok {
            return Ok(());
        }
        let m = &self.fanout.metrics;
        m.auth_failures.inc();
        m.statuses
            .with_label_values(&[code_label(tonic::Code::Unauthenticated)])
            .inc();
        Err(Status::unauthenticated(
            "missing or wrong bearer token: send metadata `authorization: Bearer <token>`",
        ))
    }

    async fn open(
        &self,
        req: Request<SubscribeKvEventsRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        self.check_auth(req.metadata())?;
        let rank = req
            .metadata()
            .get(DP_RANK_HEADER)
            .map(|v| v.as_bytes().to_vec());
        let start = req.get_ref().start_sequence_number;
        // Request field 2: the client takes snapshot chunks (§6.5) and load records (§3.5).
        let wants_load = req.get_ref().load_records_before_first_batch;
        // A subscriber from 0 may be sent a snapshot, and building one copies the block table
        // (tens of milliseconds for a million blocks, behind any ZMQ replay copying it): that
        // runs on a blocking thread, not on a worker that serves other streams meanwhile.
        let sub = if start == 0 && self.fanout.snapshots().is_some() {
            let (fanout, path) = (self.fanout.clone(), self.path);
            tokio::task::spawn_blocking(move || {
                fanout.subscribe(path, start, rank.as_deref(), wants_load)
            })
            .await
            .map_err(|e| Status::internal(format!("opening the subscription failed: {e}")))??
        } else {
            self.fanout
                .subscribe(self.path, start, rank.as_deref(), wants_load)?
        };
        tracing::debug!(path = self.path, start, "subscription opened");
        let ring_id = super::ring_id_value(sub.ring_id());
        // Everything a delivery touches is resolved once here and moved through the stream's
        // state: no label look-up, no reference-count traffic per delivered batch.
        let state = Delivering {
            latency: self
                .fanout
                .metrics
                .send_latency
                .with_label_values(&[self.path]),
            catchup: self
                .fanout
                .metrics
                .catchup_sends
                .with_label_values(&[self.path]),
            opened_ns: crate::clock::unix_nanos(),
            metrics: self.fanout.metrics.clone(),
            sub,
        };
        let stream = futures_util::stream::unfold(state, |mut st| async move {
            let item = st.sub.next_batch().await?;
            st.account(&item);
            Some((item, st))
        });
        // Load records (sidecar mode) only for clients that accept them (docs/smg-api.md §3.5).
        let mut response = match (wants_load, self.fanout.load_feed.get()) {
            (true, Some(feed)) => Response::new(Box::pin(super::with_load_records(
                Box::pin(stream),
                feed.clone(),
            )) as BatchStream),
            _ => Response::new(Box::pin(stream) as BatchStream),
        };
        // Which ring the numbers belong to: the same id after a kvbridge restart on its ring
        // (a continuation), another after a ring reset (docs/subscribers.md).
        response
            .metadata_mut()
            .insert(super::RING_ID_HEADER, ring_id);
        Ok(response)
    }
}

/// One open stream: its subscription and the metric handles every delivery updates.
struct Delivering {
    sub: super::Subscription,
    metrics: Arc<super::FanoutMetrics>,
    latency: prometheus::Histogram,
    catchup: prometheus::IntCounter,
    /// When the stream opened (Unix ns): records ingested before are catch-up, not live.
    opened_ns: u64,
}

impl Delivering {
    /// Counts a delivered batch (sizes, lag, ingest → hand-off latency) or an ending status.
    fn account(&self, item: &Result<EncodedBatch, Status>) {
        let m = &self.metrics;
        match item {
            Ok(b) => {
                m.batches_sent.inc();
                m.bytes_sent.inc_by(b.0.len() as u64);
                m.subscriber_lag.observe(self.sub.lag() as f64);
                // Live latency only: history a subscriber catches up on (a gateway's resume
                // after a restart) would fill the histogram with the age of the ring instead.
                let t = self.sub.last_ingest_ns();
                if t >= self.opened_ns {
                    let now = crate::clock::unix_nanos();
                    self.latency.observe(now.saturating_sub(t) as f64 * 1e-9);
                } else if t > 0 {
                    self.catchup.inc();
                }
            }
            Err(s) => {
                m.statuses.with_label_values(&[code_label(s.code())]).inc();
                if s.code() == tonic::Code::DataLoss {
                    m.resumes.with_label_values(&["data_loss"]).inc();
                }
            }
        }
    }
}

macro_rules! impl_path {
    ($module:ident :: $server_mod:ident :: $trait_:ident) => {
        #[tonic::async_trait]
        impl $module::$server_mod::$trait_ for PathHandler {
            type SubscribeKvEventsStream = BatchStream;
            async fn subscribe_kv_events(
                &self,
                request: Request<SubscribeKvEventsRequest>,
            ) -> Result<Response<BatchStream>, Status> {
                self.open(request).await
            }
        }
    };
}

impl_path!(sglang::sglang_scheduler_server::SglangScheduler);
impl_path!(vllm::vllm_engine_server::VllmEngine);
impl_path!(tokenspeed::token_speed_scheduler_server::TokenSpeedScheduler);
impl_path!(trtllm::trtllm_service_server::TrtllmService);

/// What the gRPC edge adds around `SubscribeKvEvents`: TLS, a bearer token, the stream limit
/// per connection, the handshake deadline and the health service.
#[derive(Clone, Default)]
pub struct EdgeOptions {
    /// Serve TLS with this certificate chain and key.
    pub tls: Option<crate::secrets::TlsFiles>,
    /// Bearer token required on `SubscribeKvEvents` (health and reflection stay open).
    pub auth_token: Option<String>,
    /// HTTP/2 max concurrent streams per connection (`None`: the transport's default).
    pub max_streams_per_connection: Option<u32>,
    /// Time an accepted connection has to complete TLS and send the HTTP/2 preface and SETTINGS
    /// (`None`: [`super::DEFAULT_HANDSHAKE_TIMEOUT_MS`]).
    pub handshake_timeout: Option<Duration>,
    /// Serve `grpc.health.v1.Health` from this reporter.
    pub health: Option<tonic_health::server::HealthReporter>,
    /// Re-read `tls` and `auth_token` from these files on SIGHUP and when they change
    /// (`crate::secrets`); `None`: they stay as given for the whole run.
    pub reload: Option<crate::secrets::SecretFiles>,
}

/// The fully-qualified names of the four `SubscribeKvEvents` services.
pub fn service_names() -> Vec<&'static str> {
    crate::proto::ENGINE_SERVICES
        .iter()
        .map(|s| s.service)
        .collect()
}

/// The handler for generated server `S`: its path comes from [`crate::proto::ENGINE_SERVICES`],
/// looked up by the generated service name, so the table and the servers cannot disagree.
fn path_of<S: tonic::server::NamedService>() -> &'static str {
    crate::proto::ENGINE_SERVICES
        .iter()
        .find(|s| s.service == S::NAME)
        .map(|s| s.path)
        .unwrap_or_else(|| panic!("{} is missing from ENGINE_SERVICES", S::NAME))
}

/// Generated server `S` around the handler for its own path.
fn with_path<S: tonic::server::NamedService>(
    new: impl FnOnce(PathHandler) -> S,
    handler: &impl Fn(&'static str) -> PathHandler,
) -> S {
    new(handler(path_of::<S>()))
}

/// The gRPC edge, ready to serve: the router and what wraps every accepted connection.
pub struct Edge {
    routes: tonic::service::Routes,
    max_streams: Option<u32>,
    secrets: Arc<crate::secrets::Secrets>,
    reload: Option<crate::secrets::SecretFiles>,
    handshake_timeout: Duration,
    metrics: Arc<super::FanoutMetrics>,
}

/// The gRPC edge serving `SubscribeKvEvents` on all four SMG paths, identically, plus
/// reflection, with TLS, the token, the stream limit, the handshake deadline and health from
/// `opts`. Fails (with a message about the key pair) only when the TLS files are unusable.
pub fn edge(fanout: Arc<Fanout>, opts: &EdgeOptions) -> Result<Edge, String> {
    let tls = opts
        .tls
        .as_ref()
        .map(|t| crate::net::Tls::from_pem(&t.cert, &t.key))
        .transpose()?;
    let handshake_timeout = opts
        .handshake_timeout
        .unwrap_or(Duration::from_millis(super::DEFAULT_HANDSHAKE_TIMEOUT_MS));
    let metrics = fanout.metrics.clone();
    let secrets = Arc::new(crate::secrets::Secrets::new(tls, opts.auth_token.clone()));
    Ok(Edge {
        routes: routes_with(fanout, opts, &secrets),
        max_streams: opts.max_streams_per_connection,
        secrets,
        reload: opts.reload.clone(),
        handshake_timeout,
        metrics,
    })
}

fn routes_with(
    fanout: Arc<Fanout>,
    opts: &EdgeOptions,
    secrets: &Arc<crate::secrets::Secrets>,
) -> tonic::service::Routes {
    let h = |path: &'static str| PathHandler {
        fanout: fanout.clone(),
        path,
        secrets: secrets.clone(),
    };
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection().build_v1().expect("valid descriptor set");
    let v1alpha = reflection().build_v1alpha().expect("valid descriptor set");
    // Records are kept under 4 MiB by the decoder's split threshold; the encode limit is left
    // at tonic's default (unlimited) so a limit here can never turn a valid record into an error.
    let mut routes = tonic::service::Routes::new(with_path(SglangSchedulerServer::new, &h))
        .add_service(with_path(VllmEngineServer::new, &h))
        .add_service(with_path(TokenSpeedSchedulerServer::new, &h))
        .add_service(with_path(TrtllmServiceServer::new, &h))
        .add_service(v1)
        .add_service(v1alpha);
    if let Some(reporter) = &opts.health {
        routes = routes.add_service(tonic_health::pb::health_server::HealthServer::new(
            tonic_health::server::HealthService::from_health_reporter(reporter.clone()),
        ));
    }
    routes
}

/// HTTP/2 keepalive pings kvbridge sends its clients, on the plain server and in sidecar mode
/// alike: SMG pings every 30 s even when idle, so pings are accepted (tonic does not enforce a
/// ping policy), and kvbridge pings its peers too, to reap dead subscriptions.
pub(crate) const CLIENT_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive ping to a client may go unanswered before its connection is dropped.
pub(crate) const CLIENT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Transport settings: the client keepalive above. (Socket options are set on each accepted
/// connection by [`crate::net::tune`].)
fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(CLIENT_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(CLIENT_KEEPALIVE_TIMEOUT))
}

/// What another HTTP/2 server needs to serve the edge on connections of its own: sidecar mode
/// (`crate::proxy`) serves these routes beside the calls it forwards, on its own runtime. The
/// edge does not know that server; the server takes the edge apart ([`Edge::into_parts`]).
pub struct EdgeParts {
    /// kvbridge's own services.
    pub routes: tonic::service::Routes,
    /// HTTP/2 max concurrent streams per connection, as configured (`None`: not given).
    pub max_streams: Option<u32>,
    secrets: Arc<crate::secrets::Secrets>,
    handshake_timeout: Duration,
    metrics: Arc<super::FanoutMetrics>,
    _watcher: Option<AbortOnDrop>,
}

impl EdgeParts {
    /// The accepted connections of `listener`, each under TLS (if on) and the handshake
    /// deadline, exactly as the edge's own server takes them.
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
    ) -> impl Stream<Item = crate::net::EdgeIo> + Send {
        incoming(
            listener,
            self.secrets.clone(),
            self.handshake_timeout,
            &self.metrics,
        )
    }
}

impl Edge {
    /// The edge's parts, for a server that is not tonic's (see [`EdgeParts`]). Starts watching
    /// the TLS and token files (needs a tokio runtime); the watch ends when the parts are dropped.
    pub fn into_parts(self) -> EdgeParts {
        let Edge {
            routes,
            max_streams,
            secrets,
            reload,
            handshake_timeout,
            metrics,
        } = self;
        let _watcher = reload
            .map(|files| AbortOnDrop(tokio::spawn(crate::secrets::watch(secrets.clone(), files))));
        EdgeParts {
            routes,
            max_streams,
            secrets,
            handshake_timeout,
            metrics,
            _watcher,
        }
    }

    /// Serves on an already-bound listener (bound early, so an occupied port is a start-up
    /// error) until `shutdown` resolves. Connections come from our own accept loop
    /// ([`crate::net::Acceptor`]: no spinning when descriptors run out), each wrapped in a
    /// [`crate::net::EdgeIo`] (TLS, handshake deadline).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        let max_streams = self.max_streams;
        let parts = self.into_parts();
        // TLS is not tonic's: it is done per connection by `net::EdgeIo`, under the handshake
        // deadline (tonic's own TLS would hold a silent client's handshake open forever).
        use futures_util::StreamExt;
        let incoming = parts.incoming(listener);
        server_builder()
            .max_concurrent_streams(max_streams)
            .add_routes(parts.routes.clone())
            .serve_with_incoming_shutdown(incoming.map(Ok::<_, std::io::Error>), shutdown)
            .await
    }
}

/// Connections from our own accept loop ([`crate::net::Acceptor`]: no spinning when
/// descriptors run out), each tuned and wrapped in a [`crate::net::EdgeIo`] (TLS, handshake
/// deadline).
fn incoming(
    listener: tokio::net::TcpListener,
    secrets: Arc<crate::secrets::Secrets>,
    handshake_timeout: Duration,
    metrics: &super::FanoutMetrics,
) -> impl Stream<Item = crate::net::EdgeIo> + Send {
    use crate::net::{tune, Acceptor, EdgeIo};
    let acceptor = Acceptor::new(listener, "grpc", metrics.accept_errors.clone());
    let timeouts = metrics.handshake_timeouts.clone();
    futures_util::stream::unfold(acceptor, move |mut acceptor| {
        let (secrets, timeouts) = (secrets.clone(), timeouts.clone());
        async move {
            let sock = acceptor.accept().await;
            tune(&sock);
            // The certificate current at accept time; a later rotation leaves this
            // connection's session alone.
            let tls = secrets.tls();
            let io = EdgeIo::new(sock, tls.as_deref(), handshake_timeout, timeouts);
            Some((io, acceptor))
        }
    })
}

/// Aborts the task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(values: &[&str]) -> tonic::metadata::MetadataMap {
        let mut md = tonic::metadata::MetadataMap::new();
        for v in values {
            md.append("authorization", v.parse().unwrap());
        }
        md
    }

    /// RFC 7235 §2.1: the scheme is case-insensitive; the token is compared exactly.
    #[test]
    fn bearer_scheme_is_case_insensitive_and_the_token_is_not() {
        for ok in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "bEaReR s3cret",
            "Bearer\ts3cret",
            "  Bearer   s3cret  ",
        ] {
            assert!(bearer_ok(&md(&[ok]), b"s3cret"), "{ok:?} refused");
        }
        for bad in [
            "Bearer S3CRET",
            "Bearer s3cre",
            "Bearer s3crett",
            "Bearers3cret",
            "Basic s3cret",
            "s3cret",
            "Bearer",
            "Bearer ",
            "",
        ] {
            assert!(!bearer_ok(&md(&[bad]), b"s3cret"), "{bad:?} accepted");
        }
        assert!(!bearer_ok(&md(&[]), b"s3cret"), "no header accepted");
    }

    /// Two `authorization` headers are refused, even when both (or the first) hold the token.
    #[test]
    fn a_repeated_authorization_header_is_refused() {
        for pair in [
            ["Bearer s3cret", "Bearer s3cret"],
            ["Bearer s3cret", "Bearer other"],
            ["Bearer other", "Bearer s3cret"],
        ] {
            assert!(!bearer_ok(&md(&pair), b"s3cret"), "{pair:?} accepted");
        }
    }

    /// Every generated server has its row in the table, and every row a server.
    #[test]
    fn engine_services_match_the_generated_servers() {
        let paths = [
            path_of::<SglangSchedulerServer<PathHandler>>(),
            path_of::<VllmEngineServer<PathHandler>>(),
            path_of::<TokenSpeedSchedulerServer<PathHandler>>(),
            path_of::<TrtllmServiceServer<PathHandler>>(),
        ];
        for s in crate::proto::ENGINE_SERVICES {
            assert!(paths.contains(&s.path), "{} has no server", s.service);
            assert_eq!(s.path, format!("/{}/SubscribeKvEvents", s.service));
        }
    }
}
