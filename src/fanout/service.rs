//! The gRPC side: `SubscribeKvEvents` on the four SMG paths (from `proto/services/`), all
//! delegating to one [`Fanout`], plus the HTTP/2 settings SMG gateways need (docs/smg-api.md
//! §3.1).
//!
//! The call is served by hand ([`Subscribe`]) rather than by tonic's generated servers, because
//! the response is already on the wire format: every record is one framed gRPC message, and the
//! body (`body.rs`) writes it as it is. The request side is the generated message type,
//! decoded from the one length-prefixed message a server-streaming call carries.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Buf;
use futures_util::Stream;
use http_body_util::BodyExt;
use tonic::Status;

use super::body::{Accounting, Records, RecordsBody};
use super::{Fanout, DP_RANK_HEADER};
use crate::proto::common::SubscribeKvEventsRequest;

/// Most bytes a `SubscribeKvEventsRequest` may take (it is two small fields).
const MAX_REQUEST_BYTES: usize = 64 << 10;

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

/// The one message of a unary request body: `SubscribeKvEventsRequest`, uncompressed (kvbridge
/// announces no request compression, so a compressed one is refused as gRPC says).
async fn read_request(body: tonic::body::Body) -> Result<SubscribeKvEventsRequest, Status> {
    let bytes = http_body_util::Limited::new(body, MAX_REQUEST_BYTES)
        .collect()
        .await
        .map_err(|e| Status::invalid_argument(format!("reading the request failed: {e}")))?
        .to_bytes();
    let mut buf = &bytes[..];
    if buf.len() < crate::ring::GRPC_PREFIX_LEN {
        return Err(Status::internal("Missing request message."));
    }
    let compressed = buf.get_u8();
    let len = buf.get_u32() as usize;
    if compressed != 0 {
        return Err(Status::unimplemented(
            "compressed requests are not supported: send SubscribeKvEventsRequest uncompressed",
        ));
    }
    if buf.len() < len {
        return Err(Status::internal("the request message is truncated"));
    }
    prost::Message::decode(&buf[..len]).map_err(|e| {
        Status::internal(format!(
            "the request is not a SubscribeKvEventsRequest: {e}"
        ))
    })
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
        self.fanout.metrics.auth_failures.inc();
        Err(self.fanout.status(Status::unauthenticated(
            "missing or wrong bearer token: send metadata `authorization: Bearer <token>`",
        )))
    }

    /// One call: the request read and checked, then the response headers and the stream.
    async fn serve(
        self,
        req: http::Request<tonic::body::Body>,
    ) -> http::Response<tonic::body::Body> {
        if req.uri().path() != self.path {
            return Status::unimplemented(format!(
                "{}: kvbridge serves only SubscribeKvEvents",
                req.uri().path()
            ))
            .into_http();
        }
        let (parts, body) = req.into_parts();
        // Counted on its connection while it streams: a connection carrying several streams
        // combines their writes (`crate::net::EdgeConnInfo`).
        let on_conn = parts
            .extensions
            .get::<crate::net::EdgeConnInfo>()
            .map(|c| c.stream_opened());
        let md = tonic::metadata::MetadataMap::from_headers(parts.headers);
        let opened = match self.check_auth(&md) {
            Ok(()) => match read_request(body).await {
                Ok(msg) => self.open(&md, msg).await,
                Err(s) => Err(self.fanout.status(s)),
            },
            Err(s) => Err(s),
        };
        let (records, ring_id) = match opened {
            Ok(o) => o,
            Err(s) => return s.into_http(),
        };
        let acct = Accounting {
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
        };
        let body = RecordsBody::new(records, self.fanout.linger, acct, on_conn);
        let mut response = http::Response::new(tonic::body::Body::new(body));
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        // Which ring the numbers belong to: the same id after a kvbridge restart on its ring
        // (a continuation), another after a ring reset (docs/subscribers.md).
        headers.insert(super::RING_ID_HEADER, ring_id);
        response
    }

    /// Opens the subscription: its records (with load records if asked for and available)
    /// and the id of the ring they come from.
    async fn open(
        &self,
        md: &tonic::metadata::MetadataMap,
        req: SubscribeKvEventsRequest,
    ) -> Result<(Records, http::HeaderValue), Status> {
        let rank = md.get(DP_RANK_HEADER).map(|v| v.as_bytes().to_vec());
        let start = req.start_sequence_number;
        // Request field 2: the client takes snapshot chunks (§6.5) and load records (§3.5).
        let wants_load = req.load_records_before_first_batch;
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
        let stream = futures_util::stream::unfold(sub, |mut sub| async move {
            let item = sub.next_batch().await?;
            Some((item, sub))
        });
        // Load records (sidecar mode) only for clients that accept them (docs/smg-api.md §3.5).
        let records: Records = match (wants_load, self.fanout.load_feed.get()) {
            (true, Some(feed)) => {
                Box::pin(super::with_load_records(Box::pin(stream), feed.clone()))
            }
            _ => Box::pin(stream),
        };
        Ok((records, ring_id))
    }
}

/// `SubscribeKvEvents` of entry `I` of [`crate::proto::ENGINE_SERVICES`]: one type per service,
/// since the router finds a service by its name.
#[derive(Clone)]
struct Subscribe<const I: usize>(PathHandler);

impl<const I: usize> tonic::server::NamedService for Subscribe<I> {
    const NAME: &'static str = crate::proto::ENGINE_SERVICES[I].service;
}

impl<const I: usize> tower::Service<http::Request<tonic::body::Body>> for Subscribe<I> {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Infallible>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let handler = self.0.clone();
        Box::pin(async move { Ok(handler.serve(req).await) })
    }
}

impl<const I: usize> Subscribe<I> {
    fn new(handler: &impl Fn(&'static str) -> PathHandler) -> Self {
        Subscribe(handler(crate::proto::ENGINE_SERVICES[I].path))
    }
}

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
    let mut routes = tonic::service::Routes::new(Subscribe::<0>::new(&h))
        .add_service(Subscribe::<1>::new(&h))
        .add_service(Subscribe::<2>::new(&h))
        .add_service(Subscribe::<3>::new(&h))
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

    /// The four services are the table's four rows, each serving its own path.
    #[test]
    fn each_service_serves_its_own_row() {
        use tonic::server::NamedService;
        let names = [
            Subscribe::<0>::NAME,
            Subscribe::<1>::NAME,
            Subscribe::<2>::NAME,
            Subscribe::<3>::NAME,
        ];
        for (i, s) in crate::proto::ENGINE_SERVICES.iter().enumerate() {
            assert_eq!(names[i], s.service);
            assert_eq!(s.path, format!("/{}/SubscribeKvEvents", s.service));
        }
    }
}
