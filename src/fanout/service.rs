//! The gRPC side: `SubscribeKvEvents` on the four SMG paths (from `proto/services/`), all
//! delegating to one [`Fanout`], plus the HTTP/2 settings SMG gateways need (docs/smg-api.md
//! §3.1).
//!
//! Each accepted connection is served by one task (`conn.rs`), which opens every
//! `SubscribeKvEvents` stream itself through [`PathHandler`] (`call.rs`), in sidecar mode too.
//! The tonic routes serve every other path: health, reflection, and `UNIMPLEMENTED` for the
//! engine services' other methods ([`OtherMethods`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;

use super::call::PathHandler;
use super::Fanout;

/// The methods other than `SubscribeKvEvents` of entry `I` of
/// [`crate::proto::ENGINE_SERVICES`], which kvbridge does not serve: one type per service, since
/// the router finds a service by its name. (`SubscribeKvEvents` itself never reaches the routes:
/// the connection opens those streams.)
#[derive(Clone)]
struct OtherMethods<const I: usize>;

impl<const I: usize> tonic::server::NamedService for OtherMethods<I> {
    const NAME: &'static str = crate::proto::ENGINE_SERVICES[I].service;
}

impl<const I: usize> tower::Service<http::Request<tonic::body::Body>> for OtherMethods<I> {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(tonic::Status::unimplemented(format!(
            "{}: kvbridge serves only SubscribeKvEvents",
            req.uri().path()
        ))
        .into_http()))
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
    /// The four `SubscribeKvEvents` handlers every connection serves its streams with.
    streams: Arc<super::conn::Streams>,
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
    let streams = Arc::new(super::conn::Streams {
        subscribe: crate::proto::ENGINE_SERVICES
            .iter()
            .map(|s| PathHandler::new(fanout.clone(), s.path, secrets.clone()))
            .collect(),
    });
    Ok(Edge {
        routes: routes_with(opts),
        streams,
        max_streams: opts.max_streams_per_connection,
        secrets,
        reload: opts.reload.clone(),
        handshake_timeout,
        metrics,
    })
}

/// The routes for every path but `SubscribeKvEvents`: the engine services' other methods,
/// reflection, and health when `opts` has it.
fn routes_with(opts: &EdgeOptions) -> tonic::service::Routes {
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let v1 = reflection().build_v1().expect("valid descriptor set");
    let v1alpha = reflection().build_v1alpha().expect("valid descriptor set");
    let mut routes = tonic::service::Routes::new(OtherMethods::<0>)
        .add_service(OtherMethods::<1>)
        .add_service(OtherMethods::<2>)
        .add_service(OtherMethods::<3>)
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

/// What another HTTP/2 server needs to serve the edge on connections of its own: sidecar mode
/// (`crate::proxy`) serves these routes beside the calls it forwards, on its own runtime. The
/// edge does not know that server; the server takes the edge apart ([`Edge::into_parts`]).
pub struct EdgeParts {
    /// kvbridge's own services.
    pub routes: tonic::service::Routes,
    /// The `SubscribeKvEvents` handlers a connection serves its streams with
    /// ([`super::serve_connection`]).
    pub streams: Arc<super::conn::Streams>,
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
            streams,
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
            streams,
            max_streams,
            secrets,
            handshake_timeout,
            metrics,
            _watcher,
        }
    }

    /// Serves on an already-bound listener (bound early, so an occupied port is a start-up
    /// error) until `shutdown` resolves, then lets open connections finish (each gets a GOAWAY;
    /// the fan-out ends their streams). Connections come from our own accept loop
    /// ([`crate::net::Acceptor`]: no spinning when descriptors run out), each wrapped in a
    /// [`crate::net::EdgeIo`] (TLS, handshake deadline) and served by one task
    /// (`super::conn`: the connection and every stream it carries).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let mut builder = crate::net::h2io::server_builder();
        if let Some(n) = self.max_streams {
            builder.max_concurrent_streams(n);
        }
        let parts = self.into_parts();
        let streams = parts.streams.clone();
        let incoming = parts.incoming(listener);
        let routes = parts.routes.clone();
        crate::net::h2io::serve_connections(incoming, shutdown, |io, stopping| {
            let hold = io.flush_hold();
            super::conn::serve(
                streams.clone(),
                builder.clone(),
                io,
                hold,
                stopping,
                super::conn::Others::routes(routes.clone()),
            )
        })
        .await;
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

    /// The four services are the table's four rows, each serving its own path.
    #[test]
    fn each_service_serves_its_own_row() {
        use tonic::server::NamedService;
        let names = [
            OtherMethods::<0>::NAME,
            OtherMethods::<1>::NAME,
            OtherMethods::<2>::NAME,
            OtherMethods::<3>::NAME,
        ];
        for (i, s) in crate::proto::ENGINE_SERVICES.iter().enumerate() {
            assert_eq!(names[i], s.service);
            assert_eq!(s.path, format!("/{}/SubscribeKvEvents", s.service));
        }
    }
}
